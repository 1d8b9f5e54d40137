"""The engine's bookkeeping driven by a fake runner, without torch or a model:
request states, chunked prompts, preemption, aborts, detokenizing, stop strings and
stop tokens, ``n`` seeded sequences, a request the model fails on, and the stats.
After every step each sequence is in exactly one state and no block is leaked.
Torch-free (``scripts/check_core.sh`` runs it where torch is not installed)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.config import EngineConfig
from carpool.engine.block_manager import HybridBlockManager
from carpool.engine.engine import Engine
from carpool.engine.outputs import SchedulerOutput
from carpool.engine.request_output import RequestOutput
from carpool.engine.runner import EngineModelSpec, Launch, Sampled, SamplingRow, StepResult
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.sequence import FinishReason
from carpool.errors import InvalidRequest

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,."
EOS = len(ALPHABET)  # 29


class CharTokenizer:
    """Token i is ALPHABET[i]; EOS decodes to nothing (a special token)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[t] for t in token_ids if t < len(ALPHABET))


def ids(text: str) -> list[int]:
    return [ALPHABET.index(c) for c in text]


class FakeRunner:
    """Replies with a fixed continuation per prompt (then EOS); a seeded sequence
    draws from its own ``random.Random`` instead. ``fail_on``: a prompt token that
    makes any step holding it raise, as a model bug would."""

    def __init__(self, replies: Mapping[str, str], num_blocks: int = 64, fail_on: int = -1):
        self.spec = EngineModelSpec("fake", EOS + 1, 256, frozenset({EOS}), CharTokenizer())
        self.num_blocks = num_blocks
        self.paths = ()
        self.multi_step = False
        self.device_type = "cpu"
        self.replies = {tuple(ids(k)): ids(v) for k, v in replies.items()}
        self.fail_on = fail_on
        self.tokens_run = 0
        self.steps = 0

    def make_generator(self, seed: int) -> random.Random:
        return random.Random(seed)

    def execute(
        self,
        step: SchedulerOutput,
        rows: Mapping[str, SamplingRow],
        prompt_logprobs: Mapping[str, int] | None = None,
    ) -> StepResult:
        if any(self.fail_on in c.seq.prompt_ids for c in step.chunks):
            raise RuntimeError("the model failed")
        self.tokens_run += step.num_tokens
        self.steps += 1
        result = StepResult()
        for chunk in step.chunks:
            if chunk.samples:
                row = rows[chunk.seq.request_id]
                # Its outputs so far, a pending one (asynchronous scheduling) included.
                done = chunk.seq.num_output_tokens
                # A draft is verified as a model would: kept while it matches.
                accepted: list[int] = []
                for token in chunk.draft:
                    if self._next(row, done + len(accepted)) != token:
                        break
                    accepted.append(token)
                next_token = self._next(row, done + len(accepted))
                result.sampled[chunk.seq.request_id] = Sampled(next_token, None, tuple(accepted))
        return result

    def _next(self, row: SamplingRow, done: int) -> int:
        """The reply's token after its first ``done``."""
        if row.generator is not None:
            return int(row.generator.randrange(len(ALPHABET)))
        reply = self.replies.get(tuple(row.prompt_ids), [])
        return reply[done] if done < len(reply) else EOS


