"""The engine's own time per step, with a null device (issue 48).

The real ``Engine`` (scheduler, block manager, output processing, the real SmolLM2
tokenizer's incremental detokenizing, stop checks) drives a runner whose forward
pass costs a fixed device time (``--device-ms``) and samples plausible tokens (a
cycle of common words, never end-of-text). A plain step sleeps that time, as a
synchronous step waits on a GPU; with ``--async-scheduling`` (a GPU's default) each
step is launched onto a device timeline behind the one before it and landed later,
so the host's work overlaps the device's. Each workload runs to its end; printed:
host time per decode step (step wall time less the time the host waited on the
device) as a median, per sequence-step, split into schedule / run (the runner's host
part) / the rest (output processing: emit, detokenize, stop checks; with overlap,
landing and advancing), and the device-idle share (1 - device time / step time).

The engine process, its pipe and the HTTP stream path: ``benchmarks.null_http``.

    python -m benchmarks.null_device [--device-ms 0 2] [--workloads 64x128 256x128] [--rounds 3]
                                     [--output-kind cumulative|delta|final_only] [--tokenizer DIR]
                                     [--async-scheduling]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from transformers import AutoTokenizer

from carpool.config import EngineConfig, default_cache_dir
from carpool.engine.engine import Engine
from carpool.engine.outputs import SchedulerOutput
from carpool.engine.runner import EngineModelSpec, Launch, Sampled, SamplingRow, StepResult
from carpool.engine.sampling_params import SamplingParams
from carpool.models.causal_lm import convert_gguf
from carpool.models.registry import BUILTIN_MODELS
from carpool.paths import PathTaken

WORDS = [" the", " a", " of", " and", " to", " in", " is", " that", " it", " was", ","]


class NullRunner:
    """A device that takes ``device_s`` a step and answers common words.

    Run as a plain step (``execute``), the host sleeps the device time. Launched
    (``launch`` and ``land``: asynchronous scheduling, a GPU's default), a step queues
    on the device behind the one before it, as on a CUDA stream, and ``land`` sleeps
    only what is left of it: the host's work between them overlaps the device's."""

    def __init__(self, tokenizer: Any, device_s: float, num_blocks: int) -> None:
        eos = tokenizer.eos_token_id
        self.spec = EngineModelSpec("null", len(tokenizer), 8192, frozenset({eos}), tokenizer)
        self.num_blocks = num_blocks
        self.paths: tuple[PathTaken, ...] = ()
        self.multi_step = False
        self.device_type = "cpu"  # the CPU's defaults (step budget), as the benchmarks ran
        self.device_s = device_s
        self.words = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(w))[0] for w in WORDS]
        self.host_s = 0.0  # the runner's own time, device excluded
        self.device_total_s = 0.0  # the time the host waited on the device (a sleep overshoots)
        self.device_steps = 0  # steps the device ran: device_steps * device_s of it busy
        self._device_free_at = 0.0  # when the device ends the last step launched

    def make_generator(self, seed: int) -> None:
        return None

    def execute(
        self,
        step: SchedulerOutput,
        rows: Mapping[str, SamplingRow],
        prompt_logprobs: Mapping[str, int] | None = None,
    ) -> StepResult:
        result, slept = self._answered(step)
        if self.device_s:
            time.sleep(self.device_s)
        self.device_total_s += time.perf_counter() - slept
        return result

    def launch(
        self, step: SchedulerOutput, rows: Mapping[str, SamplingRow], after: Launch | None
    ) -> Launch:
        result, now = self._answered(step)
        self._device_free_at = max(now, self._device_free_at) + self.device_s
        order = {request_id: j for j, request_id in enumerate(result.sampled)}
        return Launch(order, (self._device_free_at, result))

    def land(self, launch: Launch) -> StepResult:
        done_at, result = launch.handle
        start = time.perf_counter()
        if done_at > start:
            time.sleep(done_at - start)
        self.device_total_s += time.perf_counter() - start
        return cast(StepResult, result)

    def _answered(self, step: SchedulerOutput) -> tuple[StepResult, float]:
        """``step``'s answer, its host time counted and one more step for the device,
        and when the answer was ready."""
        start = time.perf_counter()
        result = self._answer(step)
        ready = time.perf_counter()
        self.host_s += ready - start
        self.device_steps += 1
        return result, ready

    def _answer(self, step: SchedulerOutput) -> StepResult:
        """A word for each sampling chunk, chosen by the position it samples (so the
        same whether the sequence's last token has landed or is still in flight)."""
        result = StepResult()
        for chunk in step.chunks:
            if chunk.samples:
                position = chunk.seq.num_computed + chunk.num_tokens
                token = self.words[position % len(self.words)]
                result.sampled[chunk.seq.request_id] = Sampled(token, None)
        return result


def timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - start)

    return wrapper


def time_phases(engine: Engine) -> dict[str, list[float]]:
    """Time ``engine``'s phases from now on, call by call: the whole ``step``,
    ``schedule``, ``launch`` and ``land`` of asynchronous scheduling (``wait``: the
    host blocked on the device inside it), ``run`` and ``postprocess`` of a step
    without overlap, ``collect`` (the outputs; inside ``postprocess`` there) and
    ``advance``."""
    record: dict[str, list[float]] = {}
    overlap = engine.overlap
    targets = {
        "step": (engine, "step"),
        "schedule": (engine.scheduler, "schedule"),
        "launch": (overlap, "_launch"),
        "land": (overlap, "_land"),
        "wait": (engine.runner, "_wait"),
        "run": (engine, "run"),
        "postprocess": (engine, "postprocess"),
        "collect": (engine.outputs, "collect"),
        "advance": (overlap, "_advance"),
    }
    # Inside a launching runner's ``launch`` (a GPU's): the forward pass's inputs and
    # its graph's replay, the choice of tokens, the hand-off of their copy.
    runner = engine.runner
    decode = getattr(runner, "decode", None)
    targets |= {
        "runner_launch": (runner, "launch"),
        "forward": (runner, "_launch_forward"),
        "staged": (decode, "_staged"),
        "fill": (decode, "_fill"),
        "upload": (decode, "_upload"),
        "replay": (decode, "_pass"),
        "hand_off": (runner, "_hand_off"),
    }
    for name, (owner, attr) in targets.items():
        if owner is not None and hasattr(owner, attr):
            setattr(owner, attr, timed(record.setdefault(name, []), getattr(owner, attr)))
    _time_module_function(record, "carpool.workers.model_runner", "choose")
    _time_module_function(record, "carpool.workers.decode_graphs", "resolve_pending")
    return record


def _time_module_function(record: dict[str, list[float]], module: str, name: str) -> None:
    """Time calls of function ``name`` made from ``module`` (where the tree has it)."""
    found = sys.modules.get(module)
    if found is not None and hasattr(found, name):
        setattr(found, name, timed(record.setdefault(name, []), getattr(found, name)))


def run(
    tokenizer: Any,
    sequences: int,
    tokens: int,
    device_ms: float,
    output_kind: str = "cumulative",
    async_scheduling: bool = False,
) -> dict[str, float]:
    runner = NullRunner(tokenizer, device_ms / 1000, num_blocks=sequences * 32)
    # A step budget that admits every prompt within a few steps (a GPU's is larger than
    # the CPU's 192), so every sequence decodes together before the first one ends.
    config = EngineConfig(
        block_size=16,
        max_num_seqs=sequences,
        max_num_batched_tokens=8192,
        kv_cache_memory="1GiB",
        async_scheduling=async_scheduling,
    )
    engine = Engine(runner, config)
    schedule: list[float] = []
    engine.scheduler.schedule = timed(schedule, engine.scheduler.schedule)  # type: ignore[method-assign]
    # Named only when not the default: so the benchmark runs on a tree before it.
    kind = {} if output_kind == "cumulative" else {"output_kind": output_kind}
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, **kind)  # type: ignore[arg-type]
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"][:128]
    for i in range(sequences):
        # Varied in the first token: a last token + 1 is a byte of a character cut in two.
        engine.add_request(f"r{i}", [prompt[0] + i % 7, *prompt[1:]], params)
    steps: list[tuple[float, float, float, int]] = []  # wall, waited, runner host, running
    while engine.has_work:
        host, waited = runner.host_s, runner.device_total_s
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        waited = runner.device_total_s - waited
        steps.append((wall, waited, runner.host_s - host, len(engine.scheduler.running)))
    # Decode steps with every sequence running (prefill steps and the tail left out).
    full = [i for i, step in enumerate(steps) if step[3] == sequences and i >= 1]
    host_s = [steps[i][0] - steps[i][1] for i in full]
    rest = [host_s[j] - steps[i][2] - schedule[i] for j, i in enumerate(full)]
    step_host = statistics.median(host_s)
    device_s = device_ms / 1000
    wall_s = statistics.median(steps[i][0] for i in full)
    return {
        "steps": len(full),
        "host_ms": step_host * 1000,
        "per_seq_us": step_host / sequences * 1e6,
        "schedule_ms": statistics.median(schedule[i] for i in full) * 1000,
        "run_ms": statistics.median(steps[i][2] for i in full) * 1000,
        "post_ms": statistics.median(rest) * 1000,
        "idle": max(0.0, 1 - device_s / wall_s) if device_s else 1.0,
    }


