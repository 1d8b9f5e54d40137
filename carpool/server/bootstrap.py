"""Assembling a running server from a config: models, runtime, batchers, app."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from sse_starlette.sse import AppStatus

from carpool.batching import DynamicBatcher
from carpool.config import CarpoolConfig, ConfigError, ServerConfig
from carpool.engine.async_engine import AsyncEngine, EngineWorker, GenerationWorker
from carpool.engine.block_manager import HybridBlockManager
from carpool.engine.engine import Engine
from carpool.engine.engine_process import EngineClient
from carpool.errors import CarpoolError
from carpool.models import registry
from carpool.models.causal_lm import LoadedLM, ModelFacts, customize_tokenizer
from carpool.models.generation_defaults import read_generation_defaults
from carpool.models.openmp import release_thread_team
from carpool.models.registry import LoadOptions, Task
from carpool.repository.errors import RepositoryError
from carpool.repository.function_model import InProcessModel
from carpool.repository.repository import ModelRepository
from carpool.repository.vllm_model import VllmModel
from carpool.runtime import DeviceRuntime
from carpool.server.http.app import create_app
from carpool.server.http.drain import DrainingServer
from carpool.server.kserve import v2_grpc
from carpool.server.observability import metrics
from carpool.server.registry import heap
from carpool.server.registry.model_control import ModelControl
from carpool.server.registry.served import Builtin, ServedEmbedding, ServedGenerator, ServedModels
from carpool.workers.factory import engine_for

log = logging.getLogger("carpool")


@dataclass
class ServerBundle:
    """Everything a running server holds."""

    config: CarpoolConfig
    models: ServedModels
    loaders: dict[str, Callable[[], Builtin]] = field(default_factory=dict)
    runtime: DeviceRuntime = field(init=False)
    control: ModelControl = field(init=False)
    exit_code: int = 0
    _server: DrainingServer | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.runtime = DeviceRuntime(on_death=self.on_runtime_death)
        repo = self.config.repository
        repository = (
            ModelRepository(
                Path(repo.model_repository),
                self.config.runtime.device,
                execution_timeout_s=repo.model_execution_timeout_s,
                isolation=repo.model_isolation,
                auto_complete=not repo.disable_auto_complete_config,
            )
            if repo.model_repository
            else None
        )
        self.control = ModelControl(
            repository,
            repo,
            self.models,
            self.runtime,
            builtins=self.loaders,
            llm_loader=functools.partial(_repository_llm, self.config, self.on_runtime_death),
        )

    def on_runtime_death(self, exc: BaseException) -> None:
        """The runtime thread (or an engine process) died: exit non-zero so a
        supervisor restarts us (on Ray Serve, the replica's health check fails and Ray
        replaces it); not ready from now on."""
        reason = str(exc) or "the device runtime died"
        log.critical("%s (%s); shutting down", reason, type(exc).__name__)
        self.exit_code = 1
        if self._server is not None:
            self._server.stop()

    def _is_ready(self) -> bool:
        return self.runtime.alive and self.exit_code == 0

    def create_app(self) -> FastAPI:
        """The HTTP app over this bundle's models and runtime."""
        return create_app(
            self.models,
            is_ready=self._is_ready,
            max_body_bytes=self.config.server.max_body_bytes,
            api_key=self.config.server.api_key,
            runtime_stats=self.runtime.stats,
            control=self.control,
        )

    def close(self) -> None:
        """After serving: stop the runtime (failing whatever is left), then release
        the repository models (``finalize``, ``teardown``) within the shutdown
        timeout."""
        self.runtime.stop()
        self.control.finalize_all(self.config.server.shutdown_timeout_s)

    async def run(
        self, sock: socket.socket, ready_line: str, metrics_sock: socket.socket | None = None
    ) -> None:
        """Serve the app on ``sock`` (``GET /metrics`` alone on ``metrics_sock``, and
        the gRPC service on its port) until a signal's drain (or the runtime's death)
        ends it. A gRPC port that cannot be bound is a failed start (exit code 1), as
        an HTTP one is."""
        # sse-starlette cuts every open stream on SIGTERM by default; we drain them.
        AppStatus.disable_automatic_graceful_drain()
        server = self.config.server
        grpc_server = None
        if server.grpc_port:
            try:
                grpc_server, port = await v2_grpc.start(
                    v2_grpc.InferenceService(
                        self.models, self._is_ready, self.control, server.api_key
                    ),
                    server.host,
                    server.grpc_port,
                    server.max_body_bytes,
                )
            except OSError as exc:
                log.error("cannot bind gRPC %s:%d: %s", server.host, server.grpc_port, exc)
                self.exit_code = 1
                return
            ready_line += f"; gRPC on {server.host}:{port}"
        app: Any = self.create_app()
        socks = [sock]
        if metrics_sock is not None:
            metrics_port = metrics_sock.getsockname()[1]
            app = metrics.MetricsPortOnly(app, metrics_port)
            socks.append(metrics_sock)
            ready_line += f"; metrics on http://{server.host}:{metrics_port}/metrics"
        stopping: list[asyncio.Future[None]] = []

        def stop_grpc() -> None:
            if grpc_server is not None and not stopping:
                stopping.append(asyncio.ensure_future(_stop_grpc(grpc_server, server)))

        self._server = DrainingServer(
            app,
            log_level=server.log_level,
            timeout_s=server.shutdown_timeout_s,
            on_drain=stop_grpc,
        )
        try:
            await self._server.serve(socks, ready_line)
        finally:
            stop_grpc()
            await asyncio.gather(*stopping)


