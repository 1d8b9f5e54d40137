"""Incremental detokenization with stop strings.

Text comes out in pieces that never split a UTF-8 character: a token's text is
released only once decoding the recent tokens no longer ends in U+FFFD (after
TGI's prefix/read offsets, which also keep a word's leading space right).

Stop strings never leak: text that could be the beginning of a stop string is
held back until it either completes one (then everything from the stop string on
is dropped and the sequence stops) or stops being a possible beginning (then it
is released). So a stop string can span any number of tokens.

Where the tokenizer is a Rust ``tokenizers.Tokenizer`` and the prompt's last tokens
decode to whole characters, its ``DecodeStream`` does the same offsets in one call
per token (two Python-level decodes and slices otherwise: ~4.6 against ~1.2 us a
token, issue 48). A prompt that ends inside a character keeps the Python offsets,
whose text for the token that completes it differs from the stream's; a stream that
refuses a token hands over to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens kept as decoding context, so the first generated token's leading
# space and merges decode as they would in the full text.
CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def _fastest(tokenizer: Decoder) -> Decoder:
    """The Rust tokenizer behind a transformers fast tokenizer, where decoding with it
    gives the same text (no clean-up of spaces): transformers' own ``decode`` adds
    ~10 us a call in Python, twice per generated token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer
    return backend


def _stream(decoder: Decoder, context: list[int], skip: bool) -> DecodeStream | None:
    """A ``DecodeStream`` primed with ``context`` (less any leading tokens that begin
    inside a character), where ``decoder`` is a Rust tokenizer and ``context`` ends
    on a whole character; else None."""
    if not isinstance(decoder, Tokenizer):
        return None
    text = decoder.decode(context, skip_special_tokens=skip)
    if text.endswith("\ufffd"):
        return None
    while context and text.startswith("\ufffd"):
        context = context[1:]
        text = decoder.decode(context, skip_special_tokens=skip)
    return DecodeStream(ids=context, skip_special_tokens=skip)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = _fastest(tokenizer)
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stream = _stream(self._tokenizer, self._ids, skip_special_tokens)
        self._stop = tuple(stop)
        self._held = ""
        self.text = ""
        self.stopped_on: str | None = None

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it makes safe to show (maybe "")."""
        if self.stopped_on is not None:
            return ""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                # A stream exists only for a Rust tokenizer (``_stream``).
                piece = self._stream.step(cast(Tokenizer, self._tokenizer), token_id)
            except Exception:
                # tokenizers refuses a text that no longer starts with what it showed
                # ("invalid prefix": vLLM meets it on bytes that are no UTF-8): the
                # offsets go on from the last token shown.
                self._stream = None
                self._prefix_offset = max(0, self._read_offset - CONTEXT_TOKENS)
            else:
                if not piece:
                    return ""
                self._read_offset = len(self._ids)
                return self._release(piece)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._release(full[len(prefix) :])

    def flush(self) -> str:
        """The text held back for a possible stop string, at the end of generation."""
        if self.stopped_on is not None:
            return ""
        out, self._held = self._held, ""
        self.text += out
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _release(self, new_text: str) -> str:
        if not self._stop:
            self.text += new_text
            return new_text
        pending = self._held + new_text
        hit = min(((pending.find(s), s) for s in self._stop if s in pending), default=None)
        if hit is not None:
            index, stop = hit
            self.stopped_on = stop
            self._held = ""
            out = pending[:index]
        else:
            keep = self._longest_stop_prefix_suffix(pending)
            out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
