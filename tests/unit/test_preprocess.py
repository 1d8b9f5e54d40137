"""Bounded tokenization: a text far over its limit is judged by a window of it, and
what is kept of a truncated text is what the whole text's tokens would give."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from carpool.server.registry.preprocess import (
    MARGIN,
    TooManyTokens,
    encode_within,
    token_chars,
    window_chars,
)


class WordEncoder:
    """One token per word (a stand-in tokenizer); records the text it was given."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, texts: list[str]) -> list[list[int]]:
        self.seen.extend(len(t) for t in texts)
        return [[len(w) for w in t.split()] for t in texts]


def test_short_texts_are_tokenized_whole() -> None:
    enc = WordEncoder()
    assert encode_within(enc, ["a bb ccc", ""], limit=2, keep="all") == [[1, 2, 3], []]


def test_a_dense_text_far_over_the_limit_is_refused_from_its_window() -> None:
    enc = WordEncoder()
    text = "w " * 1_000_000
    with pytest.raises(TooManyTokens) as info:
        encode_within(enc, ["ok", text], limit=100, keep="all")
    assert info.value.index == 1 and info.value.at_least > 100
    assert max(enc.seen) == window_chars(100) < len(text)


def test_a_sparse_long_text_is_tokenized_whole_after_all() -> None:
    enc = WordEncoder()
    text = "word" + " " * 100_000 + "end"
    assert encode_within(enc, [text], limit=100, keep="all") == [[4, 3]]
    assert enc.seen[-1] == len(text)


@pytest.mark.parametrize("keep", ["head", "tail"])
def test_truncating_keeps_the_whole_texts_end(keep: str, smollm_folder: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm_folder))

    def encode(texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in tokenizer(texts)["input_ids"]]

    text = " ".join(f"word{i} and, punctuation!" for i in range(20_000))
    whole = encode([text])[0]
    limit = 50
    got = encode_within(encode, [text], limit=limit, keep=keep)[0]  # type: ignore[arg-type]
    assert limit + MARGIN < len(got) < len(whole)
    if keep == "head":
        assert got[:limit] == whole[:limit]
    else:
        assert got[-limit:] == whole[-limit:]


def test_a_sparse_text_past_what_its_tokens_can_cover_is_refused_unread() -> None:
    enc = WordEncoder()
    text = "word" + " " * 100_000 + "end"
    with pytest.raises(TooManyTokens) as info:
        encode_within(enc, [text], limit=100, keep="all", token_chars=20)
    assert info.value.index == 0
    assert enc.seen == []  # refused by its length alone, nothing tokenized


@pytest.mark.parametrize("keep", ["head", "tail"])
def test_a_sparse_text_kept_by_an_end_is_tokenized_in_reach_of_it(keep: str) -> None:
    enc = WordEncoder()
    text = "first" + " " * 100_000 + "last"
    got = encode_within(enc, [text], limit=100, keep=keep, token_chars=20)[0]
    assert got == ([5] if keep == "head" else [4])
    assert max(enc.seen) == (100 + MARGIN) * 20 < len(text)


def test_token_chars_bounds_every_token_of_a_real_tokenizer(smollm_folder: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm_folder))
    bound = token_chars(tokenizer)
    text = " " * 5000 + "".join(f"word{i}, " for i in range(500)) + "\u00e9t\u00e9 " * 200
    ids = tokenizer(text)["input_ids"]
    assert len(text) <= len(ids) * bound
    assert token_chars(tokenizer) == bound
