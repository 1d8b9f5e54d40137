"""Kernel builds: cached under a key of everything they depend on, written
atomically, compiled at most once, and the plainest flags (no OpenMP, no
``-march=native``) still build kernels that compute what torch computes."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from carpool.config import default_cache_dir, default_compiler
from carpool.models import llama_stack, native
from carpool.models.decode_kernel import decode_kernel_in
from carpool.models.gguf_blocks import to_packed
from carpool.models.native import BASE_FLAGS, FLAG_LADDER, build_key, build_library
from carpool.models.packed_linear import (
    Interleaved,
    PackedWeight,
    QuantizedLinearKernel,
    without_k_scales,
)
from tests.unit.models.test_decode_kernel import attend, paged_inputs
from tests.unit.models.test_gguf_blocks import random_blocks
from tests.unit.models.test_packed_linear import INTERLEAVED, gguf_weight, rounded_rows_product

KERNEL = "paged_decode_attention"


@pytest.fixture
def compiler() -> str:
    found = default_compiler()
    if found is None:
        pytest.skip("no C compiler")
    return found


def test_a_second_build_compiles_nothing(
    compiler: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = (*BASE_FLAGS, *FLAG_LADDER[0])
    first = build_library(KERNEL, compiler, flags, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial file left

    def no_compiling(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(native.subprocess, "run", no_compiling)
    assert build_library(KERNEL, compiler, flags, tmp_path) == first


def test_the_key_follows_the_sources_the_flags_and_the_compiler(
    compiler: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = build_key(KERNEL, compiler, BASE_FLAGS)
    assert build_key(KERNEL, compiler, (*BASE_FLAGS, "-fopenmp")) != key
    monkeypatch.setattr(native, "compiler_version", lambda _: "another compiler 1.0")
    assert build_key(KERNEL, compiler, BASE_FLAGS) != key
    monkeypatch.undo()
    copy = tmp_path / "kernels"
    shutil.copytree(native.KERNELS, copy)
    monkeypatch.setattr(native, "KERNELS", copy)
    assert build_key(KERNEL, compiler, BASE_FLAGS) == key
    header = copy / "decode_attention.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert build_key(KERNEL, compiler, BASE_FLAGS) != key


def test_concurrent_builds_leave_one_whole_library(compiler: str, tmp_path: Path) -> None:
    flags = (*BASE_FLAGS, *FLAG_LADDER[0])
    paths: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: paths.append(build_library(KERNEL, compiler, flags, tmp_path))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and len(paths) == 3
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
    ctypes.CDLL(str(paths[0])).paged_decode_attention  # noqa: B018 - loads whole


@pytest.mark.parametrize("extra", FLAG_LADDER, ids=lambda e: " ".join(e) or "plain")
def test_every_rung_of_the_flag_ladder_matches_torch(
    compiler: str, tmp_path: Path, extra: tuple[str, ...]
) -> None:
    """Over a float32 cache and a float16 one (the plain rungs widen halves bit by bit,
    the native ones with F16C)."""
    library = ctypes.CDLL(str(build_library(KERNEL, compiler, (*BASE_FLAGS, *extra), tmp_path)))
    kernel = decode_kernel_in(library)
    contexts = [1, 17, 131]
    cache, q, tables = paged_inputs(contexts, 6, 2, 16, head_dim=64)
    for held in (cache, cache.half()):
        expected = attend(held, q, tables, contexts, native=False)
        torch.testing.assert_close(
            attend(held, q, tables, contexts, native=True, kernel=kernel),
            expected,
            rtol=1e-5,
            atol=1e-5,
        )


# Exports kv_cache.h's conversions, for the test below to call.
CONVERSIONS = """
#include "kv_cache.h"
void widen(const uint16_t *in, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = kv_value(in, i, 1);
}
void narrow(const float *in, uint16_t *out, int64_t n) { kv_store(out, 0, in, n, 1); }
"""


@pytest.mark.parametrize("extra", [(), ("-mavx2", "-mfma", "-mf16c")], ids=["plain", "f16c"])
def test_the_half_conversions_round_as_torch_does(
    compiler: str, tmp_path: Path, extra: tuple[str, ...]
) -> None:
    """Every half widens to the float torch gives (its NaNs to NaNs), and floats round
    to torch's halves: ties to even, subnormals, past the largest half, the extremes."""
    if extra and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2 (nor F16C, which every AVX2 CPU has)")
    source = tmp_path / "conversions.c"
    source.write_text(CONVERSIONS)
    library_path = tmp_path / "conversions.so"
    command = [compiler, *BASE_FLAGS, *extra, "-I", str(native.KERNELS)]
    subprocess.run([*command, str(source), "-o", str(library_path)], check=True)
    library = ctypes.CDLL(str(library_path))
    for function in (library.widen, library.narrow):
        function.restype, function.argtypes = None, [ctypes.c_void_p] * 2 + [ctypes.c_int64]
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    widened = torch.empty(halves.shape, dtype=torch.float32)
    library.widen(halves.data_ptr(), widened.data_ptr(), halves.numel())
    expected = halves.float()
    numbers = ~expected.isnan()
    assert torch.equal(widened[numbers], expected[numbers]) and widened[~numbers].isnan().all()
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(100_000, generator=gen) * torch.logspace(-9, 6, 100_000).double().float()
    ordered = expected[numbers & ~expected.isinf()].unique()  # sorted, -0 one with 0
    halfway = (ordered[:-1] + ordered[1:]) / 2  # ties between neighbours: exact as floats
    edges = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e9, float("inf"), 2**-25, 2**-24])
    floats = torch.cat([spread, halfway, edges, -edges])
    narrowed = torch.empty(floats.shape, dtype=torch.float16)
    library.narrow(floats.data_ptr(), narrowed.data_ptr(), floats.numel())
    assert torch.equal(narrowed.view(torch.int16), floats.half().view(torch.int16))


