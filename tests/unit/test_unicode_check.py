"""The lone-surrogate check: the raw-bytes scan never lets one through, in any of
the spellings that Python's JSON parser reads, and the walk names the string."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.errors import InvalidRequest
from carpool.server.http.unicode_check import (
    invalid_unicode_at,
    may_hold_surrogates,
    refuse_invalid_unicode,
)

LONE = "\ud800"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def spellings(value: object) -> list[bytes]:
    """``value`` as JSON bytes in every form ``json.loads`` reads back: ASCII escapes,
    raw UTF-8 (surrogates as their 3-byte forms), UTF-16."""
    text = json.dumps(value, ensure_ascii=False)
    return [
        json.dumps(value).encode(),
        text.encode("utf-8", "surrogatepass"),
        text.encode("utf-16-le", "surrogatepass"),
    ]


@given(json_values)
def test_a_body_without_lone_surrogates_passes(value: object) -> None:
    for body in spellings(value):
        refuse_invalid_unicode(body)


@given(json_values, st.sampled_from([LONE, "\udfff", "a\udc00b", "\ud83d"]))
def test_a_lone_surrogate_is_found_in_every_spelling(value: object, bad: str) -> None:
    wrapped = {"ok": value, "field": [value, {"deep": bad}]}
    for body in spellings(wrapped):
        assert may_hold_surrogates(body)
        with pytest.raises(InvalidRequest) as caught:
            refuse_invalid_unicode(body)
        assert caught.value.param == "field"
        assert "'field.1.deep'" in str(caught.value)


def test_plain_bodies_and_paired_surrogates_skip_or_pass_the_walk() -> None:
    assert not may_hold_surrogates(json.dumps({"prompt": [5] * 1000, "x": "héllo"}).encode())
    emoji = json.dumps({"prompt": "\U0001f600"}).encode()  # \ud83d\ude00, a valid pair
    assert may_hold_surrogates(emoji)
    refuse_invalid_unicode(emoji)


def test_a_key_is_named_and_a_non_json_body_is_left_to_its_parser() -> None:
    assert invalid_unicode_at({"a": {LONE: 1}}) == f"a.{LONE}"
    refuse_invalid_unicode(b'{"prompt": "\\ud800"')  # truncated: the parser's error answers
