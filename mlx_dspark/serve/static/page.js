// The chat page of mlx-dspark: our streaming chat completions API, with each step's `dspark_step`
// extension marking who wrote each token. Model text only ever enters the page as text nodes.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null, key: sessionStorage.getItem("mlx-dspark-key") || "" };

function headers() {
  const h = { "Content-Type": "application/json", "X-DSpark-Marks": "1" };
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

// Markdown, safely: fenced code blocks, headings, paragraphs, inline code, bold and italics, all built
// as DOM nodes with textContent (never innerHTML).
function renderInline(parent, text) {
  const pattern = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\n]+\*)/g;
  let last = 0;
  for (const match of text.matchAll(pattern)) {
    if (match.index > last) parent.appendChild(document.createTextNode(text.slice(last, match.index)));
    const token = match[0];
    if (token.startsWith("`")) parent.appendChild(el("code", null, token.slice(1, -1)));
    else if (token.startsWith("**")) parent.appendChild(el("strong", null, token.slice(2, -2)));
    else parent.appendChild(el("em", null, token.slice(1, -1)));
    last = match.index + token.length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

function renderMarkdown(parent, text) {
  parent.replaceChildren();
  const lines = text.split("\n");
  let paragraph = [];
  const flush = () => {
    if (paragraph.length) {
      const p = el("div");
      renderInline(p, paragraph.join("\n"));
      parent.appendChild(p);
      paragraph = [];
    }
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    if (line.startsWith("```")) {
      flush();
      const code = [];
      for (i++; i < lines.length && !lines[i].startsWith("```"); i++) code.push(lines[i]);
      const pre = el("pre");
      pre.appendChild(el("code", null, code.join("\n")));
      parent.appendChild(pre);
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) {
      flush();
      const h = el("h" + Math.min(6, heading[1].length + 2));
      renderInline(h, heading[2]);
      parent.appendChild(h);
      continue;
    }
    paragraph.push(line);
  }
  flush();
}

function addMessage(role, text) {
  const box = el("div", "message " + role);
  box.appendChild(el("span", "role", role));
  const parts = { box, raw: el("div", "raw"), rendered: el("div", "rendered"), reasoning: null, calls: null };
  if (role === "user") {
    parts.rendered.textContent = text;
    parts.raw.textContent = text;
  }
  box.appendChild(parts.raw);
  box.appendChild(parts.rendered);
  $("messages").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return parts;
}

function appendMarked(raw, step) {
  let offset = 0;
  for (const [chars, origin] of step.marks) {
    const span = el("span", "o-" + origin, step.text.slice(offset, offset + chars));
    span.dataset.origin = origin;
    raw.appendChild(span);
    offset += chars;
  }
  if (offset < step.text.length) raw.appendChild(el("span", "o-target", step.text.slice(offset)));
}

function showStats(s) {
  const rounds = s.rounds;
  const mean = rounds ? (s.committed / rounds).toFixed(2) : "-";
  const tps = s.elapsed > 0 && s.tokens > 1 ? ((s.tokens - 1) / s.elapsed).toFixed(1) : "-";
  $("stats").textContent = `${s.tokens} tokens, ${tps} tok/s; ${rounds} rounds, mean acceptance ${mean}, ` +
    `draft length ${s.lastDraft}, ${s.parked} rounds parked; ` +
    `by origin: draft ${s.origins.draft || 0}, lookup ${s.origins.lookup || 0}, forced ${s.origins.forced || 0}, ` +
    `target ${s.origins.target || 0}`;
}

async function send(text) {
  $("error").textContent = "";
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  const system = $("system").value.trim();
  const body = {
    messages: (system ? [{ role: "system", content: system }] : []).concat(state.messages),
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  const stats = { tokens: 0, rounds: 0, committed: 0, parked: 0, lastDraft: "-", origins: {}, started: 0, elapsed: 0 };
  let content = "", reasoning = "", failed = false;
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      if (response.status === 401) $("settings").open = true;
      throw new Error((err.error && err.error.message) || response.statusText);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const step = chunk.dspark_step;
          if (step) {
            if (!stats.started) stats.started = performance.now();
            stats.elapsed = (performance.now() - stats.started) / 1000;
            stats.tokens += step.tokens;
            if (step.verified) {
              stats.rounds += 1;
              stats.committed += step.accepted + 1;
              stats.lastDraft = step.proposed;
              if (step.proposed === 0) stats.parked += 1;
            }
            const fromBlock = step.source && step.verified ? Math.min(step.accepted, step.tokens) : 0;
            if (fromBlock) stats.origins[step.source] = (stats.origins[step.source] || 0) + fromBlock;
            stats.origins.target = (stats.origins.target || 0) + step.tokens - fromBlock;
            appendMarked(reply.raw, step);
            showStats(stats);
          }
          const choice = chunk.choices && chunk.choices[0];
          const delta = choice && choice.delta;
          if (!delta) continue;
          if (delta.reasoning_content) {
            reasoning += delta.reasoning_content;
            if (!reply.reasoning) {
              reply.reasoning = el("div", "reasoning rendered");
              reply.box.insertBefore(reply.reasoning, reply.rendered);
            }
            reply.reasoning.textContent = reasoning;
          }
          if (delta.content) {
            content += delta.content;
            renderMarkdown(reply.rendered, content);
          }
          for (const call of delta.tool_calls || []) {
            if (call.function && call.function.name) {
              reply.calls = el("div", "tool-call rendered", "tool call: " + call.function.name + " ");
              reply.box.appendChild(reply.calls);
            }
            if (reply.calls && call.function && call.function.arguments) {
              reply.calls.appendChild(document.createTextNode(call.function.arguments));
            }
          }
          reply.box.scrollIntoView({ block: "end" });
        }
      }
    }
  } catch (err) {
    if (err.name !== "AbortError") {
      $("error").textContent = String(err.message || err);
      failed = true;
    }
  } finally {
    if (failed && !content) state.messages.pop();  // the turn never happened: the next send starts over
    else state.messages.push({ role: "assistant", content });
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) {
      $("model").textContent = "set the API key in Settings";
      $("settings").open = true;
      return;
    }
    const card = (await response.json()).data[0];
    $("model").textContent = card.id;
    if (card.max_model_len) $("context").textContent = `context ${card.max_model_len} tokens`;
  } catch (err) {
    $("model").textContent = "server not reachable";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = state.key;
  $("api-key").addEventListener("change", () => {
    state.key = $("api-key").value.trim();
    sessionStorage.setItem("mlx-dspark-key", state.key);
    loadModel();
  });
  $("marks").addEventListener("change", () => document.body.classList.toggle("no-marks", !$("marks").checked));
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    $("messages").replaceChildren();
    $("stats").textContent = "";
    $("error").textContent = "";
  });
  loadModel();
});
