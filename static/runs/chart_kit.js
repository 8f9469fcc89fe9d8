// Pure helpers of the run page's metric panel (static/runs/metric_panel.js): EMA smoothing, the
// metric-name filter, axis sizing and tick labels. No DOM state of their own, so they stay testable
// and cheap; the panel calls them once per drawn frame at most.
"use strict";

const GrpoChartKit = (() => {
  /**
   * Debiased exponential moving average, computed incrementally into `s.ema` (W&B's smoothing):
   * acc = a * acc + (1 - a) * v over the finite values; smoothed = acc / (1 - a^n), n the finite
   * values so far, so the first points are not pulled towards 0. A null (NaN) value stays null and
   * does not move the average. `s`: {values, ema, emaDone, emaAcc, emaPow, emaAlpha}; only the
   * values past `s.emaDone` are computed (reset `emaDone` to 0 when an earlier value changed).
   * With a = 0 the "smoothed" series is the raw array itself (nothing to compute).
   */
  function emaUpdate(s, alpha) {
    if (alpha <= 0) return s.values;
    if (s.emaAlpha !== alpha || !s.ema || s.emaDone > s.values.length) s.emaDone = 0;
    if (s.emaDone === 0) {
      s.ema = [];
      s.emaAcc = 0;
      s.emaPow = 1;
      s.emaAlpha = alpha;
    }
    const values = s.values, out = s.ema;
    let acc = s.emaAcc, pow = s.emaPow;
    for (let i = s.emaDone; i < values.length; i++) {
      const v = values[i];
      if (v === null || v === undefined || !Number.isFinite(v)) {
        out[i] = null;
        continue;
      }
      acc = alpha * acc + (1 - alpha) * v;
      pow *= alpha;
      const smoothed = acc / (1 - pow);
      // A flat series stays exactly flat (rounding would otherwise jitter it by a pixel).
      out[i] = Math.abs(smoothed - v) <= 1e-12 * Math.abs(v) ? v : smoothed;
    }
    out.length = values.length;
    s.emaAcc = acc;
    s.emaPow = pow;
    s.emaDone = values.length;
    return out;
  }

  /**
   * The metric filter box's query as a matcher: `/re/flags` a regular expression (case-insensitive
   * unless flags are given; g and y dropped, they make test() stateful), text with `*` or `?` a glob
   * over the whole name, other text a substring; all case-insensitive. Returns {test(name)} or
   * {error} for an invalid regular expression (the panel then shows every chart and the error).
   */
  function nameMatcher(query) {
    const q = (query || "").trim();
    if (!q) return { test: () => true };
    const re = /^\/(.+)\/([a-z]*)$/.exec(q);
    if (re) {
      try {
        const flags = re[2] ? re[2].replace(/[gy]/g, "") : "i";
        const regex = new RegExp(re[1], flags);
        return { test: (name) => regex.test(name) };
      } catch (err) {
        return { error: `invalid regular expression: ${err.message}` };
      }
    }
    if (/[*?]/.test(q)) {
      const body = q.replace(/[.+^${}()|[\]\\]/g, "\\$&").replace(/\*/g, ".*").replace(/\?/g, ".");
      const glob = new RegExp(`^${body}$`, "i");
      return { test: (name) => glob.test(name) };
    }
    const needle = q.toLowerCase();
    return { test: (name) => name.toLowerCase().includes(needle) };
  }

  /**
   * A uPlot axis `size` function: the widest tick label (measured in the axis font) plus the
   * ticks and the gap, so "1.2e-05" or "12,345,678" never runs into the plot or the page edge.
   */
  function axisSize(u, values, axisIdx, cycleNum) {
    const axis = u.axes[axisIdx];
    let widest = 0;
    if (values && values.length) {
      u.ctx.font = axis.font[0];
      for (const v of values) if (v) widest = Math.max(widest, u.ctx.measureText(v).width);
    }
    axis._labelPx = widest / (window.devicePixelRatio || 1); // the labels last asked for (recordAxisFit)
    const size = Math.ceil(axis._labelPx + axis.ticks.size + axis.gap + 4);
    // uPlot re-asks while the layout converges, and the narrower plot may bring longer labels
    // ("0.75" after "0.5"): never shrink within one layout, so the last labels asked for fit.
    return cycleNum > 1 && axis._size ? Math.max(size, axis._size) : size;
  }

  /** Whether a y column holds at most one value (nulls aside): such a series gets a dot. */
  function loneValue(ys) {
    let seen = 0;
    for (const v of ys) if (v !== null && v !== undefined && ++seen > 1) return false;
    return seen === 1;
  }

  /** The room for the y axis's labels (its width less the ticks and the gap) and its widest drawn
   * label, in CSS px, on the card (data-y-axis-px, data-y-label-px): the browser test checks every
   * label fits. */
  function recordAxisFit(u, card) {
    const axis = u.axes[1]; // axisSize measured its labels: nothing is measured again per draw
    card.dataset.yLabelPx = String(Math.ceil(axis._labelPx || 0));
    card.dataset.yAxisPx = String(Math.floor(axis._size - axis.ticks.size - axis.gap));
  }

  /** Seconds as a short clock label for a wall-time axis spanning `span` seconds. */
  function clockLabel(seconds, span) {
    const d = new Date(seconds * 1000);
    const pad = (n) => String(n).padStart(2, "0");
    const hm = `${pad(d.getHours())}:${pad(d.getMinutes())}`;
    if (span > 2 * 86400) return `${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${hm}`;
    if (span > 1200) return hm;
    return `${hm}:${pad(d.getSeconds())}`;
  }

  /** Seconds since the run's first step as "1h05m", "12m30s", "42s", "1.5s". */
  function elapsedLabel(seconds) {
    if (!Number.isFinite(seconds)) return "";
    const sign = seconds < 0 ? "-" : "";
    let s = Math.abs(seconds);
    if (s < 10 && s % 1) return `${sign}${parseFloat(s.toFixed(1))}s`;
    s = Math.round(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    if (h) return `${sign}${h}h${m ? String(m).padStart(2, "0") + "m" : ""}`;
    if (m) return `${sign}${m}m${sec ? String(sec).padStart(2, "0") + "s" : ""}`;
    return `${sign}${sec}s`;
  }

  /** Index of the first element >= x in a sorted array. */
  function lowerBound(arr, x) {
    let lo = 0, hi = arr.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (arr[mid] < x) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  /** localStorage as JSON, forgiving: private mode or a corrupt value gives `fallback`. */
  function stored(key, fallback) {
    try {
      const text = window.localStorage.getItem(key);
      return text === null ? fallback : JSON.parse(text);
    } catch (err) {
      return fallback;
    }
  }

  function store(key, value) {
    try {
      window.localStorage.setItem(key, JSON.stringify(value));
    } catch (err) {
      /* private mode or full: the setting lasts for this page only */
    }
  }

  return { emaUpdate, nameMatcher, axisSize, loneValue, recordAxisFit, clockLabel, elapsedLabel, lowerBound, stored, store };
})();
