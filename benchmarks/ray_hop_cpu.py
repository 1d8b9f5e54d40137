"""What streaming one chunk through Ray Serve costs in CPU, with no model: a
deployment yields ``--chunks`` SSE-sized chunks 2 ms apart and a client reads them
through four fronts, in one run:

- ``local``: uvicorn in this process, no Ray (carpool's single process);
- ``driver``: uvicorn in this process over a deployment handle (one Ray hop; what
  ``carpool serve --replicas`` does);
- ``proxy``: Ray Serve's HTTP proxy and an ingress deployment that yields the
  chunks itself (one Ray hop);
- ``proxy+ingress``: Ray Serve's proxy, an ingress deployment, and the deployment
  behind its handle (two Ray hops; what ``build_app`` under ``serve.run`` does).

The CPU time of every process on the machine (client included) is read from /proc
before and after; per chunk is that over the chunks.

    python -m benchmarks.ray_hop_cpu [--chunks 2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from collections.abc import AsyncIterator

import httpx
import ray
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from ray import serve

from carpool.distributed.launch import local_cluster
from carpool.testing import free_port

CHUNK = b"data: " + b"x" * 200 + b"\n\n"


async def chunks(n: int) -> AsyncIterator[bytes]:
    for _ in range(n):
        await asyncio.sleep(0.002)
        yield CHUNK


@serve.deployment(ray_actor_options={"num_cpus": 1})
class Source:
    async def stream(self, n: int) -> AsyncIterator[bytes]:
        async for c in chunks(n):
            yield c


ingress_app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(ingress_app)
class Front:
    def __init__(self, source: serve.handle.DeploymentHandle) -> None:
        self.source = source

    @ingress_app.get("/proxy/{n}")
    async def proxy(self, n: int) -> StreamingResponse:
        return StreamingResponse(chunks(n), media_type="text/event-stream")

    @ingress_app.get("/hops/{n}")
    async def hops(self, n: int) -> StreamingResponse:
        stream = self.source.options(stream=True).stream.remote(n)
        return StreamingResponse(stream, media_type="text/event-stream")


def cpu_seconds() -> float:
    """CPU time of every process now alive, user and system."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def read_stream(url: str) -> None:
    with httpx.Client(timeout=300) as c, c.stream("GET", url) as r:
        for _ in r.iter_bytes():
            pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ray.init(log_to_driver=False, **local_cluster(num_cpus=2, object_store_bytes=96 << 20))
    proxy_port, local_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
    serve.run(Front.bind(Source.bind()), route_prefix="/")
    handle = serve.get_deployment_handle("Source", "default")
    local = FastAPI()

    @local.get("/local/{n}")
    async def in_process(n: int) -> StreamingResponse:
        return StreamingResponse(chunks(n), media_type="text/event-stream")

    @local.get("/driver/{n}")
    async def driver(n: int) -> StreamingResponse:
        stream = handle.options(stream=True).stream.remote(n)
        return StreamingResponse(stream, media_type="text/event-stream")

    server = uvicorn.Server(uvicorn.Config(local, port=local_port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    fronts = {
        "local": f"http://127.0.0.1:{local_port}/local",
        "driver": f"http://127.0.0.1:{local_port}/driver",
        "proxy": f"http://127.0.0.1:{proxy_port}/proxy",
        "proxy+ingress": f"http://127.0.0.1:{proxy_port}/hops",
    }
    seen: dict[str, list[float]] = {name: [] for name in fronts}
    for _ in range(args.rounds):
        for name, url in fronts.items():
            before = cpu_seconds()
            read_stream(f"{url}/{args.chunks}")
            seen[name].append((cpu_seconds() - before) / args.chunks * 1000)
    for name, per_chunk in seen.items():
        print(f"{name:14} CPU per chunk {', '.join(f'{x:.2f}' for x in per_chunk)} ms")
    serve.shutdown()
    ray.shutdown()
    print("reproduce: python -m benchmarks.ray_hop_cpu " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
