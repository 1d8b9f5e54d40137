"""A model repository folder: which models it holds, reading and loading them.

Each sub-folder is a model, in Triton's layout (``config.pbtxt``) or carpool's
(``carpool.toml``). Reading checks the config only; loading imports the user's code
and initialises every instance, so a model that fails to load raises here and
nothing of it is left running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from carpool.repository.backends import Backend, create_backend
from carpool.repository.bls import CallModel
from carpool.repository.carpool_config import is_carpool_model, read_carpool_model
from carpool.repository.errors import RepositoryError
from carpool.repository.process import ProcessBackend
from carpool.repository.spec import ModelSpec
from carpool.repository.triton_config import is_triton_model, read_triton_model
from carpool.repository.user_model import UserBatchModel

log = logging.getLogger(__name__)

# The source kinds that run the user's own Python code.
USER_CODE_KINDS = ("triton_python", "python_class", "litapi")


@dataclass(frozen=True)
class LoadedVersion:
    """One served version of a repository model."""

    spec: ModelSpec
    model: UserBatchModel


class ModelRepository:
    """The models under ``root``, for a runtime on ``device``; ``auto_complete``: let
    Python-backend models complete their configs (Triton's default)."""

    def __init__(
        self,
        root: Path,
        device: str = "cpu",
        execution_timeout_s: float = 0.0,
        isolation: str = "process",
        auto_complete: bool = True,
    ) -> None:
        if not root.is_dir():
            raise RepositoryError(f"model repository {root} is not a folder")
        self.root = root
        self.device = device
        self.execution_timeout_s = execution_timeout_s
        self.isolation = isolation
        self.auto_complete = auto_complete
        self.call_model: CallModel | None = None  # serves BLS calls; set by the server

    def names(self) -> list[str]:
        """Every model folder's name, sorted."""
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.is_dir() and (is_triton_model(p) or is_carpool_model(p))
        )

    def read(self, name: str) -> list[ModelSpec]:
        """The versions of ``name`` its config serves; ``RepositoryError`` if unusable."""
        folder = self.root / name
        if "/" in name or name.startswith(".") or not folder.is_dir():
            raise RepositoryError(f"no model '{name}' in the repository {self.root}")
        if is_triton_model(folder) and is_carpool_model(folder):
            raise RepositoryError(f"{folder}: holds both config.pbtxt and carpool.toml; keep one")
        if is_triton_model(folder):
            return read_triton_model(folder, self.device, complete=self.auto_complete)
        if is_carpool_model(folder):
            return read_carpool_model(folder)
        raise RepositoryError(f"{folder}: holds neither config.pbtxt nor carpool.toml")

    def load(self, name: str, specs: list[ModelSpec] | None = None) -> list[LoadedVersion]:
        """Load every instance of every version ``name`` serves: of ``specs`` when the
        caller has read them already (reading a Python-backend model imports its code
        for ``auto_complete_config``), else of what ``read`` gives."""
        loaded: list[LoadedVersion] = []
        try:
            for spec in self.read(name) if specs is None else specs:
                instances: list[Backend] = []
                try:
                    for i in range(spec.instance_count):
                        instances.append(self._instance(spec, i))
                except BaseException:
                    for instance in instances:
                        _finalize_quietly(instance, name)
                    raise
                timeout = spec.execution_timeout_s or self.execution_timeout_s
                model = UserBatchModel(spec, instances, timeout, replace=self._replacer(spec))
                loaded.append(LoadedVersion(spec, model))
        except BaseException:
            for version in loaded:
                version.model.finalize()
            raise
        return loaded

    def _replacer(self, spec: ModelSpec) -> Callable[[int], Backend]:
        """Loads instance ``index`` of ``spec`` anew (one that hung is replaced)."""
        return lambda index: self._instance(spec, index)

    def isolation_of(self, spec: ModelSpec) -> str:
        """Where ``spec``'s instances run: its own isolation, else, for the user's
        own code (a Python-backend model, a class), the repository's (``process`` by
        default; a decoupled model's responses cross from its process on a pipe of
        their own). A library model (a pipeline, a sentence-transformers model: no
        line of user code) runs in a thread of the server's process, sharing its
        torch."""
        if spec.isolation:
            return spec.isolation
        if spec.source.kind not in USER_CODE_KINDS:
            return "thread"
        return self.isolation

    def _instance(self, spec: ModelSpec, index: int) -> Backend:
        if self.isolation_of(spec) == "process":
            return ProcessBackend(spec, index, self.device, self.call_model)
        return create_backend(spec, index, self.device, self.call_model)


def _finalize_quietly(instance: Backend, name: str) -> None:
    try:
        instance.finalize()
    except Exception:
        log.exception("model %s: finalize after a failed load failed", name)
