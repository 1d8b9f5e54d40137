"""A K-quant GGUF (Q4_K_M) on carpool's native kernels against llama.cpp on the
same file, side by side in one run, 2 threads each: one stream (``llama-bench``
tg128 against carpool's offline engine, back to back in ``--rounds`` rounds), 64
concurrent streams over HTTP (``carpool bench``, the same random prompts for ``carpool
serve`` and ``llama-server``: output tok/s, TTFT, inter-token p99), and carpool's peak
resident memory against the bound of issue 49: the process before any model + 1.3x
the file + the KV cache. Beside the one-stream rounds it prints whether they are bound
by memory: what this machine reads (``read_ceiling_gib_s``, before each side of each
round too: this guest's rate swings 1.5-2x within minutes), the bytes a token reads
in llama.cpp and in carpool, and what share of that rate each streamed. carpool's KV
cache is sized to hold every stream at once (``--concurrency`` x the prompt and output
tokens) unless ``--kv-cache`` says otherwise: a smaller one preempts streams and
recomputes them (the count is printed). It holds float16 (``--kv-cache-dtype``), as
llama.cpp's cache does at its defaults.

    python -m benchmarks.k_quants --llama-bin /path/to/llama.cpp/build/bin [--gguf F]

Without ``--gguf`` the file is made from the built-in model with ``llama-quantize
--allow-requantize ... Q4_K_M`` (its 576-wide rows are not whole 256-weight
super-blocks, so llama.cpp writes most of them as Q5_0, the rest Q4_K, Q6_K, Q8_0).
With ``--shape`` (one of ``benchmarks.real_size``'s, e.g. ``llama-1.2b``) it is a
random-weight model of that shape (``real_size``), converted by llama.cpp's own
``convert_hf_to_gguf.py`` (it imports ``sentencepiece``: ``pip install sentencepiece``)
and quantized to Q4_K_M: a real size, mostly Q4_K and Q6_K.
Build llama.cpp as ``benchmarks/vs_llama_server.py`` says, with the targets
``llama-server llama-bench llama-quantize``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.single_stream import llama_bench, offline
from benchmarks.vs_llama_server import CHAT, builtin_gguf, start, stop
from carpool.bench.config import BenchConfig
from carpool.bench.run import run
from carpool.testing import spawn

TOKENS = 128
PROMPT_TOKENS = 64
BLOCK = 16  # carpool's KV block, in tokens


def make_q4_k_m(llama_bin: Path, out_dir: Path) -> Path:
    target = out_dir / "smollm2-135m-instruct.Q4_K_M.gguf"
    if not target.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        quantize = [str(llama_bin / "llama-quantize"), "--allow-requantize"]
        subprocess.run([*quantize, builtin_gguf(), str(target), "Q4_K_M"], check=True)
    return target


def make_shape_q4_k_m(shape: str, llama_bin: Path, llama_src: Path, out_dir: Path) -> Path:
    """A random-weight model of ``shape`` as llama.cpp makes a Q4_K_M file of it."""
    target = out_dir / f"{shape}.Q4_K_M.gguf"
    if target.exists():
        return target
    from benchmarks.real_size import build
    from carpool.config import default_cache_dir
    from carpool.models.causal_lm import convert_gguf

    tokenizer = convert_gguf(Path(builtin_gguf()), default_cache_dir(), progress=False)
    hf, f16 = out_dir / f"{shape}-hf", out_dir / f"{shape}.f16.gguf"
    try:
        build(shape, hf, tokenizer)
        convert = [sys.executable, str(llama_src / "convert_hf_to_gguf.py"), str(hf)]
        subprocess.run([*convert, "--outfile", str(f16), "--outtype", "f16"], check=True)
        quantize = [str(llama_bin / "llama-quantize"), str(f16), str(target), "Q4_K_M"]
        subprocess.run(quantize, check=True)
    finally:
        shutil.rmtree(hf, ignore_errors=True)
        f16.unlink(missing_ok=True)
    return target


def int8_code() -> str:
    """Which code carpool's interleaved int8 kernels run here, as this process (and the
    servers it starts, with the same ``CC``) builds them."""
    from carpool.models.packed_linear import quantized_linear_kernel

    return quantized_linear_kernel(int8_dots=True).int8_code


def tensor_types(gguf: Path) -> str:
    from gguf import GGUFReader

    counts = collections.Counter(t.tensor_type.name for t in GGUFReader(str(gguf)).tensors)
    return ", ".join(f"{n} {kind}" for kind, n in counts.most_common())


MEMORY_PROBE = """
import sys
from pathlib import Path
import torch, transformers, carpool.cli, carpool.server.bootstrap, carpool.server.http.app
from carpool.models.causal_lm import load_causal_lm
def status(key):
    return int(Path("/proc/self/status").read_text().split(key + ":")[1].split()[0]) / 1024
