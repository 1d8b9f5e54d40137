"""``carpool serve --replicas``' HTTP front, in the launching process: uvicorn serving
``Ingress`` over the replicas' deployment handle (Ray Serve's request router runs in
this process, inside the handle). One Ray hop per request instead of the two that Ray
Serve's proxy and an ingress deployment make, and carpool's own listening socket,
body limit, API key and drain.
"""

from __future__ import annotations

import socket

from fastapi import FastAPI, Request, Response

from carpool.config import CarpoolConfig
from carpool.distributed.ingress import Ingress
from carpool.server.http import errors
from carpool.server.http.drain import DrainingServer
from carpool.server.http.guards import guard
from carpool.version import __version__

METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


def front_app(ingress: Ingress, config: CarpoolConfig) -> FastAPI:
    """/health and /metrics from every replica; everything else to one replica."""
    # The replicas serve their own /docs and /openapi.json; the front forwards them.
    app = FastAPI(
        title="carpool", version=__version__, docs_url=None, redoc_url=None, openapi_url=None
    )
    errors.install(app)
    guard(app, max_body_bytes=config.server.max_body_bytes, api_key=config.server.api_key)

    @app.get("/health")
    async def health() -> Response:
        return await ingress.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await ingress.metrics()

    @app.api_route("/{path:path}", methods=METHODS)
    async def forward(request: Request) -> Response:
        return await ingress.forward(request)

    return app


async def serve_front(
    app: FastAPI, sock: socket.socket, ready_line: str, config: CarpoolConfig
) -> None:
    """Serve ``app`` on ``sock`` until SIGTERM or SIGINT, then drain as one carpool
    process does (``DrainingServer``)."""
    server = config.server
    front = DrainingServer(app, log_level=server.log_level, timeout_s=server.shutdown_timeout_s)
    await front.serve([sock], ready_line)
