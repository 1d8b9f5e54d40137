"""Model control (Triton's repository extension): which models are served, loading
and unloading them while the server runs.

Owned by the event loop. Two kinds of model are controlled: the repository's, and
the built-in ones named by ``--model`` (an LLM, an embedder), each reloaded from its
source. Loading reads and initialises a model on a worker thread, then hands its
batchers (or engine) to the device runtime; a load that fails leaves nothing behind
and every other model serving. Unloading refuses new requests (503 + Retry-After),
lets those in flight finish, takes the model off the runtime, then frees it (a
repository model's code is finalised); after that the model is gone (404).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool.batching import DynamicBatcher
from carpool.config import RepositoryConfig
from carpool.engine.async_engine import GenerationWorker
from carpool.errors import InvalidRequest, ModelExecutionError, ModelNotFound, ModelUnavailable
from carpool.repository.bls import Arrays
from carpool.repository.errors import RepositoryError
from carpool.repository.function_model import InProcessModel
from carpool.repository.payload import TensorPayload
from carpool.repository.repository import LoadedVersion, ModelRepository
from carpool.repository.spec import ModelSpec, check_inputs
from carpool.repository.user_model import UserBatchModel
from carpool.repository.vllm_model import VllmModel, read_model_json
from carpool.runtime import DeviceRuntime
from carpool.server.kserve.v2_models import BUILTIN_VERSION
from carpool.server.registry import heap
from carpool.server.registry.served import Builtin, ServedGenerator, ServedModels
from carpool.server.registry.served_ensemble import ServedEnsemble
from carpool.server.registry.served_user import ModelState, ServedUserModel

log = logging.getLogger(__name__)

# Loads an LLM folder's model (name, its model.json) afresh on each call.
LlmLoader = Callable[[str, VllmModel], Callable[[], Builtin]]


@dataclass(frozen=True)
class LoadedLlm:
    """An LLM folder (Triton's vLLM backend layout) loaded as a generation model, and
    how to load it again."""

    served: Builtin
    load: Callable[[], Builtin]


# What loading a repository model gives: its versions, an ensemble's spec, or an LLM.
Loaded = list[LoadedVersion] | ModelSpec | LoadedLlm


@dataclass(frozen=True)
class IndexEntry:
    """One row of the repository index."""

    name: str
    version: str
    state: str
    reason: str


class ModelControl:
    """Loads and unloads models into ``models`` and ``runtime``: the repository's,
    and the built-in ones ``builtins`` loads (name -> a function loading it afresh)."""

    def __init__(
        self,
        repository: ModelRepository | None,
        config: RepositoryConfig,
        models: ServedModels,
        runtime: DeviceRuntime,
        builtins: dict[str, Callable[[], Builtin]] | None = None,
        llm_loader: LlmLoader | None = None,
    ) -> None:
        self.repository = repository
        self.mode = config.model_control_mode
        self.timeout_s = config.model_execution_timeout_s
        self.poll_s = config.repository_poll_secs
        self._models = models
        self._runtime = runtime
        self._builtins = dict(builtins or {})
        self._llm_loader = llm_loader
        self._failures: dict[str, str] = {}
        self._stamps: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        if repository is not None:
            repository.call_model = self._call_model

    # --- start-up (before the event loop serves) -----------------------------------

    def initial_models(self, config: RepositoryConfig) -> list[str]:
        """The models to load at start: all of them, or explicit mode's list."""
        if self.repository is None:
            return []
        if self.mode != "explicit":
            return self.repository.names()
        if "*" in config.load_model:
            return self.repository.names()
        known = set(self.repository.names())
        unknown = [n for n in config.load_model if n not in known]
        if unknown:
            raise RepositoryError(f"--load-model names '{unknown[0]}', which the repository lacks")
        return list(config.load_model)

    def load_at_start(self, names: list[str]) -> None:
        """Load ``names`` before serving; a model that fails is logged, left out and
        shown in the index with its reason (as Triton does); the others serve."""
        for name in names:
            try:
                self._install(name, self._read_and_load(name))
            except RepositoryError as exc:
                self._failures[name] = str(exc)
                log.error("model %s failed to load: %s", name, exc)

    def install_function(self, function: InProcessModel) -> None:
        """Serve a ``carpool.batched`` function or a ``LitAPI`` instance in this
        process (before serving; not unloadable)."""
        spec = function.spec
        model = UserBatchModel(
            spec, [function.backend()], spec.execution_timeout_s or self.timeout_s
        )
        self._install(spec.name, [LoadedVersion(spec, model)])

    def finalize_all(self, timeout_s: float) -> None:
        """At shutdown, after the drain and with the runtime stopped: release every
        repository model's instances (their ``finalize`` / ``teardown``) at once, each
        model within ``timeout_s`` (a worker that overruns is killed, an in-process
        finalize left on its daemon thread). Any thread; returns within about
        ``timeout_s``."""
        versions = [v for m in self._models.user_models.values() for v in m.versions.values()]
        if not versions:
            return
        with ThreadPoolExecutor(len(versions), thread_name_prefix="carpool-finalize") as pool:
            for version in versions:
                pool.submit(version.model.finalize, timeout_s)
        log.info("repository models finalized: %s", ", ".join(v.name for v in versions))

    # --- the repository API (event loop) ------------------------------------------

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model in the repository and every built-in one (loaded or not), and
        every one served, with its state."""
        names = set(self.repository.names()) if self.repository else set()
        names |= set(self._models.user_models) | set(self._models.ensembles) | set(self._builtins)
        entries = []
        for name in sorted(names):
            served = self._models.user_models.get(name)
            ensemble = self._models.ensemble(name)
            if ensemble is not None:
                own = str(ensemble.spec.version)
                entries.append(IndexEntry(name, own, ensemble.state.value, ""))
            elif name in self._builtins and self._models.builtin(name) is not None:
                closing = self._models.is_closing(name)
                now = ModelState.UNLOADING if closing else ModelState.READY
                entries.append(IndexEntry(name, BUILTIN_VERSION, now.value, ""))
            elif served is not None:
                for version in sorted(served.versions):
                    entries.append(IndexEntry(name, str(version), served.state.value, ""))
            elif not ready_only:
                reason = self._failures.get(name, "unloaded")
                entries.append(IndexEntry(name, "", ModelState.UNAVAILABLE.value, reason))
        if ready_only:
            entries = [e for e in entries if e.state == ModelState.READY.value]
        return entries

    async def load(self, name: str) -> None:
        """Load (or reload) ``name``; ``InvalidRequest`` if it cannot be loaded. A
        built-in model already loaded stays as it is (its source does not change)."""
        self._require_explicit("load", name)
        async with self._lock(name):
            if name in self._builtins:
                await self._load_builtin(name)
            else:
                await self._load(name)

    async def unload(self, name: str) -> None:
        """Drain and unload ``name``; ``ModelNotFound`` if it is not loaded."""
        self._require_explicit("unload", name)
        async with self._lock(name):
            if name in self._builtins and self._models.builtin(name) is not None:
                await self._unload_builtin(name)
            elif self._models.is_from_repository(name):
                await self._unload(name)
                heap.settle()
            else:
                raise ModelNotFound(f"model '{name}' is not loaded", param="model")

    async def poll(self) -> None:
        """Poll mode: follow the repository forever (load new and changed models,
        unload removed ones)."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.poll_once()
            except Exception:
                log.exception("polling the model repository failed")

    async def poll_once(self) -> None:
        if self.repository is None:
            return
        present = set(self.repository.names())
        for name in sorted(present):
            stamp = _stamp(self.repository.root / name)
            if self._stamps.get(name) != stamp:
                async with self._lock(name):
                    try:
                        await self._load(name)
                    except InvalidRequest as exc:
                        log.error("poll: %s", exc.message)
        for name in sorted({*self._models.user_models, *self._models.ensembles} - present):
            async with self._lock(name):
                if self._models.is_from_repository(name):
                    await self._unload(name)
                    heap.settle()

    # --- BLS (a model's instance thread) ---------------------------------------------

    def _call_model(
        self,
        caller: str,
        name: str,
        version: str,
        inputs: Arrays,
        outputs: tuple[str, ...],
        parameters: Mapping[str, Any],
        decoupled: bool = False,
    ) -> list[Arrays]:
        """Serve one BLS call of ``caller`` to repository model ``name`` (``bls``);
        raises the call's ``CarpoolError``. Reads the served models from an instance
        thread: a model loaded or unloaded meanwhile is found or not, whole."""
        if name == caller:
            raise ModelExecutionError(f"model '{caller}' cannot call itself through BLS")
        served = self._models.user_models.get(name)
        if served is None:
            raise ModelNotFound(f"BLS: no repository model '{name}' is served", param="model_name")
        if served.state is not ModelState.READY:
            raise ModelUnavailable(f"model '{name}' is unloading")
        target = served.version(version)
        if target.spec.decoupled and not decoupled:
            raise ModelExecutionError(
                f"BLS: model '{name}' is decoupled; call it with exec(decoupled=True)"
            )
        checked = check_inputs(target.spec, inputs)
        known = {t.name for t in target.spec.outputs}
        unknown = next((o for o in outputs if o not in known), None)
        if unknown is not None:
            raise InvalidRequest(f"model '{name}' has no output '{unknown}'", param=unknown)
        payload = TensorPayload(checked.arrays, outputs, parameters=dict(parameters))
        return target.model.call(payload)

    # --- inside ---------------------------------------------------------------

    def _require_explicit(self, action: str, name: str) -> None:
        if self.repository is None and name not in self._builtins:
            raise InvalidRequest(
                f"cannot {action} '{name}': it is not a --model, and the server has no "
                "--model-repository"
            )
        if self.mode != "explicit":
            raise InvalidRequest(
                f"explicit model {action} is not allowed in model control mode '{self.mode}' "
                "(start the server with --model-control-mode explicit)"
            )

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _read_and_load(self, name: str) -> Loaded:
        """``name``'s versions loaded, or an ensemble's spec (it loads nothing: its
        steps find their models when a request runs)."""
        assert self.repository is not None
        stamp = _stamp(self.repository.root / name)
        specs = self.repository.read(name)
        loaded: Loaded
        if specs[0].ensemble:
            loaded = specs[0]
        elif specs[0].source.kind == "vllm":
            loaded = self._load_llm(name, Path(specs[-1].source.path))
        else:
            loaded = self.repository.load(name, specs)
        self._stamps[name] = stamp
        return loaded

    def _load_llm(self, name: str, model_json: Path) -> LoadedLlm:
        if self._llm_loader is None:
            raise RepositoryError(f"model '{name}': this server cannot load generation models")
        load = self._llm_loader(name, read_model_json(model_json))
        try:
            return LoadedLlm(load(), load)
        except RepositoryError:
            raise
        except Exception as exc:  # a model that cannot load leaves the rest serving
            raise RepositoryError(f"model '{name}': {type(exc).__name__}: {exc}") from exc

    async def _load(self, name: str) -> None:
        assert self.repository is not None
        if name not in self.repository.names():
            raise InvalidRequest(f"failed to load '{name}': no such model in the repository")
        try:
            loaded = await asyncio.to_thread(self._read_and_load, name)
            if self._models.builtin(name) is not None:
                await self._unload_builtin(name)
            elif self._models.is_from_repository(name):
                await self._unload(name)
            self._install(name, loaded)
        except RepositoryError as exc:
            self._failures[name] = str(exc)
            log.error("model %s failed to load: %s", name, exc)
            raise InvalidRequest(f"failed to load '{name}': {exc}") from None
        finally:
            # The new versions frozen; a replaced version's and a failed load's garbage freed.
            heap.settle()
        log.info("model %s loaded", name)

    def _install(self, name: str, loaded: Loaded) -> None:
        """Serve ``loaded``; ``RepositoryError`` (its instances finalised) if its name
        is a built-in model's."""
        if isinstance(loaded, LoadedLlm):
            try:
                self._models.add_builtin(loaded.served)
            except InvalidRequest as exc:
                _worker(loaded.served).close(exc.message)
                raise RepositoryError(exc.message) from None
            self._builtins[name] = loaded.load
            self._runtime.add(_worker(loaded.served))
            self._failures.pop(name, None)
            return
        if isinstance(loaded, ModelSpec):
            try:
                self._models.add_ensemble(ServedEnsemble(loaded, self._models))
            except InvalidRequest as exc:
                raise RepositoryError(exc.message) from None
            self._failures.pop(name, None)
            return
        served = ServedUserModel.from_loaded(loaded)
        try:
            self._models.add_user(served)
        except InvalidRequest as exc:
            for failed in loaded:
                failed.model.finalize()
            raise RepositoryError(exc.message) from None
        for version in served.versions.values():
            self._runtime.add(version.batcher)
        self._failures.pop(name, None)

    async def _unload(self, name: str) -> None:
        """Drain and unload ``name``; its memory is freed by the caller's
        ``heap.settle`` (a reload settles once, after the new versions are in). An
        ensemble is refused from now on (the requests in its steps finish there)."""
        ensemble = self._models.ensemble(name)
        if ensemble is not None:
            ensemble.state = ModelState.UNLOADING
            self._models.remove_ensemble(name)
            self._stamps.pop(name, None)
            log.info("model %s unloaded", name)
            return
        served = self._models.user(name)
        served.state = ModelState.UNLOADING
        await served.drained()
        for version in served.versions.values():
            await asyncio.wrap_future(self._runtime.remove(version.batcher))
            version.batcher.close(f"model '{name}' was unloaded")
        self._models.remove_user(name)
        self._stamps.pop(name, None)
        for version in served.versions.values():
            await asyncio.to_thread(version.model.finalize)
        log.info("model %s unloaded", name)

    async def _load_builtin(self, name: str) -> None:
        if self._models.builtin(name) is not None:
            return
        try:
            served = await asyncio.to_thread(self._builtins[name])
        except Exception as exc:  # a model that cannot load leaves the rest serving
            reason = f"{type(exc).__name__}: {exc}"
            self._failures[name] = reason
            log.exception("model %s failed to load", name)
            raise InvalidRequest(f"failed to load '{name}': {reason}") from None
        self._models.add_builtin(served)
        self._runtime.add(_worker(served))
        self._failures.pop(name, None)
        heap.settle()
        log.info("model %s loaded", name)

    async def _unload_builtin(self, name: str) -> None:
        served = self._models.builtin(name)
        assert served is not None
        self._models.close_builtin(name)
        worker = _worker(served)
        await asyncio.wrap_future(self._runtime.retire(worker))
        # Off the loop: closing an engine process waits for the process to exit.
        await asyncio.to_thread(worker.close, f"model '{name}' was unloaded")
        self._models.remove_builtin(name)
        del served, worker
        heap.settle()
        log.info("model %s unloaded", name)


def _worker(served: Builtin) -> DynamicBatcher | GenerationWorker:
    """What the runtime drives for a built-in model."""
    return served.engine.worker if isinstance(served, ServedGenerator) else served.batcher


def _stamp(folder: Path) -> float:
    """The newest modification time of anything in ``folder`` (poll mode's change test)."""
    times = [p.stat().st_mtime for p in folder.rglob("*") if p.is_file()]
    return max(times, default=0.0)