class LaunchingFakeRunner(FakeRunner):
    """A ``FakeRunner`` whose steps are launched and landed (asynchronous
    scheduling). It reads each pending token from the step in flight, and records
    every (position, id) it ran per sequence so a test can check they were the real
    ones."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.fail_landing_on = -1  # a sampled token that makes its step fail to land
        self.ran: dict[str, dict[int, int]] = {}
        self.launched = 0

    def launch(
        self, step: SchedulerOutput, rows: Mapping[str, SamplingRow], after: Launch | None
    ) -> Launch:
        tokens: list[int] = [] if after is None else after.handle
        for chunk in step.chunks:
            rid = chunk.seq.request_id
            seen = self.ran.setdefault(rid, {})
            ids = chunk.input_ids
            if chunk.pending:
                assert after is not None and rid in after.rows, "a pending token of no flight"
                ids.insert(chunk.num_own - 1, tokens[after.rows[rid]])
            for pos, token in enumerate(ids, chunk.seq.num_computed):
                assert token >= 0, "a placeholder reached the model"
                seen[pos] = token
        result = self.execute(step, rows)
        self.launched += 1
        order = {rid: j for j, rid in enumerate(result.sampled)}
        return Launch(order, [s.token_id for s in result.sampled.values()])

    def land(self, launch: Launch) -> StepResult:
        tokens = launch.handle
        if self.fail_landing_on in tokens:
            raise RuntimeError("the step failed on the device")
        return StepResult({rid: Sampled(tokens[j], None) for rid, j in launch.rows.items()})


def run(engine: Engine, abort_after: Mapping[str, int] | None = None) -> dict[str, RequestOutput]:
    """Step until idle, checking the invariants after every step; each request's
    final output (exactly one per request). ``abort_after``: abort a request after
    that many steps."""
    finals: dict[str, RequestOutput] = {}
    every = [s for r in engine.outputs.requests.values() for s in r.seqs]
    steps = 0
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
        steps += 1
        for rid, after in (abort_after or {}).items():
            if steps == after:
                engine.abort(rid)
        engine.scheduler.check(every)
    assert engine.blocks.num_free == engine.blocks.num_usable, "blocks leaked"
    assert all(s.num_pending == 0 for s in every), "a pending token never landed"
    return finals


def greedy(max_tokens: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def test_text_comes_out_whole_and_ends_on_eos() -> None:
    engine = Engine(FakeRunner({"hi": "hello there"}), EngineConfig(block_size=8))
    engine.add_request("a", ids("hi"), greedy())
    out = run(engine)["a"].outputs[0]
    assert out.text == "hello there" and out.token_ids == [*ids("hello there"), EOS]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason is None  # EOS, as vLLM


def test_stop_strings_never_show_and_span_tokens() -> None:
    engine = Engine(FakeRunner({"q": "the answer, then more"}), EngineConfig(block_size=8))
    engine.add_request("a", ids("q"), greedy(stop=("r, t",)))
    out = run(engine)["a"].outputs[0]
    assert out.text == "the answe" and out.stop_reason == "r, t"
    assert out.finish_reason is FinishReason.STOP


def test_max_tokens_stop_token_ids_and_ignore_eos() -> None:
    runner = FakeRunner({"x": "abcdef"})
    engine = Engine(runner, EngineConfig(block_size=8))
    engine.add_request("length", ids("x"), greedy(max_tokens=3))
    engine.add_request("token", ids("x"), greedy(stop_token_ids=(ALPHABET.index("d"),)))
    engine.add_request("past-eos", ids("x"), greedy(max_tokens=8, ignore_eos=True))
    finals = run(engine)
    assert finals["length"].outputs[0].text == "abc"
    assert finals["length"].outputs[0].finish_reason is FinishReason.LENGTH
    token = finals["token"].outputs[0]
    assert token.text == "abc" and token.stop_reason == ALPHABET.index("d")
    assert len(finals["past-eos"].outputs[0].token_ids) == 8


@pytest.mark.parametrize("launching", [False, True])
def test_final_only_and_delta_outputs_say_what_cumulative_ones_do(launching: bool) -> None:
    """final_only: one output a request, the cumulative one's last; delta: each
    step's new pieces alone, which joined are the cumulative one's last."""
    replies = {"q": "the answer, then more", "x": "abcdef"}
    asked = {
        "stop": (ids("q"), greedy(stop=("r, t",))),
        "length": (ids("x"), greedy(max_tokens=3)),
        "eos": (ids("x"), greedy()),
        "seeded": (ids("ab"), SamplingParams(n=2, max_tokens=6, seed=7)),
    }
    finals = {}
    joined: dict[str, list[tuple[str, list[int]]]] = {}
    for kind in ("cumulative", "final_only", "delta"):
        runner = (LaunchingFakeRunner if launching else FakeRunner)(replies)
        engine = Engine(runner, EngineConfig(block_size=8, async_scheduling=launching))
        for rid, (prompt, params) in asked.items():
            engine.add_request(rid, prompt, dataclasses.replace(params, output_kind=kind))
        reported: list[RequestOutput] = []
        while engine.has_work:
            reported += engine.step()
        assert engine.blocks.num_free == engine.blocks.num_usable
        finals[kind] = {o.request_id: o for o in reported if o.finished}
        if kind == "final_only":
            assert len(reported) == len(asked) and all(o.finished for o in reported)
        if kind == "delta":
            for out in reported:
                pieces = joined.setdefault(out.request_id, [("", []) for _ in out.outputs])
                for i, o in enumerate(out.outputs):
                    assert (o.text, o.token_ids) == (o.new_text, o.new_token_ids)
                    pieces[i] = (pieces[i][0] + o.text, pieces[i][1] + o.token_ids)
    for rid in asked:
        cumulative, final = finals["cumulative"][rid], finals["final_only"][rid]
        for c, f in zip(cumulative.outputs, final.outputs, strict=True):
            assert (f.text, f.token_ids, f.finish_reason, f.stop_reason) == (
                c.text,
                c.token_ids,
                c.finish_reason,
                c.stop_reason,
            )
            assert f.new_text == f.text and f.new_token_ids == f.token_ids  # all of it is new
        assert joined[rid] == [(c.text, c.token_ids) for c in cumulative.outputs]
        reasons = [o.finish_reason for o in finals["delta"][rid].outputs]
        assert reasons == [c.finish_reason for c in cumulative.outputs]


def test_an_unknown_output_kind_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequest) as refused:
        SamplingParams(output_kind="deltas")
    assert refused.value.param == "output_kind"


def test_seeded_sequences_are_their_own_whatever_runs_beside_them() -> None:
    def alone() -> list[list[int]]:
        engine = Engine(FakeRunner({}), EngineConfig(block_size=8))
        engine.add_request("s", ids("ab"), SamplingParams(n=2, max_tokens=6, seed=7))
        return [o.token_ids for o in run(engine)["s"].outputs]

    engine = Engine(FakeRunner({"cd": "crowd"}), EngineConfig(block_size=8))
    engine.add_request("c", ids("cd"), greedy())
    engine.add_request("s", ids("ab"), SamplingParams(n=2, max_tokens=6, seed=7))
    crowd = [o.token_ids for o in run(engine)["s"].outputs]
    assert crowd == alone() and crowd[0] != crowd[1]  # seed + i per sequence


def test_a_request_the_model_fails_on_fails_alone_and_frees_its_blocks() -> None:
    bad = ALPHABET.index("z")
    engine = Engine(FakeRunner({"ok": "fine"}, fail_on=bad), EngineConfig(block_size=8))
    engine.add_request("bad", ids("zz"), greedy())
    engine.add_request("good", ids("ok"), greedy())
    finals = run(engine)
    assert finals["bad"].error is not None and finals["good"].error is None
    assert finals["good"].outputs[0].text == "fine"


def test_stats_count_what_ran() -> None:
    runner = FakeRunner({"abc": "de"})
    engine = Engine(runner, EngineConfig(block_size=8))
    engine.add_request("a", ids("abc"), greedy())
    run(engine)
    stats = engine.stats.snapshot()
    assert stats.prompt_tokens == 3 and stats.generation_tokens == 3  # d, e, EOS
    assert stats.finished == {"stop": 1} and stats.running == 0 and stats.waiting == 0
    assert runner.tokens_run == 3 + 2  # the prompt, then one token per later step
    assert stats.steps == 3 and stats.prompt_steps == 1  # the prompt's step, two decodes


REPLIES = {
    "".join(ALPHABET[(i * 7 + j) % 26] for j in range(3 + i % 9)): "reply " * (1 + i % 4)
    for i in range(12)
}


@settings(max_examples=40, deadline=None)
@given(
    order=st.permutations(sorted(REPLIES)),
    budget=st.sampled_from([8, 16, 64]),
    blocks=st.sampled_from([8, 16, 64]),
    aborts=st.dictionaries(st.sampled_from(sorted(REPLIES)), st.integers(1, 12), max_size=3),
    mode=st.sampled_from(["plain", "speculate", "overlap"]),
    hybrid=st.booleans(),
)
def test_random_load_with_chunking_preemption_and_aborts_gives_each_its_own_answer(
    order: list[str], budget: int, blocks: int, aborts: dict[str, int], mode: str, hybrid: bool
) -> None:
    """Small token budgets chunk the prompts, few blocks force preemption, drafts
    come and go, or each step is launched before the last one lands; every request
    not aborted gets exactly the text it gets alone, and ends once. ``hybrid``: the
    blocks are a hybrid model's two pools (a window of 10 in the second, as many
    blocks), whose invariants ``run`` checks after every step too."""
    config = EngineConfig(
        block_size=8,
        max_num_batched_tokens=budget,
        max_num_seqs=6,
        speculative_config=SPECULATE if mode == "speculate" else "",
        async_scheduling=mode == "overlap",
    )
    runner = (LaunchingFakeRunner if mode == "overlap" else FakeRunner)(REPLIES, num_blocks=blocks)
    if hybrid:
        runner.spec = dataclasses.replace(runner.spec, hybrid_window=10, window_blocks=blocks)
    engine = Engine(runner, config)
    assert isinstance(engine.blocks, HybridBlockManager) == hybrid
    for prompt in order:
        engine.add_request(prompt, ids(prompt), greedy(max_tokens=30))
    finals = run(engine, abort_after=aborts)
    assert finals.keys() == set(order)
    # 64 tokens for 12 requests: some must give their blocks back, unless requests
    # aborted early freed theirs (3 aborts in speculate mode once ran without one)
    if blocks == 8 and not aborts:
        assert engine.stats.snapshot().preemptions > 0
    for prompt, out in finals.items():
        if prompt in aborts and out.outputs[0].finish_reason is FinishReason.ABORT:
            continue
        assert out.outputs[0].text == REPLIES[prompt], prompt
    if isinstance(runner, LaunchingFakeRunner):
        assert runner.launched > 0
        assert_ran_the_real_tokens(runner, engine, order)


def assert_ran_the_real_tokens(
    runner: LaunchingFakeRunner, engine: Engine, prompts: list[str]
) -> None:
    """Every id the runner ran at a position is the token the request has there (its
    prompt, then its output; past its end, a token computed before its stop landed)."""
    for prompt, ran in runner.ran.items():
        rid = prompt.removesuffix("#0")
        real = [*ids(rid), *ids(REPLIES.get(rid, ""))]
        for pos, token in ran.items():
            if pos < len(real):
                assert token == real[pos], (rid, pos)
            else:
                assert token == EOS, (rid, pos)


def test_launched_steps_end_as_waiting_ones_do() -> None:
    """Asynchronous scheduling against steps that wait: the same texts, tokens,
    finish and stop reasons and counts, with stops found one step late (stop
    strings, stop tokens, a length ending a sequence while its token is in flight,
    seeded ``n``), and a penalised request's steps waiting."""
    dot = ALPHABET.index(".")
    requests = {
        "string": ("q", greedy(stop=("r, t",))),
        "token": ("x", greedy(stop_token_ids=(dot,))),
        "length": ("x", greedy(max_tokens=3)),
        "stop-at-length": ("x", greedy(max_tokens=4, stop_token_ids=(dot,))),
        "one": ("q", greedy(max_tokens=1)),
        "past-eos": ("x", greedy(max_tokens=9, ignore_eos=True)),
        "seeded": ("ab", SamplingParams(n=2, max_tokens=6, seed=7)),
        "eos": ("hi", greedy()),
    }
    replies = {"q": "the answer, then more", "x": "abc.def", "hi": "hello there"}
    finals, stats = {}, {}
    for overlap in (False, True):
        runner = (LaunchingFakeRunner if overlap else FakeRunner)(replies)
        engine = Engine(runner, EngineConfig(block_size=8, async_scheduling=overlap))
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, ids(prompt), params)
        finals[overlap] = run(engine)
        stats[overlap] = engine.stats.snapshot()
        if overlap:
            assert isinstance(runner, LaunchingFakeRunner) and runner.launched > 5
            assert runner.steps == runner.launched  # every step launched
    for rid in requests:
        pairs = zip(finals[False][rid].outputs, finals[True][rid].outputs, strict=True)
        for alone, launched in pairs:
            assert launched.text == alone.text and launched.token_ids == alone.token_ids, rid
            assert launched.finish_reason is alone.finish_reason, rid
            assert launched.stop_reason == alone.stop_reason, rid
    assert stats[True].generation_tokens == stats[False].generation_tokens
    assert stats[True].prompt_tokens == stats[False].prompt_tokens
    assert stats[True].finished == stats[False].finished


