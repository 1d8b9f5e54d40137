"""Picks each row's next token from a step's logits, every row with its own
parameters. Temperature, top-k, top-p, min-p and the draw are one vectorised pass
over the batch; penalties and ``min_tokens`` masks are applied row by row (each
touches only that row's seen tokens).

Order (as vLLM): repetition, frequency and presence penalties; ``min_tokens``
masking of end tokens; then greedy rows take the argmax, the others are scaled by
temperature, filtered by top-k, top-p and min-p, and sampled by the inverse of
their running sum (the first token whose running sum passes u times the total, u
uniform). A seeded row draws its u from its own generator, so its tokens do not
depend on what else is in the batch.
Log-probabilities are of the model's raw logits (vLLM's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from carpool.engine.runner import SamplingRow, TokenLogprobs
from carpool.engine.structured import GrammarConstraint, fill_bitmasks

DRAW_BYTES = 1 << 20  # about how much of the logits a CPU draw copies at a time (_draw_rows)


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
    """``logits``: [len(rows), vocab]."""
    raw = (
        torch.log_softmax(logits.float(), dim=-1)
        if any(r.params.logprobs is not None for r in rows)
        else None
    )
    tokens: list[int] = choose(logits, rows).tolist()
    return SampleOutput(tokens, _logprobs(raw, tokens, rows))


def choose(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's token, as a tensor on the logits' device. For rows without
    penalties, biases or grammars nothing here waits for the device (the small
    tensors of per-row parameters go up with ``_upload``), so a step's tokens can be
    chosen while the step before it still runs."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} rows")
    logits = logits.float()
    penalised = any(_penalised(r) for r in rows)
    biased = any(r.params.logit_bias for r in rows)
    constrained = [i for i, r in enumerate(rows) if r.constraint is not None]
    if penalised or biased or constrained:
        logits = logits.clone()  # once: the edits below work in place
    if penalised:
        _penalise(logits, rows)
        _mask_early_ends(logits, rows)
    if biased:
        _bias(logits, rows)
    if constrained:
        _mask_grammar(logits, rows, constrained)
    chosen = logits.argmax(dim=-1)
    drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
    step = _draw_rows(logits, len(drawn))
    for at in range(0, len(drawn), step):
        part = drawn[at : at + step]
        index = _upload(part, torch.long, logits.device)
        chosen[index] = _draw(logits[index], [rows[i] for i in part])
    return chosen


def _draw_rows(logits: torch.Tensor, drawn: int) -> int:
    """How many of the ``drawn`` rows to draw at a time (at least 1). On the CPU, enough rows
    for about ``DRAW_BYTES`` of logits: the draw copies its rows (and, filtered, sorts
    them), so 64 rows of a 49,152-token vocabulary drawn at once copy 12 MiB at a step's
    peak (64 sampled streams of the 135M model peaked 9.6 MiB higher that way). A GPU
    draws all rows at once: the copies come from its own pool, and each part would be
    a dozen launches."""
    if logits.device.type != "cpu":
        return max(1, drawn)
    return max(1, DRAW_BYTES // (logits.shape[1] * logits.element_size()))


def _upload(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting for the work
    queued there (``torch.tensor(..., device=...)`` copies blocking: on a GPU it would
    wait for the step in flight)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def verify(logits: torch.Tensor, draft: Sequence[int], row: SamplingRow) -> tuple[list[int], int]:
    """Speculative decoding's check of ``draft`` against the target model:
    ``logits`` [len(draft) + 1, vocab], row j predicting the token after draft
    token j - 1. Returns the draft tokens accepted and the token that follows them.

    Greedy: the longest prefix equal to the argmax, then the argmax. Sampled
    (rejection sampling, Leviathan et al.; the draft is a point mass q): draft
    token x is accepted with probability p(x); on rejection the token is drawn from
    p with x removed, renormalised; after a full acceptance, from the last row. The
    tokens are distributed exactly as non-speculative sampling's. Only for rows
    without penalties, biases, grammars or log-probabilities (``speculable``)."""
    if logits.dim() != 2 or logits.shape[0] != len(draft) + 1:
        raise ValueError(f"logits of shape {tuple(logits.shape)} for a draft of {len(draft)}")
    logits = logits.float()
    if row.params.greedy:
        best: list[int] = logits.argmax(dim=-1).tolist()
        n = 0
        while n < len(draft) and best[n] == draft[n]:
            n += 1
        return list(draft[:n]), best[n]
    probs = _probs(logits, [row] * len(logits))
    for j, token in enumerate(draft):
        u = torch.rand((), generator=row.generator, device=logits.device)
        if u < probs[j, token]:
            continue
        residual = probs[j].clone()
        residual[token] = 0.0
        return list(draft[:j]), _pick(residual[None], [row])
    return list(draft), _pick(probs[-1:], [row])  # probs is not read again


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per (non-greedy) row: temperature, the filters the rows ask for,
    then one draw from each row's distribution. ``logits`` are the drawn rows' own
    copy (a gather), and are changed: without filters the weights are exp(logits / T
    - max) made in place, not a softmax (the draw needs no normalised row)."""
    if any(_filtered(r) for r in rows):
        return _pick_all(_probs(logits, rows), rows)
    temperatures = _upload([r.params.temperature for r in rows], torch.float32, logits.device)
    weights = logits.div_(temperatures[:, None])
    weights.sub_(weights.amax(dim=-1, keepdim=True)).exp_()
    return _pick_all(weights, rows)


