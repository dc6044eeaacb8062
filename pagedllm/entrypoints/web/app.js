// pagedllm's web page: a chat over /v1/chat/completions (streamed) and a live engine view polling /engine/view.
// Plain browser JavaScript, no build step and no libraries, so the server can ship it as it is.
"use strict";

const CLIENT_DEFAULTS = { temperature: 0.7, top_p: 0.9 };  // as `pagedllm chat` and common chat clients
const POLL_MS = 1000;
const KEY_STORAGE = "pagedllm-api-key";
const BLOCK_COLORS = { ".": "--free", "c": "--cached", "u": "--in-use", "s": "--shared" };

const $ = (id) => document.getElementById(id);
let model = null;
let conversation = [];      // {role, content} of the finished turns, sent whole each turn
let streaming = null;       // the AbortController of the answer being streamed
let previousView = null;    // the last snapshot, for rates between two polls

// ------------------------------------------------------------------------------------------- API key
function headers(extra = {}) {
  const key = localStorage.getItem(KEY_STORAGE);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

class AuthError extends Error {}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers) });
  if (response.status === 401) {
    $("key-form").hidden = false;
    throw new AuthError("this server needs its API key");
  }
  return response;
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem(KEY_STORAGE, $("key-input").value.trim());
  $("key-form").hidden = true;
  connect();
  startPolling();
});

// --------------------------------------------------------------------------------------------- chat
async function connect() {
  try {
    const cards = (await (await api("v1/models")).json()).data;
    model = cards[0].id;
    $("model-name").textContent = model;
    applyDefaults(cards[0].default_sampling_params || {}, cards[0].max_model_len);
    $("connection").textContent = "";
  } catch (error) {
    $("connection").textContent = error instanceof AuthError ? "API key needed" : `not connected: ${error.message}`;
  }
}

function applyDefaults(modelDefaults, maxModelLen) {
  // The model's generation config when the server has one, else the client defaults, as `pagedllm chat`; a
  // max_tokens past the context is cut to it (the server refuses to be asked for more, as vLLM's).
  const fromModel = Object.keys(modelDefaults).length > 0;
  const defaults = fromModel ? modelDefaults : CLIENT_DEFAULTS;
  if ($("temperature").value === "" && defaults.temperature !== undefined) $("temperature").value = defaults.temperature;
  if ($("top-p").value === "" && defaults.top_p !== undefined) $("top-p").value = defaults.top_p;
  if ($("max-tokens").value === "" && defaults.max_tokens !== undefined) {
    $("max-tokens").value = maxModelLen ? Math.min(defaults.max_tokens, maxModelLen) : defaults.max_tokens;
  }
  const listed = Object.entries(defaults).map(([name, value]) => `${name} ${value}`).join(", ");
  $("settings").dataset.defaults = `defaults: ${fromModel ? "the model's generation config" : "this page's"} (${listed})`;
  showSettings();
}

function samplingParams() {
  const params = {};
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  if (number("temperature") !== undefined) params.temperature = number("temperature");
  if (number("top-p") !== undefined) params.top_p = number("top-p");
  if (number("max-tokens") !== undefined) params.max_tokens = number("max-tokens");
  return params;
}

function showSettings() {
  const parts = Object.entries(samplingParams()).map(([name, value]) => `${name} ${value}`);
  const system = $("system-prompt").value.trim() ? ", system prompt set" : "";
  $("settings-line").textContent =
    `settings: ${parts.join(", ") || "the server's defaults"}${system} · ${$("settings").dataset.defaults || ""}`;
}
for (const id of ["temperature", "top-p", "max-tokens", "system-prompt"]) $(id).addEventListener("input", showSettings);

function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  element.textContent = text;
  $("messages").appendChild(element);
  $("messages").scrollTop = $("messages").scrollHeight;
  return element;
}

function setMeta(element, text) {
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = text;
  element.appendChild(meta);
}

