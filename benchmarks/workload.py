"""Seeded workloads shared by the benchmarks."""

from __future__ import annotations

import random

WORDS = (  # noqa: SIM905 (a word list reads better as a string)
    "the of and to in is was for on that with as by at from his her it an be are this which "
    "or had not but what all were when we there can more if no out so said time about would "
    "people into year some them see other than then now look only come its over think also "
    "back after use two how our work first well way even new want because any these give day "
    "most us model server batch request ride share queue token latency device engine share "
    "sentence vector embedding cluster network memory quickly slowly carefully together"
).split()


def sentences(count: int = 2000, seed: int = 0) -> list[str]:
    """``count`` sentences of 5 to 120 words, short ones most common (exponential, mean 20)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = min(120, 5 + int(rng.expovariate(1 / 15)))
        words = [rng.choice(WORDS) for _ in range(n)]
        out.append(" ".join(words).capitalize() + ".")
    return out


def token_prompts(
    count: int, min_len: int, max_len: int, vocab: int, seed: int = 0
) -> list[list[int]]:
    """``count`` prompts of random token ids (uniform lengths in [min_len, max_len])."""
    rng = random.Random(seed)
    low = 100  # skip the special tokens at the start of the vocabulary
    return [
        [rng.randrange(low, vocab) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(count)
    ]


def generation_workload(name: str, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) per request: ``uniform`` is 64 requests of 32-256 prompt
    tokens and exactly 128 new tokens; ``mixed`` is 64 of 16-1024 and 16-256; ``nano`` is
    nano-vllm's benchmark, 256 of 100-1024 and 100-1024."""
    rng = random.Random(seed + 1)
    if name == "nano":
        return [(p, rng.randint(100, 1024)) for p in token_prompts(256, 100, 1024, vocab, seed)]
    if name == "uniform":
        return [(p, 128) for p in token_prompts(64, 32, 256, vocab, seed)]
    if name == "mixed":
        return [(p, rng.randint(16, 256)) for p in token_prompts(64, 16, 1024, vocab, seed)]
    raise ValueError(name)
