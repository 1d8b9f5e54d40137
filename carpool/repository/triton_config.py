"""Triton's model layout: ``NAME/config.pbtxt`` and ``NAME/<version>/model.py``.

The config is parsed with protobuf's text-format parser into Triton's own
``ModelConfig`` message (the generated module that ships with ``tritonclient``), so
anything Triton would reject as malformed is rejected here too. Fields carpool does
not implement are refused by name at load time, never ignored.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from carpool.config import BatchingConfig, ConfigError, QueuePolicy
from carpool.repository.auto_complete import auto_complete
from carpool.repository.datatypes import from_config_name
from carpool.repository.ensemble import read_steps
from carpool.repository.errors import RepositoryError
from carpool.repository.spec import ISOLATIONS, ModelSpec, Source, TensorSpec, config_tensor
from carpool.repository.tensor_backends import complete_onnx_config
from carpool.repository.vllm_model import INPUTS as VLLM_INPUTS
from carpool.repository.vllm_model import MODEL_JSON
from carpool.repository.vllm_model import OUTPUTS as VLLM_OUTPUTS

CONFIG_FILE = "config.pbtxt"
DEFAULT_MODEL_FILE = "model.py"
# The Triton backends carpool runs: backend name -> (source kind, default model file,
# Triton's platform name or ""); and the platform names that stand for a backend.
TRITON_BACKENDS = {
    "python": ("triton_python", "model.py", ""),
    "onnxruntime": ("onnxruntime", "model.onnx", "onnxruntime_onnx"),
    "pytorch": ("torchscript", "model.pt", "pytorch_libtorch"),
    "vllm": ("vllm", MODEL_JSON, ""),
}
PLATFORMS = {"onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch"}
ENSEMBLE = "ensemble"
_ENSEMBLE_FIELDS = {
    "name", "platform", "max_batch_size", "input", "output", "ensemble_scheduling",
    "version_policy", "parameters",
}  # fmt: skip
# Triton's 0 means "no limit" for a queue's size and a request's timeout.
UNLIMITED_QUEUE = 1 << 30
NO_TIMEOUT_S = 1e9
# Elements are not tokens: a tensor model's batch is bounded by its slots alone.
UNBOUNDED_BATCH_TOKENS = 1 << 62

_SUPPORTED = {
    "": {
        "name",
        "platform",
        "backend",
        "max_batch_size",
        "input",
        "output",
        "dynamic_batching",
        "instance_group",
        "version_policy",
        "parameters",
        "default_model_filename",
        "model_transaction_policy",
    },
    "input": {"name", "data_type", "dims", "allow_ragged_batch", "optional", "format"},
    "output": {"name", "data_type", "dims"},
    "dynamic_batching": {
        "preferred_batch_size",
        "max_queue_delay_microseconds",
        "preserve_ordering",
        "priority_levels",
        "default_priority_level",
        "default_queue_policy",
        "priority_queue_policy",
    },
    "instance_group": {"name", "kind", "count", "gpus"},
}


@functools.cache
def model_config_pb2() -> ModuleType:
    """Triton's generated ``model_config_pb2``, loaded from tritonclient's files by path:
    importing it as ``tritonclient.grpc.model_config_pb2`` would import grpc first."""
    found = importlib.util.find_spec("tritonclient")
    if found is None or not found.submodule_search_locations:
        raise RepositoryError("tritonclient is not installed; it carries Triton's config schema")
    path = Path(next(iter(found.submodule_search_locations))) / "grpc" / "model_config_pb2.py"
    spec = importlib.util.spec_from_file_location("carpool_triton_model_config_pb2", path)
    if spec is None or spec.loader is None:
        raise RepositoryError(f"cannot load Triton's config schema from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def is_triton_model(folder: Path) -> bool:
    """A ``config.pbtxt``, or, without one, a model whose config auto-complete gives
    (``minimal_backend``)."""
    return (folder / CONFIG_FILE).is_file() or minimal_backend(folder) is not None


def minimal_backend(folder: Path) -> str | None:
    """Triton's minimal model configuration: no config file at all (neither
    ``config.pbtxt`` nor ``carpool.toml``) and a numbered version folder holding a
    ``model.py`` (a Python-backend model whose ``auto_complete_config`` configures it)
    or a ``model.onnx`` (configured from its graph); that backend's name, else None."""
    if (folder / CONFIG_FILE).exists() or (folder / "carpool.toml").exists():
        return None
    versions = [v for v in folder.iterdir() if v.is_dir() and v.name.isdigit()]
    for backend in ("python", "onnxruntime"):
        if any((v / TRITON_BACKENDS[backend][1]).is_file() for v in versions):
            return backend
    return None