# On an AVX-512 CPU, -march=native builds the AVX-512 code: this rung keeps the AVX2
# code (which AVX2-only CPUs run) in the comparison.
AVX2_RUNG = ("-mavx2", "-mfma", "-mf16c")
# On a CPU with AVX-512 VNNI (the AMX tiles' other half), the AMX tiles with their
# instructions emulated in C (kernels/amx_tiles.h): the code around them checked on a
# CPU without AMX.
AMX_EMULATED_RUNG = (*FLAG_LADDER[0], "-DCARPOOL_AMX_EMULATED")


def has_avx512_vnni() -> bool:
    return "avx512_vnni" in native.cpu_id().split()


def linear_flags() -> tuple[tuple[str, ...], ...]:
    """The flag ladder, and the AVX2 rung where the CPU has AVX-512 (and the emulated
    AMX rung where it has AVX-512 VNNI)."""
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    if not avx512:
        return FLAG_LADDER
    return (*FLAG_LADDER, AVX2_RUNG, *([AMX_EMULATED_RUNG] if has_avx512_vnni() else []))


@pytest.fixture(scope="module")
def linear_rungs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[tuple[str, ...], Path]]:
    """``quantized_linear`` built once on each rung of the flag ladder (and AVX2's)."""
    found = default_compiler()
    if found is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("rungs")
    # The first rung is the build servers load: the session's cache holds it (built
    # by the install, or by the first test that needed it). The others are built at
    # once (each is a compiler process): ~40 s one after another on 2 cores.
    served = default_cache_dir() / "kernels"
    flags = linear_flags()
    with ThreadPoolExecutor(len(flags)) as pool:
        paths = pool.map(
            lambda extra: build_library(
                "quantized_linear",
                found,
                (*BASE_FLAGS, *extra),
                served if extra == FLAG_LADDER[0] else folder,
            ),
            flags,
        )
        return list(zip(flags, paths, strict=True))


def one_result_on_every_rung(
    linear_rungs: list[tuple[tuple[str, ...], Path]],
    x: torch.Tensor,
    packed: PackedWeight | None,
    interleaved: Interleaved,
) -> torch.Tensor:
    """The int8 product of ``x`` on each rung's interleaved kernel, checked to be one
    result, bit for bit: that result."""
    results = [
        QuantizedLinearKernel(ctypes.CDLL(str(path)), int8_dots=True)(x, packed, interleaved)
        for _, path in linear_rungs
    ]
    assert all(torch.equal(r, results[0]) for r in results[1:])
    return results[0]


