// ragkv serve's dashboard. Every call sends the key kept in this tab's session storage (never in
// a URL); every figure comes from this server: nothing is fetched from anywhere else.
"use strict";
const $ = (id) => document.getElementById(id);
const KEY = "ragkv-key";
const W = 400, H = 140, PAD = 6;
let storeName = null, listed = [], open = new Set(), history = [];  // history: the kept points fetched so far

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function api(path, body) {
  const init = body === undefined ? { headers: headers() }
    : { method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body) };
  const response = await fetch(path, init);
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = new Error((data.error && data.error.message) || `${response.status} ${response.statusText}`);
    error.status = response.status;
    throw error;
  }
  return data;
}

function showError(error) {
  $("error").hidden = !error;
  $("error").textContent = error ? String(error.message || error) : "";
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function svgEl(name, attrs, text) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// -- the store --------------------------------------------------------------------------------
async function loadStore() {
  const s = await api("/v1/ui/store");
  storeName = s.name;
  listed = s.listed;
  $("store-name").textContent = `${s.name}: ${s.model.name}`;
  $("doc-count").textContent = s.documents.toLocaleString();
  $("chunk-count").textContent = s.chunks.toLocaleString();
  $("stored-count").textContent = s.chunks_stored.toLocaleString();
  const m = s.model;
  $("model").textContent = `Model ${m.name}, ${m.dtype}${m.kv_quant && m.kv_quant !== "none" ? ` (stored as ${m.kv_quant})` : ""}: `
    + `${m.kv_layers === null ? "every layer" : `${m.kv_layers} layers`} keep KV`
    + (m.state_layers ? `, ${m.state_layers} keep a recurrent state (${bytes(m.state_bytes_per_entry)} per entry)` : "");
  const prompts = s.embedder_prompts;
  $("embedder").textContent = `Embedder ${s.embedder || "unknown"}` + (prompts
    ? `; before a question: ${JSON.stringify(prompts.query || "")}, before a chunk: ${JSON.stringify(prompts.document || "")}` : "");
  for (const [name, values] of Object.entries(s.choices)) {
    const select = $(name), kept = select.value;
    select.replaceChildren(...values.map((v) => Object.assign(document.createElement("option"), { textContent: v })));
    if (values.includes(kept)) select.value = kept;
  }
  for (const id of ["generation", "disk-bytes"]) $(id).parentElement.hidden = !s.store;
  if (s.store) {
    const st = s.store, ix = st.index;
    $("generation").textContent = st.generation;
    $("disk-bytes").textContent = bytes(st.shard_bytes);
    $("index").textContent = `Index ${ix.type} over ${ix.vectors.toLocaleString()} vectors (${ix.dim} dimensions), `
      + `recall@10 estimate ${ix.tuned_recall_at_10}; lexical: ${ix.lexical}`;
    $("budget").textContent = st.kv_budget
      ? `KV budget: ${bytes(st.live_bytes)} of ${bytes(st.kv_budget)} (${(100 * st.live_bytes / st.kv_budget).toFixed(1)}% full)`
      : `KV stored: ${bytes(st.live_bytes)} (no budget set)`;
    const used = (st.hottest || []).filter((d) => d.uses > 0);
    fillList($("hot-uses"), used.length ? used.map((d) => `${d.doc_id}: ${d.uses} uses`)
      : ["no uses folded into the store yet (ragkv fold, or the next ingest)"], "Most used (popularity log)");
  } else {
    for (const id of ["index", "budget"]) $(id).textContent = "";
    $("hot-uses").replaceChildren();
  }
  renderDocuments();
}

function renderDocuments() {
  const body = $("documents").tBodies[0];
  body.replaceChildren();
  const query = $("doc-filter").value.toLowerCase();
  for (const d of listed) {
    if (query && !`${d.doc_id} ${d.source}`.toLowerCase().includes(query)) continue;
    const row = body.insertRow();
    row.className = "doc";
    for (const value of [d.doc_id, d.source, d.chunks.length, d.chunks.filter((c) => c.stored).length]) {
      row.insertCell().textContent = value;
    }
    row.onclick = () => { open.has(d.doc_id) ? open.delete(d.doc_id) : open.add(d.doc_id); renderDocuments(); };
    if (!open.has(d.doc_id)) continue;
    for (const c of d.chunks) {
      const sub = body.insertRow();
      sub.className = "chunks";
      sub.insertCell().textContent = `#${c.index}`;
      const cell = sub.insertCell();
      cell.colSpan = 2;
      cell.textContent = c.text;
      sub.insertCell().textContent = c.stored ? "stored" : "no KV";
    }
  }
}

function fillList(list, items, title) {
  list.replaceChildren();
  list.title = title;
  for (const item of items) list.appendChild(document.createElement("li")).textContent = item;
}

// -- the charts -------------------------------------------------------------------------------
function lines(svg, series) {
  svg.replaceChildren();
  const n = Math.max(...series.map((s) => s.length));
  if (n < 2) { svg.appendChild(svgEl("text", { x: PAD, y: H / 2, class: "note" }, "collecting…")); return; }
  const top = Math.max(1e-9, ...series.flat());
  series.forEach((s, i) => {
    const d = s.map((v, j) => `${j ? "L" : "M"}${(PAD + (j * (W - 2 * PAD)) / (n - 1)).toFixed(1)},`
      + `${(H - PAD - (v / top) * (H - 2 * PAD)).toFixed(1)}`).join("");
    svg.appendChild(svgEl("path", { d, fill: "none", stroke: i ? "#e4572e" : "#2a6fdb", "stroke-width": 2 }));
  });
  svg.appendChild(svgEl("text", { x: W - PAD, y: 14, "text-anchor": "end", "font-size": 11 }, `max ${+top.toFixed(2)}`));
}

function bars(svg, labels, values) {
  svg.replaceChildren();
  const top = Math.max(1, ...values), width = (W - 2 * PAD) / values.length;
  values.forEach((v, i) => {
    const h = (v / top) * (H - 30);
    svg.appendChild(svgEl("rect", { x: PAD + i * width + 2, y: H - 18 - h, width: width - 4, height: h, fill: "#2a6fdb" }));
    svg.appendChild(svgEl("text", { x: PAD + (i + 0.5) * width, y: H - 4, "text-anchor": "middle", "font-size": 10 }, labels[i]));
    if (v) svg.appendChild(svgEl("text", { x: PAD + (i + 0.5) * width, y: H - 22 - h, "text-anchor": "middle", "font-size": 10 }, v));
  });
}

function deltas(points, name, perSecond = false) {
  const out = [];
  for (let i = 1; i < points.length; i += 1) {
    const change = Math.max(0, points[i][name] - points[i - 1][name]);
    out.push(perSecond ? change / Math.max(1e-3, points[i].t - points[i - 1].t) : change);
  }
  return out;
}

async function loadCharts() {
  let s;
  try {
    const since = history.length ? history[history.length - 1].t : 0;
    s = await api(`/v1/ui/series?since=${since}`);
  } catch (error) {
    if (error.status !== 403) throw error;
    $("charts-note").hidden = false;
    $("charts-note").textContent = "Charts, what's hot and tenants count every tenant: they need a key without filters.";
    for (const id of ["chart-tokens", "chart-ram", "chart-ttft", "chart-rps", "chart-misses", "hot-ram"]) $(id).replaceChildren();
    $("tenants").tBodies[0].replaceChildren();
    return;
  }
  $("charts-note").hidden = true;
  history = [...history, ...s.points].slice(-720);
  const p = [...history, s.now];
  lines($("chart-tokens"), [deltas(p, "reused"), deltas(p, "computed")]);
  lines($("chart-ram"), [deltas(p, "ram_hits"), deltas(p, "ram_misses")]);
  lines($("chart-rps"), [deltas(p, "requests", true)]);
  lines($("chart-misses"), [deltas(p, "misses_computed"), deltas(p, "written_back")]);
  const last = s.now.ttft_buckets;
  const bounds = Object.keys(last).sort((a, b) => parseFloat(a) - parseFloat(b));
  bars($("chart-ttft"), bounds.map((b) => (b === "+Inf" ? ">" : `≤${+parseFloat(b).toFixed(3)}`)),
    bounds.map((b, i) => last[b] - (i ? last[bounds[i - 1]] : 0)));
  const body = $("tenants").tBodies[0];
  body.replaceChildren();
  for (const [tenant, t] of Object.entries(s.tenants)) {
    const row = body.insertRow();
    for (const v of [tenant || "(no tenant)", t.requests, t.prompt_tokens, t.cached_tokens, t.completion_tokens]) row.insertCell().textContent = v;
  }
  const hot = await api(`/v1/cache?model=${encodeURIComponent(storeName)}`);
  fillList($("hot-ram"), hot.documents.map((d) => `${d} (in RAM)`), `RAM tier: ${hot.documents.length} documents`);
}

// -- the playground ---------------------------------------------------------------------------
function options() {
  const filter = $("filter").value.trim();
  return { top_k: +$("top-k").value, retrieval: $("retrieval").value, rerank: +$("rerank").value, filters: filter ? [filter] : [] };
}

function askOptions() {
  return { ...options(), mode: $("mode").value, context: $("context").value, order: $("order").value };
}

async function showSources(sources) {
  const list = $("sources");
  list.replaceChildren();
  const ids = sources.map((s) => s.chunk_id);
  const texts = ids.length ? (await api("/v1/ui/chunks", { model: storeName, chunk_ids: ids })).chunks : {};
  for (const s of sources) {
    const item = list.appendChild(document.createElement("li"));
    item.className = "source";
    item.appendChild(document.createElement("b")).textContent = s.citation || `${s.source} #${s.chunk_index}`;
    item.append(` score ${(+s.score).toFixed(3)}`);
    item.appendChild(document.createElement("blockquote")).textContent = texts[String(s.chunk_id)] ?? s.text ?? "";
  }
}

function showStages(stats) {
  const stages = [
    ["embed", stats.embed_ms], ["search", Math.max(0, stats.retrieval_ms - stats.embed_ms)],
    ["catalog", stats.catalog_ms], ["rerank", stats.rerank_ms], ["KV load", stats.kv_load_ms],
    ["prefill", stats.prefill_ms], ["decode", stats.decode_s * 1000],
  ];
  const colours = ["#8e6fd8", "#2a6fdb", "#5aa9e6", "#f2a541", "#3bb273", "#e4572e", "#999"];
  const total = Math.max(1e-9, stages.reduce((sum, [, ms]) => sum + ms, 0));
  const svg = $("stages");
  svg.replaceChildren();
  let x = 0;
  stages.forEach(([name, ms], i) => {
    const w = (ms / total) * W;
    svg.appendChild(svgEl("rect", { x, y: 5, width: w, height: 30, fill: colours[i] }, undefined))
      .appendChild(svgEl("title", {}, `${name}: ${ms.toFixed(1)} ms`));
    x += w;
  });
  $("stage-legend").textContent = stages.map(([name, ms]) => `${name} ${ms.toFixed(1)} ms`).join(" · ")
    + ` · first token after ${(stats.ttft_s * 1000).toFixed(0)} ms`;
}

async function ask(event) {
  event.preventDefault();
  showError(null);
  $("answer").textContent = "";
  $("cached").textContent = "";
  const body = {
    model: storeName, stream: true, max_tokens: +$("max-tokens").value,
    messages: [{ role: "user", content: $("question").value }], ragkv: askOptions(),
  };
  const response = await fetch("/v1/chat/completions",
    { method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body) });
  if (!response.ok) {
    const data = await response.json().catch(() => ({}));
    throw new Error((data.error && data.error.message) || response.statusText);
  }
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "", last = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, cut).replace(/^data: /, "");
      buffer = buffer.slice(cut + 2);
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices[0].delta;
      if (delta.content) $("answer").textContent += delta.content;
      if (chunk.ragkv) last = chunk;
    }
  }
  if (last) {
    const used = last.usage;
    $("cached").textContent = `cached_tokens ${used.prompt_tokens_details.cached_tokens} of ${used.prompt_tokens} prompt tokens`;
    showStages(last.ragkv.stats);
    await showSources(last.ragkv.sources);
  }
  await refresh(loadCharts);
}