def builtin_tokenizer(folder: str | None = None) -> Any:
    """The built-in chat model's tokenizer, from ``folder`` or its converted GGUF."""
    found = folder or convert_gguf(
        BUILTIN_MODELS["smollm2-135m-instruct"].locate(), default_cache_dir()
    )
    return AutoTokenizer.from_pretrained(str(found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-ms", type=float, nargs="+", default=[0.0, 2.0])
    parser.add_argument("--workloads", nargs="+", default=["64x128", "256x128"])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, interleaved")
    parser.add_argument(
        "--output-kind",
        default="cumulative",
        choices=["cumulative", "delta", "final_only"],
        help="outputs every step (as served in the server's process), their new pieces (in an "
        "engine process) or once per request (LLM.generate)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a folder with the built-in model's tokenizer.json (default: convert the built-in)",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="launch each step before the last one lands (a GPU's default): the host's "
        "work overlaps the device's, and the host time a step is what it does not hide",
    )
    args = parser.parse_args()
    tokenizer = builtin_tokenizer(args.tokenizer)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {sys.version.split()[0]}")  # fmt: skip
    print(f"command: python -m benchmarks.null_device {' '.join(sys.argv[1:])}")
    print("| sequences x tokens | device ms | decode steps | host ms/step (median; each round) | "
          "host us/sequence-step | schedule ms | run (host) ms | the rest ms | "
          "device idle |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows: dict[tuple[str, float], list[dict[str, float]]] = {}
    for _ in range(args.rounds):  # interleaved: this CPU drifts within minutes
        for workload in args.workloads:
            sequences, tokens = (int(x) for x in workload.split("x"))
            for device_ms in args.device_ms:
                result = run(
                    tokenizer, sequences, tokens, device_ms, args.output_kind, args.async_scheduling
                )
                rows.setdefault((workload, device_ms), []).append(result)
    for (workload, device_ms), results in rows.items():
        r = {k: statistics.median(x[k] for x in results) for k in results[0]}
        each = ", ".join(f"{x['host_ms']:.2f}" for x in results)
        idle = f"{r['idle']:.0%}" if device_ms else "-"
        print(f"| {workload} | {device_ms:g} | {r['steps']:.0f} | {r['host_ms']:.2f} ({each}) | "
              f"{r['per_seq_us']:.1f} | {r['schedule_ms']:.2f} | {r['run_ms']:.2f} | "
              f"{r['post_ms']:.2f} | {idle} |")  # fmt: skip


if __name__ == "__main__":
    main()
