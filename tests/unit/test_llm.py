"""The offline API: outputs come back in the prompts' order, each what the engine
gives that prompt alone; its own step budget takes effect unless one is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool import LLM, SamplingParams
from carpool.config import EngineConfig
from carpool.errors import InvalidRequest
from carpool.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS
from carpool.workers.factory import engine_for
from tests import tiny_models


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory, smollm_folder: Path) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-offline")
    tiny_models.build("llama", folder, smollm_folder)
    return folder


def test_outputs_come_in_order_each_as_if_alone(tiny_folder: Path) -> None:
    llm = LLM(str(tiny_folder))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [list(range(5, 40)), list(range(300, 302)), list(range(50, 60))]
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12, 12]
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == alone(llm, prompt, greedy)


def alone(llm: LLM, ids: list[int], params: SamplingParams) -> list[int]:
    engine = engine_for(llm.lm, EngineConfig())
    engine.add_request("alone", ids, params)
    final = [o for _ in iter(lambda: engine.has_work, False) for o in engine.step() if o.finished]
    assert len(final) == 1
    return final[0].outputs[0].token_ids


def test_text_and_chat_prompts_on_the_builtin_model(smollm_folder: Path) -> None:
    llm = LLM("smollm2-135m-instruct")  # converted already, in the session's cache
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    [text] = llm.generate("The capital of France is", greedy, use_tqdm=False)
    assert "Paris" in text.outputs[0].text
    [chat] = llm.chat([[{"role": "user", "content": "Hi"}]], greedy, use_tqdm=False)
    assert llm.tokenizer.decode(chat.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert chat.outputs[0].token_ids


def test_the_offline_step_budget_is_larger_unless_given(tiny_folder: Path) -> None:
    assert LLM(str(tiny_folder)).engine.config.max_num_batched_tokens == (
        OFFLINE_MAX_NUM_BATCHED_TOKENS
    )
    llm = LLM(str(tiny_folder), max_num_batched_tokens=64)
    assert llm.engine.scheduler.config.max_num_batched_tokens == 64


def test_bad_uses_are_refused(tiny_folder: Path) -> None:
    with pytest.raises(InvalidRequest, match="not a generator"):
        LLM("all-minilm-l6-v2")
    llm = LLM(str(tiny_folder))
    with pytest.raises(InvalidRequest, match="2 sampling params for 1 prompts"):
        llm.generate([[5, 6]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(InvalidRequest, match="has no chat template"):
        llm.chat([[{"role": "user", "content": "Hi"}]], use_tqdm=False)