async def _stop_grpc(grpc_server: Any, server: ServerConfig) -> None:
    """From the drain on, new gRPC calls are refused (UNAVAILABLE) and the calls in
    flight finish, within the shutdown timeout, as HTTP's do."""
    stopped = asyncio.ensure_future(grpc_server.stop(server.shutdown_timeout_s))
    await asyncio.sleep(0)  # its first step stops the server taking calls
    log.info("gRPC: no new calls taken; the calls in flight finish")
    await stopped


def build_server(config: CarpoolConfig, functions: Sequence[InProcessModel] = ()) -> ServerBundle:
    """Load every model (and ``functions``, from ``carpool.serve``) and register it
    with a fresh (started) device runtime. ``config``'s device-dependent defaults are
    decided here, once (``CarpoolConfig.resolved``)."""
    config = config.resolved()
    _set_torch_threads(config)
    bundles: list[ServerBundle] = []  # the one below, once built

    def on_engine_death(exc: BaseException) -> None:
        if bundles:
            bundles[0].on_runtime_death(exc)

    loaders = {
        source.name: _loader(source, config, on_engine_death)
        for source in served_sources(config.server)
    }
    built = [load() for load in loaders.values()]
    served = [m for m in built if isinstance(m, ServedEmbedding)]
    generators = [m for m in built if isinstance(m, ServedGenerator)]
    models = ServedModels(served, generators, aliases=model_aliases(config.server))
    bundle = ServerBundle(config, models, loaders)
    bundles.append(bundle)
    bundle.control.load_at_start(bundle.control.initial_models(config.repository))
    for function in functions:
        bundle.control.install_function(function)
    for s in served:
        bundle.runtime.register(s.batcher)
    for g in generators:
        bundle.runtime.register(g.engine.worker)
    bundle.runtime.start()
    # The models run on the runtime thread from now on: this thread's OpenMP team
    # (made while loading) would only make libgomp throttle the runtime's.
    release_thread_team()
    heap.settle()
    return bundle


def model_aliases(server: ServerConfig) -> dict[str, str]:
    """vLLM's ``--served-model-name a b`` for one model: it is served as ``a`` and
    answers to ``b`` too (alias -> name)."""
    names = server.served_model_name
    if len(server.models) != 1 or len(names) < 2:
        return {}
    return {alias: names[0] for alias in names[1:]}


def served_sources(server: ServerConfig) -> list[registry.ModelSource]:
    """Each ``--model``'s files, under its ``--served-model-name`` where one is given
    (one model's further names are aliases: ``model_aliases``)."""
    sources = [registry.resolve(spec) for spec in server.models]
    names = list(server.served_model_name)[: len(sources)]
    renamed = [
        dataclasses.replace(s, name=names[i]) if i < len(names) else s
        for i, s in enumerate(sources)
    ]
    seen = [s.name for s in renamed]
    if len(set(seen)) != len(seen):
        raise ConfigError(f"two models would be served under one name: {seen}")
    return renamed


