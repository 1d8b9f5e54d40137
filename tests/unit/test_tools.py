"""The tool wrapper's pure parts: which tools a tool_choice offers, the grammar a
reply must match (checked with llguidance on the built-in model's tokenizer), the
history's calls written back, and a reply read into OpenAI's tool_calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from carpool.engine.structured import Grammars
from carpool.errors import InvalidRequest
from carpool.server.generation.tools import (
    ToolSpec,
    calls_as_content,
    chosen_tools,
    tool_grammar,
    tools_prompt,
    with_tools_prompt,
)

ADD = ToolSpec(
    "add",
    "Add two numbers",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)
NOW = ToolSpec("now", None, None)


@pytest.fixture(scope="module")
def grammars(smollm_folder: Path) -> Grammars:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm_folder))
    return Grammars(tokenizer, 49152, [tokenizer.eos_token_id])


def accepts(grammars: Grammars, grammar: object, text: str) -> bool:
    """Whether ``text`` is a whole reply the grammar allows."""
    constraint = grammars.constraint(grammar)  # type: ignore[arg-type]
    ids = grammars.tokenizer().tokenize_str(text)
    return all(constraint.accept(t) for t in ids) and constraint.matcher.is_accepting()


CALL_ADD = '{"tool_calls":[{"name":"add","arguments":{"a":1,"b":2}}]}'
CALL_TWICE = (
    '{"tool_calls":[{"name":"add","arguments":{"a":1,"b":2}},{"name":"now","arguments":{}}]}'
)
ANSWER = '{"response":"hello"}'


def test_the_grammar_allows_exactly_what_the_choice_asks(grammars: Grammars) -> None:
    auto = tool_grammar([ADD, NOW], required=False, parallel=True)
    assert accepts(grammars, auto, CALL_ADD) and accepts(grammars, auto, ANSWER)
    assert accepts(grammars, auto, CALL_TWICE)
    required = tool_grammar([ADD, NOW], required=True, parallel=True)
    assert accepts(grammars, required, CALL_ADD) and not accepts(grammars, required, ANSWER)
    single = tool_grammar([ADD, NOW], required=True, parallel=False)
    assert accepts(grammars, single, CALL_ADD) and not accepts(grammars, single, CALL_TWICE)
    bad_args = '{"tool_calls":[{"name":"add","arguments":{"a":"one","b":2}}]}'
    assert not accepts(grammars, required, bad_args)
    unknown = '{"tool_calls":[{"name":"sub","arguments":{"a":1,"b":2}}]}'
    assert not accepts(grammars, required, unknown)


def test_tool_choice_picks_the_tools() -> None:
    assert chosen_tools([ADD, NOW], "auto", None) == ([ADD, NOW], False)
    assert chosen_tools([ADD, NOW], None, None) == ([ADD, NOW], False)
    assert chosen_tools([ADD, NOW], "required", None) == ([ADD, NOW], True)
    assert chosen_tools([ADD, NOW], "none", None) == ([], False)
    assert chosen_tools([ADD, NOW], None, "now") == ([NOW], True)
    with pytest.raises(InvalidRequest) as caught:
        chosen_tools([ADD], None, "sub")
    assert caught.value.param == "tool_choice"


def test_the_prompt_offers_the_tools_in_the_system_message() -> None:
    prompt = tools_prompt([ADD], required=True)
    assert '"name": "add"' in prompt and "response" not in prompt
    assert "response" in tools_prompt([ADD], required=False)
    messages = [{"role": "user", "content": "hi"}]
    assert with_tools_prompt(messages, "P") == [{"role": "system", "content": "P"}, *messages]
    system = [{"role": "system", "content": "Be brief."}, *messages]
    assert with_tools_prompt(system, "P")[0]["content"] == "Be brief.\n\nP"


def test_history_calls_are_written_back_in_the_wrapper() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    assert json.loads(calls_as_content([call], "p")) == {
        "tool_calls": [{"name": "add", "arguments": {}}]
    }
    broken = {**call, "function": {"name": "add", "arguments": "not json"}}
    with pytest.raises(InvalidRequest) as caught:
        calls_as_content([broken], "messages[1].tool_calls")
    assert caught.value.param == "messages[1].tool_calls"
