"""Model control's start-up loading: failures are left out with their reason."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from carpool.config import RepositoryConfig
from carpool.repository.repository import ModelRepository
from carpool.runtime import DeviceRuntime
from carpool.server.model_control import ModelControl
from carpool.server.served import ServedEmbedding, ServedModels

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "model_repository"


def control_over(root: Path, builtin: str) -> tuple[ModelControl, ServedModels]:
    models = ServedModels([cast(ServedEmbedding, SimpleNamespace(name=builtin))])
    config = RepositoryConfig(model_repository=str(root))
    return ModelControl(ModelRepository(root), config, models, DeviceRuntime()), models


def test_a_model_named_like_a_built_in_is_left_out_and_the_others_load(tmp_path: Path) -> None:
    for name in ("python_batched_service", "mlp_classifier"):
        shutil.copytree(EXAMPLES / name, tmp_path / name)
    control, models = control_over(tmp_path, builtin="mlp_classifier")
    control.load_at_start(control.initial_models(RepositoryConfig()))
    assert models.is_user("python_batched_service")
    assert not models.is_user("mlp_classifier")
    index: dict[str, Any] = {e.name: e for e in control.index()}
    assert index["mlp_classifier"].state == "UNAVAILABLE"
    assert "already served as a built-in model" in index["mlp_classifier"].reason
    assert index["python_batched_service"].state == "READY"
