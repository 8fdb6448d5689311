/* The chat page: conversations kept in localStorage, replies streamed from the server's
 * /v1/chat/completions (SSE, read with fetch + ReadableStream), rendered by NanoMarkdown.
 *
 * Invariants: at most one reply streams at a time (`busy`); Stop aborts its fetch, which closes
 * the connection, and the server aborts the request. Model output only reaches the page through
 * NanoMarkdown.render (escaped) or textContent. The API key, when the server asks for one (401),
 * is kept in localStorage and sent as `Authorization: Bearer`.
 */
"use strict";

(() => {
  const KEYS = { conversations: "nanoserve.chat.conversations", current: "nanoserve.chat.current",
    settings: "nanoserve.chat.settings", apiKey: "nanoserve.apiKey" };
  const THINK_OPEN = "<think>", THINK_CLOSE = "</think>";
  const $ = (id) => document.getElementById(id);

  const load = (key, fallback) => {
    try { return JSON.parse(localStorage.getItem(key)) ?? fallback; } catch { return fallback; }
  };
  const save = (key, value) => localStorage.setItem(key, JSON.stringify(value));

  const state = {
    conversations: load(KEYS.conversations, []),
    currentId: load(KEYS.current, null),
    settings: load(KEYS.settings, {}),
    model: null,
    busy: null, // {controller, conv, msg} while a reply streams
    keyWaiters: null,
  };
  // A reply cut short by a page reload is shown as stopped.
  for (const conv of state.conversations) for (const m of conv.messages) if (m.pending) { m.pending = false; m.stopped = true; }

  const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  const current = () => state.conversations.find((c) => c.id === state.currentId) || null;
  const persist = () => { save(KEYS.conversations, state.conversations); save(KEYS.current, state.currentId); };

  /* ---- server access ---- */

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = localStorage.getItem(KEYS.apiKey);
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  /** The API's error as one line: `error.message`, with Retry-After for a 429. */
  async function errorMessage(resp) {
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch { /* not JSON: keep the status line */ }
    if (resp.status === 429) {
      const after = resp.headers.get("Retry-After");
      message += after ? ` (retry after ${after} s)` : "";
    }
    return `${message} [HTTP ${resp.status}]`;
  }

  /** Resolves once the user saved a key (true) or closed the prompt (false). */
  function askKey(reason) {
    const dialog = $("key-dialog");
    $("key-reason").textContent = reason || "";
    $("key-input").value = "";
    if (!dialog.open) dialog.showModal();
    return new Promise((resolve) => { (state.keyWaiters ||= []).push(resolve); });
  }

  function keyDialogClosed(saved) {
    const waiters = state.keyWaiters || [];
    state.keyWaiters = null;
    for (const resolve of waiters) resolve(saved);
  }

  async function loadModel() {
    try {
      const resp = await fetch("/v1/models", { headers: headers() });
      if (resp.status === 401) {
        if (await askKey(await errorMessage(resp))) return loadModel();
        return showError("An API key is needed to use this server.");
      }
      if (!resp.ok) return showError(`Could not list the models: ${await errorMessage(resp)}`);
      const body = await resp.json();
      state.model = body.data && body.data.length ? body.data[0].id : null;
      $("model").textContent = state.model || "no model";
      showError(null);
    } catch (e) {
      showError(`The server could not be reached: ${e.message}`);
    }
  }

  /** The JSON payloads of an SSE body, up to `data: [DONE]`. */
  async function* sseEvents(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  }

  /** Sampling settings as request fields: empty or unparsable fields are left to the server. */
  function samplingFields() {
    const out = {};
    for (const [field, name] of [["temperature", "temperature"], ["top_p", "top_p"], ["max_tokens", "max_tokens"],
      ["seed", "seed"]]) {
      const raw = state.settings[name];
      if (raw === undefined || raw === null || String(raw).trim() === "") continue;
      const value = Number(raw);
      if (!Number.isNaN(value)) out[field] = value;
    }
    return out;
  }

  /** A reply's text split into its reasoning (`<think>...</think>`, open while streaming) and answer. */
  function splitReasoning(text) {
    const open = text.indexOf(THINK_OPEN), close = text.indexOf(THINK_CLOSE);
    if (open >= 0 && text.slice(0, open).trim() === "") {
      const start = open + THINK_OPEN.length;
      if (close < 0) return { reasoning: text.slice(start), answer: "", thinking: true };
      return { reasoning: text.slice(start, close), answer: text.slice(close + THINK_CLOSE.length), thinking: false };
    }
    if (close >= 0 && open < 0) { // the template opened the block in the prompt
      return { reasoning: text.slice(0, close), answer: text.slice(close + THINK_CLOSE.length), thinking: false };
    }
    return { reasoning: "", answer: text, thinking: false };
  }

  function requestMessages(conv, upTo) {
    const messages = [];
    const system = (state.settings.system || "").trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of conv.messages.slice(0, upTo)) {
      if (m.role === "user") messages.push({ role: "user", content: m.content });
      else if (!m.error) messages.push({ role: "assistant", content: splitReasoning(m.content).answer.trim() });
    }
    return messages;
  }

  /** Streams one assistant reply to the end of `conv`. */
  async function generate(conv) {
    const msg = { role: "assistant", content: "", reasoning: "", pending: true };
    const history = requestMessages(conv, conv.messages.length);
    conv.messages.push(msg);
    conv.updated = Date.now();
    const controller = new AbortController();
    state.busy = { controller, conv, msg };
    persist();
    render();
    const body = { messages: history, stream: true, stream_options: { include_usage: true }, ...samplingFields() };
    if (state.model) body.model = state.model;
    const t0 = performance.now();
    let tFirst = null, usage = null, retryWithKey = false;
    try {
      const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
        signal: controller.signal });
      if (!resp.ok) {
        msg.error = await errorMessage(resp);
        retryWithKey = resp.status === 401;
      } else {
        for await (const event of sseEvents(resp.body)) {
          if (event.error) { msg.error = `${event.error.message} (the reply was cut short)`; break; }
          for (const choice of event.choices || []) {
            const delta = choice.delta || {};
            if ((delta.content || delta.reasoning_content) && tFirst === null) tFirst = performance.now();
            if (delta.content) msg.content += delta.content;
            if (delta.reasoning_content) msg.reasoning += delta.reasoning_content;
            if (choice.finish_reason) msg.finish = choice.finish_reason;
          }
          if (event.usage) usage = event.usage;
          scheduleUpdate();
        }
      }
    } catch (e) {
      if (e.name === "AbortError") msg.stopped = true;
      else msg.error = `The server could not be reached: ${e.message}`;
    } finally {
      const tEnd = performance.now();
      msg.pending = false;
      msg.stats = { ttftMs: tFirst === null ? null : tFirst - t0, totalMs: tEnd - t0,
        decodeMs: tFirst === null ? null : tEnd - tFirst, usage };
      state.busy = null;
      if (retryWithKey) conv.messages.splice(conv.messages.indexOf(msg), 1);
      persist();
      render();
    }
    if (retryWithKey && await askKey(msg.error)) {
      await loadModel();
      await generate(conv);
    } else if (retryWithKey) {
      msg.pending = false;
      conv.messages.push(msg);
      persist();
      render();
    }
  }

  /* ---- rendering ---- */

  function showError(text) {
    const el = $("error");
    el.hidden = !text;
    el.textContent = text || "";
  }

  function statsLine(msg) {
    const s = msg.stats;
    if (!s) return null;
    const parts = [];
    const usage = s.usage;
    if (usage) {
      parts.push(`${usage.completion_tokens} tokens`);
      // Decode speed: tokens after the first over the time after the first.
      if (usage.completion_tokens > 1 && s.decodeMs > 0) {
        parts.push(`${((usage.completion_tokens - 1) / (s.decodeMs / 1000)).toFixed(1)} tok/s`);
      }
      parts.push(`prompt ${usage.prompt_tokens}`);
    }
    if (s.ttftMs !== null) parts.push(`TTFT ${Math.round(s.ttftMs)} ms`);
    if (msg.stopped) parts.push("stopped");
    else if (msg.finish) parts.push(`finish: ${msg.finish}`);
    const el = document.createElement("div");
    el.className = "stats";
    el.dataset.testid = "stats";
    if (usage) {
      el.dataset.completionTokens = usage.completion_tokens;
      el.dataset.promptTokens = usage.prompt_tokens;
    }
    el.textContent = parts.join(" · ");
    return el;
  }

  /** Redraws an assistant message element (`.msg`) from `msg`. */
  function fillAssistant(msgEl, msg) {
    const { reasoning, answer, thinking } = splitReasoning(msg.content);
    const allReasoning = (msg.reasoning || "") + reasoning;
    const el = msgEl.querySelector(".assistant-body");
    el.replaceChildren();
    if (allReasoning.trim()) {
      const details = document.createElement("details");
      details.className = "reasoning";
      details.dataset.testid = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = thinking && msg.pending ? "Thinking…" : "Reasoning";
      const body = document.createElement("div");
      body.className = "reasoning-body";
      body.textContent = allReasoning.trim();
      details.append(summary, body);
      el.append(details);
    }
    const content = document.createElement("div");
    content.className = "content";
    content.dataset.testid = "content";
    content.innerHTML = window.NanoMarkdown.render(answer);
    el.append(content);
    if (msg.error) {
      const err = document.createElement("div");
      err.className = "msg-error";
      err.dataset.testid = "message-error";
      err.setAttribute("role", "alert");
      err.textContent = msg.error;
      el.append(err);
    }
    const stats = statsLine(msg);
    if (stats) el.append(stats);
    msgEl.dataset.state = msg.pending ? "streaming" : msg.error ? "error" : msg.stopped ? "stopped" : "done";
  }

  function messageElement(conv, msg, index) {
    const el = document.createElement("div");
    el.className = `msg ${msg.role}`;
    el.dataset.testid = "message";
    el.dataset.role = msg.role;
    el.dataset.index = index;
    if (msg.role === "user") {
      const content = document.createElement("div");
      content.className = "content";
      content.dataset.testid = "content";
      content.textContent = msg.content;
      el.append(content);
      return el;
    }
    const inner = document.createElement("div");
    inner.className = "assistant-body";
    el.append(inner);
    fillAssistant(el, msg);
    if (index === conv.messages.length - 1 && !msg.pending) {
      const regen = document.createElement("button");
      regen.type = "button";
      regen.className = "regenerate";
      regen.dataset.testid = "regenerate";
      regen.textContent = "↻ Regenerate";
      regen.disabled = Boolean(state.busy);
      el.append(regen);
    }
    return el;
  }

  function renderConversations() {
    const list = $("conversations");
    list.replaceChildren();
    const sorted = [...state.conversations].sort((a, b) => (b.updated || 0) - (a.updated || 0));
    for (const conv of sorted) {
      const li = document.createElement("li");
      li.dataset.testid = "conversation";
      li.dataset.id = conv.id;
      if (conv.id === state.currentId) li.className = "active";
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open";
      open.textContent = conv.title || "New chat";
      open.title = conv.title || "New chat";
      const del = document.createElement("button");
      del.type = "button";
      del.className = "delete";
      del.dataset.testid = "delete-conversation";
      del.title = "Delete this conversation";
      del.textContent = "×";
      li.append(open, del);
      list.append(li);
    }
  }

  function render() {
    renderConversations();
    const conv = current();
    const box = $("messages");
    const nearBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    box.replaceChildren();
    if (conv) conv.messages.forEach((m, i) => box.append(messageElement(conv, m, i)));
    if (!conv || conv.messages.length === 0) {
      const empty = document.createElement("p");
      empty.className = "empty";
      empty.textContent = "Ask the model something.";
      box.append(empty);
    }
    const busy = Boolean(state.busy);
    document.body.dataset.busy = busy ? "true" : "false";
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    if (nearBottom || busy) box.scrollTop = box.scrollHeight;
  }

  let updateQueued = false;
  /** Redraws only the streaming reply, at most once per animation frame. */
  function scheduleUpdate() {
    if (updateQueued) return;
    updateQueued = true;
    requestAnimationFrame(() => {
      updateQueued = false;
      const busy = state.busy;
      if (!busy || busy.conv.id !== state.currentId) return;
      const index = busy.conv.messages.indexOf(busy.msg);
      const el = $("messages").querySelector(`.msg[data-index="${index}"]`);
      if (!el) return;
      const box = $("messages");
      const nearBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
      fillAssistant(el, busy.msg);
      if (nearBottom) box.scrollTop = box.scrollHeight;
    });
  }

  /* ---- actions ---- */

  function newConversation() {
    const conv = { id: newId(), title: "", messages: [], updated: Date.now() };
    state.conversations.push(conv);
    state.currentId = conv.id;
    persist();
    render();
    return conv;
  }

  function deleteConversation(id) {
    if (state.busy && state.busy.conv.id === id) state.busy.controller.abort();
    state.conversations = state.conversations.filter((c) => c.id !== id);
    if (state.currentId === id) {
      const next = [...state.conversations].sort((a, b) => (b.updated || 0) - (a.updated || 0))[0];
      state.currentId = next ? next.id : null;
    }
    persist();
    render();
  }

  async function send() {
    const input = $("input");
    const text = input.value.trim();
    if (!text || state.busy) return;
    const conv = current() || newConversation();
    if (!conv.title) conv.title = text.length > 48 ? `${text.slice(0, 47)}…` : text;
    conv.messages.push({ role: "user", content: text });
    input.value = "";
    await generate(conv);
  }

  async function regenerate() {
    const conv = current();
    if (!conv || state.busy) return;
    const last = conv.messages[conv.messages.length - 1];
    if (!last || last.role !== "assistant") return;
    conv.messages.pop();
    await generate(conv);
  }

  function bindSettings() {
    const fields = { "system-prompt": "system", temperature: "temperature", "top-p": "top_p", "max-tokens": "max_tokens",
      seed: "seed" };
    for (const [id, name] of Object.entries(fields)) {
      const el = $(id);
      el.value = state.settings[name] ?? "";
      el.addEventListener("input", () => { state.settings[name] = el.value; save(KEYS.settings, state.settings); });
    }
    $("settings-toggle").addEventListener("click", () => {
      const panel = $("settings");
      panel.hidden = !panel.hidden;
      $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
    });
  }

  function bind() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    });
    $("stop").addEventListener("click", () => { if (state.busy) state.busy.controller.abort(); });
    $("new-chat").addEventListener("click", () => { if (!current() || current().messages.length) newConversation(); });
    $("conversations").addEventListener("click", (e) => {
      const li = e.target.closest("li");
      if (!li) return;
      if (e.target.closest(".delete")) deleteConversation(li.dataset.id);
      else { state.currentId = li.dataset.id; persist(); render(); }
    });
    $("messages").addEventListener("click", (e) => {
      if (e.target.closest(".regenerate")) { regenerate(); return; }
      const copy = e.target.closest(".copy");
      if (copy) {
        const code = copy.closest(".codeblock").querySelector("code").textContent;
        navigator.clipboard.writeText(code).then(() => { copy.textContent = "Copied"; }, () => { copy.textContent = "Copy failed"; });
      }
    });
    $("key-form").addEventListener("submit", () => {
      localStorage.setItem(KEYS.apiKey, $("key-input").value.trim());
      keyDialogClosed(true);
    });
    $("key-dialog").addEventListener("cancel", () => keyDialogClosed(false));
    bindSettings();
  }

  bind();
  if (!current() && state.conversations.length) state.currentId = state.conversations[0].id;
  render();
  loadModel();
})();
