"""LitServe's ``LitAPI`` contract as a repository model kind: a class with ``setup``,
``decode_request``, ``predict`` and ``encode_response`` (and, batched, ``batch`` and
``unbatch``), plain JSON in and out. An existing ``litserve.LitAPI`` subclass runs
unchanged (carpool does not need litserve; a subclass brings its own base class).

On the wire inside carpool a request is one BYTES element ``request`` (its JSON text)
and its answer one BYTES element ``response``, so the batcher, the instances and the
worker processes carry it like any repository model's tensors.

Batching as LitServe does it: with ``max_batch_size`` above 1, ``predict`` takes
``batch(decoded inputs)`` (a list where the class has no ``batch``) and its output is
split with ``unbatch`` (``list`` where it has none); with 1, ``predict`` takes one
decoded input.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from carpool.batching.request import Failed
from carpool.errors import InvalidRequest, ModelExecutionError
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import ModelSpec, TensorSpec

REQUEST, RESPONSE = "request", "response"
TENSORS: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] = (
    (TensorSpec(REQUEST, "BYTES", (1,)),),
    (TensorSpec(RESPONSE, "BYTES", (1,)),),
)

Outputs = dict[str, np.ndarray[Any, Any]]


def request_payload(body: bytes) -> dict[str, np.ndarray[Any, Any]]:
    """A request's JSON body as the model's one input (a batch of one)."""
    return {REQUEST: np.array([[body]], dtype=np.object_)}


def response_body(outputs: Outputs) -> bytes:
    """The JSON text of a LitAPI model's answer."""
    value: bytes = outputs[RESPONSE].reshape(-1)[0]
    return value


class LitApiRunner:
    """Runs one instance of a LitAPI class over batches of JSON requests."""

    def __init__(self, api: Any, spec: ModelSpec, device: str) -> None:
        require_lit_api(api)
        self.api = api
        self.spec = spec
        self.batched = spec.max_batch_size > 1
        setup = getattr(api, "setup", None)
        if callable(setup):
            setup(device)

    def execute(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        decoded: list[Any] = []
        answers: list[Outputs | Failed | None] = []
        for payload in payloads:
            try:
                request = json.loads(payload.inputs[REQUEST].reshape(-1)[0])
            except (ValueError, UnicodeDecodeError, RecursionError):
                answers.append(Failed(InvalidRequest("the request body is not JSON")))
                continue
            decoded.append(self.api.decode_request(request))
            answers.append(None)
        outputs = iter(self._predict(decoded))
        return [a if a is not None else self._encoded(next(outputs)) for a in answers]

    def _predict(self, decoded: list[Any]) -> list[Any]:
        if not decoded:
            return []
        if not self.batched:
            return [self.api.predict(x) for x in decoded]
        batch = getattr(self.api, "batch", None)
        output = self.api.predict(batch(decoded) if callable(batch) else decoded)
        unbatch = getattr(self.api, "unbatch", None)
        outputs = list(unbatch(output) if callable(unbatch) else output)
        if len(outputs) != len(decoded):
            raise ModelExecutionError(
                f"model '{self.spec.name}': predict gave {len(outputs)} outputs for "
                f"{len(decoded)} inputs"
            )
        return outputs

    def _encoded(self, output: Any) -> Outputs | Failed:
        try:
            text = json.dumps(self.api.encode_response(output)).encode()
        except (TypeError, ValueError) as exc:
            return Failed(
                ModelExecutionError(
                    f"model '{self.spec.name}': encode_response gave what is not JSON: {exc}"
                )
            )
        return {RESPONSE: np.array([[text]], dtype=np.object_)}

    def finalize(self) -> None:
        teardown = getattr(self.api, "teardown", None)
        if callable(teardown):
            teardown()


def require_lit_api(api: Any) -> None:
    """Raise TypeError naming what ``api`` lacks of LitServe's required methods."""
    missing = [m for m in ("decode_request", "predict", "encode_response") if not _has(api, m)]
    if missing:
        raise TypeError(f"{type(api).__name__} has no {', '.join(missing)}")


def _has(api: Any, method: str) -> bool:
    return callable(getattr(api, method, None))
