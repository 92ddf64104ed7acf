// The kronk_wsgi console: a client of the server's public API (and its admin API), nothing more.
"use strict";

const base = location.pathname.replace(/\/console(\/.*)?$/, "");
const $ = (id) => document.getElementById(id);
const conversation = [];
let running = null; // the AbortController of the reply being streamed

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (e) {
    return response.statusText;
  }
}

// Server-Sent Events from a fetch response: calls onEvent(name, data) for each event.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of frame.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data.push(line.slice(6));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;
  $("transcript").appendChild(div);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return div;
}

async function loadModels() {
  try {
    const response = await fetch(base + "/v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorText(response));
    const list = (await response.json()).data;
    const select = $("model");
    const chosen = select.value;
    // A model with a projector says so: it takes images (through the APIs; the console sends text).
    const reads = (m) => ((m.architecture || {}).input_modalities || []).filter((kind) => kind !== "text");
    select.replaceChildren(...list.map((m) => new Option(
      reads(m).length ? `${m.id} (takes ${reads(m).join(", ")})` : m.id, m.id)));
    if (list.some((m) => m.id === chosen)) select.value = chosen;
    $("status").textContent = "";
  } catch (e) {
    $("status").textContent = "models: " + e.message;
  }
}

async function loadAdminModels() {
  const response = await fetch(base + "/admin/models", { headers: headers() });
  if (!response.ok) {
    $("models-note").textContent = "The admin API answered: " + (await errorText(response));
    return;
  }
  const body = await response.json();
  $("models").replaceChildren(...body.data.map((m) => {
    const row = document.createElement("tr");
    const state = m.loaded
      ? `yes, ${m.memory_mb} MB, ${m.busy_slots}/${m.slots} slots busy, ${m.queued} queued`
      : (m.load_error ? "failed: " + m.load_error : "no");
    for (const text of [m.id, m.source, state]) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.appendChild(cell);
    }
    const cell = document.createElement("td");
    if (m.loaded) {
      const button = document.createElement("button");
      button.className = "secondary";
      button.textContent = "Unload";
      button.onclick = async () => {
        const r = await fetch(base + "/admin/models/" + encodeURIComponent(m.id) + "/unload", { method: "POST", headers: headers() });
        $("models-note").textContent = r.ok ? `${m.id} unloaded` : await errorText(r);
        loadAdminModels();
      };
      cell.appendChild(button);
    }
    row.appendChild(cell);
    return row;
  }));
  const b = body.budget;
  $("models-note").textContent = `Budget: ${b.max_loaded_models ?? "any number of"} models, ` +
    `${b.max_memory_mb ? b.max_memory_mb + " MB" : "no memory limit"}, ` +
    `idle unload ${b.idle_unload_seconds ? "after " + b.idle_unload_seconds + " s" : "off"}.`;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = {
    model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  return body;
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || running) return;
  $("prompt").value = "";
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  const thinking = document.createElement("div");
  const answer = document.createElement("span");
  const meta = document.createElement("div");
  thinking.className = "thinking";
  meta.className = "meta";
  thinking.hidden = true;
  bubble.append(thinking, answer, meta);
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let reply = "";
  let finish = "";
  const started = performance.now();
  try {
    const response = await fetch(base + "/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: running.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) meta.textContent = `${chunk.usage.completion_tokens} tokens in ` +
        `${((performance.now() - started) / 1000).toFixed(1)} s, finish: ${finish}`;
      for (const choice of chunk.choices) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) {
          thinking.hidden = false;
          thinking.textContent += delta.reasoning_content;
        }
        if (delta.content) {
          reply += delta.content;
          answer.textContent = reply;
          $("transcript").scrollTop = $("transcript").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
  } catch (e) {
    if (e.name === "AbortError") {
      meta.textContent = "stopped";
    } else {
      bubble.classList.add("error");
      meta.textContent = e.message;
    }
  } finally {
    conversation.push({ role: "assistant", content: reply });
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    loadAdminModels();
  }
}

async function pull() {
  const repo = $("pull-repo").value.trim();
  if (!repo) return;
  const bar = $("pull-progress");
  $("pull").disabled = true;
  $("pull-note").textContent = "looking up " + repo;
  try {
    const body = { repo_id: repo };
    if ($("pull-file").value.trim()) body.file = $("pull-file").value.trim();
    const response = await fetch(base + "/admin/pull", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!response.ok) throw new Error(await errorText(response));
    bar.hidden = false;
    bar.value = 0;
    await readEvents(response, (name, data) => {
      const event = JSON.parse(data);
      if (name === "start") $("pull-note").textContent = "pulling " + event.file;
      if (name === "progress" && event.total) {
        bar.value = event.done / event.total;
        $("pull-note").textContent = `${(event.done / 1e6).toFixed(1)} of ${(event.total / 1e6).toFixed(1)} MB`;
      }
      if (name === "done") {
        bar.value = 1;
        $("pull-note").textContent = "done: " + event.path;
      }
      if (name === "error") throw new Error(event.error.message);
    });
  } catch (e) {
    $("pull-note").textContent = "pull failed: " + e.message;
  } finally {
    $("pull").disabled = false;
  }
}

$("api-key").value = localStorage.getItem("kronk-api-key") || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem("kronk-api-key", $("api-key").value.trim());
  loadModels();
  loadAdminModels();
});
$("send").onclick = send;
$("stop").onclick = () => running && running.abort();
$("clear").onclick = () => { conversation.length = 0; $("transcript").replaceChildren(); };
$("pull").onclick = pull;
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    send();
  }
});
loadModels();
loadAdminModels();
setInterval(loadAdminModels, 5000);
