"""Structured outputs under load, side by side in one run: 64 concurrent streams
without schemas, then the same 64 where every other one carries a JSON schema
(an array of at least 40 integers, so constrained streams run as long as free
ones), alternated ``--rounds`` times against one running server (this CPU drifts);
prints output tokens/s and ITL p99 per round and their medians, and the grammar
compile times of the test schemas (first and cached).

    carpool serve --port 8123 --model smollm2-135m-instruct &
    python -m benchmarks.structured --url http://127.0.0.1:8123 [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from benchmarks.stream_loadgen import run_streams
from benchmarks.workload import token_prompts
from carpool.bench.metrics import percentile

MODEL = "smollm2-135m-instruct"
VOCAB = 49152
STREAMS = 64
MAX_TOKENS = 64
SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 40,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": SCHEMA}}


def compile_times() -> list[tuple[str, float, float]]:
    """(schema, first compile s, cached s) for the unit tests' schemas."""
    from transformers import AutoTokenizer

    from carpool.config import default_cache_dir
    from carpool.engine.sampling_params import Grammar
    from carpool.engine.structured import Grammars
    from carpool.models.causal_lm import convert_gguf
    from carpool.models.registry import BUILTIN_MODELS
    from tests.unit.engine.test_structured import PERSON

    folder = convert_gguf(BUILTIN_MODELS[MODEL].locate(), default_cache_dir(), progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    grammars = Grammars(tokenizer, VOCAB, [tokenizer.eos_token_id])
    started = time.perf_counter()
    grammars.tokenizer()
    rows = [("(llguidance tokenizer, once per model)", time.perf_counter() - started, 0.0)]
    for name, schema in (("person", PERSON), ("numbers", SCHEMA)):
        grammar = Grammar("json_schema", json.dumps(schema))
        started = time.perf_counter()
        grammars.compile(grammar)
        first = time.perf_counter() - started
        started = time.perf_counter()
        grammars.compile(grammar)
        rows.append((name, first, time.perf_counter() - started))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8123")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"python -m benchmarks.structured --url {args.url} --rounds {args.rounds}")
    rates: dict[str, list[float]] = {"free": [], "half constrained": []}
    itls: dict[str, list[float]] = {"free": [], "half constrained": []}
    for r in range(args.rounds):
        for name in rates:
            prompts = token_prompts(STREAMS, 32, 64, VOCAB, seed=1000 * r + len(name))
            extras: list[dict[str, object] | None] = [
                {"response_format": FORMAT} if name != "free" and i % 2 else None
                for i in range(STREAMS)
            ]
            workload = [(p, MAX_TOKENS) for p in prompts]
            result = asyncio.run(run_streams(args.url, MODEL, workload, STREAMS, extras=extras))
            assert result.failed == 0, f"{result.failed} requests failed"
            rates[name].append(result.tokens_per_s)
            itls[name].append(percentile(result.itl_s, 99))
            print(
                f"round {r + 1} {name:<17} {result.tokens_per_s:7.1f} tok/s  "
                f"ITL p99 {itls[name][-1] * 1000:6.1f} ms  ({result.output_tokens} tokens)"
            )
    free, mixed = statistics.median(rates["free"]), statistics.median(rates["half constrained"])
    free_itl = statistics.median(itls["free"])
    mixed_itl = statistics.median(itls["half constrained"])
    print(f"median throughput: free {free:.1f}, half constrained {mixed:.1f} ({mixed / free:.2f}x)")
    print(
        f"median ITL p99: free {free_itl * 1000:.1f} ms, half constrained "
        f"{mixed_itl * 1000:.1f} ms ({mixed_itl / free_itl:.2f}x)"
    )
    for name, first, cached in compile_times():
        print(f"compile {name}: first {first * 1000:.1f} ms, cached {cached * 1000:.3f} ms")


if __name__ == "__main__":
    main()
