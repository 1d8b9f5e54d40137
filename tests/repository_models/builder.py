"""Writes test model repositories: each model a config and its code."""

from __future__ import annotations

import json
import runpy
import shutil
import textwrap
from pathlib import Path

from tests.repository_models.tensor_models import add_tensor_models

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_repository"
DATATYPES = (
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "BF16", "FP32", "FP64", "BYTES",
)  # fmt: skip


def triton_model(root: Path, name: str, config: str, code: str, version: int = 1) -> None:
    """``root/name/config.pbtxt`` and ``root/name/<version>/model.py``."""
    folder = root / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(textwrap.dedent(config))
    (folder / str(version) / "model.py").write_text(textwrap.dedent(code))


def carpool_model(root: Path, name: str, toml: str, code: str) -> None:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "carpool.toml").write_text(textwrap.dedent(toml))
    (folder / "model.py").write_text(textwrap.dedent(code))


BATCH_REPORT = """
    import os
    import time

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            inputs = [pb_utils.get_input_tensor_by_name(r, "x").as_numpy() for r in requests]
            widths = len({x.shape[1:] for x in inputs})
            out = []
            for x in inputs:
                value = int(x.reshape(-1)[0]) if x.size else 0
                if value == 13:
                    raise ValueError("13 is unlucky")
                if value == 99:
                    os._exit(3)
                if value == 77:
                    time.sleep(3600)
                if value == 55:
                    raise SystemExit(1)
                if value == -1:
                    error = pb_utils.TritonError("negative one")
                    out.append(pb_utils.InferenceResponse(error=error))
                    continue
                rows = x.shape[0]
                count = np.full((rows, 1), len(requests), np.int32)
                if value == 7:
                    count = count.astype(np.float64)
                if value == 8:
                    count = np.zeros((rows + 1, 1), np.int32)
                tensors = [
                    pb_utils.Tensor("count", count),
                    pb_utils.Tensor("shapes", np.full((rows, 1), widths, np.int32)),
                    pb_utils.Tensor("total", x.reshape(rows, -1).sum(axis=1, keepdims=True)),
                    pb_utils.Tensor("pid", np.full((rows, 1), os.getpid(), np.int64)),
                ]
                out.append(pb_utils.InferenceResponse(output_tensors=tensors))
            return out
"""


def batch_report_config(name: str, ragged: bool, extra: str = "", batching: str = "") -> str:
    ragged_text = str(ragged).lower()
    return f"""
        name: "{name}"
        backend: "python"
        max_batch_size: 8
        dynamic_batching {{
          {batching or "preferred_batch_size: [ 4 ]  max_queue_delay_microseconds: 30000000"}
        }}
        input [
          {{ name: "x" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: {ragged_text} }}
        ]
        output [
          {{ name: "count" data_type: TYPE_INT32 dims: [ 1 ] }},
          {{ name: "shapes" data_type: TYPE_INT32 dims: [ 1 ] }},
          {{ name: "total" data_type: TYPE_FP32 dims: [ 1 ] }},
          {{ name: "pid" data_type: TYPE_INT64 dims: [ 1 ] }}
        ]
        {extra}
    """


ECHO_TOML = (
    "max_batch_size = 4\n"
    'source = { kind = "python_class", target = "model:Echo" }\n'
    "inputs = [\n"
    + "".join(
        f'  {{ name = "in_{d}", datatype = "{d}", dims = [-1], optional = true }},\n'
        for d in DATATYPES
    )
    + "]\noutputs = [\n"
    + "".join(f'  {{ name = "out_{d}", datatype = "{d}", dims = [-1] }},\n' for d in DATATYPES)
    + "]\n"
)
ECHO_CODE = """
    class Echo:
        def predict(self, inputs):
            return [{"out_" + k[3:]: v for k, v in i.items()} for i in inputs]
"""

BROKEN_CODE = """
    import this_module_does_not_exist


    class TritonPythonModel:
        def execute(self, requests):
            return []
"""

MISCOUNT_CODE = """
    class TritonPythonModel:
        def execute(self, requests):
            return []
"""

SLOW_DOUBLE_CODE = """
    import time

    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            time.sleep(0.02)
            return [
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy() * 2)]
                )
                for r in requests
            ]
"""

SLOW_DOUBLE_CONFIG = """
    backend: "python"
    max_batch_size: 8
    dynamic_batching { }
    input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


AUTO_COMPLETED_CODE = """
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(config):
            config.add_input({"name": "a", "data_type": "TYPE_FP32", "dims": [3]})
            config.add_input({"name": "b", "data_type": "TYPE_FP32", "dims": [3]})
            config.add_output({"name": "sum", "data_type": "TYPE_FP32", "dims": [3]})
            config.set_max_batch_size(4)
            config.set_dynamic_batching()
            return config

        def execute(self, requests):
            get = pb_utils.get_input_tensor_by_name
            return [
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("sum", get(r, "a").as_numpy() + get(r, "b").as_numpy())]
                )
                for r in requests
            ]
