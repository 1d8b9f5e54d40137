"""Prefix-affinity routing, the policy alone (no Ray): which replica most likely holds
a prompt's prefix in its KV cache, and whether it is too busy to take it.

A prompt's text is cut into fixed-size chunks; chunk ``i`` is named by a hash chained
over chunks ``0..i`` (as the KV cache names its full blocks), so two prompts share the
first ``k`` names exactly when they share their first ``k`` chunks. The table remembers,
for each name, the replica that last took a prompt with that prefix. A prompt goes to
the owner of its longest remembered prefix, unless that replica has more than
``max_imbalance`` requests in flight above the least busy one; a prompt nobody holds goes
to the least busy replica, and among equals to the one that owns the fewest prefixes,
so that different prefixes spread over the replicas (Ray Serve LLM's
PrefixCacheAffinityRouter is the model: its prefix tree, its smallest-tenant fallback
and its imbalance threshold).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import orjson

CHUNK_CHARS = 128
"""Characters per prefix chunk: about a 16-token KV block of English text."""

MAX_CHUNKS = 64
"""Chunks of a prompt that are named; a longer common prefix says nothing more about
where to go."""


def prefix_chain(
    text: str, chunk_chars: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS
) -> list[bytes]:
    """The chained names of ``text``'s whole chunks (a shorter tail is left out: a
    prompt shorter than one chunk has no name and routes by load alone)."""
    names: list[bytes] = []
    previous = b""
    usable = min(len(text) // chunk_chars, max_chunks)
    for i in range(usable):
        chunk = text[i * chunk_chars : (i + 1) * chunk_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + chunk, digest_size=12).digest()
        names.append(previous)
    return names


@dataclass(frozen=True)
class Choice:
    """Where a request goes: ``ranked`` is best first; ``matched_chunks`` says how much
    of its prefix the first replica was remembered to hold."""

    ranked: tuple[str, ...]
    matched_chunks: int


class AffinityTable:
    """Prefix name -> replica, least recently used names forgotten past ``capacity``.

    One owner: the router that holds it (Ray Serve calls a router from one event loop).
    """

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._owned: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._owner)

    def owned(self, replica: str) -> int:
        """How many prefix names ``replica`` holds."""
        return self._owned[replica]

    def longest_match(
        self, chain: Sequence[bytes], live: Mapping[str, int]
    ) -> tuple[str | None, int]:
        """The live replica holding the longest prefix of ``chain`` and that prefix's
        length in chunks; ``(None, 0)`` when no live replica holds its first chunk."""
        best: str | None = None
        matched = 0
        for i, name in enumerate(chain):
            owner = self._owner.get(name)
            if owner is None or owner not in live:
                break
            best, matched = owner, i + 1
        return best, matched

    def record(self, chain: Sequence[bytes], replica: str) -> None:
        """``replica`` now holds every prefix in ``chain``."""
        for name in chain:
            previous = self._owner.pop(name, None)
            if previous is not None:
                self._owned[previous] -= 1
            self._owner[name] = replica
            self._owned[replica] += 1
        while len(self._owner) > self.capacity:
            _, evicted = self._owner.popitem(last=False)
            self._owned[evicted] -= 1

    def forget(self, replica: str) -> None:
        """``replica`` is gone: drop what it held."""
        if not self._owned.pop(replica, 0):
            return
        for name in [n for n, owner in self._owner.items() if owner == replica]:
            del self._owner[name]


def choose(
    table: AffinityTable,
    chain: Sequence[bytes],
    in_flight: Mapping[str, int],
    max_imbalance: int,
    rng: random.Random,
) -> Choice:
    """Rank the replicas of ``in_flight`` (replica -> requests in flight there) for a
    prompt whose prefix names are ``chain``; ``rng`` breaks ties between equals."""
    if not in_flight:
        return Choice((), 0)
    least = min(in_flight.values())
    by_load = sorted(in_flight, key=lambda r: (in_flight[r], table.owned(r), rng.random()))
    owner, matched = table.longest_match(chain, in_flight)
    if owner is not None and in_flight[owner] - least <= max_imbalance:
        return Choice((owner, *(r for r in by_load if r != owner)), matched)
    return Choice(tuple(by_load), 0)


_PROMPTED_PATHS = ("/v1/chat/completions", "/v1/completions")


def routing_text(path: str, body: bytes, limit: int = CHUNK_CHARS * MAX_CHUNKS) -> str:
    """The start of the prompt a /v1 generation request carries (its messages' text in
    order, or its prompt string), at most ``limit`` characters; empty for any other
    request or any body that is not what it should be (the replica validates it).
    OpenAI's ``prompt_cache_key``, where given, is the first chunk: requests that share
    it share a replica (the client's own hint of a shared prefix)."""
    if path not in _PROMPTED_PATHS:
        return ""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    if not isinstance(data, dict):
        return ""
    parts: list[str] = []
    key = data.get("prompt_cache_key")
    if isinstance(key, str) and key:
        parts.append(key[: CHUNK_CHARS - 1].ljust(CHUNK_CHARS, "\0"))  # one whole chunk
    size = sum(len(p) for p in parts)
    for text in _texts(data.get("messages"), data.get("prompt")):
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(parts)[:limit]


def _texts(messages: object, prompt: object) -> Iterator[str]:
    if isinstance(prompt, str):
        yield prompt
    if not isinstance(messages, list):
        return
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


def power_of_two(replicas: Iterable[str], rng: random.Random) -> tuple[str, ...]:
    """Ray Serve's default policy, for comparison: two replicas at random (the caller
    takes the one with the shorter queue)."""
    names = sorted(replicas)
    return tuple(rng.sample(names, min(2, len(names))))
