"""User models served by carpool and by LitServe, Ray Serve (@serve.batch) and PyTriton,
side by side in one run, against the same models' in-process ceilings (issue 26).

Two models (benchmarks/user_model_peers/models.py): a torch MLP on 256 random
features, and a MiniLM-L6-sized CrossEncoder (random weights) on (query, document)
pairs. One request is one row (one pair), sent as JSON; each server batches up to 64
with its own dynamic batching (carpool: no queue delay, its default; the peers: 2 ms,
their batch timeout). Each peer runs from a virtual environment of its own, made with
its PyPI package and torch 2.13.0:

    python3.11 -m venv /tmp/peers/litserve && /tmp/peers/litserve/bin/pip install \\
        torch==2.13.0 litserve sentence-transformers       # likewise ray[serve]==2.60.0,
                                                            # nvidia-pytriton
    python -m benchmarks.user_models --litserve /tmp/peers/litserve/bin/python \\
        --rayserve /tmp/peers/rayserve/bin/python --pytriton /tmp/peers/pytriton/bin/python

A peer whose server does not come up is reported with its error. ``--peers ... bare``
adds the floor at c=1: a bare ASGI app that calls the model on its event loop, one
request at a time (not a peer: it batches nothing). The in-process
one-row call is timed in blocks interleaved with the c=1 requests' (the CPU here
drifts), each call after 2 ms idle as the server's model is called, and
carpool's health route alone at c=64 gives the HTTP bound on one-row requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from benchmarks.loadgen import LoadResult
from benchmarks.user_model_peers.models import BATCH, FEATURES, Mlp, Reranker, make_reranker
from carpool.models.registry import BUILTIN_MODELS
from carpool.repository.library_models import prepared_once
from carpool.testing import free_port

PEERS = Path(__file__).parent / "user_model_peers"


@dataclass(frozen=True)
class Workload:
    model: str
    rows: list[Any]


def workloads(count: int) -> dict[str, Workload]:
    rng = np.random.default_rng(0)
    words = [
        "the",
        "capital",
        "of",
        "france",
        "is",
        "paris",
        "a",
        "city",
        "on",
        "the",
        "seine",
        "river",
        "known",
        "for",
        "art",
    ]
    sentence = random.Random(0)
    pairs = [
        (
            " ".join(sentence.choices(words, k=8)),
            " ".join(sentence.choices(words, k=sentence.randint(12, 40))),
        )
        for _ in range(count)
    ]
    return {
        "mlp": Workload("mlp", rng.random((count, FEATURES), dtype=np.float32).tolist()),
        "reranker": Workload("reranker", pairs),
    }


def v2_body(model: str, row: Any) -> tuple[str, dict[str, Any]]:
    if model == "mlp":
        inputs = [{"name": "x", "shape": [1, FEATURES], "datatype": "FP32", "data": row}]
    else:
        inputs = [
            {"name": "query", "shape": [1, 1], "datatype": "BYTES", "data": [row[0]]},
            {"name": "document", "shape": [1, 1], "datatype": "BYTES", "data": [row[1]]},
        ]
    return f"/v2/models/{model}/infer", {"inputs": inputs}


def plain_body(model: str, row: Any) -> tuple[str, dict[str, Any]]:
    if model == "mlp":
        return "/predict", {"x": row}
    return "/predict", {"query": row[0], "document": row[1]}


async def closed_loop(url: str, bodies: list[tuple[str, dict[str, Any]]], concurrency: int,
                      limit_s: float) -> LoadResult:  # fmt: skip
    """``bodies`` sent by ``concurrency`` clients, each waiting for its answer before
    sending the next."""
    latencies: list[float] = []
    errors = 0
    index = 0
    deadline = time.monotonic() + limit_s
    # Encoded once, before the clock starts: the client shares this machine's cores.
    encoded = [(path, orjson.dumps(body)) for path, body in bodies]
    headers = {"Content-Type": "application/json"}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal index, errors
        while index < len(bodies) and time.monotonic() < deadline:
            path, data = encoded[index]
            index += 1
            t0 = time.perf_counter()
            async with session.post(url + path, data=data, headers=headers) as response:
                await response.read()
                ok = response.status == 200
            latencies.append(time.perf_counter() - t0)
            errors += not ok

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return LoadResult(len(latencies), errors, time.perf_counter() - started, latencies)


async def route_floor(url: str, count: int, concurrency: int) -> float:
    """Requests/s of ``GET /v2/health/ready`` (no body, no model) at ``concurrency``:
    what HTTP alone allows this server on this machine, the bound on one-row requests."""
    done = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while done < count:
            done += 1
            async with session.get(url + "/v2/health/ready") as response:
                await response.read()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return count / (time.perf_counter() - started)


def wait_ready(url: str, path: str, body: dict[str, Any], process: subprocess.Popen[bytes],
               timeout_s: float = 300) -> None:  # fmt: skip
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with code {process.returncode}")
        try:
            if httpx.post(url + path, json=body, timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("not ready in time")


def carpool_repository(root: Path, reranker: Path, isolation: str, instances: int) -> Path:
    (root / "mlp").mkdir(parents=True, exist_ok=True)
    (root / "mlp" / "carpool.toml").write_text(
        textwrap.dedent(
            f"""
            max_batch_size = {BATCH}
            isolation = "{isolation}"
            instance_count = {instances}
            source = {{ kind = "python_class", target = "model:MlpModel" }}
            inputs = [{{ name = "x", datatype = "FP32", dims = [{FEATURES}] }}]
            outputs = [{{ name = "y", datatype = "FP32", dims = [-1] }}]
            """
        )
    )
    (root / "mlp" / "model.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            from benchmarks.user_model_peers.models import Mlp


            class MlpModel:
                def setup(self, device):
                    self.model = Mlp()

                def collate(self, inputs):
                    return np.concatenate([i["x"] for i in inputs])

                def predict(self, rows):
                    return self.model(rows)

                def split(self, output, inputs):
                    return [{"y": output[i : i + 1]} for i in range(len(inputs))]
            """
        )
    )
    (root / "reranker").mkdir(exist_ok=True)
    (root / "reranker" / "carpool.toml").write_text(
        f'max_batch_size = {BATCH}\nisolation = "{isolation}"\ninstance_count = {instances}\n'
        f'source = {{ kind = "cross_encoder", path = "{reranker}" }}\n'
    )
    return root


