"""ONNX Runtime and TorchScript models as Triton repositories hold them: configs
completed from the graph, inputs passed in Triton's order, a batch stacked and split."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from carpool.errors import ModelExecutionError
from carpool.repository.backends import create_backend
from carpool.repository.errors import RepositoryError
from carpool.repository.payload import TensorPayload
from carpool.repository.triton_config import is_triton_model, read_triton_model
from tests.repository_models.tensor_models import MLP_SIZES, mlp_numpy, mlp_weights, onnx_mlp


def test_a_folder_holding_only_an_onnx_file_is_configured_from_its_graph(tmp_path: Path) -> None:
    weights = mlp_weights(MLP_SIZES, seed=3)
    onnx_mlp(tmp_path / "m" / "1" / "model.onnx", weights)
    assert is_triton_model(tmp_path / "m")
    [spec] = read_triton_model(tmp_path / "m")
    assert spec.max_batch_size == 4 and spec.dynamic_batching  # Triton's auto-complete
    assert [(t.name, t.datatype, t.dims) for t in (*spec.inputs, *spec.outputs)] == [
        ("x", "FP32", (4,)),
        ("y", "FP32", (3,)),
    ]
    assert spec.model_config["platform"] == "onnxruntime_onnx"
    backend = create_backend(spec, 0, "cpu")
    xs = [np.ones((2, 4), np.float32), np.arange(4, dtype=np.float32)[None]]
    results = backend.execute([TensorPayload({"x": x}) for x in xs])
    for x, result in zip(xs, results, strict=True):
        assert isinstance(result, dict)
        np.testing.assert_allclose(result["y"], mlp_numpy(x, weights), rtol=1e-5, atol=1e-6)


def test_a_config_naming_a_tensor_the_graph_lacks_is_refused(tmp_path: Path) -> None:
    onnx_mlp(tmp_path / "m" / "1" / "model.onnx", mlp_weights(MLP_SIZES))
    (tmp_path / "m" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx" max_batch_size: 2\n'
        'input [ { name: "features" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
    )
    [spec] = read_triton_model(tmp_path / "m")
    with pytest.raises(RepositoryError, match="no input 'features'"):
        create_backend(spec, 0, "cpu")


class Named(torch.nn.Module):
    def forward(self, scale: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scaled": value * scale, "total": value.sum(dim=1, keepdim=True)}


def torchscript_folder(tmp_path: Path, config: str) -> Path:
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(Named()), str(folder / "1" / "model.pt"))
    (folder / "config.pbtxt").write_text(textwrap.dedent(config))
    return folder


def test_torchscript_inputs_follow_forwards_argument_names(tmp_path: Path) -> None:
    folder = torchscript_folder(
        tmp_path,
        """
        backend: "pytorch"
        max_batch_size: 4
        input [ { name: "value" data_type: TYPE_FP32 dims: [ 2 ] },
                { name: "scale" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "total" data_type: TYPE_FP32 dims: [ 1 ] },
                 { name: "scaled" data_type: TYPE_FP32 dims: [ 2 ] } ]
        """,
    )
    [spec] = read_triton_model(folder)
    backend = create_backend(spec, 0, "cpu")
    value = np.array([[1.0, 2.0]], np.float32)
    payloads = [
        TensorPayload({"value": value, "scale": np.array([[s]], np.float32)}) for s in (2, 3)
    ]
    results = backend.execute(payloads)
    assert [r["scaled"].tolist() for r in results] == [[[2.0, 4.0]], [[3.0, 6.0]]]  # type: ignore[index]
    assert [r["total"].tolist() for r in results] == [[[3.0]], [[3.0]]]  # type: ignore[index]


def test_a_torchscript_failure_fails_the_batch_with_its_message(tmp_path: Path) -> None:
    folder = torchscript_folder(
        tmp_path,
        """
        backend: "pytorch"
        max_batch_size: 0
        input [ { name: "value" data_type: TYPE_FP32 dims: [ -1, -1 ] },
                { name: "scale" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
        output [ { name: "total" data_type: TYPE_FP32 dims: [ -1, 1 ] } ]
        """,
    )
    [spec] = read_triton_model(folder)
    backend = create_backend(spec, 0, "cpu")
    mismatched = {"value": np.ones((2, 3), np.float32), "scale": np.ones((4, 5), np.float32)}
    with pytest.raises(ModelExecutionError, match="model 'm' failed"):
        backend.execute([TensorPayload(mismatched)])
