"""A hybrid model's KV cache in one shared pool against two (``HybridBlockManager``):
the same long requests on the same ``--kv-cache-memory``, greedy, side by side.

The model is random-weight Gemma 3 text at a small width with Gemma 3's layer pattern
(five sliding layers to one global, here with a 64-token window), built with
transformers; the requests are longer than the window, so with two pools the
sliding layers' blocks behind it are released and the global layers' pool holds the
rest of the memory. Printed per layout: the blocks each pool got, how many
sequences ran at once at most, preemptions, engine steps and wall time; the tokens
must be the same in both.

    python -m benchmarks.hybrid_kv [--requests 8 --prompt 600 --output 64 --kv 6MiB]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from carpool.config import EngineConfig, default_cache_dir
from carpool.engine.block_manager import HybridBlockManager
from carpool.engine.engine import Engine
from carpool.engine.sampling_params import SamplingParams
from carpool.models.causal_lm import LoadedLM, convert_gguf, load_causal_lm
from carpool.models.decode_kernel import select_decode_kernel
from carpool.models.registry import BUILTIN_MODELS
from carpool.workers.factory import engine_for
from carpool.workers.model_runner import ModelRunner
from tests import tiny_models

WINDOW = 64
PATTERN = ["sliding_attention"] * 5 + ["full_attention"]


def build(folder: Path) -> LoadedLM:
    tiny_models.build(
        "gemma3",
        folder,
        convert_gguf(BUILTIN_MODELS["smollm2-135m-instruct"].locate(), default_cache_dir()),
        sliding_window=WINDOW,
        num_hidden_layers=len(PATTERN),
        layer_types=PATTERN,
        hidden_size=128,
        intermediate_size=256,
    )
    return load_causal_lm(folder, progress=False)


def one_pool(lm: LoadedLM, config: EngineConfig) -> Engine:
    """``engine_for``'s CPU engine with every layer in one pool (as before hybrid pools)."""
    config = config.for_device("cpu")
    memory = config.kv_cache_bytes
    assert memory is not None
    blocks = ModelRunner.blocks_for_memory(lm, memory, config.block_size)
    kernel, _ = select_decode_kernel(config.attention_kernel, lm.device, lm.dtype)
    return Engine(ModelRunner(lm, blocks, config.block_size, kernel, lm.paths), config)


def run(engine: Engine, prompts: list[list[int]], output: int) -> dict[str, object]:
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {}
    steps, most = 0, 0
    started = time.perf_counter()
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        steps += 1
        most = max(most, len(engine.scheduler.running))
    blocks = engine.blocks
    pools = (
        f"{blocks.full.num_blocks} + {blocks.windowed.num_blocks} windowed"
        if isinstance(blocks, HybridBlockManager)
        else f"{blocks.num_blocks} shared"
    )
    return {
        "pools": pools,
        "most_at_once": most,
        "preemptions": engine.scheduler.num_preemptions,
        "steps": steps,
        "seconds": time.perf_counter() - started,
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=600)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--kv", default="6MiB", help="kv_cache_memory for both layouts")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    lm = build(Path(tempfile.mkdtemp(prefix="carpool-hybrid-kv-")))
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, tiny_models.VOCAB, (args.requests, args.prompt), generator=generator)
    config = EngineConfig(kv_cache_memory=args.kv, max_num_seqs=args.requests)
    print(
        f"machine: {platform.machine()} {platform.processor()}, {torch.get_num_threads()} threads"
    )
    print(f"command: python -m benchmarks.hybrid_kv {' '.join(sys.argv[1:])}")
    print(f"{args.requests} requests of {args.prompt} prompt + {args.output} output tokens, "
          f"window {WINDOW}, 5 sliding layers to 1 global, kv {args.kv}")  # fmt: skip
    seconds: dict[str, list[float]] = {"one pool": [], "two pools": []}
    results: dict[str, dict[str, object]] = {}
    for _ in range(args.rounds):
        for name, make in (("one pool", one_pool), ("two pools", engine_for)):
            result = run(make(lm, config), prompts.tolist(), args.output)
            seconds[name].append(float(result["seconds"]))  # type: ignore[arg-type]
            results[name] = result
    same = results["one pool"]["tokens"] == results["two pools"]["tokens"]
    for name, result in results.items():
        print(f"{name:>9}: blocks {result['pools']}; at most {result['most_at_once']} running; "
              f"{result['preemptions']} preemptions; {result['steps']} steps; "
              f"median {statistics.median(seconds[name]):.2f} s")  # fmt: skip
    ratio = statistics.median(seconds["one pool"]) / statistics.median(seconds["two pools"])
    print(f"two pools / one pool speed: {ratio:.2f}x; same tokens: {same}")


if __name__ == "__main__":
    main()
