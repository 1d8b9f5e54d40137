"""The listening socket, bound before the server starts (so ``--port 0`` is known
before the ready line)."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``; raises ``OSError`` if it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY only on accepted sockets that
    # say so, and without it every response's header/body pair waits ~40 ms on Nagle.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
