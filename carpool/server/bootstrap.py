"""Assembling a running server from a config: models, runtime, batchers, app."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from sse_starlette.sse import AppStatus

from carpool.batching import DynamicBatcher
from carpool.config import CarpoolConfig
from carpool.engine.async_engine import AsyncEngine, EngineWorker
from carpool.engine.model_runner import engine_for
from carpool.faults import FaultPlan, FaultyBatchModel, FaultyCausalLM
from carpool.models import registry
from carpool.models.causal_lm import LoadedLM
from carpool.models.openmp import release_thread_team
from carpool.models.registry import LoadOptions, Task
from carpool.runtime import DeviceRuntime
from carpool.server.app import create_app
from carpool.server.drain import Drain
from carpool.server.served import ServedEmbedding, ServedGenerator, ServedModels

log = logging.getLogger("carpool")


@dataclass
class ServerBundle:
    """Everything a running server holds."""

    config: CarpoolConfig
    models: ServedModels
    runtime: DeviceRuntime = field(init=False)
    exit_code: int = 0
    drain: Drain = field(init=False, repr=False)
    _server: uvicorn.Server | None = field(default=None, repr=False)
    _drain_task: asyncio.Future[None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.runtime = DeviceRuntime(on_death=self.on_runtime_death)

    def on_runtime_death(self, exc: BaseException) -> None:
        """The runtime thread died: exit non-zero so a supervisor restarts us (on Ray
        Serve, the replica's health check fails and Ray replaces it)."""
        log.critical("device runtime died (%s); shutting down", type(exc).__name__)
        self.exit_code = 1
        if self._server is not None:
            self._server.should_exit = True

    def create_app(self) -> FastAPI:
        """The HTTP app over this bundle's models and runtime."""
        return create_app(
            self.models,
            is_ready=lambda: self.runtime.alive,
            max_body_bytes=self.config.server.max_body_bytes,
            api_key=self.config.server.api_key,
            runtime_stats=self.runtime.stats,
        )

    async def run(self, sock: socket.socket, ready_line: str) -> None:
        self.drain = Drain(self.create_app())
        uv_config = uvicorn.Config(
            self.drain,
            log_level=self.config.server.log_level,
            access_log=self.config.server.log_level == "debug",
            timeout_graceful_shutdown=1,
        )
        # sse-starlette cuts every open stream on SIGTERM by default; we drain them.
        AppStatus.disable_automatic_graceful_drain()
        self._server = uvicorn.Server(uv_config)
        serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not serving.done():
            await asyncio.sleep(0.01)
        if self._server.started:
            self._take_signals(asyncio.get_running_loop())
            log.info(ready_line)
        await serving

    def _take_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """Replace uvicorn's SIGTERM/SIGINT handlers with our drain: keep listening
        (new requests get 503), let the requests in flight finish, then stop."""

        def handler(signum: int, _frame: object) -> None:
            loop.call_soon_threadsafe(self.begin_drain, signal.Signals(signum).name)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, handler)

    def begin_drain(self, reason: str) -> None:
        server = self._server
        if server is None:
            return
        if self.drain.draining:  # a second signal: stop now
            server.should_exit = server.force_exit = True
            return
        self.drain.draining = True
        timeout = self.config.server.shutdown_timeout_s
        log.info(
            "%s: draining %d requests in flight (up to %.0fs)",
            reason,
            self.drain.in_flight,
            timeout,
        )
        self._drain_task = asyncio.ensure_future(self._finish_drain(server, timeout))

    async def _finish_drain(self, server: uvicorn.Server, timeout_s: float) -> None:
        if not await self.drain.idle(timeout_s):
            log.warning(
                "shutdown timeout: %d requests still in flight are cut", self.drain.in_flight
            )
        server.should_exit = True


def build_server(config: CarpoolConfig) -> ServerBundle:
    """Load every model and register it with a fresh (started) device runtime."""
    if config.runtime.threads:
        import torch

        torch.set_num_threads(config.runtime.threads)
    options = LoadOptions(
        device=config.runtime.device,
        dtype=config.engine.dtype,
        cache_dir=Path(config.runtime.cache_dir) if config.runtime.cache_dir else None,
        weight_kernel=config.engine.weight_kernel,
    )
    faults = (
        FaultPlan.parse(config.runtime.fault_injection) if config.runtime.fault_injection else None
    )
    served: list[ServedEmbedding] = []
    generators: list[ServedGenerator] = []
    for spec in config.server.models:
        source = registry.resolve(spec)
        log.info("loading %s (%s) from %s", source.name, source.task.value, source.path)
        model = registry.load(source, options)
        if faults is not None:
            model = _with_faults(model, source.task, faults)
        if source.task is Task.GENERATE:
            generators.append(_generator(source.name, model, config))
        else:
            batcher = DynamicBatcher(source.name, model, config.batching_for(source.name))
            served.append(ServedEmbedding(source.name, model, batcher))
    bundle = ServerBundle(config, ServedModels(served, generators))
    for s in served:
        bundle.runtime.register(s.batcher)
    for g in generators:
        bundle.runtime.register(g.engine.worker)
    bundle.runtime.start()
    # The models run on the runtime thread from now on: this thread's OpenMP team
    # (made while loading) would only make libgomp throttle the runtime's.
    release_thread_team()
    return bundle


def _with_faults(model: Any, task: Task, plan: FaultPlan) -> Any:
    log.warning("fault injection is on: %s", plan)
    if task is Task.GENERATE:
        model.model = FaultyCausalLM(model.model, plan)
        return model
    return FaultyBatchModel(model, plan)


def _generator(name: str, lm: LoadedLM, config: CarpoolConfig) -> ServedGenerator:
    cache_dir = Path(config.runtime.cache_dir) if config.runtime.cache_dir else None
    engine = engine_for(lm, config.engine, cache_dir=cache_dir)
    log.info(
        "%s: %d KV blocks of %d tokens (%s), max_model_len %d",
        name,
        engine.blocks.num_blocks,
        engine.blocks.block_size,
        config.engine.kv_cache_memory,
        engine.max_model_len,
    )
    worker = EngineWorker(engine, name)
    return ServedGenerator(
        name,
        lm,
        AsyncEngine(worker, max_waiting=config.engine.max_waiting_requests),
        default_timeout_s=config.engine.request_timeout_s,
    )
