"""A generation model behind Triton's tensors, as Triton's vLLM backend shows an LLM:
``text_input`` (and ``stream``, ``sampling_parameters`` as JSON text, or the request's
parameters, ``exclude_input_in_output``, ``return_finish_reason``,
``return_num_input_tokens``, ``return_num_output_tokens``) in; ``text_output`` (and
``finish_reason``, ``num_input_tokens``, ``num_output_tokens``) out. One response
with the whole text (after the prompt, unless ``exclude_input_in_output``), or with
``stream`` one per step with the step's new text.

An adapter over the completions path: the request becomes a ``CompletionRequest``
and is tokenized and started as ``/v1/completions`` does. Sampling parameters take
vLLM's names and defaults (``max_tokens`` 16, ``temperature`` 1), and, as vLLM's
backend reads them, numbers and booleans written as text.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError

from carpool.config import BatchingConfig
from carpool.engine.request_output import RequestOutput
from carpool.errors import InvalidRequest
from carpool.repository.spec import ModelSpec, Source, check_inputs
from carpool.repository.vllm_model import INPUTS, OUTPUTS
from carpool.server.generation.generation_inputs import prompt_token_ids, sampling_params
from carpool.server.generation.schemas import CompletionRequest

Arrays = dict[str, np.ndarray[Any, Any]]

# Each extra output, and the input that asks for it.
EXTRA_OUTPUTS = {
    "finish_reason": "return_finish_reason",
    "num_input_tokens": "return_num_input_tokens",
    "num_output_tokens": "return_num_output_tokens",
}

# vLLM's sampling parameters carpool takes, by the type their text is read as (a
# list: read as JSON, ``stop`` as it is).
_KINDS: dict[str, type] = {
    **dict.fromkeys(("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"), float),
    **dict.fromkeys(("max_tokens", "top_k", "min_tokens", "seed", "n"), int),
    **dict.fromkeys(("ignore_eos", "skip_special_tokens"), bool),
    **dict.fromkeys(("stop", "stop_token_ids"), list),
}  # fmt: skip
# Request parameters that are Triton's or carpool's, not sampling parameters.
_NOT_SAMPLING = ("stream", "priority", "timeout")
VLLM_MAX_TOKENS = 16  # vLLM's SamplingParams default


def llm_spec(name: str, version: int = 1) -> ModelSpec:
    """The tensors of a generation model as Triton's vLLM backend declares them."""
    return ModelSpec(
        name=name,
        version=version,
        max_batch_size=0,
        inputs=INPUTS,
        outputs=OUTPUTS,
        batching=BatchingConfig(),
        source=Source("vllm", ""),
        dynamic_batching=False,
        decoupled=True,
    )


@dataclass(frozen=True)
class LlmRequest:
    """What a request to the LLM's tensors asks."""

    prompt: str
    stream: bool
    prepend_prompt: bool
    sampling: Mapping[str, Any]
    extra_outputs: frozenset[str]


def read_request(spec: ModelSpec, arrays: Arrays, params: Mapping[str, Any]) -> LlmRequest:
    """The request in ``arrays`` (and ``params``, the request's parameters);
    ``InvalidRequest`` naming the input or parameter that is wrong."""
    checked = check_inputs(spec, arrays).arrays

    def flag(name: str) -> bool | None:
        value = checked.get(name)
        return None if value is None else bool(value.reshape(-1)[0])

    prompt = _text(checked["text_input"], "text_input")
    stream = bool(flag("stream"))
    exclude = flag("exclude_input_in_output")
    if stream and exclude is False:
        raise InvalidRequest(
            "exclude_input_in_output false is not allowed when streaming (as in Triton's "
            "vLLM backend)",
            param="exclude_input_in_output",
        )
    if "sampling_parameters" in checked:
        text = _text(checked["sampling_parameters"], "sampling_parameters")
        try:
            sampling = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            raise InvalidRequest(
                "sampling_parameters must be a JSON object", param="sampling_parameters"
            ) from None
        if not isinstance(sampling, dict):
            raise InvalidRequest(
                "sampling_parameters must be a JSON object", param="sampling_parameters"
            )
    else:
        sampling = {k: v for k, v in params.items() if k not in _NOT_SAMPLING}
    return LlmRequest(
        prompt,
        stream,
        prepend_prompt=not stream and not exclude,
        sampling=sampling,
        extra_outputs=frozenset(o for o, asked in EXTRA_OUTPUTS.items() if flag(asked)),
    )


