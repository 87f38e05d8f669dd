"""commweave: co-design computation and communication for multi-GPU programs."""

__version__ = "0.1.0"
