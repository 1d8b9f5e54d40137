"""One benchmark request against an OpenAI-compatible endpoint, timed as the client
sees it: /v1/completions and /v1/chat/completions streamed (TTFT at the first
piece of text, ITL between pieces, tokens from the final usage chunk),
/v1/embeddings whole.

On aiohttp, as vLLM's serving benchmark: httpx's client spent ~10 ms of CPU per
streamed request on a 2-vCPU machine, so at 64 streams the client, not the server,
set the rate measured (aiohttp: under 1 ms)."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import orjson

from carpool.bench.metrics import ClientRecord
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


def _text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    if "delta" in first:
        return str(first["delta"].get("content") or "")
    return str(first.get("text") or "")


async def send(
    session: aiohttp.ClientSession,
    url: str,
    endpoint: str,
    model: str,
    request: BenchRequest,
    extra: dict[str, Any],
) -> ClientRecord:
    """Send ``request`` to ``url + endpoint``; its outcome (never raises for HTTP or
    connection errors, or the session's timeout)."""
    body = body_for(endpoint, model, request, extra)
    started = time.perf_counter()
    try:
        if endpoint == "/v1/embeddings":
            async with session.post(url + endpoint, json=body) as response:
                outcome = ClientRecord(response.status, sent=started)
                answer = await response.read()
            if response.status == 200:
                outcome.prompt_tokens = int(
                    json.loads(answer).get("usage", {}).get("prompt_tokens", 0)
                )
            outcome.latency = time.perf_counter() - started
            return outcome
        return await _stream(session, url + endpoint, body, started)
    except (TimeoutError, aiohttp.ClientError):
        return ClientRecord(None, latency=time.perf_counter() - started, sent=started)


def sse_data(pending: bytes, data: bytes) -> tuple[list[bytes], bytes]:
    """The ``data:`` payloads of the complete lines of a server-sent event stream in
    ``pending + data`` (not ``[DONE]``), and what is left of a line cut off at the end."""
    *lines, rest = (pending + data).split(b"\n")
    payloads = []
    for raw in lines:
        line = raw.rstrip(b"\r")
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            payloads.append(line[6:])
    return payloads, rest


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], started: float
) -> ClientRecord:
    async with session.post(url, json=body) as response:
        outcome = ClientRecord(response.status, sent=started)
        if response.status != 200:
            await response.read()
            outcome.latency = time.perf_counter() - started
            return outcome
        last: float | None = None
        pending = b""
        # The body as it arrives, split into lines here: a read often holds several
        # events, and awaiting each line (two an event) cost this client ~3 us of CPU a
        # token on cores it shares with the server it measures. The events of one read
        # arrived together: they share its time.
        async for data in response.content.iter_any():
            now = time.perf_counter()
            payloads, pending = sse_data(pending, data)
            for payload in payloads:
                chunk = orjson.loads(payload)
                if chunk.get("error"):
                    outcome.status = int(chunk["error"].get("code") or 500)
                if chunk.get("usage"):
                    outcome.prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
                    outcome.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
                if _text(chunk):
                    if last is None:
                        outcome.ttft = now - started
                    else:
                        outcome.itl.append(now - last)
                    last = now
        outcome.latency = time.perf_counter() - started
        return outcome
