"""Model control: start-up loading leaves failures out with their reason; a built-in
model drains, unloads, is freed and loads again."""

from __future__ import annotations

import asyncio
import gc
import shutil
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from carpool.batching import DynamicBatcher
from carpool.config import BatchingConfig, RepositoryConfig
from carpool.errors import ModelNotFound, ModelUnavailable
from carpool.repository.repository import ModelRepository
from carpool.runtime import DeviceRuntime
from carpool.server.registry.model_control import ModelControl
from carpool.server.registry.served import ServedEmbedding, ServedModels

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "model_repository"


def control_over(root: Path, builtin: str) -> tuple[ModelControl, ServedModels]:
    models = ServedModels([cast(ServedEmbedding, SimpleNamespace(name=builtin))])
    config = RepositoryConfig(model_repository=str(root))
    return ModelControl(ModelRepository(root), config, models, DeviceRuntime()), models


def test_a_model_named_like_a_built_in_is_left_out_and_the_others_load(tmp_path: Path) -> None:
    for name in ("python_batched_service", "mlp_classifier"):
        shutil.copytree(EXAMPLES / name, tmp_path / name)
    control, models = control_over(tmp_path, builtin="mlp_classifier")
    control.load_at_start(control.initial_models(RepositoryConfig()))
    assert models.is_user("python_batched_service")
    assert not models.is_user("mlp_classifier")
    index: dict[str, Any] = {e.name: e for e in control.index()}
    assert index["mlp_classifier"].state == "UNAVAILABLE"
    assert "already served as a built-in model" in index["mlp_classifier"].reason
    assert index["python_batched_service"].state == "READY"


class HeldModel:
    """A batch model whose forward waits for ``release`` (doubles its inputs)."""

    ragged = False

    def __init__(self) -> None:
        self.running, self.release = threading.Event(), threading.Event()

    def collate(self, payloads: list[Any]) -> list[Any]:
        return payloads

    def forward(self, batch: list[Any]) -> list[Any]:
        self.running.set()
        self.release.wait()
        return [2 * x for x in batch]

    def split(self, output: list[Any], count: int) -> list[Any]:
        return output


def test_a_built_in_model_drains_unloads_frees_and_loads_again() -> None:
    loads: list[weakref.ref[HeldModel]] = []
    gates: list[tuple[threading.Event, threading.Event]] = []

    def load() -> ServedEmbedding:
        model = HeldModel()
        loads.append(weakref.ref(model))
        gates.append((model.running, model.release))
        batcher = DynamicBatcher("embedder", model, BatchingConfig())
        return cast(ServedEmbedding, ServedEmbedding("embedder", cast(Any, model), batcher))

    first = load()
    models = ServedModels([first])
    runtime = DeviceRuntime()
    runtime.register(first.batcher)
    config = RepositoryConfig(model_control_mode="explicit")
    control = ModelControl(None, config, models, runtime, builtins={"embedder": load})
    runtime.start()

    async def scenario() -> None:
        held = asyncio.wrap_future(models.embedder("embedder").batcher.submit(21, 1))
        await asyncio.to_thread(gates[0][0].wait)
        unloading = asyncio.create_task(control.unload("embedder"))
        while not models.is_closing("embedder"):
            await asyncio.sleep(0)
        with pytest.raises(ModelUnavailable):
            models.embedder("embedder")
        assert [e.state for e in control.index()] == ["UNLOADING"]
        assert not unloading.done()  # the batch in flight holds it
        gates[0][1].set()
        assert await held == 42
        await unloading
        with pytest.raises(ModelNotFound):
            models.embedder("embedder")
        assert [(e.state, e.reason) for e in control.index()] == [("UNAVAILABLE", "unloaded")]
        await control.load("embedder")
        gates[1][1].set()
        assert await asyncio.wrap_future(models.embedder("embedder").batcher.submit(5, 1)) == 10

    try:
        del first
        asyncio.run(scenario())
        gc.collect()
        assert loads[0]() is None  # nothing holds the unloaded model
        assert len(loads) == 2 and runtime.workers == ["embedder"]
    finally:
        runtime.stop()
