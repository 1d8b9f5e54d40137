"""carpool's own model layout: ``NAME/carpool.toml`` (read with the standard library's
``tomllib``), with the same knobs as Triton's config under carpool's names.

```toml
max_batch_size = 32
execution_timeout_s = 30
isolation = "process"        # or "thread" (the default: --model-isolation)
source = { kind = "python_class", target = "model:Classifier" }
batching = { max_queue_delay_ms = 2, preferred_batch_sizes = [8, 16] }
inputs = [{ name = "x", datatype = "FP32", dims = [4] }]
outputs = [{ name = "probs", datatype = "FP32", dims = [3] }]
```
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carpool.config import BatchingConfig, ConfigError, from_dict
from carpool.repository.datatypes import DATATYPES
from carpool.repository.errors import RepositoryError
from carpool.repository.library_models import PIPELINE_TASKS, signature
from carpool.repository.litapi import TENSORS as LITAPI_TENSORS
from carpool.repository.spec import ISOLATIONS, ModelSpec, Source, TensorSpec, triton_view

CONFIG_FILE = "carpool.toml"
SOURCE_KINDS = ("python_class", "litapi", "pipeline", "cross_encoder", "sentence_transformer")
LIBRARY_KINDS = SOURCE_KINDS[2:]


@dataclass(frozen=True)
class TensorEntry:
    """One input or output in ``carpool.toml``."""

    name: str
    datatype: str
    dims: tuple[int, ...] = ()
    allow_ragged_batch: bool = False
    optional: bool = False


@dataclass(frozen=True)
class SourceEntry:
    """Where the model's code is. ``kind``: python_class (``target`` is module:Class,
    imported from the model's folder; ``options`` its keyword arguments), pipeline
    (a transformers pipeline: ``task`` on the model folder ``path``), cross_encoder or
    sentence_transformer (a sentence-transformers folder ``path``). ``path`` is
    relative to the model's own folder."""

    kind: str
    target: str = ""
    path: str = ""
    task: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelFile:
    """The whole of ``carpool.toml``."""

    source: SourceEntry
    inputs: tuple[TensorEntry, ...] = ()
    outputs: tuple[TensorEntry, ...] = ()
    max_batch_size: int = 8
    version: int = 1
    instance_count: int = 1
    execution_timeout_s: float = 0.0
    isolation: str = ""
    batching: Mapping[str, Any] = field(default_factory=dict)
    # LitServe's name: seconds a batch may wait to fill (batching.max_queue_delay_ms).
    batch_timeout: float | None = None


def _litserve_delay(batch_timeout: float | None) -> dict[str, float]:
    if batch_timeout is None:
        return {}
    return {"max_queue_delay_ms": batch_timeout * 1000}


def is_carpool_model(folder: Path) -> bool:
    return (folder / CONFIG_FILE).is_file()


def read_carpool_model(folder: Path) -> list[ModelSpec]:
    """The model in ``folder``'s ``carpool.toml``; ``RepositoryError`` naming the key."""
    where = str(folder / CONFIG_FILE)
    try:
        data = tomllib.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RepositoryError(f"{where}: {exc}") from None
    if "max_batch_size" in (data.get("batching") or {}):
        raise RepositoryError(f"{where}: set max_batch_size at the top level, not in batching")
    try:
        entry = from_dict(ModelFile, data)
        batching = from_dict(
            BatchingConfig,
            {
                "max_batch_tokens": 1 << 62,
                **_litserve_delay(entry.batch_timeout),
                **entry.batching,
                "max_batch_size": max(1, entry.max_batch_size),
            },
        )
    except ConfigError as exc:
        raise RepositoryError(f"{where}: {exc}") from None
    if entry.source.kind not in SOURCE_KINDS:
        raise RepositoryError(
            f"{where}: source.kind '{entry.source.kind}' is not one of {', '.join(SOURCE_KINDS)}"
        )
    if entry.max_batch_size < 0 or entry.instance_count < 1 or entry.execution_timeout_s < 0:
        raise RepositoryError(
            f"{where}: max_batch_size must be >= 0, instance_count >= 1, execution_timeout_s >= 0"
        )
    if entry.isolation not in ISOLATIONS:
        raise RepositoryError(f"{where}: isolation must be thread or process")
    if entry.source.kind in LIBRARY_KINDS:
        return [_library_model(folder, entry, batching, where)]
    if ":" not in entry.source.target:
        raise RepositoryError(f"{where}: source.target must be 'module:Class'")
    if entry.source.kind == "litapi":
        inputs, outputs = LITAPI_TENSORS  # JSON text in and out
    elif not entry.inputs or not entry.outputs:
        raise RepositoryError(f"{where}: a model needs at least one input and one output")
    else:
        inputs = tuple(_tensor(t, where) for t in entry.inputs)
        outputs = tuple(_tensor(t, where) for t in entry.outputs)
    source = Source(entry.source.kind, str(folder), entry.source.target, entry.source.options)
    return [_spec(folder, entry, batching, (inputs, outputs), source, entry.max_batch_size)]


def _library_model(
    folder: Path, entry: ModelFile, batching: BatchingConfig, where: str
) -> ModelSpec:
    """A pipeline, cross-encoder or embedder: its tensors are the kind's own."""
    source = entry.source
    if entry.inputs or entry.outputs:
        raise RepositoryError(
            f"{where}: a {source.kind} model's inputs and outputs are its kind's own; "
            "leave them out"
        )
    if not source.path:
        raise RepositoryError(f"{where}: source.path must name the model's folder")
    path = (folder / source.path).resolve()
    if not path.exists():
        raise RepositoryError(f"{where}: source.path {path} does not exist")
    if source.kind == "pipeline" and source.task not in PIPELINE_TASKS:
        raise RepositoryError(
            f"{where}: source.task '{source.task}' is not one of {', '.join(PIPELINE_TASKS)}"
        )
    options = {**source.options, "task": source.task}
    return _spec(
        folder,
        entry,
        batching,
        signature(source.kind, source.task),
        Source(source.kind, str(path), source.task, options),
        max(1, entry.max_batch_size),
    )


def _spec(
    folder: Path,
    entry: ModelFile,
    batching: BatchingConfig,
    tensors: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]],
    source: Source,
    max_batch_size: int,
) -> ModelSpec:
    """The spec of ``folder``'s model, with the config Triton's routes show for it."""
    inputs, outputs = tensors
    return ModelSpec(
        name=folder.name,
        version=entry.version,
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=outputs,
        batching=batching,
        source=source,
        instance_count=entry.instance_count,
        execution_timeout_s=entry.execution_timeout_s,
        isolation=entry.isolation,
        model_config=triton_view(
            folder.name,
            "carpool",
            entry.max_batch_size,
            inputs,
            outputs,
            entry.instance_count,
            batching,
        ),
    )


def _tensor(entry: TensorEntry, where: str) -> TensorSpec:
    if entry.datatype not in DATATYPES:
        raise RepositoryError(
            f"{where}: tensor '{entry.name}': datatype '{entry.datatype}' is not one of "
            f"{', '.join(DATATYPES)}"
        )
    if any(d < -1 or d == 0 for d in entry.dims):
        raise RepositoryError(f"{where}: tensor '{entry.name}': dims must be -1 or positive")
    return TensorSpec(
        entry.name, entry.datatype, tuple(entry.dims), entry.allow_ragged_batch, entry.optional
    )
