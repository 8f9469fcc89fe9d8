// The run page's "Sampled completions" table: pages of whole groups from the server, searched,
// filtered and sorted there, so every logged step is reachable however long the run.
//
//   GET {api}?by=group&page=&ordering=&step=&groups=&reward_min=&reward_max=&group_id=&q=&split=
//       pages of groups, each with all its rollouts (a page never cuts a group)
//   GET {steps}?split=                   every step that has completions (the step picker)
//
// The dashboard (dashboard.js) calls GrpoCompletionPanel.load() once, .live(step, items, split) for
// each websocket "completions" message and .backfill() after a reconnect. Live samples are drawn only
// on the default view (all steps, newest first, no filter, first page) of their own split; on any
// other view of that split they are counted in a "N new samples" notice, so nothing moves under what
// the user is reading. The Training/Eval switch (shown when the run evaluates: an eval_dataset, or
// eval samples stored or arriving) picks the split: eval groups are one eval prompt's samples at the
// step whose weights were evaluated; samples of the other split never reach the view.
"use strict";

window.GrpoCompletionPanel = (() => {
  const panel = document.getElementById("completions-panel");
  const $ = (id) => document.getElementById(id);
  const DEFAULT_ORDERING = "-step";
  const SEARCH_DELAY_MS = 300; // typing in a box asks the server once it pauses
  const PROMPT_LINES = 3; // lines of a prompt shown before "show whole prompt"

  const state = {
    loaded: false,
    pending: [], // live messages that arrived before the first page
    view: { split: "train", step: "", ordering: DEFAULT_ORDERING, groups: "", reward_min: "", reward_max: "", group_id: "", q: "" },
    page: 1,
    count: 0, // groups matching the view
    pageSize: parseInt(panel?.dataset.pageSize, 10) || 10,
    shown: new Map(), // "step:group" -> {group, node} of the groups on screen
    steps: new Map(), // step -> samples stored (the picker's options)
    unseen: 0, // live samples not drawn (the notice's N)
    seq: 0, // the latest page request; older answers are dropped
    timer: 0,
  };

  // ---------------------------------------------------------------- helpers
  const { el } = GrpoDom;

  const fmt = (v) => (v === null || v === undefined ? "–" : GrpoCharts.formatValue(v));

  const { fetchJSON } = GrpoDom;

  function isDefaultView() {
    const v = state.view;
    return state.page === 1 && v.ordering === DEFAULT_ORDERING &&
      !v.step && !v.groups && !v.reward_min && !v.reward_max && !v.group_id && !v.q;
  }

  /** The view's filters as query parameters (the downloads take the same ones; the training split
   * is the API's default and is left out). */
  function filterParams() {
    const params = new URLSearchParams();
    for (const [k, v] of Object.entries(state.view)) {
      if (v !== "" && k !== "ordering" && !(k === "split" && v === "train")) params.set(k, v);
    }
    return params;
  }

  const groupKey = (step, groupId) => `${step}:${groupId ?? "-"}`;

  // ---------------------------------------------------------------- the step picker
  function addStepOption(step, samples) {
    const select = $("completion-step");
    state.steps.set(step, samples);
    const label = `step ${step} (${samples})`;
    const existing = select.querySelector(`option[value="${step}"]`);
    if (existing) { existing.textContent = label; return; }
    const option = el("option", { value: String(step), text: label });
    // Newest first, after "all steps".
    const after = [...select.options].find((o) => o.value !== "" && parseInt(o.value, 10) < step);
    select.insertBefore(option, after || null);
  }

  async function loadSteps() {
    const split = state.view.split;
    const body = await fetchJSON(split === "train" ? panel.dataset.steps : `${panel.dataset.steps}?split=${split}`);
    if (split !== state.view.split) return 0; // switched meanwhile: the other split's steps
    for (const s of body.steps) addStepOption(s.step, s.samples);
    return body.steps.reduce((total, s) => total + s.samples, 0);
  }

  // ---------------------------------------------------------------- one group
  function rewardClass(r) {
    return r > 0 ? "reward-pos" : r < 0 ? "reward-neg" : "";
  }

  function promptBlock(text) {
    const pre = el("pre", { class: "cprompt-text", text });
    const box = el("div", { class: "cprompt" }, el("span", { class: "help", text: "prompt" }), pre);
    if (text.split("\n").length > PROMPT_LINES || text.length > 240) {
      box.classList.add("clamped");
      const more = el("button", { type: "button", class: "linklike cprompt-more", text: "show whole prompt" });
      more.addEventListener("click", () => {
        const open = box.classList.toggle("open");
        more.textContent = open ? "show less" : "show whole prompt";
      });
      box.append(more);
    }
    return box;
  }

  /** A group: its header, the prompt once, the reference answer, then one row per rollout with a
   * column per reward function (the union of the names its rollouts were scored by). */
  function renderGroup(group) {
    const names = [...new Set(group.rollouts.flatMap((r) => Object.keys(r.rewards || {})))].sort();
    const evaluated = state.view.split === "eval";
    const what = evaluated ? `eval of step ${group.step} · eval prompt ${group.group_id ?? "–"} · ${group.rollouts.length} sample(s)`
      : `step ${group.step} · group ${group.group_id ?? "–"} · ${group.rollouts.length} rollout(s)`;
    const head = el("div", { class: "meta cgroup-head" },
      el("span", { text: what }),
      el("span", { text: `mean reward ${fmt(group.reward_mean)}` }),
      group.mixed ? el("span", { class: "badge", title: "rewards differ: this group carries a GRPO signal", text: "mixed" }) : null);
    const thead = el("tr", {},
      el("th", { class: "cnum", text: "#" }), el("th", { class: "cnum", text: "reward" }), el("th", { class: "cnum", text: "advantage" }),
      ...names.map((n) => el("th", { class: "cnum cfunc", "data-func": n, title: n, text: n })),
      el("th", { text: "completion" }));
    const body = el("tbody");
    for (const r of group.rollouts) {
      const cut = r.truncated ? el("div", { class: "help", text: "(cut in the live view; reload for the whole text)" }) : null;
      const ownPrompt = r.prompt && r.prompt !== group.prompt ? promptBlock(r.prompt) : null; // an environment's own prompt
      body.append(el("tr", { class: `rollout${r.match === false ? " nomatch" : ""}`, "data-index": String(r.index) },
        el("td", { class: "cnum", "data-label": "#", text: String(r.index) }),
        el("td", { class: `cnum ${rewardClass(r.reward)}`, "data-label": "reward", text: fmt(r.reward) }),
        el("td", { class: "cnum", "data-label": "advantage", text: fmt(r.advantage) }),
        ...names.map((n) => el("td", { class: "cnum cfunc", "data-func": n, "data-label": n, text: fmt((r.rewards || {})[n]) })),
        el("td", { class: "ctext", "data-label": "completion" }, ownPrompt, el("pre", { class: "completion-text", text: r.completion }), cut)));
    }
    return el("section", { class: "cgroup", "data-split": state.view.split, "data-step": String(group.step), "data-group": String(group.group_id ?? ""),
      "data-mixed": String(!!group.mixed), "data-mean": String(group.reward_mean ?? "") },
      head,
      promptBlock(group.prompt || ""),
      group.reference ? el("div", { class: "creference" }, el("span", { class: "help", text: "reference answer " }), el("code", { text: group.reference })) : null,
      el("table", { class: "crollouts" }, el("thead", {}, thead), body));
  }

  // ---------------------------------------------------------------- a page of groups
  function renderPage(groups) {
    const box = $("completions");
    state.shown.clear();
    const nodes = groups.map((g) => {
      const node = renderGroup(g);
      state.shown.set(groupKey(g.step, g.group_id), { group: g, node });
      return node;
    });
    box.replaceChildren(...(nodes.length ? nodes : [el("p", { class: "help", text: isDefaultView() ? "None yet." : "No completion matches." })]));
    renderPager();
  }

  function renderPager() {
    const pages = Math.max(1, Math.ceil(state.count / state.pageSize));
    $("completion-pager").hidden = state.count === 0;
    $("completion-page").textContent = `page ${state.page} of ${pages} · ${state.count} group(s)`;
    $("completion-prev").disabled = state.page <= 1;
    $("completion-next").disabled = state.page >= pages;
  }

  function showErrors(body) {
    const list = $("completion-errors");
    const items = Object.entries(body || {}).map(([field, errs]) => el("li", { text: `${field}: ${[].concat(errs).join(" ")}` }));
    list.replaceChildren(...items);
    list.hidden = items.length === 0;
  }

  async function fetchPage() {
    const seq = ++state.seq;
    const params = filterParams();
    params.set("by", "group");
    params.set("ordering", state.view.ordering);
    params.set("page", String(state.page));
    let body;
    try {
      body = await fetchJSON(`${panel.dataset.api}?${params}`);
    } catch (err) {
      if (seq !== state.seq) return;
      if (err.body && Object.keys(err.body).length) showErrors(err.body);
      else console.warn("completions", err);
      return;
    }
    if (seq !== state.seq) return; // a newer view was asked for meanwhile
    showErrors(null);
    state.count = body.count;
    renderPage(body.results);
  }

  /** The view changed: back to its first page; the downloads follow the filters. */
  function refilter() {
    const v = state.view;
    v.step = $("completion-step").value;
    v.ordering = $("completion-ordering").value;
    v.groups = $("completion-groups").value;
    v.reward_min = $("completion-reward-min").value.trim();
    v.reward_max = $("completion-reward-max").value.trim();
    v.group_id = $("completion-group").value.trim();
    v.q = $("completion-search").value.trim();
    state.page = 1;
    panel.dataset.split = v.split;
    const query = filterParams().toString();
    for (const fmtName of ["csv", "json"]) {
      const link = $(`download-completions-${fmtName}`);
      link.href = `${panel.dataset.api}?format=${fmtName}${query ? `&${query}` : ""}`;
    }
    if (isDefaultView()) clearNotice();
    return fetchPage();
  }

  // ---------------------------------------------------------------- live samples
  function clearNotice() {
    state.unseen = 0;
    $("completion-new").hidden = true;
  }

  function notice(samples) {
    state.unseen += samples;
    const button = $("completion-new");
    button.textContent = `${state.unseen} new sample${state.unseen === 1 ? "" : "s"} — show`;
    button.hidden = false;
  }

  /** Draw a live message's groups at the top of the default view, keeping the user's reading
   * position when the table's top is scrolled off the screen. */
  function drawLive(step, items) {
    const box = $("completions");
    const anchor = [...box.children].find((n) => n.getBoundingClientRect().bottom > 0);
    const keepPlace = anchor && box.getBoundingClientRect().top < 0;
    const before = keepPlace ? anchor.getBoundingClientRect().top : 0;
    const byGroup = new Map();
    for (const item of items) {
      const key = groupKey(step, item.group_id);
      if (!byGroup.has(key)) byGroup.set(key, []);
      byGroup.get(key).push({ ...item, step, match: true });
    }
    box.querySelector(":scope > p.help")?.remove();
    // Each prepended in turn, lowest group id first: the newest ends on top, as the server orders them.
    const order = [...byGroup].sort((a, b) => (a[1][0].group_id ?? -1) - (b[1][0].group_id ?? -1));
    for (const [key, rollouts] of order) {
      const known = state.shown.get(key);
      // A step's block may reach the tailer in two reads: the second half joins its group.
      const merged = new Map((known ? known.group.rollouts : []).map((r) => [r.index, r]));
      for (const r of rollouts) merged.set(r.index, r);
      const all = [...merged.values()].sort((a, b) => a.index - b.index);
      const rewards = all.map((r) => r.reward).filter((r) => r !== null && r !== undefined);
      const group = {
        step, group_id: rollouts[0].group_id ?? null, rollouts: all, prompt: all[0].prompt, reference: all[0].reference,
        reward_mean: rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null,
        mixed: rewards.length > 1 && Math.min(...rewards) < Math.max(...rewards),
      };
      const node = renderGroup(group);
      if (known) known.node.replaceWith(node);
      else { box.prepend(node); state.count += 1; }
      state.shown.set(key, { group, node });
    }
    const nodes = box.querySelectorAll(":scope > .cgroup");
    for (let i = nodes.length - 1; i >= state.pageSize; i--) { // the page keeps its size: the oldest go to page 2
      const node = nodes[i];
      state.shown.delete(groupKey(node.dataset.step, node.dataset.group === "" ? null : node.dataset.group));
      node.remove();
    }
    renderPager();
    if (keepPlace) window.scrollBy(0, anchor.getBoundingClientRect().top - before);
  }

  function live(step, items, split = "train") {
    if (!panel) return;
    if (split === "eval") showSwitch();
    if (!state.loaded) { state.pending.push([step, items, split]); return; }
    if (split !== state.view.split) return; // the other split's samples: read when it is chosen
    addStepOption(step, (state.steps.get(step) || 0) + items.length);
    if (isDefaultView()) drawLive(step, items);
    else notice(items.length);
  }

  // ---------------------------------------------------------------- load, backfill
  async function load() {
    if (!panel) return;
    await Promise.all([loadSteps().catch((err) => console.warn("completion steps", err)), fetchPage()]);
    state.loaded = true;
    // Messages that came while the first page loaded: drawn unless the page already had them.
    for (const [step, items, split] of state.pending.splice(0)) {
      if (split !== state.view.split) continue;
      const fresh = items.filter((i) => !(state.shown.get(groupKey(step, i.group_id))?.group.rollouts || []).some((r) => r.index === i.index));
      if (fresh.length) live(step, fresh, split);
    }
  }

  // ---------------------------------------------------------------- training / eval
  function showSwitch() {
    $("completion-split").hidden = false;
    panel.dataset.hasEval = "true";
  }

  /** Show the other split: its own steps in the picker, its first page, its downloads. */
  async function setSplit(split) {
    if (split === state.view.split) return;
    state.view.split = split;
    for (const button of $("completion-split").querySelectorAll("button")) {
      button.setAttribute("aria-pressed", String(button.dataset.split === split));
    }
    state.steps.clear();
    const select = $("completion-step");
    for (const option of [...select.options]) if (option.value !== "") option.remove();
    clearNotice();
    state.shown.clear();
    await Promise.all([loadSteps().catch((err) => console.warn("completion steps", err)), refilter()]);
  }

  /** After a dropped socket: the steps it missed; the default view reloads, any other counts them. */
  async function backfill() {
    if (!panel || !state.loaded) return;
    const before = [...state.steps.values()].reduce((a, b) => a + b, 0);
    const total = await loadSteps();
    if (isDefaultView()) await fetchPage();
    else if (total > before) notice(total - before);
  }

  // ---------------------------------------------------------------- controls
  if (panel) {
    panel.dataset.split = state.view.split;
    for (const button of $("completion-split").querySelectorAll("button")) {
      button.addEventListener("click", () => setSplit(button.dataset.split));
    }
    for (const id of ["completion-step", "completion-ordering", "completion-groups"]) $(id).addEventListener("change", refilter);
    for (const id of ["completion-search", "completion-reward-min", "completion-reward-max", "completion-group"]) {
      $(id).addEventListener("input", () => {
        clearTimeout(state.timer);
        state.timer = setTimeout(refilter, SEARCH_DELAY_MS);
      });
    }
    // A new page starts at the table's top, wherever the button was.
    const turn = (by) => { state.page += by; fetchPage().then(() => panel.scrollIntoView({ block: "start" })); };
    $("completion-prev").addEventListener("click", () => turn(-1));
    $("completion-next").addEventListener("click", () => turn(1));
    // "show": back to the default view, where the new samples are.
    $("completion-new").addEventListener("click", () => {
      $("completion-step").value = "";
      $("completion-ordering").value = DEFAULT_ORDERING;
      $("completion-groups").value = "";
      for (const id of ["completion-reward-min", "completion-reward-max", "completion-group", "completion-search"]) $(id).value = "";
      clearNotice();
      refilter();
    });
  }

  return { load, live, backfill };
})();
