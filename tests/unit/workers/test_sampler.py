"""The sampler: each parameter's effect on a row, rows independent, seeds reproducible."""

from __future__ import annotations

import math

import pytest
import torch

from carpool.engine.sampling_params import SamplingParams
from carpool.errors import InvalidRequest
from carpool.workers import sampler
from carpool.workers.sampler import SamplingRow, _probs, make_generator, sample, verify

VOCAB = 50


def logits_for(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(
    output: list[int] | None = None, prompt: list[int] | None = None, **params: object
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), prompt or [], output or [])  # type: ignore[arg-type]


def test_greedy_takes_the_argmax() -> None:
    logits = logits_for(4)
    out = sample(logits, [row(temperature=0.0) for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_one_and_tiny_top_p_and_min_p_one_are_greedy() -> None:
    logits = logits_for(3, seed=1)
    best = logits.argmax(dim=-1).tolist()
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        for _ in range(5):
            assert sample(logits, [row(**params) for _ in range(3)]).token_ids == best, params


def test_top_k_keeps_sampling_within_the_k_best() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, :3] = torch.tensor([5.0, 4.9, 4.8])
    seen = {sample(logits, [row(top_k=3, temperature=5.0)]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1, 2}


def test_each_row_uses_its_own_parameters() -> None:
    logits = logits_for(2, seed=2)
    greedy_token = logits[0].argmax().item()
    results = {
        sample(logits, [row(temperature=0.0), row(temperature=50.0)]).token_ids[1]
        for _ in range(50)
    }
    assert all(
        sample(logits, [row(temperature=0.0), row(temperature=50.0)]).token_ids[0] == greedy_token
        for _ in range(10)
    )
    assert len(results) > 5, "the hot row samples widely while the greedy row does not move"


def test_repetition_penalty_and_frequency_penalty_push_seen_tokens_down() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 2.0
    logits[0, 8] = 1.9
    assert sample(logits, [row(temperature=0.0)]).token_ids == [7]
    assert sample(logits, [row(prompt=[7], temperature=0.0, repetition_penalty=1.2)]).token_ids == [
        8
    ]
    assert sample(logits, [row(output=[7], temperature=0.0, frequency_penalty=0.5)]).token_ids == [
        8
    ]
    assert sample(logits, [row(output=[7], temperature=0.0, presence_penalty=0.5)]).token_ids == [8]
    assert sample(logits, [row(prompt=[7], temperature=0.0, frequency_penalty=0.5)]).token_ids == [
        7
    ], "frequency and presence penalties count output tokens only"


def test_min_tokens_masks_end_tokens_until_reached() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 2] = 10.0
    early = SamplingRow(
        SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5), [], [1], frozenset({2})
    )
    late = SamplingRow(
        SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5), [], [1, 1], frozenset({2})
    )
    assert sample(logits, [early, late]).token_ids[0] != 2
    assert sample(logits, [early, late]).token_ids[1] == 2


def test_a_seeded_row_is_reproducible_whatever_else_is_in_the_batch() -> None:
    def run(batch: int, position: int) -> list[int]:
        generator = make_generator(1234)
        tokens = []
        for step in range(10):
            logits = logits_for(batch, seed=100 + step)
            logits[position] = logits_for(1, seed=step)[0]
            rows = [row(temperature=1.0) for _ in range(batch)]
            rows[position] = SamplingRow(
                SamplingParams(temperature=1.0, seed=1234), [], tokens, generator=generator
            )
            tokens.append(sample(logits, rows).token_ids[position])
        return tokens

    alone = run(1, 0)
    assert run(5, 3) == alone and run(8, 7) == alone
    assert len(set(alone)) > 1


def test_rows_without_a_seed_draw_each_from_its_own_distribution_in_one_batch() -> None:
    """Unseeded rows share one draw of noise for the batch: each row must still follow
    its own softmax, independently of the rows beside it (4,000 rows, 5 sigma)."""
    torch.manual_seed(7)
    first = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    second = torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 0.5])
    trials = 4_000
    logits = torch.stack([first, second] * trials)
    tokens = torch.tensor(sample(logits, [row(temperature=1.0)] * len(logits)).token_ids)
    for i, expected in enumerate((first, second)):
        counts = torch.bincount(tokens[i::2], minlength=6).double()
        assert_distributed(counts, torch.softmax(expected.double(), -1), trials)
    pairs = tokens[0::2] * 6 + tokens[1::2]  # joint = product of marginals: independent
    joint = torch.bincount(pairs, minlength=36).double()
    product = torch.outer(torch.softmax(first.double(), -1), torch.softmax(second.double(), -1))
    assert_distributed(joint, product.flatten(), trials)


