// The run page's tags and note: shown to anyone who may see the run, edited in place by its owner.
//
//   PATCH {card.dataset.api}  {"tags": [...], "note": "..."}  -> the run (or 400 with field errors)
"use strict";

(() => {
  const card = document.getElementById("annotations");
  const form = document.getElementById("annotations-form");
  const edit = document.getElementById("annotations-edit");
  if (!card || !form || !edit) return;
  const tagsBox = document.getElementById("run-tags");
  const noteBox = document.getElementById("run-note");
  const errors = document.getElementById("annotations-errors");

  function show(editing) {
    form.hidden = !editing;
    edit.hidden = editing;
    tagsBox.hidden = editing;
    noteBox.hidden = editing;
  }

  function render(run) {
    tagsBox.replaceChildren();
    for (const tag of run.tags) {
      const link = document.createElement("a");
      link.className = "tag";
      link.href = `${card.dataset.list}?tag=${encodeURIComponent(tag)}`;
      link.textContent = tag;
      tagsBox.append(link);
    }
    if (!run.tags.length) {
      const none = document.createElement("span");
      none.className = "help";
      none.textContent = "No tags.";
      tagsBox.append(none);
    }
    noteBox.textContent = run.note;
    form.elements.tags.value = run.tags.join(", ");
    form.elements.note.value = run.note;
  }

  function showErrors(body) {
    errors.replaceChildren();
    const entries = typeof body === "object" && body ? Object.entries(body) : [["error", String(body)]];
    for (const [field, messages] of entries) {
      const li = document.createElement("li");
      li.textContent = `${field}: ${[].concat(messages).join(" ")}`;
      errors.append(li);
    }
  }

  edit.addEventListener("click", () => {
    errors.replaceChildren();
    show(true);
    form.elements.tags.focus();
  });
  document.getElementById("annotations-cancel").addEventListener("click", () => show(false));

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const tags = form.elements.tags.value.split(/[,\s]+/).filter(Boolean);
    const payload = { tags, note: form.elements.note.value };
    try {
      const resp = await fetch(card.dataset.api, {
        method: "PATCH",
        credentials: "same-origin",
        headers: {
          "Content-Type": "application/json",
          Accept: "application/json",
          "X-CSRFToken": form.querySelector("[name=csrfmiddlewaretoken]").value,
        },
        body: JSON.stringify(payload),
      });
      const body = await resp.json().catch(() => `HTTP ${resp.status}`);
      if (!resp.ok) {
        showErrors(body);
        return;
      }
      render(body);
      show(false);
    } catch (err) {
      showErrors(String(err));
    }
  });
})();
