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
})();
