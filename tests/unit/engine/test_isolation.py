"""Nothing a request carries stops the runtime: an exception injected into any
per-request step on the runtime thread (seeding, detokenizer setup, sampling,
detokenizing, the model) fails only that request; its neighbours finish with the
output they have alone, no block leaks, and the runtime goes on. A bug escaping a
whole step fails what was in flight, and the engine serves again afterwards."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from carpool.config import EngineConfig
from carpool.engine import engine as engine_module
from carpool.engine.async_engine import EngineWorker
from carpool.engine.detokenizer import IncrementalDetokenizer
from carpool.engine.request_output import RequestOutput
from carpool.engine.sampling_params import SamplingParams
from carpool.errors import CarpoolError, InvalidRequest, ModelExecutionError
from carpool.models.causal_lm import LoadedLM, load_causal_lm
from carpool.runtime import DeviceRuntime
from carpool.workers import model_runner
from carpool.workers.factory import engine_for
from carpool.workers.sampler import sample
from tests import tiny_models
from tests.faults import FaultPlan, FaultyCausalLM

BAD_SEED = 666
BAD_STOP = "never-seen-stop"
POISON = 77
GOOD = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, smollm_folder: Path) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    return tiny_models.build("llama", folder, smollm_folder), folder


@pytest.fixture(scope="module")
def tiny(built: tuple[Any, Path]) -> LoadedLM:
    return load_causal_lm(built[1], progress=False)


class Collector:
    """A request's sink: records what the runtime hands over, flags the end."""

    def __init__(self) -> None:
        self.items: list[RequestOutput | CarpoolError] = []
        self.ended = threading.Event()

    def __call__(self, item: RequestOutput | CarpoolError) -> None:
        self.items.append(item)
        if isinstance(item, CarpoolError) or item.finished:
            self.ended.set()

    def final(self) -> RequestOutput | CarpoolError:
        assert self.ended.wait(60), "the request never ended"
        return self.items[-1]


@pytest.fixture
def served(tiny: LoadedLM) -> Iterator[tuple[EngineWorker, DeviceRuntime]]:
    engine = engine_for(tiny, EngineConfig(kv_cache_memory="16MiB"))
    worker = EngineWorker(engine, "tiny")
    runtime = DeviceRuntime()
    runtime.register(worker)
    runtime.start()
    yield worker, runtime
    runtime.stop()


def greedy(**extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **extra)


