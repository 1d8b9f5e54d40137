"""Triton's vLLM-backend tensors read into a completion request, and model.json read
into engine config values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.errors import InvalidRequest
from carpool.repository.errors import RepositoryError
from carpool.repository.vllm_model import read_model_json
from carpool.server.kserve.llm_tensors import as_completion, llm_spec, read_request

SPEC = llm_spec("llm")


def tensors(prompt: str = "hi", **flags: Any) -> dict[str, np.ndarray[Any, Any]]:
    arrays = {"text_input": np.array([prompt.encode()], dtype=np.object_)}
    for name, value in flags.items():
        if isinstance(value, bool):
            arrays[name] = np.array([value])
        else:
            arrays[name] = np.array([json.dumps(value).encode()], dtype=np.object_)
    return arrays


def test_sampling_parameters_as_text_take_their_types() -> None:
    sampling = {"temperature": "0.5", "max_tokens": "7", "ignore_eos": "true", "stop": ["\n"]}
    asked = read_request(SPEC, tensors(sampling_parameters=sampling), {})
    completion = as_completion("llm", asked)
    assert (completion.temperature, completion.max_tokens) == (0.5, 7)
    assert completion.ignore_eos is True and completion.stop == ["\n"]
    assert asked.prepend_prompt and not asked.stream


def test_request_parameters_stand_in_for_the_tensor_and_vllms_default_applies() -> None:
    asked = read_request(SPEC, tensors(), {"stream": False, "top_k": 3, "priority": 1})
    completion = as_completion("llm", asked)
    assert completion.top_k == 3 and completion.max_tokens == 16


def test_streaming_leaves_the_prompt_out_and_extra_outputs_are_asked_by_flag() -> None:
    asked = read_request(SPEC, tensors(stream=True, return_finish_reason=True), {})
    assert asked.stream and not asked.prepend_prompt
    assert asked.extra_outputs == {"finish_reason"}
    with pytest.raises(InvalidRequest, match="exclude_input_in_output"):
        read_request(SPEC, tensors(stream=True, exclude_input_in_output=False), {})


@pytest.mark.parametrize(
    ("sampling", "words"),
    [
        ({"temperature": "hot"}, "'temperature' has the value 'hot'"),
        ({"lora_name": "a"}, "'lora_name' is not one carpool takes"),
        ({"temperature": 9}, "sampling parameter 'temperature'"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_bad_sampling_parameters_are_named(sampling: Any, words: str) -> None:
    arrays = tensors(sampling_parameters=sampling)
    with pytest.raises(InvalidRequest, match=words):
        as_completion("llm", read_request(SPEC, arrays, {}))


def test_model_json_sets_shared_engine_arguments(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    path = tmp_path / "model.json"
    args = {"model": "weights", "max_model_len": 256, "dtype": "half", "enforce_eager": True}
    path.write_text(json.dumps(args))
    read = read_model_json(path)
    assert read.model == str(tmp_path / "weights")  # beside model.json
    assert dict(read.engine) == {"max_model_len": 256, "dtype": "float16"}
    assert read.ignored == ("enforce_eager",)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"max_model_len": 8}, "'model'"),
        ({"model": "m", "tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
        ({"model": "m", "quantization": "awq"}, "'quantization' is not one carpool takes"),
    ],
)
def test_model_json_that_cannot_be_honoured_is_named(
    tmp_path: Path, args: dict[str, Any], words: str
) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(args))
    with pytest.raises(RepositoryError, match=words):
        read_model_json(path)
