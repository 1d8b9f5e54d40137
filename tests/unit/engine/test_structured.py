"""Constrained decoding on the built-in model: outputs match their grammar (JSON
schema, regex, choice, Lark), rows without a grammar batched beside them keep their
greedy output, ``logit_bias`` bans and forces tokens, and a grammar that cannot be
enforced is refused naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from carpool.config import EngineConfig
from carpool.engine.engine import Engine
from carpool.engine.sampling_params import Grammar, SamplingParams
from carpool.engine.structured import closed_objects, fill_bitmasks
from carpool.errors import InvalidRequest
from carpool.models.causal_lm import LoadedLM
from carpool.workers.factory import engine_for

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Rome"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}


def chat_ids(lm: LoadedLM, text: str) -> list[int]:
    rendered = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = lm.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return ids


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, Any] = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.fixture
def engine(smollm: LoadedLM) -> Engine:
    return engine_for(smollm, EngineConfig(kv_cache_memory="64MiB"))


def test_outputs_match_their_grammar_and_free_neighbours_are_unchanged(
    smollm: LoadedLM, engine: Engine
) -> None:
    ask = chat_ids(smollm, "Describe a person.")
    free = {f"free{i}": (chat_ids(smollm, f"Count to {i + 3}."), greedy(12)) for i in range(2)}
    alone = run(engine_for(smollm, EngineConfig(kv_cache_memory="64MiB")), free)
    constrained = {
        "json": (ask, greedy(80, grammar=Grammar("json_schema", json.dumps(PERSON)))),
        "regex": (ask, greedy(12, grammar=Grammar("regex", r"[0-9]{3}-[a-z]{2}"))),
        "choice": (ask, greedy(8, grammar=Grammar("choice", json.dumps(["yes", "no"])))),
        "lark": (ask, greedy(12, grammar=Grammar("lark", 'start: "ab" ("c" | "d")+ "!"'))),
        "gbnf": (ask, greedy(8, grammar=Grammar("lark", 'root ::= "x" [0-9] [0-9]'))),
    }
    together = run(engine, {**constrained, **free})
    person = json.loads(together["json"].text)
    assert (
        set(person) == {"name", "age", "city", "tags"}
        and person["city"] in PERSON["properties"]["city"]["enum"]
    )  # type: ignore[index]
    assert 0 <= person["age"] <= 120 and len(person["name"]) <= 20
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", together["regex"].text)
    assert together["choice"].text in ("yes", "no")
    assert re.fullmatch(r"ab[cd]+!", together["lark"].text) or (
        together["lark"].finish_reason.value == "length"
        and re.fullmatch(r"ab[cd]*", together["lark"].text)
    )
    assert re.fullmatch(r"x[0-9][0-9]", together["gbnf"].text)
    for rid in free:
        assert together[rid].token_ids == alone[rid].token_ids


WEATHER_TAG = {
    "structures": [
        {
            "begin": "<function=get_weather>",
            "schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
            "end": "</function>",
        }
    ],
    "triggers": ["<function="],
}


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ('Sure. <function=get_weather>{"city": "Boston"}</function> Done.', True),
        ("No call at all, just text.", True),
        ("Sure. <function=get_time>", False),  # after the trigger, only a structure
        ('<function=get_weather>{"town": 1}', False),  # the schema holds inside
    ],
)
def test_a_structural_tag_leaves_text_free_and_holds_each_structure(
    smollm: LoadedLM, engine: Engine, text: str, kept: bool
) -> None:
    # vLLM's structural_tag response format (its structured_outputs example's).
    grammar = Grammar("structural_tag", json.dumps(WEATHER_TAG))
    constraint = engine.runner.make_constraint(grammar)
    ids = smollm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert all(constraint.accept(t) for t in ids) is kept


def test_logit_bias_bans_and_forces_tokens(smollm: LoadedLM, engine: Engine) -> None:
    prompt = chat_ids(smollm, "Say hello.")
    plain = run(engine, {"plain": (prompt, greedy(4))})["plain"].token_ids
    banned = run(engine, {"b": (prompt, greedy(4, logit_bias=((plain[0], -100.0),)))})["b"]
    assert banned.token_ids[0] != plain[0]
    forced = run(engine, {"f": (prompt, greedy(3, logit_bias=((42, 100.0),)))})["f"]
    assert forced.token_ids == [42, 42, 42]


@pytest.mark.parametrize(
    ("grammar", "reason"),
    [
        (Grammar("regex", "[a-"), "unclosed character class"),
        (Grammar("json_schema", json.dumps({"type": "string", "format": "x-unknown"})), "format"),
        # A keyword it cannot enforce is refused, never ignored (unknown ones are
        # annotations, as JSON Schema says).
        (Grammar("json_schema", json.dumps({"type": "array", "uniqueItems": True})), "uniqueItems"),
        (Grammar("json_schema", "[1, 2]"), "must be an object"),
        (Grammar("choice", "[]"), "non-empty list"),
        (Grammar("lark", "start: missing_rule"), "missing_rule"),
        (
            Grammar(
                "structural_tag",
                json.dumps({**WEATHER_TAG, "triggers": ["<tool="]}),
            ),
            "starts with none of the triggers",
        ),
    ],
)
def test_a_grammar_that_cannot_be_enforced_is_refused_naming_the_field(
    engine: Engine, grammar: Grammar, reason: str
) -> None:
    with pytest.raises(InvalidRequest, match=reason) as caught:
        engine.runner.compile_grammar(grammar, "response_format")
    assert caught.value.param == "response_format"


def test_a_logit_bias_outside_the_vocabulary_is_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequest) as caught:
        engine.add_request("x", [1, 2], greedy(2, logit_bias=((10**6, 1.0),)))
    assert caught.value.param == "logit_bias"


def test_the_bitmask_address_is_checked_against_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="do not cover"):
        fill_bitmasks([], 0, 10, 49152)


def test_objects_that_list_properties_are_closed_as_vllm_reads_them() -> None:
    # LangChain's bind_tools sends no additionalProperties: open, a small model adds
    # keys until max_tokens (xgrammar's strict mode, vLLM's default, closes them).
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "stops": {"type": "array", "items": {"type": "object", "properties": {"n": {}}}},
            "extra": {"type": "object", "additionalProperties": {"properties": {"k": {}}}},
        },
        "$defs": {"Unit": {"type": "object", "properties": {"u": {}}}},
        "anyOf": [{"properties": {"a": {}}}, {"type": "object"}],
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["stops"]["items"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["additionalProperties"]["additionalProperties"] is False
    assert closed["$defs"]["Unit"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["anyOf"][1]  # lists no properties: open
    assert "additionalProperties" not in schema  # the caller's schema is left as it was
    kept = {"type": "object", "properties": {"a": {}}, "additionalProperties": True}
    assert closed_objects(kept) == kept
