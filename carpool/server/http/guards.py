"""What every HTTP front checks before a route runs: the body size limit and, when
set, the API key. Light on purpose: ``carpool serve --replicas``' front imports it
without loading any model code."""

from __future__ import annotations

from fastapi import FastAPI

from carpool.server.http.auth import APIKeyAuth
from carpool.server.http.limits import BodySizeLimit


def guard(app: FastAPI, *, max_body_bytes: int, api_key: str) -> None:
    """Refuse bodies over ``max_body_bytes`` (413) and, with ``api_key``, unauthorised
    requests (401) before any route runs."""
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key:
        # Added last, so it runs first: an unauthorised body is never read.
        app.add_middleware(APIKeyAuth, api_key=api_key)
