"""What one request to a repository model carries into its batch, and what a model
answers it with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TensorPayload:
    """A request's checked inputs and the outputs it asked for (empty: all)."""

    inputs: Mapping[str, np.ndarray[Any, Any]]
    outputs: tuple[str, ...] = ()
    request_id: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)


class ModelAnswer(dict[str, np.ndarray[Any, Any]]):
    """A repository model's outputs for one request, by name, with the response
    parameters it set (Triton's ``InferenceResponse(parameters=...)``: names to
    strings, integers, floats or booleans), which the protocols send beside the
    outputs. A plain dict of outputs is an answer without parameters."""

    def __init__(
        self,
        outputs: Mapping[str, np.ndarray[Any, Any]],
        parameters: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(outputs)
        self.parameters: dict[str, Any] = dict(parameters or {})


def parameters_of(outputs: Mapping[str, Any]) -> dict[str, Any]:
    """The response parameters an answer carries (none for a plain dict)."""
    return outputs.parameters if isinstance(outputs, ModelAnswer) else {}
