"""How fast the host side alone can go: the engine with a runner that answers every
step at once (no model), offline and behind the HTTP server, 64 streams of 128
tokens each. Tokens are a fixed English text's, so detokenizing costs what it does
for real text. The offline figure is the engine's bookkeeping ceiling; the HTTP
figure adds the server (event loop, SSE framing, JSON, the client on the same
machine); their ratio bounds what over-HTTP/offline ratio any model could reach on
this machine's CPU, whatever its accelerator.

    python -m benchmarks.serving_ceiling [--concurrency 64] [--requests 64]
                                         [--device-ms 2.3] [--async-scheduling]
                                         [--engine-process]

``--device-ms``: each step takes that long on a simulated device (a sleep, which
holds no GIL, as a GPU's step does not), whatever its size; steps queue on it in
order as on a CUDA stream, so with ``--async-scheduling`` the host's work for the
next step overlaps the device's, as it would on a GPU. The offline and HTTP figures
then bound what a GPU with that step time allows on this host.

``--engine-process``: the server runs the engine in a process of its own
(``carpool serve --engine-process``); the instant runner goes with it.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from benchmarks.stream_loadgen import run_streams_split
from benchmarks.workload import token_prompts
from carpool.bench.metrics import percentile
from carpool.engine.outputs import SchedulerOutput
from carpool.engine.runner import Sampled, SamplingRow, StepResult
from carpool.testing import spawn

MODEL = "smollm2-135m-instruct"
# The simulated step time, for an engine process: spawned, it imports this module as
# ``__mp_main__`` (below) and makes its runner instant the same way.
DEVICE_S_VARIABLE = "CARPOOL_CEILING_DEVICE_S"
TEXT = (
    "The history of the city goes back many centuries. Its first walls were built of "
    "timber and earth, and the market that grew inside them drew traders from the "
    "coast and the hills alike. "
) * 4


class InstantRunner:
    """A ``Runner`` with no model: each sampling chunk's next token is the next of
    ``tokens`` (by how many the sequence has), after ``device_s`` on a simulated
    device (0: at once). Grammars and generators are the real runner's."""

    def __init__(self, real: Any, tokens: list[int], device_s: float = 0.0) -> None:
        self.real = real
        self.spec = real.spec
        self.num_blocks = real.num_blocks
        self.paths = real.paths
        self.multi_step = False
        self.device_type = real.device_type
        self.tokens = tokens
        self.device_s = device_s
        self.device_free_at = 0.0  # when the simulated device has run what it was given

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
        result = self._answer(step, rows)
        self._wait_until(self._queue())
        return result

    def launch(self, step: SchedulerOutput, rows: Mapping[str, SamplingRow], after: Any) -> Any:
        from carpool.engine.runner import Launch

        result = self._answer(step, rows)
        order = {rid: j for j, rid in enumerate(result.sampled)}
        return Launch(order, (result, self._queue()))

    def land(self, launch: Any) -> StepResult:
        result, ready_at = launch.handle
        self._wait_until(ready_at)
        return result  # type: ignore[no-any-return]

    def _answer(self, step: SchedulerOutput, rows: Mapping[str, SamplingRow]) -> StepResult:
        result = StepResult()
        for chunk in step.chunks:
            if chunk.samples:
                n = len(rows[chunk.seq.request_id].output_ids)
                result.sampled[chunk.seq.request_id] = Sampled(
                    self.tokens[n % len(self.tokens)], None
                )
        return result

    def _queue(self) -> float:
        """Give the simulated device a step: when it will have run it."""
        self.device_free_at = max(time.perf_counter(), self.device_free_at) + self.device_s
        return self.device_free_at

    @staticmethod
    def _wait_until(ready_at: float) -> None:
        delay = ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def text_tokens() -> list[int]:
    from transformers import AutoTokenizer

    from carpool.config import default_cache_dir
    from carpool.models.causal_lm import convert_gguf
    from carpool.models.registry import BUILTIN_MODELS

    folder = convert_gguf(BUILTIN_MODELS[MODEL].locate(), default_cache_dir(), progress=False)
    tokens: list[int] = AutoTokenizer.from_pretrained(str(folder)).encode(TEXT)
    return tokens


