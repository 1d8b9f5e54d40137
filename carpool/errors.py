"""The typed error hierarchy. ``server/errors.py`` maps each class to an HTTP status
in one place; the core raises these and never thinks about HTTP."""

from __future__ import annotations


class CarpoolError(Exception):
    """Base of every error carpool reports to a client.

    ``message`` is safe to show a client: it never holds a stack trace.
    ``param`` names the offending request field where there is one.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(CarpoolError):
    """The request itself is wrong (bad value, empty input, too long)."""


class RequestTooLarge(InvalidRequest):
    """The request asks for more than the server ever takes in one request (more
    inputs or prompts than a per-request limit): retrying cannot help."""


class ModelNotFound(CarpoolError):
    """The request names a model that is not served."""


class Unauthorized(CarpoolError):
    """Missing or wrong API key."""


class Overloaded(CarpoolError):
    """The server refuses the request now; the client may retry after ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueTimeout(CarpoolError):
    """The request waited past its deadline and never ran."""


class ModelExecutionError(CarpoolError):
    """The model failed on this request. The message is short; the log has the trace."""


class BatchFailed(ModelExecutionError):
    """The model failed as a whole on a batch (it hung past its execution timeout, or
    its worker process died): every request in the batch fails, none is retried."""


class ModelUnavailable(Overloaded):
    """The model is loaded but takes no requests now (unloading, or marked unready
    after it hung); retrying later may find it back."""


class ServerShuttingDown(Overloaded):
    """The server is draining and takes no new work."""


class RuntimeDead(CarpoolError):
    """The device runtime has stopped; nothing can run."""


class ReplicaFailed(CarpoolError):
    """The replica running this request died before answering it whole (replicas on
    Ray Serve); the request did not complete and may be sent again."""
