// The run page's metric charts, as W&B / MLflow users expect them: one uPlot chart per metric,
// grouped by the catalogue's namespaces behind a "Pinned" group (which charts, and their order: the
// user's pins, static/runs/chart_pins.js); a hover readout and zoom synced across every chart; EMA smoothing
// (raw faint, smoothed strong); a log scale per chart; x = step, wall time or time since the first
// step; a dashed line where each resumed attempt starts; collapsible groups; regex/glob filter.
//
// The core (dashboard.js) feeds it: init(catalogue payload), addColumns(GET metrics/?layout=columns),
// onMetrics(websocket message); it reads lastStep() and series(name). Charts are (re)drawn at most
// once per animation frame, and only while visible (a filtered-out or collapsed chart waits).
//
// State for tests and scripts is on the DOM: each card's data-points, data-scale, data-x-min/max,
// data-x-ticks, data-markers, data-pinned, data-smoothed-last; #charts' data-x-axis, data-smoothing.
"use strict";

const GrpoMetricPanel = (() => {
  const container = document.getElementById("charts");
  const Kit = GrpoChartKit;
  const SYNC_KEY = "grpo-run-charts";
  const STRONG = GrpoCharts.PALETTE[0];
  const FAINT = STRONG + "40"; // the raw series under a smoothed one: same colour, 25% alpha
  const MARKER_COLORS = { attempt: { line: "#7a5af8", text: "#5925dc" }, metric: { line: "#0e9384", text: "#107569" } };
  const X_LABEL = { step: "step", wall: "wall time", relative: "time since first step" };
  const STORE = { collapsed: "grpo.charts.collapsed", log: "grpo.charts.log", smoothing: "grpo.charts.smoothing", x: "grpo.charts.x" };

  const state = {
    catalogue: GrpoCharts.catalogue(null),
    series: new Map(), // name -> {steps, values, ema..., card, box, last, readout, chart, dirty, view}
    lastStep: 0,
    stepTime: new Map(), // step -> unix seconds it was logged
    stepAttempt: new Map(), // step -> attempt that logged it
    firstTime: null, // time of the first logged step (relative axis origin)
    // [{step, label, kind}]: the first step of each attempt > 1 ("attempt"), and each step where a
    // metric the catalogue declares with `marks` changes value ("metric": curriculum/level)
    markers: [],
    markersDirty: false,
    smoothing: clampSmoothing(Kit.stored(STORE.smoothing, 0)),
    xMode: X_LABEL[Kit.stored(STORE.x, "step")] ? Kit.stored(STORE.x, "step") : "step",
    zoom: null, // [min, max] in the current x units, or null
    pendingZoom: null,
    pins: GrpoChartPins.create(container.dataset.preferences), // the user's pinned charts (chart_pins.js)
    collapsed: new Set(Kit.stored(STORE.collapsed, [])),
    log: new Set(Kit.stored(STORE.log, [])),
    matcher: Kit.nameMatcher(""),
    frame: 0,
  };

  function clampSmoothing(v) {
    const x = Number(v);
    return Number.isFinite(x) ? Math.min(0.99, Math.max(0, x)) : 0;
  }

  const { el } = GrpoDom;

  // ---------------------------------------------------------------- groups, pins, collapse
  function sectionFor(group, title, before) {
    let section = container.querySelector(`section[data-group="${CSS.escape(group)}"]`);
    if (section) return section;
    const heading = el("h3", { class: "group-toggle", role: "button", tabindex: "0", "aria-expanded": "true", title: "collapse / expand" },
      el("span", { class: "caret", text: "▾" }), " ", title);
    section = el("section", { class: group === "pinned" ? "pinned-group" : "metric-group", "data-group": group },
      heading, el("div", { class: "charts" }));
    const toggle = () => setCollapsed(section, !section.classList.contains("collapsed"));
    heading.addEventListener("click", toggle);
    heading.addEventListener("keydown", (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); toggle(); } });
    container.insertBefore(section, before || null);
    setCollapsed(section, state.collapsed.has(group), false);
    document.getElementById("charts-empty")?.remove();
    return section;
  }

  function setCollapsed(section, collapsed, save = true) {
    const group = section.dataset.group;
    section.classList.toggle("collapsed", collapsed);
    section.querySelector(".charts").hidden = collapsed;
    section.querySelector("h3").setAttribute("aria-expanded", String(!collapsed));
    if (collapsed) state.collapsed.add(group);
    else state.collapsed.delete(group);
    if (!save) return;
    Kit.store(STORE.collapsed, [...state.collapsed]);
    if (!collapsed) { // drawn now that they are seen, at the width they have now
      for (const card of section.querySelectorAll(".chart")) state.series.get(card.dataset.metric).dirty = true;
      scheduleDraw();
    }
  }

  function groupCharts(namespace) {
    const order = state.catalogue.namespaces;
    // Keep namespaces in the catalogue's (the spec's) reading order; unknown ones go last, alphabetically.
    const rank = (ns) => { const i = order.indexOf(ns); return i < 0 ? order.length : i; };
    const existing = container.querySelector(`.metric-group[data-group="${CSS.escape(namespace)}"]`);
    if (existing) return existing.querySelector(".charts");
    const after = [...container.querySelectorAll(".metric-group")].find((s) => {
      const other = s.dataset.group;
      return rank(other) > rank(namespace) || (rank(other) === rank(namespace) && other > namespace);
    });
    return sectionFor(namespace, namespace === "train" ? "reward, loss and training" : namespace + "/", after).querySelector(".charts");
  }

  function pinnedCharts() {
    const first = container.querySelector(".metric-group");
    const section = sectionFor("pinned", "Pinned", first);
    if (!section.querySelector(".pin-help")) {
      section.querySelector("h3").append(el("span", { class: "help pin-help", text: " (☆ on a chart pins it here, for your account)" }));
    }
    return section.querySelector(".charts");
  }

  /** Put a card where it belongs: the Pinned group in pin order, else its namespace in name order. */
  function place(s) {
    const name = s.card.dataset.metric;
    const pinned = state.pins.loaded() && state.pins.isPinned(name);
    const group = groupCharts(s.namespace); // exists even when its charts are all pinned (order kept)
    let charts, rank;
    if (pinned) {
      charts = pinnedCharts();
      rank = state.pins.rank;
    } else {
      charts = group;
      // "reward" and the loss lead their group; the rest keep name order.
      rank = (m) => (m === "reward" ? "0" : m === "loss" ? "1" : "2" + m);
    }
    s.card.dataset.pinned = String(pinned);
    s.pin.textContent = pinned ? "★" : "☆";
    s.pin.setAttribute("aria-pressed", String(pinned));
    s.pin.title = pinned ? "unpin (saved for your account)" : "pin to the top (saved for your account)";
    const before = [...charts.children].find((c) => c !== s.card && rank(c.dataset.metric) > rank(name));
    charts.insertBefore(s.card, before || null); // a drawn chart moves as it is: no redraw
  }

  function refreshSections() {
    for (const section of container.querySelectorAll("section[data-group]")) {
      const cards = [...section.querySelectorAll(".chart")];
      section.hidden = cards.length === 0 || cards.every((c) => c.hidden);
    }
  }

  function placeAll() {
    for (const s of state.series.values()) place(s);
    refreshSections();
    scheduleDraw();
  }

  async function loadPins() {
    await state.pins.load();
    placeAll();
  }

  async function togglePin(name) {
    if (!state.pins.loaded()) return;
    const saved = state.pins.toggle(name, [...state.series.keys()]);
    placeAll(); // shown at once; put back below if the server refuses it
    const message = document.getElementById("charts-message");
    try {
      await saved;
      message.hidden = true;
      container.dataset.pinsSaved = String(Number(container.dataset.pinsSaved || 0) + 1);
    } catch (err) {
      placeAll();
      message.textContent = `could not save the pin: ${err.message}`;
      message.hidden = false;
    }
  }

  // ---------------------------------------------------------------- series and cards
  function seriesFor(name) {
    let s = state.series.get(name);
    if (s) return s;
    const declared = state.catalogue.lookup(name);
    // The title's tooltip is the catalogue's help text (a plugin's undeclared metric has none).
    const title = el("span", declared ? { class: "chart-name", text: name, title: declared.help } : { class: "chart-name", text: name });
    const last = el("span", { class: "chart-last" });
    const log = el("button", { type: "button", class: "chart-log", "aria-pressed": "false", title: "log scale" }, "log");
    const pin = el("button", { type: "button", class: "chart-pin", "aria-pressed": "false" }, "☆");
    const readout = el("div", { class: "chart-readout", "aria-live": "off" });
    const box = el("div", { class: "chart-plot" });
    const card = el("div", { class: "chart", "data-metric": name, "data-points": "0", "data-scale": "linear" },
      el("div", { class: "chart-title" }, title, el("span", { class: "chart-tools" }, last, log, pin)), readout, box);
    s = {
      name, steps: [], values: [], card, box, last, readout, pin, logButton: log, chart: null, dirty: true,
      namespace: declared ? declared.namespace : GrpoCharts.namespaceOf(name),
      view: null, // what the chart shows: {steps, xs, raw, smooth}
      distr: 1,
      marks: Boolean(declared && declared.marks), // its changes are marked on every chart
    };
    state.series.set(name, s);
    log.addEventListener("click", () => toggleLog(s));
    pin.addEventListener("click", () => togglePin(name));
    place(s);
    card.hidden = !state.matcher.error && !state.matcher.test(name);
    refreshSections();
    return s;
  }

  function addPoint(name, step, value) {
    const s = seriesFor(name);
    const n = s.steps.length;
    if (n === 0 || step > s.steps[n - 1]) {
      s.steps.push(step);
      s.values.push(value);
    } else {
      // A re-logged step (a resumed attempt) replaces the value; a late one is inserted in order.
      const i = Kit.lowerBound(s.steps, step);
      if (s.steps[i] === step) s.values[i] = value;
      else { s.steps.splice(i, 0, step); s.values.splice(i, 0, value); }
      s.emaDone = 0; // an earlier value changed: the average is recomputed (rare: resumes)
    }
    s.dirty = true;
    if (s.marks) state.markersDirty = true;
  }

  function setStep(step, time, attempt) {
    if (time !== null && time !== undefined && state.stepTime.get(step) !== time) {
      const first = state.stepTime.size === 0;
      state.stepTime.set(step, time);
      if (state.firstTime === null || time < state.firstTime) state.firstTime = time;
      if (first && state.xMode !== "step") setXMode(state.xMode); // the time axis can be drawn now
      else if (state.xMode !== "step") markAllDirty();
    }
    if (attempt !== null && attempt !== undefined && state.stepAttempt.get(step) !== attempt) {
      state.stepAttempt.set(step, attempt);
      if (attempt > 1 || state.markers.length) state.markersDirty = true;
    }
  }

  /** The first step of each attempt after the first (where a resumed run starts again), and each step
   * where a `marks` metric takes a new value (labelled by its name's last part: "level 2"). */
  function computeMarkers() {
    state.markersDirty = false;
    const first = new Map();
    for (const [step, attempt] of state.stepAttempt) {
      if (attempt > 1 && (!first.has(attempt) || step < first.get(attempt))) first.set(attempt, step);
    }
    const markers = [...first].map(([attempt, step]) => ({ step, label: `attempt ${attempt}`, kind: "attempt" }));
    for (const s of state.series.values()) {
      if (!s.marks) continue;
      const word = s.name.slice(s.name.lastIndexOf("/") + 1);
      for (let i = 1; i < s.steps.length; i++) {
        if (s.values[i] !== s.values[i - 1] && s.values[i] !== null) {
          markers.push({ step: s.steps[i], label: `${word} ${GrpoCharts.formatValue(s.values[i])}`, kind: "metric" });
        }
      }
    }
    markers.sort((a, b) => a.step - b.step || a.label.localeCompare(b.label));
    const key = (ms) => ms.map((m) => `${m.step}:${m.label}`).join(",");
    if (key(markers) === key(state.markers)) return;
    state.markers = markers;
    container.dataset.markers = key(markers);
    for (const s of state.series.values()) {
      s.card.dataset.markers = container.dataset.markers;
      if (s.chart) s.chart.redraw(false);
    }
  }

  /** The x axis drawn: the chosen one, but steps while no step has a time (a run logged before
   * timestamps were kept), so a remembered "wall time" never shows empty charts. */
  function axisMode() {
    return state.stepTime.size ? state.xMode : "step";
  }

  function markerX(m) {
    if (axisMode() === "step") return m.step;
    const t = state.stepTime.get(m.step);
    if (t === undefined) return null;
    return axisMode() === "wall" ? t : t - state.firstTime;
  }

  function markAllDirty() {
    for (const s of state.series.values()) s.dirty = true;
    scheduleDraw();
  }

  // ---------------------------------------------------------------- drawing
  /** What the chart shows now: x in the current mode (points without a time are left out of the
   * time axes), the raw values and the smoothed ones, as uPlot's [xs, raw, smooth]. */
  function viewOf(s) {
    const smooth = Kit.emaUpdate(s, state.smoothing);
    if (axisMode() === "step") return { steps: s.steps, xs: s.steps, raw: s.values, smooth };
    const offset = axisMode() === "relative" ? state.firstTime : 0;
    let idx = [];
    for (let i = 0; i < s.steps.length; i++) if (state.stepTime.has(s.steps[i])) idx.push(i);
    const time = (i) => state.stepTime.get(s.steps[i]);
    for (let k = 1; k < idx.length; k++) {
      if (time(idx[k]) < time(idx[k - 1])) { idx = idx.slice().sort((a, b) => time(a) - time(b)); break; } // a resumed attempt re-doing steps
    }
    return {
      steps: idx.map((i) => s.steps[i]),
      xs: idx.map((i) => time(i) - offset),
      raw: idx.map((i) => s.values[i]),
      smooth: smooth === s.values ? null : idx.map((i) => smooth[i]),
    };
  }

  function wantedDistr(s) {
    if (!state.log.has(s.name)) return 1;
    // Log needs positive values; anything <= 0 gets asinh (log-like, through zero).
    return s.values.every((v) => v === null || !Number.isFinite(v) || v > 0) ? 3 : 4;
  }

  function yRangeFor(distr) {
    if (distr === 3) return (u, min, max) => (min > 0 && max > 0 ? uPlot.rangeLog(min, max, 10, true) : [1, 10]);
    if (distr === 4) return (u, min, max) => uPlot.rangeAsinh(min, max, 10, true);
    return GrpoCharts.yRange;
  }

  function xValues(card) {
    return (u, splits) => {
      const span = u.scales.x.max - u.scales.x.min;
      const labels = splits.map((v) => {
        if (v === null || v === undefined) return "";
        if (axisMode() === "wall") return Kit.clockLabel(v, span);
        if (axisMode() === "relative") return Kit.elapsedLabel(v);
        return GrpoCharts.formatValue(v);
      });
      card.dataset.xTicks = labels.join("|");
      return labels;
    };
  }

  function makeChart(s, data) {
    const distr = (s.distr = wantedDistr(s));
    const card = s.card;
    s.card.dataset.scale = distr === 3 ? "log" : distr === 4 ? "asinh" : "linear";
    s.logButton.setAttribute("aria-pressed", String(distr !== 1));
    s.logButton.title = distr === 4
      ? "log scale: this series has values <= 0, so it is drawn on an asinh scale (log-like, through zero)"
      : "log scale";
    const opts = {
      width: Math.max(160, s.box.clientWidth || 360),
      height: 170,
      legend: { show: false },
      cursor: {
        sync: { key: SYNC_KEY, setSeries: false },
        drag: { x: true, y: false, setScale: false }, // the panel zooms every chart (setSelect below)
        points: { size: 5 },
      },
      scales: {
        x: { time: axisMode() === "wall" },
        y: { distr, log: 10, range: yRangeFor(distr) },
      },
      series: [
        { label: X_LABEL[axisMode()] },
        // A metric logged once (the end-of-training summary: train_runtime, total_flos) has no line
        // to draw: it is shown as a dot.
        { label: "raw", stroke: () => (state.smoothing > 0 ? FAINT : STRONG), width: 1.25, spanGaps: true, points: { show: (u, i) => Kit.loneValue(u.data[i]) } },
        { label: "smoothed", stroke: STRONG, width: 1.75, spanGaps: true, points: { show: false }, show: state.smoothing > 0 },
      ],
      axes: [
        // steps are whole numbers: whole-step ticks only (the time axes keep uPlot's own spacings)
        { size: 28, space: axisMode() === "wall" ? 80 : axisMode() === "relative" ? 64 : 50, values: xValues(card),
          incrs: axisMode() === "step" ? GrpoCharts.INTEGER_INCRS : undefined },
        { size: Kit.axisSize, values: (u, ticks) => ticks.map(GrpoCharts.formatValue) },
      ],
      hooks: {
        setCursor: [(u) => showReadout(s, u.cursor.idx)],
        setSelect: [(u) => onSelect(u)],
        setScale: [(u, key) => { if (key === "x") { card.dataset.xMin = String(u.scales.x.min); card.dataset.xMax = String(u.scales.x.max); } }],
        draw: [(u) => drawMarkers(u), (u) => Kit.recordAxisFit(u, card)],
      },
    };
    const chart = new uPlot(opts, data, s.box);
    chart.over.addEventListener("dblclick", () => setZoom(null));
    return chart;
  }

  function render(s) {
    const view = (s.view = viewOf(s));
    const data = [view.xs, view.raw, view.smooth || view.raw];
    if (s.chart && s.distr !== wantedDistr(s)) { s.chart.destroy(); s.chart = null; s.box.replaceChildren(); }
    if (!s.chart) s.chart = makeChart(s, data);
    else {
      const w = Math.max(160, s.box.clientWidth);
      if (Math.abs(w - s.chart.width) > 2) s.chart.setSize({ width: w, height: s.chart.height });
      s.chart.setData(data);
    }
    if (s.chart.series[2].show !== state.smoothing > 0) s.chart.setSeries(2, { show: state.smoothing > 0 });
    if (state.zoom) s.chart.setScale("x", { min: state.zoom[0], max: state.zoom[1] });
    s.card.dataset.points = String(s.steps.length);
    s.card.dataset.markers = container.dataset.markers || "";
    const n = s.values.length;
    const lastRaw = n ? s.values[n - 1] : null;
    const lastSmooth = view.smooth && view.smooth.length ? view.smooth[view.smooth.length - 1] : null;
    s.last.textContent = GrpoCharts.formatValue(lastRaw) + (state.smoothing > 0 ? ` (ema ${GrpoCharts.formatValue(lastSmooth)})` : "");
    s.card.dataset.smoothedLast = state.smoothing > 0 ? String(lastSmooth) : String(lastRaw);
  }

  function visible(s) {
    return !s.card.hidden && !s.card.closest("section")?.classList.contains("collapsed");
  }

  function scheduleDraw() {
    if (!state.frame) state.frame = requestAnimationFrame(draw);
  }

  function draw() {
    state.frame = 0;
    if (state.markersDirty) computeMarkers();
    if (state.pendingZoom !== null) applyZoom();
    for (const s of state.series.values()) {
      if (!s.dirty || !visible(s)) continue; // a hidden chart stays dirty: drawn when shown
      s.dirty = false;
      render(s);
    }
  }

  // ---------------------------------------------------------------- hover, zoom, markers
  function showReadout(s, idx) {
    const view = s.view;
    if (idx === null || idx === undefined || !view || idx >= view.xs.length) {
      s.readout.textContent = "";
      delete s.card.dataset.hoverStep;
      return;
    }
    const step = view.steps[idx];
    const x = view.xs[idx];
    const where = axisMode() === "step" ? `step ${step}`
      : axisMode() === "wall" ? `${new Date(x * 1000).toLocaleString()} · step ${step}`
      : `${Kit.elapsedLabel(x)} · step ${step}`;
    const attempt = state.stepAttempt.get(step);
    const smooth = state.smoothing > 0 && view.smooth ? ` · ema ${GrpoCharts.formatValue(view.smooth[idx])}` : "";
    s.readout.textContent = `${where}: ${GrpoCharts.formatValue(view.raw[idx])}${smooth}${attempt > 1 ? ` · attempt ${attempt}` : ""}`;
    s.card.dataset.hoverStep = String(step);
  }

  function onSelect(u) {
    if (u.select.width < 3) return;
    const min = u.posToVal(u.select.left, "x");
    const max = u.posToVal(u.select.left + u.select.width, "x");
    u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
    // Synced charts report the same drag: the first range of the frame wins, applied once.
    if (state.pendingZoom === null && max > min) state.pendingZoom = [min, max];
    scheduleDraw();
  }

  function setZoom(range) {
    if (range === null) {
      if (!state.zoom && state.pendingZoom === null) return;
      state.zoom = null;
      state.pendingZoom = null;
      document.getElementById("chart-reset-zoom").hidden = true;
      delete container.dataset.zoom;
      markAllDirty(); // setData re-fits x to each chart's data
      return;
    }
    state.pendingZoom = range;
    scheduleDraw();
  }

  function applyZoom() {
    state.zoom = state.pendingZoom;
    state.pendingZoom = null;
    document.getElementById("chart-reset-zoom").hidden = false;
    container.dataset.zoom = state.zoom.join(",");
    for (const s of state.series.values()) {
      if (s.chart && visible(s)) s.chart.setScale("x", { min: state.zoom[0], max: state.zoom[1] });
      else s.dirty = true;
    }
  }

  function drawMarkers(u) {
    if (!state.markers.length) return;
    const ctx = u.ctx, dpr = window.devicePixelRatio || 1;
    const { left, top, width, height } = u.bbox;
    ctx.save();
    ctx.lineWidth = dpr;
    ctx.setLineDash([4 * dpr, 3 * dpr]);
    ctx.font = `${10 * dpr}px system-ui, sans-serif`;
    for (const m of state.markers) {
      const x = markerX(m);
      if (x === null) continue;
      const px = Math.round(u.valToPos(x, "x", true));
      if (px < left || px > left + width) continue;
      const colors = MARKER_COLORS[m.kind];
      ctx.strokeStyle = colors.line;
      ctx.fillStyle = colors.text;
      ctx.beginPath();
      ctx.moveTo(px, top);
      ctx.lineTo(px, top + height);
      ctx.stroke();
      // Attempts label the top of the plot, metric changes the bottom: both can sit on one step.
      const y = m.kind === "attempt" ? top + 10 * dpr : top + height - 4 * dpr;
      ctx.fillText(m.label, px + 3 * dpr, y);
    }
    ctx.restore();
  }

  // ---------------------------------------------------------------- log, smoothing, x axis, filter
  function toggleLog(s) {
    if (state.log.has(s.name)) state.log.delete(s.name);
    else state.log.add(s.name);
    Kit.store(STORE.log, [...state.log]);
    if (s.chart) { s.chart.destroy(); s.chart = null; s.box.replaceChildren(); }
    s.dirty = true;
    scheduleDraw();
  }

  function setSmoothing(value) {
    state.smoothing = clampSmoothing(value);
    document.getElementById("chart-smoothing-value").textContent = state.smoothing.toFixed(2);
    container.dataset.smoothing = String(state.smoothing);
    Kit.store(STORE.smoothing, state.smoothing);
    markAllDirty();
  }

  function setXMode(mode) {
    if (!X_LABEL[mode]) return;
    state.xMode = mode;
    container.dataset.xAxis = mode;
    Kit.store(STORE.x, mode);
    state.zoom = null; // a range in steps means nothing in seconds
    state.pendingZoom = null;
    document.getElementById("chart-reset-zoom").hidden = true;
    delete container.dataset.zoom;
    for (const s of state.series.values()) { // the x scale's kind changes: new charts
      if (s.chart) { s.chart.destroy(); s.chart = null; s.box.replaceChildren(); }
      s.dirty = true;
    }
    scheduleDraw();
  }

  function applyFilter() {
    const input = document.getElementById("metric-filter");
    const error = document.getElementById("metric-filter-error");
    state.matcher = Kit.nameMatcher(input.value);
    // An invalid regex hides nothing: every chart stays, with the error beside the box.
    error.textContent = state.matcher.error || "";
    error.hidden = !state.matcher.error;
    input.setAttribute("aria-invalid", String(Boolean(state.matcher.error)));
    for (const s of state.series.values()) s.card.hidden = !state.matcher.error && !state.matcher.test(s.name);
    refreshSections();
    scheduleDraw();
  }

  function fitWidths() {
    for (const s of state.series.values()) if (s.chart && visible(s)) s.dirty = true;
    scheduleDraw();
  }

  // ---------------------------------------------------------------- the core's calls
  /** The metric catalogue's payload (GET /api/v1/metrics/catalogue/), before any chart is made. */
  function init(cataloguePayload) {
    state.catalogue = GrpoCharts.catalogue(cataloguePayload);
  }

  /** GET metrics/?layout=columns: {series: {name: {steps, values}}, steps: {step, time, attempt}}. */
  function addColumns(payload) {
    const steps = (payload && payload.steps) || { step: [] };
    for (let i = 0; i < steps.step.length; i++) setStep(steps.step[i], steps.time[i], steps.attempt[i]);
    for (const [name, col] of Object.entries((payload && payload.series) || {})) {
      for (let i = 0; i < col.steps.length; i++) addPoint(name, col.steps[i], col.values[i]);
      const n = col.steps.length;
      if (n && col.steps[n - 1] > state.lastStep) state.lastStep = col.steps[n - 1];
    }
    scheduleDraw();
  }

  /** A websocket metrics message: {step, values: {name: value}, time, attempt}. */
  function onMetrics(msg) {
    setStep(msg.step, msg.time, msg.attempt);
    for (const [name, value] of Object.entries(msg.values)) addPoint(name, msg.step, value);
    if (msg.step > state.lastStep) state.lastStep = msg.step;
    scheduleDraw();
  }

  /** The last step of any metric whose name starts with `prefix` (e.g. "eval/"), or null: a reconnect's
   * backfill starts there, as an eval line for a step comes after later steps' lines. */
  function lastStepOf(prefix) {
    let last = null;
    for (const s of state.series.values()) {
      const n = s.steps.length;
      if (n && s.name.startsWith(prefix) && (last === null || s.steps[n - 1] > last)) last = s.steps[n - 1];
    }
    return last;
  }

  /** A metric's data as the page holds it: {steps, values, smoothed} (arrays by step), or null. */
  function series(name) {
    const s = state.series.get(name);
    return s ? { steps: s.steps, values: s.values, smoothed: Kit.emaUpdate(s, state.smoothing) } : null;
  }

  // ---------------------------------------------------------------- controls
  if (container) {
    const smoothing = document.getElementById("chart-smoothing");
    smoothing.value = String(state.smoothing);
    smoothing.addEventListener("input", () => setSmoothing(smoothing.value));
    setSmoothing(state.smoothing);
    const xSelect = document.getElementById("chart-x");
    xSelect.value = state.xMode;
    container.dataset.xAxis = state.xMode;
    xSelect.addEventListener("change", () => setXMode(xSelect.value));
    document.getElementById("chart-reset-zoom").addEventListener("click", () => setZoom(null));
    document.getElementById("metric-filter").addEventListener("input", applyFilter);
    window.addEventListener("resize", fitWidths);
    uPlot.sync(SYNC_KEY); // one cursor group for the page's charts
    loadPins();
  }

  return { init, addColumns, onMetrics, lastStep: () => state.lastStep, lastStepOf, series, setZoom, setXMode, setSmoothing };
})();
