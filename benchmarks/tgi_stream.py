"""TGI's ``/generate_stream`` against carpool's own OpenAI stream on one server: the
same greedy workload (prompts of token-ish words, a fixed number of tokens each, EOS
ignored for OpenAI and left to ``max_new_tokens`` for TGI, which stops only there on
these prompts), ``concurrency`` streams at once, rounds alternating between the two
routes so drift falls on both. Reports tokens/s per round, the medians and their
ratio: the TGI adapter should cost nothing measurable.

    python -m benchmarks.tgi_stream --concurrency 64 --tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import sys
import time

import httpx

from carpool.testing import spawn

MODEL = "smollm2-135m-instruct"


async def _openai(client: httpx.AsyncClient, prompt: str, tokens: int) -> int:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    count = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                count += 1
    return count


async def _tgi(client: httpx.AsyncClient, prompt: str, tokens: int) -> int:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens}}
    count = 0
    async with client.stream("POST", "/generate_stream", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                count += 1
                if event.get("generated_text") is not None:
                    break
    return count


async def _round(url: str, route: str, concurrency: int, tokens: int) -> tuple[float, int]:
    """(seconds, events received) for ``concurrency`` streams on ``route``."""
    one = _openai if route == "openai" else _tgi
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        prompts = [f"Story number {i}: once upon a time" for i in range(concurrency)]
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, p, tokens) for p in prompts))
        return time.perf_counter() - start, sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    command = [sys.executable, "-m", "carpool.cli", "serve", "--port", "0", "--model", MODEL]
    command += ["--max-model-len", "1024", "--max-num-seqs", str(args.concurrency)]
    process, match, _ = spawn(command, re.compile(r"carpool ready on (http://\S+)"), 300.0, None)
    url = match.group(1)
    rates: dict[str, list[float]] = {"openai": [], "tgi": []}
    try:
        asyncio.run(_round(url, "openai", 4, 8))  # warm both paths
        asyncio.run(_round(url, "tgi", 4, 8))
        for r in range(args.rounds):
            for route in ("openai", "tgi") if r % 2 == 0 else ("tgi", "openai"):
                seconds, events = asyncio.run(_round(url, route, args.concurrency, args.tokens))
                rate = events / seconds  # an event per token on both routes
                rates[route].append(rate)
                print(f"round {r + 1} {route:6s}: {seconds:6.2f} s, {events} events, "
                      f"{rate:7.1f} tokens/s")  # fmt: skip
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    openai, tgi = statistics.median(rates["openai"]), statistics.median(rates["tgi"])
    print(f"median tokens/s: openai {openai:.1f}, tgi {tgi:.1f}, tgi/openai {tgi / openai:.3f}")
    print(
        "reproduce: python -m benchmarks.tgi_stream "
        f"--concurrency {args.concurrency} --tokens {args.tokens} --rounds {args.rounds}"
    )


if __name__ == "__main__":
    main()
