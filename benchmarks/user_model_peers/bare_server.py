"""The floor for one request at a time: a bare ASGI app under uvicorn (httptools,
uvloop) that calls the model inline on its event loop, one request at a time, with
no batching, no routing and no validation. Not a peer (it batches nothing): what
HTTP alone adds to an in-process call on this machine at concurrency 1.

python bare_server.py {mlp|reranker} PORT RERANKER_FOLDER
"""

import sys
from pathlib import Path

import numpy as np
import orjson
import uvicorn
from models import Mlp, Reranker


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    if kind == "mlp":
        mlp = Mlp()

        def answer(body: dict) -> dict:
            return {"y": mlp(np.asarray([body["x"]], np.float32))[0].tolist()}
    else:
        reranker = Reranker(Path(sys.argv[3]))

        def answer(body: dict) -> dict:
            return {"score": float(reranker([(body["query"], body["document"])])[0])}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        payload = orjson.dumps(answer(orjson.loads(b"".join(chunks))))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    uvicorn.run(
        app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools"
    )


if __name__ == "__main__":
    main()
