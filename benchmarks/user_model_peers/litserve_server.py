"""LitServe serving the MLP (/mlp ... no: one LitServer per model, on its own port).

python litserve_server.py {mlp|reranker} PORT RERANKER_FOLDER
"""

import sys
from pathlib import Path

import litserve as ls
import numpy as np
from models import Mlp, Reranker


class MlpAPI(ls.LitAPI):
    def setup(self, device):
        self.model = Mlp()

    def decode_request(self, request):
        return np.asarray(request["x"], np.float32)

    def batch(self, inputs):
        return np.stack(inputs)

    def predict(self, x):
        return self.model(x)

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return {"y": output.tolist()}


class RerankAPI(ls.LitAPI):
    def setup(self, device):
        self.model = Reranker(Path(sys.argv[3]))

    def decode_request(self, request):
        return (request["query"], request["document"])

    def batch(self, inputs):
        return inputs

    def predict(self, pairs):
        return self.model(pairs)

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return {"score": float(output)}


if __name__ == "__main__":
    api = (
        MlpAPI(max_batch_size=64, batch_timeout=0.002)
        if sys.argv[1] == "mlp"
        else RerankAPI(max_batch_size=64, batch_timeout=0.002)
    )
    ls.LitServer(api, accelerator="cpu", workers_per_device=1).run(port=int(sys.argv[2]))
