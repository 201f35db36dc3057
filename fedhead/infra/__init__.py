"""Infrastructure every layer uses and that knows nothing of federated learning: one-line errors and exits,
atomic files, locks, signals, consoles, devices and declared parameters."""
