// kbd · the Knowledge page (docs/knowledge-page.md). Plain JavaScript, no framework, no
// third-party code: the server's Content-Security-Policy allows only this file.
//
// Safety rule for this file: every value that comes from the server (workflow
// labels, IDs, aliases, KB file names, note text, error messages) reaches the
// DOM through textContent / setAttribute on elements built with createElement.
// Nothing here ever assigns innerHTML/outerHTML or calls insertAdjacentHTML or
// document.write, so a label like `<img src=x onerror=…>` stays inert text.
"use strict";

(() => {
  // -- state --------------------------------------------------------------------
  const S = {
    me: null, // {principal, csrf, workflow, live, mode}
    workflows: [],
    wid: null, // the selected workflow
    detail: null, // GET /api/workflows/{wid}
    rights: { manage: false, grant: false },
    sources: [],
    candidates: [],
    writers: null,
    pending: null,
    rejected: null,
    history: null, // the viewer's note history: {alias, path, data} (data.versions newest first)
    diffs: {}, // pending relpath -> its preview diff (or an error), while shown
    rendered: true, // Markdown files: rendered (true) or as text
    editing: null, // the own KB file being edited: {path, text, expected} (expected: the version read, or "none")
    kb: { alias: null, path: "" }, // alias null = the workflow's own KB
    file: null, // the file shown in the viewer: {alias, path}
    confirming: null, // the alias whose detach waits for a confirmation
    revoking: null, // the consumer whose writer revoke waits for a confirmation
    previews: {}, // "detach:ALIAS" | "revoke:WF" -> what the change would do (or the error), while confirming
    whys: {}, // alias -> kbd why attach's answer for that card (or the error), while shown
    requests: null, // GET /api/requests
    seq: 0, // bumps on every workflow switch: late answers for another workflow are dropped
  };
  const LIST_LIMIT = 500;

  const $ = (id) => document.getElementById(id);

  // -- DOM helpers (text only) -------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k === "hidden" || k === "disabled" || k === "checked" || k === "selected") node[k] = Boolean(v);
      else if (k === "value") node.value = v;
      else if (k === "on") for (const [ev, fn] of Object.entries(v)) node.addEventListener(ev, fn);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    append(node, children);
    return node;
  }
  function append(node, children) {
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return node;
  }
  const button = (label, action, onClick, attrs = {}) =>
    el("button", { type: "button", "data-action": action, on: { click: onClick }, ...attrs }, label);
  const badge = (text, kind) => el("span", { class: `badge ${kind || ""}`.trim() }, text);

  // A path that wraps after its slashes, never inside a name (a <wbr> after each '/').
  function pathCode(text, attrs = {}) {
    const node = el("code", { class: "path", ...attrs });
    const parts = String(text).split("/");
    parts.forEach((part, i) => {
      node.append(document.createTextNode(i < parts.length - 1 ? `${part}/` : part));
      if (i < parts.length - 1) node.append(document.createElement("wbr"));
    });
    return node;
  }
  const when = (seconds) => new Date(seconds * 1000).toISOString().replace(/\.\d+Z$/, "Z");

  // A unified diff as lines, each marked added, removed, a hunk head or context (text only).
  function diffView(text, label) {
    const pre = el("pre", { class: "diff", tabindex: "0", "aria-label": label });
    for (const line of String(text).split("\n")) {
      const kind = line.startsWith("+++") || line.startsWith("---") ? "file" : line.startsWith("@@") ? "hunk"
        : line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : "ctx";
      pre.append(el("span", { class: `dl ${kind}`, text: `${line}\n` }));
    }
    return pre;
  }

  // -- Markdown, rendered safely -------------------------------------------------
  // A small subset (headings, paragraphs, lists, quotes, code, rules, emphasis, links)
  // built as DOM nodes from text: raw HTML in a note stays visible text, never markup.
  // A link is made only for http(s) and mailto addresses, and never follows a referrer.
  const SAFE_LINK = /^(https?:\/\/|mailto:)/i;
  function inline(text) {
    const out = [];
    const re = /(`[^`]+`)|(\*\*[^*]+\*\*)|(\*[^*\s][^*]*\*|_[^_\s][^_]*_)|(\[[^\]]+\]\([^)\s]+\))/g;
    let last = 0;
    for (let m = re.exec(text); m; m = re.exec(text)) {
      if (m.index > last) out.push(text.slice(last, m.index));
      const t = m[0];
      if (m[1]) out.push(el("code", { text: t.slice(1, -1) }));
      else if (m[2]) out.push(el("strong", {}, ...inline(t.slice(2, -2))));
      else if (m[3]) out.push(el("em", {}, ...inline(t.slice(1, -1))));
      else {
        const close = t.indexOf("](");
        const label = t.slice(1, close);
        const href = t.slice(close + 2, -1);
        out.push(SAFE_LINK.test(href)
          ? el("a", { href, rel: "noopener noreferrer nofollow", target: "_blank" }, ...inline(label))
          : `${label} (${href})`);
      }
      last = m.index + t.length;
    }
    if (last < text.length) out.push(text.slice(last));
    return out;
  }
  function renderMarkdown(text) {
    const root = el("div", { class: "md" });
    let lines = String(text).replace(/\r\n?/g, "\n").split("\n");
    if (lines[0] === "---") {
      const end = lines.indexOf("---", 1);
      if (end > 0) {
        root.append(el("pre", { class: "frontmatter", text: lines.slice(1, end).join("\n") }));
        lines = lines.slice(end + 1);
      }
    }
    let para = [];
    let list = null;
    const flush = () => {
      if (para.length) root.append(el("p", {}, ...inline(para.join(" "))));
      para = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = /^(```|~~~)/.exec(line);
      if (fence) {
        flush(); list = null;
        const body = [];
        for (i++; i < lines.length && !lines[i].startsWith(fence[1]); i++) body.push(lines[i]);
        root.append(el("pre", { class: "code" }, el("code", { text: body.join("\n") })));
        continue;
      }
      const h = /^(#{1,6})\s+(.*)$/.exec(line);
      const item = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line);
      if (h) { flush(); list = null; root.append(el(`h${Math.min(6, h[1].length + 2)}`, {}, ...inline(h[2]))); }
      else if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flush(); list = null; root.append(el("hr")); }
      else if (item) {
        flush();
        const tag = /\d/.test(item[1]) ? "ol" : "ul";
        if (!list || list.tagName.toLowerCase() !== tag) { list = el(tag); root.append(list); }
        list.append(el("li", {}, ...inline(item[2])));
      } else if (/^>\s?/.test(line)) { flush(); list = null; root.append(el("blockquote", {}, ...inline(line.replace(/^>\s?/, "")))); }
      else if (!line.trim()) { flush(); list = null; }
      else { list = null; para.push(line.trim()); }
    }
    flush();
    return root;
  }

  // Keeps keyboard focus across a re-render: elements that can take focus carry data-key.
  function keepFocus(render) {
    const active = document.activeElement;
    const key = active && active.getAttribute ? active.getAttribute("data-key") : null;
    render();
    if (key) {
      const again = document.querySelector(`[data-key="${CSS.escape(key)}"]`);
      if (again && again !== document.activeElement) again.focus();
    }
  }

  // -- API ------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, code, message, hint) {
      super(message);
      this.status = status;
      this.code = code;
      this.hint = hint;
    }
  }

  async function api(path, { method = "GET", body } = {}) {
    const headers = { Accept: "application/json" };
    if (method !== "GET") {
      headers["X-KBD-CSRF"] = S.me ? S.me.csrf : "";
      if (body !== undefined) headers["Content-Type"] = "application/json";
    }
    let res;
    try {
      res = await fetch(path, {
        method, headers, credentials: "same-origin", cache: "no-store",
        body: body === undefined ? undefined : JSON.stringify(body),
      });
    } catch (exc) {
      throw new ApiError(0, "ui-unreachable", `the kbd ui server did not answer (${exc.message})`,
        "is `kbd ui` still running? Start it again and open the new URL");
    }
    const text = await res.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
    if (!res.ok) {
      const e = data && data.error ? data.error : {};
      throw new ApiError(res.status, e.code || `http-${res.status}`,
        e.message || `${method} ${path} answered ${res.status} ${res.statusText}`.trim(), e.hint || null);
    }
    return data;
  }
  const enc = encodeURIComponent;
  const wfPath = (wid, rest = "") => `/api/workflows/${enc(wid)}${rest}`;

  // -- errors: always shown as code + message + hint -----------------------------
  function errorBox(err, onDismiss) {
    const e = err instanceof ApiError ? err : new ApiError(0, "ui-script", String(err && err.message || err), null);
    const box = el("div", { class: "error", "data-code": e.code },
      el("p", { class: "error-line" }, el("code", { text: `error[${e.code}]` }), " ", e.message),
      e.hint ? el("p", { class: "hint" }, "hint: ", e.hint) : null);
    if (onDismiss) box.append(button("Dismiss", "dismiss", onDismiss, { class: "quiet" }));
    return box;
  }
  function showError(id, err) {
    const area = $(id);
    area.replaceChildren(errorBox(err, () => area.replaceChildren()));
  }
  const clearError = (id) => $(id).replaceChildren();
  function alertError(err) {
    const area = $("alerts");
    const box = errorBox(err, () => box.remove());
    area.append(box);
  }
  function notice(text) {
    const area = $("alerts");
    const box = el("div", { class: "notice", role: "status" }, el("p", { text }));
    area.append(box);
    setTimeout(() => box.remove(), 4000);
  }

  // -- workflows panel -----------------------------------------------------------
  async function loadWorkflows() {
    try {
      const data = await api("/api/workflows");
      S.workflows = data.workflows || [];
      renderWorkflows();
      renderGrantOptions();
    } catch (err) {
      alertError(err);
    }
  }

  function renderWorkflows() {
    const filter = $("wf-filter").value.trim().toLowerCase();
    const items = S.workflows
      .filter((w) => !filter || `${w.id} ${w.label || ""}`.toLowerCase().includes(filter))
      .map((w) => {
        const current = w.id === S.wid;
        return el("li", {},
          el("button", {
            type: "button", class: current ? "wf current" : "wf", "data-workflow": w.id, "data-key": `wf:${w.id}`,
            "aria-current": current ? "page" : null, on: { click: () => selectWorkflow(w.id) },
          },
          el("span", { class: "wf-label", text: w.label || w.id }),
          el("span", { class: "wf-id", text: w.id }),
          w.status && w.status !== "ok" ? badge(w.status, "bad") : null));
      });
    keepFocus(() => $("wf-list").replaceChildren(...(items.length ? items
      : [el("li", { class: "empty", text: S.workflows.length ? "No workflow matches." : "You can see no workflow." })])));
  }

  // Up/Down move between workflows (the list is one tab stop's worth of buttons).
  function workflowKeys(ev) {
    if (ev.key !== "ArrowDown" && ev.key !== "ArrowUp") return;
    const buttons = [...$("wf-list").querySelectorAll("button[data-workflow]")];
    const at = buttons.indexOf(document.activeElement);
    if (at < 0) return;
    ev.preventDefault();
    const next = buttons[Math.max(0, Math.min(buttons.length - 1, at + (ev.key === "ArrowDown" ? 1 : -1)))];
    next.focus();
  }

  function selectWorkflow(wid) {
    if (wid === S.wid) return;
    S.wid = wid;
    S.seq += 1;
    S.detail = null;
    S.sources = [];
    S.candidates = [];
    S.writers = null;
    S.pending = null;
    S.rejected = null;
    S.history = null;
    S.diffs = {};
    S.editing = null;
    S.kb = { alias: null, path: "" };
    S.file = null;
    S.confirming = null;
    S.revoking = null;
    S.previews = {};
    S.whys = {};
    stale.review = true;
    stale.browser = true;
    $("hits").replaceChildren();
    $("search-note").textContent = "";
    for (const id of ["src-error", "attach-error", "writers-error", "pending-error", "browser-error", "search-error"]) {
      clearError(id);
    }
    const want = `#wf=${enc(wid)}`;
    if (location.hash !== want) history.replaceState(null, "", want);
    renderWorkflows();
    refreshWorkflow();
  }

  // -- the selected workflow --------------------------------------------------------
  let refreshing = null;
  let again = false;
  // One refresh at a time; a request during one runs once more after it (never lost, never doubled).
  async function refreshWorkflow() {
    if (refreshing) { again = true; return refreshing; }
    refreshing = (async () => {
      do {
        again = false;
        await refreshOnce();
      } while (again);
    })();
    try { await refreshing; } finally { refreshing = null; }
  }

  // What the next refresh reloads beyond the workflow itself. One request,
  // GET /api/workflows/{wid}, carries the head, the cards (its `sources`), the
  // attach choices (`candidates`) and the rights; the grantor's panels and the
  // browser are reloaded only when an event (or an action) concerns them.
  const stale = { review: true, browser: true };

  async function refreshOnce() {
    const wid = S.wid;
    const seq = S.seq;
    if (!wid) { renderHead(); return; }
    const review = stale.review;
    const browser = stale.browser;
    stale.review = false;
    stale.browser = false;
    const known = Boolean(S.detail && S.detail.workflow_id === wid);
    // The grantor's panels load beside the workflow (with the rights known so far).
    const side = known && S.rights.grant && review ? loadReview(wid, seq) : null;
    let detail;
    try {
      detail = await api(wfPath(wid));
    } catch (err) {
      if (side) await side;
      if (seq !== S.seq) return;
      S.detail = null;
      S.sources = [];
      S.candidates = [];
      S.rights = { manage: false, grant: false };
      renderHead(err);
      renderAll();
      await refreshBrowser(seq);
      return;
    }
    if (seq !== S.seq) return;
    const hadGrant = known && S.rights.grant;
    S.detail = detail;
    S.sources = detail.sources || [];
    S.candidates = detail.candidates || [];
    S.rights = { manage: Boolean(detail.rights && detail.rights.manage), grant: Boolean(detail.rights && detail.rights.grant) };
    // An action's refusal stays until the next action or Dismiss: the refresh that follows it
    // (and any change event) must not erase the only place the page says why.
    const shown = S.kb.alias;
    renderHead();
    renderCards();
    renderAttach();
    renderKbSelect(); // falls back to the own KB when the one shown is gone
    renderSearchScope();
    if (S.rights.grant && (side || review || !hadGrant)) {
      await (side || loadReview(wid, seq));
      if (seq !== S.seq) return;
    }
    renderWriters();
    renderPending();
    if (browser || shown !== S.kb.alias) await refreshBrowser(seq);
    else renderKbStatus();
  }

  const loadReview = (wid, seq) => Promise.all([loadWriters(wid, seq), loadPending(wid, seq), loadRejected(wid, seq)]);

  async function loadWriters(wid, seq) {
    try {
      const data = await api(wfPath(wid, "/writers"));
      if (seq === S.seq) S.writers = data;
    } catch (err) {
      if (seq === S.seq) { S.writers = null; showError("writers-error", err); }
    }
  }
  async function loadPending(wid, seq) {
    try {
      const data = await api(wfPath(wid, "/notes/pending"));
      if (seq === S.seq) S.pending = data;
    } catch (err) {
      if (seq === S.seq) { S.pending = null; showError("pending-error", err); }
    }
  }

  async function loadRejected(wid, seq) {
    try {
      const data = await api(wfPath(wid, "/notes/rejected"));
      if (seq === S.seq) S.rejected = data;
    } catch (err) {
      if (seq === S.seq) { S.rejected = null; showError("pending-error", err); }
    }
  }

  function renderAll() {
    renderCards();
    renderAttach();
    renderWriters();
    renderPending();
    renderKbSelect();
    renderSearchScope();
  }

  function renderHead(err) {
    const head = $("wf-head");
    if (!S.wid) { head.replaceChildren(el("p", { class: "empty", text: "Choose a workflow." })); return; }
    if (err) {
      head.replaceChildren(el("h2", { class: "wf-title", text: S.wid }), errorBox(err));
      return;
    }
    const d = S.detail;
    if (!d) return;
    const rights = [];
    if (S.rights.manage) rights.push(badge("you manage its attachments", "ok"));
    else rights.push(badge("read-only: you can inspect, not manage", "ro"));
    if (S.rights.grant) rights.push(badge("you grant writers and review contributions", "ok"));
    if (d.legacy) rights.push(badge("legacy: no owner", "warn"));
    const people = [["owners", d.owners], ["editors", d.editors], ["readers", d.readers]]
      .filter(([, list]) => list && list.length)
      .map(([name, list]) => el("span", { class: "people" }, `${name}: `, list.join(", ")));
    head.replaceChildren(
      el("div", { class: "wf-title-row" },
        el("h2", { class: "wf-title", text: d.label || d.workflow_id }),
        el("code", { class: "wf-id", text: d.workflow_id })),
      el("p", { class: "rights" }, ...rights),
      people.length ? el("p", { class: "meta" }, ...people) : null,
      d.path ? el("p", { class: "meta" }, "folder: ", el("code", { text: d.path })) : null,
    );
  }

  // -- source cards -----------------------------------------------------------------
  function writeStatus(att) {
    if (att.access !== "write" || !att.write) return null;
    if (att.write.available) return { text: "write granted (notes/ only)", kind: "ok" };
    if (att.write.reason === "write_not_granted") return { text: "waiting for the owner's grant", kind: "warn" };
    return { text: `write unavailable: ${att.write.reason || "unknown"}`, kind: "bad" };
  }

  function renderCards() {
    $("src-note").textContent = S.wid
      ? (S.sources.length ? `${S.sources.length} attached` : "") : "";
    const cards = S.sources.map(card);
    keepFocus(() => $("cards").replaceChildren(...(cards.length ? cards
      : [el("p", { class: "empty", text: S.wid ? "No knowledge is attached to this workflow." : "" })])));
  }

  function card(att) {
    const ok = att.available;
    const ws = writeStatus(att);
    const facts = [
      ["Source", [el("span", { text: att.label || "(label not visible)" }), " ", el("code", { text: att.workflow_id })]],
      ["Access", [att.access === "write" ? "read + write notes/" : "read"]],
      ["Variable", [el("code", { text: att.env || `WORKFLOW_KB_${att.alias.toUpperCase()}` })]],
      ["KB folder", [att.path ? pathCode(att.path) : "—"]],
    ];
    if (ws) facts.push(["Write", [badge(ws.text, ws.kind)]]);
    const dl = el("dl", { class: "facts" }, ...facts.map(([k, v]) => [el("dt", { text: k }), el("dd", {}, ...v)]));
    const reason = ok ? null : el("p", { class: "reason" },
      el("code", { class: "reason-code", text: att.reason || "unavailable" }), " ", att.message || "");
    const actions = el("div", { class: "card-actions" });
    // Every "no" says why and how to get to "yes" (docs/knowledge-page.md "Why and requests").
    const refused = !ok || (ws && ws.kind !== "ok");
    if (refused) {
      actions.append(button(S.whys[att.alias] ? "Hide why" : "Why?", "why", () => toggleWhy(att),
        { "data-key": `why:${att.alias}`, "aria-label": `Why is ${att.alias} ${ok ? "not writable" : "unavailable"}?` }));
    }
    if (ok) {
      actions.append(button("Browse", "open", () => openKb(att.alias, ""),
        { "data-key": `open:${att.alias}`, "aria-label": `Browse ${att.alias}` }));
    }
    if (S.rights.manage && ok) {
      // An unavailable attachment is repaired at its source or detached: its access cannot resolve anew.
      const other = att.access === "write" ? "read" : "write";
      if (other === "write" && att.write_grantable === false) {
        // A legacy source has no owner who could grant writing: offering it could never succeed.
        actions.append(el("span", { class: "muted", "data-note": "not-grantable",
          text: "Read only: the source has no owner who could grant writing." }));
      } else {
        actions.append(button(other === "write" ? "Allow writing" : "Make read-only", "access",
          () => changeAccess(att, other), { "data-key": `access:${att.alias}`, "data-to": other,
            "aria-label": `Change ${att.alias} to ${other}` }));
      }
    }
    if (S.rights.manage) {
      if (S.confirming === att.alias) {
        actions.append(el("span", { class: "confirm", role: "group", "aria-label": `Confirm detaching ${att.alias}` },
          el("span", { text: `Detach ${att.alias}?` }),
          previewBox(S.previews[`detach:${att.alias}`]),
          button("Yes, detach", "detach-confirm", () => detach(att), {
            class: "danger", "data-key": `detach-confirm:${att.alias}`, "aria-label": `Yes, detach ${att.alias}` }),
          button("Cancel", "detach-cancel", () => { S.confirming = null; renderCards(); focusKey(`detach:${att.alias}`); },
            { "data-key": `detach-cancel:${att.alias}` })));
      } else {
        actions.append(button("Detach", "detach", () => { S.confirming = att.alias; renderCards();
          focusKey(`detach-confirm:${att.alias}`);
          loadPreview(`detach:${att.alias}`, wfPath(S.wid, `/sources/${enc(att.alias)}`), renderCards); },
        { class: "danger-quiet", "data-key": `detach:${att.alias}`, "aria-label": `Detach ${att.alias}` }));
      }
    }
    return el("article", {
      class: ok ? "card" : "card unavailable", "data-alias": att.alias, "data-reason": ok ? null : (att.reason || "unavailable"),
      "aria-label": `Attachment ${att.alias}`,
    },
    el("header", { class: "card-head" },
      el("h3", { text: att.alias }),
      ok ? badge("available", "ok") : badge("unavailable", "bad"),
      badge(att.access, att.access === "write" ? "write" : "read")),
    reason, whyBox(att), dl, actions.childNodes.length ? actions : null);
  }

  // -- why, access requests, previews ------------------------------------------------------------
  async function toggleWhy(att) {
    if (S.whys[att.alias]) { delete S.whys[att.alias]; renderCards(); return; }
    const access = att.access === "write" ? "write" : "read";
    try {
      S.whys[att.alias] = { data: await api(wfPath(S.wid, `/why?source=${enc(att.workflow_id)}&access=${access}`)) };
    } catch (err) {
      S.whys[att.alias] = { err };
    }
    renderCards();
  }

  function whyBox(att) {
    const shown = S.whys[att.alias];
    if (!shown) return null;
    if (shown.err) return el("div", { class: "why", "data-why": att.alias }, errorBox(shown.err));
    const w = shown.data;
    const lines = (w.reasons || []).map((r) => el("li", {}, el("code", { class: "reason-code", text: r.code }), " ", r.message));
    const fix = w.fix
      ? el("div", { class: "fix" }, el("p", { text: "What would allow it:" }),
        el("ol", {}, ...w.fix.steps.map((st) => el("li", {}, el("code", { text: st.command }),
          st.by && st.by.length ? el("span", { class: "muted", text: ` (by ${st.by.join(", ")})` }) : null))))
      : el("p", { class: "muted", text: w.allowed ? "Nothing stands in the way now." : (w.no_fix || "No change allows it.") });
    const kind = !att.available && att.reason === "audience_denied" ? "read"
      : att.available && att.access === "write" && att.write && att.write.reason === "write_not_granted" ? "write" : null;
    const ask = kind && S.rights.manage && w.fix
      ? button(`Ask ${att.workflow_id}'s owners`, "ask", () => askAccess(att, kind),
        { "data-key": `ask:${att.alias}`, "aria-label": `Ask ${att.workflow_id}'s owners to let ${S.wid} ${kind}` })
      : null;
    return el("div", { class: "why", "data-why": att.alias, role: "region", "aria-label": `Why: ${att.alias}` },
      lines.length ? el("ul", { class: "why-reasons" }, ...lines) : null, fix, ask);
  }

  async function askAccess(att, kind) {
    clearError("src-error");
    try {
      const r = await api("/api/requests", { method: "POST", body: { kind, workflow_id: att.workflow_id, consumer: S.wid } });
      notice(`Asked ${att.workflow_id}'s owners (request ${r.request_id}).`);
    } catch (err) {
      showError("src-error", err);
    }
    await loadRequests();
  }

  async function loadPreview(key, path, rerender) {
    delete S.previews[key];
    try {
      S.previews[key] = { data: await api(`${path}?dry_run=true`, { method: "DELETE" }) };
    } catch (err) {
      S.previews[key] = { err };
    }
    rerender();
  }

  // What a change would do, in the words of its preview (docs/access.md "Previews").
  function previewBox(shown) {
    if (!shown) return el("span", { class: "preview muted", text: "checking what it would change…" });
    if (shown.err) return el("span", { class: "preview" }, errorBox(shown.err));
    const p = shown.data;
    const items = [];
    for (const ses of p.sessions) {
      const lost = ses.lost.filter((c) => c.kind !== "variable").map((c) => `${c.kind} ${c.target}`);
      items.push(`session ${ses.session_id} (${ses.workflow_id}) loses ${lost.length ? lost.join(", ") : "nothing readable"}`);
    }
    for (const c of p.commands) items.push(`running command ${c.pid} would be ${c.effect === "terminated" ? "terminated" : "marked stale"}`);
    for (const a of p.consumers) items.push(`${a.workflow_id}'s ${a.alias} would be ${a.status}${a.reason ? ` (${a.reason})` : ""}`);
    if (p.unseen) items.push(`and ${p.unseen} more in workflows you cannot see`);
    return el("span", { class: "preview", "data-preview": "true" },
      items.length ? el("ul", {}, ...items.map((t) => el("li", { text: t }))) : el("span", { class: "muted", text: "No session or attachment would change." }));
  }

  async function loadRequests() {
    try {
      S.requests = await api("/api/requests");
      clearError("requests-error");
    } catch (err) {
      S.requests = null;
      showError("requests-error", err);
    }
    renderRequests();
  }

  function renderRequests() {
    const list = (S.requests && S.requests.requests) || [];
    $("requests-panel").hidden = list.length === 0;
    const rows = list.map((r) => {
      const msg = el("input", { type: "text", maxlength: "500", placeholder: "message (optional)", "aria-label": `Message for request ${r.request_id}` });
      return el("li", { class: "row", "data-request": r.request_id, "data-state": r.state },
        el("code", { text: `#${r.request_id}` }),
        badge(r.state, r.state === "approved" ? "ok" : r.state === "pending" ? "warn" : "ro"),
        el("span", {}, `${r.kind} `, el("code", { text: r.source }), " for ", el("code", { text: r.consumer })),
        el("span", { class: "muted", text: `asked by ${r.requested_by}${r.message ? `: “${r.message}”` : ""}` }),
        r.decision_message ? el("span", { class: "muted", text: `${r.decided_by}: “${r.decision_message}”` }) : null,
        el("span", { class: "spacer" }),
        r.can_decide ? [msg,
          button("Approve", "approve-request", () => decideRequest(r, "approve", msg.value), { "aria-label": `Approve request ${r.request_id}` }),
          button("Decline", "decline-request", () => decideRequest(r, "decline", msg.value),
            { class: "danger-quiet", "aria-label": `Decline request ${r.request_id}` })] : null);
    });
    keepFocus(() => $("requests-list").replaceChildren(...rows));
  }

  async function decideRequest(r, decision, message) {
    clearError("requests-error");
    try {
      await api(`/api/requests/${enc(r.request_id)}/decision`, { method: "POST", body: message ? { decision, message } : { decision } });
      notice(`Request ${r.request_id} ${decision === "approve" ? "approved" : "declined"}.`);
    } catch (err) {
      showError("requests-error", err);
    }
    stale.review = true;
    await loadRequests();
    await refreshWorkflow();
  }

  function focusKey(key) {
    const node = document.querySelector(`[data-key="${CSS.escape(key)}"]`);
    if (node) node.focus();
  }

  async function detach(att) {
    S.confirming = null;
    try {
      await api(wfPath(S.wid, `/sources/${enc(att.alias)}`), { method: "DELETE" });
      clearError("src-error");
      notice(`Detached ${att.alias}.`);
    } catch (err) {
      showError("src-error", err);
    }
    await refreshWorkflow();
  }

  async function changeAccess(att, access) {
    try {
      await api(wfPath(S.wid, `/sources/${enc(att.alias)}`), { method: "PATCH", body: { access } });
      clearError("src-error");
      notice(`${att.alias} is now ${access}.`);
    } catch (err) {
      showError("src-error", err);
    }
    await refreshWorkflow();
  }

  // -- attach ---------------------------------------------------------------------------
  let aliasTouched = false;
  function suggestAlias(id) {
    let a = String(id).toLowerCase().replace(/^wf[_-]/, "").replace(/[^a-z0-9_]+/g, "_").replace(/^_+|_+$/g, "");
    if (!/^[a-z]/.test(a)) a = `kb_${a}`;
    a = a.slice(0, 48).replace(/_+$/, "") || "kb";
    const taken = new Set(S.sources.map((s) => s.alias));
    let out = a === "access" ? "access_kb" : a;
    for (let i = 2; taken.has(out); i += 1) out = `${a.slice(0, 44)}_${i}`;
    return out;
  }

  function renderAttach() {
    const panel = $("attach-panel");
    panel.hidden = !S.rights.manage;
    if (!S.rights.manage) return;
    const select = $("attach-source");
    const was = select.value;
    const options = S.candidates.map((c) => el("option", { value: c.workflow_id, selected: c.workflow_id === was },
      `${c.label || c.workflow_id} — ${c.workflow_id}${c.write_granted ? " (write granted)" : ""}`));
    select.replaceChildren(...options);
    const none = S.candidates.length === 0;
    $("attach-form").hidden = none;
    $("attach-empty").hidden = !none;
    if (!aliasTouched && select.value) $("attach-alias").value = suggestAlias(select.value);
  }

  async function attach(ev) {
    ev.preventDefault();
    const workflowId = $("attach-source").value;
    const alias = $("attach-alias").value.trim();
    const checked = document.querySelector('input[name="attach-access"]:checked');
    const access = checked ? checked.value : "read";
    clearError("attach-error");
    if (!workflowId) {
      showError("attach-error", new ApiError(0, "invalid-input", "choose a source workflow", null));
      return;
    }
    try {
      await api(wfPath(S.wid, "/sources"), { method: "POST", body: { workflow_id: workflowId, alias, access } });
      notice(`Attached ${workflowId} as ${alias}.`);
      aliasTouched = false;
      $("attach-alias").value = "";
    } catch (err) {
      showError("attach-error", err);
    }
    await refreshWorkflow();
  }

  // -- writers (the grantor's panel) ---------------------------------------------------------
  function renderWriters() {
    const panel = $("writers-panel");
    panel.hidden = !S.rights.grant;
    if (!S.rights.grant) return;
    const writers = (S.writers && S.writers.writers) || [];
    const rows = writers.map((w) => el("li", { class: "row", "data-writer": w.workflow_id },
      el("code", { text: w.workflow_id }),
      labelOf(w.workflow_id) ? el("span", { class: "muted", text: labelOf(w.workflow_id) }) : null,
      w.exists === false ? badge("no such workflow", "warn") : badge("may write notes/", "ok"),
      el("span", { class: "spacer" }),
      S.revoking === w.workflow_id
        ? el("span", { class: "confirm", role: "group", "aria-label": `Confirm revoking ${w.workflow_id}` },
          el("span", { text: `Revoke ${w.workflow_id}?` }),
          previewBox(S.previews[`revoke:${w.workflow_id}`]),
          button("Yes, revoke", "revoke-confirm", () => revoke(w.workflow_id),
            { class: "danger", "data-key": `revoke-confirm:${w.workflow_id}`, "aria-label": `Yes, revoke ${w.workflow_id}` }),
          button("Cancel", "revoke-cancel", () => { S.revoking = null; renderWriters(); focusKey(`revoke:${w.workflow_id}`); }))
        : button("Revoke", "revoke", () => {
          S.revoking = w.workflow_id;
          renderWriters();
          focusKey(`revoke-confirm:${w.workflow_id}`);
          loadPreview(`revoke:${w.workflow_id}`, wfPath(S.wid, `/writers/${enc(w.workflow_id)}`), renderWriters);
        }, { class: "danger-quiet", "data-key": `revoke:${w.workflow_id}`, "aria-label": `Revoke ${w.workflow_id}` })));
    const empty = el("li", { class: "empty", text: S.writers && S.writers.legacy
      ? "A legacy workflow (no owner) cannot grant writers." : "No workflow may write here yet." });
    keepFocus(() => $("writers-list").replaceChildren(...(rows.length ? rows : [empty])));
    $("grant-form").hidden = Boolean(S.writers && S.writers.legacy);
    renderGrantOptions();
  }

  // Workflows this principal can see, by label; one it cannot see is granted by its ID ("another…").
  const OTHER = "\u0000other";
  function renderGrantOptions() {
    const granted = new Set(((S.writers && S.writers.writers) || []).map((w) => w.workflow_id));
    const pick = $("grant-pick");
    const was = pick.value;
    const opts = S.workflows.filter((w) => w.id !== S.wid && !granted.has(w.id))
      .map((w) => el("option", { value: w.id, selected: w.id === was }, w.label && w.label !== w.id ? `${w.label} (${w.id})` : w.id));
    pick.replaceChildren(el("option", { value: "" }, "Choose a workflow…"), ...opts,
      el("option", { value: OTHER, selected: was === OTHER }, "Another workflow, by its ID…"));
    $("grant-other").hidden = pick.value !== OTHER;
  }
  const labelOf = (wid) => { const w = S.workflows.find((x) => x.id === wid); return w && w.label && w.label !== wid ? w.label : null; };

  async function grant(ev) {
    ev.preventDefault();
    const pick = $("grant-pick").value;
    const consumer = pick === OTHER ? $("grant-id").value.trim() : pick;
    if (!consumer) {
      showError("writers-error", new ApiError(0, "ui-input", "choose the workflow that may write", null));
      return;
    }
    clearError("writers-error");
    try {
      await api(wfPath(S.wid, "/writers"), { method: "POST", body: { workflow_id: consumer } });
      $("grant-id").value = "";
      $("grant-pick").value = "";
      notice(`${consumer} may now write into notes/.`);
    } catch (err) {
      showError("writers-error", err);
    }
    stale.review = true;
    await refreshWorkflow();
  }

  async function revoke(consumer) {
    S.revoking = null;
    clearError("writers-error");
    try {
      await api(wfPath(S.wid, `/writers/${enc(consumer)}`), { method: "DELETE" });
      notice(`Revoked ${consumer}.`);
    } catch (err) {
      showError("writers-error", err);
    }
    stale.review = true;
    await refreshWorkflow();
  }

  // -- pending contributions ------------------------------------------------------------------
  function renderPending() {
    const panel = $("pending-panel");
    panel.hidden = !S.rights.grant;
    if (!S.rights.grant) return;
    const list = (S.pending && S.pending.pending) || [];
    const rows = list.map((p) => el("li", { class: "row pending", "data-path": p.relpath },
      el("div", { class: "grow" },
        el("button", { type: "button", class: "link", "data-action": "open", "data-key": `pending-open:${p.relpath}`,
          on: { click: () => openFile(null, p.relpath) } }, p.relpath),
        el("p", { class: "muted" },
          `by ${p.contributed_by_workflow || "an unknown workflow"}`,
          p.contributed_at ? ` · ${p.contributed_at}` : "",
          typeof p.bytes === "number" ? ` · ${p.bytes} bytes` : "",
          p.digest ? ` · ${String(p.digest).slice(0, 19)}…` : "")),
      button(S.diffs[p.relpath] ? "Hide changes" : "Preview changes", "preview", () => preview(p),
        { class: "quiet", "data-key": `preview:${p.relpath}`, "aria-expanded": String(Boolean(S.diffs[p.relpath])),
          "aria-label": `Preview the changes of ${p.relpath}` }),
      button("Approve", "approve", () => review(p, "approve"),
        { class: "primary", "data-key": `approve:${p.relpath}`, "aria-label": `Approve ${p.relpath}` }),
      button("Reject", "reject", () => review(p, "reject"),
        { class: "danger-quiet", "data-key": `reject:${p.relpath}`, "aria-label": `Reject ${p.relpath}` })));
    for (const row of rows) {
      const d = S.diffs[row.getAttribute("data-path")];
      if (d) row.append(d.error ? errorBox(d.error) : diffView(d.diff, `Changes of ${d.relpath}`));
    }
    const empty = el("li", { class: "empty", text: "Nothing is waiting for review." });
    const more = S.pending && S.pending.truncated ? el("li", { class: "muted", text: "More are waiting: review these first." }) : null;
    keepFocus(() => $("pending-list").replaceChildren(...(rows.length ? rows : [empty]), ...(more ? [more] : [])));
    renderRejected();
  }

  // The contribution against the version before it (history), before deciding on it.
  async function preview(p) {
    if (S.diffs[p.relpath]) { delete S.diffs[p.relpath]; renderPending(); return; }
    try {
      S.diffs[p.relpath] = await api(`${wfPath(S.wid, "/notes/diff")}?path=${enc(p.relpath)}`);
    } catch (err) {
      S.diffs[p.relpath] = { error: err };
    }
    renderPending();
  }

  function renderRejected() {
    const list = (S.rejected && S.rejected.rejected) || [];
    $("rejected-title").hidden = list.length === 0;
    keepFocus(() => $("rejected-list").replaceChildren(...list.map((r) => el("li", { class: "row rejected", "data-rejected": String(r.id) },
      el("div", { class: "grow" }, pathCode(r.relpath),
        el("p", { class: "muted", text: `rejected by ${r.rejected_by} · ${when(r.rejected_at)} · ${r.bytes} bytes` })),
      button("Restore", "unreject", () => unreject(r),
        { "data-key": `unreject:${r.id}`, "aria-label": `Restore ${r.relpath} into notes/` })))));
  }

  async function unreject(r) {
    clearError("pending-error");
    try {
      await api(wfPath(S.wid, `/notes/rejected/${enc(String(r.id))}/restore`), { method: "POST", body: {} });
      notice(`Restored ${r.relpath}: it waits for review again.`);
    } catch (err) {
      showError("pending-error", err);
    }
    stale.browser = true;
    stale.review = true;
    await refreshWorkflow();
  }

  async function review(p, decision) {
    clearError("pending-error");
    try {
      await api(wfPath(S.wid, "/notes/review"), { method: "POST",
        body: { path: p.relpath, decision, expected_version: p.digest || null } });
      notice(`${decision === "approve" ? "Approved" : "Rejected"} ${p.relpath}.`);
    } catch (err) {
      showError("pending-error", err);
    }
    stale.browser = true; // a rejected note leaves notes/
    stale.review = true;
    await refreshWorkflow();
  }

  // -- knowledge browser ------------------------------------------------------------------------
  const kbName = (alias) => (alias === null ? "own" : alias);
  function kbBase(alias) { return alias === null ? wfPath(S.wid, "/own") : wfPath(S.wid, `/sources/${enc(alias)}`); }

  function renderKbSelect() {
    const bar = $("kb-select");
    if (!S.wid || !S.detail) { bar.replaceChildren(); return; }
    // The attachment shown may have gone (detached, unavailable): fall back to the own KB.
    if (S.kb.alias !== null && !S.sources.some((s) => s.alias === S.kb.alias && s.available)) {
      S.kb = { alias: null, path: "" };
      S.file = null;
    }
    const choices = [{ alias: null, text: "Own", title: "this workflow's own knowledge base" }]
      .concat(S.sources.map((s) => ({ alias: s.alias, text: s.alias, disabled: !s.available,
        title: s.available ? `${s.label || s.workflow_id} (${s.workflow_id})` : `unavailable: ${s.reason}` })));
    keepFocus(() => bar.replaceChildren(...choices.map((c) => el("button", {
      type: "button", class: "seg", "data-kb": kbName(c.alias), "data-key": `kb:${kbName(c.alias)}`,
      "aria-pressed": String(c.alias === S.kb.alias), disabled: c.disabled, title: c.title,
      on: { click: () => openKb(c.alias, "") } }, c.text))));
  }

  function renderKbStatus() {
    const status = $("kb-status");
    if (!S.wid || !S.detail) { status.replaceChildren(); return; }
    if (S.kb.alias === null) {
      status.replaceChildren(badge("read-only view", "ro"), " ",
        el("span", { text: `own knowledge base of ${S.detail.label || S.wid}` }));
      return;
    }
    const att = S.sources.find((s) => s.alias === S.kb.alias);
    const parts = [badge("read-only view", "ro"), " ",
      el("span", { text: `shared from ${att ? (att.label || att.workflow_id) : S.kb.alias}` }), " ",
      el("code", { text: att ? att.workflow_id : "" })];
    if (att && att.access === "write") {
      const ws = writeStatus(att);
      parts.push(" ", badge(ws ? ws.text : "write", ws ? ws.kind : "write"));
    }
    status.replaceChildren(...parts);
  }

  function openKb(alias, path) {
    S.kb = { alias, path };
    S.file = null;
    renderKbSelect();
    refreshBrowser(S.seq);
    $("browser-title").scrollIntoView({ block: "nearest" });
  }

  async function refreshBrowser(seq) {
    renderKbStatus();
    renderCrumbs();
    if (!S.wid || !S.detail) { $("entries").replaceChildren(); $("viewer").replaceChildren(); return; }
    const { alias, path } = S.kb;
    try {
      const data = await api(`${kbBase(alias)}/dir?path=${enc(path)}&limit=${LIST_LIMIT}`);
      if (seq !== S.seq || alias !== S.kb.alias || path !== S.kb.path) return;
      clearError("browser-error");
      renderEntries(data);
    } catch (err) {
      if (seq !== S.seq) return;
      $("entries").replaceChildren();
      showError("browser-error", err);
      const att = S.sources.find((x) => x.alias === alias);
      if (att) {
        // A refused browse of a source: the same "why?" its card offers.
        $("browser-error").append(button("Why?", "why", async () => { if (!S.whys[att.alias]) await toggleWhy(att); focusKey(`why:${att.alias}`); },
          { "data-key": `browse-why:${att.alias}` }));
      }
    }
    if (S.file) await showFile(seq);
    else renderViewer(null);
  }

  function renderCrumbs() {
    const crumbs = $("crumbs");
    if (!S.wid || !S.detail) { crumbs.replaceChildren(); return; }
    const parts = S.kb.path ? S.kb.path.split("/") : [];
    const nodes = [button(kbName(S.kb.alias), "open", () => openKb(S.kb.alias, ""),
      { class: "crumb", "data-path": "", "data-key": "crumb:" })];
    parts.forEach((name, i) => {
      const rel = parts.slice(0, i + 1).join("/");
      nodes.push(el("span", { class: "sep", "aria-hidden": "true", text: "/" }),
        button(name, "open", () => openKb(S.kb.alias, rel), { class: "crumb", "data-path": rel, "data-key": `crumb:${rel}` }));
    });
    if (S.kb.alias === null && S.rights.manage && /^(context|notes)(\/|$)/.test(S.kb.path)) {
      nodes.push(el("span", { class: "spacer" }),
        el("form", { class: "new-file", novalidate: true, on: { submit: (ev) => { ev.preventDefault(); newFile(); } } },
          el("label", {}, "New file ", el("input", { id: "new-file-name", placeholder: "name.md", autocomplete: "off",
            spellcheck: "false", "data-key": "new-file-name" })),
          el("button", { type: "submit", "data-action": "new-file" }, "Create")));
    }
    crumbs.replaceChildren(...nodes);
  }

  function renderEntries(data) {
    const base = S.kb.path;
    const rows = (data.entries || []).map((e) => {
      const rel = base ? `${base}/${e.name}` : e.name;
      const isDir = e.type === "dir";
      const openable = isDir || e.type === "file" || e.type === "link" || e.type === "symlink";
      return el("li", { class: `entry ${e.type}` },
        el("button", {
          type: "button", class: "entry-btn", "data-action": "open", "data-path": rel, "data-type": e.type,
          "data-key": `entry:${rel}`, "aria-current": S.file && S.file.path === rel ? "true" : null,
          disabled: !openable,
          on: { click: () => (isDir ? openKb(S.kb.alias, rel) : openFile(S.kb.alias, rel)) },
        },
        el("span", { class: "icon", "aria-hidden": "true", text: isDir ? "▸" : "·" }),
        el("span", { class: "name", text: e.name }),
        isDir ? null : el("span", { class: "kind", text: e.type !== "file" ? e.type : "" }),
        e.contributed_by ? badge(`from ${e.contributed_by}`, "warn") : null));
    });
    if (data.truncated) rows.push(el("li", { class: "muted", text: `Showing the first ${rows.length} entries.` }));
    keepFocus(() => $("entries").replaceChildren(...(rows.length ? rows : [el("li", { class: "empty", text: "Empty folder." })])));
  }

  function openFile(alias, path) {
    if (alias !== S.kb.alias) {
      S.kb = { alias, path: path.includes("/") ? path.slice(0, path.lastIndexOf("/")) : "" };
      renderKbSelect();
      S.file = { alias, path };
      refreshBrowser(S.seq);
    } else {
      S.file = { alias, path };
      showFile(S.seq);
    }
    $("browser-title").scrollIntoView({ block: "nearest" });
  }

  async function showFile(seq) {
    const file = S.file;
    if (!file) return;
    if (S.editing && S.editing.expected === "none" && file.alias === null && S.editing.path === file.path) {
      // A new file not saved yet: nothing to read, the editor stays as it is.
      renderViewer({ path: file.path, size: 0, encoding: "utf-8", content: "" });
      return;
    }
    for (const b of $("entries").querySelectorAll("button[data-path]")) {
      if (b.getAttribute("data-path") === file.path) b.setAttribute("aria-current", "true");
      else b.removeAttribute("aria-current");
    }
    try {
      const data = await api(`${kbBase(file.alias)}/file?path=${enc(file.path)}`);
      if (seq !== S.seq || S.file !== file) return;
      clearError("browser-error");
      renderViewer(data);
    } catch (err) {
      if (seq !== S.seq || S.file !== file) return;
      // A refusal replaces the view: nothing of an earlier file stays on screen under this name.
      renderViewer(null);
      $("viewer").append(el("h3", { class: "viewer-path", text: file.path }));
      showError("browser-error", err);
    }
  }

  function renderViewer(data) {
    const viewer = $("viewer");
    if (!data) {
      viewer.replaceChildren(el("p", { class: "empty", text: S.file ? "" : "Choose a file to read it here." }));
      return;
    }
    const isMd = /\.(md|markdown)$/i.test(data.path) && data.encoding === "utf-8";
    const file = S.file;
    const owner = file ? noteOwner(file.alias) : null;
    const head = el("header", { class: "viewer-head" },
      el("h3", { class: "viewer-path" }, pathCode(data.path, { class: "path plain" })),
      badge(`${data.size} bytes`, "muted"), badge("read-only", "ro"),
      el("span", { class: "spacer" }),
      isMd ? button(S.rendered ? "Show text" : "Show rendered", "render", () => { S.rendered = !S.rendered; renderViewer(data); },
        { class: "quiet", "data-key": "viewer-render", "aria-pressed": String(S.rendered) }) : null,
      owner && /^notes\//.test(data.path) ? button("History", "history", () => loadHistory(file, owner),
        { class: "quiet", "data-key": "viewer-history" }) : null,
      editable(file, data) ? button("Edit", "edit", () => startEdit(data), { class: "quiet", "data-key": "viewer-edit" }) : null);
    if (S.editing && file && file.alias === null && S.editing.path === data.path) {
      viewer.replaceChildren(head, editor());
      return;
    }
    let body;
    if (isMd && S.rendered) {
      // Rendered from text into DOM nodes (renderMarkdown): never parsed as HTML.
      body = renderMarkdown(data.content);
      body.setAttribute("aria-label", `Contents of ${data.path}`);
      body.setAttribute("tabindex", "0");
    } else if (data.encoding === "utf-8") {
      body = el("pre", { class: "file-text", tabindex: "0", "aria-label": `Contents of ${data.path}` });
      body.textContent = data.content;
    } else {
      body = el("p", { class: "empty", text: "Not text (binary): not shown." });
    }
    const hist = S.history && file && S.history.alias === file.alias && S.history.path === file.path
      ? historyView(S.history) : null;
    viewer.replaceChildren(head, body, ...(hist ? [hist] : []));
  }

  // -- editing the own KB (owners and editors: the operation re-checks) ---------------------------
  const EDITABLE = /^(context|notes)\/./;
  function editable(file, data) {
    return Boolean(file && file.alias === null && S.rights.manage && data.encoding === "utf-8"
      && EDITABLE.test(data.path) && data.path !== "notes/_index.json");
  }

  async function versionOf(text) {
    const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
    return `sha256:${[...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, "0")).join("")}`;
  }

  async function startEdit(data) {
    // The version the editor read: a save is refused (412) when the file changed since.
    S.editing = { path: data.path, text: data.content, expected: await versionOf(data.content) };
    renderViewer(data);
    focusKey("editor-text");
  }

  function newFile() {
    const name = $("new-file-name").value.trim();
    if (!name) return;
    const path = `${S.kb.path}/${name}`;
    S.editing = { path, text: "", expected: "none" };
    S.file = { alias: null, path };
    renderViewer({ path, size: 0, encoding: "utf-8", content: "" });
    focusKey("editor-text");
  }

  function editor() {
    const ed = S.editing;
    const area = el("textarea", { class: "editor", "data-key": "editor-text", "aria-label": `Text of ${ed.path}`,
      spellcheck: "false", rows: "18", on: { input: (ev) => { ed.text = ev.target.value; } } });
    area.value = ed.text;
    return el("form", { class: "edit-form", novalidate: true, on: { submit: (ev) => { ev.preventDefault(); saveEdit(); } } },
      area,
      el("div", { class: "edit-actions" },
        el("span", { class: "muted", text: ed.expected === "none" ? "a new file" : `editing version ${ed.expected.slice(0, 19)}…` }),
        el("span", { class: "spacer" }),
        button("Cancel", "edit-cancel", () => { S.editing = null; showFile(S.seq); }, { class: "quiet" }),
        el("button", { type: "submit", class: "primary", "data-action": "save", "data-key": "editor-save" }, "Save")));
  }

  async function saveEdit() {
    const ed = S.editing;
    clearError("browser-error");
    try {
      const done = await api(wfPath(S.wid, "/own/file"), { method: "PUT",
        body: { path: ed.path, content: ed.text, expected_version: ed.expected } });
      notice(`Saved ${done.path} (${done.bytes} bytes).`);
    } catch (err) {
      // The text stays in the editor: a refused save loses nothing.
      showError("browser-error", err);
      return;
    }
    S.editing = null;
    stale.browser = true;
    await refreshWorkflow();
  }

  // -- note history (the viewer's notes/ files) ------------------------------------------------
  // The workflow whose notes/ holds the file: this one (own KB) or the attached source.
  function noteOwner(alias) {
    if (alias === null) return S.wid;
    const att = S.sources.find((s) => s.alias === alias);
    return att ? att.workflow_id : null;
  }

  async function loadHistory(file, owner) {
    try {
      const data = await api(`${wfPath(owner, "/notes/history")}?path=${enc(file.path)}`);
      if (S.file !== file) return;
      S.history = { alias: file.alias, path: file.path, owner, data, diff: null };
      clearError("browser-error");
    } catch (err) {
      showError("browser-error", err);
      return;
    }
    await showFile(S.seq);
    focusKey("history-close");
  }

  function historyView(h) {
    const versions = h.data.versions || [];
    const rows = versions.map((v, i) => el("li", { class: "row version", "data-version": v.version },
      el("code", { text: String(v.version).slice(0, 19) }),
      el("span", { class: "muted", text: `${when(v.at)} · ${v.how} · ${v.principal || v.workflow || "-"} · ${v.size} bytes` }),
      el("span", { class: "spacer" }),
      button(i === versions.length - 1 ? "Show first version" : "Diff", "diff", () => showDiff(h, v.version),
        { class: "quiet", "data-key": `diff:${v.version}`, "aria-label": `Changes of version ${v.version}` })));
    return el("section", { class: "history", "aria-label": `History of ${h.path}` },
      el("div", { class: "panel-head" }, el("h4", { text: `History (${versions.length} version${versions.length === 1 ? "" : "s"})` }),
        button("Close", "history-close", () => { S.history = null; showFile(S.seq); }, { class: "quiet", "data-key": "history-close" })),
      el("ul", { class: "rows" }, ...(rows.length ? rows : [el("li", { class: "empty", text: "No version recorded yet." })])),
      h.diff ? diffView(h.diff.diff, `Changes from ${h.diff.from || "nothing"} to ${h.diff.to}`) : null);
  }

  async function showDiff(h, version) {
    try {
      h.diff = await api(`${wfPath(h.owner, "/notes/diff")}?path=${enc(h.path)}&version=${enc(version)}`);
      clearError("browser-error");
    } catch (err) {
      showError("browser-error", err);
      return;
    }
    await showFile(S.seq);
    focusKey(`diff:${version}`);
  }

  // -- search --------------------------------------------------------------------------------
  function renderSearchScope() {
    const select = $("search-alias");
    const was = select.value;
    const opts = [el("option", { value: "" }, "all knowledge")].concat(
      S.sources.filter((s) => s.available).map((s) => el("option", { value: s.alias, selected: s.alias === was }, s.alias)));
    select.replaceChildren(...opts);
  }

  async function search(ev) {
    ev.preventDefault();
    const q = $("search-q").value.trim();
    clearError("search-error");
    if (!S.wid) return;
    if (!q) { $("hits").replaceChildren(); $("search-note").textContent = "Type what to look for."; return; }
    const alias = $("search-alias").value;
    const seq = S.seq;
    $("search-note").textContent = "Searching…";
    try {
      const unreviewed = $("search-unreviewed").checked ? "&include_unreviewed=true" : "";
      const data = await api(wfPath(S.wid, `/search?q=${enc(q)}&limit=20${alias ? `&alias=${enc(alias)}` : ""}${unreviewed}`));
      if (seq !== S.seq) return;
      renderHits(data);
    } catch (err) {
      if (seq !== S.seq) return;
      $("search-note").textContent = "";
      $("hits").replaceChildren();
      showError("search-error", err);
    }
  }

  const TRUST = {
    own: ["own KB", "ok"], source: ["source's own", "ok"],
    "contributed-approved": ["contributed · approved", "ok"], "contributed-unreviewed": ["contributed · unreviewed", "warn"],
  };
  function renderHits(data) {
    const hits = data.hits || [];
    const dropped = data.dropped_by_gate ? ` · ${data.dropped_by_gate} left out by the injection gate` : "";
    $("search-note").textContent = `${hits.length} hit${hits.length === 1 ? "" : "s"} for “${data.query}”${dropped}`;
    $("hits").replaceChildren(...hits.map((h) => {
      const [trustText, trustKind] = TRUST[h.trust] || [h.trust, "muted"];
      return el("li", { class: "hit", "data-trust": h.trust, "data-review": h.review },
        el("button", { type: "button", class: "link hit-title", "data-action": "open", "data-path": h.relpath,
          "data-key": `hit:${h.alias || ""}:${h.relpath}`, on: { click: () => openFile(h.alias, h.relpath) } },
        h.title || h.relpath),
        el("p", { class: "hit-meta" },
          badge(h.alias === null ? "own" : h.alias, "kb"), " ", el("code", { text: h.relpath }), " ",
          badge(trustText, trustKind), " ",
          h.review === "own" ? null : badge(`review: ${h.review}`, h.review === "unreviewed" ? "warn" : "ok"),
          h.contributed_by_workflow ? el("span", { class: "muted", text: ` by ${h.contributed_by_workflow}` }) : null),
        el("p", { class: "snippet", text: h.snippet || "" }));
    }));
  }

  // -- live -------------------------------------------------------------------------------------------
  function setLive(on, text) {
    const badgeEl = $("live");
    badgeEl.setAttribute("data-live", on ? "on" : "off");
    badgeEl.textContent = text;
  }

  // Coalescing without timers: a hidden tab's timers are throttled to one a
  // second, its network events are not. The first event starts a refresh at
  // once; events meanwhile are folded into one more refresh after it.
  const wanted = { workflows: false, workflow: false };
  let draining = false;
  async function schedule(what) {
    for (const k of what) wanted[k] = true;
    if (draining) return;
    draining = true;
    try {
      while (wanted.workflow || wanted.workflows) {
        const todo = { ...wanted };
        wanted.workflows = false;
        wanted.workflow = false;
        // The shown workflow first (what a change shows), then the list.
        if (todo.workflow) await refreshWorkflow();
        if (todo.workflows) await loadWorkflows();
      }
    } finally {
      draining = false;
    }
  }

  // Which panels an event touches: the selected workflow, or one of its sources (cards
  // show the sources' labels, availability and write grants), or everything on resync.
  function onEvent(ev) {
    let data;
    try { data = JSON.parse(ev.data); } catch (_) { return; }
    const type = data.type || ev.type;
    const wid = data.workflow_id;
    if (type === "resync") {
      refreshMe(); // a daemon started or stopped: is the page live now?
      stale.review = true;
      stale.browser = true;
      schedule(["workflows", "workflow"]);
      return;
    }
    if (type === "workflow.changed") schedule(["workflows"]);
    if (type === "request.opened" || type === "request.decided") { loadRequests(); return; }
    if (!S.wid) return;
    const own = wid === S.wid;
    const source = S.sources.find((s) => s.workflow_id === wid);
    if (!own && !source) return;
    if (!/^(workflow|sources|writers|note)\./.test(type)) return;
    // A hand edit of the manifest may change its writers too (it comes as workflow.changed).
    if (own && type !== "sources.changed") stale.review = true;
    if (type === "note.written" && (own ? S.kb.alias === null : source && source.alias === S.kb.alias)) {
      stale.browser = true;
    }
    schedule(["workflow"]);
  }

  const EVENT_TYPES = ["workflow.changed", "sources.changed", "writers.changed", "note.written", "request.opened",
    "request.decided", "resync"];
  // The badge is "live" only while the stream is open AND the server says changes
  // reach it (/api/me `live`: on the root, a daemon must run to see hand edits).
  let streamOpen = false;
  function showLive() {
    const live = Boolean(S.me && S.me.live);
    if (streamOpen && live) setLive(true, "live");
    else if (live) setLive(false, "connecting…");
    else setLive(false, "not live — reload to refresh");
  }
  async function refreshMe() {
    try {
      S.me = await api("/api/me");
    } catch (err) {
      alertError(err);
    }
    showLive();
  }

  function follow() {
    if (typeof EventSource === "undefined") { setLive(false, "not live — reload to refresh"); return; }
    const source = new EventSource("/api/events");
    let dropped = false;
    source.onopen = () => {
      streamOpen = true;
      showLive();
      if (dropped) { dropped = false; schedule(["workflows", "workflow"]); refreshMe(); }
    };
    source.onerror = () => {
      dropped = true;
      streamOpen = false;
      setLive(false, source.readyState === EventSource.CLOSED ? "not live — reload to refresh" : "reconnecting…");
    };
    source.onmessage = onEvent;
    // Frames that name their type (`event: …`) do not reach onmessage.
    for (const t of EVENT_TYPES) source.addEventListener(t, onEvent);
    showLive();
  }

  // -- start -------------------------------------------------------------------------------------------
  function wfFromHash() {
    const m = /^#wf=(.+)$/.exec(location.hash);
    if (!m) return null;
    try { return decodeURIComponent(m[1]); } catch (_) { return null; }
  }

  async function start() {
    $("attach-form").addEventListener("submit", attach);
    $("attach-source").addEventListener("change", () => {
      if (!aliasTouched) $("attach-alias").value = suggestAlias($("attach-source").value);
    });
    $("attach-alias").addEventListener("input", () => { aliasTouched = $("attach-alias").value !== ""; });
    $("grant-form").addEventListener("submit", grant);
    $("grant-pick").addEventListener("change", () => { $("grant-other").hidden = $("grant-pick").value !== OTHER; });
    $("search-form").addEventListener("submit", search);
    $("wf-filter").addEventListener("input", renderWorkflows);
    $("wf-list").addEventListener("keydown", workflowKeys);
    window.addEventListener("hashchange", () => { const w = wfFromHash(); if (w) selectWorkflow(w); });
    try {
      S.me = await api("/api/me");
    } catch (err) {
      $("who").textContent = "not signed in";
      alertError(err);
      setLive(false, "not live");
      return;
    }
    $("who").replaceChildren(el("span", { class: "principal", text: S.me.principal }),
      el("span", { class: "mode", text: S.me.mode === "daemon" ? " · through the daemon" : " · on the root" }));
    follow();
    await loadWorkflows();
    await loadRequests();
    const initial = wfFromHash() || S.me.workflow || (S.workflows[0] && S.workflows[0].id) || null;
    if (initial) selectWorkflow(initial);
    else renderHead();
    document.body.setAttribute("data-ready", "true");
  }

  document.addEventListener("DOMContentLoaded", start);
})();