before = status("VmRSS")
lm = load_causal_lm(Path(sys.argv[1]), progress=False, weight_kernel=sys.argv[2])
after, peak = status("VmRSS"), status("VmHWM")
from benchmarks.k_quants import bytes_per_token  # last: the server imports none of it
print(before, after, peak, bytes_per_token(lm.model) / 2**20)
"""


def bytes_per_token(model: Any) -> int:
    """The bytes of weights a decode step of one row reads: every linear layer's
    blocks as the model holds them (interleaved, or the file's layout), or its float32
    weight (an embedding looks up one row: not counted)."""
    from carpool.models.packed_linear import Linear, interleaved_parts, packed_parts

    seen: set[int] = set()

    def size(*tensors: Any) -> int:
        fresh = [t for t in tensors if t is not None and t.data_ptr() not in seen]
        seen.update(t.data_ptr() for t in fresh)
        return sum(t.numel() * t.element_size() for t in fresh)

    total = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        if module.interleaved is not None:
            for i in interleaved_parts(module.interleaved):
                total += size(i.quants, i.scales, i.extra)
        elif module.packed is not None:
            for p in packed_parts(module.packed):
                k = p.k_scales
                total += size(p.quants, p.scales, p.mins, k and k.supers, k and k.factors)
        else:
            total += size(module.weight)
    return total


def llama_bytes_per_token(gguf: Path) -> int:
    """The bytes of the file a llama.cpp decode step of one row reads: every tensor
    but the token table, which it looks a row up in (unless the output is tied to it)."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(gguf)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def read_ceiling_gib_s(threads: int, gib: int = 1) -> float:
    """What this machine reads from memory, GiB/s: the median of 9 sums of a ``gib``
    GiB float32 tensor on ``threads`` torch threads (a one-row decode step that
    streams its weights at this rate is bound by memory). The median: a best run
    here once read 59 GiB/s where the others read 32-34."""
    import time

    import torch

    torch.set_num_threads(threads)
    data = torch.ones(gib * 2**28)
    rates = []
    for _ in range(9):
        started = time.perf_counter()
        data.sum()
        rates.append(gib / (time.perf_counter() - started))
    return statistics.median(rates)


def kv_cache_for(folder: Path, streams: int, dtype: str) -> str:
    """A KV cache of ``dtype`` (float32 or float16) that holds ``streams`` sequences of
    the prompt and output tokens at once (and one block more each), for the model
    converted into ``folder``."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    element = 2 if dtype == "float16" else 4
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * element
    blocks = streams * (-(-(PROMPT_TOKENS + TOKENS) // BLOCK) + 1)
    return f"{-(-blocks * BLOCK * per_token // 2**20)}MiB"


def model_memory(gguf: Path, weight_kernel: str) -> tuple[float, float, float, float]:
    """In a fresh process with the server's modules imported (what ``carpool serve``
    imports before it loads a model): RSS before loading the model, after, and the
    peak, and the weights a one-row step reads (``bytes_per_token``), MiB. The file
    is converted beforehand, so the conversion's own memory is not counted."""
    command = [sys.executable, "-c", MEMORY_PROBE, str(gguf), weight_kernel]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    before, after, peak, read = (float(v) for v in out.split()[-4:])
    return before, after, peak, read


def peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


