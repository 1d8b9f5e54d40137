"""Offline generation throughput, in one run, side by side: carpool's ``LLM.generate``
(all requests at once), transformers one request at a time, and transformers in
static batches of 16 (left padding); plus a single request alone on each. Greedy,
EOS ignored, the built-in smollm2-135m-instruct in float32. Each system runs in
its own subprocess so its peak memory is its own.

    python -m benchmarks.generation [--workload uniform|mixed|nano] [--hf-single-requests 4]
                                    [--device cpu|cuda] [--carpool-only] [--rows both|batch|single]
                                    [--engine '{"num_scheduler_steps": 8}']
                                    [--model FOLDER] [--temperature 0.6] [--cprofile N]
                                    [--trace N] [--warmup shape|small]

``--model``: a Hugging Face folder instead of the built-in (``benchmarks.real_size``
makes random-weight ones of real models' shapes); ``--workload nano`` is nano-vllm's
benchmark (256 requests, prompts and outputs of 100-1024 tokens; it samples at
temperature 0.6). Each carpool row prints a digest of its tokens: greedy runs of one
workload under two engine configurations should give the same one.

On a GPU carpool's rows also give its start-up, CUDA-graph capture time and how long
the GPU sat idle between steps (compare ``--engine '{"async_scheduling": true}'``,
which launches each step before the last one's tokens are back). Each carpool row
ends with the engine's time a step by phase (``null_device.time_phases``; ``wait``:
the host blocked on the device's tokens, inside ``land``). ``--trace N`` runs carpool's
measured run under torch's profiler and prints its top N operations by host time, and
on a GPU the kernels a step and their own time against the device's busy time (the
rest is the gaps between kernels).

transformers one-at-a-time runs on the first ``--hf-single-requests`` requests only
(its rate does not depend on how many there are; all 64 would take ~10 minutes).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import platform
import pstats
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.null_device import time_phases
from benchmarks.workload import generation_workload, token_prompts

MODEL = "smollm2-135m-instruct"
VOCAB = 49152


def run_carpool(workload: list[tuple[list[int], int]], args: argparse.Namespace) -> dict[str, Any]:
    from carpool import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(args.model, device=args.device, **json.loads(args.engine))
    startup = time.perf_counter() - started
    params = [
        SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True)
        for _, n in workload
    ]
    # Warm up on other prompts (the workload's own would be in the prefix cache): by
    # default as many, as long, so the measured run compiles no kernel variant of its
    # prompts' steps (a first step of a new shape can take 100s of ms on a GPU).
    vocab = vocab_of(args.model)
    if args.warmup == "shape":
        warm = [p for p, _ in generation_workload(args.workload, vocab, seed=99)]
        warm_params = SamplingParams(max_tokens=16, ignore_eos=True)
    else:
        warm = token_prompts(2, 32, 64, vocab, seed=99)
        warm_params = params[0]
    llm.generate(warm, warm_params, use_tqdm=False)
    runner = llm.engine.runner
    busy = getattr(runner, "device_seconds", 0.0)
    phases = time_phases(llm.engine)
    profile = cProfile.Profile() if args.cprofile else None
    trace = _tracer(args.device) if args.trace else None
    started = time.perf_counter()
    if profile is not None:
        profile.enable()
    if trace is not None:
        trace.start()
    outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    if trace is not None:
        trace.stop()
        _print_trace(trace, args.trace, len(phases["step"]), runner)
    if profile is not None:
        profile.disable()
        # To stderr: the parent reads the result from stdout and shows stderr on failure.
        stats = pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime")
        stats.print_stats(args.cprofile)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    digest = hashlib.sha256(json.dumps([o.outputs[0].token_ids for o in outputs]).encode())
    result = {
        "tokens": tokens,
        "seconds": elapsed,
        "startup_s": startup,
        "digest": digest.hexdigest()[:12],
        # Each phase's median call: a step's typical cost, not its mean, which one
        # slow step (a kernel compiled on first use) can double.
        "phases_ms": {k: statistics.median(v) * 1000 for k, v in phases.items() if v},
        "slowest_step_ms": max(phases["step"], default=0.0) * 1000,
    }
    if hasattr(runner, "device_seconds"):
        # From each step's first kernel to its tokens on the host; the rest of the
        # wall time the GPU waited on the host (scheduling, detokenizing, outputs).
        result["device_busy"] = (runner.device_seconds - busy) / elapsed
        graphs = getattr(runner, "graphs", None)
        result["capture_s"] = graphs.capture_seconds if graphs is not None else 0.0
    return result


def _tracer(device: str) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _print_trace(trace: torch.profiler.profile, top: int, steps: int, runner: Any) -> None:
    """To stderr (as ``--cprofile``): the top operations by their own host time, then
    the kernels' count and own device time a step."""
    averages = trace.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=top), file=sys.stderr)
    kernels = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if kernels and steps:
        own_us = sum(e.device_time for e in kernels) / steps
        print(
            f"kernels: {len(kernels) / steps:.1f} a step, {own_us:.0f} us of their own a step",
            file=sys.stderr,
        )
        by_name = sorted(
            (a for a in averages if a.device_time_total > 0),
            key=lambda a: a.device_time_total,
            reverse=True,
        )
        for a in by_name[:top]:
            print(
                f"  {a.count / steps:6.1f} a step {a.device_time_total / steps:8.1f} us "
                f" {a.key[:90]}",
                file=sys.stderr,
            )


