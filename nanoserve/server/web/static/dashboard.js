// The engine dashboard: reads /dashboard/stats (SSE, read with fetch so that it can send the API
// key) and draws the latest record at most once per animation frame, only when a new one came.
// Records arrive a few times a second; the page keeps the last HISTORY of them for its charts.
"use strict";

const KEY_STORAGE = "nanoserve.apiKey";
const HISTORY = 300;           // records kept for the sparklines (~60 s at 5 records/s)
const STEP_HISTORY = 160;      // steps kept for the step-composition chart
const STATE_COLORS = ["--free", "--used", "--cached", "--pinned"];

const $ = (id) => document.getElementById(id);
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

const view = { latest: null, history: [], steps: [], dirty: false, pixels: null, expertTokens: null };

// ---- the stream --------------------------------------------------------------------------------

async function connect() {
  const key = localStorage.getItem(KEY_STORAGE);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  let response;
  try {
    response = await fetch("/dashboard/stats", { headers, cache: "no-store" });
  } catch (e) {
    return retry("server unreachable");
  }
  if (response.status === 401) {
    setStatus(key ? "wrong API key" : "API key needed", "error");
    $("key-form").hidden = false;
    $("key-input").focus();
    return;  // the form reconnects
  }
  if (!response.ok || !response.body) return retry(`error ${response.status}`);
  $("key-form").hidden = true;
  setStatus("live", "live");
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) receive(JSON.parse(line.slice(6)));
        }
      }
    }
  } catch (e) {
    // the connection dropped: retried below
  }
  retry("disconnected");
}

function retry(why) {
  setStatus(`${why}; retrying`, "error");
  setTimeout(connect, 1000);
}

function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = `status ${cls || ""}`;
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  localStorage.setItem(KEY_STORAGE, $("key-input").value.trim());
  $("key-form").hidden = true;
  setStatus("connecting…");
  connect();
});

function receive(record) {
  view.latest = record;
  view.history.push(record);
  if (view.history.length > HISTORY) view.history.splice(0, view.history.length - HISTORY);
  view.steps.push(...record.steps);
  if (view.steps.length > STEP_HISTORY) view.steps.splice(0, view.steps.length - STEP_HISTORY);
  if (!view.dirty) {
    view.dirty = true;
    requestAnimationFrame(draw);
  }
}

// ---- drawing -----------------------------------------------------------------------------------

function draw() {
  view.dirty = false;
  const r = view.latest;
  drawTiles(r);
  drawBlocks(r.blocks);
  drawSteps(r.limits.max_num_batched_tokens);
  drawExperts(r.experts);
  drawTree(r.tree);
  drawSparkTput();
  drawSparkLatency(r.latency.window_s);
  drawQueues(r);
}

