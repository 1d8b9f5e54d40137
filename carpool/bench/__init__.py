"""``carpool bench``: load, metrics and figures for any OpenAI-compatible server."""
