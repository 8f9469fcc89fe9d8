// Line charts on uPlot (vendored under static/vendor/uplot), shared by the run dashboard and the
// run comparison page. One chart = one metric (or one metric across runs); x is the optimizer step.
"use strict";

const GrpoCharts = (() => {
  const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

  /** A compact, readable number: 0.5612, 1.2e-05, 12,345. */
  function formatValue(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    return String(parseFloat(v.toPrecision(4))); // 0.01000 -> 0.01
  }

  /** Seconds as "1h 02m", "3m 12s", "42s". */
  function formatDuration(s) {
    if (!Number.isFinite(s) || s < 0) return "";
    s = Math.round(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
    if (m) return `${m}m ${String(sec).padStart(2, "0")}s`;
    return `${sec}s`;
  }

  /**
   * Tick spacings for an axis of integers (the optimizer step): 1, 2, 5, 10, 20, 25, 50, 100, ...
   * uPlot's default for a number axis also offers 0.5 and 2.5, which put ticks at steps 2.5 and 7.5
   * on a short run. Ticks are multiples of the spacing, so every tick is a whole step, zoomed or not.
   */
  const INTEGER_INCRS = [1, 2, 5];
  for (let mag = 10; mag <= 1e15; mag *= 10) INTEGER_INCRS.push(mag, 2 * mag, 2.5 * mag, 5 * mag);

  /**
   * The y range: uPlot's padded default, except for a (nearly) flat series, which gets a band of 1% of
   * its magnitude. An importance-sampling ratio of 0.99999988 vs 0.99999982 otherwise asks uPlot's
   * tick splitter for millions of ticks ("Invalid array length").
   */
  function yRange(u, min, max) {
    if (min === null || max === null || !Number.isFinite(min) || !Number.isFinite(max)) return [0, 1];
    const magnitude = Math.max(Math.abs(min), Math.abs(max));
    if (max - min <= magnitude * 1e-6) {
      const pad = magnitude ? magnitude * 0.01 : 1;
      return [min - pad, max + pad];
    }
    return uPlot.rangeNum(min, max, 0.1, true);
  }

  /**
   * A uPlot line chart in `el`. `labels`: one per series (y columns). Data is
   * [steps, ys0, ys1, ...] with null for a missing value (gaps are spanned).
   */
  function lineChart(el, labels, data, { height = 170, legend = labels.length > 1 } = {}) {
    const width = Math.max(240, el.clientWidth - 8 || 360);
    const opts = {
      width,
      height,
      scales: { x: { time: false }, y: { range: yRange } },
      legend: { show: legend, live: true },
      cursor: { drag: { x: true, y: false } },
      series: [
        { label: "step", value: (u, v) => (v === null || v === undefined ? "–" : String(v)) },
        ...labels.map((label, i) => ({
          label,
          stroke: PALETTE[i % PALETTE.length],
          width: 1.5,
          spanGaps: true,
          points: { show: false },
          value: (u, v) => formatValue(v),
        })),
      ],
      axes: [{ size: 28, incrs: INTEGER_INCRS }, { size: 56, values: (u, ticks) => ticks.map(formatValue) }],
    };
    return new uPlot(opts, data, el);
  }

  /** Resize every chart to its container's width (on window resize). */
  function fitWidths(charts) {
    for (const chart of charts) {
      const w = Math.max(240, chart.root.parentElement.clientWidth - 8);
      if (Math.abs(w - chart.width) > 2) chart.setSize({ width: w, height: chart.height });
    }
  }

  /** The metric namespace a chart is grouped under ("rollout/concurrency" -> "rollout"). */
  function namespaceOf(name) {
    const slash = name.indexOf("/");
    return slash < 0 ? "train" : name.slice(0, slash);
  }

  /**
   * The metric catalogue (GET /api/v1/metrics/catalogue/) as a lookup: `lookup(name)` is the
   * declaration of a concrete name (exact names first, then patterns such as "rewards/{name}/mean"),
   * or null for a name it does not declare (a plugin's own metric).
   */
  function catalogue(payload) {
    const metrics = (payload && payload.metrics) || [];
    const exact = new Map(metrics.filter((m) => !m.templated).map((m) => [m.name, m]));
    const escape = (s) => s.replace(/[.*+?^$()|[\]\\]/g, "\\$&");
    const patterns = metrics.filter((m) => m.templated).map((m) => [
      new RegExp("^" + m.name.split(/\{\w+\}/).map(escape).join(".+") + "$"), m,
    ]);
    function lookup(name) {
      if (exact.has(name)) return exact.get(name);
      const hit = patterns.find(([re]) => re.test(name));
      return hit ? hit[1] : null;
    }
    return { lookup, namespaces: (payload && payload.namespaces) || [] };
  }

  return { PALETTE, INTEGER_INCRS, formatValue, formatDuration, yRange, lineChart, fitWidths, namespaceOf, catalogue };
})();
