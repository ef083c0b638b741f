// The live cluster view: polls /api/cluster (the scheduler's stats) every POLL_MS and keeps the
// last WINDOW_S seconds of samples in the page. Rates (tokens/s, steps/s) and the TTFT are
// differences of the scheduler's totals between samples. A group the scheduler no longer lists
// (dead or gone: it drops them after their heartbeat timeout) stays GONE_KEEP_S, marked gone.
"use strict";

(() => {
  const POLL_MS = 1000, WINDOW_S = 300, RATE_S = 5, GONE_KEEP_S = 60;
  const $ = (id) => document.getElementById(id);
  const samples = [];  // {t, stats}
  const gone = new Map();  // group name -> {group, since}
  let timer = null;

  const fmt = (v, d) => (v === null || v === undefined || Number.isNaN(v) ? "–" : (+v).toFixed(d || 0));
  const ms = (s) => (s === null || s === undefined ? "–" : Math.round(s * 1000) + " ms");
  const dur = (s) => (s < 120 ? Math.round(s) + " s" : s < 7200 ? Math.round(s / 60) + " min" : (s / 3600).toFixed(1) + " h");

  // the sample about RATE_S before the newest (for rates that do not jump at every poll)
  function earlier(span) {
    const last = samples[samples.length - 1];
    for (let i = samples.length - 2; i >= 0; i--) if (last.t - samples[i].t >= span) return samples[i];
    return samples.length > 1 ? samples[0] : null;
  }

  function groupRate(name, field, span) {
    const a = earlier(span), b = samples[samples.length - 1];
    if (!a) return null;
    const ga = a.stats.groups.find((g) => g.name === name), gb = b.stats.groups.find((g) => g.name === name);
    if (!ga || !gb || b.t <= a.t) return null;
    return Math.max(0, (gb[field] - ga[field]) / (b.t - a.t));
  }

  function card(k, v, id) {
    const c = ZS.el("div", "card");
    c.appendChild(ZS.el("div", "k", k));
    const val = ZS.el("div", "v", v);
    if (id) c.dataset.card = id;
    c.appendChild(val);
    return c;
  }

  function renderCards(s) {
    const m = s.metrics || {};
    const a = earlier(RATE_S), b = samples[samples.length - 1];
    let tps = s.tokens_per_s, ttft = null;
    if (a && b.t > a.t) {
      const ma = a.stats.metrics || {};
      const n = (m.ttft_count || 0) - (ma.ttft_count || 0);
      if (n > 0) ttft = ((m.ttft_sum_s || 0) - (ma.ttft_sum_s || 0)) / n;
    }
    const ready = s.groups.filter((g) => g.state === "ready").length;
    const cards = $("cards");
    cards.textContent = "";
    cards.append(
      card("worker groups ready", ready + " / " + s.groups.length, "groups"),
      card("requests running", fmt(s.requests), "requests"),
      card("scheduler queue", fmt(s.queue), "queue"),
      card("tokens/s (10 s)", fmt(tps, 1), "tps"),
      card("TTFT (last " + RATE_S + " s)", ttft === null ? ms(m.ttft_mean_s) : ms(ttft), "ttft"),
      card("finished / aborted", fmt(m.requests_finished) + " / " + fmt(m.requests_aborted), "finished"),
      card("admission refusals", fmt(m.refused), "refused"),
      card("failovers", fmt(m.requeued), "failovers"),
    );
  }

  function shardsCell(g) {
    const td = ZS.el("td", "shards");
    for (const w of g.workers || []) {
      // a pipeline-parallel group's shards name their stage (its layers live on that host)
      const stage = (g.pp_size || 1) > 1 ? " stage " + w.stage : "";
      const line = ZS.el("div", "", "r" + w.rank + stage + " " + w.worker_id + " @ " + w.host + " (pid " + w.pid + ", "
        + w.device + (w.heartbeat_age_s !== undefined ? ", seen " + fmt(w.heartbeat_age_s, 1) + " s ago" : "") + ")");
      td.appendChild(line);
    }
    return td;
  }

  function kvCell(g) {
    const td = ZS.el("td", "num");
    if (g.kv_blocks_total === undefined) { td.textContent = "–"; return td; }
    td.textContent = g.kv_blocks_used + " / " + g.kv_blocks_total;
    const bar = ZS.el("div", "bar"), fill = ZS.el("div");
    fill.style.width = (100 * g.kv_blocks_used / Math.max(1, g.kv_blocks_total)).toFixed(1) + "%";
    bar.appendChild(fill);
    td.appendChild(bar);
    return td;
  }

  function renderGroups(s, now) {
    const listed = new Set(s.groups.map((g) => g.name));
    const prev = samples.length > 1 ? samples[samples.length - 2].stats.groups : [];
    for (const g of prev) if (!listed.has(g.name) && !gone.has(g.name)) gone.set(g.name, { group: g, since: now });
    for (const [name, v] of gone) if (listed.has(name) || now - v.since > GONE_KEEP_S) gone.delete(name);
    const body = $("groups");
    body.textContent = "";
    const rows = [...s.groups].sort((a, b) => (a.name < b.name ? -1 : 1)).map((g) => [g, g.state]).concat([...gone.values()].map((v) => [v.group, "gone"]));
    for (const [g, st] of rows) {
      const tr = ZS.el("tr");
      tr.dataset.group = g.name;
      tr.dataset.state = st;
      tr.appendChild(ZS.el("td", "", g.name));
      const stc = ZS.el("td");
      stc.appendChild(ZS.el("span", "state " + st, st));
      tr.appendChild(stc);
      tr.appendChild(ZS.el("td", "", g.model));
      tr.appendChild(ZS.el("td", "num", fmt(g.tp_size)));
      tr.appendChild(shardsCell(g));
      tr.appendChild(kvCell(g));
      const live = st !== "gone";
      tr.appendChild(ZS.el("td", "num", fmt(g.running)));
      tr.appendChild(ZS.el("td", "num", fmt(g.waiting)));
      tr.appendChild(ZS.el("td", "num", live ? fmt(groupRate(g.name, "steps", RATE_S), 1) : "–"));
      tr.appendChild(ZS.el("td", "num", live ? fmt(groupRate(g.name, "tokens", RATE_S), 1) : "–"));
      body.appendChild(tr);
    }
    if (!rows.length) {
      const tr = ZS.el("tr"), td = ZS.el("td", "", "no worker group has joined yet");
      td.colSpan = 10;
      tr.appendChild(td);
      body.appendChild(tr);
    }
  }

  function renderServices(s) {
    const body = $("services");
    body.textContent = "";
    const row = (k, v, id) => {
      const tr = ZS.el("tr");
      if (id) tr.dataset.row = id;
      tr.append(ZS.el("th", "", k), ZS.el("td", "", v));
      body.appendChild(tr);
    };
    const d = s.detokenizer || {};
    row("detokenizer", d.connected ? "connected (" + d.worker_id + ")" : "NOT connected", "detokenizer");
    row("scheduler", s.scheduler_id + ", up " + dur(s.uptime_s || 0), "scheduler");
    const pool = s.pool || {};
    const states = pool.models || {};
    row("models", (s.models || []).map((n) => states[n] ? n + " (" + states[n].state + ")" : n).join(", ") || "–",
        "models");
    if ((pool.members || []).length) {
      // which pool member holds which model, and the loads in progress
      row("model pool", pool.members.map((m) => m.worker_id + ": " + m.state + (m.model ? " " + m.model : "")
          + (m.state === "loading" || m.state === "unloading" ? " (" + dur(m.for_s || 0) + ")" : "")).join("  ·  "),
          "pool");
    }
    row("addresses", Object.entries(s.addresses || {}).map(([k, v]) => k + " " + v).join("  ·  ") || "–");
    const m = s.metrics || {};
    row("latency (mean since start)", "queue " + ms(m.queue_mean_s) + " · TTFT " + ms(m.ttft_mean_s) + " · inter-token "
        + ms(m.itl_mean_s) + " · end-to-end " + ms(m.e2e_mean_s));
    row("tokens", "prompt " + fmt(m.prompt_tokens) + " · generated " + fmt(m.generation_tokens) + " · prefix cache hit rate "
        + (m.prefix_cache_hit_rate === null || m.prefix_cache_hit_rate === undefined ? "–"
          : Math.round(100 * m.prefix_cache_hit_rate) + "%") + " · preemptions " + fmt(m.preemptions));
  }

  function renderCharts(now) {
    // the x axis spans what the page has seen, from 30 s up to WINDOW_S: a page just opened has a chart to look at
    const span = Math.min(WINDOW_S, Math.max(30, now - samples[0].t));
    const names = [];
    for (const sm of samples) for (const g of sm.stats.groups) if (!names.includes(g.name)) names.push(g.name);
    names.sort();
    const pts = (f) => samples.map((sm, i) => [sm.t, i ? f(samples[i - 1], sm) : null]);
    const perGroup = (field) => names.map((n) => ({ name: n, points: pts((a, b) => {
      const ga = a.stats.groups.find((g) => g.name === n), gb = b.stats.groups.find((g) => g.name === n);
      return ga && gb && b.t > a.t ? Math.max(0, (gb[field] - ga[field]) / (b.t - a.t)) : null;
    }) }));
    const total = { name: "cluster", points: pts((a, b) => (b.t > a.t
      ? Math.max(0, (b.stats.tokens_total - a.stats.tokens_total) / (b.t - a.t)) : null)) };
    Charts.line($("chart-tps"), $("legend-tps"), [total].concat(names.length > 1 ? perGroup("tokens") : []), now, span);
    const ttft = { name: "TTFT", points: pts((a, b) => {
      const ma = a.stats.metrics || {}, mb = b.stats.metrics || {};
      const n = (mb.ttft_count || 0) - (ma.ttft_count || 0);
      return n > 0 ? 1000 * ((mb.ttft_sum_s || 0) - (ma.ttft_sum_s || 0)) / n : null;
    }) };
    Charts.line($("chart-ttft"), $("legend-ttft"), [ttft], now, span);
    const kv = names.map((n) => ({ name: n, points: samples.map((sm) => {
      const g = sm.stats.groups.find((x) => x.name === n);
      return [sm.t, g && g.kv_blocks_total ? 100 * g.kv_blocks_used / g.kv_blocks_total : null];
    }) }));
    Charts.line($("chart-kv"), $("legend-kv"), kv, now, span, 100);
  }

  async function poll() {
    try {
      const resp = await ZS.api("/api/cluster");
      if (!resp.ok) throw new Error(await ZS.errorText(resp));
      const j = await resp.json();
      samples.push({ t: j.time, stats: j.stats });
      while (samples.length && j.time - samples[0].t > WINDOW_S + 5) samples.shift();
      $("notice").classList.add("hidden");
      $("status").textContent = "updated " + new Date(j.time * 1000).toLocaleTimeString();
      document.body.dataset.polls = String(+(document.body.dataset.polls || 0) + 1);
      renderCards(j.stats);
      renderGroups(j.stats, j.time);
      renderServices(j.stats);
      renderCharts(j.time);
    } catch (e) {
      $("notice").textContent = "Cannot read the cluster's state: " + e.message;
      $("notice").classList.remove("hidden");
      $("status").textContent = "not updating";
    } finally {
      timer = setTimeout(poll, POLL_MS);
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    ZS.onKey(() => { clearTimeout(timer); poll(); });
    poll();
  });
})();
