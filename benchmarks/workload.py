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
