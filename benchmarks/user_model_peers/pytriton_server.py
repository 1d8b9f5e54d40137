"""PyTriton (Triton Inference Server under a Python callable, @batch) serving one model.

python pytriton_server.py {mlp|reranker} PORT RERANKER_FOLDER
"""

import sys
from pathlib import Path

import numpy as np
from models import CLASSES, FEATURES, Mlp, Reranker
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

if __name__ == "__main__":
    which, port = sys.argv[1], int(sys.argv[2])
    config = ModelConfig(
        max_batch_size=64, batcher=DynamicBatcher(max_queue_delay_microseconds=2000)
    )
    with Triton(
        config=TritonConfig(http_port=port, grpc_port=port + 1, metrics_port=port + 2)
    ) as triton:
        if which == "mlp":
            mlp = Mlp()

            @batch
            def infer(x):
                return {"y": mlp(x.astype(np.float32))}

            triton.bind(
                model_name="mlp",
                infer_func=infer,
                inputs=[Tensor(name="x", dtype=np.float32, shape=(FEATURES,))],
                outputs=[Tensor(name="y", dtype=np.float32, shape=(CLASSES,))],
                config=config,
            )
        else:
            reranker = Reranker(Path(sys.argv[3]))

            @batch
            def infer(query, document):
                pairs = [
                    (q[0].decode(), d[0].decode()) for q, d in zip(query, document, strict=True)
                ]
                return {"score": reranker(pairs).reshape(-1, 1)}

            triton.bind(
                model_name="reranker",
                infer_func=infer,
                inputs=[
                    Tensor(name="query", dtype=bytes, shape=(1,)),
                    Tensor(name="document", dtype=bytes, shape=(1,)),
                ],
                outputs=[Tensor(name="score", dtype=np.float32, shape=(1,))],
                config=config,
            )
        print("pytriton ready", flush=True)
        triton.serve()
