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


# A memory-mapped file's pages count toward the process's resident memory once read,
# until the map is gone: a file is mapped again after this many bytes are read from
# it, so that reading a model adds at most this much to its peak beyond the tensors
# kept (a 684 MiB Q4_K_M file's blocks peaked at twice their size read in one map).
MAPPED_BYTES = 64 << 20


def iter_safetensors(
    folder: Path, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """``folder``'s tensors one at a time, those named in ``skip`` left unread (so
    at most one tensor beyond the model's own is in memory). Each is a view of the
    file's memory map (``read_tensors``): copy what is kept."""
    for file in _weight_files(folder):
        yield from read_tensors(file, skip)


def read_tensors(file: Path, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """``file``'s tensors in its order, those named in ``skip`` left unread: views of
    a memory map (``read_tensor`` copies one out). The file is mapped anew
    after every ``MAPPED_BYTES`` read; an old map goes once no view of it is left."""
    with safe_open(str(file), framework="pt") as f:
        names = [name for name in f.keys() if name not in skip]  # noqa: SIM118 (not a mapping)
    start = 0
    while start < len(names):
        with safe_open(str(file), framework="pt") as f:
            read = 0
            while start < len(names) and read < MAPPED_BYTES:
                name = names[start]
                start += 1
                tensor = f.get_tensor(name)
                read += tensor.nbytes
                yield name, tensor


def read_tensor(file: Path, name: str) -> torch.Tensor:
    """``file``'s tensor ``name``, a copy of its own, read in pieces of at most about
    ``MAPPED_BYTES`` along its first dimension, the file mapped anew for each: reading
    one large tensor adds one piece to the peak, not the whole tensor twice."""
    with safe_open(str(file), framework="pt") as f:
        part = f.get_slice(name)
        shape = part.get_shape()
        if not shape or shape[0] <= 1:
            return f.get_tensor(name).clone()
        first = part[0:1]
        if first.nbytes * shape[0] <= MAPPED_BYTES:  # one piece: read it from this map
            return f.get_tensor(name).clone()
    out = torch.empty(shape, dtype=first.dtype)
    step = max(1, MAPPED_BYTES // max(1, first.nbytes))
    for start in range(0, shape[0], step):
        with safe_open(str(file), framework="pt") as f:
            out[start : start + step] = f.get_slice(name)[start : start + step]
    return out


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