def test_the_emulated_amx_rung_runs_the_amx_tiles(
    linear_rungs: list[tuple[tuple[str, ...], Path]],
) -> None:
    """The rung the bit-for-bit comparisons below include for the AMX code does run it
    (its kernel says so), and the other rungs do not emulate anything."""
    codes = {
        extra: QuantizedLinearKernel(ctypes.CDLL(str(path))).interleaved_vectorized
        for extra, path in linear_rungs
    }
    if AMX_EMULATED_RUNG not in codes or codes[FLAG_LADDER[0]] < 2:
        pytest.skip("no AVX-512 VNNI code here (the CPU's or the compiler's): no AMX tiles")
    assert codes[AMX_EMULATED_RUNG] == 3
    assert codes[FLAG_LADDER[-1]] == 0
    assert codes[AVX2_RUNG] == 1


def test_the_amx_instructions_build_for_a_cpu_with_amx(compiler: str, tmp_path: Path) -> None:
    """The AMX tiles' real instructions (not emulated) compile for a Sapphire Rapids,
    the first CPU with AMX, whatever CPU builds them: they run where one is found."""
    probe = tmp_path / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    known = subprocess.run(
        [compiler, "-march=sapphirerapids", "-fsyntax-only", str(probe)], capture_output=True
    )
    if known.returncode != 0:
        pytest.skip("the compiler does not know -march=sapphirerapids")
    library = build_library(
        "quantized_linear", compiler, (*BASE_FLAGS, "-march=sapphirerapids", "-fopenmp"), tmp_path
    )
    assert library.exists()


@pytest.mark.parametrize("kind", INTERLEAVED)
def test_the_interleaved_int8_kernel_computes_the_same_bits_on_every_rung(
    linear_rungs: list[tuple[tuple[str, ...], Path]], kind: str
) -> None:
    """Its portable C (the plain rungs, or a CPU without AVX-512 VNNI), its vector code
    and its AMX tiles (emulated: past 8 rows, 16 at a time) do the same arithmetic:
    one result, bit for bit."""
    # 11 blocks a row: the AMX tiles' 8 at a time, then 3
    packed, _ = gguf_weight(kind, 48, 352, seed=2)
    interleaved = Interleaved.of(packed)
    assert interleaved is not None
    # up to 8 rows AVX2's four at a time (every remainder), more its wide tiles (one
    # unpacking for every row), and past a call's 64 (AMX's 16 at a time, then 6)
    for rows in (1, 3, 6, 9, 70):
        x = torch.randn(rows, 352, generator=torch.Generator().manual_seed(rows))
        one_result_on_every_rung(linear_rungs, x, packed, interleaved)


def test_the_interleaved_q6_k_computes_the_same_bits_on_every_rung(
    linear_rungs: list[tuple[tuple[str, ...], Path]],
) -> None:
    """Q6_K's tile (its AVX-512 VNNI code, its AVX2 code and the portable C): one
    result on every rung, for a few rows, a tile's worth and more, and past AVX2's
    64 rows a call."""
    packed = to_packed(
        GGMLQuantizationType.Q6_K, random_blocks(GGMLQuantizationType.Q6_K, 32, 512, 7)
    )
    assert packed is not None
    interleaved = Interleaved.of(packed)
    assert interleaved is not None and interleaved.k_scales
    for rows in (1, 11, 70):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        one_result_on_every_rung(linear_rungs, x, None, interleaved)


@pytest.mark.parametrize(
    "kind", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K], ids=lambda t: t.name
)
def test_the_interleaved_k_quant_scales_compute_the_same_bits_on_every_rung(
    linear_rungs: list[tuple[tuple[str, ...], Path]], kind: GGMLQuantizationType
) -> None:
    """The interleaved copy that keeps a K-quant's own scales (d * sc, -dmin * m): one
    result on every rung, the rounded rows' product with one step per 256 of x (the
    integer sub-block scales multiply integer sums). Its float32 products are not
    float16's: without the K-quant's scales there is no interleaved copy of them."""
    packed = to_packed(kind, random_blocks(kind, 32, 512, seed=5))
    assert packed is not None
    compact = Interleaved.of(packed)
    assert compact is not None and compact.k_scales
    assert Interleaved.of(without_k_scales(packed)) is None
    # up to 8 rows AVX2's four at a time (every remainder), more its wide tiles (one
    # unpacking for every row), and past a call's 64
    for rows in (1, 3, 6, 9, 70):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(
            one_result_on_every_rung(linear_rungs, x, None, compact).double(),
            rounded_rows_product(x, packed, super_blocks=True),
            rtol=1e-5,
            atol=1e-5,
        )


