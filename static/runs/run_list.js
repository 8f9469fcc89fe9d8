// The run list: status, progress and last reward updated in place, without a reload.
//
//   GET  {table.dataset.poll}   the API list of the rows shown (?id=3,5,8): by id, not by the page's
//                               filters, so a run that leaves them (finishes under ?status=running)
//                               is still updated
//
// Every POLL_MS while a shown run is live (SETTLED_MS once all are finished), and only while the
// tab is visible. A reload shows runs created since.
"use strict";

(() => {
  const table = document.getElementById("runs");
  if (!table || !table.dataset.poll) return;
  const ACTIVE = new Set(["queued", "starting", "running", "stopping"]);
  const POLL_MS = 3000;
  const SETTLED_MS = 15000;
  let timer = 0;

  function rowsShown() {
    return [...table.querySelectorAll("tbody tr[data-run-id]")];
  }

  function anyActive() {
    return rowsShown().some((tr) => ACTIVE.has(tr.querySelector(".status")?.textContent.trim()));
  }

  function update(tr, run) {
    const badge = tr.querySelector(".status");
    if (badge && badge.textContent !== run.status) {
      badge.textContent = run.status;
      badge.className = `status status-${run.status}`;
    }
    const cell = tr.querySelector(".run-progress");
    if (cell) {
      const step = run.step ?? 0;
      const max = run.max_steps;
      cell.querySelector(".run-step").textContent = max ? `${step} / ${max}` : `${step}`;
      let bar = cell.querySelector(".progress > div");
      if (max && !bar) {
        const outer = document.createElement("div");
        outer.className = "progress";
        bar = document.createElement("div");
        outer.append(bar);
        cell.append(outer);
      }
      if (bar && max) bar.style.width = `${Math.min(100, Math.round((100 * step) / max))}%`;
    }
    const reward = tr.querySelector(".run-reward");
    if (reward) reward.textContent = run.last_reward === null || run.last_reward === undefined ? "–" : `${+run.last_reward.toFixed(4)}`;
    tr.dataset.polled = String((+tr.dataset.polled || 0) + 1); // tests wait on this
  }

  async function poll() {
    timer = 0;
    if (document.visibilityState === "visible") {
      try {
        const resp = await fetch(table.dataset.poll, { credentials: "same-origin", headers: { Accept: "application/json" } });
        if (resp.ok) {
          const body = await resp.json();
          const byId = new Map(body.results.map((run) => [String(run.id), run]));
          for (const tr of rowsShown()) {
            const run = byId.get(tr.dataset.runId);
            if (run) update(tr, run);
          }
        }
      } catch (err) {
        console.warn(`run list poll: ${err}`);
      }
    }
    schedule();
  }

  function schedule() {
    if (!timer) timer = setTimeout(poll, anyActive() ? POLL_MS : SETTLED_MS);
  }

  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible") {
      clearTimeout(timer);
      timer = 0;
      poll();
    }
  });
  schedule();
})();