def parse_config(text: str, where: str) -> Message:
    """``config.pbtxt`` text as Triton's ``ModelConfig``; ``RepositoryError`` if malformed."""
    message = model_config_pb2().ModelConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        raise RepositoryError(f"{where}: {exc}") from None
    return message


def to_dict(message: Message) -> dict[str, Any]:
    """The fields set in ``message`` as JSON-ready values: enums by name, int64 as int."""
    out: dict[str, Any] = {}
    for fd, value in message.ListFields():
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            out[fd.name] = {
                k: (to_dict(v) if isinstance(v, Message) else v) for k, v in value.items()
            }
        elif fd.is_repeated:
            out[fd.name] = [_scalar(fd, v) for v in value]
        else:
            out[fd.name] = _scalar(fd, value)
    return out


def _scalar(fd: FieldDescriptor, value: Any) -> Any:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return to_dict(value)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return fd.enum_type.values_by_number[value].name
    return value


def _refuse_unsupported(config: dict[str, Any], where: str) -> None:
    for section, allowed in _SUPPORTED.items():
        entries = [config] if section == "" else config.get(section, [])
        for entry in entries if isinstance(entries, list) else [entries]:
            for key in entry:
                if key not in allowed:
                    field = f"{section}.{key}" if section else key
                    raise RepositoryError(
                        f"{where}: field '{field}' is not supported by carpool "
                        f"(supported here: {', '.join(sorted(allowed))})"
                    )


def read_triton_model(folder: Path, device: str = "cpu", complete: bool = True) -> list[ModelSpec]:
    """Every version of the Triton model in ``folder`` that its version policy serves;
    ``complete``: let the newest version's ``auto_complete_config`` fill the config in."""
    where = str(folder / CONFIG_FILE)
    minimal = minimal_backend(folder)
    try:
        # Without a file, the config is what auto-complete gives.
        text = f'backend: "{minimal}"' if minimal else (folder / CONFIG_FILE).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RepositoryError(f"{where}: {exc}") from None
    config = to_dict(parse_config(text, where))
    name = config.setdefault("name", folder.name)
    if name != folder.name:
        raise RepositoryError(f"{where}: name '{name}' differs from its folder '{folder.name}'")
    if config.get("platform") == ENSEMBLE:
        return [_read_ensemble(folder, config, where)]
    backend = config.get("backend") or PLATFORMS.get(config.get("platform", ""), "")
    if backend not in TRITON_BACKENDS:
        given = config.get("backend") or config.get("platform", "")
        raise RepositoryError(
            f"{where}: backend '{given}' is not supported; carpool runs Triton's "
            f"{', '.join(TRITON_BACKENDS)} backends (platforms "
            f"{', '.join(PLATFORMS)}) and its own carpool.toml models"
        )
    kind, default_file, platform = TRITON_BACKENDS[backend]
    filename = config.get("default_model_filename") or default_file
    versions = _versions(folder, config, filename, where)
    model_file = folder / str(versions[-1]) / filename
    if complete and backend == "python":
        config = _reparsed(auto_complete(config, model_file, where), where)
    elif complete and backend == "onnxruntime":
        config = _reparsed(complete_onnx_config(config, model_file, where), where)
    if backend == "vllm":
        config = _llm_config(config)
    _refuse_unsupported(config, where)
    config["backend"] = backend
    if platform:
        config["platform"] = platform
    max_batch_size, inputs, outputs = _tensors(config, where)
    count = _instances(config, where, device)
    batching = _batching(config, max_batch_size, where)
    parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    timeout = _float_parameter(parameters, "execution_timeout_s", where)
    isolation = parameters.get("isolation", "")
    if isolation not in ISOLATIONS:
        raise RepositoryError(
            f"{where}: parameter 'isolation' must be thread or process, got {isolation!r}"
        )
    decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
    specs = []
    for version in versions:
        specs.append(
            ModelSpec(
                name=name,
                version=version,
                max_batch_size=max_batch_size,
                inputs=inputs,
                outputs=outputs,
                batching=batching,
                dynamic_batching="dynamic_batching" in config,
                source=Source(kind, str(folder / str(version) / filename)),
                instance_count=count,
                execution_timeout_s=timeout,
                isolation=isolation,
                model_config=config,
                decoupled=decoupled,
            )
        )
    return specs


