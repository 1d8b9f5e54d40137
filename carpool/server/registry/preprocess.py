"""Request text to token ids: off the event loop, and within a cheap bound first.

Tokenizing is the one step of a request whose cost grows with what the client
sends: a multi-megabyte prompt took seconds and gigabytes, on the event loop. So
every tokenizer call runs on a small thread pool (the tokenizers used release the
GIL while they work), and a text far longer than the limit it must fit is judged
by a window of it before the whole is tokenized:

- A text of at most ``(limit + MARGIN) * WINDOW_CHARS_PER_TOKEN`` characters is
  tokenized whole.
- A longer one is first tokenized in that many characters at the end that counts
  (its head, or its tail when the caller keeps the last tokens). If the window
  alone has more than ``limit + MARGIN`` tokens, the whole text has more than
  ``limit``: its tokens before the cut are the whole text's, give or take the one
  word the cut splits (``MARGIN`` covers that word). Then a text that must fit
  whole is refused without tokenizing the rest, and a text to be truncated gets
  the window's tokens, whose kept end is the whole text's.
- Otherwise (text sparse in tokens: long runs of spaces, say) the whole text is
  tokenized after all, unless the caller knows the most characters one token can
  cover (``token_chars``: twice the longest entry of the vocabulary, for a normalizer
  that folds characters). Then a text longer than ``limit * token_chars`` cannot fit:
  it is refused unread when it must fit whole, and, kept by an end, it is tokenized
  in a window of ``(limit + MARGIN) * token_chars`` characters, which holds the kept
  tokens and more. Without this bound, megabytes of spaces cost seconds of a
  tokenizer thread per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

MARGIN = 64
WINDOW_CHARS_PER_TOKEN = 16

Keep = Literal["all", "head", "tail"]
EncodeBatch = Callable[[list[str]], list[list[int]]]


class TooManyTokens(Exception):
    """Text ``index`` has more than ``limit`` tokens (at least ``at_least``)."""

    def __init__(self, index: int, limit: int, at_least: int) -> None:
        super().__init__(f"text {index} has at least {at_least} tokens, over {limit}")
        self.index = index
        self.limit = limit
        self.at_least = at_least


def window_chars(limit: int) -> int:
    return (limit + MARGIN) * WINDOW_CHARS_PER_TOKEN


def token_chars(tokenizer: Any) -> int:
    """The most characters of text one of ``tokenizer``'s tokens stands for, bounded
    from above: twice its longest vocabulary entry (a byte-level entry is at least
    as long as the text it stands for; the factor covers normalizers that fold two
    characters into one). It copies the whole vocabulary: a served model computes it
    once, while it loads (``ServedGenerator.token_chars``)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 2 * max(1, longest)


def encode_within(
    encode_batch: EncodeBatch,
    texts: list[str],
    limit: int,
    keep: Keep,
    token_chars: int | None = None,
) -> list[list[int]]:
    """Token ids of each text, as described in the module docstring.

    ``keep``: "all" when a text must fit ``limit`` whole (raises ``TooManyTokens``
    for the first that certainly does not); "head" or "tail" when the caller keeps
    that end's ``limit`` tokens (a long text's ids may then be a window's). The
    caller still checks the exact count of what is returned. ``token_chars``: the
    most characters a token covers (``token_chars()``), if known."""
    if token_chars is not None:
        texts = _within_reach(texts, limit, keep, token_chars)
    size = window_chars(limit)
    windows = [_window(t, size, keep) for t in texts]
    ids = encode_batch(windows)
    whole: list[int] = []
    for i, (text, piece, got) in enumerate(zip(texts, windows, ids, strict=True)):
        if len(piece) == len(text):
            continue
        if len(got) > limit + MARGIN:
            if keep == "all":
                raise TooManyTokens(i, limit, len(got) - MARGIN)
            continue
        whole.append(i)
    if whole:
        for i, got in zip(whole, encode_batch([texts[i] for i in whole]), strict=True):
            ids[i] = got
    return ids


def _within_reach(texts: list[str], limit: int, keep: Keep, token_chars: int) -> list[str]:
    """Each text, cut to the characters its kept tokens can come from; raises
    ``TooManyTokens`` for the first that must fit whole and cannot."""
    most = limit * token_chars
    for i, text in enumerate(texts):
        if keep == "all" and len(text) > most:
            raise TooManyTokens(i, limit, len(text) // token_chars)
    return [_window(t, (limit + MARGIN) * token_chars, keep) for t in texts]


def _window(text: str, size: int, keep: Keep) -> str:
    if len(text) <= size:
        return text
    return text[-size:] if keep == "tail" else text[:size]


class Preprocessor:
    """The thread pool that request pre-processing (templates, tokenizers) runs on."""

    def __init__(self, threads: int = 2) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="carpool-preprocess")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the pool; the event loop goes on meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
