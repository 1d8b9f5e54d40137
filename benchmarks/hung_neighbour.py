"""Other models' latency while one model hangs (issue 47), side by side with a tree
from before, in one run.

One ``carpool serve`` per tree, each with the built-in chat model and embedder and a
repository of two Triton Python-backend models at their default isolation: ``mlp``
(a small numpy MLP) and ``hangs`` (sleeps an hour on any request; its execution
timeout is ``--timeout-s``). Three neighbours load the server in closed loops at
concurrency 2 each (8-token greedy completions, one-text embeddings, one-row MLP
requests) for ``--seconds``, first alone, then while a client keeps one request to
``hangs`` in flight at all times (each fails at the timeout; the next is sent at once).
Printed per tree and neighbour: requests done, p50 and p99 latency, both phases.

    python -m benchmarks.hung_neighbour [--before 9c2c824] [--seconds 20] [--timeout-s 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from carpool.testing import spawn

REPO = Path(__file__).resolve().parent.parent
CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"

MLP_CODE = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)

        def execute(self, requests):
            get = pb_utils.get_input_tensor_by_name
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "y", np.tanh(get(r, "x").as_numpy() @ self.w))]) for r in requests]
"""
HANGS_CODE = """
    import time

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            time.sleep(3600)
            return []
"""


def config(name: str, extra: str = "") -> str:
    return textwrap.dedent(
        f"""
        name: "{name}"
        backend: "python"
        max_batch_size: 8
        dynamic_batching {{ }}
        input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 64 ] }} ]
        output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 64 ] }} ]
        {extra}
        """
    )


def repository(root: Path, timeout_s: float) -> Path:
    for name, code, extra in [
        ("mlp", MLP_CODE, ""),
        (
            "hangs",
            HANGS_CODE,
            'parameters { key: "execution_timeout_s" '
            f'value: {{ string_value: "{timeout_s:g}" }} }}',
        ),
    ]:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config(name, extra))
        (root / name / "1" / "model.py").write_text(textwrap.dedent(code))
    return root


def worktree(commit: str, parent: Path) -> Path:
    folder = parent / commit
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), commit],
        check=True,
        capture_output=True,
    )
    return folder


Call = Callable[[httpx.AsyncClient], Any]

X = [0.01 * i for i in range(64)]
NEIGHBOURS: dict[str, Call] = {
    "completion (8 tokens)": lambda c: c.post(
        "/v1/completions",
        json={"model": CHAT, "prompt": "The sky is", "max_tokens": 8, "temperature": 0},
    ),
    "embedding": lambda c: c.post("/v1/embeddings", json={"model": EMBED, "input": "hello"}),
    "mlp (repository)": lambda c: c.post(
        "/v2/models/mlp/infer",
        json={"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": X}]},
    ),
}


async def closed_loop(url: str, call: Call, seconds: float, concurrency: int) -> list[float]:
    """Latencies (s) of requests sent back to back by ``concurrency`` clients."""
    latencies: list[float] = []
    end = time.monotonic() + seconds

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            while time.monotonic() < end:
                start = time.monotonic()
                response = await call(c)
                response.raise_for_status()
                latencies.append(time.monotonic() - start)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


async def keep_one_hanging(url: str, stop: asyncio.Event) -> int:
    """Send requests to ``hangs`` one after another until ``stop``; how many failed."""
    failed = 0
    body = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": X}]}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        while not stop.is_set():
            response = await c.post("/v2/models/hangs/infer", json=body)
            failed += response.status_code >= 500
    return failed


async def phase(url: str, seconds: float, hanging: bool) -> tuple[dict[str, list[float]], int]:
    stop = asyncio.Event()
    hanger = asyncio.ensure_future(keep_one_hanging(url, stop)) if hanging else None
    results = await asyncio.gather(
        *(closed_loop(url, call, seconds, 2) for call in NEIGHBOURS.values())
    )
    stop.set()
    failed = await hanger if hanger is not None else 0
    return dict(zip(NEIGHBOURS, results, strict=True)), failed


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def measure(tree: Path, repo: Path, seconds: float) -> None:
    command = [sys.executable, "-m", "carpool.cli", "serve", "--port", "0"]
    command += ["--model", CHAT, "--model", EMBED, "--model-repository", str(repo)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    process, match, _ = spawn(
        command, re.compile(r"carpool ready on (http://\S+)"), 600.0, cwd=str(tree), env=env
    )
    url = match.group(1)
    try:
        asyncio.run(phase(url, 3, hanging=False))  # warm-up
        for hanging in (False, True):
            latencies, failed = asyncio.run(phase(url, seconds, hanging))
            label = "while 'hangs' hangs" if hanging else "alone"
            print(f"  {label}" + (f" ({failed} hung requests failed)" if hanging else ""))
            for name, values in latencies.items():
                print(
                    f"    {name:24s} n={len(values):5d}  p50 {p(values, 0.5):8.1f} ms  "
                    f"p99 {p(values, 0.99):8.1f} ms  mean {statistics.mean(values) * 1000:8.1f}"
                )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="", help="a commit to measure first, side by side")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"command: python -m benchmarks.hung_neighbour {' '.join(sys.argv[1:])}")
    with tempfile.TemporaryDirectory() as tmp:
        repo = repository(Path(tmp) / "repo", args.timeout_s)
        trees = [("this tree", REPO)]
        if args.before:
            trees.insert(0, (args.before, worktree(args.before, Path(tmp))))
        try:
            for label, tree in trees:
                print(f"{label}:")
                measure(tree, repo, args.seconds)
        finally:
            if args.before:
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees[0][1])],
                    check=False,
                )


if __name__ == "__main__":
    main()
