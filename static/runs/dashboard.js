// The run dashboard: history over REST, then only what is new over the run's websocket.
//
//   GET  {api}metrics/?layout=columns   every series, as parallel step/value arrays
//   GET  {api}events/?kind=&q= (the events panel's filter), diagnosis/; completions: completion_panel.js
//   GET  {catalogue}                    the metric catalogue: chart groups, their order, title tooltips
//   GET  {api}checkpoints/              the checkpoints (also drawn by the page; merged by step)
//   WS   /ws/runs/<id>/                 status, metrics (one message per step), completions, events,
//                                       checkpoints (one message per saved checkpoint)
//
// The metric charts are static/runs/metric_panel.js (GrpoMetricPanel: fed below, drawn at most once
// per animation frame); the diagnosis is re-fetched at most every DIAGNOSIS_EVERY_MS while metrics flow.
"use strict";

(() => {
  const root = document.getElementById("run");
  if (!root) return;
  const API = root.dataset.api; // ".../api/v1/runs/<id>/"
  const ACTIVE = new Set(["queued", "starting", "running", "stopping"]);
  const DIAGNOSIS_EVERY_MS = 5000;
  const MAX_EVENTS = 300;
  const ETA_WINDOW = 10; // steps of perf/step_s averaged for the ETA
  const SLOWING_RATIO = 1.5; // recent steps this many times slower than the first: "slowing"
  const SLOWING_DROPPED_FRAC = 0.5; // ... and at least this share of groups dropped: it says why

  const state = {
    status: root.dataset.status,
    maxSteps: parseInt(root.dataset.maxSteps, 10) || null,
    lastStep: 0,
    historyLoaded: false,
    buffered: [], // socket messages that arrived before the history
    diagnosisAt: 0,
    diagnosisTimer: 0,
    eventIds: new Set(), // ids of the events shown (the socket and a backfill may both carry one)
    lastEventId: 0,
    everOpen: false, // a socket has been open once: the next open is a reconnect
    reconnects: 0, // socket re-opens after a drop (root.dataset.reconnects mirrors it for tests)
  };

  // ---------------------------------------------------------------- helpers
  const { el } = GrpoDom;

  const { fetchJSON } = GrpoDom;

  function getJSON(path) {
    return fetchJSON(API + path);
  }

  /** The metric catalogue, or an empty one if it cannot be read (charts then lack tooltips only). */
  function loadCatalogue() {
    return fetchJSON(root.dataset.catalogue).catch((err) => {
      console.warn(`metric catalogue: ${err}`);
      return null;
    });
  }

  // ---------------------------------------------------------------- metrics (charts: metric_panel.js)
  // An eval line arrives for an earlier step (after the lines of later steps): its points join the
  // eval charts at that step, and the progress, ETA and latest step only ever move forward.
  function onMetrics(msg) {
    GrpoMetricPanel.onMetrics(msg);
    if (msg.step > state.lastStep) state.lastStep = msg.step;
    updateProgress();
    scheduleDiagnosis();
  }

  // ---------------------------------------------------------------- status, progress, ETA
  function setStatus(msg) {
    if (msg.status) {
      state.status = msg.status;
      const badge = document.getElementById("run-status");
      badge.textContent = msg.status;
      badge.className = `status status-${msg.status}`;
      root.dataset.status = msg.status;
      document.getElementById("stop-form").hidden = !["queued", "starting", "running"].includes(msg.status);
      document.getElementById("resume-form").hidden = !["failed", "stopped", "interrupted"].includes(msg.status);
    }
    if (msg.failure_reason) {
      const pre = document.getElementById("failure-reason");
      pre.textContent = msg.failure_reason;
      pre.hidden = false;
    }
    if (msg.max_steps) state.maxSteps = msg.max_steps;
    if (msg.attempt) document.getElementById("run-attempt").textContent = msg.attempt;
    if (msg.step && msg.step > state.lastStep) state.lastStep = msg.step;
    updateProgress();
  }

  function updateProgress() {
    const total = state.maxSteps;
    document.getElementById("run-step").textContent = `step ${state.lastStep || "–"}${total ? " / " + total : ""}`;
    document.getElementById("run-progress").style.width = total ? `${Math.min(100, (100 * state.lastStep) / total)}%` : "0%";
    const eta = document.getElementById("run-eta");
    const stepTimes = GrpoMetricPanel.series("perf/step_s");
    if (!total || !ACTIVE.has(state.status) || !stepTimes || stepTimes.values.length === 0) {
      eta.textContent = "";
      return;
    }
    const mean = meanOf(stepTimes.values.slice(-ETA_WINDOW));
    const left = Math.max(0, total - state.lastStep);
    eta.textContent = left ? `ETA ${GrpoCharts.formatDuration(left * mean)} (${GrpoCharts.formatValue(mean)} s/step)${slowingNote(stepTimes.values, mean)}` : "";
  }

  function meanOf(values) {
    const known = values.filter((v) => v !== null && Number.isFinite(v));
    return known.length ? known.reduce((a, b) => a + b, 0) / known.length : NaN;
  }

  // The ETA reads the last ETA_WINDOW steps; when they are SLOWING_RATIO times slower than the first
  // ETA_WINDOW and most groups are dropped for identical rewards, it says why (issue 34).
  function slowingNote(stepValues, recentMean) {
    if (stepValues.length < 2 * ETA_WINDOW) return "";
    const first = meanOf(stepValues.slice(0, ETA_WINDOW));
    const dropped = GrpoMetricPanel.series("frac_reward_zero_std");
    const frac = dropped ? meanOf(dropped.values.slice(-ETA_WINDOW)) : NaN;
    if (!(recentMean > SLOWING_RATIO * first) || !(frac >= SLOWING_DROPPED_FRAC)) return "";
    return ` · slowing ${GrpoCharts.formatValue(recentMean / first)}×: ${Math.round(100 * frac)}% of groups dropped (identical rewards)`;
  }

  // ---------------------------------------------------------------- events and log tail
  // The kind filter and the search box ask the server (events/?kind=&q=) and redraw the table; live
  // events are shown when they match the same filter. Rows stay in id order whatever arrives first.
  const eventFilter = { kind: "", q: "", seq: 0 };

  function eventQuery(params = {}) {
    const query = new URLSearchParams(params);
    if (eventFilter.kind) query.set("kind", eventFilter.kind);
    if (eventFilter.q) query.set("q", eventFilter.q);
    const text = query.toString();
    return `events/${text ? `?${text}` : ""}`;
  }

  function eventMatches(e) {
    if (eventFilter.kind && e.kind !== eventFilter.kind) return false;
    return !eventFilter.q || (e.message || "").toLowerCase().includes(eventFilter.q.toLowerCase());
  }

  function addEvent(e) {
    if (e.id !== undefined && e.id !== null) {
      if (state.eventIds.has(e.id)) return;
      state.eventIds.add(e.id);
      if (e.id > state.lastEventId) state.lastEventId = e.id;
    }
    if (!eventMatches(e)) return;
    const body = document.getElementById("events");
    const time = e.created_at ? new Date(e.created_at).toLocaleTimeString() : "";
    const hasId = e.id !== undefined && e.id !== null;
    const row = el("tr", { "data-kind": e.kind, ...(hasId ? { "data-id": String(e.id) } : {}) },
      el("td", { text: time }), el("td", { text: e.kind }), el("td", {}, el("pre", { text: e.message })));
    const later = hasId ? [...body.children].find((r) => r.dataset.id && Number(r.dataset.id) > e.id) : null;
    body.insertBefore(row, later || null);
    while (body.children.length > MAX_EVENTS) body.removeChild(body.firstChild);
    document.getElementById("events-empty").hidden = true;
  }

  async function refilterEvents() {
    eventFilter.kind = document.getElementById("event-kind").value;
    eventFilter.q = document.getElementById("event-search").value.trim();
    const seq = ++eventFilter.seq;
    // Emptied now, not when the answer comes: a live event arriving meanwhile is kept (and the answer,
    // which may hold it too, is deduplicated against it).
    document.getElementById("events").replaceChildren();
    state.eventIds.clear();
    let events;
    try {
      events = await getJSON(eventQuery());
    } catch (err) {
      console.warn("events", err);
      return;
    }
    if (seq !== eventFilter.seq) return; // a newer filter is under way
    for (const e of events) addEvent(e);
    const shown = document.getElementById("events").children.length;
    document.getElementById("events-empty").hidden = shown > 0 || (!eventFilter.kind && !eventFilter.q);
  }

  let eventSearchTimer = 0;
  document.getElementById("event-kind").addEventListener("change", refilterEvents);
  document.getElementById("event-search").addEventListener("input", () => {
    clearTimeout(eventSearchTimer);
    eventSearchTimer = setTimeout(refilterEvents, 250);
  });

  // ---------------------------------------------------------------- checkpoints
  // The page draws those saved before it loaded; each "checkpoint" message (and the checkpoints API,
  // on each status message: at every connect) adds its row or replaces the row of the same step (a resumed
  // attempt saves a step again). Rows in step order, each with "new run from this checkpoint" and,
  // for the run's owner, a download of the folder as a tar.
  function addCheckpoint(c) {
    const panel = document.getElementById("checkpoints-panel");
    const step = Number(c.step);
    if (!panel || !Number.isInteger(step) || step < 0) return;
    const links = [];
    if (panel.dataset.download) {
      links.push(" · ", el("a", { class: "checkpoint-download", download: "", href: `${panel.dataset.download}${step}/download/`, text: "download (tar)" }));
    }
    links.push(" · ", el("a", { class: "checkpoint-new-run", href: `${panel.dataset.newRun}${step}`, text: "new run from this checkpoint" }));
    const row = el("li", { "data-step": String(step) }, `step ${step}: `, el("code", { text: String(c.path ?? "") }), ...links);
    const list = document.getElementById("checkpoints");
    document.getElementById("checkpoints-empty")?.remove();
    const same = list.querySelector(`li[data-step="${step}"]`);
    if (same) {
      same.replaceWith(row);
      return;
    }
    const later = [...list.children].find((r) => r.dataset.step && Number(r.dataset.step) > step);
    list.insertBefore(row, later || null);
  }

  function loadCheckpoints() {
    return getJSON("checkpoints/").then((items) => { for (const c of items) addCheckpoint(c); }, (err) => console.warn("checkpoints", err));
  }

  // ---------------------------------------------------------------- placement
  // Where the run runs (host, GPUs of vLLM and of each trainer rank) and why a queued run waits;
  // reloaded from the run's API when an event says the placement changed.
  const PLACEMENT_EVENTS = /^(placement:|waiting for|vllm environment|trainer environment|trainer ranks)/;

  function gpuText(gpus) {
    return gpus && gpus.length ? `GPU${gpus.length > 1 ? "s" : ""} ${gpus.join(",")}` : "CPU";
  }

  function renderPlacement(run) {
    const waiting = document.getElementById("run-waiting");
    waiting.textContent = run.status === "queued" && run.waiting_reason ? run.waiting_reason : "";
    waiting.hidden = !waiting.textContent;
    const box = document.getElementById("run-placement");
    box.replaceChildren();
    const p = run.placement || {};
    if (!p.host) {
      box.hidden = true;
      return;
    }
    box.hidden = false;
    box.append(el("div", { text: `host ${p.host} · worker ${p.worker}` }));
    if ((p.servers || []).length > 1) box.append(el("div", { text: `vLLM: named servers ${p.servers.join(", ")}` }));
    else if (p.server) box.append(el("div", { text: `vLLM: named server ${p.server}` }));
    else if (p.vllm) {
      const env = p.vllm.env ? Object.entries(p.vllm.env).map(([k, v]) => `${k}=${v}`).join(" ") : "";
      box.append(el("div", { "data-part": "vllm", text: `vLLM: ${gpuText(p.vllm.gpus)} (TP ${p.vllm.tensor_parallel_size} × DP ${p.vllm.data_parallel_size}), port ${run.vllm_port ?? "–"}${env ? ` · ${env}` : ""}` }));
    }
    const t = p.trainer || {};
    box.append(el("div", { "data-part": "trainer", text: `trainer: ${gpuText(t.gpus)}, ${t.processes || 1} process${(t.processes || 1) > 1 ? "es" : ""}${t.launcher ? ` · ${t.launcher}` : ""}` }));
    for (const n of p.nodes || []) {
      box.append(el("div", { "data-part": "node", text: `  and on host ${n.host} · worker ${n.worker}: ${gpuText(n.gpus)}, ${n.processes || 1} process${(n.processes || 1) > 1 ? "es" : ""}` }));
    }
    if (t.rendezvous) box.append(el("div", { text: `  rendezvous ${t.rendezvous.endpoint} (${t.rendezvous.id})` }));
    for (const r of t.ranks || []) {
      box.append(el("div", { class: "rank", "data-rank": String(r.rank), text: `  rank ${r.rank}: ${r.device}${r.gpu !== null && r.gpu !== undefined ? ` = GPU ${r.gpu}` : ""} · pid ${r.pid} on ${r.host}` }));
    }
  }

  async function loadPlacement() {
    try {
      renderPlacement(await getJSON(""));
    } catch (err) {
      console.warn("placement", err);
    }
  }

  // ---------------------------------------------------------------- diagnosis
  function scheduleDiagnosis() {
    if (state.diagnosisTimer) return;
    const wait = Math.max(0, state.diagnosisAt + DIAGNOSIS_EVERY_MS - Date.now());
    state.diagnosisTimer = setTimeout(loadDiagnosis, wait);
  }

  async function loadDiagnosis() {
    state.diagnosisTimer = 0;
    state.diagnosisAt = Date.now();
    try {
      renderDiagnosis(await getJSON("diagnosis/"));
    } catch (err) {
      console.warn("diagnosis", err);
    }
  }

  // The strip: one chip per topic, the verdict's short name (its title up to the colon) coloured by
  // severity; the panel opens on the full cards: the numbers under the spec's names or plain words
  // (the API's labels; the raw key is the row's tooltip) and the spec's advice.
  const TOPIC_NAMES = {
    bottleneck: "Bottleneck",
    concurrency: "Concurrency",
    saturation: "Saturation",
    duplicates: "Duplicates",
    clipping: "Truncation",
  };

  function renderDiagnosis(items) {
    if (!items.length) return;
    const name = (d) => TOPIC_NAMES[d.topic] || d.topic;
    document.getElementById("diagnosis").replaceChildren(...items.map((d) =>
      el("span", { class: `diagnosis chip sev-${d.severity}`, "data-topic": d.topic, "data-verdict": d.verdict, title: d.title },
        el("span", { class: "help", text: `${name(d)}: ` }), d.title.split(":")[0])));
    document.getElementById("diagnosis-details").replaceChildren(...items.map((d) => {
      const labels = d.labels || {};
      const rows = Object.entries(d.evidence).map(([k, v]) =>
        el("tr", { "data-key": k }, el("td", { text: labels[k] || k, title: k }), el("td", { text: GrpoCharts.formatValue(v) })));
      return el("div", { class: `diagnosis sev-${d.severity}`, "data-topic": d.topic, "data-verdict": d.verdict },
        el("div", { class: "help", text: name(d) }),
        el("strong", { text: d.title }),
        el("table", {}, el("tbody", {}, ...rows)),
        el("div", { class: "advice", text: d.advice }));
    }));
  }

  // ---------------------------------------------------------------- stop / resume without reload
  for (const id of ["stop-form", "resume-form"]) {
    const form = document.getElementById(id);
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      // Stop asks first (the form's data-confirm); cancelling sends nothing.
      if (form.dataset.confirm && !window.confirm(form.dataset.confirm)) return;
      const button = form.querySelector("button");
      button.disabled = true;
      try {
        const resp = await fetch(form.dataset.api, {
          method: "POST",
          credentials: "same-origin",
          headers: { "X-CSRFToken": form.querySelector("[name=csrfmiddlewaretoken]").value, Accept: "application/json" },
        });
        const body = await resp.json().catch(() => ({}));
        if (!resp.ok) addEvent({ kind: "error", message: body.detail || `HTTP ${resp.status}`, created_at: new Date().toISOString() });
        else setStatus({ status: body.status });
      } finally {
        button.disabled = false;
      }
    });
  }

  // ---------------------------------------------------------------- websocket
  let socket = null;
  let retryMs = 500;

  function handle(msg) {
    if (!state.historyLoaded && msg.type !== "status") {
      state.buffered.push(msg);
      return;
    }
    if (msg.type === "metrics") onMetrics(msg);
    else if (msg.type === "completions") GrpoCompletionPanel.live(msg.step, msg.items, msg.split || "train");
    else if (msg.type === "status") {
      setStatus(msg);
      loadPlacement();
      // The socket's first message (after each connect) is a status, sent once it follows the run:
      // what was saved before it, since the page was drawn or while a dropped socket was down.
      loadCheckpoints();
    } else if (msg.type === "event") {
      addEvent(msg);
      if (PLACEMENT_EVENTS.test(msg.message || "")) loadPlacement();
    } else if (msg.type === "checkpoint") addCheckpoint(msg);
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}${root.dataset.ws}`);
    const conn = document.getElementById("conn");
    // Live once the server has joined the run's group, which its first message (the status) says:
    // the socket is open a little before that, and a step sent in between reaches the database and
    // other sockets but not this one, so the backfill after a drop must start from here, not onopen.
    let joined = false;
    const onJoined = () => {
      conn.textContent = "live";
      conn.className = "conn live";
      if (state.everOpen) {
        // After a drop: count it, and fetch what was missed while the socket was down.
        state.reconnects += 1;
        root.dataset.reconnects = String(state.reconnects);
        backfill().catch((err) => console.warn("backfill", err));
      }
      state.everOpen = true;
      retryMs = 500;
    };
    socket.onmessage = (ev) => {
      const msg = JSON.parse(ev.data);
      if (!joined && msg.type === "status") {
        joined = true;
        onJoined();
      }
      handle(msg);
    };
    socket.onclose = (ev) => {
      conn.className = "conn";
      if (ev.code === 4401 || ev.code === 4404) {
        conn.textContent = ev.code === 4401 ? "not logged in" : "run not found";
        return;
      }
      conn.textContent = "reconnecting…";
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 10000);
    };
  }

  /** What a dropped socket missed: metrics and completions after the last step shown, events after
   * the last event shown (the socket's status message on re-open brings the status and checkpoints). */
  async function backfill() {
    if (!state.historyLoaded) return; // the first history load is still under way and covers it
    // One step back: a step's completions may follow its metrics; duplicates replace, never add.
    let since = Math.max(0, state.lastStep - 1);
    if (root.dataset.evaluates === "true") {
      // An eval line for step S comes after the lines of later steps, so one missed while the socket
      // was down is for a step after the last eval step shown (none shown yet: the whole history).
      const lastEval = GrpoMetricPanel.lastStepOf("eval/");
      since = lastEval === null ? -1 : Math.min(since, lastEval);
    }
    const [metrics, events] = await Promise.all([
      getJSON(`metrics/?layout=columns${since >= 0 ? `&since_step=${since}` : ""}`),
      getJSON(eventQuery({ after_id: state.lastEventId })),
      GrpoCompletionPanel.backfill(),
    ]);
    loadMetricColumns(metrics);
    for (const e of events) addEvent(e);
  }

  /** GET metrics/?layout=columns: {series, steps}. */
  function loadMetricColumns(payload) {
    GrpoMetricPanel.addColumns(payload);
    state.lastStep = Math.max(state.lastStep, GrpoMetricPanel.lastStep());
    updateProgress();
  }

  async function loadHistory() {
    const [catalogue, metrics, events] = await Promise.all([
      loadCatalogue(),
      getJSON("metrics/?layout=columns"),
      getJSON(eventQuery()),
    ]);
    GrpoMetricPanel.init(catalogue);
    loadMetricColumns(metrics);
    for (const e of events) addEvent(e);
    state.historyLoaded = true;
    for (const msg of state.buffered.splice(0)) handle(msg);
    loadDiagnosis();
  }

  connect(); // subscribe first: nothing produced while the history loads is lost
  loadPlacement();
  GrpoCompletionPanel.load().catch((err) => console.warn("completions", err)); // buffers live samples until its first page
  loadHistory().catch((err) => {
    document.getElementById("charts").append(el("p", { class: "errorlist", text: `could not load the history: ${err}` }));
    state.historyLoaded = true;
  });
})();
