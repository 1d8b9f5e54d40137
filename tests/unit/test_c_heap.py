"""Returning the C heap's free pages after a load."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import pytest

from carpool import c_heap

MIB = 1 << 20


def _resident_anonymous() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_freed_heap_memory_leaves_the_process_once_trimmed() -> None:
    name = ctypes.util.find_library("c")
    if name is None or not c_heap.trim():
        pytest.skip("not glibc: no malloc_trim")
    libc = ctypes.CDLL(name)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    # 96 MiB in blocks under malloc's mmap threshold (so from its heap), each written
    # so that it is resident; the last one kept, so freeing the rest leaves them in
    # the heap below it rather than handing them back at once.
    blocks = [libc.malloc(64 * 1024) for _ in range(96 * 16)]
    for block in blocks:
        ctypes.memset(block, 1, 64 * 1024)
    for block in blocks[:-1]:
        libc.free(block)
    held = _resident_anonymous()
    assert c_heap.trim()
    assert _resident_anonymous() < held - 64 * MIB
    libc.free(blocks[-1])
