"""Incremental detokenization with the built-in model's real tokenizer: pieces never
split a character, join to the full decode, and stop strings never leak."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from carpool.engine.detokenizer import IncrementalDetokenizer
from carpool.models.registry import BUILTIN_MODELS


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    path = BUILTIN_MODELS["smollm2-135m-instruct"].locate()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def rust_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer as the engine's converted folder has it: no clean-up of spaces, so
    decoding goes to the Rust tokenizer."""
    rust = copy.deepcopy(tokenizer)
    rust.clean_up_tokenization_spaces = False
    return rust


def stream(
    tokenizer: Any, text: str, stop: tuple[str, ...] = ()
) -> tuple[list[str], IncrementalDetokenizer]:
    prompt = tokenizer.encode("Say something:")
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    pieces = [detok.push(t) for t in tokenizer.encode(text)]
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        " leading space and  double  spaces",
        "Héllo 🚗 wörld 汉字 — done.",
        "line one\nline two\n\ttab",
        "🚗🚕🚙",
    ],
)
def test_pieces_join_to_the_full_decode_and_never_split_a_character(
    tokenizer: Any, text: str
) -> None:
    pieces, detok = stream(tokenizer, text)
    assert "".join(pieces) == tokenizer.decode(tokenizer.encode(text)) == detok.text
    assert not any("\ufffd" in p for p in pieces)


def test_a_stop_string_across_tokens_ends_the_text_and_never_leaks(tokenizer: Any) -> None:
    pieces, detok = stream(
        tokenizer, "The answer is 42. END OF ANSWER and more text", stop=("END OF ANSWER",)
    )
    assert detok.stopped_on == "END OF ANSWER"
    assert "".join(pieces) == detok.text == "The answer is 42. "
    assert not any("END" in p for p in pieces)


def test_text_that_only_began_like_a_stop_string_is_released(tokenizer: Any) -> None:
    pieces, detok = stream(tokenizer, "We stopped. Then we stop here.", stop=("stop here",))
    assert detok.text == "We stopped. Then we "
    assert "stopped" in "".join(pieces[:-1]), (
        "released before the end, once it could no longer match"
    )


def test_the_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    _, detok = stream(tokenizer, "alpha beta gamma", stop=("gamma", "beta"))
    assert detok.stopped_on == "beta" and detok.text == "alpha "


def test_without_a_match_the_held_text_comes_out_at_the_end(tokenizer: Any) -> None:
    pieces, detok = stream(tokenizer, "ends with sto", stop=("stop",))
    assert detok.stopped_on is None
    assert pieces[-1].endswith("sto") and detok.text == "ends with sto"


class _PythonDecoder:
    """The same tokenizer seen as a plain ``Decoder`` (no Rust ``DecodeStream``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend = tokenizer.backend_tokenizer

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_stream_gives_the_python_offsets_pieces(rust_tokenizer: Any, skip: bool) -> None:
    tokenizer = rust_tokenizer
    rng = random.Random(7)
    for prompt_text in ["Say something:", "naïve café — 日本語", "<|im_start|>user\nhi"]:
        prompt = tokenizer.encode(prompt_text)
        for _ in range(40):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 20))]
            fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
            slow = IncrementalDetokenizer(
                _PythonDecoder(tokenizer), prompt, skip_special_tokens=skip
            )
            assert fast._stream is not None and slow._stream is None
            assert [fast.push(t) for t in ids] == [slow.push(t) for t in ids]


def test_a_prompt_ending_inside_a_character_keeps_the_python_offsets(
    rust_tokenizer: Any,
) -> None:
    tokenizer = rust_tokenizer
    ids = tokenizer.encode("日本語のテキスト")
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, ids[:cut])
    assert detok._stream is None
    pieces = [detok.push(t) for t in ids[cut:]]
    assert not any("\ufffd" in p for p in pieces)


class _RefusingStream:
    """A ``DecodeStream`` that raises from its ``after``-th token on, as tokenizers'
    own does on an "invalid prefix"."""

    def __init__(self, stream: Any, after: int) -> None:
        self._stream, self._left = stream, after

    def step(self, tokenizer: Any, token_id: int) -> str | None:
        self._left -= 1
        if self._left < 0:
            raise RuntimeError("Invalid prefix encountered while decoding stream")
        piece: str | None = self._stream.step(tokenizer, token_id)
        return piece


@pytest.mark.parametrize("after", [0, 1, 3, 7])
def test_a_stream_that_refuses_a_token_hands_over_to_the_offsets(
    rust_tokenizer: Any, after: int
) -> None:
    prompt = rust_tokenizer.encode("Say something:")
    ids = rust_tokenizer.encode("Héllo 🚗 wörld 汉字 — done. 🚕🚙 and the rest")
    detok = IncrementalDetokenizer(rust_tokenizer, prompt)
    detok._stream = _RefusingStream(detok._stream, after)
    pieces = [detok.push(t) for t in ids]
    pieces.append(detok.flush())
    assert detok._stream is None  # it went over
    assert "".join(pieces) == rust_tokenizer.decode(ids) == detok.text
    assert not any("\ufffd" in p for p in pieces)
