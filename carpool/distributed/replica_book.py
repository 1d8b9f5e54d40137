"""Which replicas of a deployment this process's router last saw running, for the
ingress in the same process to address each by name.

Its own module because Ray Serve copies a request router's module by value into the
process that runs it: state kept there would be a copy the ingress never sees. The
router writes (from Ray Serve's router thread), the ingress reads (from its event loop);
each write replaces a whole tuple under the lock.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_replicas: dict[str, tuple[str, ...]] = {}


def deployment_key(app: str, deployment: str) -> str:
    """How the book names a deployment of an application."""
    return f"{app}/{deployment}"


def publish(deployment: str, replicas: tuple[str, ...]) -> None:
    """``deployment``'s running replicas (full id strings) are now ``replicas``."""
    with _lock:
        _replicas[deployment] = replicas


def known_replicas(deployment: str) -> tuple[str, ...]:
    """The replicas last published for ``deployment``; empty before any."""
    with _lock:
        return _replicas.get(deployment, ())
