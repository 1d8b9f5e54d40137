"""Giving the C heap's free memory back to the system after a model is loaded or
unloaded.

glibc's malloc keeps the memory that large temporaries freed (a fused projection's
parts once stacked, a conversion's copies) in its heap for later allocations, and
after the first large block is freed it serves later large ones from that heap too:
the process stays as large as it was at its fullest. ``malloc_trim`` returns the free
pages. Loading a 684 MiB Q4_K_M file here left 34-42 MiB of them. The heap is
trimmed once a model is loaded, before its KV cache is allocated (so that allocation
does not stack on top of them), and by the server after each unload. ``libc_function``
declares the C library's functions for this and for ``carpool.huge_pages``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable, Sequence
from typing import Any


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, or None where ctypes cannot find or load it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def libc_function(name: str, restype: Any, argtypes: Sequence[Any]) -> Any | None:
    """The C library's function ``name``, declared with these types; None where the
    library, or the function in it, is missing."""
    library = _libc()
    function = getattr(library, name, None) if library is not None else None
    if function is not None:
        function.restype, function.argtypes = restype, list(argtypes)
    return function


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``int malloc_trim(size_t pad)``, or None under another C library."""
    trim: Callable[[int], int] | None = libc_function(
        "malloc_trim", ctypes.c_int, [ctypes.c_size_t]
    )
    return trim


def trim() -> bool:
    """Return the C heap's free pages to the system; whether this C library can."""
    malloc_trim = _malloc_trim()
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True
