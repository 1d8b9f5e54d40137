"""LitServe serving one model (one LitServer per model, on its own port), the LitAPI
classes of ``lit_apis.py`` with ``litserve.LitAPI`` as their base.

python litserve_server.py {mlp|reranker} PORT RERANKER_FOLDER
"""

import sys

import litserve as ls
from lit_apis import MlpAPI, RerankAPI


class LitMlp(MlpAPI, ls.LitAPI):
    pass


class LitRerank(RerankAPI, ls.LitAPI):
    pass


if __name__ == "__main__":
    options = {"max_batch_size": 64, "batch_timeout": 0.002}
    api = LitMlp(**options) if sys.argv[1] == "mlp" else LitRerank(sys.argv[3], **options)
    ls.LitServer(api, accelerator="cpu", workers_per_device=1).run(port=int(sys.argv[2]))