async function searchOnly() {
  showError(null);
  const found = await api("/v1/retrieve", { model: storeName, query: $("question").value, ...options() });
  $("answer").textContent = `${found.data.length} chunks (${found.retrieval})`;
  await showSources(found.data.map((r) => ({ ...r, citation: r.citation || r.source })));
}

async function refresh(step) {
  try { await step(); } catch (error) { showError(error); }
}

// Everything the page shows, emptied when the key changes: nothing one key was shown stays for the next.
function clear() {
  listed = [];
  history = [];
  open = new Set();
  for (const id of ["hot-ram", "hot-uses", "sources", "chart-tokens", "chart-ram", "chart-ttft", "chart-rps", "chart-misses", "stages"]) {
    $(id).replaceChildren();
  }
  $("tenants").tBodies[0].replaceChildren();
  $("documents").tBodies[0].replaceChildren();
  for (const id of ["answer", "cached", "stage-legend", "budget", "index", "model", "embedder", "store-name"]) {
    $(id).textContent = "";
  }
  for (const id of ["doc-count", "chunk-count", "stored-count", "generation", "disk-bytes"]) $(id).textContent = "–";
}

async function start() {
  clear();
  await refresh(loadStore);
  await refresh(loadCharts);
}

$("key-form").onsubmit = (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  $("key").value = "";
  start();
};
$("forget").onclick = () => { sessionStorage.removeItem(KEY); start(); };
$("doc-filter").oninput = renderDocuments;
$("ask-form").onsubmit = (event) => refresh(() => ask(event));
$("search").onclick = () => refresh(searchOnly);
setInterval(() => refresh(loadCharts), 5000);
start();
