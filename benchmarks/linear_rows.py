"""What a step of r rows costs in the built-in model's linear layers, per weight
kernel, side by side in one run: every linear layer of the model (30 layers of each
projection and the LM head) run on r random rows, per row count. This is the part of
a speculative verification (r = 1 + the draft) that grows with r; a one-row step is
r = 1.

    python -m benchmarks.linear_rows [--rows 1 2 4 6 8 16 64] [--repeats 15]
                                     [--weight-kernels native native-int8]

Each kind of layer is timed on its own, its 30 matrices back to back, and the
quartile of ``--repeats`` runs is kept; a layer's weights may then be partly in the
last-level cache (the LM head's 28 MB most of all), so a whole step reads more from
memory than the sum here.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from carpool import LLM
from carpool.models.packed_linear import Linear

MODEL = "smollm2-135m-instruct"


def layers_by_kind(llm: LLM) -> dict[str, list[Linear]]:
    """The model's linear layers that run on the file's blocks, by projection name."""
    model = llm.engine.runner.lm.model
    kinds: dict[str, list[Linear]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.packed is not None:
            kinds.setdefault(name.split(".")[-1], []).append(module)
    return kinds


def time_rows(layers: list[Linear], rows: int, repeats: int) -> float:
    """Seconds to run every layer of ``layers`` once on ``rows`` rows (quartile)."""
    kernel = layers[0].kernel
    assert kernel is not None
    x = torch.randn(rows, layers[0].in_features)
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for layer in layers:
            assert layer.packed is not None
            kernel(x, layer.packed, layer.interleaved)
        runs.append(time.perf_counter() - started)
    return sorted(runs)[len(runs) // 4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--weight-kernels", nargs="+", default=["native", "native-int8"])
    args = parser.parse_args()
    print(
        "command: python -m benchmarks.linear_rows --rows "
        + " ".join(map(str, args.rows))
        + f" --repeats {args.repeats} --weight-kernels "
        + " ".join(args.weight_kernels)
    )
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    table: dict[str, dict[int, float]] = {}
    for choice in args.weight_kernels:
        kinds = layers_by_kind(LLM(MODEL, weight_kernel=choice))
        table[choice] = {}
        for rows in args.rows:
            per_kind = {k: time_rows(layers, rows, args.repeats) for k, layers in kinds.items()}
            table[choice][rows] = sum(per_kind.values())
            detail = ", ".join(f"{k} {s * 1e3:.2f}" for k, s in per_kind.items())
            print(f"{choice:>12} rows {rows:>3}: {sum(per_kind.values()) * 1e3:7.2f} ms ({detail})")
    print(f"\n{'rows':>5} " + " ".join(f"{c + ' ms':>16} {'x 1 row':>8}" for c in table))
    for rows in args.rows:
        first = args.rows[0]
        cells = [f"{t[rows] * 1e3:>16.2f} {t[rows] / t[first]:>8.2f}" for t in table.values()]
        print(f"{rows:>5} " + " ".join(cells))


if __name__ == "__main__":
    main()
