"""The offline API (after vLLM's ``LLM.generate``): load a model, run many prompts
through the engine at once, get every output back in order."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from carpool.config import EngineConfig
from carpool.engine.request_output import RequestOutput
from carpool.engine.sampling_params import SamplingParams
from carpool.errors import InvalidRequest
from carpool.models import registry
from carpool.models.registry import LoadOptions, Task
from carpool.workers.factory import engine_for

Prompt = str | list[int]

# Offline, all prompts are known at once and no stream waits on a step, so steps may
# be larger than the server's (which keeps them short for inter-token latency); as
# vLLM's LLM does. 2048 measured 1.3x the tokens/s of 256 on the uniform workload
# here (8192: 1.1x).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048


class LLM:
    """``LLM("smollm2-135m-instruct").generate(["Hello"], SamplingParams(max_tokens=32))``.

    ``model`` is a built-in name, a Hugging Face folder or a ``.gguf`` file. Engine
    settings are ``EngineConfig``'s fields, as keyword arguments; the step budget
    ``max_num_batched_tokens`` defaults to ``OFFLINE_MAX_NUM_BATCHED_TOKENS`` here."""

    def __init__(
        self,
        model: str,
        *,
        device: str = "cpu",
        cache_dir: str | Path | None = None,
        **engine: object,
    ) -> None:
        source = registry.resolve(model)
        if source.task is not Task.GENERATE:
            raise InvalidRequest(f"{model!r} is a {source.task.value} model, not a generator")
        engine.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        config = EngineConfig(**engine).for_device(device)  # type: ignore[arg-type]
        options = LoadOptions(
            device=device,
            dtype=config.dtype,
            cache_dir=None if cache_dir is None else Path(cache_dir),
            weight_kernel=config.weight_kernel,
        )
        self.lm = registry.load(source, options)
        self.engine = engine_for(self.lm, config, cache_dir=options.cache_dir)
        self.tokenizer = self.lm.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt (text or token ids); outputs in the prompts' order. Each
        request is reported once, when it ends (``output_kind`` "final_only", as
        vLLM's ``LLM.generate``): no output is built per step."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        batch = list(prompts)
        params = _per_prompt(sampling_params, len(batch))
        base = self.engine.num_unfinished
        ids = [f"offline-{base}-{i}" for i in range(len(batch))]
        for rid, prompt, p in zip(ids, batch, params, strict=True):
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            self.engine.add_request(rid, tokens, dataclasses.replace(p, output_kind="final_only"))
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(batch), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_work:
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in ids]

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Each conversation rendered with the model's chat template, then generated."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(f"{self.lm.name!r} has no chat template; use generate")
        prompts: list[Prompt] = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    list(messages), add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )
            for messages in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise InvalidRequest(f"{len(params)} sampling params for {count} prompts")
    return list(params)
