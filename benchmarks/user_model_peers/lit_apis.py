"""The two models as LitServe ``LitAPI`` classes, written once and served unchanged by
LitServe (``litserve_server.py`` adds ``litserve.LitAPI`` as a base) and by carpool
(a repository model of kind ``litapi``). No litserve import: carpool needs none.

Importable from this folder (``from lit_apis import ...``), as each peer runs it.
"""

from pathlib import Path

import numpy as np
from models import Mlp, Reranker


class MlpAPI:
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


class RerankAPI:
    def __init__(self, folder, **litserve_options):
        super().__init__(**litserve_options)  # litserve.LitAPI's, where it is a base
        self.folder = Path(folder)

    def setup(self, device):
        self.model = Reranker(self.folder)

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
