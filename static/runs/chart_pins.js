// The user's pinned charts on the run page (static/runs/metric_panel.js places the cards): which
// metrics are pinned and in what order, read from and saved to the server's chart preferences
// (GET/PUT {data-preferences}, `ChartPreference`). While a user has saved none, the server's
// defaults are pinned and so are a run's headline eval charts (eval/reward, eval/pass@k) once it
// logs them; the first pin a user saves keeps what they saw pinned. No DOM of its own.
"use strict";

const GrpoChartPins = (() => {
  // Pinned by default (not saved) when the run logs them: the headline numbers of evaluation.
  const EVAL_PINS = /^eval\/(reward|pass@\d+)$/;

  /** The pins of `url` (the preferences endpoint): null until `load` answers. */
  function create(url) {
    let pinned = null; // metric names, in the user's order
    let defaults = false; // the user never saved pins: the server's defaults, and EVAL_PINS too

    const loaded = () => pinned !== null;
    const isPinned = (name) => (pinned || []).includes(name) || (defaults && EVAL_PINS.test(name));

    /** A pinned chart's place in the Pinned group: the saved order, then default eval pins by name. */
    function rank(name) {
      const i = pinned.indexOf(name);
      return i >= 0 ? String(i).padStart(4, "0") : `z${name}`;
    }

    /** Read the user's pins; on failure none (logged), so the page still draws every chart. */
    async function load() {
      try {
        const resp = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
        if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
        const body = await resp.json();
        pinned = body.pinned;
        defaults = body.default === true;
      } catch (err) {
        console.warn("chart preferences", err);
        pinned = [];
      }
    }

    /**
     * Pin or unpin `name` now, `logged` being the metrics the run has logged, and save: the promise
     * resolves once the server took it, or rejects with its reason after putting the pins back as
     * they were (the page shows what the server has).
     */
    function toggle(name, logged) {
      const before = pinned, wasDefault = defaults;
      const shown = wasDefault ? [...before, ...logged.filter((m) => EVAL_PINS.test(m) && !before.includes(m)).sort()] : before;
      defaults = false;
      pinned = shown.includes(name) ? shown.filter((m) => m !== name) : [...shown, name];
      return save(before, wasDefault);
    }

    async function save(before, wasDefault) {
      try {
        const csrf = document.querySelector("[name=csrfmiddlewaretoken]");
        const resp = await fetch(url, {
          method: "PUT",
          credentials: "same-origin",
          headers: { "Content-Type": "application/json", Accept: "application/json", "X-CSRFToken": csrf ? csrf.value : "" },
          body: JSON.stringify({ pinned }),
        });
        const body = await resp.json().catch(() => ({}));
        if (!resp.ok) throw new Error((body.pinned && body.pinned[0]) || body.detail || `HTTP ${resp.status}`);
      } catch (err) {
        pinned = before;
        defaults = wasDefault;
        throw err;
      }
    }

    return { loaded, isPinned, rank, load, toggle };
  }

  return { create, EVAL_PINS };
})();
