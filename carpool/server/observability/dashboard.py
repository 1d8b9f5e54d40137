"""The live dashboard: ``GET /dashboard`` (one static page and its assets, uPlot
vendored, nothing fetched from elsewhere) and ``GET /dashboard/stats`` (the live
statistics it polls once a second; behind ``--api-key`` when one is set, while the
page and its assets stay open: they hold no data)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

from carpool.server.observability.live import LiveStats, Reading
from carpool.server.registry.served import ServedModels
from carpool.stats import RuntimeStats

ASSETS = "/dashboard/assets"


def static_dir() -> Path:
    return Path(str(files("carpool.server.observability") / "static"))


def reading(models: ServedModels) -> Reading:
    """Snapshots of every served model's statistics."""
    engines = {g.name: g.engine.worker for g in models.generators}
    batched = {m.name: m.batcher.stats for m in models.batched()}
    return Reading(
        engines={name: e.stats.snapshot() for name, e in engines.items()},
        block_sizes={name: e.block_size for name, e in engines.items()},
        batchers={name: stats.snapshot() for name, stats in batched.items()},
        serials={
            **{name: e.stats.serial for name, e in engines.items()},
            **{name: stats.serial for name, stats in batched.items()},
        },
    )


def install(app: FastAPI, models: ServedModels, runtime: RuntimeStats | None) -> None:
    live = LiveStats(lambda: reading(models), runtime)
    router = APIRouter()

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(static_dir() / "dashboard.html", media_type="text/html")

    @router.get("/dashboard/stats")
    async def stats() -> dict[str, Any]:
        """Live statistics of every model and of the device runtime (the dashboard's
        data): series over the last two minutes, percentiles over the last one."""
        return live.view()

    app.include_router(router)
    app.mount(ASSETS, StaticFiles(directory=static_dir()), name="dashboard-assets")
