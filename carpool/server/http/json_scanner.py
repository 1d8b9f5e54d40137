"""Following one JSON value as its text arrives, character by character, and saying
where each value inside it starts and ends, by path.

A reply being generated is JSON cut anywhere; ``json.loads`` can read it only when
it is whole. The scanner keeps a stack of open containers and reports, for every
value, ``on_start(path, start)`` at its first character and ``on_end(path, start,
end)`` past its last (``end`` exclusive; positions count every character fed). A
path is the keys and array indices from the top value down: ``("tool_calls", 0,
"arguments")``. Text that is not JSON stops the scan (``broken``); what follows the
top value is ignored. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

Path = tuple[str | int, ...]

_SCALAR = frozenset("0123456789+-.eEtruefalsn")
_SPACE = frozenset(" \t\r\n")


@dataclass
class _Open:
    """One open object or array: its own path and start, and where its reading is."""

    path: Path
    start: int
    is_object: bool
    key: str | int | None = None  # the key being read (object) or the index (array)
    expects: str = "first"  # first | key | colon | value | comma


@dataclass
class _Token:
    """A string or scalar being read."""

    start: int
    is_key: bool = False
    is_string: bool = True
    escaped: bool = False
    text: list[str] = field(default_factory=list)  # a key's characters


class JsonScanner:
    """Scans one JSON value fed in pieces (``feed``)."""

    def __init__(
        self,
        on_start: Callable[[Path, int], None],
        on_end: Callable[[Path, int, int], None],
    ) -> None:
        self._on_start = on_start
        self._on_end = on_end
        self._stack: list[_Open] = []
        self._token: _Token | None = None
        self.position = 0  # characters fed so far
        self.started = False
        self.done = False
        self.broken = False

    def feed(self, text: str) -> None:
        for char in text:
            if self.done or self.broken:
                self.position += 1
                continue
            self._char(char)
            self.position += 1

    def _path(self) -> Path:
        return tuple(o.key for o in self._stack if o.key is not None)

    def _char(self, char: str) -> None:
        token = self._token
        if token is not None:
            if token.is_string:
                self._string_char(token, char)
                return
            if char in _SCALAR:
                return
            self._token = None
            self._ended(token.start, self.position)
        if char in _SPACE:
            return
        top = self._stack[-1] if self._stack else None
        if top is None:
            if self.started:
                self.done = True
            else:
                self._value(char)
            return
        if top.is_object:
            self._object_char(top, char)
        else:
            self._array_char(top, char)

    def _string_char(self, token: _Token, char: str) -> None:
        if token.escaped:
            token.escaped = False
        elif char == "\\":
            token.escaped = True
        elif char == '"':
            self._token = None
            if token.is_key:
                self._stack[-1].key = json.loads('"' + "".join(token.text) + '"')
                self._stack[-1].expects = "colon"
            else:
                self._ended(token.start, self.position + 1)
            return
        if token.is_key:
            token.text.append(char)

    def _object_char(self, top: _Open, char: str) -> None:
        if top.expects in ("first", "key") and char == '"':
            self._token = _Token(self.position, is_key=True)
        elif top.expects in ("first", "comma") and char == "}":
            self._close()
        elif top.expects == "colon" and char == ":":
            top.expects = "value"
        elif top.expects == "value":
            self._value(char)
        elif top.expects == "comma" and char == ",":
            top.expects = "key"
        else:
            self.broken = True

    def _array_char(self, top: _Open, char: str) -> None:
        if top.expects in ("first", "comma") and char == "]":
            self._close()
        elif top.expects == "comma" and char == ",":
            assert isinstance(top.key, int)
            top.key += 1
            top.expects = "value"
        elif top.expects in ("first", "value"):
            top.key = top.key if top.key is not None else 0
            self._value(char)
        else:
            self.broken = True

    def _value(self, char: str) -> None:
        """``char`` begins a value at the current path."""
        self.started = True
        path = self._path()
        start = self.position
        if char in "{[":
            self._on_start(path, start)
            if self._stack:
                self._stack[-1].expects = "pending"
            self._stack.append(_Open(path, start, is_object=char == "{"))
        elif char == '"' or char in _SCALAR:
            self._on_start(path, start)
            self._token = _Token(start, is_string=char == '"')
            if self._stack:
                self._stack[-1].expects = "pending"
        else:
            self.broken = True

    def _ended(self, start: int, end: int) -> None:
        """The string or scalar at the current path ended."""
        self._on_end(self._path(), start, end)
        self._after_value()

    def _close(self) -> None:
        opened = self._stack.pop()
        self._on_end(opened.path, opened.start, self.position + 1)
        self._after_value()

    def _after_value(self) -> None:
        if not self._stack:
            self.done = True
            return
        top = self._stack[-1]
        top.expects = "comma"
        if top.is_object:
            top.key = None
