"""``carpool models --repository DIR`` lists what it finds, and what cannot load."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from carpool.cli import main
from tests.repository_models.builder import add_ensembles
from tests.repository_models.tensor_models import add_tensor_models

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "model_repository"


def test_lists_the_example_repository(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The two examples that need no weights (make_weights.py writes the others').
    for name in ("python_batched_service", "mlp_classifier"):
        shutil.copytree(EXAMPLES / name, tmp_path / name)
    assert main(["models", "--repository", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "python_batched_service   triton_python" in out
    assert "in  input_field: FP32 [-1]" in out
    assert "mlp_classifier           python_class" in out


def test_names_a_model_that_cannot_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.pbtxt").write_text('backend: "python"\nsequence_batching { }\n')
    assert main(["models", "--repository", str(tmp_path)]) == 1
    assert "UNUSABLE" in capsys.readouterr().out


def test_lists_onnx_torchscript_and_ensemble_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    add_tensor_models(tmp_path)
    add_ensembles(tmp_path)
    assert main(["models", "--repository", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "onnx_mlp                 onnxruntime" in out
    assert "in  x: FP32 [4]" in out  # read from the graph
    assert "scale_sum                torchscript" in out
    assert "echo_then_scale          ensemble" in out and "steps echo -> scale_sum" in out
