"""How long one oversized request holds the event loop: a ~7 MB prompt (text, token
ids, a chat message, an embedding input) is sent to a running server while
``/health`` is polled every 10 ms; prints each request's answer, its time, and the
slowest ``/health`` answer meanwhile, and the server's RSS growth.

    carpool serve --port 8123 &
    python -m benchmarks.loop_stall --url http://127.0.0.1:8123 [--pid PID]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
TEXT = "hello world " * 600_000

CASES: dict[str, tuple[str, dict[str, object]]] = {
    "text prompt": ("/v1/completions", {"model": CHAT, "prompt": TEXT, "max_tokens": 2}),
    "token-id prompt": (
        "/v1/completions",
        {"model": CHAT, "prompt": [5] * 1_500_000, "max_tokens": 2},
    ),
    "chat message": (
        "/v1/chat/completions",
        {"model": CHAT, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 2},
    ),
    "embedding input": ("/v1/embeddings", {"model": EMBED, "input": TEXT}),
}


def rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def one(url: str, path: str, body: dict[str, object]) -> tuple[int, float, float]:
    data = json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        worst = 0.0
        done = False

        async def ping() -> None:
            nonlocal worst
            while not done:
                t = time.monotonic()
                await c.get("/health")
                worst = max(worst, time.monotonic() - t)
                await asyncio.sleep(0.01)

        poller = asyncio.create_task(ping())
        t = time.monotonic()
        r = await c.post(path, content=data, headers={"content-type": "application/json"})
        took = time.monotonic() - t
        done = True
        await poller
        return r.status_code, took, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8123")
    parser.add_argument("--pid", type=int, default=None, help="the server's pid, for its RSS")
    args = parser.parse_args()
    print("python -m benchmarks.loop_stall --url", args.url)
    header = ("request", "MB", "status", "took s", "worst /health s", "RSS +MiB")
    print("{:<16} {:>5} {:>6} {:>7} {:>16} {:>9}".format(*header))
    for name, (path, body) in CASES.items():
        before = rss_mib(args.pid)
        status, took, worst = asyncio.run(one(args.url, path, body))
        size = len(json.dumps(body)) / 1e6
        grew = rss_mib(args.pid) - before
        print(f"{name:<16} {size:>5.1f} {status:>6} {took:>7.2f} {worst:>16.3f} {grew:>9.0f}")


if __name__ == "__main__":
    main()
