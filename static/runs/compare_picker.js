// The comparison page's controls: the metric picker (filter the names, count what is chosen, and
// submit as the canonical ?runs=3,5&metrics=a,b link) and the config diff's "show all keys" toggle.
// Without this script the form still works: it submits ?runs=3,5&metric=a&metric=b, which the page
// reads the same.
"use strict";

(() => {
  const form = document.getElementById("compare-form");
  if (form) {
    const boxes = () => [...form.querySelectorAll("input[type=checkbox][name=metric]")];
    const picked = document.getElementById("picked");
    // Charts keep the order the metrics were chosen in (the ones shown now first, then each new
    // one at the end), not the picker's alphabetical order.
    const data = document.getElementById("compare-data");
    let order = data ? JSON.parse(data.textContent).metrics.map((m) => m.name) : [];
    const checked = () => new Set(boxes().filter((b) => b.checked).map((b) => b.value));
    const chosen = () => {
      const on = checked();
      order = [...order.filter((name) => on.has(name)), ...[...on].filter((name) => !order.includes(name))];
      return order;
    };
    const showPicked = () => { picked.textContent = chosen().join(", ") || "reward, loss (default)"; };

    form.addEventListener("change", showPicked);
    document.getElementById("metric-clear").addEventListener("click", () => {
      for (const b of boxes()) b.checked = false;
      showPicked();
    });
    // Narrow the list as one types; a namespace with nothing left is hidden whole.
    document.getElementById("metric-filter").addEventListener("input", (ev) => {
      const q = ev.target.value.trim().toLowerCase();
      for (const fieldset of form.querySelectorAll("fieldset")) {
        let shown = 0;
        for (const label of fieldset.querySelectorAll("label")) {
          const hit = !q || label.textContent.toLowerCase().includes(q);
          label.hidden = !hit;
          if (hit) shown += 1;
        }
        fieldset.hidden = shown === 0;
      }
    });
    // Enter in the filter box would submit the form: only the Show button does.
    document.getElementById("metric-filter").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter") ev.preventDefault();
    });
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const params = new URLSearchParams({ runs: form.dataset.runs });
      const names = chosen();
      if (names.length) params.set("metrics", names.join(","));
      // URLSearchParams writes "," as %2C; the link reads better with it bare (a comma is legal there).
      location.assign(`${location.pathname}?${params.toString().replace(/%2C/g, ",")}`);
    });
  }

  const toggle = document.getElementById("diff-toggle");
  const table = document.getElementById("config-diff");
  if (toggle && table) {
    toggle.addEventListener("click", () => {
      const all = table.classList.toggle("all");
      toggle.textContent = all ? toggle.dataset.differing : toggle.dataset.all;
      toggle.setAttribute("aria-pressed", String(all));
    });
  }
})();
