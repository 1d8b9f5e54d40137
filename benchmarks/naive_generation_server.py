"""The baseline: a generation server built the way Hugging Face's "pipelines for a
webserver" guide shows: one loop that takes requests from a queue and runs
transformers' ``generate`` on each, one at a time, on the event loop. It answers
/v1/completions (a stream is one event holding the whole text, then usage).

    python -m benchmarks.naive_generation_server --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.generation import _hf_model

MODEL = "smollm2-135m-instruct"


def build_app() -> Starlette:
    model = _hf_model()
    from transformers import AutoTokenizer

    from carpool.models.registry import BUILTIN_MODELS

    path = BUILTIN_MODELS[MODEL].locate()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    queue: asyncio.Queue[tuple[dict[str, Any], asyncio.Queue[dict[str, Any]]]] = asyncio.Queue()

    async def server_loop() -> None:
        while True:
            body, reply = await queue.get()
            prompt = body["prompt"]
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            new = int(body.get("max_tokens", 16))
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=new,
                    min_new_tokens=new if body.get("ignore_eos") else 0,
                    do_sample=False,
                    pad_token_id=0,
                )
            generated = out[0, len(ids) :].tolist()
            await reply.put(
                {
                    "text": tokenizer.decode(generated, skip_special_tokens=True),
                    "usage": {
                        "prompt_tokens": len(ids),
                        "completion_tokens": len(generated),
                        "total_tokens": len(ids) + len(generated),
                    },
                }
            )

    async def completions(request: Request) -> Response:
        body = await request.json()
        reply: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        await queue.put((body, reply))
        result = await reply.get()
        choice = {"index": 0, "text": result["text"], "finish_reason": "length"}
        if not body.get("stream"):
            return JSONResponse({"choices": [choice], "usage": result["usage"]})

        async def events() -> Any:
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': result['usage']})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        loop_task = asyncio.get_running_loop().create_task(server_loop())
        yield
        loop_task.cancel()

    return Starlette(
        routes=[Route("/v1/completions", completions, methods=["POST"])], lifespan=lifespan
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    uvicorn.run(build_app(), host="127.0.0.1", port=args.port, log_level="info", access_log=False)


if __name__ == "__main__":
    main()
