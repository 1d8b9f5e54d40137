"""carpool: an inference server in which requests share the ride.

``carpool.LLM`` and ``carpool.SamplingParams`` are the offline API; they are
imported on first use, so ``import carpool`` stays cheap (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from carpool.engine.llm import LLM
    from carpool.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from carpool.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from carpool.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'carpool' has no attribute {name!r}")
