"""The kvrig release (kept apart so that no module has to import the package root for it)."""

__version__ = "0.1.0"
