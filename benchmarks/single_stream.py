"""One person chatting: a single stream's speed, side by side in one run, on the
built-in GGUF with 2 threads: ``llama-bench`` tg128, carpool's offline engine, and
over HTTP at concurrency 1 (``carpool bench``, the same prompts for each server)
carpool and ``llama-server``. Greedy, 128 tokens, EOS ignored.

    python -m benchmarks.single_stream --llama-bin /path/to/llama.cpp/build/bin
                                       [--rounds 1] [--weight-kernels native native-int8]
                                       [--carpool-env OMP_WAIT_POLICY=passive ...]

carpool runs once per ``--weight-kernels`` choice (offline and over HTTP): native is
exact against the file's float32 weights, native-int8 uses integer dot products.
``--carpool-env`` runs carpool's first HTTP case once more with those environment
variables (to compare a setting in the same run). ``--rounds`` repeats everything and
ends with the median of each round's ratios: this CPU drifts by ±20% within
minutes, and one round's offline and HTTP measurements are minutes apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.vs_llama_server import builtin_gguf, start, stop
from carpool.bench.config import BenchConfig
from carpool.bench.run import run

TOKENS = 128


def llama_bench(binary: Path, gguf: str, threads: int) -> float:
    """llama-bench's tg128 tokens/s."""
    out = subprocess.run(
        [str(binary), "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(TOKENS), "-o", "csv"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    header, *rows = [line for line in out.splitlines() if line.strip()]
    column = header.split(",").index("avg_ts")
    return float(rows[-1].split(",")[column].strip('"'))


def offline(
    threads: int,
    requests: int,
    weight_kernel: str,
    model: str = "smollm2-135m-instruct",
    **engine: Any,
) -> float:
    """carpool's offline engine on ``model``, one request at a time: the median of
    (time for 128 tokens - time for the first) / 127, the prefix cache off so both
    prefill. ``engine``: more of the engine's settings."""
    import torch

    from carpool import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, enable_prefix_caching=False, weight_kernel=weight_kernel, **engine)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    whole = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    per_token = []
    for i in range(requests + 1):  # the first warms up
        prompt = f"Request {i}: write about the sea, the sky and the hills."
        started = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        one = time.perf_counter() - started
        started = time.perf_counter()
        llm.generate([prompt], whole, use_tqdm=False)
        if i:
            per_token.append((time.perf_counter() - started - one) / (TOKENS - 1))
    return statistics.median(per_token)


def over_http(
    name: str, args: argparse.Namespace, env: dict[str, str], extra: list[str] | None = None
) -> dict[str, Any]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        process, url = start(name, argparse.Namespace(**vars(args), carpool_extra=extra or []))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        config = BenchConfig(
            base_url=url,
            dataset="random",
            random_input_len=64,
            random_output_len=TOKENS,
            num_prompts=args.requests,
            num_warmups=2,
            concurrency=1,
            ignore_eos=True,
            seed=args.seed,
        )
        [result] = run(config, progress=False)
        return result
    finally:
        stop(process)


def one_round(args: argparse.Namespace) -> dict[str, float]:
    """Every measurement once, in this order: llama-bench, carpool offline per kernel,
    carpool over HTTP per kernel (and with --carpool-env), llama-server."""
    rows: dict[str, float] = {}
    rows["llama-bench tg128 (ms/token)"] = 1000 / llama_bench(
        Path(args.llama_bin) / "llama-bench", args.gguf, args.threads
    )
    kernels = args.weight_kernels
    for kernel in kernels:
        rows[f"carpool {kernel} offline, one stream (ms/token)"] = 1000 * offline(
            args.threads, args.requests, kernel
        )
    http = {
        f"carpool {kernel}": over_http("carpool", args, {}, ["--weight-kernel", kernel])
        for kernel in kernels
    }
    if args.carpool_env:
        env = dict(item.split("=", 1) for item in args.carpool_env)
        http[f"carpool {kernels[0]} {' '.join(args.carpool_env)}"] = over_http(
            "carpool", args, env, ["--weight-kernel", kernels[0]]
        )
    http["llama-server"] = over_http("llama-server", args, {})
    for name, r in http.items():
        rows[f"{name} HTTP c=1 ITL p50 (ms)"] = r["median_itl_ms"]
        rows[f"{name} HTTP c=1 TPOT mean (ms)"] = r["mean_tpot_ms"]
    return rows


def ratios(rows: dict[str, float], kernel: str) -> tuple[float, float, float]:
    """ITL p50 / llama-server's, ITL p50 / the offline engine's ms a token, and
    offline tokens/s / llama-bench's."""
    itl = rows[f"carpool {kernel} HTTP c=1 ITL p50 (ms)"]
    own = rows[f"carpool {kernel} offline, one stream (ms/token)"]
    return (
        itl / rows["llama-server HTTP c=1 ITL p50 (ms)"],
        itl / own,
        rows["llama-bench tg128 (ms/token)"] / own,
    )


def describe(kernel: str, kernel_ratios: tuple[float, float, float]) -> str:
    """One line for ``ratios``' three numbers."""
    server, own, bench = kernel_ratios
    return (
        f"{kernel}: ITL p50 {server:.2f}x llama-server's, {own:.2f}x its offline "
        f"engine; offline tokens/s {bench:.2f}x llama-bench's"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", required=True, help="llama.cpp's build/bin folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-kernels", nargs="+", default=["native", "native-int8"])
    parser.add_argument("--carpool-env", nargs="*", default=[], help="KEY=VALUE ...")
    args = parser.parse_args()
    args.gguf = builtin_gguf()
    args.llama_server = str(Path(args.llama_bin) / "llama-server")
    args.parallel, args.llama_port = 1, 8092
    print("command: python -m benchmarks.single_stream " + " ".join(sys.argv[1:]))
    per_round: list[tuple[dict[str, float], dict[str, tuple[float, float, float]]]] = []
    for round_ in range(args.rounds):
        rows = one_round(args)
        per_round.append((rows, {k: ratios(rows, k) for k in args.weight_kernels}))
        print(f"\nround {round_ + 1}")
        for name, value in rows.items():
            print(f"{name:64} {value:8.2f}")
        for kernel, kernel_ratios in per_round[-1][1].items():
            print(describe(kernel, kernel_ratios))
    if args.rounds > 1:
        print(f"\nmedians of the per-round ratios ({args.rounds} rounds)")
        for kernel in args.weight_kernels:
            server, own, bench = (
                statistics.median(r[1][kernel][i] for r in per_round) for i in range(3)
            )
            print(describe(kernel, (server, own, bench)))


if __name__ == "__main__":
    main()
