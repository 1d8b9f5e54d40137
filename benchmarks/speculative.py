"""Prompt-lookup speculative decoding, one stream at a time, side by side in one
run: each request of a repetitive workload (copy a text, fill a JSON record from a
given one, edit a code file) and of a non-repetitive one (open questions), with
and without ``--speculative-config``, interleaved request by request so drift hits
both alike. Greedy (the outputs must be the same tokens; checked), the built-in
model, offline engine.

    python -m benchmarks.speculative [--rounds 2] [--max-tokens 160]
                                     [--weight-kernel native-int8] [--step-times]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from carpool import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"
SPECULATE = {"method": "ngram", "num_speculative_tokens": 5}
ARTICLE = (
    "Carpooling is the sharing of car journeys so that more than one person travels in a "
    "car, and prevents the need for others to have to drive to a location themselves. By "
    "having more people using one vehicle, carpooling reduces each person's travel costs "
    "such as fuel costs, tolls, and the stress of driving. Carpooling is also seen as a "
    "more environmentally friendly and sustainable way to travel as sharing journeys "
    "reduces air pollution, carbon emissions, traffic congestion on the roads, and the "
    "need for parking spaces."
)
CODE = """def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total = total + (value - m) ** 2
    return total / len(values)
"""
RECORD = (
    '{"id": 4411, "name": "Ada Lovelace", "email": "ada@example.org", '
    '"city": "London", "country": "United Kingdom", "born": 1815, '
    '"languages": ["English", "French"], "role": "analyst"}'
)
REPETITIVE = [
    f"Repeat the following text word for word.\n\n{ARTICLE}",
    f"Rewrite this text, keeping every sentence, in the same words:\n\n{ARTICLE}",
    f"Here is a Python file:\n\n{CODE}\nRewrite the file with `total = total + x` written "
    "as `total += x`, changing nothing else.",
    f"Copy this JSON record, changing the city to Paris and the country to France:\n\n{RECORD}",
]
OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold.",
    "What are three good habits for learning a new language?",
    "Describe a busy market in a small town on a Saturday morning.",
]


def chat(llm: LLM, prompt: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = llm.tokenizer.encode(text, add_special_tokens=False)
    return ids


def timed(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    started = time.perf_counter()
    [out] = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0].token_ids, time.perf_counter() - started


def measure(
    prompts: list[str], plain: LLM, spec: LLM, params: SamplingParams, rounds: int
) -> list[tuple[int, float, int, float]]:
    """Per request: tokens and median seconds without, then with speculation; the
    outputs must be the same tokens (asserted, native-int8 included: a verified row
    gets its decode's bits)."""
    rows = []
    for text in prompts:
        prompt = chat(plain, text)
        seconds: dict[str, list[float]] = {"plain": [], "spec": []}
        tokens: dict[str, list[int]] = {}
        for _ in range(rounds):
            for name, llm in (("plain", plain), ("spec", spec)):
                tokens[name], s = timed(llm, prompt, params)
                seconds[name].append(s)
        assert tokens["plain"] == tokens["spec"], f"speculation changed the output of {text!r}"
        median = {n: statistics.median(s) for n, s in seconds.items()}
        rows.append((len(tokens["plain"]), median["plain"], len(tokens["spec"]), median["spec"]))
    return rows


def report(name: str, rows: list[tuple[int, float, int, float]]) -> None:
    tokens, plain = sum(r[0] for r in rows), sum(r[1] for r in rows)
    spec_tokens, spec = sum(r[2] for r in rows), sum(r[3] for r in rows)
    print(f"\n## {name}")
    print(f"{'request':>8} {'tokens':>7} {'plain tok/s':>12} {'spec tok/s':>11} {'speed-up':>9}")
    for i, (n, p, m, s) in enumerate(rows):
        print(f"{i:>8} {n:>7} {n / p:>12.1f} {m / s:>11.1f} {(m / s) / (n / p):>8.2f}x")
    ratio = (spec_tokens / spec) / (tokens / plain)
    print(
        f"{'all':>8} {tokens:>7} {tokens / plain:>12.1f} {spec_tokens / spec:>11.1f} {ratio:>8.2f}x"
    )


def step_times(prompt: str, plain: LLM, spec: LLM, params: SamplingParams) -> None:
    """Where one request's time goes, with and without speculation: its first step
    (the prefill and first token) and the mean of the steps after it, each
    ``engine.step`` timed (the second of two runs, the first warming up)."""
    print(f"\n## steps of one request: {prompt[:40]!r}...")
    for name, llm in (("plain", plain), ("spec", spec)):
        engine, ids = llm.engine, chat(llm, prompt)
        for attempt in range(2):
            engine.add_request(f"steps-{attempt}", ids, params)
            times = []
            while engine.has_work:
                started = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - started)
        rest = times[1:]
        print(
            f"{name:>6}: {sum(times) * 1e3:6.0f} ms in {len(times)} steps; first "
            f"{times[0] * 1e3:.0f} ms, then {statistics.mean(rest) * 1e3:.2f} ms a step"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--weight-kernel", default="auto")
    parser.add_argument(
        "--step-times", action="store_true", help="also time the steps of the first request"
    )
    args = parser.parse_args()
    print(
        f"command: python -m benchmarks.speculative --rounds {args.rounds} "
        f"--max-tokens {args.max_tokens} --weight-kernel {args.weight_kernel}"
        + (" --step-times" if args.step_times else "")
    )
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, speculative_config {json.dumps(SPECULATE)}"
    )
    # No prefix cache: every run prefills its prompt, as the first one does.
    common = {"enable_prefix_caching": False, "weight_kernel": args.weight_kernel}
    plain = LLM(MODEL, **common)
    spec = LLM(MODEL, speculative_config=json.dumps(SPECULATE), **common)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    if args.step_times:
        step_times(REPETITIVE[0], plain, spec, params)
    report(
        "repetitive (copy, rewrite, edit code, fill JSON)",
        measure(REPETITIVE, plain, spec, params, args.rounds),
    )
    report(
        "non-repetitive (open questions)",
        measure(OPEN, plain, spec, params, args.rounds),
    )
    stats = spec.engine.stats.snapshot()
    rate = stats.spec_accepted_tokens / max(1, stats.spec_draft_tokens)
    print(
        f"\ndrafts {stats.spec_drafts}, draft tokens {stats.spec_draft_tokens}, "
        f"accepted {stats.spec_accepted_tokens} ({rate:.0%})"
    )


if __name__ == "__main__":
    main()
