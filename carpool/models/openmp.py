"""One OpenMP team per process: freeing the thread team of a thread that is done
with the model.

libgomp (torch's, which the kernels share: the same ``libgomp.so.1``) gives every
thread that opens a parallel region a team of worker threads of its own, kept until
that thread exits. Once the threads of all teams outnumber the CPUs, libgomp
throttles: a worker waiting for the next region spins ~100 times instead of ~300,000
and then sleeps in the kernel, so every region of a step pays a futex wake-up and a
context switch. A server loads its models on one thread and runs them on the device
runtime's: two teams. On this 2-core machine that took one stream from 8.7 to 12 ms
a token (BENCHMARKS.md, issue 16). ``release_thread_team`` on the loading thread
leaves the runtime's team the only one.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp.h's omp_pause_soft: free the threads, keep the settings


def loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp already in this process (torch's), or None where there is none (a
    torch built on another OpenMP, or none); never loads one."""
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except (OSError, AttributeError):  # not loaded; RTLD_NOLOAD is missing off Linux
        return None


def release_thread_team() -> bool:
    """End the calling thread's OpenMP team (its worker threads exit), as OpenMP 5's
    ``omp_pause_resource_all(omp_pause_soft)``. Call it from a thread that will open
    no more parallel regions; one it does open later gets a new team. Returns whether
    a team was released (False without libgomp, or inside a parallel region)."""
    library = loaded_libgomp()
    if library is None:
        return False
    try:
        pause = library.omp_pause_resource_all
    except AttributeError:  # a libgomp older than OpenMP 5 (GCC 9)
        return False
    pause.restype, pause.argtypes = ctypes.c_int, [ctypes.c_int]
    released = pause(OMP_PAUSE_SOFT) == 0
    log.debug("this thread's OpenMP team %s", "released" if released else "kept")
    return released