def alone(lm: LoadedLM, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = engine_for(lm, EngineConfig(kv_cache_memory="16MiB"))
    engine.add_request("x", prompt, params)
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("no output")


def submit_together(
    worker: EngineWorker, requests: list[tuple[list[int], SamplingParams]]
) -> list[RequestOutput | CarpoolError]:
    sinks = [Collector() for _ in requests]
    worker.submit_many(
        [
            (worker.new_request_id(), p, params, s)
            for (p, params), s in zip(requests, sinks, strict=True)
        ]
    )
    return [s.final() for s in sinks]


def _inject(fault: str, monkeypatch: pytest.MonkeyPatch, tiny: LoadedLM) -> SamplingParams:
    """Make ``fault``'s step raise for one request; the parameters that mark it."""
    if fault == "seeding":
        real_generator = model_runner.ModelRunner.make_generator

        def make_generator(self: model_runner.ModelRunner, seed: int) -> torch.Generator:
            if seed == BAD_SEED:
                raise RuntimeError("injected: seeding failed")
            return real_generator(self, seed)

        monkeypatch.setattr(model_runner.ModelRunner, "make_generator", make_generator)
        return greedy(seed=BAD_SEED)
    if fault in ("detokenizer_setup", "detokenizing"):

        class Faulty(IncrementalDetokenizer):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                if fault == "detokenizer_setup" and BAD_STOP in self._stop:
                    raise RuntimeError("injected: detokenizer setup failed")

            def push(self, token_id: int) -> str:
                if BAD_STOP in self._stop:
                    raise RuntimeError("injected: detokenizing failed")
                return super().push(token_id)

        monkeypatch.setattr(engine_module, "IncrementalDetokenizer", Faulty)
        return greedy(stop=(BAD_STOP,))
    if fault == "sampling":

        def faulty_sample(logits: torch.Tensor, rows: list[Any]) -> Any:
            if any(r.params.seed == BAD_SEED for r in rows):
                raise RuntimeError("injected: sampling failed")
            return sample(logits, rows)

        monkeypatch.setattr(model_runner, "sample", faulty_sample)
        return greedy(seed=BAD_SEED)
    assert fault == "model"
    monkeypatch.setattr(tiny, "model", FaultyCausalLM(tiny.model, FaultPlan(fail_on_token=POISON)))
    return greedy()


@pytest.mark.parametrize(
    "fault", ["seeding", "detokenizer_setup", "sampling", "detokenizing", "model"]
)
def test_a_failing_step_fails_only_its_request(
    fault: str,
    tiny: LoadedLM,
    served: tuple[EngineWorker, DeviceRuntime],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expected = [alone(tiny, p, greedy()) for p in GOOD]
    worker, runtime = served
    bad_params = _inject(fault, monkeypatch, tiny)
    bad_prompt = [3, POISON, 4] if fault == "model" else [3, 4]
    bad, *good = submit_together(worker, [(bad_prompt, bad_params), *((p, greedy()) for p in GOOD)])
    if isinstance(bad, RequestOutput):
        assert bad.finished and bad.error, fault
    else:
        assert isinstance(bad, ModelExecutionError), fault
    assert [g.outputs[0].token_ids for g in good if isinstance(g, RequestOutput)] == expected
    assert runtime.alive and runtime.error is None
    assert worker.engine.blocks.num_free == worker.engine.blocks.num_blocks
    assert worker.engine.num_unfinished == 0 and worker.num_waiting == 0


def test_a_bug_escaping_a_step_fails_what_is_in_flight_and_the_engine_goes_on(
    tiny: LoadedLM, served: tuple[EngineWorker, DeviceRuntime], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, runtime = served
    real_update = worker.engine.scheduler.update
    calls = {"n": 0}

    def update_once_broken(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected: a bug in the scheduler")
        return real_update(*args)

    monkeypatch.setattr(worker.engine.scheduler, "update", update_once_broken)
    first = submit_together(worker, [(p, greedy()) for p in GOOD])
    assert all(isinstance(r, ModelExecutionError) for r in first)
    assert worker.engine.blocks.num_free == worker.engine.blocks.num_blocks
    again = submit_together(worker, [(p, greedy()) for p in GOOD])
    assert [r.outputs[0].token_ids for r in again if isinstance(r, RequestOutput)] == [
        alone(tiny, p, greedy()) for p in GOOD
    ]
    assert runtime.alive and worker.num_waiting == 0


def test_values_that_reach_torch_are_refused_or_made_safe(tiny: LoadedLM) -> None:
    with pytest.raises(InvalidRequest) as seed:
        SamplingParams(seed=2**64)
    assert seed.value.param == "seed"
    SamplingParams(seed=-(2**63))
    SamplingParams(seed=2**63 - 1, n=16)  # seed + i stays within torch's range
    engine = engine_for(tiny, EngineConfig(kv_cache_memory="16MiB"))
    with pytest.raises(InvalidRequest) as stop:
        engine.check_request([5, 6], greedy(stop_token_ids=(tiny.config.vocab_size,)))
    assert stop.value.param == "stop_token_ids"
    # 1e-40 is 0 in float32: sampled at that temperature, a row would divide by 0.
    tiny_temperature = SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True, seed=1)
    assert tiny_temperature.greedy
    assert alone(tiny, GOOD[0], tiny_temperature) == alone(tiny, GOOD[0], greedy())


def test_prompt_logprobs_match_a_full_forward(built: tuple[Any, Path], tiny: LoadedLM) -> None:
    """Chunked (a 4-token step budget) and after the same prompt was cached: each
    prompt token's logprob is the reference model's, given the tokens before it."""
    hf_model, _ = built
    prompt = [5, 9, 33, 17, 42, 8, 101, 64, 7, 250, 3, 19, 44, 21, 90, 11, 13, 300]
    engine = engine_for(
        tiny, EngineConfig(kv_cache_memory="16MiB", max_num_batched_tokens=4, block_size=8)
    )
    engine.add_request("warm", prompt, greedy())  # fills the prefix cache
    engine.add_request("p", prompt, greedy(prompt_logprobs=2))
    finals: dict[str, RequestOutput] = {}
    while engine.has_work:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    got = finals["p"].prompt_logprobs
    assert got is not None and got[0] is None and len(got) == len(prompt)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    for position, entry in enumerate(got[1:], start=1):
        assert entry is not None
        want = float(reference[position - 1, prompt[position]])
        assert entry.logprob == pytest.approx(want, abs=1e-4)
        top = reference[position - 1].topk(2)
        assert [t for t, _ in entry.top] == top.indices.tolist()
