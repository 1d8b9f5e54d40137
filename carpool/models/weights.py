"""Reading weight files from a Hugging Face model folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor in ``folder``'s safetensors files (single file or sharded index)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


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
