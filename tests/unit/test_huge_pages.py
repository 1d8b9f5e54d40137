"""Backing weights with transparent huge pages: only whole 2 MiB pages inside them."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

from carpool import huge_pages
from carpool.huge_pages import HUGE_PAGE

MIB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _collapses_here() -> bool:
    """Linux 6.1 or later (MADV_COLLAPSE) with huge pages not off."""
    if not THP.exists() or "[never]" in THP.read_text():
        return False
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


def _huge_bytes_in(start: int, end: int) -> int:
    """AnonHugePages of the mappings that overlap [start, end)."""
    total, inside = 0, False
    for line in Path(f"/proc/{os.getpid()}/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(v, 16) for v in head.split("-"))
            inside = low < end and start < high
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def test_only_whole_huge_pages_inside_the_spans_are_asked_for() -> None:
    base = 64 * HUGE_PAGE  # addresses only: nothing here is read
    # two spans 100 bytes apart: one range, from the first whole page to the last
    near = [
        (base + 3 * HUGE_PAGE + 100, base + 4 * HUGE_PAGE + 7),
        (base + 100, base + 3 * HUGE_PAGE),
    ]
    assert huge_pages.huge_ranges(near) == [(base + HUGE_PAGE, base + 4 * HUGE_PAGE)]
    # two pages apart, neither holds a whole huge page
    far = [
        (base + 100, base + HUGE_PAGE + 100),
        (base + HUGE_PAGE + 8292, base + 2 * HUGE_PAGE + 9),
    ]
    assert huge_pages.huge_ranges(far) == []


def test_a_written_tensor_turns_huge_and_keeps_its_values() -> None:
    if not _collapses_here():
        pytest.skip("no MADV_COLLAPSE here (huge pages off, or Linux before 6.1)")
    weights = torch.arange(8 * MIB // 4, dtype=torch.int32)  # 8 MiB, written
    start = weights.data_ptr()
    end = start + weights.numel() * weights.element_size()
    expected = weights.clone()
    collapsed = huge_pages.collapse([weights])
    whole = end // HUGE_PAGE * HUGE_PAGE - -(-start // HUGE_PAGE) * HUGE_PAGE
    assert whole >= 3 * HUGE_PAGE
    # each chunk is collapsed or not (the kernel may find no free huge page for one)
    assert whole >= collapsed >= HUGE_PAGE and collapsed % HUGE_PAGE == 0
    assert _huge_bytes_in(start, end) >= collapsed
    assert torch.equal(weights, expected)
