"""``kv_cache_dtype``: the cache's dtype follows it (auto: the model's), the same
memory holds twice the blocks in float16, and a GPU refuses a dtype its kernels
do not read."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from carpool.config import ConfigError, EngineConfig
from carpool.engine.sampling_params import SamplingParams
from carpool.models.causal_lm import LoadedLM
from carpool.workers.factory import engine_for, kv_cache_dtype
from carpool.workers.model_runner import ModelRunner


def test_the_cache_holds_the_dtype_asked_for_and_twice_the_blocks_in_half(
    smollm: LoadedLM,
) -> None:
    engines = {
        dtype: engine_for(smollm, EngineConfig(kv_cache_memory="8MiB", kv_cache_dtype=dtype))
        for dtype in ("auto", "float16")
    }
    runners = {d: cast(ModelRunner, e.runner) for d, e in engines.items()}
    assert {c.dtype for c in runners["auto"].caches} == {torch.float32}
    assert {c.dtype for c in runners["float16"].caches} == {torch.float16}
    assert runners["float16"].num_blocks == 2 * runners["auto"].num_blocks
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for dtype, engine in engines.items():
        engine.add_request(dtype, [1, 2, 3, 4, 5], params)
        while engine.has_work:
            for out in engine.step():
                if out.finished:
                    outputs[dtype] = list(out.outputs[0].token_ids)
    # the built-in model's greedy tokens do not move for a rounding of its cache
    assert outputs["float16"] == outputs["auto"] and len(outputs["auto"]) == 8


def test_auto_is_the_models_dtype_and_a_gpu_takes_only_that() -> None:
    def lm(device: str, dtype: torch.dtype) -> Any:
        return SimpleNamespace(device=torch.device(device), dtype=dtype)

    assert kv_cache_dtype(lm("cpu", torch.float32), EngineConfig()) is torch.float32
    half = EngineConfig(kv_cache_dtype="float16")
    assert kv_cache_dtype(lm("cpu", torch.float32), half) is torch.float16
    assert kv_cache_dtype(lm("cuda", torch.float16), half) is torch.float16
    with pytest.raises(ValueError, match="on a GPU the KV cache holds the model's dtype"):
        kv_cache_dtype(lm("cuda", torch.bfloat16), half)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto"):
        EngineConfig(kv_cache_dtype="fp8")
