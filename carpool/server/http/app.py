"""The FastAPI application: routes, error handling, limits, health and metrics."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response

from carpool.server.anthropic import messages_routes
from carpool.server.http import errors
from carpool.server.http.awaiting import ClientDisconnected
from carpool.server.http.guards import guard
from carpool.server.kserve import generate_routes, repository_routes, v2_routes
from carpool.server.observability import dashboard, metrics
from carpool.server.openai import generation_routes, openai_routes, tokens_routes
from carpool.server.registry.model_control import ModelControl
from carpool.server.registry.served import ServedModels
from carpool.server.responses import responses_routes
from carpool.server.responses.response_store import ResponseStore
from carpool.server.tasks import task_routes
from carpool.server.tei import tei_routes
from carpool.server.tgi import tgi_routes
from carpool.stats import RuntimeStats
from carpool.version import __version__


def create_app(
    models: ServedModels,
    *,
    is_ready: Callable[[], bool],
    max_body_bytes: int,
    api_key: str = "",
    runtime_stats: RuntimeStats | None = None,
    control: ModelControl | None = None,
) -> FastAPI:
    """The ASGI app serving ``models``; ``is_ready`` says whether the runtime is alive;
    ``runtime_stats`` are the device runtime's (its choice of model, in /metrics and
    the dashboard); ``control`` loads and unloads repository models (and, in poll
    mode, follows the repository while the app runs)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        poller = None
        if control is not None and control.mode == "poll":
            poller = asyncio.create_task(control.poll())
        yield
        if poller is not None:
            poller.cancel()

    app = FastAPI(
        title="carpool",
        version=__version__,
        lifespan=lifespan,
        **_no_telemetry(),
    )
    errors.install(app)
    guard(app, max_body_bytes=max_body_bytes, api_key=api_key)
    app.router.routes[:0] = v2_routes.infer_routes(models, is_ready)  # first: matched at once
    app.include_router(openai_routes.router(models))
    app.include_router(generation_routes.router(models))
    app.include_router(tokens_routes.router(models))
    app.include_router(responses_routes.router(models, ResponseStore()))
    app.include_router(messages_routes.router(models))
    app.include_router(v2_routes.router(models, is_ready))
    app.include_router(generate_routes.router(models))
    app.include_router(task_routes.router(models))
    app.include_router(tgi_routes.router(models))
    app.include_router(tei_routes.router(models))
    if control is not None:
        app.include_router(repository_routes.router(control))
    dashboard.install(app, models, runtime_stats)
    collectors = [
        metrics.BatcherCollector(models),
        metrics.EngineCollector(models),
        metrics.ProcessCollector(),
    ]
    if runtime_stats is not None:
        collectors.append(metrics.RuntimeCollector(runtime_stats))
    registry = metrics.make_registry(collectors)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_request: object, _exc: ClientDisconnected) -> Response:
        # Nobody is listening; 499 (nginx's "client closed request") lands in the log only.
        return Response(status_code=499)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if is_ready() else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        custom = b""
        if models.user_models:  # their workers are asked off the event loop
            custom = await asyncio.to_thread(metrics.user_metrics_text, models)
        return Response(metrics.render(registry) + custom, media_type=metrics.CONTENT_TYPE)

    return app


def _no_telemetry() -> dict[str, Any]:
    """FastAPI's built-in OpenTelemetry off, where this FastAPI has it: its per-request
    check for a configured provider cost ~6% of the event loop's time under load, and
    carpool's metrics are Prometheus'."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
