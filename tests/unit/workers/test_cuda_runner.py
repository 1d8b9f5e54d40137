"""The GPU's runner (``CudaModelRunner``): Triton paged attention with rows in step
order, decode steps from CUDA graphs, bfloat16 by default.

Without a GPU its eager path runs on the CPU under Triton's interpreter and must
give transformers' greedy tokens, alone and batched, with prompts prefilled in
chunks and a prefix taken from the cache. On a GPU: the same with CUDA graphs;
graphs and eager steps agree exactly in float32; and in bfloat16, checked by
teacher forcing against transformers (bfloat16 and float32): every token carpool
chose is within ``MARGIN`` nats of transformers' best at its position.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from carpool.config import ConfigError, EngineConfig  # noqa: E402
from carpool.engine.block_manager import HybridBlockManager  # noqa: E402
from carpool.engine.engine import Engine  # noqa: E402
from carpool.engine.sampling_params import SamplingParams  # noqa: E402
from carpool.models.causal_lm import LoadedLM, load_causal_lm  # noqa: E402
from carpool.workers.cuda_runner import CudaModelRunner  # noqa: E402
from carpool.workers.factory import engine_for  # noqa: E402
from tests import tiny_models  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
ONLY_CUDA = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# Teacher forcing's bound on how far below transformers' best token carpool's
# bfloat16 choice may be, in log-probability (nats). Measured on an H100, worst over
# the 20 prompts it then had, alone and batched: 0.250 with the unfused layer, 0.812 once the
# residual add + RMSNorm and SiLU x up were fused (each rounds once where transformers
# rounds twice), against this bound's first value of 0.5.
MARGIN = 1.0


# A request's final tokens, text and finish reason.
Final = tuple[list[int], str, object]


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, ``max_tokens`` of them, run together."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [tokens for tokens, _, _ in finals(engine, prompts, [params] * len(prompts))]


def finals(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Final]:
    """Run each prompt with its parameters together; each request's ``Final``."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                done[out.request_id] = (o.token_ids, o.text, o.finish_reason)
    return [done[str(i)] for i in range(len(prompts))]


def gpu_engine(lm: LoadedLM, graphs: bool = CUDA, window_blocks: int = 0, **config: Any) -> Engine:
    """An engine on ``CudaModelRunner`` (on the CPU: eager, interpreted kernels;
    ``window_blocks``: a hybrid model's windowed pool there, which ``engine_for``
    sizes on a GPU)."""
    engine_config = EngineConfig(**{"kv_cache_memory": "32MiB", **config})
    if CUDA:
        return engine_for(lm, dataclasses.replace(engine_config, cuda_graphs=graphs))
    runner = CudaModelRunner(
        lm,
        128,
        16,
        (),
        engine_config.max_num_seqs,
        2048,
        cuda_graphs=False,
        max_passes=engine_config.num_scheduler_steps,
        window_blocks=window_blocks,
        prompt_graphs=engine_config.cuda_graph_prompts,
        max_num_batched_tokens=engine_config.for_device("cpu").max_num_batched_tokens,
    )
    return Engine(runner, engine_config)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_tiny_models_match_transformers_alone_batched_and_cached(
    arch: str, tmp_path: Path, smollm_folder: Path
) -> None:
    reference = tiny_models.build(arch, tmp_path, smollm_folder).to(DEVICE)
    lm = load_causal_lm(tmp_path, progress=False, device=DEVICE)
    rng = random.Random(arch)
    shared = [rng.randrange(3, tiny_models.VOCAB) for _ in range(40)]
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (1, 9, 70)] + [
        [*shared, 5, 6, 7]
    ]
    expected = [tiny_models.hf_greedy(reference, p, 10) for p in prompts]
    if arch == "llama":  # one by one once: the architectures share that path (suite time)
        assert [run(gpu_engine(lm), [p], 10)[0] for p in prompts] == expected
    # Batched with a small step budget: the long prompt in chunks while others decode.
    engine = gpu_engine(lm, max_num_batched_tokens=32)
    assert run(engine, prompts, 10) == expected
    # The shared prompt's first 32 tokens now come from the prefix cache.
    hits = engine.blocks.stats.hits
    assert run(engine, [[*shared, 9, 9]], 10) == [
        tiny_models.hf_greedy(reference, [*shared, 9, 9], 10)
    ]
    assert engine.blocks.stats.hits > hits


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "phi3"])
def test_the_newer_architectures_match_transformers_batched(
    arch: str, tmp_path: Path, smollm_folder: Path
) -> None:
    """Q/K norms and per-layer rotary tables (Qwen3, Gemma 3), LongRoPE (Phi-3) on the
    GPU runner's kernels: one batched run, prompts prefilled in chunks (the suite's
    time: the one-by-one runs above cover what the architectures share)."""
    reference = tiny_models.build(arch, tmp_path, smollm_folder).to(DEVICE)
    lm = load_causal_lm(tmp_path, progress=False, device=DEVICE)
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (1, 9, 70)]
    expected = [tiny_models.hf_greedy(reference, p, 10) for p in prompts]
    assert run(gpu_engine(lm, max_num_batched_tokens=32), prompts, 10) == expected