@pytest.mark.parametrize(
    "kind",
    [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K],
    ids=lambda t: t.name,
)
def test_a_lean_k_quant_computes_its_product_on_every_rung(
    linear_rungs: list[tuple[tuple[str, ...], Path]], kind: GGMLQuantizationType
) -> None:
    """A K-quant matrix holding only its file's scales: Q4_K's and Q5_K's sc and m
    unpacked from their 12 bytes (in 32-bit words in the vector code, byte by byte in
    the portable C), Q6_K's quants from their six bits; the float32 product on every
    rung, one row (four features at a time) and a few."""
    packed = to_packed(kind, random_blocks(kind, 32, 512, seed=9))
    assert packed is not None
    lean = packed.lean()
    assert lean.is_lean
    weight = packed.dequantize()
    for rows in (1, 3):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        exact = x @ weight.T
        for extra, path in linear_rungs:
            got = QuantizedLinearKernel(ctypes.CDLL(str(path)))(x, lean)
            torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5, msg=str(extra))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", ["Q8_16+mins", "Q6_16", "Q5_1", "Q5_0", "Q8_0"])
def test_the_k_quant_layouts_compute_their_products_on_every_rung(
    linear_rungs: list[tuple[tuple[str, ...], Path]], kind: str, rows: int
) -> None:
    """Q8_16 (scales and mins per 16), Q6_16 (two lanes of bits 4 and 5), Q5_1 and
    Q5_0 (a plane of fifth bits) and Q8_0
    in the vector code and the portable C, one row (four features at a time) and a
    few: the float32 product, and with int8 dots the rounded rows' integer products."""
    packed, weight = gguf_weight(kind, 40, 128, seed=6)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(6))
    exact, rounded = x @ weight.T, rounded_rows_product(x, packed)
    for extra, path in linear_rungs:
        library = ctypes.CDLL(str(path))
        got = QuantizedLinearKernel(library)(x, packed)
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5, msg=str(extra))
        got8 = QuantizedLinearKernel(library, int8_dots=True)(x, packed).double()
        torch.testing.assert_close(got8, rounded, rtol=1e-5, atol=1e-5, msg=str(extra))


def test_a_failing_rung_falls_to_the_next_with_a_warning(
    compiler: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As on a compiler without OpenMP: the full flags fail, a plainer set builds."""
    monkeypatch.setattr(native, "default_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(native, "FLAG_LADDER", (("-fno-such-flag",), *FLAG_LADDER[1:]))
    with caplog.at_level("WARNING", logger="carpool.models.native"):
        library = native.load_library.__wrapped__(KERNEL)
    assert library.paged_decode_attention is not None
    assert "built without -fno-such-flag" in caplog.text


def test_a_library_of_another_abi_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION + 1)
    with pytest.raises(native.KernelUnavailable, match="ABI version"):
        native.load_library.__wrapped__(KERNEL)


def test_a_struct_declared_unlike_its_c_twin_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Dims(ctypes.Structure):  # two fields short of the C struct
        _fields_ = llama_stack._Dims._fields_[:-2]

    monkeypatch.setattr(llama_stack, "_Dims", _Dims)
    with pytest.raises(native.KernelUnavailable, match="Dims is 80 bytes in C and 64"):
        llama_stack._function.__wrapped__()


def test_cc_names_the_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    monkeypatch.setenv("CC", "gcc")
    assert default_compiler() == gcc
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert default_compiler() is None
    monkeypatch.setattr(native, "default_cache_dir", lambda: tmp_path)
    with pytest.raises(native.KernelUnavailable, match="no C compiler"):
        native.load_library.__wrapped__(KERNEL)
