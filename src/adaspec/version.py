"""The package version (kept low, so that every module may read it)."""

__version__ = "0.1.0"