def vocab_of(model: str) -> int:
    """The vocabulary of ``model``: the built-in's, or a folder's ``config.json``'s."""
    if model == MODEL:
        return VOCAB
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def _hf_model(model: str) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    from carpool.models.registry import BUILTIN_MODELS

    transformers.logging.set_verbosity_error()
    if model != MODEL:
        return AutoModelForCausalLM.from_pretrained(model).eval()
    path = BUILTIN_MODELS[MODEL].locate()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()


def run_hf(
    workload: list[tuple[list[int], int]], batch: int, device: str, model_name: str
) -> dict[str, Any]:
    model = _hf_model(model_name).to(device)
    tokens = 0
    with torch.inference_mode():
        warm = torch.tensor([workload[0][0][:8]], device=device)
        model.generate(warm, max_new_tokens=2, do_sample=False)
        started = time.perf_counter()
        for i in range(0, len(workload), batch):
            group = workload[i : i + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for row, (p, _) in enumerate(group):  # left padding
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            new = max(n for _, n in group)
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            tokens += sum(n for _, n in group)  # each row's own budget counts, not padding
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
    return {"tokens": tokens, "seconds": elapsed}


def child(args: argparse.Namespace) -> None:
    workload = generation_workload(args.workload, vocab_of(args.model))
    if args.single:
        workload = workload[:1]
    if args.system == "carpool":
        result = run_carpool(workload, args)
    elif args.system == "hf-one":
        result = run_hf(workload[: args.hf_single_requests], 1, args.device, args.model)
    else:
        result = run_hf(workload, 16, args.device, args.model)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device.startswith("cuda"):
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(result))


