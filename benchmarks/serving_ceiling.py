"""How fast the host side alone can go: the engine with a runner that answers every
step at once (no model), offline and behind the HTTP server, 64 streams of 128
tokens each. Tokens are a fixed English text's, so detokenizing costs what it does
for real text. The offline figure is the engine's bookkeeping ceiling; the HTTP
figure adds the server (event loop, SSE framing, JSON, the client on the same
machine); their ratio bounds what over-HTTP/offline ratio any model could reach on
this machine's CPU, whatever its accelerator.

    python -m benchmarks.serving_ceiling [--concurrency 64] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from benchmarks.stream_loadgen import run_streams
from benchmarks.workload import token_prompts
from carpool.bench.metrics import percentile
from carpool.engine.outputs import SchedulerOutput
from carpool.engine.runner import Sampled, SamplingRow, StepResult
from carpool.testing import spawn

MODEL = "smollm2-135m-instruct"
TEXT = (
    "The history of the city goes back many centuries. Its first walls were built of "
    "timber and earth, and the market that grew inside them drew traders from the "
    "coast and the hills alike. "
) * 4


class InstantRunner:
    """A ``Runner`` with no model: each sampling chunk's next token is the next of
    ``tokens`` (by how many the sequence has), at once. Grammars and generators are
    the real runner's."""

    def __init__(self, real: Any, tokens: list[int]) -> None:
        self.real = real
        self.spec = real.spec
        self.num_blocks = real.num_blocks
        self.paths = real.paths
        self.tokens = tokens

    def make_generator(self, seed: int) -> Any:
        return self.real.make_generator(seed)

    def compile_grammar(self, grammar: Any, param: str) -> None:
        self.real.compile_grammar(grammar, param)

    def make_constraint(self, grammar: Any) -> Any:
        return self.real.make_constraint(grammar)

    def execute(
        self,
        step: SchedulerOutput,
        rows: Mapping[str, SamplingRow],
        prompt_logprobs: Mapping[str, int] | None = None,
    ) -> StepResult:
        result = StepResult()
        for chunk in step.chunks:
            if chunk.samples:
                n = len(rows[chunk.seq.request_id].output_ids)
                result.sampled[chunk.seq.request_id] = Sampled(
                    self.tokens[n % len(self.tokens)], None
                )
        return result


def text_tokens() -> list[int]:
    from transformers import AutoTokenizer

    from carpool.config import default_cache_dir
    from carpool.models.causal_lm import convert_gguf
    from carpool.models.registry import BUILTIN_MODELS

    folder = convert_gguf(BUILTIN_MODELS[MODEL].locate(), default_cache_dir(), progress=False)
    tokens: list[int] = AutoTokenizer.from_pretrained(str(folder)).encode(TEXT)
    return tokens


def offline(workload: list[tuple[list[int], int]]) -> float:
    from carpool import LLM, SamplingParams

    llm = LLM(MODEL)
    llm.engine.runner = InstantRunner(llm.engine.runner, text_tokens())
    params = SamplingParams(max_tokens=workload[0][1], temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def serve(argv: list[str]) -> None:
    """``carpool serve`` with every generation engine's runner made instant."""
    from carpool import cli
    from carpool.server import bootstrap

    real_engine_for = bootstrap.engine_for
    tokens = text_tokens()

    def instant_engine_for(*args: Any, **kwargs: Any) -> Any:
        engine = real_engine_for(*args, **kwargs)
        engine.runner = InstantRunner(engine.runner, tokens)
        return engine

    bootstrap.engine_for = instant_engine_for  # type: ignore[assignment]
    sys.exit(cli.main(["serve", *argv]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    workload = [(p, 128) for p in token_prompts(args.requests, 32, 256, 49152, seed=3)]
    print(f"# {platform.machine()}, {os.cpu_count()} cores, instant runner, {MODEL} tokenizer")
    alone = offline(workload)
    print(f"offline engine, no model: {alone:9.0f} tok/s")
    command = [sys.executable, "-m", "benchmarks.serving_ceiling", "--serve"]
    command += ["--port", "0", "--model", MODEL]
    process, match, _ = spawn(command, re.compile(r"carpool ready on (http://\S+)"), 300.0)
    try:
        result = asyncio.run(run_streams(match.group(1), MODEL, workload, args.concurrency))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    print(
        f"HTTP c={args.concurrency}, no model: {result.tokens_per_s:9.0f} tok/s "
        f"({result.completed}/{result.requests} ok; ITL p50 "
        f"{percentile(result.itl_s, 50) * 1000:.1f} ms, p99 "
        f"{percentile(result.itl_s, 99) * 1000:.1f} ms)"
    )
    print(f"HTTP / offline: {result.tokens_per_s / alone:.2f}")
    print("reproduce: python -m benchmarks.serving_ceiling " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
