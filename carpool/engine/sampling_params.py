"""Sampling parameters with vLLM's names and meanings, validated once on creation."""

from __future__ import annotations

from dataclasses import dataclass, field

from carpool.errors import InvalidRequest

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Temperatures below this sample greedily: dividing float32 logits by less overflows,
# and 1e-40 is 0 in float32.
GREEDY_BELOW = 1e-5
# Dividing float32 logits by a smaller repetition penalty overflows.
PENALTY_MIN = 1e-3


LOGIT_BIAS_MAX = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
GRAMMAR_KINDS = ("json_schema", "regex", "choice", "lark", "structural_tag")
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match (constrained decoding): ``kind`` is
    ``json_schema`` (``source``: the schema as JSON text), ``regex``, ``choice``
    (``source``: a JSON list of the allowed strings), ``lark`` or ``structural_tag``
    (``source``: JSON of vLLM's ``structures`` and ``triggers``). Plain and hashable:
    compiled grammars are cached by it."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        _check(self.kind in GRAMMAR_KINDS, "grammar", f"kind must be one of {GRAMMAR_KINDS}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of a request (vLLM's ``SamplingParams``).

    ``temperature`` below ``GREEDY_BELOW`` (1e-5, vLLM's epsilon) is greedy: smaller
    values underflow in float32. ``seed`` is a signed 64-bit integer (vLLM's range).
    ``top_k`` 0 (or -1, vLLM's spelling) keeps every
    token. ``logprobs`` is how many top alternatives to report per token (None:
    none). ``truncate_prompt_tokens`` keeps only the prompt's last
    that many tokens. ``logit_bias`` adds each bias to its token's logit (OpenAI's
    meaning); ``grammar`` constrains the output. Invalid values raise
    ``InvalidRequest`` naming the parameter.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    grammar: Grammar | None = None
    # What the engine reports of the request (vLLM's ``RequestOutputKind``):
    # "cumulative", after every step that changed it, all so far and the new;
    # "delta", after every step, the new alone (text, token ids and log-probabilities
    # are the new pieces: an engine process's, whose pipe carries only those);
    # "final_only", its last output alone (``LLM.generate``'s: none built per step).
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple(self.logit_bias))
        _check(1 <= self.n <= 16, "n", "must be between 1 and 16")
        _check(self.output_kind in OUTPUT_KINDS, "output_kind", f"must be one of {OUTPUT_KINDS}")
        _check(self.max_tokens >= 1, "max_tokens", "must be at least 1")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be between 0 and max_tokens",
        )
        _check(
            self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
            "seed",
            "must be a signed 64-bit integer",
        )
        _check(0.0 <= self.temperature <= 100.0, "temperature", "must be between 0 and 100")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", "must be -1, 0 (all tokens) or positive")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be between 0 and 1")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be between -2 and 2")
        _check(
            -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be between -2 and 2"
        )
        _check(
            PENALTY_MIN <= self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"must be between {PENALTY_MIN:g} and 10",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            "must be between 0 and 20",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            "must be between 0 and 20",
        )
        _check(
            self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
            "truncate_prompt_tokens",
            "must be at least 1",
        )
        _check(all(s for s in self.stop), "stop", "must not contain empty strings")
        _check(
            all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids (>= 0)"
        )
        _check(
            all(t >= 0 and -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX for t, b in self.logit_bias),
            "logit_bias",
            f"must map token ids (>= 0) to biases between -{LOGIT_BIAS_MAX:g} and "
            f"{LOGIT_BIAS_MAX:g}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(f"{param} {message}", param=param)