def test_a_request_that_needs_its_history_makes_its_steps_wait() -> None:
    runner = LaunchingFakeRunner({"q": "the answer", "x": "abcdef"})
    engine = Engine(runner, EngineConfig(block_size=8, async_scheduling=True))
    engine.add_request("plain", ids("q"), greedy())
    engine.add_request("penalised", ids("x"), greedy(max_tokens=3, presence_penalty=0.5))
    finals = run(engine)
    assert finals["plain"].outputs[0].text == "the answer"
    assert finals["penalised"].outputs[0].text == "abc"
    # The three steps with the penalised request waited; the plain one's later ones
    # were launched.
    assert runner.steps - runner.launched == 3 and runner.launched > 0


def test_a_launch_that_fails_runs_its_step_chunk_by_chunk() -> None:
    bad = ALPHABET.index("z")
    runner = LaunchingFakeRunner({"ok": "fine"}, fail_on=bad)
    engine = Engine(runner, EngineConfig(block_size=8, async_scheduling=True))
    engine.add_request("good", ids("ok"), greedy())
    engine.step()
    engine.step()
    engine.add_request("bad", ids("zz"), greedy())
    finals = run(engine)
    assert finals["bad"].error is not None and finals["good"].error is None
    assert finals["good"].outputs[0].text == "fine"


