"""A model's generation_config.json gives the sampling defaults of requests that leave
a field unset (vLLM's behaviour); what a request sets wins; a bad value in the file
is left out."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from carpool.config import ConfigError
from carpool.models.generation_defaults import read_generation_defaults
from carpool.server.bootstrap import sampling_defaults
from carpool.server.generation.generation_inputs import sampling_params
from carpool.server.generation.schemas import ChatCompletionRequest

QWEN3 = {  # Qwen3-0.6B's generation_config.json
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def test_the_file_gives_the_sampling_fields(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3 | {"max_new_tokens": 64}))
    assert read_generation_defaults(tmp_path) == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "max_tokens": 64,
    }
    assert read_generation_defaults(tmp_path / "absent") == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": -1, "top_p": "high", "top_k": True, "min_p": 0.1})
    )
    assert read_generation_defaults(tmp_path) == {"min_p": 0.1}


def served(defaults: dict[str, Any]) -> Any:
    return SimpleNamespace(generation_defaults=defaults, max_model_len=1000)


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    )


def test_unset_fields_take_the_models_defaults_and_set_ones_win() -> None:
    model = served({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 64})
    params = sampling_params(model, chat(), 10, None, None)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (
        0.6,
        20,
        0.95,
        64,
    )
    mine = sampling_params(model, chat(temperature=0, top_k=0, top_p=1), 10, 5, None)
    assert (mine.temperature, mine.top_k, mine.top_p, mine.max_tokens) == (0, 0, 1, 5)
    # max_new_tokens never runs past the context
    assert sampling_params(model, chat(), 980, None, None).max_tokens == 20
    plain = sampling_params(served({}), chat(), 10, None, None)
    assert (plain.temperature, plain.top_k, plain.top_p, plain.max_tokens) == (1.0, 0, 1.0, 990)


def test_the_generation_config_flag_picks_whose_defaults_apply(tmp_path: Path) -> None:
    lm: Any = SimpleNamespace(generation_defaults={"top_k": 20})
    assert sampling_defaults(lm, "auto") == {"top_k": 20}
    assert sampling_defaults(lm, "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert sampling_defaults(lm, str(tmp_path)) == {"top_p": 0.5}
    with pytest.raises(ConfigError, match=r"no generation_config\.json"):
        sampling_defaults(lm, str(tmp_path / "elsewhere"))
