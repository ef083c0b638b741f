// The chat playground: a conversation kept in the page, streamed from /v1/chat/completions
// (or /v1/completions in completion mode) as server-sent events. Stop aborts the fetch; the
// gateway sees the connection close and aborts the request in the cluster.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const state = { mode: "chat", messages: [], controller: null, noTemplate: new Set() };

  function notice(text, isError) {
    const n = $("notice");
    n.textContent = text || "";
    n.classList.toggle("hidden", !text);
    n.classList.toggle("error", !!isError);
  }

  function setMode(mode) {
    state.mode = mode;
    $("mode-chat").classList.toggle("on", mode === "chat");
    $("mode-completion").classList.toggle("on", mode === "completion");
    $("system-box").classList.toggle("hidden", mode !== "chat");
    $("prompt").placeholder = mode === "chat" ? "Message (Enter sends, Shift+Enter: new line)"
                                              : "Prompt to continue (Enter sends, Shift+Enter: new line)";
    document.body.dataset.mode = mode;
  }

  // a model pool's model: its state beside its name; choosing one that no worker holds loads it
  function modelLabel(m) {
    const st = m.state || "loaded";
    if (st === "loaded") return m.id + (m.groups !== undefined ? "  (" + m.groups + " groups)" : "");
    if (st === "failed") return m.id + "  (failed: " + (m.reason || "").slice(0, 80) + ")";
    return m.id + "  (" + st + (m.waiting ? ", " + m.waiting + " waiting" : "") + ")";
  }

  let modelsTimer = null;
  async function loadModels() {
    clearTimeout(modelsTimer);
    try {
      const j = await ZS.json("/v1/models");
      const sel = $("model"), prev = sel.value;
      sel.textContent = "";
      for (const m of j.data) {
        const o = ZS.el("option", "", modelLabel(m));
        o.value = m.id;
        o.dataset.state = m.state || "loaded";
        sel.appendChild(o);
      }
      if (prev && j.data.some((m) => m.id === prev)) sel.value = prev;
      const loaded = j.data.filter((m) => (m.state || "loaded") === "loaded").length;
      $("status").textContent = j.data.length ? j.data.length + " model(s), " + loaded + " loaded" : "no model served yet";
      // states change as the pool loads and unloads: look again while the page is open
      modelsTimer = setTimeout(loadModels, j.data.length ? 5000 : 2000);
    } catch (e) {
      $("status").textContent = "gateway: " + e.message;
      modelsTimer = setTimeout(loadModels, 3000);
    }
  }

  async function chooseModel() {
    const o = $("model").selectedOptions[0];
    if (!o || o.dataset.state === "loaded" || o.dataset.state === "loading") return;
    try {
      await ZS.json("/v1/models/load", { method: "POST", body: JSON.stringify({ model: o.value }) });
      $("status").textContent = "loading " + o.value + "...";
    } catch (e) {
      $("status").textContent = "load " + o.value + ": " + e.message;
    }
    loadModels();
  }

  function addMessage(role, text, raw) {
    const m = ZS.el("div", "msg " + role);
    m.appendChild(ZS.el("div", "who", role));
    const body = ZS.el("div", "body" + (raw ? " raw" : ""));
    if (text !== undefined) body.textContent = text;
    m.appendChild(body);
    const meta = ZS.el("div", "meta");
    m.appendChild(meta);
    $("log").appendChild(m);
    $("log").scrollTop = $("log").scrollHeight;
    return { el: m, body, meta };
  }

  function params() {
    const num = (id) => { const v = $(id).value.trim(); return v === "" ? undefined : Number(v); };
    const p = { model: $("model").value || undefined, stream: true, stream_options: { include_usage: true },
                temperature: num("temperature"), top_p: num("top_p"), max_tokens: num("max_tokens"),
                seed: num("seed") };
    const stop = $("stop").value.split(",").map((s) => s.replace(/\\n/g, "\n")).filter((s) => s.length);
    if (stop.length) p.stop = stop;
    return p;
  }

  // the events of one SSE response -> calls onEvent(json) per `data:` line, until [DONE]
  async function readEvents(resp, onEvent) {
    const reader = resp.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of ev.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          onEvent(JSON.parse(data));
        }
      }
    }
  }

  function busy(on) {
    $("send").disabled = on;
    $("stopbtn").disabled = !on;
  }

  // fallback: the text to send again as a completion (the notice that says why stays up)
  async function send(fallback) {
    const text = typeof fallback === "string" ? fallback : $("prompt").value;
    if (!text.trim() || state.controller) return;
    const model = $("model").value;
    if (state.mode === "chat" && state.noTemplate.has(model)) setMode("completion");
    $("prompt").value = "";
    if (typeof fallback !== "string") notice("");
    const chat = state.mode === "chat";
    const body = params();
    let path, asked = null;
    if (chat) {
      state.messages.push({ role: "user", content: text });
      asked = addMessage("user", text);
      const sys = $("system").value.trim();
      body.messages = (sys ? [{ role: "system", content: sys }] : []).concat(state.messages);
      path = "/v1/chat/completions";
    } else {
      addMessage("prompt", text, true);
      body.prompt = text;
      path = "/v1/completions";
    }
    const reply = addMessage(chat ? "assistant" : "completion", "", !chat);
    reply.el.dataset.state = "waiting";
    const ctl = state.controller = new AbortController();
    busy(true);
    const t0 = performance.now();
    let tFirst = null, tLast = null, chunks = 0, usage = null, finish = null, out = "";
    const show = () => {
      if (chat) reply.body.innerHTML = MD.render(out); else reply.body.textContent = out;
      $("log").scrollTop = $("log").scrollHeight;
    };
    const meta = (extra) => {
      const parts = [];
      if (tFirst !== null) parts.push("TTFT " + Math.round(tFirst - t0) + " ms");
      const n = usage ? usage.completion_tokens : chunks;
      if (n) parts.push(n + " tokens");
      if (n > 1 && tLast > tFirst) parts.push(((n - 1) / ((tLast - tFirst) / 1000)).toFixed(1) + " tokens/s");
      if (finish) parts.push("finish: " + finish);
      if (extra) parts.push(extra);
      reply.meta.textContent = parts.join(" · ");
    };
    try {
      const resp = await ZS.api(path, { method: "POST", body: JSON.stringify(body), signal: ctl.signal });
      if (!resp.ok) throw new Error(await ZS.errorText(resp));
      reply.el.dataset.state = "streaming";
      await readEvents(resp, (ev) => {
        if (ev.error) throw new Error(ev.error.message || JSON.stringify(ev.error));
        if (ev.usage) usage = ev.usage;
        const c = ev.choices && ev.choices[0];
        if (!c) return;
        const piece = chat ? (c.delta && c.delta.content) || "" : c.text || "";
        if (c.finish_reason) finish = c.finish_reason;
        if (piece) {
          const now = performance.now();
          if (tFirst === null) tFirst = now;
          tLast = now;
          chunks++;
          out += piece;
          show();
          meta();
        }
      });
      reply.el.dataset.state = "done";
      meta();
      if (chat) state.messages.push({ role: "assistant", content: out });
    } catch (e) {
      if (e.name === "AbortError") {
        reply.el.dataset.state = "stopped";
        meta("stopped");
        if (chat) state.messages.push({ role: "assistant", content: out });
      } else if (chat && /no chat template/i.test(e.message)) {
        // e.g. the built-in tiny model: say so and send the same text as a raw completion
        state.messages.pop();
        reply.el.remove();
        asked.el.remove();
        state.noTemplate.add(model);
        notice("The model " + model + " has no chat template, so this page switched to completion mode: the "
               + "text is continued as it is. (" + e.message + ")");
        setMode("completion");
        state.controller = null;
        busy(false);
        return send(text);
      } else {
        reply.el.dataset.state = "error";
        reply.meta.classList.add("error");
        meta("error: " + e.message);
        if (chat) state.messages.pop();
      }
    } finally {
      if (state.controller === ctl) { state.controller = null; busy(false); }
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    setMode("chat");
    $("mode-chat").addEventListener("click", () => setMode("chat"));
    $("mode-completion").addEventListener("click", () => setMode("completion"));
    $("send").addEventListener("click", () => send());
    $("stopbtn").addEventListener("click", () => state.controller && state.controller.abort());
    $("clear").addEventListener("click", () => {
      if (state.controller) state.controller.abort();
      state.messages = [];
      $("log").textContent = "";
      notice("");
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
    });
    $("model").addEventListener("change", chooseModel);
    ZS.onKey(loadModels);
    loadModels();
  });
})();
