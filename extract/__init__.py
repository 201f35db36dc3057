"""Extraction stage: frozen encoders, dataset loaders and the HDF5 feature store."""
