"""A reasoning model's reply split into its reasoning and its answer
(``--reasoning-parser``, vLLM's names), as the reply arrives.

Both parsers read ``<think>...</think>``:

- ``qwen3``: a reply that begins with ``<think>`` reasons until ``</think>``; any
  other reply is all answer (Qwen3 with ``enable_thinking: false``, whose template
  writes an empty think block into the prompt).
- ``deepseek_r1``: the reply reasons from its start (the template opened the think
  block in the prompt; a leading ``<think>`` is dropped) until ``</think>``; a reply
  that never closes it is all reasoning.

The answer's leading newlines (after ``</think>``) are dropped. ``ReasoningSplitter``
holds back text that may be the start of a tag, so a tag cut across pieces is still
found; the whole reply fed at once splits the same way. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from carpool.server.generation.reply_reader import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class Split:
    """What a piece of the reply adds to each part."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Splits one reply for ``parser`` (one of ``PARSERS``)."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")
        self.parser = parser
        self._held = ""
        # start: nothing read yet; reasoning; content
        self._state = "start"
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str) -> Split:
        return self._read(text, final=False)

    def finish(self) -> Split:
        """What was held back, once the reply is complete."""
        return self._read("", final=True)

    def _read(self, text: str, final: bool) -> Split:
        self._held += text
        reasoning, content = "", ""
        if self._state == "start":
            if not final and OPEN.startswith(self._held.lstrip()):
                return Split()  # may yet be "<think>"
            opened = self._held.lstrip().startswith(OPEN)
            if opened:
                self._held = self._held.lstrip()[len(OPEN) :]
            thinking = opened or self.parser == "deepseek_r1"
            self._state = "reasoning" if thinking else "content"
        if self._state == "reasoning":
            at = self._held.find(CLOSE)
            if at < 0:
                keep = 0 if final else partial_suffix(self._held, CLOSE)
                reasoning, self._held = _cut(self._held, len(self._held) - keep)
            else:
                reasoning = self._held[:at]
                self._held = self._held[at + len(CLOSE) :]
                self._state = "content_start"
        if self._state == "content_start":
            stripped = self._held.lstrip("\n")
            if not stripped and not final:
                self._held = ""
                return self._kept(reasoning, "")
            self._held = stripped
            self._state = "content"
        if self._state == "content":
            content, self._held = self._held, ""
        return self._kept(reasoning, content)

    def _kept(self, reasoning: str, content: str) -> Split:
        self.reasoning += reasoning
        self.content += content
        return Split(reasoning, content)


def _cut(text: str, at: int) -> tuple[str, str]:
    return text[:at], text[at:]
