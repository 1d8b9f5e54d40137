"""carpool: an inference server in which requests share the ride."""

__version__ = "0.1.0"
