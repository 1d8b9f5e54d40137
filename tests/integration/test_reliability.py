"""Nothing is lost: faults, disconnect storms, overload, shutdown under load and a
soak, each against a real server, bounded in count and time. Every accepted
request ends with exactly one terminal outcome; nothing leaks; a failure stays
with the requests it belongs to."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.conftest import Server, rss_bytes, start_server, stop_server, wait_for
from tests.integration.conftest import greedy_body as completion

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
POISON = 29999  # fails the model when a prompt holds it
KILLER = 29998  # kills the device runtime when a prompt holds it


def idle(server: Server) -> bool:
    return (
        server.metric("carpool_num_requests_running", model=CHAT) == 0
        and server.metric("carpool_num_requests_waiting", model=CHAT) == 0
        and server.metric("carpool_kv_cache_usage_perc", model=CHAT) == 0
    )


@pytest.fixture(scope="module")
def faulty() -> Iterator[Server]:
    plan = json.dumps({"fail_on_token": POISON, "kill_runtime_on_token": KILLER})
    s = start_server("--kv-cache-memory", "128MiB", faults=plan)
    yield s
    s.process.kill()  # the last test kills its runtime


def test_a_failing_generation_request_fails_alone(faulty: Server) -> None:
    good = [[100 + i, 200 + i, 300 + i] for i in range(4)]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=faulty.url, timeout=120) as c:
            alone = [await c.post("/v1/completions", json=completion(p, 8)) for p in good[:1]]
            mixed = await asyncio.gather(
                c.post("/v1/completions", json=completion([5, POISON, 6], 8)),
                *(c.post("/v1/completions", json=completion(p, 8)) for p in good),
            )
            return alone + list(mixed)

    alone, bad, *neighbours = asyncio.run(run())
    assert bad.status_code == 500 and "Traceback" not in bad.text
    assert bad.json()["error"]["type"] == "model_error"
    assert [r.status_code for r in neighbours] == [200] * 4
    assert neighbours[0].json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    wait_for(lambda: idle(faulty))


def test_a_failing_embedding_input_fails_alone(faulty: Server) -> None:
    texts = ["first sentence", "second sentence", "third one"]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=faulty.url, timeout=60) as c:
            return list(
                await asyncio.gather(
                    c.post("/v1/embeddings", json={"model": EMBED, "input": [101, POISON, 102]}),
                    *(c.post("/v1/embeddings", json={"model": EMBED, "input": t}) for t in texts),
                )
            )

    bad, *good = asyncio.run(run())
    assert bad.status_code == 500 and "Traceback" not in bad.text
    assert [r.status_code for r in good] == [200] * 3


def test_when_the_runtime_dies_health_fails_and_the_process_exits_nonzero(faulty: Server) -> None:
    with httpx.Client(base_url=faulty.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json=completion([7, KILLER], 4))
        assert r.status_code == 503 and "Traceback" not in r.text
        try:  # the very next probe after the failed request
            health = c.get("/health").status_code
        except httpx.TransportError:
            health = None  # already gone: also not healthy
        assert health in (503, None)
    assert faulty.process.wait(timeout=60) != 0


@pytest.fixture(scope="module")
def busy() -> Iterator[Server]:
    s = start_server(
        "--model",
        CHAT,
        "--kv-cache-memory",
        "256MiB",
        "--max-num-seqs",
        "64",
        "--max-waiting-requests",
        "512",
    )
    yield s
    assert stop_server(s) == 0


def test_disconnect_storm_leaves_nothing_behind(busy: Server) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randint(4, 40))] for _ in range(8)]
    with httpx.Client(base_url=busy.url, timeout=120) as c:
        solo = [
            c.post("/v1/completions", json=completion(p, 8)).json()["choices"][0]["text"]
            for p in prompts
        ]
    idle_kv = busy.metric("carpool_kv_cache_usage_perc", model=CHAT)
    outcomes: dict[str, int] = {"complete": 0, "cut": 0, "mismatch": 0}

    async def one(c: httpx.AsyncClient, i: int) -> None:
        p = i % len(prompts)
        cut_after = rng.choice([0, 1, 2, 4]) if i % 2 else None  # half are cut
        text, events = "", 0
        async with c.stream(
            "POST", "/v1/completions", json=completion(prompts[p], 8, stream=True)
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if cut_after is not None and events >= cut_after:
                    outcomes["cut"] += 1
                    return  # leaving the block closes the connection mid-stream
                events += 1
                text += json.loads(line[6:])["choices"][0]["text"]
        outcomes["complete" if text == solo[p] else "mismatch"] += 1

    async def storm() -> None:
        async with httpx.AsyncClient(
            base_url=busy.url, timeout=300, limits=httpx.Limits(max_connections=200)
        ) as c:
            await asyncio.gather(*(one(c, i) for i in range(200)))

    asyncio.run(storm())
    assert outcomes == {"complete": 100, "cut": 100, "mismatch": 0}
    wait_for(lambda: idle(busy))
    assert busy.metric("carpool_kv_cache_usage_perc", model=CHAT) == idle_kv == 0


def test_a_burst_of_ten_times_capacity_gets_answers_or_503s(tmp_path: object) -> None:
    s = start_server(
        "--model",
        CHAT,
        "--max-num-seqs",
        "4",
        "--max-waiting-requests",
        "8",
        "--kv-cache-memory",
        "64MiB",
    )
    try:
        before = rss_bytes(s)
        with httpx.Client(base_url=s.url, timeout=60) as c:
            expected = c.post("/v1/completions", json=completion([10, 11, 12], 4)).json()

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=120)
            async with httpx.AsyncClient(base_url=s.url, timeout=120, limits=limits) as c:
                return list(
                    await asyncio.gather(
                        *(
                            c.post("/v1/completions", json=completion([10, 11, 12], 4))
                            for _ in range(120)
                        )
                    )
                )

        responses = asyncio.run(burst())  # none hung: the client's timeout would raise
        codes = [r.status_code for r in responses]
        print(f"burst: 120 sent, {codes.count(200)} answered 200, {codes.count(503)} got 503")
        assert set(codes) <= {200, 503} and codes.count(200) >= 8 and codes.count(503) >= 1
        for r in responses:
            if r.status_code == 503:
                assert int(r.headers["Retry-After"]) >= 1
            else:
                assert r.json()["choices"] == expected["choices"]
        wait_for(lambda: idle(s))
        assert rss_bytes(s) < before * 1.5
        with httpx.Client(base_url=s.url, timeout=60) as c:
            after = c.post("/v1/completions", json=completion([10, 11, 12], 4))
        assert after.status_code == 200 and after.json()["choices"] == expected["choices"]
    finally:
        assert stop_server(s) == 0


def test_sigterm_under_load_finishes_in_flight_refuses_new_and_exits_0() -> None:
    s = start_server("--model", CHAT, "--kv-cache-memory", "64MiB", "--shutdown-timeout-s", "60")
    results: list[httpx.Response] = []

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
            in_flight = [
                asyncio.ensure_future(
                    c.post("/v1/completions", json=completion([20 + i, 21, 22], 16))
                )
                for i in range(6)
            ]
            await asyncio.to_thread(
                wait_for, lambda: s.metric("carpool_num_requests_running", model=CHAT) >= 1
            )
            s.process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(wait_for, lambda: _refuses(s))
            late = await c.post("/v1/completions", json=completion([1, 2, 3], 4))
            return list(await asyncio.gather(*in_flight)), late

    results, late = asyncio.run(run())
    assert [r.status_code for r in results] == [200] * 6
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in results)
    assert late.status_code == 503 and late.headers["Retry-After"] == "1"
    assert s.process.wait(timeout=60) == 0


def _refuses(s: Server) -> bool:
    with httpx.Client(base_url=s.url, timeout=10) as c:
        return c.get("/v2/health/ready").status_code == 503


SOAK_REQUESTS = 600  # twice the warm-up; the suite's 20 minutes bound it


@pytest.mark.slow
def test_soak_of_mixed_requests_leaks_no_memory_tasks_or_threads() -> None:
    s = start_server("--kv-cache-memory", "128MiB", "--max-waiting-requests", "4096")
    rng = random.Random(3)
    outcomes: dict[str, int] = {}

    async def one(c: httpx.AsyncClient, kind: str) -> None:
        prompt = [rng.randrange(100, 20000) for _ in range(rng.randint(3, 30))]
        if kind == "embed":
            r = await c.post(
                "/v1/embeddings", json={"model": EMBED, "input": f"text {rng.random()}"}
            )
            status = r.status_code
        elif kind == "chat":
            r = await c.post(
                "/v1/chat/completions",
                json={
                    "model": CHAT,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"hello {rng.random()}"}],
                },
            )
            status = r.status_code
        elif kind == "complete":
            status = (await c.post("/v1/completions", json=completion(prompt, 2))).status_code
        else:
            status = 200
            async with c.stream(
                "POST", "/v1/completions", json=completion(prompt, 4, stream=True)
            ) as r:
                async for line in r.aiter_lines():
                    if kind == "cancel" and line.startswith("data: "):
                        status = 499
                        break
        key = f"{kind}:{status}"
        outcomes[key] = outcomes.get(key, 0) + 1

    async def wave(count: int) -> None:
        kinds = rng.choices(
            ["embed", "chat", "complete", "stream", "cancel"], weights=[60, 10, 15, 10, 5], k=count
        )
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=s.url, timeout=300, limits=limits) as c:
            queue = list(kinds)

            async def worker() -> None:
                while queue:
                    await one(c, queue.pop())

            await asyncio.gather(*(worker() for _ in range(32)))

    try:
        asyncio.run(wave(300))  # warm-up: caches, pools and buffers reach their size
        wait_for(lambda: idle(s))
        rss_warm = rss_bytes(s)
        tasks_warm = s.metric("carpool_event_loop_tasks")
        threads_warm = s.metric("carpool_threads")
        outcomes.clear()
        asyncio.run(wave(SOAK_REQUESTS))
        wait_for(lambda: idle(s))
        print(
            f"soak: {sorted(outcomes.items())}; RSS after warm-up {rss_warm >> 20} MiB, "
            f"after {SOAK_REQUESTS} {rss_bytes(s) >> 20} MiB; tasks {tasks_warm:.0f}, threads "
            f"{threads_warm:.0f}"
        )
        assert sum(outcomes.values()) == SOAK_REQUESTS
        assert all(k.endswith((":200", ":499")) for k in outcomes), outcomes
        assert rss_bytes(s) <= rss_warm * 1.10
        assert s.metric("carpool_event_loop_tasks") == tasks_warm
        assert s.metric("carpool_threads") == threads_warm
    finally:
        assert stop_server(s) == 0