async function send(text) {
  const system = $("system-prompt").value.trim();
  // This exchange's conversation: "New chat" replaces `conversation` while it may still be streaming, and the
  // answer must not land in the new one.
  const turns = conversation;
  turns.push({ role: "user", content: text });
  addMessage("user", text);
  const answer = addMessage("assistant", "");
  const messages = system ? [{ role: "system", content: system }, ...turns] : turns;
  streaming = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let content = "";
  let finishReason = null;
  try {
    const response = await api("v1/chat/completions", {
      method: "POST", signal: streaming.signal, headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model, messages, stream: true, ...samplingParams() }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error?.message || `HTTP ${response.status}`);
    }
    for await (const chunk of serverSentEvents(response)) {
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      content += choice.delta?.content || "";
      finishReason = choice.finish_reason || finishReason;
      answer.textContent = content;
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    setMeta(answer, `finish: ${finishReason}`);
  } catch (error) {
    if (error.name === "AbortError") {
      setMeta(answer, "stopped");
    } else {
      answer.classList.add("error");
      answer.textContent = content + (content ? "\n" : "") + `error: ${error.message}`;
    }
  } finally {
    // A stopped answer stays in the conversation as far as it went; a failed one takes its question back out.
    if (answer.classList.contains("error")) turns.pop();
    else turns.push({ role: "assistant", content });
    streaming = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// The `data:` payloads of an SSE response, parsed, until [DONE].
async function* serverSentEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new Error(parsed.error.message);
        yield parsed;
      }
    }
  }
}

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || streaming) return;
  $("chat-input").value = "";
  send(text);
});
$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => streaming?.abort());
$("clear").addEventListener("click", () => {
  streaming?.abort();
  conversation = [];
  $("messages").replaceChildren();
});

// -------------------------------------------------------------------------------------- engine view
// Polls once a second while the server answers; a 401 stops it until a key is given (the key form restarts it).
let polling = false;

function startPolling() {
  if (!polling) {
    polling = true;
    poll();
  }
}

async function poll() {
  try {
    const response = await api("engine/view");
    if (response.ok) render(await response.json());
  } catch (error) {
    if (error instanceof AuthError) polling = false;
    else $("connection").textContent = `engine view: ${error.message}`;
  }
  if (polling) setTimeout(poll, POLL_MS);
}

function sum(engines, field) {
  return engines.reduce((total, engine) => total + engine[field], 0);
}

function render(view) {
  const engines = view.engines;
  const now = { time: Math.max(...engines.map((e) => e.time)), steps: sum(engines, "num_steps"),
    tokens: sum(engines, "num_step_tokens"), queries: sum(engines, "prefix_cache_queries"),
    hits: sum(engines, "prefix_cache_hits") };
  $("stat-running").textContent = sum(engines, "num_running_reqs");
  $("stat-waiting").textContent = sum(engines, "num_waiting_reqs");
  $("stat-kv").textContent = `${(100 * sum(engines, "kv_cache_usage") / engines.length).toFixed(1)}%`;
  $("stat-preemptions").textContent = sum(engines, "num_preemptions");
  $("stat-prefix").textContent = now.queries ? `${(100 * now.hits / now.queries).toFixed(1)}%` : "–";
  if (previousView && now.time > previousView.time) {
    const seconds = now.time - previousView.time;
    const steps = now.steps - previousView.steps;
    const tokens = now.tokens - previousView.tokens;
    $("stat-steps").textContent = (steps / seconds).toFixed(1);
    $("stat-tokens").textContent = (tokens / seconds).toFixed(0);
    $("stat-tokens-per-step").textContent = steps ? (tokens / steps).toFixed(1) : "–";
    const queries = now.queries - previousView.queries;
    if (queries) $("stat-prefix").title = `last ${seconds.toFixed(1)} s: ${(100 * (now.hits - previousView.hits) / queries).toFixed(1)}%`;
  }
  previousView = now;
  renderBlockMaps(engines);
  renderRequests(engines);
}