def test_a_step_that_fails_to_land_fails_its_sequences_and_the_engine_goes_on() -> None:
    runner = LaunchingFakeRunner({"ok": "fine", "no": "aab", "hi": "later"})
    runner.fail_landing_on = ALPHABET.index("b")
    engine = Engine(runner, EngineConfig(block_size=8, async_scheduling=True))
    engine.add_request("innocent", ids("ok"), greedy())
    engine.add_request("bad", ids("no"), greedy())
    finals = run(engine)
    # Both were in the step whose token "b" failed to land; what came before stays.
    assert finals["bad"].error is not None and finals["innocent"].error is not None
    assert finals["innocent"].outputs[0].text == "fi" and finals["bad"].outputs[0].text == "aa"
    engine.add_request("later", ids("hi"), greedy())
    assert run(engine)["later"].outputs[0].text == "later"


# Drafts of up to 4 tokens, in batches of up to 8 sequences.
SPECULATE = '{"num_speculative_tokens": 4, "disable_by_batch_size": 8}'
ECHO = {"say it twice, the cat sat. the cat sat": " on the mat. the cat sat on the mat."}


def test_drafts_verified_give_the_same_text_in_fewer_steps() -> None:
    outputs, steps = {}, {}
    for speculate in (False, True):
        runner = FakeRunner(ECHO)
        config = EngineConfig(block_size=8, speculative_config=SPECULATE if speculate else "")
        engine = Engine(runner, config)
        engine.add_request("a", ids(next(iter(ECHO))), greedy(max_tokens=64))
        outputs[speculate] = run(engine)["a"].outputs[0]
        steps[speculate] = runner.steps
    assert outputs[True].text == outputs[False].text == next(iter(ECHO.values()))
    assert outputs[True].token_ids == outputs[False].token_ids
    assert steps[True] < steps[False] * 0.7  # the repeated half came in drafts
    stats = engine.stats.snapshot()
    assert stats.spec_accepted_tokens > 0 and stats.spec_drafts > 0
    assert stats.spec_draft_tokens >= stats.spec_accepted_tokens
    assert stats.generation_tokens == len(outputs[True].token_ids)  # every token counted


