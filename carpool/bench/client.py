"""One benchmark request against an OpenAI-compatible endpoint, timed as the client
sees it: /v1/completions and /v1/chat/completions streamed (TTFT at the first
piece of text, ITL between pieces, tokens from the final usage chunk),
/v1/embeddings whole."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from carpool.bench.metrics import Outcome
from carpool.bench.workload import BenchRequest


def body_for(
    endpoint: str, model: str, request: BenchRequest, extra: dict[str, Any]
) -> dict[str, Any]:
    """The JSON body of ``request`` for ``endpoint`` (``extra`` merged in)."""
    if endpoint == "/v1/embeddings":
        return {"model": model, "input": request.prompt, **extra}
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def text_of(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    if "delta" in first:
        return str(first["delta"].get("content") or "")
    return str(first.get("text") or "")


async def send(
    client: httpx.AsyncClient,
    endpoint: str,
    model: str,
    request: BenchRequest,
    extra: dict[str, Any],
) -> Outcome:
    """Send ``request``; its outcome (never raises for HTTP or connection errors)."""
    body = body_for(endpoint, model, request, extra)
    started = time.perf_counter()
    try:
        if endpoint == "/v1/embeddings":
            response = await client.post(endpoint, json=body)
            outcome = Outcome(response.status_code, sent=started)
            if response.status_code == 200:
                outcome.prompt_tokens = int(
                    response.json().get("usage", {}).get("prompt_tokens", 0)
                )
            outcome.latency = time.perf_counter() - started
            return outcome
        return await _stream(client, endpoint, body, started)
    except httpx.HTTPError:
        return Outcome(None, latency=time.perf_counter() - started, sent=started)


async def _stream(
    client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], started: float
) -> Outcome:
    async with client.stream("POST", endpoint, json=body) as response:
        outcome = Outcome(response.status_code, sent=started)
        if response.status_code != 200:
            await response.aread()
            outcome.latency = time.perf_counter() - started
            return outcome
        last: float | None = None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("error"):
                outcome.status = int(chunk["error"].get("code") or 500)
            if chunk.get("usage"):
                outcome.prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
                outcome.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
            if text_of(chunk):
                if last is None:
                    outcome.ttft = now - started
                else:
                    outcome.itl.append(now - last)
                last = now
        outcome.latency = time.perf_counter() - started
        return outcome
