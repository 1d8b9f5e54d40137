"""A request's tensors checked against a model's declared inputs."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.config import BatchingConfig
from carpool.errors import InvalidRequest
from carpool.repository.spec import ModelSpec, Source, TensorSpec, check_inputs, check_unique


def spec(max_batch_size: int = 4, ragged: bool = False, dynamic: bool = True) -> ModelSpec:
    return ModelSpec(
        name="m",
        version=1,
        max_batch_size=max_batch_size,
        inputs=(
            TensorSpec("a", "FP32", (-1,), allow_ragged_batch=ragged),
            TensorSpec("b", "INT32", (2,), optional=True),
        ),
        outputs=(TensorSpec("y", "FP32", (1,)),),
        batching=BatchingConfig(),
        source=Source("python_class", "."),
        dynamic_batching=dynamic,
    )


def test_equal_shapes_group_together_and_the_batch_dimension_is_the_size() -> None:
    one = check_inputs(spec(), {"a": np.zeros((3, 5), np.float32)})
    two = check_inputs(spec(), {"a": np.zeros((1, 5), np.float32)})
    other = check_inputs(spec(), {"a": np.zeros((1, 6), np.float32)})
    assert one.size == 3 and two.size == 1
    assert one.group == two.group != other.group


def test_ragged_inputs_do_not_split_groups() -> None:
    a = check_inputs(spec(ragged=True), {"a": np.zeros((1, 5), np.float32)})
    b = check_inputs(spec(ragged=True), {"a": np.zeros((1, 6), np.float32)})
    assert a.group == b.group


def test_without_batching_every_request_is_its_own_group() -> None:
    for s in (spec(max_batch_size=0), spec(dynamic=False)):
        x = {"a": np.zeros((1, 5) if s.max_batch_size else (5,), np.float32)}
        assert check_inputs(s, x).group != check_inputs(s, x).group


@pytest.mark.parametrize(
    ("arrays", "named"),
    [
        ({"a": np.zeros((1, 5), np.float64)}, "a"),  # datatype
        ({"a": np.zeros((5,), np.float32)}, "a"),  # no batch dimension
        ({"a": np.zeros((5, 2), np.float32)}, "a"),  # over max_batch_size
        ({"a": np.zeros((1, 2, 2), np.float32)}, "a"),  # rank
        ({"a": np.zeros((2, 2), np.float32), "b": np.zeros((1, 2), np.int32)}, "b"),  # batch
        ({"b": np.zeros((1, 2), np.int32)}, "a"),  # missing
        ({"a": np.zeros((1, 2), np.float32), "c": np.zeros(1)}, "c"),  # unknown
        ({"a": np.zeros((1, 2), np.float32), "b": np.zeros((1, 3), np.int32)}, "b"),  # dims
    ],
)
def test_bad_inputs_name_the_input(arrays: dict[str, np.ndarray], named: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_inputs(spec(), arrays)
    assert caught.value.param == named


class CountedName(str):
    """A name that counts how often it is compared for equality."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountedName.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_checking_names_for_repeats_is_linear() -> None:
    """30,000 distinct names held the event loop for 10 s when each was counted."""
    names = [CountedName(f"input_{i}") for i in range(3000)]
    CountedName.compared = 0
    check_unique(names)
    assert CountedName.compared <= len(names)
    with pytest.raises(InvalidRequest) as repeated:
        check_unique([*names, names[7]], "output")
    assert repeated.value.param == "input_7" and "output 'input_7'" in repeated.value.message
