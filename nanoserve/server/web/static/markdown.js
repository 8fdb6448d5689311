/* A small Markdown renderer for model output: paragraphs, headings, emphasis, inline code, fenced
 * code blocks with a light syntax highlighter, lists (nested), block quotes, rules and links.
 *
 * Invariant: every character of the input reaches the output HTML-escaped; the only markup in the
 * output is the markup this file writes, and the only attribute values taken from the input are
 * http(s)/mailto link targets, escaped. So no input, however hostile, can add an element, an event
 * handler or a script URL. An unclosed code fence runs to the end (a reply still streaming).
 *
 * Exposes `window.NanoMarkdown = {render, highlight, escapeHtml}`.
 */
"use strict";

(() => {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

  // Private-use characters mark placeholders during inline rendering; the input never keeps them.
  const MARK = "\uE000";
  const MARK_RE = /\uE000(\d+)\uE000/g;

  /* ---- syntax highlighting ---- */

  const words = (s) => new Set(s.split(" "));
  const C_LIKE = { line: "//", block: true, strings: "\"'" };
  const LANGS = {
    python: { line: "#", strings: "\"'", triple: true,
      keywords: words("and as assert async await break class continue def del elif else except finally for from global if import in is lambda nonlocal not or pass raise return try while with yield match case"),
      literals: words("True False None self") },
    javascript: { ...C_LIKE, strings: "\"'`",
      keywords: words("async await break case catch class const continue default delete do else export extends finally for from function if import in instanceof let new of return static super switch this throw try typeof var void while yield interface type enum implements"),
      literals: words("true false null undefined NaN Infinity") },
    json: { strings: "\"", keywords: words(""), literals: words("true false null") },
    bash: { line: "#", strings: "\"'",
      keywords: words("if then else elif fi for in do done while until case esac function return local export set unset echo cd exit source"),
      literals: words("true false") },
    c: { ...C_LIKE,
      keywords: words("auto break case char const continue default do double else enum extern float for goto if inline int long register return short signed sizeof static struct switch typedef union unsigned void volatile while class namespace template typename public private protected virtual override new delete using constexpr auto bool include define"),
      literals: words("true false NULL nullptr this") },
    rust: { ...C_LIKE,
      keywords: words("as async await break const continue crate dyn else enum extern fn for if impl in let loop match mod move mut pub ref return static struct trait type unsafe use where while"),
      literals: words("true false self Self None Some Ok Err") },
    go: { ...C_LIKE, strings: "\"'`",
      keywords: words("break case chan const continue default defer else fallthrough for func go goto if import interface map package range return select struct switch type var"),
      literals: words("true false nil iota") },
    java: { ...C_LIKE,
      keywords: words("abstract boolean break byte case catch char class const continue default do double else enum extends final finally float for if implements import instanceof int interface long new package private protected public return short static super switch synchronized this throw throws try void volatile while var record"),
      literals: words("true false null") },
    sql: { line: "--", block: true, strings: "'\"",
      keywords: words("select from where and or not insert into values update set delete create table drop alter join left right inner outer on group by order having limit offset as distinct union all in is like between case when then else end primary key index"),
      literals: words("null true false"), caseless: true },
  };
  const ALIASES = { py: "python", js: "javascript", ts: "javascript", typescript: "javascript", jsx: "javascript",
    tsx: "javascript", sh: "bash", shell: "bash", console: "bash", zsh: "bash", cpp: "c", "c++": "c", h: "c",
    hpp: "c", cc: "c", cuda: "c", rs: "rust", golang: "go", kotlin: "java", jsonc: "json" };

  const reEscape = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

  /** The token pattern of a language: comments, strings, numbers, words, anything else. */
  function tokenPattern(lang) {
    const parts = [];
    if (lang.block) parts.push("(?<com>/\\*[\\s\\S]*?(?:\\*/|$)" + (lang.line ? "|" + reEscape(lang.line) + ".*" : "") + ")");
    else if (lang.line) parts.push("(?<com>" + reEscape(lang.line) + ".*)");
    const strs = [];
    if (lang.triple) strs.push('"""[\\s\\S]*?(?:"""|$)', "'''[\\s\\S]*?(?:'''|$)");
    for (const q of lang.strings) {
      const e = reEscape(q);
      strs.push(q === "`" ? "`(?:\\\\[\\s\\S]|[^`\\\\])*`?" : `${e}(?:\\\\.|[^${e}\\\\\\n])*${e}?`);
    }
    parts.push(`(?<str>${strs.join("|")})`);
    parts.push("(?<num>\\b(?:0[xX][\\da-fA-F_]+|\\d[\\d_]*(?:\\.\\d+)?(?:[eE][+-]?\\d+)?)\\b)");
    parts.push("(?<word>[A-Za-z_$][\\w$]*)");
    return new RegExp(parts.join("|"), "g");
  }

  /** `code` as HTML with spans (tok-com, tok-str, tok-num, tok-kw, tok-lit, tok-fn); plain
   *  escaped text for a language it does not know. */
  function highlight(code, langName) {
    const name = (langName || "").toLowerCase();
    const lang = LANGS[ALIASES[name] || name];
    if (!lang) return escapeHtml(code);
    const re = tokenPattern(lang);
    let out = "", last = 0, m;
    while ((m = re.exec(code)) !== null) {
      if (m[0] === "") { re.lastIndex++; continue; }
      out += escapeHtml(code.slice(last, m.index));
      last = m.index + m[0].length;
      const g = m.groups;
      let cls = g.com ? "com" : g.str ? "str" : g.num ? "num" : null;
      if (g.word) {
        const w = lang.caseless ? g.word.toLowerCase() : g.word;
        cls = lang.keywords.has(w) ? "kw" : lang.literals.has(w) ? "lit" : /^\s*\(/.test(code.slice(last)) ? "fn" : null;
      }
      out += cls ? `<span class="tok-${cls}">${escapeHtml(m[0])}</span>` : escapeHtml(m[0]);
    }
    return out + escapeHtml(code.slice(last));
  }

  /* ---- inline ---- */

  const SAFE_URL = /^(?:https?:\/\/|mailto:)/i;

  function emphasis(s) {
    return s
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  }

  /** One block's text as inline HTML: escaped first, then code spans and links are set aside
   *  as placeholders (so emphasis never reaches into them), then emphasis, then they go back. */
  function inline(text) {
    const held = [];
    const hold = (html) => `${MARK}${held.push(html) - 1}${MARK}`;
    let s = escapeHtml(text);
    s = s.replace(/(`+)(?!`)([\s\S]*?[^`])\1(?!`)/g, (_, _ticks, code) => hold(`<code>${code.trim() || code}</code>`));
    s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (all, label, url) => {
      const target = url.replace(/&amp;/g, "&");
      if (!SAFE_URL.test(target)) return label;
      return hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`);
    });
    s = s.replace(/(^|[\s(])(https?:\/\/[^\s<]*[^\s<.,;:!?)"'])/g, (_, pre, url) =>
      pre + hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${url}</a>`));
    s = emphasis(s);
    // A placeholder may sit inside another held piece (code in a link label), so restore until stable.
    for (let depth = 0; s.includes(MARK) && depth < 3; depth++) s = s.replace(MARK_RE, (_, i) => held[Number(i)]);
    return s;
  }

  /* ---- blocks ---- */

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}>\s?/;
  const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const BLANK = /^\s*$/;

  const startsBlock = (line) => FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    ITEM.test(line);

  function codeBlock(code, lang) {
    const label = lang ? `<span class="code-lang">${escapeHtml(lang)}</span>` : "<span></span>";
    return `<div class="codeblock"><div class="code-head">${label}<button type="button" class="copy">Copy</button>` +
      `</div><pre><code${lang ? ` class="lang-${escapeHtml(lang)}"` : ""}>${highlight(code, lang)}</code></pre></div>`;
  }

  /** Lines of a list starting at `start`: [html, next line index]. */
  function list(lines, start) {
    const first = ITEM.exec(lines[start]);
    const ordered = /\d/.test(first[2]);
    const items = [];
    let i = start;
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || /\d/.test(m[2]) !== ordered) break;
      const indent = m[1].length + m[2].length + 1;
      const body = [m[3]];
      i++;
      while (i < lines.length) {
        const line = lines[i];
        if (BLANK.test(line)) {
          const next = lines[i + 1];
          if (next !== undefined && /^\s{2,}\S/.test(next)) { body.push(""); i++; continue; }
          break;
        }
        if (/^\s{2,}\S/.test(line)) body.push(line.slice(Math.min(indent, line.length - line.trimStart().length)));
        else if (ITEM.test(line) || startsBlock(line)) break;
        else body.push(line.trim());
        i++;
      }
      items.push(body);
      if (i < lines.length && BLANK.test(lines[i]) && ITEM.test(lines[i + 1] || "")) i++;
    }
    const start1 = ordered ? parseInt(first[2], 10) : 1;
    const tag = ordered ? "ol" : "ul";
    const attrs = ordered && start1 !== 1 ? ` start="${start1}"` : "";
    const html = items.map((body) => {
      const inner = blocks(body);
      return `<li>${inner.startsWith("<p>") && inner.indexOf("<p>", 1) < 0 ? inner.slice(3).replace(/<\/p>/, "") : inner}</li>`;
    }).join("");
    return [`<${tag}${attrs}>${html}</${tag}>`, i];
  }

  function blocks(lines) {
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (BLANK.test(line)) { i++; continue; }
      if ((m = FENCE.exec(line))) {
        const close = new RegExp(`^ {0,3}${m[1][0] === "`" ? "`" : "~"}{${m[1].length},}\\s*$`);
        const body = [];
        for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
        i++;
        out.push(codeBlock(body.join("\n"), m[2]));
      } else if ((m = HEADING.exec(line))) {
        const level = m[1].length;
        out.push(`<h${level}>${inline(m[2])}</h${level}>`);
        i++;
      } else if (RULE.test(line)) {
        out.push("<hr>");
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) body.push(lines[i].replace(QUOTE, ""));
        out.push(`<blockquote>${blocks(body)}</blockquote>`);
      } else if (ITEM.test(line)) {
        const [html, next] = list(lines, i);
        out.push(html);
        i = next;
      } else {
        const para = [line.trim()];
        for (i++; i < lines.length && !BLANK.test(lines[i]) && !startsBlock(lines[i]); i++) para.push(lines[i].trim());
        out.push(`<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`);
      }
    }
    return out.join("");
  }

  /** Markdown `text` as safe HTML (see the invariant at the top of this file). */
  function render(text) {
    const clean = String(text).replace(/\r\n?/g, "\n").replace(/[\uE000\u0000]/g, "");
    return blocks(clean.split("\n"));
  }

  window.NanoMarkdown = Object.freeze({ render, highlight, escapeHtml });
})();