def carpool_litapi_repository(root: Path, model: str, reranker: Path) -> Path:
    """The LitAPI class LitServe serves (``lit_apis.py``) for ``model``, alone (at
    ``/predict``, as LitServe serves one), as a carpool repository model of kind
    ``litapi``, batched as LitServe batches it."""
    target, options = {
        "mlp": ("MlpAPI", ""),
        "reranker": ("RerankAPI", f', options = {{ folder = "{reranker}" }}'),
    }[model]
    (root / model).mkdir(parents=True, exist_ok=True)
    (root / model / "carpool.toml").write_text(
        f"max_batch_size = {BATCH}\nbatch_timeout = 0.002\n"
        f'source = {{ kind = "litapi", target = "model:{target}"{options} }}\n'
    )
    (root / model / "model.py").write_text(
        f"import sys\nsys.path.insert(0, {str(PEERS)!r})\n"
        f"from lit_apis import {target}  # noqa: E402\n"
    )
    return root


def start(peer: str, model: str, port: int, python: str, reranker: Path,
          tmp: Path) -> subprocess.Popen[bytes]:  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    log = open(tmp / f"{peer}-{model}.log", "wb")  # noqa: SIM115 (the process keeps it)
    if peer == "carpool-litapi":
        repo = carpool_litapi_repository(tmp / f"repo-{peer}-{model}", model, reranker)
        command = [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port),
                   "--model-repository", str(repo), "--log-level", "warning"]  # fmt: skip
        cwd = str(Path.cwd())
    elif peer.startswith("carpool"):
        # carpool[-process][-xN]: isolation by process, N instances running at once
        isolation = "process" if "-process" in peer else "thread"
        instances = int(peer.rpartition("-x")[2]) if "-x" in peer else 1
        repo = carpool_repository(tmp / f"repo-{peer}", reranker, isolation, instances)
        command = [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port),
                   "--model-repository", str(repo), "--log-level", "warning"]  # fmt: skip
        cwd = str(Path.cwd())
    else:
        command = [python, f"{peer}_server.py", model, str(port), str(reranker)]
        cwd = str(PEERS)
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(process: subprocess.Popen[bytes]) -> None:
    """Stop a server and every process it started: LitServe's workers outlive their
    parent and, left spinning, slowed every later measurement of a run."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def in_process_models(reranker: Path) -> dict[str, Callable[[Any], Any]]:
    return {"mlp": Mlp(), "reranker": Reranker(reranker)}


def lean_models(reranker: Path) -> dict[str, Callable[[Any], Any]]:
    """The models as carpool's backends call them, where that differs from the plain
    in-process call: the CrossEncoder prepared once (eval mode, device) instead of on
    every ``predict``."""
    lean = Reranker(reranker)
    lean.model = prepared_once(lean.model)
    return {"reranker": lean}


def one_row(name: str, row: Any) -> Any:
    return np.asarray([row], np.float32) if name == "mlp" else [row]


def batched_rows_s(name: str, model: Callable[[Any], Any], rows: list[Any]) -> float:
    """Rows/s of ``model`` called in-process on ``rows`` in batches of ``BATCH``."""
    prepared = (
        [np.asarray(rows[i : i + BATCH], np.float32) for i in range(0, len(rows), BATCH)]
        if name == "mlp"
        else [rows[i : i + BATCH] for i in range(0, len(rows), BATCH)]
    )
    model(prepared[0])
    t0 = time.perf_counter()
    for batch in prepared:
        model(batch)
    return len(rows) / (time.perf_counter() - t0)


def ceiling(name: str, model: Callable[[Any], Any], rows: list[Any]) -> tuple[float, float]:
    """Rows/s of ``model`` called in-process in batches of ``BATCH``, and the median
    seconds of one-row calls made back to back (warm caches, busy threads)."""
    rows_s = batched_rows_s(name, model, rows[: BATCH * 20])
    singles = []
    for row in rows[:100]:
        one = one_row(name, row)
        started = time.perf_counter()
        model(one)
        singles.append(time.perf_counter() - started)
    return rows_s, statistics.median(singles)


def interleaved_c1(
    url: str,
    bodies: list[tuple[str, dict[str, Any]]],
    name: str,
    model: Callable[[Any], Any],
    rows: list[Any],
    count: int,
    limit_s: float,
    per_block: int = 20,
    idle_s: float = 0.002,
    lean: Callable[[Any], Any] | None = None,
) -> tuple[LoadResult, list[float], float, float | None]:
    """``count`` requests at concurrency 1 and as many in-process one-row calls of the
    same rows, in alternating blocks of ``per_block``; and the median over blocks of
    (the block's c=1 p50 - its in-process p50). The CPU here drifts by tens of percent
    in minutes: paired blocks see the same stretch of it. Each in-process call follows
    ``idle_s`` of idleness, as the server's model is called once a request with the
    HTTP round trip between. Blocks, not call by call: an in-process call just before
    each request left this process's torch threads spinning on the two cores while the
    server answered (+0.16 to +0.63 ms on the MLP's c=1 p50, measured). With ``lean``
    (the same model called as carpool's backend calls it), each row is also called so,
    and the last value is the same median against those calls."""
    latencies: list[float] = []
    errors = 0
    singles: list[float] = []
    over: list[float] = []
    over_lean: list[float] = []
    started = time.perf_counter()
    for start_at in range(0, count, per_block):
        part = bodies[start_at : start_at + per_block]
        result = asyncio.run(closed_loop(url, part, 1, limit_s))
        latencies += result.latencies
        errors += result.errors
        block: list[float] = []
        lean_block: list[float] = []
        for row in rows[start_at : start_at + len(part)]:
            one = one_row(name, row)
            block.append(idle_then_time(model, one, idle_s))
            if lean is not None:
                lean_block.append(idle_then_time(lean, one, idle_s))
        singles += block
        p50 = statistics.median(result.latencies)
        over.append(p50 - statistics.median(block))
        if lean_block:
            over_lean.append(p50 - statistics.median(lean_block))
    load = LoadResult(len(latencies), errors, time.perf_counter() - started, latencies)
    lean_over = statistics.median(over_lean) if over_lean else None
    return load, singles, statistics.median(over), lean_over


def idle_then_time(model: Callable[[Any], Any], one: Any, idle_s: float) -> float:
    time.sleep(idle_s)
    t0 = time.perf_counter()
    model(one)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--litserve", default="/tmp/peers/litserve/bin/python")
    parser.add_argument("--rayserve", default="/tmp/peers/rayserve/bin/python")
    parser.add_argument("--pytriton", default="/tmp/peers/pytriton/bin/python")
    every = ["carpool", "carpool-process", "carpool-litapi", "bare", "litserve", "rayserve",
             "pytriton"]  # fmt: skip
    parser.add_argument(
        "--peers",
        nargs="+",
        default=every,
        help="servers to run; carpool[-process][-xN]: carpool by thread or process "
        "isolation with N instances running at once (default 1); carpool-litapi: "
        "carpool serving the LitAPI classes LitServe serves (lit_apis.py)",
    )
    parser.add_argument("--models", nargs="+", default=["mlp", "reranker"])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--single", type=int, default=300, help="requests at concurrency 1")
    parser.add_argument("--limit-s", type=float, default=60.0)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="carpool-user-models-"))
    reranker = tmp / "reranker-weights"
    make_reranker(reranker, BUILTIN_MODELS["all-minilm-l6-v2"].locate())
    work = workloads(args.requests)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus; "
          f"logs in {tmp}")  # fmt: skip
    models = in_process_models(reranker)
    leans = lean_models(reranker)
    ceilings = {name: ceiling(name, model, work[name].rows) for name, model in models.items()}
    for name, (rows_s, single) in ceilings.items():
        print(f"in-process {name}: {rows_s:.0f} rows/s in batches of {BATCH}; one-row "
              f"calls back to back p50 {single * 1e3:.2f} ms")  # fmt: skip
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for model in args.models:
        for peer in args.peers:
            python = getattr(args, peer.split("-")[0], sys.executable)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            tensors = peer.startswith(("carpool", "pytriton")) and peer != "carpool-litapi"
            shape = v2_body if tensors else plain_body
            bodies = [shape(model, row) for row in work[model].rows]
            process = start(peer, model, port, python, reranker, tmp)
            try:
                wait_ready(url, *bodies[0], process)
                asyncio.run(closed_loop(url, bodies[:200], 16, args.limit_s))  # warm up
                one, singles, over, over_lean = interleaved_c1(
                    url, bodies, model, models[model], work[model].rows, args.single,
                    args.limit_s, lean=leans.get(model) if peer.startswith("carpool") else None,
                )  # fmt: skip
                single = statistics.median(singles)
                # The batched ceiling just before and just after the c=64 run (the
                # server idle): the figure it is compared with drifts within minutes.
                bracket = work[model].rows[: BATCH * 5]
                before = batched_rows_s(model, models[model], bracket)
                many = asyncio.run(closed_loop(url, bodies, 64, args.limit_s))
                after = batched_rows_s(model, models[model], bracket)
                results[(model, peer)] = {
                    "c1": one.summary(),
                    "c64": many.summary(),
                    "in_process_single": single,
                    "c1_over_in_process": over,
                    "c1_over_lean": over_lean,
                    "ceiling_rows_s": (before + after) / 2,
                }
                if peer.startswith("carpool"):
                    floor = asyncio.run(route_floor(url, len(bodies), 64))
                    results[(model, peer)]["route_floor_rps"] = floor
            except Exception as exc:
                results[(model, peer)] = {"error": str(exc)}
            finally:
                stop(process)
            print(model, peer, json.dumps(results[(model, peer)]), flush=True)
    print()
    print("| model | server | in-process one-row p50 ms | c=1 p50 ms | c=1 over in-process ms | "
          "c=64 rows/s | in-process batched rows/s around it | c=64 p50 ms | c=64 p99 ms | "
          "errors |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (model, peer), r in results.items():
        if "error" in r:
            print(f"| {model} | {peer} | did not run: {r['error']} | | | | | | | |")
            continue
        print(f"| {model} | {peer} | {r['in_process_single'] * 1e3:.2f} | "
              f"{r['c1']['p50'] * 1e3:.2f} | {r['c1_over_in_process'] * 1e3:+.2f} | "
              f"{r['c64']['rps']:.0f} | {r['ceiling_rows_s']:.0f} | "
              f"{r['c64']['p50'] * 1e3:.1f} | {r['c64']['p99'] * 1e3:.1f} | "
              f"{int(r['c1']['errors'] + r['c64']['errors'])} |")  # fmt: skip
    for model in args.models:
        ours = results.get((model, "carpool"), {})
        if "c64" not in ours:
            continue
        peers = [r for (m, p), r in results.items() if m == model
                 and not p.startswith(("carpool", "bare")) and "c64" in r]  # fmt: skip
        over = ours["c1_over_in_process"]
        line = (f"{model}: carpool c=64 = {ours['c64']['rps'] / ours['ceiling_rows_s']:.2f}x "
                f"the in-process ceiling measured around it; c=1 p50 = in-process one-row "
                f"call (after 2 ms idle; median of interleaved blocks' differences) "
                f"{over * 1e3:+.2f} ms (back to back "
                f"{(ours['c1']['p50'] - ceilings[model][1]) * 1e3:+.2f} ms)")  # fmt: skip
        if ours.get("c1_over_lean") is not None:
            line += (f"; against the same model called in-process as carpool's backend calls "
                     f"it (prepared once): {ours['c1_over_lean'] * 1e3:+.2f} ms")  # fmt: skip
        bare = results.get((model, "bare"), {})
        if "c1_over_in_process" in bare:
            line += (f"; the bare server (no batching, the model on its event loop): c=1 "
                     f"+{bare['c1_over_in_process'] * 1e3:.2f} ms")  # fmt: skip
        if "route_floor_rps" in ours:
            line += (f"; GET /v2/health/ready alone at c=64: {ours['route_floor_rps']:.0f} "
                     f"requests/s = {ours['route_floor_rps'] / ours['ceiling_rows_s']:.2f}x the "
                     f"ceiling")  # fmt: skip
        if peers:
            best = max(peers, key=lambda r: r["c64"]["rps"])
            line += (f"; {ours['c64']['rps'] / best['c64']['rps']:.2f}x the best peer's "
                     f"throughput, p99 {ours['c64']['p99'] * 1e3:.1f} vs "
                     f"{best['c64']['p99'] * 1e3:.1f} ms")  # fmt: skip
        print(line)
    print("\nreproduce: python -m benchmarks.user_models " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
