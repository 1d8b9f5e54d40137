"""Small ONNX and TorchScript models for Triton repositories, built in the test (onnx's
graph helper; ``torch.jit.script``), with the numpy they must equal."""

from __future__ import annotations

import itertools
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper


def mlp_weights(sizes: tuple[int, ...], seed: int = 0) -> list[tuple[np.ndarray[Any, Any], ...]]:
    rng = np.random.default_rng(seed)
    return [
        (
            (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
            rng.standard_normal(b).astype(np.float32),
        )
        for a, b in itertools.pairwise(sizes)
    ]


def mlp_numpy(x: np.ndarray[Any, Any], weights: list[tuple[np.ndarray[Any, Any], ...]]) -> Any:
    for i, (w, b) in enumerate(weights):
        x = x @ w + b
        if i < len(weights) - 1:
            x = np.maximum(x, 0)
    return x


def onnx_mlp(path: Path, weights: list[tuple[np.ndarray[Any, Any], ...]]) -> None:
    """An MLP (MatMul, Add, Relu) from ``x`` [batch, in] to ``y`` [batch, out], the
    batch dimension free."""
    nodes, initializers = [], []
    current = "x"
    for i, (w, b) in enumerate(weights):
        initializers += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"m{i}"]))
        last = i == len(weights) - 1
        added = "y" if last else f"a{i}"
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [added]))
        if not last:
            nodes.append(helper.make_node("Relu", [added], [f"r{i}"]))
            current = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", weights[0][0].shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", weights[-1][0].shape[1]])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def onnx_cnn(path: Path, channels: int, classes: int = 10, seed: int = 0) -> None:
    """A small image classifier from ``x`` [batch, 3, H, W] to ``y`` [batch, classes]:
    two 3x3 stride-2 convolutions (``channels``, then twice as many) with ReLU, a global
    average pool and a dense layer; the batch and picture sides free."""
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        array = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        return numpy_helper.from_array(array, name)

    initializers = [
        weight("k1", channels, 3, 3, 3),
        weight("k2", 2 * channels, channels, 3, 3),
        weight("w", classes, 2 * channels),
        numpy_helper.from_array(np.zeros(classes, np.float32), "b"),
    ]
    conv: dict[str, Any] = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["x", "k1"], ["c1"], **conv),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "k2"], ["c2"], **conv),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "w", "b"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", classes])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


class ScaleAndSum(torch.nn.Module):
    """Two inputs, two outputs: ``a * 2`` and the row sums of ``a + b``."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a * 2, (a + b).sum(dim=1, keepdim=True)


def torchscript_model(path: Path) -> None:
    """A TorchScript file, as Triton repositories hold them (torch now deprecates
    writing them; reading them is what is tested)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(ScaleAndSum()), str(path))


# INPUT__0 / OUTPUT__0 naming, as Triton's PyTorch backend documents it.
TORCHSCRIPT_CONFIG = textwrap.dedent(
    """
    platform: "pytorch_libtorch"
    max_batch_size: 8
    dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 30000000 }
    input [
      { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3 ] },
      { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 3 ] }
    ]
    output [
      { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] },
      { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 1 ] }
    ]
    """
)

# Inputs and outputs left to auto-complete (from the graph).
ONNX_CONFIG = textwrap.dedent(
    """
    platform: "onnxruntime_onnx"
    max_batch_size: 8
    dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 30000000 }
    """
)

MLP_SIZES = (4, 16, 3)


def add_tensor_models(root: Path) -> None:
    """``onnx_mlp`` (its tensors from the graph) and ``scale_sum`` (TorchScript,
    INPUT__0 naming): each runs a batch once four requests wait."""
    onnx_mlp(root / "onnx_mlp" / "1" / "model.onnx", mlp_weights(MLP_SIZES))
    (root / "onnx_mlp" / "config.pbtxt").write_text(ONNX_CONFIG)
    torchscript_model(root / "scale_sum" / "1" / "model.pt")
    (root / "scale_sum" / "config.pbtxt").write_text(TORCHSCRIPT_CONFIG)
