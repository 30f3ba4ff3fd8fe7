"""headatlas library: corpus → windows → model with hooks → per-head statistics → storage."""

__version__ = "0.1.0"
