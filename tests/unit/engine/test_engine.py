"""The engine end to end on a tiny random Llama: every request ends exactly once
with the output it would have had alone, whatever joins, leaves, is aborted or
preempted; nothing leaks; bad requests are refused before anything runs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from carpool.config import EngineConfig
from carpool.engine.engine import Engine
from carpool.engine.request_output import RequestOutput
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.sequence import FinishReason, Sequence
from carpool.errors import InvalidRequest
from carpool.models.causal_lm import LoadedLM, load_causal_lm
from carpool.workers.factory import engine_for
from tests import tiny_models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm_folder: Path) -> LoadedLM:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_models.build("llama", folder, smollm_folder)
    return load_causal_lm(folder, progress=False)


def run(engine: Engine, check: bool = True) -> dict[str, RequestOutput]:
    """Step until idle; the final output of each request (asserting it is final once)."""
    final: dict[str, RequestOutput] = {}
    while engine.has_work:
        for out in engine.step():
            assert out.request_id not in final, f"{out.request_id} finished twice"
            if out.finished:
                final[out.request_id] = out
        if check:
            engine.scheduler.check([*engine.scheduler.running, *engine.scheduler.waiting])
    return final


def alone(lm: LoadedLM, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = engine_for(lm, EngineConfig(kv_cache_memory="64MiB"))
    engine.add_request("x", prompt, params)
    return run(engine)["x"].outputs[0].token_ids


@pytest.mark.parametrize("overlap", [False, True], ids=["waiting", "launched"])
def test_60_random_requests_with_aborts_and_preemption(tiny: LoadedLM, overlap: bool) -> None:
    """(``launched``: with asynchronous scheduling, each step launched before the
    last one lands: the same outputs as alone, without it.) Each request is run alone
    again to compare: the suite's time bounds how many."""
    rng = random.Random(7)
    # 40 blocks of 16 tokens: far less than the requests need together.
    config = EngineConfig(
        block_size=16, max_num_batched_tokens=96, max_num_seqs=16, async_scheduling=overlap
    )
    engine = engine_for(tiny, config, num_blocks=40)
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    final: dict[str, RequestOutput] = {}
    pending = list(range(60))
    while pending or engine.has_work:
        for _ in range(rng.randint(0, 4)):
            if pending:
                i = pending.pop(0)
                prompt = [rng.randrange(3, tiny_models.VOCAB) for _ in range(rng.randint(1, 200))]
                params = SamplingParams(
                    max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True
                )
                requests[str(i)] = (prompt, params)
                engine.add_request(str(i), prompt, params, priority=rng.choice([0, 0, 1]))
        if requests and rng.random() < 0.08:
            victim = rng.choice(sorted(requests))
            if victim not in final:
                engine.abort(victim)
                aborted.add(victim)
        for out in engine.step():
            assert out.request_id not in final, f"{out.request_id} finished twice"
            if out.finished:
                final[out.request_id] = out
        engine.scheduler.check([*engine.scheduler.running, *engine.scheduler.waiting])
    assert set(final) == set(requests)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.num_unfinished == 0
    assert (engine.stats.snapshot().launched_steps > 60) is overlap
    for rid, out in final.items():
        prompt, params = requests[rid]
        reason = out.outputs[0].finish_reason
        if reason is FinishReason.ABORT:
            assert rid in aborted
            continue
        assert reason is FinishReason.LENGTH
        assert out.outputs[0].token_ids == alone(tiny, prompt, params), f"request {rid}"


def test_the_attention_kernel_setting_takes_effect_and_keeps_the_outputs(tiny: LoadedLM) -> None:
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(5)]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs = {}
    for kernel in ("torch", "native"):
        engine = engine_for(tiny, EngineConfig(attention_kernel=kernel))
        assert (engine.runner.decode_kernel is None) == (kernel == "torch")
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy)
        outputs[kernel] = {rid: out.outputs[0].token_ids for rid, out in run(engine).items()}
    assert outputs["native"] == outputs["torch"]


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_crowd(tiny: LoadedLM) -> None:
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = list(range(10, 30))
    by_itself = alone(tiny, prompt, seeded)
    engine = engine_for(tiny, EngineConfig())
    for i in range(6):
        engine.add_request(
            f"noise{i}", list(range(40 + i, 90)), SamplingParams(max_tokens=30, temperature=1.0)
        )
    engine.add_request("seeded", prompt, seeded)
    assert run(engine)["seeded"].outputs[0].token_ids == by_itself


def test_n_sequences_share_the_prompt_and_differ(tiny: LoadedLM) -> None:
    engine = engine_for(tiny, EngineConfig())
    params = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    engine.add_request("r", list(range(5, 60)), params)
    out = run(engine)["r"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 16 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3


def test_stop_string_ends_generation_and_never_shows(smollm: LoadedLM) -> None:
    prompt = smollm.tokenizer.encode("The capital of France is")
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    engine = engine_for(smollm, EngineConfig(kv_cache_memory="64MiB"))
    engine.add_request("free", prompt, greedy)
    free_text = run(engine)["free"].outputs[0].text
    assert "Paris" in free_text
    stop = "Paris"
    engine.add_request(
        "stopped", prompt, SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,))
    )
    out = run(engine)["stopped"].outputs[0]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    assert out.text == free_text[: free_text.index(stop)]


