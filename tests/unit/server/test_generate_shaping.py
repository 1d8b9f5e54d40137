"""The generate extension's shaping: JSON values to tensors of the declared
datatypes (refused by name when they do not fit), outputs back to JSON."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool.config import BatchingConfig
from carpool.errors import InvalidRequest
from carpool.repository.spec import ModelSpec, Source, TensorSpec
from carpool.server.kserve.generate_shaping import generate_body, generate_inputs


def spec(max_batch_size: int = 4) -> ModelSpec:
    return ModelSpec(
        name="m",
        version=1,
        max_batch_size=max_batch_size,
        inputs=(
            TensorSpec("text", "BYTES", (-1,)),
            TensorSpec("ids", "INT8", (-1,)),
            TensorSpec("scale", "FP32", (1,)),
            TensorSpec("flag", "BOOL", (1,)),
        ),
        outputs=(TensorSpec("out", "FP32", (-1,)),),
        batching=BatchingConfig(),
        source=Source("python_class", "model:M"),
    )


def test_values_become_tensors_with_a_batch_dimension() -> None:
    body = {"text": ["a", "é"], "ids": [1, -2], "scale": 0.5, "flag": True, "parameters": {"p": 1}}
    arrays, params = generate_inputs(body, spec())
    assert arrays["text"].tolist() == [[b"a", "é".encode()]]
    assert arrays["ids"].dtype == np.int8 and arrays["ids"].tolist() == [[1, -2]]
    assert arrays["scale"].dtype == np.float32 and arrays["scale"].shape == (1, 1)
    assert arrays["flag"].dtype == np.bool_ and params == {"p": 1}
    unbatched, _ = generate_inputs({"ids": 3}, spec(max_batch_size=0))
    assert unbatched["ids"].shape == (1,)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"nope": 1}, "nope"),
        ({"ids": 300}, "ids"),
        ({"ids": 1.5}, "ids"),
        ({"ids": [1, [2]]}, "ids"),
        ({"ids": True}, "ids"),
        ({"scale": "1"}, "scale"),
        ({"flag": 1}, "flag"),
        ({"text": [1]}, "text"),
        ({"parameters": [1]}, "parameters"),
    ],
)
def test_a_value_that_does_not_fit_is_refused_by_name(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        generate_inputs(body, spec())
    assert refused.value.param == field


def test_outputs_lose_the_batch_dimension_and_one_element_is_a_scalar() -> None:
    outputs = [
        ("vector", np.array([[1.0, 2.0]], np.float32)),
        ("one", np.array([[7]], np.int32)),
        ("text", np.array([[b"hi"]], np.object_)),
        ("texts", np.array([[b"a", b"b"]], np.object_)),
    ]
    body = generate_body("m", "1", outputs, batched=True)
    assert body == {
        "model_name": "m",
        "model_version": "1",
        "vector": [1.0, 2.0],
        "one": 7,
        "text": "hi",
        "texts": ["a", "b"],
    }
