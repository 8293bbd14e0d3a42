// The chat page: conversations kept in this browser (localStorage), replies streamed from
// /v1/chat/completions. Model text is only ever set as textContent, never parsed as HTML.
"use strict";

const STORE = "superslm.chat";
const $ = (id) => document.getElementById(id);

const state = load();
let running = null; // {controller, message} while a reply streams

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "null");
    if (saved && Array.isArray(saved.conversations)) return saved;
  } catch (e) { /* a broken store starts over */ }
  return { conversations: [], current: null, settings: {} };
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

function current() {
  return state.conversations.find((c) => c.id === state.current) || null;
}

function newConversation() {
  const c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "New chat", messages: [] };
  state.conversations.unshift(c);
  state.current = c.id;
  save();
  render();
  return c;
}

const SETTINGS = { system: "system", temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens",
                   api_key: "api-key", model: "model" };

function readSettings() {
  for (const [key, id] of Object.entries(SETTINGS)) state.settings[key] = $(id).value;
  save();
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.settings.api_key) h.Authorization = "Bearer " + state.settings.api_key;
  return h;
}

async function loadModels() {
  const select = $("model");
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
    if (state.settings.model && body.data.some((m) => m.id === state.settings.model)) select.value = state.settings.model;
    setStatus("");
  } catch (e) {
    setStatus("Could not list the models: " + e.message);
  }
}

function setStatus(text) {
  $("status").textContent = text;
}

function renderMessage(m) {
  const box = document.createElement("div");
  box.className = "message " + m.role + (m.error ? " error" : "");
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role === "user" ? "You" : "Assistant" + (m.model ? " · " + m.model : "");
  box.append(role);
  if (m.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = "Thinking";
    const pre = document.createElement("pre");
    pre.textContent = m.reasoning;
    details.append(summary, pre);
    box.append(details);
  }
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = m.error ? m.error : m.content;
  box.append(content);
  if (m.stats) {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = m.stats;
    box.append(stats);
  }
  return box;
}

function render() {
  const list = $("conversations");
  list.replaceChildren(...state.conversations.map((c) => {
    const li = document.createElement("li");
    li.className = c.id === state.current ? "current" : "";
    const title = document.createElement("span");
    title.textContent = c.title;
    const del = document.createElement("button");
    del.type = "button";
    del.title = "Delete";
    del.textContent = "×";
    del.addEventListener("click", (ev) => {
      ev.stopPropagation();
      state.conversations = state.conversations.filter((x) => x.id !== c.id);
      if (state.current === c.id) state.current = state.conversations.length ? state.conversations[0].id : null;
      save();
      render();
    });
    li.append(title, del);
    li.addEventListener("click", () => { if (!running) { state.current = c.id; save(); render(); } });
    return li;
  }));
  const conv = current();
  $("messages").replaceChildren(...(conv ? conv.messages.map(renderMessage) : []));
  $("messages").scrollTop = $("messages").scrollHeight;
}

function number(value, fallback) {
  const x = parseFloat(value);
  return Number.isFinite(x) ? x : fallback;
}

async function send(text) {
  readSettings();
  const conv = current() || newConversation();
  if (!conv.messages.length) conv.title = text.slice(0, 40);
  conv.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", reasoning: "", model: state.settings.model };
  conv.messages.push(reply);
  save();
  render();
  const history = conv.messages.slice(0, -1).filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  const messages = state.settings.system ? [{ role: "system", content: state.settings.system }, ...history] : history;
  const body = {
    model: state.settings.model, messages, stream: true, stream_options: { include_usage: true },
    temperature: number(state.settings.temperature, 0.7), top_p: number(state.settings.top_p, 1),
    max_tokens: Math.max(1, Math.round(number(state.settings.max_tokens, 512))),
  };
  const controller = new AbortController();
  running = { controller, message: reply };
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("Generating…");
  const started = performance.now();
  let first = null;
  let pieces = 0;
  let usage = null;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                     signal: controller.signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : r.status + " " + r.statusText);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of frame.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const delta = chunk.choices && chunk.choices[0] ? chunk.choices[0].delta || {} : {};
          if (delta.content || delta.reasoning_content) {
            if (first === null) first = performance.now();
            pieces += 1;
            reply.content += delta.content || "";
            reply.reasoning += delta.reasoning_content || "";
            render();
          }
        }
      }
    }
    reply.stats = stats(usage ? usage.completion_tokens : pieces, first, started);
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stopped = true;
      reply.stats = stats(pieces, first, started) + " · stopped";
    } else {
      reply.error = e.message;
    }
  } finally {
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    setStatus("");
    save();
    render();
  }
}

function stats(tokens, first, started) {
  const now = performance.now();
  const ttft = first === null ? null : (first - started) / 1000;
  const rate = first !== null && now > first && tokens > 1 ? (tokens - 1) / ((now - first) / 1000) : null;
  let text = tokens + " tokens";
  if (rate !== null) text += " · " + rate.toFixed(1) + " tok/s";
  if (ttft !== null) text += " · first token " + ttft.toFixed(2) + " s";
  return text;
}

function init() {
  for (const [key, id] of Object.entries(SETTINGS)) {
    if (state.settings[key] !== undefined && key !== "model") $(id).value = state.settings[key];
    $(id).addEventListener("change", readSettings);
  }
  $("api-key").addEventListener("change", loadModels);
  $("new-chat").addEventListener("click", () => { if (!running) newConversation(); });
  $("stop").addEventListener("click", () => { if (running) running.controller.abort(); });
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || running) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  render();
  loadModels();
}

init();
