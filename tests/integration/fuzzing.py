"""What the bad-input suites share: JSON values at the edges that torch, the
tokenizer and the kernels meet, a careless client's encoding, and the check that
every answer is clear (no 500, no stack trace, a message that says something)."""

from __future__ import annotations

import json
from collections import Counter

import httpx
from hypothesis import strategies as st

# Values at the edges that torch, the tokenizer and the kernels meet: integers at and
# past 32/64-bit limits and the vocabulary (49152), floats at float32's underflow and
# overflow, Unicode that is not (lone surrogates) or is awkward (NUL, combining
# marks, 4-byte characters), empty and huge collections.
EDGE_INTS = [
    *(
        sign * 2**bits + delta
        for bits in (31, 32, 63, 64)
        for sign in (1, -1)
        for delta in (-1, 0, 1)
    ),
    49151,
    49152,
    -1,
    0,
    2**100,
]
EDGE_FLOATS = [1e-40, 1e-45, 5e-324, -0.0, 1e-5, 0.99999994, 2.0000002, 3.4e38, 3.5e38, 1e308]
EDGE_TEXT = [
    "\ud800",
    "a\udfffb",
    "\udbff\udc00",
    "\x00",
    "e\u0301\u0301\u0301",
    "\U0001f600" * 5,
    "",
    " " * 500,
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from(EDGE_INTS)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([*EDGE_FLOATS, float("inf"), float("nan")])
    | st.text(max_size=20)
    | st.sampled_from(EDGE_TEXT)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        | st.just([])
        | st.just({})
        | st.just(list(range(20_000)))
        | st.just(["x"] * 5_000)
    ),
    max_leaves=12,
)


def send(c: httpx.Client, path: str, body: object) -> httpx.Response:
    """``body`` as JSON with ASCII escapes (lone surrogates as \\ud800, NaN and
    Infinity as Python writes them: what a careless client sends)."""
    content = json.dumps(body).encode()
    return c.post(path, content=content, headers={"content-type": "application/json"})


OUTCOMES: Counter[int] = Counter()  # statuses answered, across a module's campaign


def check(response: httpx.Response) -> None:
    OUTCOMES[response.status_code] += 1
    assert response.status_code < 500, response.text
    assert "Traceback" not in response.text and 'File "' not in response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert isinstance(message, str) and len(message) > 5, response.text