/** A canvas sized to its CSS width at the device's pixel ratio; returns its 2D context and size. */
function surface(id, height) {
  const canvas = $(id);
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = height ?? canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    canvas.style.height = `${h}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  return { ctx, w, h };
}

const hexRgb = (hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));

const fmt = (x, digits = 0) => (x == null ? "–" : x.toLocaleString(undefined, {
  minimumFractionDigits: digits, maximumFractionDigits: digits }));

function seconds(x) {
  if (x == null) return "–";
  return x < 1 ? `${fmt(x * 1000, x < 0.01 ? 1 : 0)} ms` : `${fmt(x, 2)} s`;
}

function drawTiles(r) {
  $("t-running").textContent = fmt(r.num_running);
  $("t-waiting").textContent = fmt(r.num_waiting);
  $("t-gen").textContent = r.rates ? fmt(r.rates.generation_tps) : "–";
  $("t-prompt").textContent = r.rates ? fmt(r.rates.prompt_tps) : "–";
  const lat = r.latency;
  $("t-ttft").textContent = lat.ttft ? `${seconds(lat.ttft[0])} / ${seconds(lat.ttft[2])}` : "–";
  $("t-itl").textContent = lat.itl ? `${seconds(lat.itl[0])} / ${seconds(lat.itl[2])}` : "–";
  const t = r.tree;
  $("t-hit").textContent = t.queried_tokens ? `${fmt((100 * t.hit_tokens) / t.queried_tokens, 1)} %` : "–";
  $("t-preempt").textContent = fmt(r.counters.preemptions);
  const c = r.counters;
  $("t-drafts").textContent = c.drafts_proposed
    ? `${fmt((100 * c.drafts_accepted) / c.drafts_proposed, 1)} %` : "–";
}

function drawBlocks(b) {
  const states = b.states;
  const n = states.length;
  const width = $("blocks").clientWidth;
  // Square cells as large as fit in about 240 px of height: drawn one by one with a gap when
  // large, else as one image of a pixel per block, scaled up.
  const cell = Math.max(1, Math.min(28, Math.floor(Math.sqrt((width * 240) / n))));
  const cols = Math.max(1, Math.floor(width / cell));
  const rows = Math.ceil(n / cols);
  const { ctx } = surface("blocks", rows * cell);
  const colors = STATE_COLORS.map(css);
  if (cell >= 6) {
    for (let i = 0; i < n; i++) {
      ctx.fillStyle = colors[states.charCodeAt(i) - 48];
      ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - 1, cell - 1);
    }
  } else {
    const rgb = colors.map(hexRgb);
    const image = new ImageData(cols, rows);
    const px = image.data;
    for (let i = 0; i < n; i++) {
      const c = rgb[states.charCodeAt(i) - 48];
      px[4 * i] = c[0]; px[4 * i + 1] = c[1]; px[4 * i + 2] = c[2]; px[4 * i + 3] = 255;
    }
    view.pixels = view.pixels && view.pixels.width === cols && view.pixels.height === rows
      ? view.pixels : Object.assign(document.createElement("canvas"), { width: cols, height: rows });
    view.pixels.getContext("2d").putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(view.pixels, 0, 0, cols * cell, rows * cell);
  }
  $("n-free").textContent = fmt(b.free);
  $("n-used").textContent = fmt(b.used);
  $("n-cached").textContent = fmt(b.cached);
  $("n-pinned").textContent = fmt(b.pinned);
  $("blocks-caption").textContent = `${fmt(n)} blocks of ${b.block_size} tokens; live sequences hold ` +
    `${fmt((100 * (b.used + b.pinned)) / n, 1)} %, the cache ${fmt((100 * (b.cached + b.pinned)) / n, 1)} %`;
}

function drawSteps(budget) {
  const { ctx, w, h } = surface("steps", 160);
  const steps = view.steps;
  const top = Math.max(budget, ...steps.map((s) => s[3] + s[4] + s[5]));
  const y = (v) => h - 4 - ((h - 14) * v) / top;
  const bw = w / STEP_HISTORY;
  const colors = [css("--decode"), css("--draft"), css("--prefill")];
  steps.forEach((s, i) => {
    const x = w - (steps.length - i) * bw;
    let base = 0;
    [s[3], s[4], s[5]].forEach((v, k) => {
      if (!v) return;
      ctx.fillStyle = colors[k];
      ctx.fillRect(x, y(base + v), Math.max(bw - 1, 1), y(base) - y(base + v));
      base += v;
    });
    if (s[7]) {  // a step that preempted
      ctx.fillStyle = css("--ttft");
      ctx.fillRect(x, 0, Math.max(bw - 1, 1), 4);
    }
  });
  ctx.strokeStyle = css("--budget");
  ctx.setLineDash([4, 3]);
  ctx.beginPath();
  ctx.moveTo(0, y(budget));
  ctx.lineTo(w, y(budget));
  ctx.stroke();
  ctx.setLineDash([]);
  ctx.fillStyle = css("--muted");
  ctx.font = "11px system-ui";
  ctx.fillText(`budget ${budget} tokens`, 4, y(budget) - 3);
  const last = steps.slice(-20);
  const ms = last.length ? (1000 * last.reduce((a, s) => a + s[1], 0)) / last.length : null;
  const tokens = last.length ? last.reduce((a, s) => a + s[3] + s[4] + s[5], 0) / last.length : null;
  $("steps-caption").textContent = last.length
    ? `last ${steps.length}; recent: ${fmt(tokens)} tokens, ${fmt(ms, 1)} ms a step` : "idle";
}

// A mixture of experts' load: steps carry [8] distinct experts read (over the MoE layers) and [9]
// the busiest expert's tokens; the record, tokens per expert since the previous one. Hidden for
// a dense model (no `experts` in the record).
function drawExperts(e) {
  $("experts-panel").hidden = !e;
  if (!e) return;
  const recent = view.steps.slice(-20).filter((s) => s[8] > 0);
  const n = recent.length;
  const read = n ? recent.reduce((a, s) => a + s[8], 0) / n : null;
  const share = n ? recent.reduce((a, s) => a + s[9] / (s[3] + s[4] + s[5]), 0) / n : null;
  $("e-read").textContent = fmt(read, 1);
  $("e-layer").textContent = read == null ? "–" : fmt(read / e.num_layers, 1);
  $("e-busiest").textContent = share == null ? "–" : `${fmt(100 * share)} %`;
  $("experts-caption").textContent = `${e.num_experts} experts in ${e.num_layers} layers`;
  if (e.tokens) view.expertTokens = e.tokens;
  const { ctx, w, h } = surface("experts", 90);
  const tokens = view.expertTokens;
  if (!tokens) return;
  const top = Math.max(1, ...tokens);
  const bw = w / tokens.length;
  ctx.fillStyle = css("--decode");
  tokens.forEach((t, i) => {
    const bh = ((h - 2) * t) / top;
    ctx.fillRect(i * bw, h - bh, Math.max(bw - 1, 1), bh);
  });
}

function drawTree(t) {
  const { ctx, w, h } = surface("tree", 160);
  const nodes = t.nodes;
  const size = nodes.map((node) => node[1]);
  for (let i = nodes.length - 1; i >= 0; i--) if (nodes[i][0] >= 0) size[nodes[i][0]] += size[i];
  const depth = new Array(nodes.length);
  let total = 0;
  let maxDepth = 0;
  nodes.forEach((node, i) => {
    depth[i] = node[0] < 0 ? 0 : depth[node[0]] + 1;
    maxDepth = Math.max(maxDepth, depth[i]);
    if (node[0] < 0) total += size[i];
  });
  const rowH = Math.max(4, Math.min(24, (h - 2) / (maxDepth + 1)));
  const x = new Array(nodes.length);
  const cursor = new Array(nodes.length);
  let rootCursor = 0;
  const colors = { true: css("--pinned"), false: css("--cached") };
  nodes.forEach((node, i) => {
    const width = total ? (w * size[i]) / total : 0;
    const parent = node[0];
    x[i] = parent < 0 ? rootCursor : cursor[parent];
    if (parent < 0) rootCursor += width; else cursor[parent] += width;
    cursor[i] = x[i];
    const top = depth[i] * rowH;
    if (top + rowH > h) return;
    ctx.fillStyle = colors[node[2]];
    ctx.fillRect(x[i], top, Math.max(width - 1, 0.5), rowH - 1);
  });
  if (!nodes.length) {
    ctx.fillStyle = css("--muted");
    ctx.font = "12px system-ui";
    ctx.fillText("empty (nothing cached yet)", 8, 20);
  }
  const shown = nodes.length < t.num_nodes ? ` (first ${nodes.length} drawn)` : "";
  $("tree-caption").textContent = `${fmt(t.num_nodes)} nodes${shown}, ${fmt(t.evicted_blocks)} blocks evicted`;
}

/** Lines over the history: series = [{values, color, alpha}], on one axis from 0 to the max. */
function sparkline(id, series, unit) {
  const { ctx, w, h } = surface(id, 90);
  const top = Math.max(1e-9, ...series.flatMap((s) => s.values.filter((v) => v != null)));
  const dx = w / (HISTORY - 1);
  const off = HISTORY - view.history.length;
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.globalAlpha = s.alpha ?? 1;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    s.values.forEach((v, i) => {
      if (v == null) { pen = false; return; }
      const px = (off + i) * dx;
      const py = h - 2 - ((h - 14) * v) / top;
      if (pen) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      pen = true;
    });
    ctx.stroke();
  }
  ctx.globalAlpha = 1;
  ctx.fillStyle = css("--muted");
  ctx.font = "11px system-ui";
  ctx.fillText(`max ${unit(top)}`, 4, 10);
}

function drawSparkTput() {
  const hist = view.history;
  sparkline("spark-tput", [
    { values: hist.map((r) => r.rates && r.rates.prompt_tps), color: css("--prefill") },
    { values: hist.map((r) => r.rates && r.rates.generation_tps), color: css("--decode") },
  ], (v) => `${fmt(v)} tok/s`);
}

function drawSparkLatency(windowS) {
  const hist = view.history;
  const pick = (kind, q) => hist.map((r) => r.latency[kind] && r.latency[kind][q]);
  sparkline("spark-lat", [
    { values: pick("ttft", 2), color: css("--ttft"), alpha: 0.35 },
    { values: pick("itl", 2), color: css("--itl"), alpha: 0.35 },
    { values: pick("ttft", 0), color: css("--ttft") },
    { values: pick("itl", 0), color: css("--itl") },
  ], seconds);
  $("latency-caption").textContent = `p50 / p99 over the last ${windowS} s`;
}

function bar(parts) {
  const el = document.createElement("span");
  el.className = "bar";
  let left = 0;
  for (const [cls, frac] of parts) {
    const i = document.createElement("i");
    i.className = cls;
    i.style.left = `${left * 100}%`;
    i.style.width = `${Math.max(0, Math.min(1 - left, frac)) * 100}%`;
    left += frac;
    el.appendChild(i);
  }
  return el;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = document.createElement("td");
    if (c instanceof Node) td.appendChild(c);
    else if (Array.isArray(c)) { td.append(...c); }
    else td.textContent = c;
    tr.appendChild(td);
  }
  return tr;
}

function requestId(s) {
  const td = document.createElement("span");
  td.textContent = s.seq_index ? `${s.request_id} #${s.seq_index}` : s.request_id;
  td.title = td.textContent;
  return td;
}

