// Run comparison (X3): one chart per chosen metric, every compared run overlaid on the step axis,
// the same colour for a run on every chart and in the run legend; active runs follow live.
//
//   #compare-data (json_script)            {runs: [{id, label, status, api, ws}], metrics: [{name, help}]}
//   GET  {run.api}metrics/?layout=columns&names=a,b   each run's history of the chosen metrics
//   WS   {run.ws}                          only for runs that are active: status, metrics (one per step)
//
// A run's chart labels come from the page data and reach the DOM as text only (uPlot sets legend
// labels with textContent; titles here too), so a run named "<b>" stays those three characters.
// Charts are redrawn at most once per animation frame however many steps arrive.
"use strict";

(() => {
  const dataNode = document.getElementById("compare-data");
  const box = document.getElementById("compare-charts");
  if (!dataNode || !box) return;
  const page = JSON.parse(dataNode.textContent);
  const runs = page.runs;
  const metrics = page.metrics;
  if (!runs.length || !metrics.length) return;
  const ACTIVE = new Set(["queued", "starting", "running", "stopping"]);
  const note = document.getElementById("compare-note");
  const names = metrics.map((m) => m.name);
  const namesParam = encodeURIComponent(names.join(","));

  // metric name -> one sorted column per run (index = the run's place in `runs`, hence its colour)
  const columns = new Map(names.map((name) => [name, runs.map(() => ({ steps: [], values: [] }))]));
  const charts = new Map(); // metric name -> {card, plot, chart, dirty}
  const runState = runs.map(() => ({ loaded: false, buffered: [], lastStep: 0, socket: null, everOpen: false }));
  let frame = 0;

  const { el } = GrpoDom;

  function colour(i) {
    return GrpoCharts.PALETTE[i % GrpoCharts.PALETTE.length];
  }

  function legendItem(run) {
    return document.querySelector(`#compare-runs li[data-run-id="${run.id}"]`);
  }

  // ------------------------------------------------------------------ series
  /** Set (step, value) in a run's column of a metric: appended when newer (the live case),
   * otherwise inserted in order, and a step seen twice (history and socket) keeps one value. */
  function put(name, runIndex, step, value) {
    const col = columns.get(name)[runIndex];
    const n = col.steps.length;
    if (!n || step > col.steps[n - 1]) {
      col.steps.push(step);
      col.values.push(value);
    } else {
      let lo = 0, hi = n; // first index whose step >= step
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        if (col.steps[mid] < step) lo = mid + 1; else hi = mid;
      }
      if (col.steps[lo] === step) col.values[lo] = value;
      else {
        col.steps.splice(lo, 0, step);
        col.values.splice(lo, 0, value);
      }
    }
    const state = runState[runIndex];
    if (step > state.lastStep) state.lastStep = step;
    const chart = charts.get(name);
    if (chart) chart.dirty = true;
  }

  /** uPlot's data: [union of the runs' steps, one y array per run with null where it has none]. */
  function align(cols) {
    const steps = [...new Set(cols.flatMap((c) => c.steps))].sort((a, b) => a - b);
    const index = new Map(steps.map((s, i) => [s, i]));
    const ys = cols.map((c) => {
      const y = new Array(steps.length).fill(null);
      c.steps.forEach((s, i) => { y[index.get(s)] = c.values[i]; });
      return y;
    });
    return [steps, ...ys];
  }

  // ------------------------------------------------------------------ charts
  function makeChart(metric) {
    const title = el("div", { class: "chart-title" }, el("span", { text: metric.name }));
    if (metric.help) title.title = metric.help;
    const plot = el("div", { class: "chart-plot" });
    const card = el("div", { class: "chart", "data-metric": metric.name, "data-points": "0" }, title, plot);
    box.append(card);
    charts.set(metric.name, { card, plot, chart: null, dirty: true });
  }

  function scheduleDraw() {
    if (!frame) frame = requestAnimationFrame(draw);
  }

  function draw() {
    frame = 0;
    for (const [name, c] of charts) {
      if (!c.dirty) continue;
      c.dirty = false;
      const cols = columns.get(name);
      const data = align(cols);
      if (c.chart) c.chart.setData(data);
      else c.chart = GrpoCharts.lineChart(c.plot, runs.map((r) => r.label), data, { height: 220, legend: true });
      c.card.dataset.points = String(cols.reduce((n, col) => n + col.steps.length, 0));
    }
    if (box.dataset.loaded) noteMissing(); // a live run's first point of a metric clears its line
  }

  function noteMissing() {
    // Say which run logged none of which metric (a "loss" chart without run 5's line is otherwise a puzzle).
    const lines = [];
    for (const name of names) {
      const empty = runs.filter((r, i) => runState[i].loaded && !columns.get(name)[i].steps.length);
      if (empty.length && empty.length < runs.length) lines.push(`"${name}" not logged by ${empty.map((r) => r.label).join(", ")}`);
      else if (empty.length) lines.push(`"${name}" not logged by any of these runs yet`);
    }
    note.textContent = lines.join("; ");
  }

  // ------------------------------------------------------------------ data
  async function fetchColumns(run, sinceStep) {
    let url = `${run.api}metrics/?layout=columns&names=${namesParam}`;
    if (sinceStep !== undefined) url += `&since_step=${sinceStep}`;
    const resp = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!resp.ok) throw new Error(`run ${run.id}: HTTP ${resp.status}`);
    return (await resp.json()).series;
  }

  function loadSeries(runIndex, series) {
    for (const [name, col] of Object.entries(series)) {
      if (!columns.has(name)) continue;
      for (let i = 0; i < col.steps.length; i++) put(name, runIndex, col.steps[i], col.values[i]);
    }
  }

  function onMetrics(runIndex, step, values) {
    for (const name of names) if (name in values) put(name, runIndex, step, values[name]);
    scheduleDraw();
  }

  function setStatus(runIndex, status) {
    runs[runIndex].status = status;
    const badge = legendItem(runs[runIndex])?.querySelector(".status");
    if (badge) {
      badge.textContent = status;
      badge.className = `status status-${status}`;
    }
  }

  function handle(runIndex, msg) {
    const state = runState[runIndex];
    if (msg.type === "status") setStatus(runIndex, msg.status);
    else if (msg.type === "metrics") {
      if (!state.loaded) state.buffered.push(msg); // applied once the history is in
      else onMetrics(runIndex, msg.step, msg.values);
    }
  }

  /** A live run's socket: opened before its history is fetched, so no step falls between the two;
   * reopened with backoff after a drop (and what was missed fetched), never for a finished run. */
  function connect(runIndex, retryMs = 500) {
    const run = runs[runIndex];
    const state = runState[runIndex];
    const item = legendItem(run);
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}${run.ws}`);
    state.socket = socket;
    if (item) item.dataset.live = "connecting";
    socket.onopen = () => {
      if (item) item.dataset.live = "open";
      if (state.everOpen && state.loaded) {
        fetchColumns(run, Math.max(0, state.lastStep - 1))
          .then((series) => { loadSeries(runIndex, series); scheduleDraw(); })
          .catch((err) => console.warn("backfill", err));
      }
      state.everOpen = true;
      retryMs = 500;
    };
    socket.onmessage = (ev) => handle(runIndex, JSON.parse(ev.data));
    socket.onclose = (ev) => {
      if (item) item.dataset.live = "closed";
      if (ev.code === 4401 || ev.code === 4404 || !ACTIVE.has(run.status)) return;
      setTimeout(() => connect(runIndex, Math.min(retryMs * 2, 10000)), retryMs);
    };
  }

  async function loadRun(runIndex) {
    const state = runState[runIndex];
    try {
      loadSeries(runIndex, await fetchColumns(runs[runIndex]));
    } finally {
      state.loaded = true;
      for (const msg of state.buffered.splice(0)) onMetrics(runIndex, msg.step, msg.values);
    }
  }

  // ------------------------------------------------------------------ start
  runs.forEach((run, i) => {
    const swatch = legendItem(run)?.querySelector(".swatch");
    if (swatch) swatch.style.background = colour(i);
  });
  for (const metric of metrics) makeChart(metric);
  runs.forEach((run, i) => { if (ACTIVE.has(run.status)) connect(i); });
  Promise.allSettled(runs.map((run, i) => loadRun(i))).then((results) => {
    const failed = results.filter((r) => r.status === "rejected").map((r) => String(r.reason));
    for (const c of charts.values()) c.dirty = true;
    draw();
    noteMissing();
    if (failed.length) note.textContent = `could not load: ${failed.join("; ")}`;
    box.dataset.loaded = "true";
  });
  window.addEventListener("resize", () => GrpoCharts.fitWidths([...charts.values()].map((c) => c.chart).filter(Boolean)));
})();