def _loader(
    source: registry.ModelSource,
    config: CarpoolConfig,
    on_engine_death: Callable[[BaseException], None],
) -> Callable[[], Builtin]:
    """Loads the ``--model`` ``source`` afresh on each call (at start, and when model
    control loads it again after an unload). With ``--engine-process`` a generation
    model loads in its engine's process; ``on_engine_death`` hears if that dies."""

    def load() -> Builtin:
        if source.task is Task.GENERATE and config.runtime.engine_process:
            build = functools.partial(build_engine, source, config)
            client = EngineClient(
                build, source.name, log_level=config.server.log_level, on_death=on_engine_death
            )
            return _served_generator(source.name, client.facts.model, client, config)
        model = load_model(source, config)
        if source.task is Task.GENERATE:
            engine = _engine(source.name, model, config)
            return _served_generator(source.name, model, EngineWorker(engine, source.name), config)
        batcher = DynamicBatcher(source.name, model, config.batching_for(source.name))
        return ServedEmbedding(source.name, model, batcher)

    return load


def _repository_llm(
    config: CarpoolConfig,
    on_engine_death: Callable[[BaseException], None],
    name: str,
    vllm: VllmModel,
) -> Callable[[], Builtin]:
    """Loads an LLM folder of the repository (Triton's vLLM backend layout) as a
    generation model named ``name``: its ``model.json``'s model, with its engine
    arguments over the server's engine config."""
    try:
        source = dataclasses.replace(registry.resolve(vllm.model), name=name)
        engine = dataclasses.replace(config.engine, **vllm.engine)
        engine = engine.for_device(config.runtime.device)
    except (CarpoolError, ConfigError, ValueError, OSError) as exc:
        raise RepositoryError(f"model '{name}': {exc}") from None
    if source.task is not Task.GENERATE:
        raise RepositoryError(f"model '{name}': {vllm.model} is not a text generation model")
    if vllm.ignored:
        log.info(
            "model %s: engine arguments without effect here: %s", name, ", ".join(vllm.ignored)
        )
    return _loader(source, dataclasses.replace(config, engine=engine), on_engine_death)


def _set_torch_threads(config: CarpoolConfig) -> None:
    if config.runtime.threads:
        import torch

        torch.set_num_threads(config.runtime.threads)


def load_model(source: registry.ModelSource, config: CarpoolConfig) -> Any:
    """The one place a served model is loaded (in the server's process, an engine
    process or a replica): the reliability tests wrap it (``tests/faults.py``)."""
    options = LoadOptions(
        device=config.runtime.device,
        dtype=config.engine.dtype,
        cache_dir=Path(config.runtime.cache_dir) if config.runtime.cache_dir else None,
        weight_kernel=config.engine.weight_kernel,
    )
    log.info("loading %s (%s) from %s", source.name, source.task.value, source.path)
    model = registry.load(source, options)
    if source.task is Task.GENERATE:
        customize_tokenizer(model, config.server.tokenizer, config.server.chat_template)
    return model


def build_engine(source: registry.ModelSource, config: CarpoolConfig) -> tuple[ModelFacts, Engine]:
    """In an engine process (``--engine-process``): load the generation model
    ``source`` and build its engine; what the server needs of the model beside it."""
    _set_torch_threads(config)
    lm = load_model(source, config)
    return lm.facts(), _engine(source.name, lm, config)


def _engine(name: str, lm: LoadedLM, config: CarpoolConfig) -> Engine:
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
    if isinstance(engine.blocks, HybridBlockManager):
        log.info(
            "%s: %d more KV blocks for the layers with a %d-token window, freed behind it",
            name,
            engine.blocks.windowed.num_blocks,
            engine.blocks.windowed.window,
        )
    return engine


def _served_generator(
    name: str, lm: LoadedLM | ModelFacts, worker: GenerationWorker, config: CarpoolConfig
) -> ServedGenerator:
    return ServedGenerator(
        name,
        lm,
        AsyncEngine(worker, max_waiting=config.engine.max_waiting_requests),
        default_timeout_s=config.engine.request_timeout_s,
        reasoning_parser=config.server.reasoning_parser or None,
        generation_defaults=sampling_defaults(lm, config.server.generation_config),
    )


def sampling_defaults(lm: LoadedLM | ModelFacts, generation_config: str) -> dict[str, Any]:
    """The sampling defaults ``--generation-config`` chooses: the model's own (auto),
    none (vllm), or a folder's ``generation_config.json``."""
    if generation_config == "auto":
        return dict(lm.generation_defaults)
    if generation_config == "vllm":
        return {}
    folder = Path(generation_config)
    if not (folder / "generation_config.json").is_file():
        raise ConfigError(
            f"--generation-config {generation_config!r}: no generation_config.json there "
            "(give auto, vllm or such a folder)"
        )
    return read_generation_defaults(folder)
