// carpool's live dashboard: polls /dashboard/stats once a second and draws what it
// returns with uPlot. The server derives every number (rates, means, percentiles);
// this script only lays them out. window.carpoolDashboard exposes what was drawn.
"use strict";
(function () {
  const POLL_MS = 1000;
  // The charts' time axis: the last two minutes in clock time (the server keeps that
  // much), whatever the data holds. Left to uPlot, one point made an axis of years.
  const SPAN_S = 120;
  const KEY = "carpool-api-key";
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
  const state = { frames: 0, last: null, charts: {}, kinds: {}, runtimeWorkers: "", error: null };
  window.carpoolDashboard = state;

  // The key may come in the URL fragment (never sent to the server, so never in a
  // log); it is moved to session storage and the fragment is dropped from the URL.
  function takeKey() {
    const match = /(?:^#|&)key=([^&]*)/.exec(location.hash);
    if (match) {
      sessionStorage.setItem(KEY, decodeURIComponent(match[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem(KEY) || "";
  }
  let apiKey = takeKey();

  const form = document.getElementById("key-form");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    apiKey = document.getElementById("key-input").value;
    sessionStorage.setItem(KEY, apiKey);
    form.hidden = true;
  });

  const ms = (s) => (s === null || s === undefined ? "–" : (s * 1000).toFixed(1) + " ms");
  const pct = (x) => (x === null || x === undefined ? "–" : (x * 100).toFixed(1) + " %");
  const int = (n) => String(n);
  const sum = (obj) => Object.values(obj).reduce((a, b) => a + b, 0);
  const pairs = (obj) => Object.entries(obj).map(([k, v]) => k + ": " + v).join(", ") || "none";

  // What each kind of model shows: [metric id, label, value from the model's view].
  const STATS = {
    generation: [
      ["running", "running", (m) => int(last(m.series.running))],
      ["waiting", "waiting", (m) => int(last(m.series.waiting))],
      ["kv_usage", "KV cache use", (m) => pct(last(m.series.kv_usage))],
      ["generation_tokens", "output tokens", (m) => int(m.totals.generation_tokens)],
      ["prompt_tokens", "prompt tokens", (m) => int(m.totals.prompt_tokens)],
      ["finished", "finished requests", (m) => int(sum(m.totals.finished))],
      ["steps", "engine steps", (m) => int(m.totals.steps)],
      ["preemptions", "preemptions", (m) => int(m.totals.preemptions)],
      ["prefix_hit_rate", "prefix-cache hits (1 min)", (m) => pct(m.window.prefix_cache_hit_rate)],
      ["spec_acceptance", "draft tokens accepted (1 min)", (m) => pct(m.window.spec_acceptance)],
      ["ttft_p50", "TTFT p50 (1 min)", (m) => ms(m.window.ttft_s.p50)],
      ["ttft_p99", "TTFT p99 (1 min)", (m) => ms(m.window.ttft_s.p99)],
      ["itl_p50", "ITL p50 (1 min)", (m) => ms(m.window.itl_s.p50)],
      ["itl_p99", "ITL p99 (1 min)", (m) => ms(m.window.itl_s.p99)],
      ["e2e_p50", "latency p50 (1 min)", (m) => ms(m.window.e2e_s.p50)],
      ["errors", "errors (1 min)", (m) => pairs(m.window.errors)],
    ],
    embedding: [
      ["pending", "waiting", (m) => int(last(m.series.pending))],
      ["success", "requests served", (m) => int(m.totals.requests.success)],
      ["batches", "batches run", (m) => int(m.totals.batches)],
      ["inferences", "inputs run", (m) => int(m.totals.inferences)],
      ["queue_p50", "queue p50 (1 min)", (m) => ms(m.window.queue_s.p50)],
      ["queue_p99", "queue p99 (1 min)", (m) => ms(m.window.queue_s.p99)],
      ["compute_p50", "batch time p50 (1 min)", (m) => ms(m.window.compute_s.p50)],
      ["batch_sizes", "batch sizes (1 min, size ≤: count)", (m) => pairs(m.window.batch_sizes)],
      ["errors", "errors (1 min)", (m) => pairs(m.window.errors)],
    ],
  };
  // Charts of each kind: [chart id, title, [[series key, label, scale factor], ...]].
  const CHARTS = {
    generation: [
      ["requests", "requests running and waiting", [["running", "running"], ["waiting", "waiting"]]],
      ["tokens", "tokens per second", [["generation_tokens_per_s", "output"], ["prompt_tokens_per_s", "prompt"]]],
      ["step", "tokens per engine step (mean)", [["tokens_per_step", "tokens/step"]]],
      ["kv", "KV cache use (%)", [["kv_usage", "KV use", 100]]],
    ],
    embedding: [
      ["rate", "requests per second", [["requests_per_s", "requests/s"]]],
      ["batch", "executed batch size (mean) and queue", [["batch_size", "batch size"], ["pending", "waiting"]]],
      ["queue", "time in queue (mean, ms)", [["queue_ms", "queue ms"]]],
    ],
  };

  function last(values) {
    return values && values.length ? values[values.length - 1] : 0;
  }

  function element(tag, attrs, parent) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") el.textContent = v;
      else el.setAttribute(k, v);
    }
    if (parent) parent.appendChild(el);
    return el;
  }

  function statGrid(parent, owner, specs) {
    for (const [id, label] of specs) {
      const box = element("div", { class: "stat" }, parent);
      element("span", { class: "label", text: label }, box);
      element("span", { class: "value", "data-metric": owner + "/" + id, text: "–" }, box);
    }
  }

  function setStat(owner, id, text) {
    const el = document.querySelector('[data-metric="' + CSS.escape(owner + "/" + id) + '"]');
    if (el) el.textContent = text;
  }

  function makeChart(parent, id, title, lines) {
    const box = element("div", { class: "chart", "data-chart": id }, parent);
    element("h3", { text: title }, box);
    const empty = element("p", { class: "empty", text: "no samples yet" }, box);
    const opts = {
      width: 440,
      height: 170,
      legend: { live: false },
      scales: {
        x: { time: true, range: () => timeWindow() },
        y: { range: (_u, lo, hi) => [Math.min(0, lo), Math.max(1, hi)] },
      },
      // A mean over an interval with no work is null: the line joins the intervals
      // that had some, and every sample is a dot, so a lone value still shows.
      series: [{}].concat(lines.map((line, i) => ({ label: line[1], stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true, points: { show: true, size: 4 } }))),
    };
    const none = [[]].concat(lines.map(() => []));
    return { plot: new uPlot(opts, none, box), lines: lines, data: none, empty: empty };
  }

  function timeWindow() {
    const end = state.last ? state.last.time : Date.now() / 1000;
    return [end - SPAN_S, end];
  }

  // Draw ``data`` and say why a chart is blank: no sample pair yet, or nothing ran.
  function draw(chart, data, why) {
    chart.data = data;
    chart.plot.setData(data);
    const drawn = data.slice(1).some((line) => line.some((v) => v !== null));
    chart.empty.hidden = drawn;
    chart.empty.textContent = data[0].length ? why : "no samples yet";
  }

  function chartData(series, lines) {
    return [series.t].concat(lines.map(([key, , scale]) => (series[key] || []).map((v) => (v === null ? null : v * (scale || 1)))));
  }

  function ensureModel(name, kind) {
    if (state.charts[name] && state.kinds[name] === kind) return;
    dropModel(name); // new, or loaded again as another kind of model
    state.kinds[name] = kind;
    const section = element("section", { class: "model", "data-model": name }, document.getElementById("models"));
    const h2 = element("h2", { text: name + " " }, section);
    element("span", { class: "kind", text: kind === "generation" ? "(text generation, continuous batching)" : "(dynamic batching)" }, h2);
    statGrid(element("div", { class: "stats" }, section), name, STATS[kind]);
    const charts = element("div", { class: "charts" }, section);
    state.charts[name] = CHARTS[kind].map(([id, title, lines]) => makeChart(charts, id, title, lines));
  }

  // A model unloaded while the page is open leaves the page with its charts.
  function dropModel(name) {
    for (const chart of state.charts[name] || []) chart.plot.destroy();
    delete state.charts[name];
    delete state.kinds[name];
    const section = document.querySelector('section[data-model="' + CSS.escape(name) + '"]');
    if (section) section.remove();
  }

  function drawModel(name, model) {
    ensureModel(name, model.kind);
    for (const [id, , value] of STATS[model.kind]) setStat(name, id, value(model));
    for (const chart of state.charts[name]) draw(chart, chartData(model.series, chart.lines), "no requests yet");
  }

  function drawRuntime(runtime) {
    const section = document.getElementById("runtime");
    const workers = Object.keys(runtime.units).sort();
    if (!workers.length) return;
    section.hidden = false;
    // A model shows up here once it has run a unit; the chart is rebuilt when one does.
    if (state.runtimeWorkers !== workers.join(",")) {
      state.runtimeWorkers = workers.join(",");
      const grid = document.getElementById("runtime-stats");
      grid.textContent = "";
      statGrid(grid, "runtime", workers.map((w) => ["units:" + w, "units run: " + w]));
      const charts = document.getElementById("runtime-charts");
      charts.textContent = "";
      state.charts.runtime = [makeChart(charts, "share", "share of device time (%)", workers.map((w) => [w, w, 100]))];
    }
    for (const w of workers) setStat("runtime", "units:" + w, int(runtime.units[w]));
    draw(state.charts.runtime[0], chartData(runtime.series, state.charts.runtime[0].lines), "nothing ran yet");
  }

  function setStatus(text, isError) {
    const el = document.getElementById("status");
    el.textContent = text;
    el.className = isError ? "error" : "";
  }

  async function poll() {
    try {
      const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
      const response = await fetch("/dashboard/stats", { headers: headers, cache: "no-store" });
      if (response.status === 401) {
        form.hidden = false;
        setStatus("this server needs an API key", true);
        return;
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      const view = await response.json();
      state.last = view; // first: the charts' time axis ends at this sample
      for (const [name, model] of Object.entries(view.models)) drawModel(name, model);
      for (const name of Object.keys(state.kinds)) if (!(name in view.models)) dropModel(name);
      drawRuntime(view.runtime);
      state.frames += 1;
      state.error = null;
      const span = view.window_s === null ? "since start" : "over the last " + Math.round(view.window_s) + " s";
      setStatus("updated " + new Date(view.time * 1000).toLocaleTimeString() + "; percentiles " + span, false);
    } catch (err) {
      state.error = String(err);
      setStatus("cannot reach the server (" + err + "); retrying", true);
    }
  }

  async function loop() {
    await poll();
    setTimeout(loop, POLL_MS);
  }
  loop();
})();