"""


BLS_CALLER_CODE = """
    import json

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        async def execute(self, requests):
            return [await self.one(r) for r in requests]

        async def one(self, request):
            params = json.loads(request.parameters())
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            if "countdown" in params:
                return await self.count(x, params)
            call = pb_utils.InferenceRequest(
                model_name=params.get("target", "slow_double"),
                requested_output_names=["y"],
                inputs=[pb_utils.Tensor("x", x)],
            )
            answer = call.exec() if params.get("sync") else await call.async_exec()
            if answer.has_error():
                return pb_utils.InferenceResponse(error=answer.error())
            y = pb_utils.get_output_tensor_by_name(answer, "y").as_numpy()
            said = {"called": call.model_name(), "sync": bool(params.get("sync"))}
            if params.get("bad_parameter"):
                said["bad"] = [1, 2]
            return pb_utils.InferenceResponse([pb_utils.Tensor("y", y + 1)], parameters=said)

        async def count(self, x, params):
            # A decoupled model's responses, as Triton's bls_decoupled example reads them.
            call = pb_utils.InferenceRequest(
                model_name="countdown",
                requested_output_names=["count"],
                inputs=[pb_utils.Tensor("n", np.array([params["countdown"]], np.int32))],
            )
            decoupled = params.get("decoupled", True)
            if params.get("sync"):
                answers = call.exec(decoupled=decoupled)
            else:
                answers = await call.async_exec(decoupled=decoupled)
            total = 0
            remaining = []
            for answer in answers if decoupled else [answers]:
                if answer.has_error():
                    return pb_utils.InferenceResponse(error=answer.error())
                if answer.output_tensors():
                    total += int(pb_utils.get_output_tensor_by_name(answer, "count").as_numpy()[0])
                    remaining.append(str(json.loads(answer.parameters())["remaining"]))
            said = {"remaining": ",".join(remaining)}  # the callee's, through exec
            out = pb_utils.Tensor("y", x * 0 + total)
            return pb_utils.InferenceResponse([out], parameters=said)
"""


# Two instances that each wait for the other inside execute: only instances running at
# once can answer (the barrier is shared through a module both import: in one process).
PAIR_CONFIG = """
    backend: "python"
    max_batch_size: 4
    input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
    instance_group [ { count: 2 kind: KIND_CPU } ]
    parameters { key: "isolation" value: { string_value: "thread" } }
"""
PAIR_CODE = """
    import pair_barrier
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            pair_barrier.BARRIER.wait(timeout=60)
            get = pb_utils.get_input_tensor_by_name
            return [pb_utils.InferenceResponse([pb_utils.Tensor("y", get(r, "x").as_numpy())])
                    for r in requests]