def test_a_sliding_window_matches_transformers_past_it(tmp_path: Path, smollm_folder: Path) -> None:
    """Gemma 3's sliding layer with a window of 16 beside its global one: prompts
    prefilled in tiles that start past the window, decodes past it, four passes a
    decode step. The sliding layer keeps its KV in a pool of its own of 12 blocks
    (three sequences' windows), shorter than the longest sequence: its blocks behind
    the window are released, in eager steps and in the decode steps' buffers alike."""
    reference = tiny_models.build("gemma3", tmp_path, smollm_folder, sliding_window=16)
    lm = load_causal_lm(tmp_path, progress=False, device=DEVICE)
    rng = random.Random("mistral")  # prompts whose tokens the window changes
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (5, 23, 180)]
    expected = [tiny_models.hf_greedy(reference, p, 24) for p in prompts]
    config = {"max_num_batched_tokens": 32, "max_num_seqs": 3, "num_scheduler_steps": 4}
    engine = gpu_engine(lm, window_blocks=12, **config)
    assert isinstance(engine.blocks, HybridBlockManager)
    assert engine.blocks.windowed.num_usable * 16 < 180 + 24
    assert run(engine, prompts, 24) == expected


def test_multi_step_decoding_gives_the_tokens_of_one_step_at_a_time(
    tmp_path: Path, smollm_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Four passes a step: greedy rows take three tokens more per step, fed back on
    the device; a sampled row, one that ends on EOS or its length mid-step, and one
    with a stop string end as they do one token a step."""
    tiny_models.build("llama", tmp_path, smollm_folder)
    lm = load_causal_lm(tmp_path, progress=False, device=DEVICE)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (3, 20, 50)]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0.0),  # may end on EOS
        SamplingParams(max_tokens=9, temperature=0.8, seed=5),  # one token a step
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=["e"]),
    ]
    prompts.append(prompts[0])

    def outputs(steps: int) -> tuple[list[Final], int]:
        engine = gpu_engine(lm, num_scheduler_steps=steps, max_num_batched_tokens=64)
        return finals(engine, prompts, params), engine.stats.snapshot().steps

    with caplog.at_level(logging.ERROR):
        one, steps_one = outputs(1)
        four, steps_four = outputs(4)
    assert four == one
    assert steps_four < steps_one
    # Mixed steps (prompts prefilling while others decode) ran whole: none was
    # retried chunk by chunk after a failure (placeholder ids must never reach the
    # model: on a GPU that is a device-side assert, not an exception).
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


def test_launched_steps_give_the_tokens_of_steps_that_wait(
    tmp_path: Path, smollm_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Asynchronous scheduling: each step launched before the last one's tokens are
    back (decode steps and mixed ones, each reading the tokens in flight on the
    device), with stops found a step late; the same tokens, texts and reasons as
    steps that wait, and a penalised request's steps waiting beside them."""
    tiny_models.build("llama", tmp_path, smollm_folder)
    lm = load_causal_lm(tmp_path, progress=False, device=DEVICE)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (3, 20, 50, 7)]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0.0),  # may end on EOS
        SamplingParams(max_tokens=9, temperature=0.8, seed=5),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=["e"]),
        SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3),
    ]
    prompts.append(prompts[0])

    def outputs(overlap: bool) -> tuple[list[Final], int]:
        engine = gpu_engine(lm, async_scheduling=overlap, max_num_batched_tokens=32)
        return finals(engine, prompts, params), engine.stats.snapshot().launched_steps

    with caplog.at_level(logging.ERROR):
        waiting, _ = outputs(False)
        launched, count = outputs(True)
    assert launched == waiting
    assert count >= 5  # once the penalised request is done, every step
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


