// A small Markdown renderer for model replies: fenced code blocks, inline code, headings,
// bold / italic, lists, block quotes, links, paragraphs. The text is HTML-escaped before any
// markup is added, so a reply cannot inject elements; links keep only http(s) targets. It runs
// again on the whole reply at every streamed chunk: an open ``` fence renders as code so far.
"use strict";

const MD = (() => {
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);

  function inline(s) {  // s is escaped already
    const codes = [];
    s = s.replace(/`([^`\n]+)`/g, (_, c) => { codes.push(c); return "\u0000" + (codes.length - 1) + "\u0000"; });
    s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
      (_, t, u) => '<a href="' + u + '" rel="noopener noreferrer" target="_blank">' + t + "</a>");
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_\n]+)__/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>")
         .replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + codes[+i] + "</code>");
  }

  function render(text) {
    const lines = esc(text).split("\n");
    const out = [];
    let para = [], list = null;
    const flushPara = () => { if (para.length) out.push("<p>" + inline(para.join("<br>")) + "</p>"); para = []; };
    const flushList = () => { if (list) out.push("</" + list + ">"); list = null; };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+#.-]*)\s*$/);
      if (fence) {
        flushPara(); flushList();
        const code = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
        const lang = fence[1] ? ' class="lang-' + fence[1] + '"' : "";
        out.push("<pre><code" + lang + ">" + code.join("\n") + "</code></pre>");
        continue;
      }
      let m;
      if ((m = line.match(/^(#{1,6})\s+(.*)$/))) {
        flushPara(); flushList();
        const n = Math.min(m[1].length + 2, 6);  // h3..h6: a reply's heading is not the page's
        out.push("<h" + n + ">" + inline(m[2]) + "</h" + n + ">");
      } else if ((m = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/))) {
        flushPara();
        const kind = /\d/.test(m[1]) ? "ol" : "ul";
        if (list !== kind) { flushList(); out.push("<" + kind + ">"); list = kind; }
        out.push("<li>" + inline(m[2]) + "</li>");
      } else if ((m = line.match(/^&gt;\s?(.*)$/))) {
        flushPara(); flushList();
        out.push("<blockquote>" + inline(m[1]) + "</blockquote>");
      } else if (!line.trim()) {
        flushPara(); flushList();
      } else {
        if (list) flushList();
        para.push(line);
      }
    }
    flushPara(); flushList();
    return out.join("");
  }

  return { render, esc };
})();