def test_streamed_pieces_join_to_the_final_text(smollm: LoadedLM) -> None:
    engine = engine_for(smollm, EngineConfig(kv_cache_memory="64MiB"))
    engine.add_request(
        "r", smollm.tokenizer.encode("Tell me a story:"), SamplingParams(max_tokens=20)
    )
    pieces, final = [], None
    while engine.has_work:
        for out in engine.step():
            pieces.append(out.outputs[0].new_text)
            final = out
    assert final is not None and final.finished
    assert "".join(pieces) == final.outputs[0].text
    assert final.outputs[0].text == smollm.tokenizer.decode(
        [t for t in final.outputs[0].token_ids if t not in smollm.eos_token_ids],
        skip_special_tokens=True,
    )


@pytest.mark.parametrize(
    ("prompt_len", "params", "param"),
    [
        (0, SamplingParams(), "prompt"),
        (2048, SamplingParams(), "prompt"),
        (2000, SamplingParams(max_tokens=100), "max_tokens"),
    ],
)
def test_bad_requests_are_refused_before_anything_runs(
    tiny: LoadedLM, prompt_len: int, params: SamplingParams, param: str
) -> None:
    engine = engine_for(tiny, EngineConfig())
    with pytest.raises(InvalidRequest) as info:
        engine.add_request("r", [5] * prompt_len, params)
    assert info.value.param == param
    assert not engine.has_work


def test_the_context_never_exceeds_the_kv_pool(tiny: LoadedLM) -> None:
    engine = engine_for(tiny, EngineConfig(block_size=16), num_blocks=4)
    assert engine.max_model_len == 64  # the model allows 2048; the pool holds 64
    with pytest.raises(InvalidRequest, match="64 tokens") as info:
        engine.add_request("r", [5] * 60, SamplingParams(max_tokens=10))
    assert info.value.param == "max_tokens"


def test_truncation_keeps_the_prompts_end(tiny: LoadedLM) -> None:
    engine = engine_for(tiny, EngineConfig())
    engine.add_request("r", [7] * 5000, SamplingParams(max_tokens=2, truncate_prompt_tokens=100))
    assert run(engine)["r"].prompt_token_ids == [7] * 100


def test_a_model_failure_fails_only_its_request(tiny: LoadedLM) -> None:
    poison = 13

    class Faulty(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner
            self.config = inner.config

        def forward(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
            if bool((input_ids == poison).any()):
                raise RuntimeError("injected fault")
            return self.inner(input_ids, *args)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return self.inner.compute_logits(hidden)

    faulty = LoadedLM(**{**tiny.__dict__, "model": Faulty(tiny.model)})
    engine = engine_for(faulty, EngineConfig())
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("good1", [20, 21, 22], params)
    engine.add_request("bad", [20, poison, 22], params)
    engine.add_request("good2", [30, 31], params)
    final = run(engine)
    assert final["bad"].error and final["bad"].outputs[0].finish_reason is FinishReason.ABORT
    for rid, prompt in (("good1", [20, 21, 22]), ("good2", [30, 31])):
        assert final[rid].error is None
        assert final[rid].outputs[0].token_ids == alone(tiny, prompt, params)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_ids_the_model_may_not_see_are_refused_before_it_runs() -> None:
    from carpool.engine.outputs import ScheduledChunk
    from carpool.engine.runner import Launch
    from carpool.workers.step_tensors import check_ids, chunk_ids, first_ids

    in_flight = Launch({"a": 0, "b": 1}, None)
    check_ids([5, 6, 7], None)
    check_ids([5, -2, -3], in_flight)  # the pending ids of rows 0 and 1
    for ids, after in (
        ([5, -1], in_flight),
        ([5, -4], in_flight),  # row 2: not one of the flight's
        ([-2], None),
        ([-(2**40)], in_flight),
    ):
        with pytest.raises(ValueError, match="placeholder"):
            check_ids(ids, after)
    # A sequence whose last token is pending runs it as the flight's row for it.
    b = Sequence("b", [7, 8, 9], max_tokens=4, arrival=0.0)
    b.num_computed, b.num_pending = 2, 1
    chunk = ScheduledChunk.of(b, 2)
    assert chunk.pending and chunk.input_ids == [9]
    assert chunk_ids(chunk, in_flight) == [9, -3]
    with pytest.raises(ValueError, match="no step in flight"):
        chunk_ids(chunk, Launch({"a": 0}, None))
    # A decode step's rows: a known token as itself, a pending one as its flight's row.
    a = Sequence("a", [4, 5], max_tokens=4, arrival=0.0)
    a.num_computed = 1
    b.num_computed = 3
    decodes = [ScheduledChunk.of(a, 1), ScheduledChunk.of(b, 1)]
    assert first_ids(decodes, in_flight) == [5, -3]
    with pytest.raises(ValueError, match="no step in flight"):
        first_ids(decodes, None)