def test_prompt_steps_on_persistent_buffers_give_the_tokens_of_eager_steps(
    tmp_path: Path, smollm_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cuda_graph_prompts``: steps with prompt chunks (prompts in chunks beside
    decodes, steps of every size in one bucket after another, so stale rows, tiles and
    sequences of a larger step sit in the buffers) run on the prompt graphs' padded
    buffers (replayed graphs on a GPU; here the same buffers, eagerly) and give the
    tokens, texts and reasons of eager steps, steps that wait and launched ones."""
    tiny_models.build("llama", tmp_path, smollm_folder)
    lm = load_causal_lm(tmp_path, progress=False, device=DEVICE)
    rng = random.Random(12)
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (5, 40, 17, 2)]
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, seed=3),
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, stop=["e"]),
        SamplingParams(max_tokens=7, temperature=0.0),
    ]
    config = {"max_num_batched_tokens": 24, "max_num_seqs": 8}

    def on_prompt_graphs(overlap: bool) -> tuple[list[Final], int]:
        """The finals, and how many steps ran on the prompt graphs' buffers."""
        engine = gpu_engine(lm, async_scheduling=overlap, cuda_graph_prompts=True, **config)
        graphs = engine.runner.prompts  # type: ignore[attr-defined]
        assert graphs is not None
        runs: list[int] = []
        real_run = graphs.run
        monkeypatch.setattr(graphs, "run", lambda size, n: runs.append(size) or real_run(size, n))
        return finals(engine, prompts, params), len(runs)

    for overlap in (False, True):
        eager = finals(gpu_engine(lm, async_scheduling=overlap, **config), prompts, params)
        graphed, runs = on_prompt_graphs(overlap)
        assert graphed == eager
        assert runs >= 3  # the prompts' steps ran there


def test_asking_for_a_gpu_that_is_not_there_is_a_configuration_error() -> None:
    if CUDA:
        pytest.skip("this machine has a GPU")
    from carpool import LLM

    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        LLM("smollm2-135m-instruct", device="cuda")


def test_dtype_and_kv_cache_memory_auto_resolve_per_device() -> None:
    config = EngineConfig()
    assert config.for_device("cpu").dtype == "float32"
    assert config.for_device("cuda").dtype == "bfloat16"
    assert EngineConfig(dtype="float32").for_device("cuda").dtype == "float32"
    assert (
        config.kv_cache_bytes is None
        and EngineConfig(kv_cache_memory="1GiB").kv_cache_bytes == 1 << 30
    )
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


@ONLY_CUDA
def test_graphs_and_eager_steps_give_the_same_tokens_in_float32(
    tmp_path: Path, smollm_folder: Path
) -> None:
    tiny_models.build("llama", tmp_path, smollm_folder)
    lm = load_causal_lm(tmp_path, progress=False, device="cuda")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in range(1, 40, 3)]
    graphed = gpu_engine(lm, graphs=True)
    assert graphed.runner.graphs is not None  # type: ignore[attr-defined]
    assert run(graphed, prompts, 24) == run(gpu_engine(lm, graphs=False), prompts, 24)


@ONLY_CUDA
def test_bfloat16_tokens_pass_teacher_forcing_alone_and_batched(smollm_folder: Path) -> None:
    from tests.unit.models.test_causal_lm import builtin_prompts, load_hf_builtin

    lm = load_causal_lm(smollm_folder, progress=False, device="cuda", dtype=torch.bfloat16)
    prompts = builtin_prompts(lm.tokenizer)
    batched = run(gpu_engine(lm, max_num_batched_tokens=512, kv_cache_memory="512MiB"), prompts, 24)
    alone = [run(gpu_engine(lm, kv_cache_memory="512MiB"), [p], 24)[0] for p in prompts]
    reference = load_hf_builtin().to("cuda")
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        model = reference.to(dtype)
        for prompt, tokens in [
            *zip(prompts, batched, strict=True),
            *zip(prompts, alone, strict=True),
        ]:
            worst = max(worst, teacher_forcing_gap(model, prompt, tokens))
    differ = sum(a != b for a, b in zip(alone, batched, strict=True))
    count = len(prompts)
    print(f"bf16: worst gap {worst:.3f} nats; {differ} of {count} prompts differ alone vs batched")
    assert worst <= MARGIN


def teacher_forcing_gap(model: Any, prompt: list[int], tokens: list[int]) -> float:
    """The largest, over ``tokens``' positions, of transformers' best log-probability
    minus that of the token carpool chose."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    return float((logprobs.max(dim=-1).values - chosen).max())
