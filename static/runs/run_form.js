// The run form: choosing a model prefills the hyper-parameters and the advanced JSON from that
// model's preset (embedded by the page as #run-presets: {"presets": {model: values}, "generic": values},
// the generic values serving any model without a preset of its own).
//
// A field the user has edited is never overwritten: it counts as edited once they type in it, and
// from the start when the page comes with a value other than the selected model's preset (a clone,
// or a form sent back with errors).
"use strict";

(() => {
  const form = document.getElementById("run-form");
  const embedded = document.getElementById("run-presets");
  if (!form || !embedded) return;
  const { presets, generic } = JSON.parse(embedded.textContent);
  const model = form.elements.model;
  const names = Object.keys(generic);

  function presetFor(name) {
    return presets[name] || generic;
  }

  function holds(input, value) {
    if (input.type === "checkbox") return input.checked === Boolean(value);
    if (input.type === "number") {
      const text = input.value.trim();
      return value === null ? text === "" : text !== "" && Number(text) === Number(value);
    }
    return input.value.trim() === String(value ?? "").trim();
  }

  function put(input, value) {
    if (input.type === "checkbox") input.checked = Boolean(value);
    else input.value = value === null || value === undefined ? "" : String(value);
  }

  const initial = presetFor(model.value);
  for (const name of names) {
    const input = form.elements[name];
    if (!input) continue;
    if (!holds(input, initial[name])) input.dataset.edited = "true";
    const mark = () => { input.dataset.edited = "true"; };
    input.addEventListener("input", mark);
    input.addEventListener("change", mark);
  }

  model.addEventListener("change", () => {
    const preset = presetFor(model.value);
    for (const name of names) {
      const input = form.elements[name];
      if (input && input.dataset.edited !== "true") put(input, preset[name]);
    }
  });

  // The chosen dataset's columns and first rows (GET /api/v1/registry/datasets/<name>/), so a
  // reward's "reads ..." can be checked against them before submitting; the same for the eval dataset.
  function cell(value) {
    const td = document.createElement("td");
    td.textContent = typeof value === "string" ? value : JSON.stringify(value);
    return td;
  }

  async function showPreview(dataset, preview) {
    if (!dataset || !preview) return;
    const name = dataset.value.trim();
    if (!name) { preview.replaceChildren(); delete preview.dataset.columns; return; } // the eval set is optional
    preview.textContent = "loading a preview…";
    try {
      const resp = await fetch(preview.dataset.api + encodeURIComponent(name) + "/", { credentials: "same-origin" });
      const body = await resp.json();
      if (dataset.value.trim() !== name) return; // another choice since
      if (!resp.ok) { preview.textContent = body.detail || `no preview (HTTP ${resp.status})`; return; }
      const table = document.createElement("table");
      table.className = "runs preview";
      const head = document.createElement("tr");
      for (const column of body.columns) { const th = document.createElement("th"); th.textContent = column; head.append(th); }
      table.append(head);
      for (const row of body.rows) {
        const tr = document.createElement("tr");
        for (const column of body.columns) tr.append(cell(row[column]));
        table.append(tr);
      }
      const caption = document.createElement("div");
      caption.textContent = `columns: ${body.columns.join(", ")} · ${body.num_rows} rows · first ${body.rows.length}:`;
      preview.replaceChildren(caption, table);
      preview.dataset.columns = body.columns.join(",");
    } catch (err) {
      preview.textContent = `no preview (${err})`;
    }
  }

  for (const [field, id] of [["train_dataset", "dataset-preview"], ["eval_dataset", "eval-dataset-preview"]]) {
    const dataset = form.elements[field];
    const preview = document.getElementById(id);
    if (!dataset || !preview) continue;
    dataset.addEventListener("change", () => showPreview(dataset, preview));
    showPreview(dataset, preview);
  }
})();