def test_a_draft_accepted_past_a_stop_or_the_length_is_cut_there() -> None:
    prompt, reply = next(iter(ECHO.items()))
    period = ids(".")[0]
    for params, text in (
        (greedy(max_tokens=64, stop=("mat",)), " on the "),
        (greedy(max_tokens=20), reply[:20]),
        (greedy(max_tokens=64, stop_token_ids=(period,)), " on the mat"),  # token not shown
    ):
        engine = Engine(FakeRunner(ECHO), EngineConfig(block_size=8, speculative_config=SPECULATE))
        engine.add_request("a", ids(prompt), params)
        out = run(engine)["a"].outputs[0]
        assert out.text == text, params
        if params.stop_token_ids:
            assert out.token_ids == ids(text + ".") and out.stop_reason == period
        if params.max_tokens == 20:
            assert out.token_ids == ids(text) and out.finish_reason is FinishReason.LENGTH
        assert engine.stats.snapshot().spec_accepted_tokens > 0


def test_no_drafts_for_sampling_that_depends_on_each_token() -> None:
    engine = Engine(FakeRunner(ECHO), EngineConfig(block_size=8, speculative_config=SPECULATE))
    engine.add_request("a", ids(next(iter(ECHO))), greedy(max_tokens=64, presence_penalty=0.5))
    run(engine)
    assert engine.stats.snapshot().spec_drafts == 0


