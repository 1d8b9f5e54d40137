"""carpool's version (the package's and the servers' metadata)."""

__version__ = "0.1.0"
