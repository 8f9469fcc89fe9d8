// "Compare with…" on a run's page: pick other runs (the user's most recent ones, or those the run
// list API's ?q= search finds: name, note, tag, model, dataset, owner) and open the comparison of
// this run with them (/runs/compare/?runs=<this>,<picked>&metrics=reward,loss).
//
//   GET {api}?page_size=20&ordering=-created[&q=...]   the runs offered (only those the user may see)
"use strict";

(() => {
  const root = document.getElementById("compare-with");
  if (!root) return;
  const thisId = Number(root.dataset.runId);
  // The comparison takes GRPO_COMPARE_MAX_RUNS runs, this one included.
  const maxOthers = Math.max(1, (parseInt(root.dataset.maxRuns, 10) || 8) - 1);
  const list = document.getElementById("compare-with-results");
  const search = document.getElementById("compare-with-search");
  const open = document.getElementById("compare-with-open");
  const hint = document.getElementById("compare-with-hint");
  const picked = new Map(); // run id -> label; kept while the search changes what is listed
  let requested = 0; // the latest request's number: an older answer arriving late is dropped
  let timer = 0;
  let loaded = false;

  const { el } = GrpoDom;

  function showPicked() {
    open.disabled = picked.size === 0;
    hint.textContent = picked.size ? `with ${[...picked.values()].join(", ")}` : "";
  }

  function render(runs) {
    if (!runs.length) {
      list.replaceChildren(el("li", { class: "help", text: "No other run matches." }));
      return;
    }
    list.replaceChildren(...runs.map((run) => {
      const label = `#${run.id} ${run.name}`.trim();
      const box = el("input", { type: "checkbox", value: String(run.id), "data-label": label });
      box.checked = picked.has(run.id);
      return el("li", { "data-run-id": String(run.id) },
        el("label", {}, box, " ", label, " ", el("span", { class: `status status-${run.status}`, text: run.status })));
    }));
  }

  async function load(q) {
    const mine = ++requested;
    const params = new URLSearchParams({ page_size: "20", ordering: "-created" });
    if (q) params.set("q", q);
    let message = "";
    try {
      const resp = await fetch(`${root.dataset.api}?${params}`, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (mine !== requested) return;
      if (resp.ok) {
        render((await resp.json()).results.filter((run) => run.id !== thisId));
        return;
      }
      message = `could not list runs: HTTP ${resp.status}`;
    } catch (err) {
      message = `could not list runs: ${err}`;
    }
    if (mine === requested) list.replaceChildren(el("li", { class: "errorlist", text: message }));
  }

  root.addEventListener("toggle", () => {
    if (root.open && !loaded) {
      loaded = true;
      load("");
    }
    if (root.open) search.focus();
  });
  search.addEventListener("input", () => {
    clearTimeout(timer); // one request when typing pauses, not one per key
    timer = setTimeout(() => load(search.value.trim()), 250);
  });
  search.addEventListener("keydown", (ev) => { if (ev.key === "Enter") ev.preventDefault(); });
  list.addEventListener("change", (ev) => {
    const box = ev.target;
    if (!(box instanceof HTMLInputElement)) return;
    const id = Number(box.value);
    if (!box.checked) picked.delete(id);
    else if (picked.size >= maxOthers) {
      box.checked = false;
      hint.textContent = `at most ${maxOthers} other runs at once`;
      return;
    } else picked.set(id, box.dataset.label);
    showPicked();
  });
  open.addEventListener("click", () => {
    const ids = [thisId, ...picked.keys()].join(",");
    location.assign(`${root.dataset.compare}?runs=${ids}&metrics=reward,loss`);
  });
})();