def _filtered(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.top_k or p.top_p < 1.0 or p.min_p > 0.0)


def _pick(probs: torch.Tensor, rows: list[SamplingRow]) -> int:
    return int(_pick_all(probs, rows)[0])


def _pick_all(weights: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of ``weights`` [rows, vocab] (>= 0, unnormalised), drawn by
    the inverse of its running sum: the first token whose running sum passes u times
    the row's total, u uniform from the row's generator (one number a row; the rows
    without a seed draw theirs in one call). ``weights`` become their running sums.
    The exponential race this replaces drew a number for every token of every row:
    64 x 49,152 a step, 96-119 ms of a 232-240 ms 64-stream step on a 2-core CPU."""
    uniform = torch.rand(len(rows), device=weights.device)
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniform[i] = torch.rand((), generator=row.generator, device=weights.device)
    sums = weights.cumsum_(dim=-1)
    totals = sums[:, -1:]
    # below the total even where u * total rounds up to it: the token found has weight
    below = torch.nextafter(totals, torch.zeros_like(totals))
    targets = torch.minimum(uniform[:, None] * totals, below)
    tokens = torch.searchsorted(sums, targets, right=True)[:, 0]
    # a row with no weight at all (NaN logits of a broken model) still gets a token id
    return tokens.clamp_(max=weights.shape[-1] - 1)


def _probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's sampling distribution: temperature, then the filters asked for."""
    device = logits.device

    def column(values: list[float]) -> torch.Tensor:
        return _upload(values, torch.float32, device)[:, None]

    scaled = logits / column([r.params.temperature for r in rows])
    if any(_filtered(r) for r in rows):
        scaled = _filter(
            scaled,
            top_k=[r.params.top_k for r in rows],
            top_p=column([r.params.top_p for r in rows]),
            min_p=column([r.params.min_p for r in rows]),
        )
    return torch.softmax(scaled, dim=-1)


def _penalised(row: SamplingRow) -> bool:
    p = row.params
    return bool(
        p.repetition_penalty != 1.0
        or p.frequency_penalty
        or p.presence_penalty
        or (row.end_ids and len(row.output_ids) < p.min_tokens)
    )


def _penalise(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Apply each row's repetition, frequency and presence penalties, in place."""
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted({*row.prompt_ids, *row.output_ids}), dtype=torch.long, device=logits.device
            )
            values = logits[i, seen]
            logits[i, seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
        if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
            out = torch.tensor(list(row.output_ids), dtype=torch.long, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device).scatter_add_(
                0, out, torch.ones(len(out), device=logits.device)
            )
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Add each row's ``logit_bias`` to its tokens' logits, in place."""
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            tokens, biases = zip(*row.params.logit_bias, strict=True)
            logits[i, list(tokens)] += torch.tensor(biases, device=logits.device)


def _mask_grammar(logits: torch.Tensor, rows: list[SamplingRow], index: list[int]) -> None:
    """Forbid (-inf), in place, in rows ``index`` every token their grammar forbids:
    one bitmask for all of them, filled in one batched call, applied in one pass."""
    vocab = logits.shape[1]
    constraints = [cast(GrammarConstraint, rows[i].constraint) for i in index]
    width = constraints[0].vocab_size  # one tokenizer per model: the same for all
    if width < vocab:
        raise ValueError(f"grammar masks of {width} tokens for logits of {vocab}")
    words = (width + 31) // 32
    bitmask = torch.empty(len(index), words, dtype=torch.int32)  # contiguous, on the CPU
    fill_bitmasks(constraints, bitmask.data_ptr(), words, width)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(index), -1)[:, :vocab].bool()
    picked = torch.tensor(index, device=logits.device)
    logits[picked] = logits[picked].masked_fill(~allowed.to(logits.device), float("-inf"))


def _mask_early_ends(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if row.end_ids and len(row.output_ids) < row.params.min_tokens:
            logits[i, list(row.end_ids)] = float("-inf")


def _filter(
    logits: torch.Tensor, top_k: list[int], top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    vocab = logits.shape[1]
    ordered, _ = logits.sort(dim=-1, descending=True)
    k = _upload([kk if 0 < kk < vocab else vocab for kk in top_k], torch.long, logits.device)
    kth = ordered.gather(1, (k - 1)[:, None])
    logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, _ = probs.sort(dim=-1, descending=True)
    # Keep the smallest set of best tokens whose mass reaches top_p (always the best one).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    threshold = sorted_probs.gather(1, kept - 1)
    logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))


def _logprobs(
    raw: torch.Tensor | None, tokens: list[int], rows: list[SamplingRow]
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = []
    for i, row in enumerate(rows):
        k = row.params.logprobs
        if raw is None or k is None:
            out.append(None)
            continue
        values, ids = raw[i].topk(k) if k else (raw[i][:0], raw[i][:0].long())
        out.append(
            TokenLogprobs(
                float(raw[i, tokens[i]]), list(zip(ids.tolist(), values.tolist(), strict=True))
            )
        )
    return out
