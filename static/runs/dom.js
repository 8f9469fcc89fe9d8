// What every run page script builds the page with: elements from tag, attributes and children (text
// always goes in as textContent, never as HTML, so a run name or a completion cannot inject markup),
// and JSON from the API (an error keeps the server's body, whose 400s name the field).
"use strict";

const GrpoDom = (() => {
  /** A `tag` element: attrs ("class", "text" = textContent, the rest as attributes) and children. */
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else node.setAttribute(k, v);
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }

  /** GET `url` as JSON (same-origin credentials); a non-2xx answer throws an Error carrying `body`. */
  async function fetchJSON(url) {
    const resp = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    const body = await resp.json().catch(() => ({}));
    if (!resp.ok) {
      const err = new Error(`${url}: HTTP ${resp.status}`);
      err.body = body;
      throw err;
    }
    return body;
  }

  return { el, fetchJSON };
})();
