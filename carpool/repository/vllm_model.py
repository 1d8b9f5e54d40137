"""An LLM in a Triton repository, in the layout of Triton's vLLM backend: ``NAME/
config.pbtxt`` with ``backend: "vllm"`` and ``NAME/<version>/model.json`` holding
vLLM's engine arguments. carpool serves it with its own generation engine: ``model``
is what ``--model`` takes (a built-in name, a folder, a GGUF file, a hub id), and the
engine arguments carpool shares with vLLM set its engine config. Read here (no model
is loaded); ``RepositoryError`` names what cannot be honoured."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carpool.repository.errors import RepositoryError
from carpool.repository.spec import TensorSpec

MODEL_JSON = "model.json"
# vLLM engine arguments that carpool's engine config has, under the same names.
SHARED = frozenset(
    {
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "block_size",
        "enable_prefix_caching",
        "dtype",
    }
)
# vLLM's names for dtypes carpool spells otherwise.
DTYPES = {"half": "float16", "float": "float32", "auto": "auto"}
# vLLM engine arguments with nothing to do here: logging, eager mode, remote code,
# downloads, the tokenizer's mode, swap space.
IGNORED = frozenset(
    {
        "disable_log_requests",
        "disable_log_stats",
        "enforce_eager",
        "trust_remote_code",
        "download_dir",
        "tokenizer_mode",
        "swap_space",
        "seed",
        "disable_custom_all_reduce",
        "distributed_executor_backend",
    }
)


# The tensors Triton's vLLM backend gives an LLM (its auto-complete adds them to what
# the config declares).
_FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason",
          "return_num_input_tokens", "return_num_output_tokens")  # fmt: skip
INPUTS = (
    TensorSpec("text_input", "BYTES", (1,)),
    *(TensorSpec(name, "BOOL", (1,), optional=True) for name in _FLAGS),
    TensorSpec("sampling_parameters", "BYTES", (1,), optional=True),
)
OUTPUTS = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("finish_reason", "BYTES", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
)


@dataclass(frozen=True)
class VllmModel:
    """What a ``model.json`` asks: the model, engine config values, and the
    arguments accepted but without effect here."""

    model: str
    engine: Mapping[str, Any] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()


def read_model_json(path: Path) -> VllmModel:
    """The engine arguments in ``path``; ``RepositoryError`` naming what is wrong."""
    try:
        args = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RepositoryError(f"{path}: {exc}") from None
    if not isinstance(args, dict):
        raise RepositoryError(f"{path}: must hold a JSON object of engine arguments")
    model = args.pop("model", None)
    if not isinstance(model, str) or not model:
        raise RepositoryError(f"{path}: 'model' (the model to serve) is missing")
    if (path.parent / model).exists():  # a folder or file beside model.json
        model = str(path.parent / model)
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if int(args.pop(key, 1)) != 1:
            raise RepositoryError(
                f"{path}: {key} must be 1: carpool runs a model on one device (serve it "
                "from several with --replicas)"
            )
    engine = {}
    for key, value in args.items():
        if key in SHARED:
            engine[key] = DTYPES.get(value, value) if key == "dtype" else value
        elif key not in IGNORED:
            raise RepositoryError(
                f"{path}: engine argument '{key}' is not one carpool takes (it takes "
                f"{', '.join(sorted(SHARED))}; accepted without effect: "
                f"{', '.join(sorted(IGNORED))})"
            )
    return VllmModel(model, engine, tuple(sorted(k for k in args if k in IGNORED)))
