"""``carpool.batched`` + ``carpool.serve``: a plain Python function served and batched
(a real server started from a user's script)."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from carpool.testing import spawn
from tests.integration.conftest import READY, Server, stop_server

SCRIPT = """
    import numpy as np

    import carpool


    @carpool.batched(
        inputs={"x": ("FP32", [3])},
        outputs={"y": ("FP32", [3]), "rows": ("INT64", [1])},
        max_batch_size=16,
        max_queue_delay_ms=60000,
        preferred_batch_sizes=[4],
    )
    def double(x):
        return {"y": x * 2, "rows": np.full((len(x), 1), len(x), np.int64)}


    class Tripler:
        # A LitServe LitAPI, handed to carpool.serve as to LitServer.

        def setup(self, device):
            self.device = device

        def decode_request(self, request):
            return request["x"]

        def predict(self, xs):
            return [3 * x for x in xs]

        def encode_response(self, y):
            return {"y": y, "device": self.device}


    tripler = carpool.lit_api(Tripler(), max_batch_size=8, batch_timeout=0.001)
    raise SystemExit(carpool.serve(double, tripler, port=0))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    script = tmp_path_factory.mktemp("function") / "serve_double.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path.cwd())}
    process, match, log = spawn([sys.executable, str(script)], READY, 120, env)
    s = Server(match.group(1), process, log)
    yield s
    assert stop_server(s) == 0


def test_a_litapi_instance_is_served_beside_the_function(server: Server) -> None:
    assert httpx.post(f"{server.url}/predict", json={"x": 2}).json() == {"y": 6, "device": "cpu"}
    named = httpx.post(f"{server.url}/v1/models/Tripler/predict", json={"x": 1})
    assert named.json()["y"] == 3


def test_a_function_is_served_and_batched(server: Server) -> None:
    def call(rows: int) -> triton.InferResult:
        c = triton.InferenceServerClient(server.url.removeprefix("http://"))
        x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
        tensor = triton.InferInput("x", [rows, 3], "FP32")
        tensor.set_data_from_numpy(x)
        result = c.infer("double", [tensor])
        np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
        return result

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(call, [1, 1, 2]))
    # The three requests (four rows: the preferred batch size) ran as one call.
    assert [r.as_numpy("rows").reshape(-1).tolist() for r in results] == [[4], [4], [4, 4]]
    c = triton.InferenceServerClient(server.url.removeprefix("http://"))
    assert c.get_model_metadata("double")["inputs"] == [
        {"name": "x", "datatype": "FP32", "shape": [-1, 3]}
    ]
