"""Building the C kernels in ``carpool/models/kernels``.

A kernel is compiled with the machine's C compiler (``$CC``, else ``cc`` or
``gcc``) for this machine's instruction set the first time any process asks for it,
and kept in ``<cache>/kernels`` under a name keyed by its sources, the flags, the
compiler's version and the CPU, so a later process (another server, a test worker)
loads it without compiling. A library is written under a temporary name and renamed
into place, so a process never loads a half-written file. Where the full flags do
not build (no OpenMP, a compiler without ``-march=native``) a plainer set is tried
and the loss is logged as a WARNING. ctypes releases the GIL for each call, so the
event loop runs meanwhile.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from carpool.config import default_cache_dir, default_compiler
from carpool.paths import PathTaken

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"
# kernels/abi.h's CARPOOL_ABI_VERSION: the version of the ctypes declarations here.
ABI_VERSION = 13
# -ffp-contract=off: a product and a sum written apart stay apart (as torch rounds
# them); the kernels' fused multiply-adds are explicit.
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")
NATIVE = "-march=native"
OPENMP = "-fopenmp"
# Tried in order; the first that builds is used.
FLAG_LADDER: tuple[tuple[str, ...], ...] = (
    (NATIVE, OPENMP),
    (NATIVE,),
    (OPENMP,),
    (),
)


class KernelUnavailable(Exception):
    """A native kernel cannot be used here; the message says why."""


def torch_because(part: str, why: str, unavailable: bool) -> PathTaken:
    """The torch path for ``part``, logged: a WARNING when a kernel that applies
    could not be built or loaded here (``unavailable``: the machine lacks something,
    and the model runs slower than it could), INFO when it does not apply (another
    device or dtype, a model without the blocks a kernel reads)."""
    level = logging.WARNING if unavailable else logging.INFO
    log.log(level, "%s: torch runs instead of a native kernel (%s)", part, why)
    return PathTaken(part, False, why)


@functools.cache
def load_library(name: str) -> ctypes.CDLL:
    """``kernels/<name>.c`` built (or found in the cache) and loaded, once per
    process; raises KernelUnavailable."""
    path, _ = build_best(name)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:  # e.g. a cache folder mounted noexec
        raise KernelUnavailable(f"cannot load the compiled kernel: {exc}") from exc
    version = library.carpool_abi_version
    version.restype, version.argtypes = ctypes.c_int64, []
    if version() != ABI_VERSION:
        raise KernelUnavailable(
            f"kernel {name} speaks ABI version {version()}, these declarations {ABI_VERSION}"
        )
    return library


def build_best(name: str) -> tuple[Path, tuple[str, ...]]:
    """``kernels/<name>.c`` built with the first rung of ``FLAG_LADDER`` that builds
    (a WARNING says what a plainer rung lost): its path and the rung's flags. Raises
    KernelUnavailable if none builds or there is no compiler."""
    compiler = default_compiler()
    if compiler is None:
        raise KernelUnavailable("no C compiler ($CC, cc or gcc) on PATH")
    cache = default_cache_dir() / "kernels"
    errors = []
    for extra in FLAG_LADDER:
        try:
            library = build_library(name, compiler, (*BASE_FLAGS, *extra), cache)
        except KernelUnavailable as exc:
            errors.append(str(exc))
            continue
        if errors:
            lost = " ".join(sorted(set(FLAG_LADDER[0]) - set(extra)))
            log.warning("kernel %s built without %s (slower): %s", name, lost, errors[0])
        return library, extra
    raise KernelUnavailable(errors[-1])


def kernel_report() -> list[str]:
    """One line per kernel: whether it builds here, with which flags, and where it
    is cached (``carpool models --verbose``)."""
    compiler = default_compiler()
    lines = [f"compiler: {compiler_version(compiler) if compiler else 'none'}"]
    for source in sorted(KERNELS.glob("*.c")):
        try:
            library, extra = build_best(source.stem)
        except KernelUnavailable as exc:
            lines.append(f"{source.stem}: unavailable, torch runs instead ({exc})")
        else:
            flags = " ".join(extra) or "no -march=native, no OpenMP"
            lines.append(f"{source.stem}: native ({flags}) {library}")
    return lines


def build_library(name: str, compiler: str, flags: tuple[str, ...], cache: Path) -> Path:
    """The path of ``kernels/<name>.c`` compiled with ``compiler`` and ``flags`` in
    ``cache``: built now unless a build with the same key is already there. Raises
    KernelUnavailable if it does not build."""
    key = build_key(name, compiler, flags)
    library = cache / f"{name}-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=cache, prefix=f".{name}-", suffix=".so")
    os.close(handle)
    command = [compiler, *flags, str(KERNELS / f"{name}.c"), "-o", partial, "-lm"]
    started = time.monotonic()
    try:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KernelUnavailable(f"{compiler} did not run: {exc}") from exc
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed: {done.stderr.strip()[:400]}")
        os.replace(partial, library)  # atomic: readers see no file or the whole file
    finally:
        Path(partial).unlink(missing_ok=True)
    log.info("compiled kernel %s in %.1f s into %s", name, time.monotonic() - started, library)
    return library


def build_key(name: str, compiler: str, flags: tuple[str, ...]) -> str:
    """A digest of everything a build depends on: every file in ``kernels/`` (a
    kernel includes headers), the flags, the compiler's version and, since
    ``-march=native`` builds for this CPU, the CPU's feature flags."""
    digest = hashlib.sha256()
    for path in sorted(KERNELS.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("\0".join((name, *flags, compiler_version(compiler), cpu_id())).encode())
    return digest.hexdigest()[:20]


@functools.cache
def compiler_version(compiler: str) -> str:
    """The first line of ``compiler --version`` (with the resolved path), or ""."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = done.stdout.splitlines()
    return f"{compiler}: {lines[0] if lines else ''}"


@functools.cache
def cpu_id() -> str:
    """The machine and, where Linux says, the CPU's model and feature flags."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("model name", "flags", "Features")):
                    parts.append(line.strip())
                if len(parts) >= 3:
                    break
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def check_tensors(**tensors: tuple[torch.Tensor, torch.dtype]) -> None:
    """Raise ValueError unless each tensor is a contiguous CPU tensor of its dtype
    (what a kernel reads through a pointer)."""
    for name, (t, dtype) in tensors.items():
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor")


def check_shape(name: str, t: torch.Tensor, *shape: int) -> None:
    """Raise ValueError unless ``t`` has exactly ``shape``."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def check_range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Raise ValueError unless every entry of ``t`` is in [low, high]: an index a
    kernel follows must point inside what it indexes."""
    if t.numel() and (int(t.min()) < low or int(t.max()) > high):
        raise ValueError(f"{name} holds {int(t.min())}..{int(t.max())}, outside [{low}, {high}]")
