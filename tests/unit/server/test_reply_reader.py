"""A reply with tool calls read as it is generated: whatever the pieces it arrives in,
the calls' names come whole and first, their arguments' pieces join to the JSON the
model wrote, and the answer's text (decoded, escapes and surrogate pairs included)
joins to what the whole reply says."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.server.generation.reply_reader import (
    ArgumentsDelta,
    CallStarted,
    ReplyReader,
    TextDelta,
)
from carpool.server.generation.tools import CLOSE, OPEN
from carpool.server.http.json_scanner import JsonScanner, Path

json_leaf = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=6), json_value, max_size=3)
names = st.from_regex(r"[a-z_]{1,10}", fullmatch=True)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)


def pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    edges = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


def read(form: str, parts: list[str]) -> tuple[ReplyReader, list[Any]]:
    reader = ReplyReader(form)
    events: list[Any] = []
    for part in parts:
        events += reader.feed(part)
    events += reader.finish()
    return reader, events


def joined_arguments(events: list[Any]) -> dict[int, str]:
    joined: dict[int, str] = {}
    for e in events:
        if isinstance(e, ArgumentsDelta):
            joined[e.index] = joined.get(e.index, "") + e.text
    return joined


def wrapped(form: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """``calls`` as a reply in ``form`` writes them."""
    if form == "generic":
        return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]})
    return "".join(f"{OPEN}\n{json.dumps({'name': n, 'arguments': a})}\n{CLOSE}" for n, a in calls)


def check_calls(events: list[Any], expected: list[tuple[str, dict[str, Any]]]) -> None:
    started = [e for e in events if isinstance(e, CallStarted)]
    assert [(e.index, e.name) for e in started] == [(i, n) for i, (n, _) in enumerate(expected)]
    for e in events:  # no call's arguments before its start
        if isinstance(e, ArgumentsDelta):
            assert any(s.index == e.index for s in started[: e.index + 1])
    joined = joined_arguments(events)
    assert [json.loads(joined[i]) for i in range(len(expected))] == [a for _, a in expected]


@settings(max_examples=150, deadline=None)
@given(calls=calls, cuts=st.lists(st.integers(0, 10_000), max_size=12), ascii_only=st.booleans())
def test_generic_calls_come_whole_whatever_the_pieces(
    calls: list[tuple[str, dict[str, Any]]], cuts: list[int], ascii_only: bool
) -> None:
    reply = json.dumps(
        {"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}, ensure_ascii=ascii_only
    )
    reader, events = read("generic", pieces(reply, cuts))
    check_calls(events, calls)
    assert not any(isinstance(e, TextDelta) for e in events)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == calls


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_a_generic_answer_is_decoded_as_it_comes(text: str, cuts: list[int]) -> None:
    reply = json.dumps({"response": text})  # ASCII escapes, surrogate pairs included
    reader, events = read("generic", pieces(reply, cuts))
    assert "".join(e.text for e in events) == text == reader.content
    assert all(isinstance(e, TextDelta) and e.text for e in events)


@settings(max_examples=150, deadline=None)
@given(
    calls=calls,
    before=st.text(alphabet="ab <_/>\n", max_size=12),
    after=st.text(alphabet="ab <_/>\n", max_size=12),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_hermes_blocks_are_calls_and_the_rest_is_text(
    calls: list[tuple[str, dict[str, Any]]], before: str, after: str, cuts: list[int]
) -> None:
    blocks = "".join(
        f"{OPEN}\n{json.dumps({'name': n, 'arguments': a})}\n{CLOSE}" for n, a in calls
    )
    reply = before + blocks + after
    reader, events = read("hermes", pieces(reply, cuts))
    check_calls(events, calls)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == before + after == reader.content


def test_hermes_arguments_before_the_name_wait_for_it() -> None:
    reply = f'{OPEN}{{"arguments": {{"x": [1, 2]}}, "name": "f"}}{CLOSE}'
    _, events = read("hermes", list(reply))
    assert isinstance(events[0], CallStarted) and events[0].name == "f"
    assert json.loads(joined_arguments(events)[0]) == {"x": [1, 2]}


def test_a_generic_reply_cut_short_never_shows_its_wrapper() -> None:
    cut = '{"tool_ca'
    reader, events = read("generic", [cut])
    assert events == [] and reader.calls == [] and reader.content == ""


@given(calls=calls, at=st.floats(0, 1))
def test_a_reply_cut_inside_a_call_keeps_only_the_calls_read_whole(
    calls: list[tuple[str, dict[str, Any]]], at: float
) -> None:
    for form in ("generic", "hermes"):
        whole = wrapped(form, calls)
        cut = whole[: int(len(whole) * at)]
        reader, _ = read(form, [cut])
        complete = [(c.name, json.loads(c.arguments)) for c in reader.complete_calls()]
        assert complete == calls[: len(complete)]
        whole_reader, _ = read(form, [whole])
        assert len(whole_reader.complete_calls()) == len(calls)


def test_a_broken_hermes_block_starts_no_call_and_the_next_one_reads() -> None:
    reply = f'{OPEN}{{"name": oops}}{CLOSE}{OPEN}{{"name": "g", "arguments": {{}}}}{CLOSE}'
    reader, events = read("hermes", [reply[:20], reply[20:]])
    assert [(c.name, c.arguments) for c in reader.calls] == [("g", "{}")]
    assert [e.index for e in events if isinstance(e, CallStarted)] == [0]


def test_the_scanner_reports_every_value_by_path() -> None:
    seen: list[tuple[Path, str]] = []
    text = '{"a": [1, {"b": "x\\"y"}], "c": true}  trailing'
    scanner = JsonScanner(lambda p, s: None, lambda p, s, e: seen.append((p, text[s:e])))
    for char in text:
        scanner.feed(char)
    assert seen == [
        (("a", 0), "1"),
        (("a", 1, "b"), '"x\\"y"'),
        (("a", 1), '{"b": "x\\"y"}'),
        (("a",), '[1, {"b": "x\\"y"}]'),
        (("c",), "true"),
        ((), '{"a": [1, {"b": "x\\"y"}], "c": true}'),
    ]
    assert scanner.done and not scanner.broken


def test_the_scanner_stops_at_text_that_is_not_json() -> None:
    scanner = JsonScanner(lambda p, s: None, lambda p, s, e: None)
    scanner.feed('{"a" 1}')
    assert scanner.broken and not scanner.done
