"""The federation: one experiment's configuration, the round loop, its transports and the run directory it
writes."""
