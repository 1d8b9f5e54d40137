"""What one request to a repository model carries into its batch."""

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