def _llm_config(config: dict[str, Any]) -> dict[str, Any]:
    """What Triton's vLLM backend completes an LLM's config with: its tensors (beside
    those declared), decoupled, and no batching of Triton's own (the engine batches)."""
    completed = dict(config)
    for key, tensors in (("input", VLLM_INPUTS), ("output", VLLM_OUTPUTS)):
        declared = {t["name"] for t in config.get(key, [])}
        completed[key] = [
            *config.get(key, []),
            *(config_tensor(t) for t in tensors if t.name not in declared),
        ]
    completed["max_batch_size"] = 0
    completed["model_transaction_policy"] = {"decoupled": True}
    return completed


def _tensors(
    config: dict[str, Any], where: str
) -> tuple[int, tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The config's ``max_batch_size`` (written back as an int), inputs and outputs."""
    max_batch_size = int(config.get("max_batch_size", 0))
    if max_batch_size < 0:
        raise RepositoryError(f"{where}: max_batch_size must be >= 0")
    config["max_batch_size"] = max_batch_size
    inputs = tuple(_tensor(t, where, "input") for t in config.get("input", []))
    outputs = tuple(_tensor(t, where, "output") for t in config.get("output", []))
    if not inputs or not outputs:
        raise RepositoryError(f"{where}: a model needs at least one input and one output")
    return max_batch_size, inputs, outputs


def _read_ensemble(folder: Path, config: dict[str, Any], where: str) -> ModelSpec:
    """An ensemble: its own inputs and outputs, and the steps that connect them. It
    has one version (its numbered folder's, else 1) and no instances of its own."""
    for key in config:
        if key not in _ENSEMBLE_FIELDS:
            raise RepositoryError(
                f"{where}: field '{key}' is not supported on an ensemble (supported: "
                f"{', '.join(sorted(_ENSEMBLE_FIELDS))})"
            )
    max_batch_size, inputs, outputs = _tensors(config, where)
    stages = read_steps(config, [t.name for t in inputs], [t.name for t in outputs], where)
    numbered = [int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()]
    return ModelSpec(
        name=config["name"],
        version=max(numbered, default=1),
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=outputs,
        batching=BatchingConfig(max_batch_size=max(1, max_batch_size)),
        source=Source(ENSEMBLE, str(folder)),
        dynamic_batching=False,
        model_config=config,
        ensemble=stages,
    )


def _reparsed(config: dict[str, Any], where: str) -> dict[str, Any]:
    """An auto-completed config through Triton's ``ModelConfig`` message again."""
    try:
        message = json_format.ParseDict(config, model_config_pb2().ModelConfig())
    except (json_format.ParseError, TypeError, ValueError) as exc:
        raise RepositoryError(
            f"{where}: auto_complete_config gave a malformed configuration: {exc}"
        ) from None
    return to_dict(message)


def _tensor(entry: dict[str, Any], where: str, kind: str) -> TensorSpec:
    name = entry.get("name", "")
    if not name:
        raise RepositoryError(f"{where}: an {kind} has no name")
    try:
        datatype = from_config_name(entry.get("data_type", "TYPE_INVALID"))
    except ValueError as exc:
        raise RepositoryError(f"{where}: {kind} '{name}': {exc}") from None
    if entry.get("format", "FORMAT_NONE") != "FORMAT_NONE":
        raise RepositoryError(f"{where}: {kind} '{name}': field 'format' is not supported")
    dims = tuple(int(d) for d in entry.get("dims", []))
    if any(d < -1 or d == 0 for d in dims):
        raise RepositoryError(f"{where}: {kind} '{name}': dims must be -1 or positive")
    return TensorSpec(
        name,
        datatype,
        dims,
        allow_ragged_batch=bool(entry.get("allow_ragged_batch", False)),
        optional=bool(entry.get("optional", False)),
    )


def _instances(config: dict[str, Any], where: str, device: str) -> int:
    groups = config.get("instance_group") or [{"count": 1, "kind": "KIND_CPU"}]
    count = 0
    for group in groups:
        kind = group.get("kind", "KIND_AUTO")
        if kind == "KIND_GPU" and not device.startswith("cuda"):
            raise RepositoryError(
                f"{where}: instance_group kind KIND_GPU needs a GPU (--device cuda); "
                f"this server runs on {device}"
            )
        if group.get("gpus") and not device.startswith("cuda"):
            raise RepositoryError(f"{where}: field 'instance_group.gpus' needs --device cuda")
        count += int(group.get("count", 1))
    if count < 1:
        raise RepositoryError(f"{where}: instance_group count must be >= 1")
    config["instance_group"] = [
        {
            "name": g.get("name", f"{config['name']}_{i}"),
            "kind": g.get("kind", "KIND_CPU"),
            "count": int(g.get("count", 1)),
        }
        for i, g in enumerate(groups)
    ]
    return count


def _queue_policy(policy: dict[str, Any], where: str) -> QueuePolicy:
    if policy.get("timeout_action", "REJECT") != "REJECT":
        raise RepositoryError(
            f"{where}: timeout_action DELAY is not supported (carpool rejects a request "
            "that times out in the queue)"
        )
    size = int(policy.get("max_queue_size", 0))
    timeout_us = int(policy.get("default_timeout_microseconds", 0))
    return QueuePolicy(
        max_queue_size=size if size > 0 else UNLIMITED_QUEUE,
        default_timeout_s=timeout_us / 1e6 if timeout_us > 0 else NO_TIMEOUT_S,
        allow_timeout_override=bool(policy.get("allow_timeout_override", False)),
    )


def _batching(config: dict[str, Any], max_batch_size: int, where: str) -> BatchingConfig:
    dyn = config.get("dynamic_batching")
    if dyn is not None and max_batch_size == 0:
        raise RepositoryError(f"{where}: dynamic_batching needs max_batch_size > 0")
    dyn = dyn or {}
    levels = int(dyn.get("priority_levels", 0)) or 1
    try:
        return BatchingConfig(
            max_batch_size=max(1, max_batch_size),
            max_queue_delay_ms=int(dyn.get("max_queue_delay_microseconds", 0)) / 1000.0,
            preferred_batch_sizes=tuple(int(s) for s in dyn.get("preferred_batch_size", [])),
            max_batch_tokens=UNBOUNDED_BATCH_TOKENS,
            priority_levels=levels,
            default_priority_level=int(dyn.get("default_priority_level", 0)) or levels,
            queue_policy=_queue_policy(dyn.get("default_queue_policy", {}), where),
            priority_queue_policy={
                int(level): _queue_policy(p, where)
                for level, p in dyn.get("priority_queue_policy", {}).items()
            },
        )
    except ConfigError as exc:
        raise RepositoryError(f"{where}: dynamic_batching: {exc}") from None


def _float_parameter(parameters: dict[str, str], key: str, where: str) -> float:
    text = parameters.get(key, "0")
    try:
        value = float(text)
    except ValueError:
        raise RepositoryError(
            f"{where}: parameter '{key}' must be a number, got {text!r}"
        ) from None
    if not value >= 0:
        raise RepositoryError(f"{where}: parameter '{key}' must be >= 0")
    return value


def _versions(folder: Path, config: dict[str, Any], filename: str, where: str) -> list[int]:
    present = sorted(
        int(p.name)
        for p in folder.iterdir()
        if p.is_dir() and p.name.isdigit() and (p / filename).is_file()
    )
    policy = config.get("version_policy", {"latest": {"num_versions": 1}})
    if "all" in policy:
        chosen = present
    elif "specific" in policy:
        chosen = sorted(int(v) for v in policy["specific"].get("versions", []))
        missing = [v for v in chosen if v not in present]
        if missing:
            raise RepositoryError(
                f"{where}: version_policy names version {missing[0]}, which has no "
                f"{missing[0]}/{filename}"
            )
    else:
        count = int(policy.get("latest", {}).get("num_versions", 1))
        chosen = present[-count:] if count > 0 else []
    if not chosen:
        raise RepositoryError(f"{where}: no version folder holds {filename}")
    return chosen
