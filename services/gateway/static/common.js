// Shared by both console pages: the API key (kept in this browser's localStorage, sent as a
// Bearer token, asked for when the gateway answers 401) and fetch helpers.
"use strict";

const ZS = (() => {
  const KEY = "zeroserve.apiKey";
  const listeners = [];

  function key() { return localStorage.getItem(KEY) || ""; }

  function headers(extra) {
    const h = Object.assign({ "Content-Type": "application/json" }, extra || {});
    if (key()) h.Authorization = "Bearer " + key();
    return h;
  }

  // the key bar: shown when the gateway refused our key (or there is none and it wants one)
  function askKey(message) {
    const bar = document.getElementById("keybar");
    bar.classList.remove("hidden");
    document.getElementById("keymsg").textContent = message;
    document.getElementById("key").focus();
  }

  function initKeyBar() {
    const bar = document.getElementById("keybar");
    const input = document.getElementById("key");
    const save = () => {
      localStorage.setItem(KEY, input.value.trim());
      bar.classList.add("hidden");
      listeners.forEach((f) => f());
    };
    document.getElementById("keysave").addEventListener("click", save);
    input.addEventListener("keydown", (e) => { if (e.key === "Enter") save(); });
  }

  // an error body of the gateway (OpenAI's shape) -> its message
  async function errorText(resp) {
    try {
      const j = await resp.json();
      return (j.error && j.error.message) || JSON.stringify(j);
    } catch (_) {
      return resp.status + " " + resp.statusText;
    }
  }

  async function api(path, opts) {
    const o = Object.assign({}, opts || {});
    o.headers = headers(o.headers);
    const resp = await fetch(path, o);
    if (resp.status === 401) {
      askKey("This gateway needs an API key (its --api-key): " + (await errorText(resp.clone())));
    }
    return resp;
  }

  async function json(path, opts) {
    const resp = await api(path, opts);
    if (!resp.ok) throw new Error(await errorText(resp));
    return resp.json();
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  document.addEventListener("DOMContentLoaded", initKeyBar);
  return { api, json, el, errorText, onKey: (f) => listeners.push(f) };
})();
