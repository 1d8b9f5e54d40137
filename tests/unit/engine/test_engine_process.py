"""What crosses an engine process's pipe: each step's outputs as tuples of what the
step added, rebuilt on the server's side into exactly the outputs the engine made
(text, tokens, finish and stop reasons, ``n`` sequences, stop strings held back);
errors keep their fields when pickled; the sender thread keeps the order, ends a clean
stop with the stop marker and a dying engine without one; the step loop takes what its
receiver thread read off the pipe, and ends on a stop or when the server's end closes.
Torch-free, with the core tests' fake runner."""

from __future__ import annotations

import multiprocessing
import pickle
import threading

from carpool.config import EngineConfig
from carpool.engine.async_engine import EngineWorker
from carpool.engine.engine import Engine
from carpool.engine.engine_process import (
    SENDS_AHEAD,
    _Held,
    _Outputs,
    _Sender,
    _Stop,
    _Submit,
    _to_wire,
    serve_engine,
)
from carpool.engine.request_output import RequestOutput
from carpool.engine.sampling_params import SamplingParams
from carpool.errors import InvalidRequest, Overloaded, RuntimeDead
from tests.unit.engine.test_engine_core import FakeRunner, ids


def _sink(item: object) -> None:
    raise AssertionError("the rebuilt outputs are compared, not delivered")


def test_outputs_cross_the_wire_unchanged() -> None:
    engine = Engine(FakeRunner({"q": "the answer, then more", "hi": "hello"}), EngineConfig())
    requests = {
        "stops": (ids("q"), SamplingParams(max_tokens=40, temperature=0.0, stop=["then"])),
        "eos": (ids("hi"), SamplingParams(max_tokens=40, temperature=0.0)),
        "seeded": (ids("ab"), SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=7)),
    }
    held = {rid: _Held(_sink, prompt) for rid, (prompt, _) in requests.items()}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    seen: list[RequestOutput] = []
    while engine.has_work:
        for out in engine.step():
            seen.append(out)
            wire = pickle.loads(pickle.dumps(_to_wire(out)))
            assert held[out.request_id].output(wire) == out
    finals = {o.request_id: o for o in seen if o.finished}
    assert finals["stops"].outputs[0].text == "the answer, "
    assert [len(c.token_ids) for c in finals["seeded"].outputs] == [6, 6]
    assert len(seen) > len(finals)  # intermediate outputs were rebuilt too


def test_errors_pickle_with_their_fields() -> None:
    refused = pickle.loads(pickle.dumps(InvalidRequest("bad", param="max_tokens")))
    assert type(refused) is InvalidRequest
    assert (refused.message, refused.param, str(refused)) == ("bad", "max_tokens", "bad")
    busy = pickle.loads(pickle.dumps(Overloaded("full", retry_after_s=3.0)))
    assert type(busy) is Overloaded and busy.retry_after_s == 3.0 and busy.message == "full"


def news(i: int) -> _Outputs:
    return _Outputs([], [(f"r{i}", InvalidRequest(f"n{i}"))], None)


def received(reader: multiprocessing.connection.Connection) -> list[object]:
    """Everything on the pipe until it is closed."""
    got: list[object] = []
    while True:
        try:
            item = reader.recv()
        except EOFError:
            return got
        got.append(item.errors[0][0] if isinstance(item, _Outputs) else item)


def test_the_sender_keeps_the_order_and_ends_a_clean_stop_with_the_marker_only() -> None:
    count = 3 * SENDS_AHEAD  # more than it holds: small enough for the pipe's buffer
    for stopped, last in ((True, [None]), (False, [])):
        reader, writer = multiprocessing.Pipe()
        sender = _Sender(writer)
        for i in range(count):
            sender.send(news(i))
        sender.close(stopped)
        writer.close()
        assert received(reader) == [*(f"r{i}" for i in range(count)), *last]


def test_a_sender_whose_reader_is_gone_says_so_and_lets_the_step_loop_go_on() -> None:
    reader, writer = multiprocessing.Pipe()
    sender = _Sender(writer)
    reader.close()
    for i in range(3 * SENDS_AHEAD):  # would block on a full queue if nothing drained it
        sender.send(news(i))
    assert sender.gone.wait(10)
    sender.close(stopped=True)


def _serving() -> tuple[multiprocessing.connection.Connection, threading.Thread]:
    """An engine served on a thread over a real pipe; the server's end of it."""
    server, engine_end = multiprocessing.Pipe()
    worker = EngineWorker(Engine(FakeRunner({"hi": "hello there"}), EngineConfig()), "fake")
    loop = threading.Thread(target=serve_engine, args=(engine_end, worker), daemon=True)
    loop.start()
    return server, loop


def test_the_step_loop_answers_what_its_receiver_read_and_ends_on_a_stop() -> None:
    server, loop = _serving()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    server.send(_Submit([("a", ids("hi"), params), ("b", ids("hi"), params)], 0, None))
    text: dict[str, str] = {"a": "", "b": ""}
    finished: set[str] = set()
    while finished != {"a", "b"}:
        news = server.recv()
        for request_id, done, _, _, _, completions in news.outputs:
            text[request_id] += "".join(c[1] for c in completions)
            if done:
                finished.add(request_id)
    assert text["a"] == text["b"] and text["a"].startswith("hello")
    server.send(_Stop(RuntimeDead("stopping")))
    while (last := server.recv()) is not None:  # news up to the stop marker
        assert isinstance(last, _Outputs)
    loop.join(10)
    assert not loop.is_alive()


def test_the_step_loop_ends_when_the_servers_end_of_the_pipe_closes() -> None:
    server, loop = _serving()
    server.close()
    loop.join(10)
    assert not loop.is_alive()