def test_drawing_leaves_the_callers_logits_as_they_were() -> None:
    """The race works in place on the drawn rows' own copy, never on the step's logits
    (which log-probabilities and other rows still read)."""
    logits = logits_for(4, seed=3)
    before = logits.clone()
    rows = [row(temperature=0.7) for _ in range(3)] + [row(temperature=0.0)]
    tokens = sample(logits, rows).token_ids
    assert torch.equal(logits, before)
    assert tokens[3] == int(before[3].argmax())


def test_rows_drawn_a_few_at_a_time_get_the_tokens_drawn_all_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU the drawn rows go a few at a time (their copy stays small); each
    seeded row's token is the one it draws in a single pass, whatever part it falls in."""

    def tokens() -> list[int]:
        rows = [
            row(temperature=0.0)
            if i % 3 == 0
            else SamplingRow(
                SamplingParams(temperature=1.3, top_k=i, seed=i),
                [],
                [],
                generator=make_generator(i),
            )
            for i in range(7)
        ]
        return sample(logits_for(7, seed=11), rows).token_ids

    monkeypatch.setattr(sampler, "DRAW_BYTES", 1 << 30)
    whole = tokens()
    monkeypatch.setattr(sampler, "DRAW_BYTES", 2 * VOCAB * 4)
    assert sampler._draw_rows(logits_for(7), 4) == 2
    # a GPU's rows go all at once, and a batch with none to draw still gets a step
    gpu_like = torch.empty(7, VOCAB, device="meta")
    assert sampler._draw_rows(gpu_like, 4) == 4 and sampler._draw_rows(gpu_like, 0) == 1
    assert tokens() == whole


def test_a_row_without_any_weight_still_gets_a_token_of_the_vocabulary() -> None:
    """NaN logits (a broken model's) or every token masked: the draw by running sums
    finds no token past u times a zero (or NaN) total; it answers an id in range."""
    logits = logits_for(3, seed=5)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    tokens = sample(logits, [row(temperature=1.0) for _ in range(3)]).token_ids
    assert all(0 <= t < logits.shape[1] for t in tokens)


def test_logits_must_have_one_row_per_sequence() -> None:
    with pytest.raises(ValueError, match="2 rows"):
        sample(torch.zeros(1, VOCAB), [row(), row()])


def test_logprobs_are_the_raw_distribution_best_first() -> None:
    logits = logits_for(1, seed=3)
    out = sample(logits, [row(temperature=0.0, logprobs=3, repetition_penalty=2.0, prompt=[0])])
    entry = out.logprobs[0]
    assert entry is not None and len(entry.top) == 3
    raw = torch.log_softmax(logits[0], -1)
    assert [t for t, _ in entry.top] == raw.topk(3).indices.tolist()
    assert math.isclose(entry.logprob, raw[out.token_ids[0]].item(), rel_tol=1e-6)
    assert sample(logits, [row()]).logprobs == [None]


@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": ("",)}, "stop"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_invalid_parameters_are_refused_naming_the_parameter(
    params: dict[str, object], name: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**params)  # type: ignore[arg-type]
    assert err.value.param == name and name in err.value.message


def test_verify_greedy_keeps_the_draft_while_it_is_the_argmax() -> None:
    logits = torch.full((3, VOCAB), -1.0)
    for position, best in enumerate((3, 5, 7)):
        logits[position, best] = 4.0
    greedy = row(temperature=0.0)
    assert verify(logits, [3, 5], greedy) == ([3, 5], 7)
    assert verify(logits, [3, 6], greedy) == ([3], 5)
    assert verify(logits, [4, 5], greedy) == ([], 3)
    with pytest.raises(ValueError):
        verify(logits, [3], greedy)


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 4}, {"temperature": 1.3, "top_p": 0.8}],
)
def test_verify_sampled_keeps_the_target_distribution(params: dict[str, float]) -> None:
    """Rejection sampling against a point-mass draft: whatever the draft, the first
    token is distributed as the target's first row, and after an accepted draft
    token the next as its second row (8,000 seeded trials, within 5 sigma: a bias over
    ~3 points fails; 20,000 cost 70 s of the suite)."""
    vocab = 6
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0], [0.0, 1.0, 2.0, 0.0, 1.0, 0.5]])
    r = row(**params)
    r.generator = make_generator(1234)
    target = _probs(logits, [r, r]).double()  # what sampling a row draws from
    trials = 8_000
    for draft_token in (0, 2, 5):  # likely, middling, filtered out by top-k/top-p
        first = torch.zeros(vocab)
        second = torch.zeros(vocab)
        for _ in range(trials):
            accepted, token = verify(logits, [draft_token], r)
            first[accepted[0] if accepted else token] += 1
            if accepted:
                second[token] += 1
        assert_distributed(first, target[0], trials)
        if second.sum() > 1000:
            assert_distributed(second, target[1], int(second.sum()))


def assert_distributed(counts: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    freq = counts.double() / n
    sigma = (probs * (1 - probs) / n).sqrt() + 1e-3
    assert ((freq - probs).abs() <= 5 * sigma).all(), (freq.tolist(), probs.tolist())
