"""Reading safetensors files: what a load keeps mapped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from carpool.models import weights
from carpool.models.weights import read_tensor, read_tensors

MIB = 1 << 20


def _mapped_resident(file: Path) -> int:
    """Bytes of ``file``'s memory maps resident in this process (/proc/self/smaps)."""
    total, current = 0, ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:
            current = head[5] if len(head) > 5 else ""
        elif head and head[0] == "Rss:" and current == str(file):
            total += int(head[1]) * 1024
    return total


def test_reading_a_file_keeps_at_most_a_few_mib_of_it_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "w.safetensors"
    tensors = {f"t{i}": torch.full((MIB,), float(i)) for i in range(12)}  # 4 MiB each
    save_file(tensors, str(file))
    monkeypatch.setattr(weights, "MAPPED_BYTES", 8 * MIB)
    mapped = []
    for name, tensor in read_tensors(file, skip={"t3"}):
        assert torch.equal(tensor, tensors[name])
        del tensor  # a view would keep its map: the caller copies what it keeps
        mapped.append(_mapped_resident(file))
    assert len(mapped) == 11
    # one map's 8 MiB and the tensor read past it; 48 MiB read in all
    assert max(mapped) <= 12 * MIB + MIB
    assert _mapped_resident(file) == 0


def test_a_large_tensor_is_read_in_pieces_each_from_a_map_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "w.safetensors"
    tensors = {
        "big": torch.arange(12 * MIB, dtype=torch.int32).view(48, -1),  # 48 MiB, rows of 1 MiB
        "one": torch.ones(1, 3, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
    }
    save_file(tensors, str(file))
    monkeypatch.setattr(weights, "MAPPED_BYTES", 8 * MIB)
    opened = []
    real = weights.safe_open

    def counted(*args: object, **kwargs: object) -> object:
        opened.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(weights, "safe_open", counted)
    for name, tensor in tensors.items():
        assert torch.equal(read_tensor(file, name), tensor)
    assert len(opened) == (1 + 48 // 8) + 1 + 1  # the big one: its shape, then 6 pieces
    assert _mapped_resident(file) == 0