def serve(name: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    if name == "llama-server":
        return start(name, args)
    command = [sys.executable, "-m", "carpool.cli", "serve", "--port", "0", "--model"]
    command += [str(args.gguf), "--served-model-name", CHAT]
    command += ["--threads", str(args.threads), "--kv-cache-memory", args.kv_cache]
    command += ["--kv-cache-dtype", args.kv_cache_dtype]
    command += ["--weight-kernel", args.weight_kernel]
    process, match, _ = spawn(command, re.compile(r"carpool ready on (http://\S+)"), 300.0)
    return process, match.group(1)


def concurrent(name: str, args: argparse.Namespace) -> dict[str, Any]:
    process, url = serve(name, args)
    try:
        config = BenchConfig(
            base_url=url,
            dataset="random",
            random_input_len=PROMPT_TOKENS,
            random_output_len=TOKENS,
            num_prompts=args.num_prompts,
            num_warmups=2,
            concurrency=args.concurrency,
            ignore_eos=True,
            seed=args.seed,
        )
        [result] = run(config, progress=False)
        preemptions = None
        if name == "carpool":
            metrics = httpx.get(f"{url}/metrics").text
            found = re.search(r"^carpool_num_preemptions_total\{[^}]*\} (\S+)", metrics, re.M)
            preemptions = int(float(found.group(1))) if found else None
        return {**result, "peak_rss_mib": peak_rss_mib(process.pid), "preemptions": preemptions}
    finally:
        stop(process)


@dataclass(frozen=True)
class Round:
    """One one-stream round: each side's tokens/s and what the machine read (the float32
    sum, ``read_ceiling_gib_s``) just before it ran."""

    bench_ts: float
    own_ts: float
    bench_ceiling: float
    own_ceiling: float


def one_stream_round(args: argparse.Namespace, bin_dir: Path, index: int) -> Round:
    """llama-bench tg128 and carpool's offline engine, back to back, llama-bench first in
    even rounds; each after a read of the machine's memory rate (this guest's swings
    by 1.5-2x within minutes, and a round read when it is low is bound by it)."""

    def bench() -> tuple[float, float]:
        ceiling = read_ceiling_gib_s(args.threads)
        return llama_bench(bin_dir / "llama-bench", str(args.gguf), args.threads), ceiling

    def own() -> tuple[float, float]:
        ceiling = read_ceiling_gib_s(args.threads)
        seconds = offline(
            args.threads,
            args.requests,
            args.weight_kernel,
            str(args.gguf),
            kv_cache_memory=args.kv_cache,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        return 1 / seconds, ceiling

    if index % 2 == 0:
        (bench_ts, bench_ceiling), (own_ts, own_ceiling) = bench(), own()
    else:
        (own_ts, own_ceiling), (bench_ts, bench_ceiling) = own(), bench()
    return Round(bench_ts, own_ts, bench_ceiling, own_ceiling)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", required=True, help="llama.cpp's build/bin folder")
    parser.add_argument("--gguf", default="", help="a Q4_K_M file (default: the built-in's)")
    parser.add_argument(
        "--shape", default="", help="a benchmarks.real_size shape to make the file of instead"
    )
    parser.add_argument(
        "--llama-src", default="", help="llama.cpp's sources (default: --llama-bin's ../..)"
    )
    parser.add_argument("--out-dir", default="benchmarks/results/k_quants")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8, help="one-stream requests")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="one-stream rounds, llama-bench and carpool back to back in alternating order "
        "(this CPU drifts between two measurements: the median of the rounds' ratios)",
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache",
        default="",
        help="carpool's KV cache (default: what --concurrency streams need at once)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="float16",
        choices=("float16", "float32"),
        help="carpool's KV cache (float16: llama.cpp's default cache type, which it runs with)",
    )
    parser.add_argument("--llama-port", type=int, default=8093)
    parser.add_argument(
        "--weight-kernel",
        default="auto",
        choices=("auto", "native", "native-int8"),
        help="carpool's (native-int8 rounds activations to int8 per 32, as llama.cpp does)",
    )
    args = parser.parse_args()
    bin_dir = Path(args.llama_bin)
    src = Path(args.llama_src) if args.llama_src else bin_dir.parent.parent
    if args.gguf:
        args.gguf = Path(args.gguf)
    elif args.shape:
        args.gguf = make_shape_q4_k_m(args.shape, bin_dir, src, Path(args.out_dir))
    else:
        args.gguf = make_q4_k_m(bin_dir, Path(args.out_dir))
    args.llama_server = str(bin_dir / "llama-server")
    args.parallel = args.concurrency
    file_mib = args.gguf.stat().st_size / 2**20
    print(f"{args.gguf} ({file_mib:.1f} MiB): {tensor_types(args.gguf)}")
    print(f"carpool's int8 kernels: {int8_code()}")

    from carpool.config import default_cache_dir
    from carpool.models.causal_lm import convert_gguf

    folder = convert_gguf(args.gguf, default_cache_dir(), progress=False)  # not measured
    args.kv_cache = args.kv_cache or kv_cache_for(folder, args.concurrency, args.kv_cache_dtype)
    kernels = dict.fromkeys((args.weight_kernel, "native", "torch"))
    memory = {kernel: model_memory(args.gguf, kernel) for kernel in kernels}
    rounds = [one_stream_round(args, bin_dir, i) for i in range(args.rounds)]
    ceiling = read_ceiling_gib_s(args.threads)
    carpool = concurrent("carpool", args)
    llama = concurrent("llama-server", args)

    kv = float(args.kv_cache.removesuffix("MiB"))
    print()
    theirs, ours = llama_bytes_per_token(args.gguf) / 2**30, memory[args.weight_kernel][3] / 1024
    for i, r in enumerate(rounds):
        print(
            f"one stream, round {i + 1}: llama-bench tg128 {r.bench_ts:.1f} tok/s | carpool "
            f"offline {r.own_ts:.1f} tok/s | ratio {r.own_ts / r.bench_ts:.2f}"
        )
        print(
            f"  streamed: llama-bench {r.bench_ts * theirs:.1f} GiB/s of {r.bench_ceiling:.1f} "
            f"read just before ({r.bench_ts * theirs / r.bench_ceiling:.0%}), carpool "
            f"{r.own_ts * ours:.1f} of {r.own_ceiling:.1f} ({r.own_ts * ours / r.own_ceiling:.0%})"
        )
    ratio = statistics.median(r.own_ts / r.bench_ts for r in rounds)
    print(f"one stream: median ratio {ratio:.2f} over {len(rounds)} rounds (target >= 1.1)")
    best_bench = max(r.bench_ts for r in rounds)
    print(
        f"  bound by memory: this machine reads {ceiling:.1f} GiB/s (a float32 sum's median, "
        f"{args.threads} threads); a token reads {theirs * 1024:.0f} MiB in llama.cpp, "
        f"{ours * 1024:.0f} in carpool; llama-bench's best round {best_bench:.1f} tok/s "
        f"streamed {best_bench * theirs:.1f} GiB/s ({best_bench * theirs / ceiling:.0%} of "
        f"it); carpool at that rate: {ceiling / ours:.1f} tok/s, "
        f"{ceiling / ours / best_bench:.2f}x that round"
    )
    print(
        f"c={args.concurrency}: output tok/s carpool {carpool['output_throughput']:.1f} | "
        f"llama-server {llama['output_throughput']:.1f} | ratio "
        f"{carpool['output_throughput'] / llama['output_throughput']:.2f} (target >= 2.0)"
    )
    for name, r in (("carpool", carpool), ("llama-server", llama)):
        print(
            f"  {name}: TTFT p50 {r['median_ttft_ms']:.0f} ms, p99 {r['p99_ttft_ms']:.0f} ms; "
            f"TPOT p50 {r['median_tpot_ms']:.1f} ms; ITL p99 {r['p99_itl_ms']:.1f} ms; "
            f"peak RSS {r['peak_rss_mib']:.0f} MiB"
        )
    print(f"  carpool's KV cache {args.kv_cache}: {carpool['preemptions']} preemptions")
    before = memory[args.weight_kernel][0]
    bound = before + 1.3 * file_mib + kv
    print(
        f"carpool's peak RSS {carpool['peak_rss_mib']:.0f} MiB against the process before "
        f"any model ({before:.0f} MiB) + 1.3 x the file ({1.3 * file_mib:.0f} MiB) + its KV "
        f"cache ({kv:.0f} MiB) = {bound:.0f} MiB"
    )
    for kernel, (before, after, peak, _) in memory.items():
        print(
            f"  loading the model alone, weight kernel {kernel}: RSS {before:.0f} MiB before "
            f"(the server's modules), +{after - before:.0f} MiB after (model and tokenizer), "
            f"peak +{peak - before:.0f} MiB"
        )
    print(
        f"\nreproduce: python -m benchmarks.k_quants --llama-bin {args.llama_bin}"
        + (f" --gguf {args.gguf}" if args.gguf else "")
        + f" --weight-kernel {args.weight_kernel}"
    )


if __name__ == "__main__":
    main()
