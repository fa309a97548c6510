"""The /dashboard page: static HTML with an inline script that polls /dashboard.json (no build step).

Rates are differences between two polls of the store's counters divided by the time between
them; "since start" figures are the counters themselves. ``?refresh=MS`` sets the poll period.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tierkv daemon</title>
<link rel="icon" href="data:,">
<style>
body{font:14px system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 4px} h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f0f0f0} td:first-child,th:first-child{text-align:left}
.bar{width:140px;height:10px;background:#e5e5e5;display:inline-block;vertical-align:middle;margin-right:6px}
.bar>i{display:block;height:100%;background:#3b7dd8}
.muted{color:#777} .down{color:#b00;font-weight:bold} #status.err{color:#b00}
</style></head><body>
<h1>tierkv daemon</h1>
<div class="muted">refreshes every <span id="period"></span> ms &middot; <span id="status">loading</span>
&middot; samples <span id="samples">0</span></div>
<h2>Tiers</h2>
<table id="tiers"><thead><tr><th>tier</th><th>usage</th><th>blocks</th><th>hit ratio</th><th>hits</th>
<th>misses</th><th>read/s</th><th>write/s</th><th>spills/s</th><th>promotions/s</th><th>evictions</th>
<th>dropped</th><th>errors</th></tr></thead><tbody></tbody></table>
<div class="muted">spill queue: <span id="spill"></span></div>
<h2>Why lookups missed (keys, since start)</h2>
<table id="lookups"><thead><tr><th>outcome</th><th>tier</th><th>keys</th><th>share</th></tr></thead><tbody></tbody></table>
<div class="muted">read lookups: <span id="lookup-keys">0</span> keys</div>
<h2>Cost-model decisions</h2>
<div class="muted" id="decisions"></div>
<h2>Miss-ratio curve <span class="muted">(drawn as hit ratio = 1 - miss ratio, against capacity)</span></h2>
<div id="curve" class="muted">no curve yet: record a trace and run advise</div>
<script>
"use strict";
const q = new URLSearchParams(location.search);
const period = Math.max(200, parseInt(q.get("refresh") || "2000", 10) || 2000);
let prev = null, samples = 0;
document.getElementById("period").textContent = period;
function bytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(Math.round(n))) + " " + u[i];
}
function pct(x) { return isFinite(x) ? (100 * x).toFixed(1) + "%" : "-"; }
function cell(tr, text, cls) {
  const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; tr.appendChild(td); return td;
}
function rate(cur, old, key, dt) {
  if (!old || dt <= 0) return "-";
  return Math.max(0, cur[key] - old[key]) / dt;
}
function renderTiers(d) {
  const body = document.querySelector("#tiers tbody"); body.textContent = "";
  const dt = prev ? d.time - prev.time : 0;
  for (const t of d.tiers) {
    const old = prev ? prev.tiers.find(x => x.name === t.name) : null;
    const tr = document.createElement("tr"); tr.dataset.tier = t.name;
    cell(tr, t.name + (t.available ? "" : " (down)"), t.available ? "" : "down");
    const use = cell(tr, ""), bar = document.createElement("span"), fill = document.createElement("i");
    bar.className = "bar"; fill.style.width = pct(t.capacity_bytes ? Math.min(1, t.used_bytes / t.capacity_bytes) : 0);
    bar.appendChild(fill); use.appendChild(bar);
    use.appendChild(document.createTextNode(bytes(t.used_bytes) + " / " + bytes(t.capacity_bytes)));
    cell(tr, t.blocks);
    cell(tr, pct(t.hits / (t.hits + t.misses)), "hit-ratio");
    cell(tr, t.hits, "hits"); cell(tr, t.misses, "misses");
    const r = rate(t, old, "read_bytes", dt), w = rate(t, old, "write_bytes", dt);
    cell(tr, r === "-" ? r : bytes(r) + "/s", "read-rate"); cell(tr, w === "-" ? w : bytes(w) + "/s", "write-rate");
    const s = rate(t, old, "spills", dt), p = rate(t, old, "promotions", dt);
    cell(tr, s === "-" ? s : s.toFixed(1)); cell(tr, p === "-" ? p : p.toFixed(1));
    cell(tr, t.evictions); cell(tr, t.dropped); cell(tr, t.errors);
    body.appendChild(tr);
  }
  document.getElementById("spill").textContent = d.spill_queue.blocks + " blocks, " + bytes(d.spill_queue.bytes);
}
function renderLookups(d) {
  const body = document.querySelector("#lookups tbody"); body.textContent = "";
  const lk = d.lookups, rows = [];
  for (const [t, n] of Object.entries(lk.hits)) rows.push(["hit", t, n]);
  for (const [t, n] of Object.entries(lk.evicted)) rows.push(["evicted lately", t, n]);
  rows.push(["absent", "", lk.absent]);
  for (const [o, t, n] of rows) {
    const tr = document.createElement("tr"); tr.dataset.outcome = o + ":" + t;
    cell(tr, o); cell(tr, t); cell(tr, n); cell(tr, lk.keys ? pct(n / lk.keys) : "-"); body.appendChild(tr);
  }
  document.getElementById("lookup-keys").textContent = lk.keys;
  document.getElementById("decisions").textContent = "made by each engine's connector, not by the daemon: see " + d.decisions_at;
}
function renderCurve(d) {
  const box = document.getElementById("curve");
  if (d.curve_error) { box.textContent = "curve unavailable: " + d.curve_error; return; }
  if (!d.curves.length) return;
  const W = 520, H = 220, L = 48, B = 30, ns = "http://www.w3.org/2000/svg";
  const xs = d.curves.flatMap(c => c.capacity_bytes), xmax = Math.max(...xs), xmin = Math.min(...xs);
  const X = v => L + (W - L - 10) * (xmax > xmin ? (v - xmin) / (xmax - xmin) : 0.5), Y = h => (H - B) * (1 - h) + 5;
  const svg = document.createElementNS(ns, "svg"); svg.setAttribute("width", W); svg.setAttribute("height", H);
  const el = (name, attrs, text) => {
    const e = document.createElementNS(ns, name); for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text; svg.appendChild(e); return e;
  };
  el("line", {x1: L, y1: Y(0), x2: W - 10, y2: Y(0), stroke: "#999"}); el("line", {x1: L, y1: Y(0), x2: L, y2: Y(1), stroke: "#999"});
  for (const h of [0, 0.5, 1]) el("text", {x: 4, y: Y(h) + 4, "font-size": 11}, pct(h));
  el("text", {x: L, y: H - 4, "font-size": 11}, bytes(xmin)); el("text", {x: W - 80, y: H - 4, "font-size": 11}, bytes(xmax));
  const colours = ["#3b7dd8", "#d8763b", "#3bd88a", "#a23bd8"];
  d.curves.forEach((c, i) => {
    const pts = c.capacity_bytes.map((x, j) => X(x) + "," + Y(c.hit_ratio[j])).join(" ");
    el("polyline", {points: pts, fill: "none", stroke: colours[i % 4], "stroke-width": 2, "data-tier": c.tier});
    el("text", {x: L + 8, y: 16 + 14 * i, "font-size": 11, fill: colours[i % 4]}, c.tier + " hit ratio vs capacity " + (c.note ? "(" + c.note + ")" : ""));
  });
  box.textContent = ""; box.className = ""; box.appendChild(svg);
}
async function poll() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch("dashboard.json", {cache: "no-store"});
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const d = await resp.json();
    renderTiers(d); renderLookups(d); renderCurve(d);
    prev = d; samples++;
    document.getElementById("samples").textContent = samples;
    status.textContent = "live, " + new Date(d.time * 1000).toLocaleTimeString(); status.className = "";
  } catch (e) {
    status.textContent = "cannot reach the daemon (" + e.message + "), retrying"; status.className = "err";
  }
  setTimeout(poll, period);
}
poll();
</script></body></html>
"""
