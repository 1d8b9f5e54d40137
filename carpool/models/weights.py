"""Reading weight files from a Hugging Face model folder."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor in ``folder``'s safetensors files (single file or sharded index)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        tensors.update(load_file(str(file)))
    return tensors


def iter_safetensors(
    folder: Path, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """``folder``'s tensors one at a time, those named in ``skip`` left unread (so
    at most one tensor beyond the model's own is in memory)."""
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name not in skip:
                    yield name, f.get_tensor(name)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return files


def read_json(path: Path) -> dict[str, object]:
    """A JSON object from ``path``; {} when the file is absent."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def read_json_list(path: Path) -> list[dict[str, Any]]:
    """A JSON list of objects from ``path``; [] when the file is absent."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path} does not hold a JSON list")
    return data
