// Run comparison (X3): one metric of several runs overlaid on one step axis. Each run's series comes
// from GET /api/v1/runs/<id>/metrics/?names=<metric>&layout=columns.
"use strict";

(() => {
  const root = document.getElementById("compare");
  if (!root) return;
  const metric = document.getElementById("compare-metric").value;
  const runs = [...document.querySelectorAll("#compare-runs li")].map((li) => ({
    id: li.dataset.runId,
    label: li.textContent.trim().split(" ").slice(0, 2).join(" "),
  }));
  if (!runs.length || !metric) return;

  async function series(runId) {
    const url = `${root.dataset.apiRoot}${runId}/metrics/?layout=columns&names=${encodeURIComponent(metric)}`;
    const resp = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!resp.ok) throw new Error(`run ${runId}: HTTP ${resp.status}`);
    return (await resp.json()).series[metric] || { steps: [], values: [] };
  }

  /** Align several (steps, values) columns on the union of their steps (null where a run has none). */
  function align(columns) {
    const steps = [...new Set(columns.flatMap((c) => c.steps))].sort((a, b) => a - b);
    const index = new Map(steps.map((s, i) => [s, i]));
    const ys = columns.map((c) => {
      const y = new Array(steps.length).fill(null);
      c.steps.forEach((s, i) => { y[index.get(s)] = c.values[i]; });
      return y;
    });
    return [steps, ...ys];
  }

  Promise.all(runs.map((r) => series(r.id)))
    .then((columns) => {
      const box = document.getElementById("compare-chart");
      const data = align(columns);
      const chart = GrpoCharts.lineChart(box, runs.map((r) => r.label), data, { height: 360, legend: true });
      box.dataset.points = String(columns.reduce((n, c) => n + c.steps.length, 0));
      const empty = runs.filter((r, i) => columns[i].steps.length === 0).map((r) => r.label);
      document.getElementById("compare-note").textContent = empty.length ? `no "${metric}" logged by: ${empty.join(", ")}` : "";
      window.addEventListener("resize", () => GrpoCharts.fitWidths([chart]));
    })
    .catch((err) => { document.getElementById("compare-note").textContent = String(err); });
})();
