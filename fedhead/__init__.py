"""fedhead: federated fine-tuning of linear heads on frozen foundation-model features."""

__version__ = "0.1.0"
