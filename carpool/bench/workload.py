"""What ``carpool bench`` sends: seeded prompts with their output lengths, as text so
that any OpenAI-compatible server takes them.

``random``: input and output lengths uniform within ``range_ratio`` of the asked
lengths (vLLM's meaning). ``sharegpt``: lengths shaped like ShareGPT conversations
(log-normal, ~230 words in and ~200 tokens out, long tails, clipped). ``prefix``:
groups of requests that share one long system-prompt-like prefix. ``jsonl``: one
JSON object a line with a ``prompt`` (and optionally ``max_tokens``). Words are
drawn from a list of short English words, about one token each; the server's usage
fields count the real tokens.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

# Short common English words, about one token each.
_WORD_TEXT = (
    "the of and to in is was for on are with as his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two "
    "like him see time could no make than first been its who now people my made over did "
    "down only way find use may water long little very after words called just where most "
    "know get through back much before go good new write our used me man too any day same "
    "right look think also around another came come work three word must because does "
    "part even place well such here take why things help put years different away again "
    "off went old number great tell men say"
)
WORDS = tuple(_WORD_TEXT.split())
DATASETS = ("random", "sharegpt", "prefix", "jsonl")


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt (text, or token ids where the server takes them, as
    /v1/completions does) and how many tokens to ask for."""

    prompt: str | list[int]
    max_tokens: int


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, count)))


def within(rng: random.Random, length: int, ratio: float) -> int:
    """A length uniform in ``[length * (1 - ratio), length * (1 + ratio)]``, at least 1."""
    low, high = int(length * (1 - ratio)), int(length * (1 + ratio))
    return max(1, rng.randint(low, max(low, high)))


def random_requests(
    count: int, input_len: int, output_len: int, ratio: float, rng: random.Random
) -> list[BenchRequest]:
    return [
        BenchRequest(words(rng, within(rng, input_len, ratio)), within(rng, output_len, ratio))
        for _ in range(count)
    ]


def sharegpt_requests(count: int, rng: random.Random, max_len: int = 2048) -> list[BenchRequest]:
    """Log-normal lengths with ShareGPT's medians (~230 in, ~200 out) and long tails."""

    def draw(median: float) -> int:
        return min(max_len, max(4, int(rng.lognormvariate(math.log(median), 0.9))))

    return [BenchRequest(words(rng, draw(230)), draw(200)) for _ in range(count)]


def prefix_requests(
    count: int,
    prefix_len: int,
    num_prefixes: int,
    suffix_len: int,
    output_len: int,
    rng: random.Random,
) -> list[BenchRequest]:
    """``count`` requests over ``num_prefixes`` shared prefixes (in turn), each with
    its own ``suffix_len``-word question."""
    prefixes = [words(rng, prefix_len) for _ in range(num_prefixes)]
    return [
        BenchRequest(f"{prefixes[i % num_prefixes]}\n\n{words(rng, suffix_len)}", output_len)
        for i in range(count)
    ]


def jsonl_requests(path: Path, count: int, output_len: int) -> list[BenchRequest]:
    """The first ``count`` lines of ``path`` (each {"prompt": ..., "max_tokens"?: n})."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line needs a string 'prompt'")
        out.append(BenchRequest(item["prompt"], int(item.get("max_tokens", output_len))))
        if len(out) == count:
            break
    return out
