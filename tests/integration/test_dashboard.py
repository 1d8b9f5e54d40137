"""The live dashboard in a real headless browser (Debian's Chromium driven by
Playwright, nothing downloaded): under load its charts fill, its numbers match
/metrics, and behind --api-key it asks for the key and never logs it. The page's
screenshot is saved to ``test-artifacts/`` (or ``$CARPOOL_TEST_ARTIFACTS``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.integration.conftest import CHAT, MODEL, Server, greedy_body, start_server, stop_server

KEY = "dashboard-key-5531"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_repository"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(
    os.environ.get("CARPOOL_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts")
)
GENERATIONS, EMBEDDINGS, USER_REQUESTS = 12, 12, 12
WAIT_MS = 60_000
MAX_ROUNDS = 20
# A sample of at least two requests running together (what the requests chart must show).
SAW_RUNNING = "(m) => window.carpoolDashboard.last?.models[m].series.running.some((x) => x >= 2)"


USER = "mlp_classifier"  # a repository model beside the built-in ones
IDLE = "python_batched_service"  # one that no test sends a request
SPAN_S = 120  # the charts' time axis: the last two minutes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repository = tmp_path_factory.mktemp("dashboard-repository")
    shutil.copytree(EXAMPLES / USER, repository / USER)
    shutil.copytree(EXAMPLES / IDLE, repository / IDLE)
    s = start_server(
        "--api-key",
        KEY,
        "--model",
        CHAT,
        "--model",
        MODEL,
        "--model-repository",
        str(repository),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
    )
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    assert Path(chromium).exists(), "Chromium is missing: bash scripts/install.sh --dev installs it"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield b
        b.close()


def load(server: Server) -> None:
    """Generation, embedding and repository-model requests at once, six at a time."""

    def one(i: int) -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
            if i < GENERATIONS:
                body = greedy_body(f"Request {i}: tell me a story about a carpool.", 24)
                c.post("/v1/completions", json=body).raise_for_status()
            elif i < GENERATIONS + EMBEDDINGS:
                body = {"model": MODEL, "input": [f"sentence {i} {j}" for j in range(3)]}
                c.post("/v1/embeddings", json=body).raise_for_status()
            else:
                x = {"name": "features", "shape": [2, 16], "datatype": "FP32", "data": [0.5] * 32}
                c.post(f"/v2/models/{USER}/infer", json={"inputs": [x]}).raise_for_status()

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(GENERATIONS + EMBEDDINGS + USER_REQUESTS)))


def metric_sum(server: Server, name: str, **labels: str) -> int:
    """The sum of /metrics samples named ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.client() as c:
        text = c.get("/metrics").text
    return int(
        sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()
        )
    )


def shown(page: Page, owner: str, metric: str) -> str:
    return page.inner_text(f'[data-metric="{owner}/{metric}"]')


def wait_shown(page: Page, owner: str, metric: str, want: int) -> None:
    """Wait until the page (polling once a second) shows ``want``."""
    page.wait_for_function(
        "([sel, want]) => document.querySelector(sel)?.textContent === want",
        arg=[f'[data-metric="{owner}/{metric}"]', str(want)],
        timeout=WAIT_MS,
    )


def drawn(page: Page, owner: str) -> list[dict[str, Any]]:
    """Each chart of ``owner``: its id and the largest value of each line drawn."""
    result: list[dict[str, Any]] = page.evaluate(
        """(owner) => window.carpoolDashboard.charts[owner].map((c) => ({
            id: c.plot.root.parentElement.dataset.chart,
            points: c.data[0].length,
            max: c.data.slice(1).map((line) => Math.max(0, ...line.filter((v) => v !== null))),
        }))""",
        owner,
    )
    return result


