"""Two commits of carpool side by side under the same load: does a change cost
throughput? Each round starts a fresh ``carpool serve`` from each commit's tree (a
git worktree in a temporary folder; the order alternates between rounds so drift
hits both alike) and runs ``carpool bench`` against it: by default the concurrency-64
load of issue 16 (random 64-word prompts, 128 tokens each, EOS ignored, 128 requests).

    python -m benchmarks.ab_commits BEFORE AFTER [--rounds 4] [--concurrency 64]
                                    [--serve-args "--weight-kernel native"]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from carpool.bench.config import BenchConfig
from carpool.bench.run import run
from carpool.testing import spawn

MODEL = "smollm2-135m-instruct"
REPO = Path(__file__).resolve().parent.parent


def worktree(commit: str, parent: Path) -> Path:
    """``commit``'s tree checked out under ``parent``."""
    folder = parent / commit.replace("/", "_")
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), commit],
        check=True,
        capture_output=True,
    )
    return folder


def serve_and_bench(tree: Path, args: argparse.Namespace, seed: int) -> float:
    """Output tokens/s of one bench run against a fresh server from ``tree``."""
    command = [sys.executable, "-m", "carpool.cli", "serve", "--port", "0", "--model", MODEL]
    command += shlex.split(args.serve_args)
    # From the tree's folder, its carpool comes before the installed (editable) one.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    process, match, _ = spawn(
        command, re.compile(r"carpool ready on (http://\S+)"), 600.0, cwd=str(tree), env=env
    )
    try:
        config = BenchConfig(
            base_url=match.group(1),
            dataset="random",
            random_input_len=64,
            random_output_len=128,
            num_prompts=args.num_prompts,
            concurrency=args.concurrency,
            ignore_eos=True,
            seed=seed,
        )
        [result] = run(config, progress=False)
        return float(result["output_throughput"])
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--serve-args", default="")
    args = parser.parse_args()
    print("command: python -m benchmarks.ab_commits " + shlex.join(sys.argv[1:]))
    with tempfile.TemporaryDirectory() as parent:
        trees = {name: worktree(name, Path(parent)) for name in (args.before, args.after)}
        try:
            results: dict[str, list[float]] = {name: [] for name in trees}
            for round_ in range(args.rounds):
                order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                for name in order:
                    tok_s = serve_and_bench(trees[name], args, seed=round_)
                    results[name].append(tok_s)
                    print(f"round {round_ + 1}: {name:>12} {tok_s:8.1f} output tok/s", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                    check=False,
                )
    before, after = (statistics.median(results[n]) for n in (args.before, args.after))
    ratios = [a / b for a, b in zip(results[args.after], results[args.before], strict=True)]
    print(
        f"median output tok/s: {args.before} {before:.1f}, {args.after} {after:.1f} "
        f"({after / before:.3f}x); per-round ratios " + ", ".join(f"{r:.3f}" for r in ratios)
    )


if __name__ == "__main__":
    main()
