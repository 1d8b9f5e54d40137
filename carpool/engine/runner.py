"""The seam between the engine's bookkeeping and the model.

The engine is handed a ``Runner``: it plans each step (``SchedulerOutput``), gives
the runner that plan with each sampling sequence's ``SamplingRow``, and gets back
a ``StepResult`` of plain data. ``ModelRunner`` (``carpool.workers``, torch) is the
real one; the engine's request bookkeeping, detokenizing, stop strings and stats
are tested with a fake. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from carpool.engine.outputs import SchedulerOutput
from carpool.engine.sampling_params import Grammar, SamplingParams

if TYPE_CHECKING:
    from carpool.paths import PathTaken


class Constraint(Protocol):
    """One sequence's place in its grammar: the runner masks the tokens it forbids;
    the engine advances it with each sampled token."""

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar forbids it."""
        ...

    @property
    def finished(self) -> bool:
        """Whether the grammar is complete and allows nothing more."""
        ...


@dataclass
class SamplingRow:
    """One sequence's row of the logits: its parameters and history. ``generator``
    is the runner's own random state for a seeded sequence (``Runner.make_generator``);
    ``constraint`` its grammar state (``Runner.make_constraint``)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    end_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and stop_token_ids
    generator: Any = None
    constraint: Constraint | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the top alternatives, best first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class Sampled:
    """A sampling chunk's result: the draft tokens it accepted (speculative
    decoding), then the token sampled after them."""

    token_id: int
    logprobs: TokenLogprobs | None
    accepted: tuple[int, ...] = ()

    @property
    def tokens(self) -> list[int]:
        return [*self.accepted, self.token_id]


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens ``first + 1 ...`` (each given the tokens
    before it), from one chunk of a sequence's prompt."""

    first: int
    entries: list[TokenLogprobs]


@dataclass
class StepResult:
    """What a step produced: the sampled token of each sampling chunk's sequence,
    and prompt log-probabilities for the sequences that asked for them."""

    sampled: dict[str, Sampled] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)

    def update(self, other: StepResult) -> None:
        self.sampled.update(other.sampled)
        self.prompt_logprobs.update(other.prompt_logprobs)


@dataclass(frozen=True)
class Launch:
    """A step sent to the device and not yet landed (``LaunchingRunner.launch``): the row of
    each sampling sequence's token among the step's sampled tokens (where the next
    launch finds a pending token), and the runner's own handle."""

    rows: dict[str, int]
    handle: Any


@dataclass(frozen=True)
class EngineModelSpec:
    """What the engine knows of the model it drives."""

    name: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    tokenizer: Any  # decode / convert_ids_to_tokens, as the detokenizer uses them
    # The window every layer attends within (each query sees its last this-many
    # tokens); None where any layer sees the whole context. Set, the engine frees the
    # blocks a sequence's window has passed.
    sliding_window: int | None = None
    # A hybrid model's (Gemma 3's): the window of its sliding layers, where the
    # others attend the whole context and the runner keeps the sliding layers' KV in
    # a pool of ``window_blocks`` blocks of their own, which the engine frees behind
    # the window (``HybridBlockManager``); None where the runner keeps one pool.
    hybrid_window: int | None = None
    window_blocks: int = 0


class Runner(Protocol):
    """Runs the engine's steps on a model whose KV cache holds ``num_blocks``
    blocks."""

    spec: EngineModelSpec
    num_blocks: int
    paths: tuple[PathTaken, ...]  # which code runs each part of a step
    # "cpu" or "cuda": what the engine config's device-dependent defaults are
    # resolved for (``EngineConfig.for_device``).
    device_type: str
    # Whether a decode step may run several forward passes, each fed the last one's
    # greedy token on the device (``EngineConfig.num_scheduler_steps``).
    multi_step: bool

    def make_generator(self, seed: int) -> Any:
        """The random state of a sequence seeded with ``seed``."""
        ...

    def compile_grammar(self, grammar: Grammar, param: str) -> None:
        """Compile ``grammar`` into the runner's cache; any thread (the server calls it
        off the event loop before queueing a request). Raises ``InvalidRequest``
        naming ``param`` if the grammar is invalid or uses what cannot be enforced."""
        ...

    def make_constraint(self, grammar: Grammar) -> Constraint:
        """A fresh grammar state for one sequence (compiling first if not cached)."""
        ...

    def execute(
        self,
        step: SchedulerOutput,
        rows: Mapping[str, SamplingRow],
        prompt_logprobs: Mapping[str, int] | None = None,
    ) -> StepResult:
        """Run ``step``; sample one token for each chunk that reaches its sequence's
        end (``rows`` holds their rows by sequence id), and give the prompt
        log-probabilities asked for in ``prompt_logprobs`` (sequence id -> top k)."""
        ...


@runtime_checkable
class LaunchingRunner(Protocol):
    """What a ``Runner`` adds whose steps can be in flight while the host plans the next
    (``EngineConfig.async_scheduling``): the engine launches step N + 1, then lands
    step N. Only steps whose sampling chunks have no draft and whose rows need no
    history on the host (``drafting.speculable``) are launched."""

    def launch(
        self, step: SchedulerOutput, rows: Mapping[str, SamplingRow], after: Launch | None
    ) -> Launch:
        """Start ``step``. A chunk whose last own token is ``pending`` (sampled by
        ``after``, the step still in flight) takes it from the row ``after.rows`` gives
        its sequence, read on the device."""
        ...

    def land(self, launch: Launch) -> StepResult:
        """Wait for ``launch``'s sampled tokens (not for any step launched after it)."""
        ...