def chart_state(page: Page) -> list[dict[str, Any]]:
    """What uPlot holds for every chart: its owner and id, the x scale's range, the
    length of each data array, how many points the server sent and the sample's time."""
    result: list[dict[str, Any]] = page.evaluate(
        """() => {
            const d = window.carpoolDashboard;
            return Object.entries(d.charts).flatMap(([owner, charts]) => charts.map((c) => ({
                owner: owner,
                id: c.plot.root.parentElement.dataset.chart,
                xmin: c.plot.scales.x.min,
                xmax: c.plot.scales.x.max,
                lengths: c.plot.data.map((line) => line.length),
                sent: (owner === "runtime" ? d.last.runtime : d.last.models[owner]).series.t.length,
                time: d.last.time,
                empty: !c.empty.hidden,
            })));
        }"""
    )
    return result


def test_under_load_the_charts_fill_and_the_numbers_match_metrics(
    server: Server, browser: Browser, tmp_path: Path
) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    page.goto(f"{server.url}/dashboard#key={KEY}")
    assert "key=" not in page.url  # the key left the address bar for session storage
    page.wait_for_function("window.carpoolDashboard.frames > 0", timeout=WAIT_MS)
    # The page samples once a second and a round of load can be shorter than that: load
    # again until a sample caught several requests running in the engine (each round
    # waits for the page to draw a sample taken after it ended).
    rounds = 0
    while not page.evaluate(SAW_RUNNING, CHAT):
        assert rounds < MAX_ROUNDS, f"no sample caught the engine running in {rounds} rounds"
        load(server)
        rounds += 1
        frames = page.evaluate("window.carpoolDashboard.frames")
        page.wait_for_function(
            "(n) => window.carpoolDashboard.frames >= n + 2", arg=frames, timeout=WAIT_MS
        )
    want = {
        (CHAT, "generation_tokens"): metric_sum(server, "carpool_generation_tokens_total"),
        (CHAT, "prompt_tokens"): metric_sum(server, "carpool_prompt_tokens_total"),
        (CHAT, "finished"): metric_sum(server, "carpool_request_success_total"),
        (CHAT, "steps"): metric_sum(server, "carpool_engine_steps_total"),
        (CHAT, "preemptions"): metric_sum(server, "carpool_num_preemptions_total"),
        (MODEL, "success"): metric_sum(
            server, "carpool_requests_total", model=MODEL, outcome="success"
        ),
        (MODEL, "batches"): metric_sum(server, "carpool_batches_total", model=MODEL),
        ("runtime", f"units:{CHAT}"): metric_sum(server, "carpool_runtime_units_total", model=CHAT),
        ("runtime", f"units:{MODEL}"): metric_sum(
            server, "carpool_runtime_units_total", model=MODEL
        ),
    }
    assert want[CHAT, "generation_tokens"] == rounds * GENERATIONS * 24
    assert want[CHAT, "finished"] == rounds * GENERATIONS
    assert want[MODEL, "success"] == rounds * 3 * EMBEDDINGS
    for (owner, metric), value in want.items():
        wait_shown(page, owner, metric, value)
    # The charts hold what the load did: tokens flowing, steps of several tokens,
    # batches of several inputs, and both models taking turns on the device.
    chat = {c["id"]: c for c in drawn(page, CHAT)}
    assert chat["tokens"]["max"][0] > 0 and chat["step"]["max"][0] > 1
    assert chat["requests"]["max"][0] >= 2 and chat["kv"]["max"][0] > 0
    embed = {c["id"]: c for c in drawn(page, MODEL)}
    assert embed["rate"]["max"][0] > 0 and embed["batch"]["max"][0] >= 1
    user = {c["id"]: c for c in drawn(page, USER)}
    assert user["rate"]["max"][0] > 0 and user["batch"]["max"][0] >= 2  # rows of 2
    assert user["queue"]["max"][0] > 0
    [share] = drawn(page, "runtime")
    assert all(top > 0 for top in share["max"]) and len(share["max"]) == 3
    # What is drawn: every chart spans the last two minutes of clock time, in seconds,
    # ending at the sample, with one point per sample pair the server sent.
    frames = page.evaluate("window.carpoolDashboard.frames")
    page.wait_for_function("(n) => window.carpoolDashboard.frames > n", arg=frames)
    charts = chart_state(page)
    assert {(c["owner"], c["id"]) for c in charts} >= {(USER, "queue"), (CHAT, "tokens")}
    for chart in charts:
        assert chart["xmax"] == pytest.approx(chart["time"]), chart
        assert chart["xmax"] - chart["xmin"] == pytest.approx(SPAN_S), chart
        assert chart["sent"] >= 3, chart
        assert set(chart["lengths"]) == {chart["sent"]}, chart
        assert chart["empty"] == (chart["owner"] == IDLE and chart["id"] == "queue"), chart
    assert page.inner_text("#status").startswith("updated")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for shot in (ARTIFACTS / "dashboard.png", tmp_path / "dashboard.png"):
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 20_000
    page.close()


