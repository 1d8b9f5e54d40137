"""An ensemble as the server serves it: each request's tensors flow step to step, each
step a request to its own repository model (so batched by that model's batcher, with
its own admission and statistics). The steps of a stage run at once; a stage starts
when the one before it has answered whole (Triton starts a step as soon as its own
inputs are there: the same answers, a step's start later at most by its stage).

Owned by the event loop, as ``ServedUserModel``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.requests import Request

from carpool.admission import RETRY_AFTER_S
from carpool.errors import CarpoolError, ModelNotFound, ModelUnavailable
from carpool.repository.ensemble import EnsembleStep
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import CheckedRequest, ModelSpec, check_inputs
from carpool.server.http.awaiting import gather_or_cancel
from carpool.server.registry.served_user import ModelState
from carpool.stats import BatcherStats, Outcome

if TYPE_CHECKING:
    from carpool.server.registry.served import ServedModels

Arrays = dict[str, np.ndarray[Any, Any]]


@dataclass
class ServedEnsemble:
    """An ensemble of repository models; ``models`` finds the composing ones when a
    request runs (a composing model unloaded meanwhile fails the request: 503)."""

    spec: ModelSpec
    models: ServedModels
    state: ModelState = ModelState.READY
    stats: BatcherStats = field(default_factory=BatcherStats)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        return self.spec.name

    def composing(self) -> list[str]:
        """The names of the models the steps call, in step order."""
        return [step.model for stage in self.spec.ensemble for step in stage]

    @property
    def ready(self) -> bool:
        """Ready, and so is every composing model."""
        return self.state is ModelState.READY and all(
            self.models.is_user(n) and self.models.user(n).ready for n in self.composing()
        )

    async def infer(
        self,
        checked: CheckedRequest,
        payload: TensorPayload,
        *,
        priority: int | None,
        timeout_s: float | None,
        request: Request | None,
    ) -> Arrays:
        """The ensemble's outputs for one request whose inputs ``checked`` holds; a
        step's failure fails it with that step's error, its message naming the step."""
        if self.state is not ModelState.READY:
            raise ModelUnavailable(f"model '{self.name}' is unloading", retry_after_s=RETRY_AFTER_S)
        started = time.perf_counter()
        tensors: Arrays = dict(checked.arrays)
        try:
            for stage in self.spec.ensemble:
                answers: list[asyncio.Future[Arrays]] = [
                    asyncio.ensure_future(
                        self._step(step, tensors, payload, priority, timeout_s, request)
                    )
                    for step in stage
                ]
                for step, outputs in zip(stage, await gather_or_cancel(answers), strict=True):
                    tensors.update({step.outputs[k]: v for k, v in outputs.items()})
        except CarpoolError:
            self.stats.record_outcome(Outcome.ERROR, time.perf_counter() - started)
            raise
        took = time.perf_counter() - started
        self.stats.record_execution(checked.size, 0.0, took, 0.0, int(time.time() * 1000))
        self.stats.record_outcome(Outcome.SUCCESS, took)
        wanted = payload.outputs or [t.name for t in self.spec.outputs]
        return {name: tensors[name] for name in wanted}

    async def _step(
        self,
        step: EnsembleStep,
        tensors: Mapping[str, np.ndarray[Any, Any]],
        payload: TensorPayload,
        priority: int | None,
        timeout_s: float | None,
        request: Request | None,
    ) -> Arrays:
        try:
            try:
                target = self.models.user(step.model)
            except ModelNotFound:
                raise ModelUnavailable(
                    f"model '{step.model}' is not loaded", retry_after_s=RETRY_AFTER_S
                ) from None
            version = target.version(step.version)
            checked = check_inputs(version.spec, {k: tensors[v] for k, v in step.inputs.items()})
            asked = TensorPayload(
                checked.arrays,
                tuple(step.outputs),
                request_id=payload.request_id,
                parameters=payload.parameters,
            )
            return await target.infer(
                version, checked, asked, priority=priority, timeout_s=timeout_s, request=request
            )
        except CarpoolError as exc:
            exc.message = f"ensemble '{self.name}' step '{step.model}': {exc.message}"
            exc.args = (exc.message,)
            raise
