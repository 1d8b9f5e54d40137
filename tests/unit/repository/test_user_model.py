"""A user model's instances as the batcher's pool: taken and given back, abandoned
when hung and replaced, and released within a bound at unload or shutdown. Driven
by hand with in-process fake backends (fault injection: no user code file)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from carpool.batching.request import Failed
from carpool.config import BatchingConfig
from carpool.errors import ModelUnavailable
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import ModelSpec, Source, TensorSpec
from carpool.repository.user_model import UserBatchModel

SPEC = ModelSpec(
    name="m",
    version=1,
    max_batch_size=4,
    inputs=(TensorSpec("x", "FP32", (1,)),),
    outputs=(TensorSpec("y", "FP32", (1,)),),
    batching=BatchingConfig(),
    source=Source("python_class", "."),
)


class Doubler:
    """An in-process backend; ``release`` lets a held ``execute`` or ``finalize`` go."""

    def __init__(self, hold_execute: bool = False, hold_finalize: bool = False) -> None:
        self.release = threading.Event()
        self.hold_execute = hold_execute
        self.hold_finalize = hold_finalize
        self.finalized = threading.Event()

    def execute(self, payloads: list[TensorPayload]) -> list[Any]:
        if self.hold_execute:
            self.release.wait(60)
        return [{"y": p.inputs["x"] * 2} for p in payloads]

    def finalize(self) -> None:
        if self.hold_finalize:
            self.release.wait(60)
        self.finalized.set()


def payload(value: float) -> TensorPayload:
    return TensorPayload({"x": np.array([[value]], np.float32)})


def run_on(model: UserBatchModel, index: int, value: float) -> Any:
    """Hand one request to instance ``index`` as the batcher does; its result."""
    done: threading.Event = threading.Event()
    out: list[Any] = []

    def job(forward: Any) -> None:
        out.append(model.split(forward(model.collate([payload(value)])), 1)[0])
        done.set()

    model.run(index, job)
    assert done.wait(60)
    return out[0]


def test_instances_are_taken_in_turn_and_given_back() -> None:
    model = UserBatchModel(SPEC, [Doubler(), Doubler()], timeout_s=5)
    assert model.take() == 0 and model.take() == 1
    assert model.take() is None and not model.has_free()
    assert run_on(model, 1, 3.0)["y"].tolist() == [[6.0]]
    model.give_back(1)
    assert model.has_free() and model.take() == 1
    assert model.ready


def test_a_hung_instance_is_replaced_on_a_new_thread_and_its_slot_comes_back() -> None:
    hung = Doubler(hold_execute=True)
    fresh = Doubler()
    woken = threading.Event()
    replaced: list[int] = []

    def replace(index: int) -> Doubler:
        replaced.append(index)
        return fresh

    model = UserBatchModel(SPEC, [hung], timeout_s=1, replace=replace)
    model.attach(woken.set)
    index = model.take()
    assert index == 0
    model.run(index, lambda forward: forward([payload(1.0)]))  # never returns by itself
    model.abandon(index)  # the batcher's timeout passed
    assert woken.wait(60) and replaced == [0]
    assert model.ready and model.take() == 0
    assert run_on(model, 0, 2.0)["y"].tolist() == [[4.0]]  # on the new instance's thread
    model.finalize(timeout_s=5)
    assert fresh.finalized.is_set()
    assert not hung.finalized.is_set()  # a hung instance's finalize is never called
    hung.release.set()


def test_a_replacement_that_fails_to_load_leaves_the_model_lost() -> None:
    woken = threading.Event()

    def replace(index: int) -> Doubler:
        raise RuntimeError("the weights are gone")

    hung = Doubler(hold_execute=True)
    model = UserBatchModel(SPEC, [hung], timeout_s=1, replace=replace)
    model.attach(woken.set)
    assert model.take() == 0
    model.abandon(0)
    assert woken.wait(60)
    assert not model.ready and not model.has_free()
    assert "the weights are gone" in model.lost_reason
    with pytest.raises(ModelUnavailable, match="the weights are gone"):
        model.call(payload(1.0))
    hung.release.set()


def test_finalize_returns_within_its_bound_though_an_instance_hangs_in_it() -> None:
    stuck, fine = Doubler(hold_finalize=True), Doubler()
    model = UserBatchModel(SPEC, [stuck, fine], timeout_s=1)
    model.finalize(timeout_s=0.2)
    assert fine.finalized.is_set() and not stuck.finalized.is_set()
    stuck.release.set()
    assert stuck.finalized.wait(60)  # it was left running on its own thread


def test_a_wrong_output_fails_that_request_with_what_was_wrong() -> None:
    class Wrong(Doubler):
        def execute(self, payloads: list[TensorPayload]) -> list[Any]:
            return [{"y": np.zeros((2, 1), np.float64)} for _ in payloads]

    model = UserBatchModel(SPEC, [Wrong()], timeout_s=1)
    result = run_on(model, 0, 1.0)
    assert isinstance(result, Failed) and "FP64" in str(result.error)
