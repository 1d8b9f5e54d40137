"""Building the C kernels in ``carpool/models/kernels``.

A kernel is compiled with the machine's C compiler the first time a process asks
for it (well under a second each here), for this machine's instruction set, into a
temporary file that is loaded with ctypes and then removed. ctypes releases the GIL
for each call, so the event loop runs meanwhile.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

KERNELS = Path(__file__).parent / "kernels"
# -ffp-contract=off: a product and a sum written apart stay apart (as torch rounds
# them); the kernels' fused multiply-adds are explicit.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


class KernelUnavailable(Exception):
    """A native kernel cannot be used here; the message says why."""


@functools.cache
def load_library(name: str) -> ctypes.CDLL:
    """``kernels/<name>.c`` compiled and loaded, once per process; raises
    KernelUnavailable."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc or gcc) on PATH")
    with tempfile.TemporaryDirectory(prefix="carpool-kernel-") as tmp:
        library = Path(tmp) / f"{name}.so"
        command = [compiler, *FLAGS, str(KERNELS / f"{name}.c"), "-o", str(library), "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KernelUnavailable(f"{compiler} did not run: {exc}") from exc
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed: {done.stderr.strip()[:400]}")
        try:
            return ctypes.CDLL(str(library))  # stays mapped after the file is removed
        except OSError as exc:  # e.g. a temporary folder mounted noexec
            raise KernelUnavailable(f"cannot load the compiled kernel: {exc}") from exc


def check_tensors(**tensors: tuple[torch.Tensor, torch.dtype]) -> None:
    """Raise ValueError unless each tensor is a contiguous CPU tensor of its dtype
    (what a kernel reads through a pointer)."""
    for name, (t, dtype) in tensors.items():
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor")
