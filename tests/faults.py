"""Fault injection, a test hook: the reliability tests start ``carpool serve`` with
``CARPOOL_TEST_FAULTS`` set to a plan (JSON) and ``tests/fault_site`` on the path,
whose ``sitecustomize`` calls ``install`` in the server's process and in every
process it starts (engine processes, Ray replicas).

Each model then loaded is wrapped so that it fails on chosen inputs: any batch or
engine step holding ``fail_on_token`` raises an ordinary exception (the request must
fail alone); one holding ``kill_runtime_on_token`` raises ``RuntimeKilled``, which no
model-failure handler catches, so the device runtime thread dies (the server must
turn unhealthy and exit non-zero). ``slow_ms`` delays every forward.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from carpool.config import from_json

log = logging.getLogger(__name__)


class RuntimeKilled(BaseException):
    """Escapes every ``except Exception``: kills the runtime thread."""


@dataclass(frozen=True)
class FaultPlan:
    fail_on_token: int | None = None
    kill_runtime_on_token: int | None = None
    slow_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        return from_json(cls, text, "CARPOOL_TEST_FAULTS")

    def check(self, token_ids: torch.Tensor) -> None:
        if self.slow_ms:
            time.sleep(self.slow_ms / 1000)
        if self.kill_runtime_on_token is not None and bool(
            (token_ids == self.kill_runtime_on_token).any()
        ):
            raise RuntimeKilled("injected: kill the runtime")
        if self.fail_on_token is not None and bool((token_ids == self.fail_on_token).any()):
            raise RuntimeError("injected model failure")


class FaultyCausalLM(torch.nn.Module):
    """A causal LM that runs ``plan.check`` on each step's tokens first."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.plan = plan

    def forward(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        self.plan.check(input_ids)
        out: torch.Tensor = self.inner(input_ids, *args)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner.compute_logits(hidden)
        return out


class FaultyBatchModel:
    """A dynamic-batched model that runs ``plan.check`` on each batch's tokens first."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.ragged = inner.ragged

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def collate(self, payloads: list[Any]) -> Any:
        return self.inner.collate(payloads)

    def forward(self, batch: Any) -> Any:
        self.plan.check(batch[0])  # the flat token ids of a ragged batch
        return self.inner.forward(batch)

    def split(self, output: Any, count: int) -> list[Any]:
        return self.inner.split(output, count)


def install(text: str) -> None:
    """From now on every model this process loads for serving fails as the plan
    ``text`` (JSON of ``FaultPlan``'s fields) says."""
    from carpool.models.registry import Task
    from carpool.server import bootstrap

    plan = FaultPlan.parse(text)
    load = bootstrap.load_model

    def faulty(source: Any, config: Any) -> Any:
        model = load(source, config)
        log.warning("fault injection is on: %s", plan)
        if source.task is Task.GENERATE:
            model.model = FaultyCausalLM(model.model, plan)
            return model
        return FaultyBatchModel(model, plan)

    bootstrap.load_model = faulty
