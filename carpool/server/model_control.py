"""Model control (Triton's repository extension): which repository models are served,
loading and unloading them while the server runs.

Owned by the event loop. Loading imports and initialises the user's code on a
worker thread, then hands the model's batchers to the device runtime; a load that
fails leaves nothing behind and every other model serving. Unloading refuses new
requests (503 + Retry-After), waits for those in flight, takes the batchers off the
runtime, then finalises the user's code; after that the model is gone (404).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass
from pathlib import Path

from carpool.config import RepositoryConfig
from carpool.errors import InvalidRequest, ModelNotFound
from carpool.repository.errors import RepositoryError
from carpool.repository.function_model import FunctionBackend, FunctionModel
from carpool.repository.repository import LoadedVersion, ModelRepository
from carpool.repository.user_model import UserBatchModel
from carpool.runtime import DeviceRuntime
from carpool.server.served import ServedModels
from carpool.server.served_user import ModelState, ServedUserModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexEntry:
    """One row of the repository index."""

    name: str
    version: str
    state: str
    reason: str


class ModelControl:
    """Loads and unloads the repository's models into ``models`` and ``runtime``."""

    def __init__(
        self,
        repository: ModelRepository | None,
        config: RepositoryConfig,
        models: ServedModels,
        runtime: DeviceRuntime,
    ) -> None:
        self.repository = repository
        self.mode = config.model_control_mode
        self.timeout_s = config.model_execution_timeout_s
        self.poll_s = config.repository_poll_secs
        self._models = models
        self._runtime = runtime
        self._failures: dict[str, str] = {}
        self._stamps: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}

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

    def install_function(self, function: FunctionModel) -> None:
        """Serve a ``carpool.batched`` function (before serving; not unloadable)."""
        spec = function.spec
        model = UserBatchModel(
            spec, [FunctionBackend(function)], spec.execution_timeout_s or self.timeout_s
        )
        self._install(spec.name, [LoadedVersion(spec, model)])

    # --- the repository API (event loop) ------------------------------------------

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model in the repository (and every one served), with its state."""
        names = set(self.repository.names()) if self.repository else set()
        names |= set(self._models.user_models)
        entries = []
        for name in sorted(names):
            served = self._models.user_models.get(name)
            if served is not None:
                for version in sorted(served.versions):
                    entries.append(IndexEntry(name, str(version), served.state.value, ""))
            elif not ready_only:
                reason = self._failures.get(name, "unloaded")
                state = ModelState.UNAVAILABLE.value
                entries.append(IndexEntry(name, "", state, reason))
        if ready_only:
            entries = [e for e in entries if e.state == ModelState.READY.value]
        return entries

    async def load(self, name: str) -> None:
        """Load (or reload) ``name``; ``InvalidRequest`` if it cannot be loaded."""
        self._require_explicit("load")
        async with self._lock(name):
            await self._load(name)

    async def unload(self, name: str) -> None:
        """Drain and unload ``name``; ``ModelNotFound`` if it is not loaded."""
        self._require_explicit("unload")
        async with self._lock(name):
            if not self._models.is_user(name):
                raise ModelNotFound(f"model '{name}' is not loaded", param="model")
            await self._unload(name)

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
        for name in sorted(set(self._models.user_models) - present):
            async with self._lock(name):
                if self._models.is_user(name):
                    await self._unload(name)

    # --- inside ---------------------------------------------------------------

    def _require_explicit(self, action: str) -> None:
        if self.repository is None:
            raise InvalidRequest(f"cannot {action}: the server has no --model-repository")
        if self.mode != "explicit":
            raise InvalidRequest(
                f"explicit model {action} is not allowed in model control mode '{self.mode}' "
                "(start the server with --model-control-mode explicit)"
            )

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _read_and_load(self, name: str) -> list[LoadedVersion]:
        assert self.repository is not None
        stamp = _stamp(self.repository.root / name)
        loaded = self.repository.load(name)
        self._stamps[name] = stamp
        return loaded

    async def _load(self, name: str) -> None:
        assert self.repository is not None
        if name not in self.repository.names():
            raise InvalidRequest(f"failed to load '{name}': no such model in the repository")
        try:
            loaded = await asyncio.to_thread(self._read_and_load, name)
            if self._models.is_user(name):
                await self._unload(name)
            self._install(name, loaded)
        except RepositoryError as exc:
            self._failures[name] = str(exc)
            log.error("model %s failed to load: %s", name, exc)
            raise InvalidRequest(f"failed to load '{name}': {exc}") from None
        log.info(
            "model %s loaded (versions %s)", name, ", ".join(str(v.spec.version) for v in loaded)
        )

    def _install(self, name: str, loaded: list[LoadedVersion]) -> None:
        """Serve ``loaded``; ``RepositoryError`` (its instances finalised) if its name
        is a built-in model's."""
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
        served = self._models.user(name)
        served.state = ModelState.UNLOADING
        await served.drained()
        for version in served.versions.values():
            await asyncio.wrap_future(self._runtime.remove(version.batcher))
            version.batcher.fail_all(ModelNotFound(f"model '{name}' was unloaded"))
        self._models.remove_user(name)
        self._stamps.pop(name, None)
        for version in served.versions.values():
            await asyncio.to_thread(version.model.finalize)
        del served
        gc.collect()
        log.info("model %s unloaded", name)


def _stamp(folder: Path) -> float:
    """The newest modification time of anything in ``folder`` (poll mode's change test)."""
    times = [p.stat().st_mtime for p in folder.rglob("*") if p.is_file()]
    return max(times, default=0.0)
