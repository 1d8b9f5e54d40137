"""Ray Serve with @serve.batch serving one model over HTTP.

python rayserve_server.py {mlp|reranker} PORT RERANKER_FOLDER
"""

import sys
import time
from pathlib import Path

import numpy as np
import ray
from models import Mlp, Reranker
from ray import serve
from starlette.requests import Request


@serve.deployment(max_ongoing_requests=256)
class MlpDeployment:
    def __init__(self):
        self.model = Mlp()

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.002)
    async def run(self, rows):
        return list(self.model(np.stack(rows)))

    async def __call__(self, request: Request):
        body = await request.json()
        y = await self.run(np.asarray(body["x"], np.float32))
        return {"y": y.tolist()}


@serve.deployment(max_ongoing_requests=256)
class RerankDeployment:
    def __init__(self, folder):
        self.model = Reranker(Path(folder))

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.002)
    async def run(self, pairs):
        return list(self.model(pairs))

    async def __call__(self, request: Request):
        body = await request.json()
        return {"score": float(await self.run((body["query"], body["document"])))}


if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024)
    serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})
    app = MlpDeployment.bind() if sys.argv[1] == "mlp" else RerankDeployment.bind(sys.argv[3])
    serve.run(app, route_prefix="/predict")
    print("ray serve ready", flush=True)
    while True:
        time.sleep(3600)