"""


# A decoupled model: n responses counting down from n, sent from a thread of its own
# after execute returned; a negative n ends with an error response. 97 sends until its
# sender says the request is cancelled, then leaves a "cancelled" mark in its folder.
COUNTDOWN_CONFIG = """
    backend: "python"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "n" data_type: TYPE_INT32 dims: [ 1 ] } ]
    output [ { name: "count" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
COUNTDOWN_CODE = """
    import os
    import threading
    import time
    from pathlib import Path

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.folder = Path(args["model_repository"])

        def execute(self, requests):
            for request in requests:
                n = int(pb_utils.get_input_tensor_by_name(request, "n").as_numpy()[0])
                if n == 98:  # the process ends, a stream of an earlier request open
                    os._exit(3)
                target = self.until_cancelled if n == 97 else self.count
                threading.Thread(target=target, args=(request, n)).start()
            return None

        def until_cancelled(self, request, n):
            sender = request.get_response_sender()
            deadline = time.monotonic() + 60
            out = pb_utils.Tensor("count", np.array([n], np.int32))
            while not sender.is_cancelled() and time.monotonic() < deadline:
                sender.send(pb_utils.InferenceResponse([out]))
                time.sleep(0.01)
            (self.folder / "cancelled").write_text(str(sender.is_cancelled()))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        def count(self, request, n):
            sender = request.get_response_sender()
            for i in range(abs(n), 0, -1):
                out = pb_utils.Tensor("count", np.array([i], np.int32))
                said = {"remaining": i - 1, "last": i == 1, "share": 1 / abs(n)}
                sender.send(pb_utils.InferenceResponse([out], parameters=said))
                if n == 99:  # one response, the stream left open
                    return
            if n < 0:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("below zero")))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


# Leaves a mark in its model folder when released (finalize / teardown), so a test can
# tell that shutdown released it.
FINALIZER_CODE = """
    from pathlib import Path

    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.mark = Path(args["model_repository"]) / "finalized"

        def execute(self, requests):
            get = pb_utils.get_input_tensor_by_name
            return [pb_utils.InferenceResponse([pb_utils.Tensor("y", get(r, "x").as_numpy())])
                    for r in requests]

        def finalize(self):
            self.mark.write_text("finalized")
"""
# Answers once a "release" file appears in its model folder, after leaving a "started"
# one there: a test holds a request in flight for as long as it needs.
GATE_CODE = """
    import time
    from pathlib import Path

    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.folder = Path(args["model_repository"])

        def execute(self, requests):
            (self.folder / "started").write_text("started")
            deadline = time.monotonic() + 60
            while not (self.folder / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            get = pb_utils.get_input_tensor_by_name
            return [pb_utils.InferenceResponse([pb_utils.Tensor("y", get(r, "x").as_numpy())])
                    for r in requests]
"""
TEARDOWN_TOML = """
    max_batch_size = 4
    source = { kind = "python_class", target = "model:Marked" }
    inputs = [ { name = "x", datatype = "FP32", dims = [2] } ]
    outputs = [ { name = "y", datatype = "FP32", dims = [2] } ]
"""
TEARDOWN_CODE = """
    from pathlib import Path


    class Marked:
        def predict(self, inputs):
            return [{"y": i["x"]} for i in inputs]

        def teardown(self):
            (Path(__file__).parent / "torn_down").write_text("torn down")
"""


# Triton's readiness hook: not ready while a file named "not_ready" is in its folder.
READY_HOOK_CODE = """
    from pathlib import Path

    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.flag = Path(args["model_repository"]) / "not_ready"

        {prefix}def is_ready(self):
            return not self.flag.exists()

        def execute(self, requests):
            get = pb_utils.get_input_tensor_by_name
            return [pb_utils.InferenceResponse([pb_utils.Tensor("y", get(r, "x").as_numpy())])
                    for r in requests]
"""


# Custom metrics as Triton's custom_metrics example records them (a counter with
# labels), and a histogram.
METRICS_CODE = """
    import time

    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            latency = pb_utils.MetricFamily(
                name="requests_process_latency_ns",
                description="Cumulative time spent processing requests",
                kind=pb_utils.MetricFamily.COUNTER,
            )
            self.latency = latency.Metric(labels={"model": "metered", "version": "1"})
            kind = pb_utils.MetricFamily.HISTOGRAM
            rows = pb_utils.MetricFamily("batch_rows", "Rows per batch", kind)
            self.rows = rows.Metric(labels={"model": "metered"}, buckets=[1, 2, 4, 8])

        def execute(self, requests):
            start = time.time_ns()
            get = pb_utils.get_input_tensor_by_name
            out = [pb_utils.InferenceResponse([pb_utils.Tensor("y", get(r, "x").as_numpy())])
                   for r in requests]
            self.rows.observe(len(requests))
            self.latency.increment(time.time_ns() - start + 1)
            return out
"""


def build_finalizers(root: Path) -> Path:
    """Two models that leave a mark when released: a Python-backend model in its
    worker process and a carpool class in a thread; and ``gate``, which answers when
    the test lets it."""
    triton_model(root, "finalizer", SLOW_DOUBLE_CONFIG, FINALIZER_CODE)
    carpool_model(root, "teardown", TEARDOWN_TOML + 'isolation = "thread"\n', TEARDOWN_CODE)
    triton_model(root, "gate", SLOW_DOUBLE_CONFIG, GATE_CODE)
    return root


def build(root: Path) -> Path:
    """The repository every live test uses."""
    shutil.copytree(EXAMPLES, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns("weights"))
    runpy.run_path(str(EXAMPLES / "make_weights.py"))["main"](root)
    triton_model(
        root,
        "equal_shapes",
        batch_report_config(
            "equal_shapes",
            False,
            batching="preferred_batch_size: [ 2 ]  max_queue_delay_microseconds: 30000000",
        ),
        BATCH_REPORT,
    )
    triton_model(root, "ragged", batch_report_config("ragged", True), BATCH_REPORT)
    triton_model(
        root,
        "faulty",
        batch_report_config("faulty", False),
        BATCH_REPORT,
    )
    triton_model(
        root,
        "hangs",
        batch_report_config(
            "hangs",
            False,
            'parameters { key: "isolation" value: { string_value: "thread" } }'
            ' parameters { key: "execution_timeout_s" value: { string_value: "1" } }',
            batching="max_queue_delay_microseconds: 0",
        ),
        BATCH_REPORT,
    )
    triton_model(
        root,
        "crashes",
        batch_report_config(
            "crashes",
            False,
            'parameters { key: "isolation" value: { string_value: "process" } }'
            ' parameters { key: "execution_timeout_s" value: { string_value: "5" } }',
            batching="max_queue_delay_microseconds: 0",
        ),
        BATCH_REPORT,
    )
    triton_model(
        root,
        "miscount",
        batch_report_config("miscount", False, batching="max_queue_delay_microseconds: 0"),
        MISCOUNT_CODE,
    )
    carpool_model(root, "echo", ECHO_TOML, ECHO_CODE)
    triton_model(root, "slow_double", SLOW_DOUBLE_CONFIG, SLOW_DOUBLE_CODE)
    triton_model(root, "auto_completed", 'backend: "python"', AUTO_COMPLETED_CODE)
    triton_model(root, "metered", SLOW_DOUBLE_CONFIG, METRICS_CODE)
    triton_model(root, "auto_completed_bare", "", AUTO_COMPLETED_CODE)
    (root / "auto_completed_bare" / "config.pbtxt").unlink()  # Triton's minimal config
    triton_model(root, "ready_hook", SLOW_DOUBLE_CONFIG, READY_HOOK_CODE.format(prefix=""))
    triton_model(
        root,
        "ready_hook_async",
        SLOW_DOUBLE_CONFIG + 'parameters { key: "isolation" value: { string_value: "thread" } }',
        READY_HOOK_CODE.format(prefix="async "),
    )
    triton_model(
        root,
        "bls_caller",
        SLOW_DOUBLE_CONFIG + 'parameters { key: "isolation" value: { string_value: "thread" } }',
        BLS_CALLER_CODE,
    )
    triton_model(root, "pair", PAIR_CONFIG, PAIR_CODE)
    triton_model(root, "countdown", COUNTDOWN_CONFIG, COUNTDOWN_CODE)
    (root / "pair" / "1" / "pair_barrier.py").write_text(
        "import threading\n\nBARRIER = threading.Barrier(2)\n"
    )
    triton_model(
        root,
        "bls_isolated",
        SLOW_DOUBLE_CONFIG + 'parameters { key: "isolation" value: { string_value: "process" } }',
        BLS_CALLER_CODE,
    )
    add_tensor_models(root)
    add_ensembles(root)
    add_llm(root)
    return root


# A Python model, then a TorchScript one: echo passes v on as "echoed"; scale_sum gives
# echoed * 2 and the row sums of echoed + v.
ECHO_THEN_SCALE = """
    platform: "ensemble"
    max_batch_size: 4
    input [ { name: "v" data_type: TYPE_FP32 dims: [ 3 ] } ]
    output [
      { name: "doubled" data_type: TYPE_FP32 dims: [ 3 ] },
      { name: "total" data_type: TYPE_FP32 dims: [ 1 ] }
    ]
    ensemble_scheduling { step [
      { model_name: "echo" model_version: -1
        input_map { key: "in_FP32" value: "v" }
        output_map { key: "out_FP32" value: "echoed" } },
      { model_name: "scale_sum" model_version: -1
        input_map { key: "INPUT__0" value: "echoed" }
        input_map { key: "INPUT__1" value: "v" }
        output_map { key: "OUTPUT__0" value: "doubled" }
        output_map { key: "OUTPUT__1" value: "total" } }
    ] }
"""
# One step, whose model fails on 13.
FAILING_STEP = """
    platform: "ensemble"
    max_batch_size: 8
    input [ { name: "v" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "sum" data_type: TYPE_FP32 dims: [ 1 ] } ]
    ensemble_scheduling { step [
      { model_name: "hangs" model_version: 1
        input_map { key: "x" value: "v" }
        output_map { key: "total" value: "sum" } }
    ] }
"""


def add_ensembles(root: Path) -> None:
    for name, config in (("echo_then_scale", ECHO_THEN_SCALE), ("failing_step", FAILING_STEP)):
        (root / name / "1").mkdir(parents=True)  # Triton's ensembles have an empty version
        (root / name / "config.pbtxt").write_text(textwrap.dedent(config))


def add_llm(root: Path) -> None:
    """An LLM folder as Triton's vLLM backend lays it out (the model: the built-in chat
    model), with engine arguments carpool takes and ones it accepts without effect."""
    (root / "llm" / "1").mkdir(parents=True)
    (root / "llm" / "config.pbtxt").write_text(
        'backend: "vllm"\ninstance_group [ { count: 1 kind: KIND_MODEL } ]\n'
    )
    engine_args = {
        "model": "smollm2-135m-instruct",
        "max_model_len": 512,
        "disable_log_requests": True,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.5,
    }
    (root / "llm" / "1" / "model.json").write_text(json.dumps(engine_args))


def add_broken(root: Path) -> None:
    triton_model(root, "broken", SLOW_DOUBLE_CONFIG, BROKEN_CODE)