def offline(workload: list[tuple[list[int], int]], device_s: float, overlap: bool) -> float:
    from carpool import LLM, SamplingParams

    llm = LLM(MODEL, async_scheduling=overlap)
    llm.engine = instant_engine(llm.engine, text_tokens(), device_s)
    params = SamplingParams(max_tokens=workload[0][1], temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def instant_engine(engine: Any, tokens: list[int], device_s: float) -> Any:
    """An engine like ``engine`` (its config) on an ``InstantRunner``."""
    from carpool.engine.engine import Engine

    return Engine(InstantRunner(engine.runner, tokens, device_s), engine.config)


def make_engines_instant(device_s: float) -> None:
    """Every generation engine the server builds in this process gets an instant runner."""
    from carpool.server import bootstrap

    real_engine_for = bootstrap.engine_for
    tokens = text_tokens()

    def instant_engine_for(*args: Any, **kwargs: Any) -> Any:
        return instant_engine(real_engine_for(*args, **kwargs), tokens, device_s)

    bootstrap.engine_for = instant_engine_for  # type: ignore[assignment]


def serve(argv: list[str], device_s: float) -> None:
    """``carpool serve`` with every generation engine's runner made instant (in an
    engine process too)."""
    from carpool import cli

    make_engines_instant(device_s)
    os.environ[DEVICE_S_VARIABLE] = str(device_s)
    sys.exit(cli.main(["serve", *argv]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--device-ms", type=float, default=0.0, help="a step's simulated time")
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--client-processes", type=int, default=1, help="load generators")
    parser.add_argument("--engine-process", action="store_true", help="serve's engine process")
    parser.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device_s = args.device_ms / 1000
    if args.serve is not None:
        serve(args.serve, device_s)
        return
    workload = [(p, 128) for p in token_prompts(args.requests, 32, 256, 49152, seed=3)]
    device = f"{args.device_ms} ms a step on a simulated device" if device_s else "instant runner"
    steps = "async scheduling" if args.async_scheduling else "steps that wait"
    if args.engine_process:
        steps += ", engine process"
    print(f"# {platform.machine()}, {os.cpu_count()} cores, {device}, {steps}, {MODEL} tokenizer")
    alone = offline(workload, device_s, args.async_scheduling)
    print(f"offline engine, no model: {alone:9.0f} tok/s")
    command = [sys.executable, "-m", "benchmarks.serving_ceiling", "--device-ms"]
    command += [str(args.device_ms), "--serve", "--port", "0", "--model", MODEL]
    if args.async_scheduling:
        command.append("--async-scheduling")
    if args.engine_process:
        command.append("--engine-process")
    process, match, _ = spawn(command, re.compile(r"carpool ready on (http://\S+)"), 300.0)
    try:
        result = run_streams_split(
            match.group(1), MODEL, workload, args.concurrency, args.client_processes
        )
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    print(
        f"HTTP c={args.concurrency}, no model: {result.tokens_per_s:9.0f} tok/s "
        f"({result.completed}/{result.requests} ok; ITL p50 "
        f"{percentile(result.itl_s, 50) * 1000:.1f} ms, p99 "
        f"{percentile(result.itl_s, 99) * 1000:.1f} ms; TTFT p50 "
        f"{percentile(result.ttft_s, 50) * 1000:.0f} ms; client CPU "
        f"{result.client_cpu_s / result.seconds:.0%})"
    )
    print(f"HTTP / offline: {result.tokens_per_s / alone:.2f}")
    print("reproduce: python -m benchmarks.serving_ceiling " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and DEVICE_S_VARIABLE in os.environ:
    make_engines_instant(float(os.environ[DEVICE_S_VARIABLE]))