def test_without_the_key_the_page_asks_for_it_and_the_key_stays_out_of_the_log(
    server: Server, browser: Browser
) -> None:
    with httpx.Client(base_url=server.url) as c:
        assert c.get("/dashboard").status_code == 200  # the page holds no data
        assert c.get("/dashboard/assets/vendor/uPlot.iife.min.js").status_code == 200
        assert c.get("/dashboard/stats").status_code == 401
        assert c.get("/dashboard/stats", headers=AUTH).status_code == 200
    page = browser.new_page()
    page.goto(f"{server.url}/dashboard")
    page.wait_for_selector("#key-form:not([hidden])", timeout=WAIT_MS)
    assert "API key" in page.inner_text("#status")
    page.fill("#key-input", KEY)
    page.click("#key-form button")
    page.wait_for_function("window.carpoolDashboard.frames > 0", timeout=WAIT_MS)
    assert shown(page, CHAT, "running") != "–"
    page.close()
    assert not any(KEY in line for line in server.log)


def test_an_empty_chart_says_why(server: Server, browser: Browser) -> None:
    page = browser.new_page()
    page.goto(f"{server.url}/dashboard#key={KEY}")
    page.wait_for_function(
        "(m) => window.carpoolDashboard.last?.models[m]?.series.t.length >= 1",
        arg=IDLE,
        timeout=WAIT_MS,
    )
    charts = {c["id"]: c for c in chart_state(page) if c["owner"] == IDLE}
    # No request ever reached it: its queue time has no value to draw and says so,
    # while its request rate (zero) and its queue length (zero) are drawn.
    assert charts["queue"]["empty"] and not charts["rate"]["empty"]
    text = page.inner_text(f'section[data-model="{IDLE}"] [data-chart="queue"] .empty')
    assert text == "no requests yet"
    for chart in charts.values():
        assert chart["xmax"] - chart["xmin"] == pytest.approx(SPAN_S), chart
    page.close()


def test_a_model_unloaded_leaves_the_page_and_comes_back_when_loaded(
    server: Server, browser: Browser
) -> None:
    page = browser.new_page()
    page.goto(f"{server.url}/dashboard#key={KEY}")
    section = f'section[data-model="{IDLE}"]'
    page.wait_for_selector(section, timeout=WAIT_MS)
    with server.client() as c:
        c.post(f"/v2/repository/models/{IDLE}/unload", headers=AUTH).raise_for_status()
        page.wait_for_selector(section, state="detached", timeout=WAIT_MS)
        assert IDLE not in page.evaluate("() => Object.keys(window.carpoolDashboard.charts)")
        assert page.is_visible(f'section[data-model="{USER}"]')  # the others stay
        c.post(f"/v2/repository/models/{IDLE}/load", headers=AUTH).raise_for_status()
    page.wait_for_selector(section, timeout=WAIT_MS)
    assert page.locator(section).count() == 1
    page.close()
