"""The native decode-attention kernel (``kernels/paged_decode_attention.c``).

It is compiled with the machine's C compiler the first time an engine asks for it
in a process (well under a second here), into a temporary file that is loaded with
ctypes and then removed. A call passes tensors by their data pointers; ctypes
releases the GIL for the call, so the event loop runs meanwhile. The torch path in
``carpool.models.attention`` stays for other devices and dtypes, and where no
compiler is found.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "paged_decode_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


class KernelUnavailable(Exception):
    """The native kernel cannot be used here; the message says why."""


class DecodeKernel:
    """Attention of one query token per sequence over its paged keys and values."""

    def __init__(self, function: Callable[..., int]) -> None:
        self._function = function

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """``q``, ``out``: [S, H, D]; ``keys``, ``values``: [blocks, block_size, Hkv, D];
        ``block_tables``: [S, max_blocks]; ``context_lens``: [S]. Writes ``out``."""
        for name, t, dtype in (
            ("q", q, torch.float32),
            ("keys", keys, torch.float32),
            ("values", values, torch.float32),
            ("out", out, torch.float32),
            ("block_tables", block_tables, torch.int64),
            ("context_lens", context_lens, torch.int64),
        ):
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor")
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = keys.shape
        failed = self._function(
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            block_tables.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("decode attention could not allocate its score buffer")


@functools.cache
def compile_decode_kernel() -> DecodeKernel:
    """Compile and load the kernel once per process; raise KernelUnavailable."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc or gcc) on PATH")
    with tempfile.TemporaryDirectory(prefix="carpool-kernel-") as tmp:
        library = Path(tmp) / "paged_decode_attention.so"
        command = [compiler, *FLAGS, str(SOURCE), "-o", str(library), "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KernelUnavailable(f"{compiler} did not run: {exc}") from exc
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed: {done.stderr.strip()[:400]}")
        handle = ctypes.CDLL(str(library))  # stays mapped after the file is removed
    function = handle.paged_decode_attention
    function.restype = ctypes.c_int
    function.argtypes = (
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
    )
    return DecodeKernel(function)


def select_decode_kernel(
    choice: str, device: torch.device, dtype: torch.dtype
) -> DecodeKernel | None:
    """The kernel ``choice`` (auto, native or torch) asks for: None means the torch
    path. ``native`` raises ValueError where the kernel cannot run; ``auto`` falls
    back to torch and logs why."""
    if choice == "torch":
        return None
    if device.type != "cpu":
        why = f"it runs on the CPU and the model is on {device}"
    elif dtype != torch.float32:
        why = f"it takes float32 and the model is {dtype}"
    else:
        try:
            return compile_decode_kernel()
        except KernelUnavailable as exc:
            why = str(exc)
    if choice == "native":
        raise ValueError(f"attention_kernel native cannot be used: {why}")
    log.info("decode attention runs on torch: the native kernel cannot be used (%s)", why)
    return None
