// Hand-written SVG line charts for the cluster page: time on x (the last windowS seconds),
// one path per series, a few grid lines with their values. Redrawn whole at every poll.
"use strict";

const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#2f6fdf", "#1f9d55", "#d64545", "#c98a06", "#8e44ad", "#16a2b8", "#e67e22", "#7f8c8d"];

  const assigned = new Map();  // series name -> colour, the same in every chart and over time
  const colorOf = (name) => {
    if (!assigned.has(name)) assigned.set(name, COLORS[assigned.size % COLORS.length]);
    return assigned.get(name);
  };

  function node(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  function nice(max) {  // a round upper bound for the y axis
    if (!(max > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(max)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= max) return m * p;
    return 10 * p;
  }

  // series: [{name, points: [[t, v|null], ...]}]; now: the x axis' right end (seconds)
  function line(svg, legend, series, now, windowS, fixedMax) {
    const w = svg.clientWidth || 320, h = svg.clientHeight || 120, left = 34, bottom = 14;
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    svg.textContent = "";
    let max = 0;
    for (const s of series) for (const [, v] of s.points) if (v !== null && v > max) max = v;
    const top = fixedMax || nice(max);
    const x = (t) => left + (w - left - 4) * (1 - (now - t) / windowS);
    const y = (v) => 4 + (h - 4 - bottom) * (1 - Math.min(v, top) / top);
    for (let i = 0; i <= 2; i++) {
      const v = top * i / 2;
      node("line", { class: "grid", x1: left, x2: w - 4, y1: y(v), y2: y(v) }, svg);
      const label = node("text", { class: "axis", x: left - 4, y: y(v) + 3, "text-anchor": "end" }, svg);
      label.textContent = v >= 100 ? Math.round(v) : +v.toFixed(1);
    }
    for (const s of [windowS, windowS / 2, 0]) {
      const label = node("text", { class: "axis", x: x(now - s), y: h - 2, "text-anchor": s ? "middle" : "end" }, svg);
      label.textContent = !s ? "now" : s < 120 ? "-" + Math.round(s) + " s" : "-" + Math.round(s / 6) / 10 + " min";
    }
    legend.textContent = "";
    series.forEach((s) => {
      const color = colorOf(s.name);
      let d = "", pen = false;
      const pts = s.points.filter(([t]) => now - t <= windowS);
      pts.forEach(([t, v], j) => {
        if (v === null) { pen = false; return; }
        d += (pen ? "L" : "M") + x(t).toFixed(1) + " " + y(v).toFixed(1);
        const alone = !pen && (j + 1 >= pts.length || pts[j + 1][1] === null);
        if (alone) node("circle", { cx: x(t), cy: y(v), r: 2.5, fill: color }, svg);  // no line to draw
        pen = true;
      });
      if (d) node("path", { d, stroke: color }, svg);
      const item = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = color;  // CSSOM, allowed under the page's CSP (no inline style attribute)
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(s.name));
      legend.appendChild(item);
    });
  }

  return { line };
})();
