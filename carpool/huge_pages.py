"""Backing a model's weights with transparent huge pages once it is loaded.

One stream reads every weight once a token (628 MiB for a 1.2B Q4_K_M file): in
4 KiB pages that is ~160,000 pages a token, each a TLB entry to fill by a walk of the
page tables. The 1.2B's 89 matrices, one row, ran 3-9% faster
from a copy in 2 MiB pages than from the 4 KiB pages they were loaded into (a Zen 4,
two threads, sweeps of each alternating in one process; BENCHMARKS.md, session 47).

Linux backs anonymous memory with huge pages where the process asks (``madvise``,
most distributions' setting of ``/sys/kernel/mm/transparent_hugepage/enabled``) or
everywhere (``always``); memory already written turns huge when its khugepaged scan
comes round (minutes), or at once with ``MADV_COLLAPSE`` (Linux 6.1). Only the whole
2 MiB pages inside the weights are asked for, so no page outside them is filled in.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from carpool import c_heap

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's <sys/mman.h>
MADV_COLLAPSE = 25
# Weights closer than this merge into one range: the page between them holds the
# allocator's header for the next one, so it is written (a collapse fills in none).
MERGE_GAP = 4096
CHUNK = 16 * HUGE_PAGE  # a thread's share at a time


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``int madvise(void *addr, size_t length, int advice)`` on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise: Callable[[int, int, int], int] | None = c_heap.libc_function(
        "madvise", ctypes.c_int, argtypes
    )
    return madvise


def huge_ranges(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole huge pages inside memory spans [start, end), as [start, end) ranges
    (spans that touch or nearly touch merged first)."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1] + MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    ranges = []
    for start, end in merged:
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        last = end // HUGE_PAGE * HUGE_PAGE
        if last > first:
            ranges.append((first, last))
    return ranges


def collapse(tensors: Iterable[torch.Tensor], threads: int = 2) -> int:
    """Ask for huge pages under the whole 2 MiB pages inside the tensors, now where the
    kernel can (``MADV_COLLAPSE``, in chunks over ``threads`` threads: each copies its
    pages into huge ones), else as khugepaged comes round. Returns the bytes collapsed
    now: 0 off Linux, where huge pages are off, or before Linux 6.1. Nothing but speed
    changes either way."""
    madvise = _madvise()
    if madvise is None:
        return 0
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tensors
        if t.device.type == "cpu" and t.numel()
    ]
    chunks = [
        (at, min(at + CHUNK, end))
        for start, end in huge_ranges(spans)
        for at in range(start, end, CHUNK)
    ]

    def one(chunk: tuple[int, int]) -> int:
        start, end = chunk
        if madvise(start, end - start, MADV_HUGEPAGE) != 0:
            return 0  # huge pages off (or not built in)
        return end - start if madvise(start, end - start, MADV_COLLAPSE) == 0 else 0

    with ThreadPoolExecutor(max(1, threads)) as pool:  # madvise runs without the GIL
        collapsed = sum(pool.map(one, chunks))
    log.debug("weights: %.0f MiB in huge pages", collapsed / 2**20)
    return collapsed
