"""An ensemble's steps read, checked and put in stages before anything runs."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.repository.ensemble import read_steps
from carpool.repository.errors import RepositoryError


def step(model: str, inputs: dict[str, str], outputs: dict[str, str], **extra: Any) -> Any:
    return {"model_name": model, "input_map": inputs, "output_map": outputs, **extra}


def config(*steps: Any) -> dict[str, Any]:
    return {"ensemble_scheduling": {"step": list(steps)}}


def test_steps_are_staged_by_what_they_read() -> None:
    stages = read_steps(
        config(
            step("join", {"a": "left", "b": "right"}, {"y": "out"}),
            step("split_l", {"x": "in"}, {"y": "left"}, model_version=2),
            step("split_r", {"x": "in"}, {"y": "right"}),
        ),
        ["in"],
        ["out"],
        "e",
    )
    assert [[s.model for s in stage] for stage in stages] == [["split_l", "split_r"], ["join"]]
    assert (stages[0][0].version, stages[0][1].version) == ("2", "")


@pytest.mark.parametrize(
    ("steps", "outputs", "message"),
    [
        ((), ["out"], "needs ensemble_scheduling with a step"),
        ((step("a", {"x": "in"}, {"y": "t"}), step("b", {"x": "t"}, {"y": "t"})), ["t"],
         "'t' is written by step 'b' and by 'a'"),
        ((step("a", {"x": "in"}, {"y": "in"}),), ["in"], "written by step 'a' and by an input"),
        ((step("a", {"x": "in"}, {"y": "t"}),), ["out"], "no step writes the ensemble output"),
        ((step("a", {"x": "nowhere"}, {"y": "out"}),), ["out"],
         "reads 'nowhere', which neither an ensemble input nor a step gives"),
        ((step("a", {"x": "u"}, {"y": "t"}), step("b", {"x": "t"}, {"y": "u"})), ["t"],
         "form a cycle"),
        ((step("a", {}, {"y": "out"}),), ["out"], "needs an input_map and an output_map"),
        ((step("a", {"x": "in"}, {"y": "out"}, model_version=0),), ["out"], "model_version"),
    ],
)  # fmt: skip
def test_broken_graphs_are_named(steps: tuple[Any, ...], outputs: list[str], message: str) -> None:
    with pytest.raises(RepositoryError, match=message):
        read_steps(config(*steps), ["in"], outputs, "e")
