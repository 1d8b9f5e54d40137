"""Triton's auto-complete: a Python-backend model's ``auto_complete_config`` fills in
what its ``config.pbtxt`` leaves out (``max_batch_size``, inputs, outputs, the
scheduler) when the model is read.

The model's file is imported in the server's process for it (under process isolation
too); whatever the hook raises or returns is a load error naming the model. The
caller parses what it returns as Triton's ``ModelConfig`` message again, so a
malformed field is refused as it would be in the file.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from carpool.repository import pb_utils
from carpool.repository.backends import describe, import_file
from carpool.repository.errors import RepositoryError


def auto_complete(config: dict[str, Any], model_file: Path, where: str) -> dict[str, Any]:
    """``config`` as the model's ``auto_complete_config`` completes it (unchanged if
    the model has none)."""
    name = config.get("name", model_file.parent.parent.name)
    try:
        module = import_file(model_file, f"carpool_user_{name}_auto_complete")
    except (Exception, SystemExit) as exc:
        raise RepositoryError(f"{where}: loading {model_file} failed: {describe(exc)}") from exc
    model_class = getattr(module, "TritonPythonModel", None)
    hook = getattr(model_class, "auto_complete_config", None)
    if hook is None:
        return config
    given = pb_utils.ModelConfig(copy.deepcopy(config))
    try:
        completed = hook(given)
    except (Exception, SystemExit) as exc:
        raise RepositoryError(f"{where}: auto_complete_config failed: {describe(exc)}") from exc
    if not isinstance(completed, pb_utils.ModelConfig):
        raise RepositoryError(
            f"{where}: auto_complete_config returned a {type(completed).__name__}, not the "
            "pb_utils.ModelConfig it was given"
        )
    return completed.as_dict()
