"""How long one large request holds the event loop: a prompt just under the body
limit (text, single-digit token ids, the densest body there is, a chat message, an
embedding input, 5-digit token ids, each sent as compact JSON) goes to a running
server while ``/health`` is polled every 10 ms; prints each request's answer, its
time, the slowest ``/health`` answer meanwhile, and the server's RSS growth.

    carpool serve --port 8123 &
    python -m benchmarks.loop_stall --url http://127.0.0.1:8123 [--pid PID] [--mb 2]

``--mb``: the body size to aim at, in MB (the server's ``--max-body-bytes``; 2 MiB
by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"


def cases(mb: float) -> dict[str, tuple[str, dict[str, object]]]:
    """Bodies of about ``mb`` MB (a little under)."""
    size = int(mb * 1e6 * 0.97)
    text = "hello world " * (size // 12)
    return {
        "text prompt": ("/v1/completions", {"model": CHAT, "prompt": text, "max_tokens": 2}),
        "token-id prompt": (
            "/v1/completions",
            {"model": CHAT, "prompt": [5] * (size // 2), "max_tokens": 2},
        ),
        "5-digit ids": (
            "/v1/completions",
            {"model": CHAT, "prompt": [12345] * (size // 6), "max_tokens": 2},
        ),
        "chat message": (
            "/v1/chat/completions",
            {"model": CHAT, "messages": [{"role": "user", "content": text}], "max_tokens": 2},
        ),
        "embedding input": ("/v1/embeddings", {"model": EMBED, "input": text}),
    }


def compact(body: dict[str, object]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def one(url: str, path: str, data: bytes) -> tuple[int, float, float]:
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
    parser.add_argument("--mb", type=float, default=2.0, help="body size to aim at, MB")
    args = parser.parse_args()
    print(f"python -m benchmarks.loop_stall --url {args.url} --mb {args.mb}")
    header = ("request", "MB", "status", "took s", "worst /health s", "RSS +MiB")
    print("{:<16} {:>5} {:>6} {:>7} {:>16} {:>9}".format(*header))
    for name, (path, body) in cases(args.mb).items():
        data = compact(body)
        before = rss_mib(args.pid)
        status, took, worst = asyncio.run(one(args.url, path, data))
        size = len(data) / 1e6
        grew = rss_mib(args.pid) - before
        print(f"{name:<16} {size:>5.1f} {status:>6} {took:>7.2f} {worst:>16.3f} {grew:>9.0f}")


if __name__ == "__main__":
    main()
