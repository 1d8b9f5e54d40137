"""The server's long-lived objects kept out of Python's cyclic garbage collector.

Loaded models, their libraries and the server's own tables are millions of objects
that live until the model is unloaded. Left to the collector, every full collection
walks them all: measured with a small model under load (2 vCPUs), a 200-230 ms pause
of every thread every second or two, which was the whole of the c=64 p99. After each
load and unload the heap is settled: collected once, then what is left frozen
(``gc.freeze``), so that later collections walk only what requests create, and the C
heap's free pages returned (``carpool.c_heap``).
"""

from __future__ import annotations

import gc

from carpool import c_heap


def settle() -> None:
    """Collect everything once (frozen objects included: an unloaded model's cycles
    are freed here) and freeze what survives. One full collection's pause (a few
    hundred ms with a model loaded): call it after a load or unload, not per request."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    c_heap.trim()  # what an unloaded model freed
