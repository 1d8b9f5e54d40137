"""The error a repository model's configuration or loading raises."""

from __future__ import annotations


class RepositoryError(Exception):
    """A model in the repository cannot be loaded: its config names something carpool
    does not support, is malformed, or its code failed to import or initialise. The
    message names the model and the field."""