def _text(array: np.ndarray[Any, Any], name: str) -> str:
    if array.size != 1:
        raise InvalidRequest(f"input '{name}' must hold one string", param=name)
    try:
        return bytes(array.reshape(-1)[0]).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"input '{name}' is not UTF-8 text", param=name) from None


def as_completion(model: str, request: LlmRequest) -> CompletionRequest:
    """The completion request that asks what ``request`` asks, with vLLM's defaults."""
    fields: dict[str, Any] = {"model": model, "prompt": request.prompt}
    fields["max_tokens"] = VLLM_MAX_TOKENS
    for key, value in request.sampling.items():
        fields[key] = _sampling_value(key, value)
    try:
        return CompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = str(first["loc"][0]) if first["loc"] else "sampling_parameters"
        raise InvalidRequest(
            f"sampling parameter '{key}': {first['msg']}", param="sampling_parameters"
        ) from None


def _sampling_value(key: str, value: Any) -> Any:
    """A sampling parameter's value, read from text where it is text."""
    kind = _KINDS.get(key)
    if kind is None:
        raise InvalidRequest(
            f"sampling parameter '{key}' is not one carpool takes (it takes {', '.join(_KINDS)})",
            param="sampling_parameters",
        )
    if not isinstance(value, str) or key == "stop":
        return value
    try:
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError(value)
            return value.lower() == "true"
        if kind is list:
            return json.loads(value)
        return kind(value)
    except (ValueError, json.JSONDecodeError):
        raise InvalidRequest(
            f"sampling parameter '{key}' has the value {value!r}", param="sampling_parameters"
        ) from None


async def responses(served: Any, models: Any, request: LlmRequest) -> AsyncGenerator[Arrays, None]:
    """Each response's outputs: one for the whole text, or one per step when
    streaming. ``served`` is a ``ServedGenerator``, ``models`` its ``ServedModels``."""
    completion = as_completion(served.name, request)
    prompts = await prompt_token_ids(models, served, completion.prompt, completion)
    params = sampling_params(served, completion, len(prompts[0]), completion.max_tokens, None)
    stream = served.engine.start_many(
        prompts, [params], priority=completion.priority, timeout_s=served.timeout(None)
    )[0]
    try:
        if request.stream:
            async for out in stream:
                texts = [o.new_text for o in out.outputs]
                yield _outputs(out, texts, [len(o.new_token_ids) for o in out.outputs], request)
            return
        final = await stream.final()
        prefix = request.prompt if request.prepend_prompt else ""
        texts = [prefix + o.text for o in final.outputs]
        yield _outputs(final, texts, [len(o.token_ids) for o in final.outputs], request)
    finally:
        stream.close()


def _outputs(
    out: RequestOutput, texts: list[str], new_tokens: list[int], request: LlmRequest
) -> Arrays:
    """One response: a text per sequence (``n``), and the extra outputs asked for."""
    arrays: Arrays = {"text_output": np.array([t.encode() for t in texts], dtype=np.object_)}
    reasons = [o.finish_reason.value if o.finish_reason else "None" for o in out.outputs]
    values = {
        "finish_reason": np.array([r.encode() for r in reasons], dtype=np.object_),
        "num_input_tokens": np.array([len(out.prompt_token_ids)], np.uint32),
        "num_output_tokens": np.array(new_tokens, np.uint32),
    }
    arrays.update({name: values[name] for name in request.extra_outputs})
    return arrays