function drawQueues(r) {
  const running = r.running.map((s) => {
    const cached = Math.max(s.cached_tokens, 0);
    const prompt = Math.min(s.computed_tokens, s.prompt_tokens);
    const tr = row([
      requestId(s),
      [bar([["cache", cached / s.prompt_tokens], ["fill", (prompt - cached) / s.prompt_tokens]]),
        `${prompt}/${s.prompt_tokens}`],
      [bar([["out", s.output_tokens / s.max_tokens]]), `${s.output_tokens}/${s.max_tokens}`],
      s.drafts_proposed ? `${s.drafts_accepted}/${s.drafts_proposed}` : "–",
      s.preemptions || "",
    ]);
    tr.firstChild.className = "id";
    return tr;
  });
  $("running").replaceChildren(...running);
  $("running-caption").textContent = `${r.running.length} sequences of ${r.limits.max_num_seqs} seats`;
  const waiting = r.waiting.map((s) => {
    const tr = row([requestId(s), s.prompt_tokens, `${s.output_tokens}/${s.max_tokens}`, s.preemptions || ""]);
    tr.firstChild.className = "id";
    return tr;
  });
  if (r.num_waiting_seqs > r.waiting.length) {
    const more = row([`… and ${r.num_waiting_seqs - r.waiting.length} more`]);
    more.className = "more";
    waiting.push(more);
  }
  $("waiting").replaceChildren(...waiting);
  $("waiting-caption").textContent = `${r.num_waiting_seqs} sequences`;
}

window.addEventListener("resize", () => { if (view.latest) draw(); });
connect();
