"""``carpool serve --replicas``' HTTP front, in the launching process: uvicorn serving
``Ingress`` over the replicas' deployment handle (Ray Serve's request router runs in
this process, inside the handle). One Ray hop per request instead of the two that Ray
Serve's proxy and an ingress deployment make, and carpool's own listening socket,
body limit, API key and drain.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvicorn
from fastapi import FastAPI, Request, Response

from carpool import __version__
from carpool.config import CarpoolConfig
from carpool.distributed.ingress import Ingress
from carpool.server import errors
from carpool.server.drain import Drain
from carpool.server.guards import guard

log = logging.getLogger("carpool")

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
    """Serve ``app`` on ``sock`` until SIGTERM or SIGINT, then drain: new requests get
    503 with Retry-After while those in flight, streams included, finish (up to
    ``shutdown_timeout_s``)."""
    drain = Drain(app)
    server = uvicorn.Server(
        uvicorn.Config(
            drain,
            log_level=config.server.log_level,
            access_log=config.server.log_level == "debug",
            timeout_graceful_shutdown=1,
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if not server.started:
        await serving
        return
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def handler(signum: int, _frame: object) -> None:
        loop.call_soon_threadsafe(stop.set)
        log.info("%s: draining %d requests in flight", signal.Signals(signum).name, drain.in_flight)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)
    log.info(ready_line)
    await asyncio.wait([serving, asyncio.ensure_future(stop.wait())], return_when="FIRST_COMPLETED")
    drain.draining = True
    if not await drain.idle(config.server.shutdown_timeout_s):
        log.warning("shutdown timeout: %d requests still in flight are cut", drain.in_flight)
    server.should_exit = True
    await serving
