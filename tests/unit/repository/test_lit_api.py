"""``carpool.lit_api``: a LitServe LitAPI instance as a served model, batched as it
was made to be, its JSON carried through the runner like a repository LitAPI's."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from carpool.repository.function_model import lit_api
from carpool.repository.litapi import REQUEST, RESPONSE
from carpool.repository.payload import TensorPayload


class Doubler:
    """Written as LitServe's users write one; ``max_batch_size`` and
    ``batch_timeout`` as ``litserve.LitAPI(max_batch_size=..., batch_timeout=...)``
    keeps them."""

    def __init__(self, max_batch_size: int = 1, batch_timeout: float = 0.0) -> None:
        self.max_batch_size = max_batch_size
        self.batch_timeout = batch_timeout

    def setup(self, device: str) -> None:
        self.device = device

    def decode_request(self, request: dict[str, Any]) -> float:
        return float(request["x"])

    def predict(self, x: Any) -> Any:
        return [2 * v for v in x] if isinstance(x, list) else 2 * x

    def encode_response(self, y: float) -> dict[str, Any]:
        return {"y": y, "device": self.device}


def payload(body: dict[str, Any]) -> TensorPayload:
    return TensorPayload({REQUEST: np.array([[json.dumps(body).encode()]], dtype=np.object_)})


def test_an_instance_batches_as_it_was_made_to_unless_told_otherwise() -> None:
    made = lit_api(Doubler(max_batch_size=8, batch_timeout=0.05))
    assert made.spec.name == "Doubler" and made.spec.source.kind == "litapi"
    assert made.spec.max_batch_size == 8 and made.spec.batching.max_queue_delay_ms == 50
    told = lit_api(Doubler(max_batch_size=8), name="d", max_batch_size=2, batch_timeout=0)
    assert (told.spec.name, told.spec.max_batch_size) == ("d", 2)
    backend = made.backend()
    answers = backend.execute([payload({"x": 1}), payload({"x": 4})])
    assert [json.loads(a[RESPONSE].reshape(-1)[0]) for a in answers] == [  # type: ignore[index]
        {"y": 2.0, "device": "cpu"},
        {"y": 8.0, "device": "cpu"},
    ]


@pytest.mark.parametrize(
    ("api", "kwargs", "error"),
    [
        (object(), {}, TypeError),
        (Doubler(), {"max_batch_size": 0}, ValueError),
        (Doubler(), {"batch_timeout": -1}, ValueError),
        (Doubler(max_batch_size="8"), {}, ValueError),  # type: ignore[arg-type]
    ],
)
def test_what_is_no_litapi_or_no_batching_is_refused(
    api: Any, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        lit_api(api, **kwargs)