def measure(system: str, args: argparse.Namespace, single: bool = False) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "benchmarks.generation",
        "--child",
        system,
        "--workload",
        args.workload,
        "--engine",
        args.engine,
        "--hf-single-requests",
        str(args.hf_single_requests),
        "--device",
        args.device,
        "--model",
        args.model,
        "--temperature",
        str(args.temperature),
        "--warmup",
        args.warmup,
    ]
    if single:
        command.append("--single")
    if args.cprofile and system == "carpool":
        command += ["--cprofile", str(args.cprofile)]
    if args.trace and system == "carpool":
        command += ["--trace", str(args.trace)]
    done = subprocess.run(command, capture_output=True, text=True)
    if (args.cprofile or args.trace) and system == "carpool":
        print(done.stderr[-30000:])
    if done.returncode != 0:
        sys.exit(f"{system} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    return result


def _ratio(row: dict[str, Any], base: dict[str, Any] | None) -> str:
    """``row``'s tokens/s over ``base``'s, or "-" where the baseline was not run."""
    return "-" if base is None else f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="uniform", choices=["uniform", "mixed", "nano"])
    parser.add_argument("--hf-single-requests", type=int, default=4)
    parser.add_argument("--engine", default="{}", help="EngineConfig fields for carpool, JSON")
    parser.add_argument("--child", dest="system", default=None)
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--device", default="cpu", help="torch device for every system")
    parser.add_argument(
        "--carpool-only", action="store_true", help="skip transformers (its rows are 1.0x)"
    )
    parser.add_argument("--model", default=MODEL, help="the built-in or a model folder")
    parser.add_argument("--temperature", type=float, default=0.0, help="carpool's sampling")
    parser.add_argument(
        "--cprofile",
        type=int,
        default=0,
        help="profile carpool's measured run (cProfile) and print its top N functions",
    )
    parser.add_argument(
        "--warmup",
        default="shape",
        choices=["shape", "small"],
        help="carpool's warm-up: prompts of the workload's count and lengths, or two short ones",
    )
    parser.add_argument(
        "--trace",
        type=int,
        default=0,
        help="run carpool's measured run under torch's profiler; print its top N operations",
    )
    parser.add_argument(
        "--rows",
        default="both",
        choices=["both", "batch", "single"],
        help="the workload all at once, one request alone, or both",
    )
    args = parser.parse_args()
    if args.system:
        child(args)
        return
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, workload {args.workload}, device {args.device}, "
        f"model {args.model}, engine {args.engine}"
    )
    one_at_a_time = f"transformers one at a time ({args.hf_single_requests} requests)"
    rows = {}
    if args.rows != "single":
        rows["carpool LLM.generate (all at once)"] = measure("carpool", args)
    if not args.carpool_only and args.rows != "single":
        rows[one_at_a_time] = measure("hf-one", args)
        rows["transformers static batches of 16"] = measure("hf-batch16", args)
    if args.rows != "batch":
        rows["carpool, one request alone"] = measure("carpool", args, single=True)
    if not args.carpool_only and args.rows != "batch":
        rows["transformers, one request alone"] = measure("hf-one", args, single=True)
    base_one = rows.get(one_at_a_time)
    base_16 = rows.get("transformers static batches of 16")
    print(
        f"{'system':48} {'tokens':>7} {'s':>7} {'tok/s':>7} {'vs 1-at-a-time':>14} "
        f"{'vs batch16':>10} {'peak RSS MB':>11}"
    )
    for name, r in rows.items():
        gpu = f" {r['peak_gpu_mb']:8.0f} MB on the GPU" if "peak_gpu_mb" in r else ""
        if "device_busy" in r:
            gpu += (
                f"; start-up {r['startup_s']:.1f} s (CUDA graphs {r['capture_s']:.2f} s), "
                f"GPU idle between steps {1 - r['device_busy']:.0%}"
            )
        if "digest" in r:
            gpu += f"; tokens {r['digest']}"
        if "phases_ms" in r:
            gpu += "; ms a step (median call): " + ", ".join(
                f"{k} {v:.3f}" for k, v in r["phases_ms"].items() if v
            )
            gpu += f"; slowest step {r['slowest_step_ms']:.1f} ms"
        print(
            f"{name:48} {r['tokens']:7d} {r['seconds']:7.1f} {r['tokens_per_s']:7.1f} "
            f"{_ratio(r, base_one):>14} {_ratio(r, base_16):>10} {r['peak_rss_mb']:11.0f}{gpu}"
        )
    print("reproduce: python -m benchmarks.generation " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
