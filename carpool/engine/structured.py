"""Constrained decoding with llguidance: a request's grammar (a JSON schema, a regex,
a list of choices, or a Lark or GBNF grammar) masks, at each step, every token that would
break it.

llguidance rather than xgrammar: one wheel with no dependencies (xgrammar 0.2.8
requires torch, transformers, triton and apache-tvm-ffi), grammars compile in
milliseconds
(the test schemas here: 0.4-3.3 ms; the tokenizer once per model, ~0.5 s; see
BENCHMARKS.md), a JSON-schema keyword it cannot enforce is an error rather than
ignored (checked: ``uniqueItems``, ``not``, ``if``, ``contains``), and it fills many
rows' masks in one batched call on its own threads, without the GIL. vLLM, SGLang
and llama.cpp use it too.

A grammar is compiled once per model and cached (``Grammars``); each sequence gets a
copy of the compiled matcher to advance (``GrammarConstraint``). Compiling runs on
the server's pre-processing pool before a request is queued, so a request whose
grammar is still compiling holds up no one. Nothing here imports torch: the
sampler owns the bitmask tensor and hands its address to ``fill_bitmasks``.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance

from carpool.engine.sampling_params import Grammar
from carpool.errors import InvalidRequest

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON (no free whitespace): a small model given the choice pads with
# newlines until max_tokens; the output is still any valid JSON of the schema.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
CACHE_SIZE = 256


# Where a schema's subschemas sit (JSON Schema's applicators), for ``closed_objects``.
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains")


def closed_objects(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing of
    ``additionalProperties`` closed to them (``additionalProperties: false``), as
    xgrammar's strict mode reads a schema (vLLM's default): an open object lets a
    small model add keys until its tokens run out. An object that lists no
    properties (``{"type": "object"}``) stays open."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    elif (
        "properties" in out and "additionalProperties" not in out and "patternProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar for ``grammar``; raises ValueError on unreadable input.
    A JSON schema's objects are closed first (``closed_objects``)."""
    if grammar.kind == "json_schema":
        schema = json.loads(grammar.source)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return str(
            llguidance.LLMatcher.grammar_from_json_schema(
                closed_objects(schema), overrides=JSON_OPTIONS
            )
        )
    if grammar.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(grammar.source))
    if grammar.kind == "choice":
        choices = json.loads(grammar.source)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        lark = "start: " + " | ".join(json.dumps(c) for c in choices)
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    if grammar.kind == "structural_tag":
        return str(llguidance.LLMatcher.grammar_from_lark(_structural_tag_lark(grammar.source)))
    return str(llguidance.LLMatcher.grammar_from_lark(_as_lark(grammar.source)))


def _structural_tag_lark(source: str) -> str:
    """vLLM's structural tag (``structures`` of ``begin``, ``schema``, ``end``, and
    ``triggers``) as llguidance's own structural-tag grammar: text, and after each
    trigger the structure it begins. A trigger is text, never taken for a special
    token (as xgrammar reads it)."""
    tags = json.loads(source)
    struct_tags = []
    for i, structure in enumerate(tags["structures"]):
        begin = structure["begin"]
        trigger = next((t for t in tags["triggers"] if t and begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures[{i}].begin {begin!r} starts with none of the triggers")
        struct_tags.append(
            llguidance.StructTag(
                trigger=trigger, begin=begin, grammar=structure["schema"], end=structure["end"]
            )
        )
    return str(llguidance.StructTag.to_grammar(struct_tags, assume_special=False))


def _as_lark(text: str) -> str:
    """``text`` in Lark: a GBNF grammar (llama.cpp's and xgrammar's EBNF, ``root ::=
    ...``) is converted by llguidance's own converter."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return str(any_to_lark(text))
    except Exception as exc:  # the converter's errors are the grammar's: a 400
        raise ValueError(f"not a Lark or GBNF grammar: {exc}") from None


class GrammarConstraint:
    """One sequence's matcher (see ``carpool.engine.runner.Constraint``);
    ``vocab_size``: the width of its masks (the tokenizer's, at least the model's)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id))

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())


class Grammars:
    """One model's compiled grammars: its llguidance tokenizer (built on first use,
    about a second) and an LRU cache of compiled matchers by ``Grammar``. Safe to
    use from any thread."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[Grammar, llguidance.LLMatcher] = OrderedDict()

    def compile(self, grammar: Grammar, param: str = "response_format") -> llguidance.LLMatcher:
        """The compiled matcher of ``grammar`` (from the cache when there); raises
        ``InvalidRequest`` naming ``param`` with llguidance's reason."""
        with self._lock:
            if grammar in self._cache:
                self._cache.move_to_end(grammar)
                return self._cache[grammar]
        try:
            text = grammar_text(grammar)
        except ValueError as exc:
            raise InvalidRequest(f"{param}: {exc}", param=param) from None
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{param}: {matcher.get_error()}", param=param)
        with self._lock:
            self._cache[grammar] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def constraint(self, grammar: Grammar) -> GrammarConstraint:
        """A fresh state of ``grammar`` for one sequence."""
        return GrammarConstraint(self.compile(grammar).deep_copy(), self.mask_width)

    @property
    def mask_width(self) -> int:
        """Tokens a mask covers: the model's vocabulary, or the tokenizer's where it
        is larger (a model may have fewer rows than its tokenizer has tokens)."""
        return max(self._vocab_size, len(self._hf_tokenizer))

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                from llguidance.hf import from_tokenizer

                self._tokenizer = from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.mask_width, eos_token=self._eos
                )
            return self._tokenizer


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def fill_bitmasks(
    constraints: Sequence[GrammarConstraint], address: int, words: int, vocab_size: int
) -> None:
    """Write each constraint's allowed tokens as a row of 32-bit words (bit ``t % 32``
    of word ``t // 32`` set: token ``t`` allowed) at ``address``, row ``i`` for
    ``constraints[i]``, in one batched call. The caller owns ``len(constraints) *
    words`` contiguous int32 there; ``words`` must cover the vocabulary."""
    if words != (vocab_size + 31) // 32:
        raise ValueError(f"{words} words per row do not cover a vocabulary of {vocab_size}")
    if not constraints:
        return
    matchers = [(c.matcher, i) for i, c in enumerate(constraints)]
    _executor().unsafe_compute_mask_ptr(matchers, address, words * 4, len(constraints))
