"""The baseline: one request at a time, the pattern of Hugging Face's "pipelines for a
webserver" guide (a queue, one server loop, one model call per request).

    python benchmarks/naive_embedding_server.py PORT
"""

from __future__ import annotations

import asyncio
import socket
import sys

import uvicorn
from sentence_transformers import SentenceTransformer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from carpool.models.registry import BUILTIN_MODELS

model = SentenceTransformer(str(BUILTIN_MODELS["all-minilm-l6-v2"].locate()), device="cpu")
queue: asyncio.Queue[tuple[str, asyncio.Future[list[float]]]] = asyncio.Queue()


async def embeddings(request: Request) -> JSONResponse:
    body = await request.json()
    future: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()
    await queue.put((body["input"], future))
    vector = await future
    return JSONResponse({"data": [{"index": 0, "embedding": vector}]})


async def server_loop() -> None:
    while True:
        text, future = await queue.get()
        vector = model.encode([text])[0].tolist()
        future.set_result(vector)


async def main(port: int) -> None:
    app = Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    loop_task = asyncio.create_task(server_loop())
    # Bind and listen before announcing readiness; IPPROTO_TCP so asyncio sets
    # TCP_NODELAY on accepted sockets, as it does for carpool.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    print(f"naive ready on http://127.0.0.1:{port}", flush=True)
    await uvicorn.Server(config).serve(sockets=[sock])
    loop_task.cancel()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