function renderBlockMaps(engines) {
  const container = $("block-maps");
  while (container.children.length > engines.length) container.lastChild.remove();
  while (container.children.length < engines.length) container.appendChild(document.createElement("canvas"));
  const counts = { ".": 0, "c": 0, "u": 0, "s": 0 };
  engines.forEach((engine, i) => {
    drawBlockMap(container.children[i], engine.block_map);
    for (const state of engine.block_map) counts[state] += 1;
  });
  $("count-free").textContent = counts["."];
  $("count-cached").textContent = counts["c"];
  $("count-in-use").textContent = counts["u"];
  $("count-shared").textContent = counts["s"];
}

// One square a block, in block-id order, row by row: the cell size is the largest that fits every block in the
// canvas's width at about a 4:1 aspect.
function drawBlockMap(canvas, blockMap) {
  const width = canvas.clientWidth || 480;
  const n = blockMap.length;
  const cell = Math.max(2, Math.min(16, Math.floor(Math.sqrt((width * width / 4) / Math.max(n, 1)))));
  const columns = Math.max(1, Math.floor(width / cell));
  const rows = Math.ceil(n / columns);
  const scale = window.devicePixelRatio || 1;
  canvas.width = width * scale;
  canvas.height = rows * cell * scale;
  canvas.style.height = `${rows * cell}px`;
  canvas.dataset.blocks = n;
  const context = canvas.getContext("2d");
  context.scale(scale, scale);
  const style = getComputedStyle(document.documentElement);
  const colors = Object.fromEntries(Object.entries(BLOCK_COLORS).map(([k, v]) => [k, style.getPropertyValue(v)]));
  for (let i = 0; i < n; i++) {
    context.fillStyle = colors[blockMap[i]];
    context.fillRect((i % columns) * cell, Math.floor(i / columns) * cell, cell - (cell > 3 ? 1 : 0), cell - (cell > 3 ? 1 : 0));
  }
}

function progressCell(done, total, text) {
  const cell = document.createElement("td");
  const bar = document.createElement("span");
  bar.className = "bar";
  const fill = document.createElement("span");
  fill.style.width = `${total ? Math.min(100, 100 * done / total) : 0}%`;
  bar.appendChild(fill);
  cell.append(bar, text);
  return cell;
}

function textCell(text, className) {
  const cell = document.createElement("td");
  cell.textContent = text;
  if (className) cell.className = className;
  return cell;
}

function renderRequests(engines) {
  const rows = [];
  for (const engine of engines) {
    for (const request of [...engine.running, ...engine.waiting]) {
      const prefill = Math.min(request.num_computed_tokens, request.num_prompt_tokens);
      const state = request.status === "running"
        ? (request.num_computed_tokens < request.num_prompt_tokens ? "prefill" : "decode") : request.status;
      const row = document.createElement("tr");
      row.dataset.status = request.status;
      row.append(
        textCell(request.request_id, "id"), textCell(state),
        progressCell(prefill, request.num_prompt_tokens, `${prefill}/${request.num_prompt_tokens}`),
        progressCell(request.num_output_tokens, request.max_tokens,
          `${request.num_output_tokens}/${request.max_tokens || "∞"}`),
        textCell(request.num_blocks), textCell(request.num_cached_tokens || 0),
        textCell(request.num_preemptions || 0));
      row.firstChild.title = request.request_id;
      rows.push(row);
    }
  }
  $("requests").tBodies[0].replaceChildren(...rows);
}

// With --api-key the server marks the page; ask for the key before calling anything that would answer 401.
if (document.body.dataset.apiKeyRequired === "true" && !localStorage.getItem(KEY_STORAGE)) {
  $("key-form").hidden = false;
  $("connection").textContent = "API key needed";
} else {
  connect();
  startPolling();
}