def test_a_steps_outputs_reach_their_event_loop_in_one_call() -> None:
    """The runtime thread wakes an event loop once per step, whatever the number
    of streams; each stream's queue still gets its own outputs, in order."""

    from carpool.engine.async_engine import EngineWorker, Mailbox, QueueSink

    class CountingLoop:
        calls = 0

        def call_soon_threadsafe(self, callback: object, *args: object) -> None:
            self.calls += 1
            callback(*args)  # type: ignore[operator]

    loop = CountingLoop()
    worker = EngineWorker(Engine(FakeRunner({"ab": "xyz", "cd": "uvw", "ef": "st"})), "w")
    queues = [Mailbox() for _ in range(3)]
    for i, (prompt, q) in enumerate(zip(["ab", "cd", "ef"], queues, strict=True)):
        worker.submit(f"r{i}", ids(prompt), greedy(), QueueSink(loop, q))  # type: ignore[arg-type]
    steps = 0
    while worker.poll(0.0).ready_since is not None:
        worker.run_once(0.0)
        steps += 1
        assert loop.calls == steps  # one wake-up for the step's three outputs
    texts = []
    for q in queues:
        outputs = [q.get_nowait() for _ in range(q.qsize())]
        assert outputs[-1].finished  # type: ignore[attr-defined]
        texts.append(outputs[-1].outputs[0].text)  # type: ignore[attr-defined]
    assert texts == ["xyz", "uvw", "st"]


def test_outputs_waiting_in_a_stream_join_into_one_and_an_error_still_follows() -> None:
    """A consumer that fell behind gets the outputs waiting for it as one, their new
    pieces joined in order; an error queued after them is raised after that one."""
    import asyncio

    import pytest

    from carpool.engine.async_engine import GenerationStream, Mailbox
    from carpool.engine.request_output import CompletionOutput
    from carpool.errors import ModelExecutionError

    def step(text: str, new: str, finished: bool = False) -> RequestOutput:
        tokens = ids(text)
        done = FinishReason.LENGTH if finished else None
        completion = CompletionOutput(0, text, tokens, [], new, ids(new), [], done)
        return RequestOutput("r", [1], [completion], finished)

    async def read(items: list[object]) -> list[RequestOutput]:
        queue = Mailbox()
        for item in items:
            queue.put_nowait(item)  # type: ignore[arg-type]
        stream = GenerationStream(None, "r", [1], queue)  # type: ignore[arg-type]
        return [out async for out in stream]

    [joined] = asyncio.run(read([step("a", "a"), step("ab", "b"), step("abc", "c", True)]))
    first = joined.outputs[0]
    assert joined.finished and first.new_text == first.text == "abc"
    assert first.new_token_ids == ids("abc") and first.finish_reason is FinishReason.LENGTH

    seen: list[RequestOutput] = []

    async def read_until_error() -> None:
        queue = Mailbox()
        for item in (step("a", "a"), step("ab", "b"), ModelExecutionError("boom")):
            queue.put_nowait(item)
        async for out in GenerationStream(None, "r", [1], queue):  # type: ignore[arg-type]
            seen.append(out)

    with pytest.raises(ModelExecutionError):
        asyncio.run(read_until_error())
    assert [o.outputs[0].new_text for o in seen] == ["ab"]


def test_a_mailbox_hands_outputs_over_in_order_and_survives_a_cancelled_reader() -> None:
    """A reader waiting on an empty mailbox wakes on the next put; one cancelled while
    waiting leaves the mailbox usable, the outputs put later still there, in order."""
    import asyncio
    import contextlib

    from carpool.engine.async_engine import Mailbox
    from carpool.errors import ModelExecutionError

    async def scenario() -> list[object]:
        box = Mailbox()
        waiting = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        box.put_nowait(ModelExecutionError("a"))  # no reader waits now
        got: list[object] = [await box.get()]
        reader = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        box.put_nowait(ModelExecutionError("b"))
        got.append(await reader)
        assert box.empty() and box.qsize() == 0
        return got

    assert [str(e) for e in asyncio.run(scenario())] == ["a", "b"]
