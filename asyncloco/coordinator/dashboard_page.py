"""The dashboard's single page (served by asyncloco/coordinator/dashboard.py): HTML, CSS and inline JS.

No external resources. The script polls ``status.json`` every 2 s and renders it; every number it
shows carries its raw value in a ``data-value`` attribute (so a test can compare the page with the
status document exactly), and the shown text uses fixed formats: updates/s and perplexity with 2
decimals, staleness with 2, steps per lease with 1, inner loss with 4, speed rounded.
"""

from __future__ import annotations

__all__ = ["PAGE", "POLL_MS"]

POLL_MS = 2000

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>asyncloco dashboard</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.2em; color: #222; background: #fafafa; }
h1 { font-size: 1.3em; margin: 0 0 .3em 0; }
.muted { color: #777; font-size: .9em; }
.cards { display: flex; flex-wrap: wrap; gap: .6em; margin: .8em 0; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: .5em .9em; min-width: 8em; }
.card .label { color: #777; font-size: .8em; }
.card .num { font-size: 1.4em; font-variant-numeric: tabular-nums; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: .8em; }
.chart { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: .4em; }
.chart h2 { font-size: .95em; margin: .2em .4em; }
svg { width: 100%; height: 220px; }
table { border-collapse: collapse; margin-top: 1em; background: #fff; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th { background: #f0f0f0; } td.text { text-align: left; font-family: monospace; }
tr.dead td { color: #aaa; }
#state.bad { color: #b00; font-weight: bold; }
</style></head>
<body>
<h1>asyncloco run <span id="run-id">…</span> <span class="muted">(<span id="method"></span>,
<span id="parameters"></span> parameters, asyncloco <span id="software-version"></span>)</span></h1>
<div class="muted"><span id="state">loading…</span> · status written <span id="updated">-</span></div>
<div class="cards">
 <div class="card"><div class="label">model version (applied updates)</div><div class="num" id="version">-</div></div>
 <div class="card"><div class="label">local updates</div><div class="num" id="local-updates">-</div></div>
 <div class="card"><div class="label">updates/s</div><div class="num" id="updates-per-s">-</div></div>
 <div class="card"><div class="label" id="metric-label">validation perplexity</div><div class="num" id="perplexity">-</div></div>
 <div class="card"><div class="label">peers alive</div><div class="num" id="peers-alive">-</div></div>
 <div class="card"><div class="label">leases in flight</div><div class="num" id="active-leases">-</div></div>
 <div class="card"><div class="label">rejections</div><div class="num" id="rejections">-</div></div>
 <div class="card"><div class="label">work verified (failed)</div><div class="num" id="verified">-</div></div>
 <div class="card"><div class="label">peers expelled</div><div class="num" id="expelled">-</div></div>
 <div class="card"><div class="label">θ sent by the coordinator's seed</div><div class="num" id="seed-bytes">-</div></div>
</div>
<div class="charts">
 <div class="chart"><h2>validation perplexity vs time (s)</h2><svg id="chart-ppl-time"></svg></div>
 <div class="chart"><h2>validation perplexity vs applied updates</h2><svg id="chart-ppl-updates"></svg></div>
 <div class="chart"><h2>updates/s vs time (s)</h2><svg id="chart-rate"></svg></div>
 <div class="chart"><h2>peer speed (<span id="speed-unit">units/s</span>)</h2><svg id="chart-speed"></svg></div>
 <div class="chart"><h2>DyLU steps per lease (mean)</h2><svg id="chart-steps"></svg></div>
 <div class="chart"><h2>mean staleness</h2><svg id="chart-stale"></svg></div>
</div>
<table id="peers-table"><thead><tr>
 <th>name</th><th>id</th><th>device</th><th>speed</th><th>DyLU steps</th><th>steps/lease</th><th>leases</th>
 <th>applied</th><th>mean staleness</th><th>last seen</th><th>last inner loss</th>
 <th title="share of its wall time computing / uploading / downloading / waiting, from its speed report">% comp/up/down/wait</th></tr></thead>
<tbody id="peers"></tbody></table>
<table id="swarm-table"><thead><tr>
 <th>θ version</th><th>codec</th><th>serving peers</th><th>dropped (bad chunks)</th><th>chunks sent by the seed</th>
 <th>chunks per copy</th></tr></thead>
<tbody id="swarm"></tbody></table>
<script>
"use strict";
const POLL_MS = __POLL_MS__;
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

function fixed(value, digits) {
  return (value === null || value === undefined || !isFinite(value)) ? "-" : Number(value).toFixed(digits);
}
function setNum(id, value, text) {
  const el = document.getElementById(id);
  el.textContent = text;
  el.setAttribute("data-value", value === null || value === undefined ? "" : String(value));
}
function lastMetric(status, key) {
  const evals = status.evals || [];
  for (let i = evals.length - 1; i >= 0; i--) { if (key in evals[i]) return evals[i][key]; }
  return null;
}
function ago(now, then) {
  if (!then) return "never";
  const s = Math.max(0, now - then);
  return s < 120 ? s.toFixed(0) + "s ago" : s < 7200 ? (s / 60).toFixed(0) + "m ago" : (s / 3600).toFixed(1) + "h ago";
}
function el(tag, attrs, text) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
function short(v) {
  const a = Math.abs(v);
  if (Number.isInteger(v) && a < 1e6) return String(v);
  return a >= 1e4 || (a > 0 && a < 1e-2) ? v.toExponential(1) : a >= 100 ? v.toFixed(0) : v.toPrecision(3);
}
function lineChart(svg, points, logY) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = svg.clientWidth || 420, H = svg.clientHeight || 220, L = 56, R = 10, T = 10, B = 24;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("data-points", String(points.length));
  if (points.length === 0) { svg.appendChild(el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#999"}, "no data yet")); return; }
  const f = logY ? (y => Math.log10(Math.max(y, 1e-12))) : (y => y);
  const xs = points.map(p => p[0]), ys = points.map(p => f(p[1]));
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) { x1 = x0 + 1; }
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  svg.appendChild(el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}));
  svg.appendChild(el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}));
  const inv = logY ? (y => Math.pow(10, y)) : (y => y);
  svg.appendChild(el("text", {x: L - 4, y: T + 10, "text-anchor": "end", "font-size": 11}, short(inv(y1))));
  svg.appendChild(el("text", {x: L - 4, y: H - B, "text-anchor": "end", "font-size": 11}, short(inv(y0))));
  svg.appendChild(el("text", {x: L, y: H - 6, "font-size": 11}, short(x0)));
  svg.appendChild(el("text", {x: W - R, y: H - 6, "text-anchor": "end", "font-size": 11}, short(x1)));
  const d = points.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(f(p[1])).toFixed(1)).join(" ");
  svg.appendChild(el("path", {d: d, fill: "none", stroke: COLORS[0], "stroke-width": 2}));
  for (const p of points.slice(-200)) svg.appendChild(el("circle", {cx: sx(p[0]), cy: sy(f(p[1])), r: 2, fill: COLORS[0]}));
}
function barChart(svg, bars, digits) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = svg.clientWidth || 420, H = svg.clientHeight || 220, T = 16, B = 24;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("data-points", String(bars.length));
  if (bars.length === 0) { svg.appendChild(el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#999"}, "no peers yet")); return; }
  const top = Math.max(...bars.map(b => b.value), 1e-12), slot = W / bars.length, w = Math.min(60, slot * 0.6);
  bars.forEach((b, i) => {
    const h = (H - T - B) * b.value / top, x = i * slot + (slot - w) / 2;
    svg.appendChild(el("rect", {x: x, y: H - B - h, width: w, height: h, fill: COLORS[i % COLORS.length]}));
    svg.appendChild(el("text", {x: x + w / 2, y: H - B - h - 3, "text-anchor": "middle", "font-size": 11}, fixed(b.value, digits)));
    svg.appendChild(el("text", {x: x + w / 2, y: H - 8, "text-anchor": "middle", "font-size": 11}, b.label));
  });
}
function cell(row, field, value, text, isText) {
  const td = document.createElement("td");
  td.setAttribute("data-field", field);
  if (!isText) td.setAttribute("data-value", value === null || value === undefined ? "" : String(value));
  else td.className = "text";
  td.textContent = text;
  row.appendChild(td);
}
function render(status) {
  const now = Date.now() / 1000;
  document.getElementById("run-id").textContent = status.run_id;
  document.getElementById("method").textContent = status.method;
  document.getElementById("parameters").textContent = status.parameters ? (status.parameters / 1e6).toFixed(1) + " M" : "?";
  document.getElementById("software-version").textContent = status.software_version || "?";
  document.getElementById("updated").textContent = ago(now, status.updated);
  document.getElementById("speed-unit").textContent = status.speed_unit || "units/s";
  setNum("version", status.version, String(status.version));
  setNum("local-updates", status.local_updates, String(status.local_updates));
  setNum("updates-per-s", status.updates_per_s, fixed(status.updates_per_s, 2));
  const ppl = lastMetric(status, "perplexity"), loss = lastMetric(status, "loss");
  if (ppl !== null || loss === null) {
    document.getElementById("metric-label").textContent = "validation perplexity";
    setNum("perplexity", ppl, fixed(ppl, 2));
  } else {
    document.getElementById("metric-label").textContent = "validation loss";
    setNum("perplexity", loss, fixed(loss, 4));
  }
  const peers = Object.entries(status.peers || {}).sort((a, b) =>
    ((a[1].name || "") + "\\u0000" + a[0]).localeCompare((b[1].name || "") + "\\u0000" + b[0]));
  const alive = peers.filter(p => p[1].alive).length;
  setNum("peers-alive", alive, alive + "/" + peers.length);
  setNum("active-leases", status.active_leases, String(status.active_leases));
  setNum("rejections", status.rejections, String(status.rejections || 0));
  const started = status.started || 0;
  const key = ppl !== null ? "perplexity" : "loss";
  const evals = (status.evals || []).filter(e => key in e);
  lineChart(document.getElementById("chart-ppl-time"), evals.map(e => [e.time - started, e[key]]), key === "perplexity");
  lineChart(document.getElementById("chart-ppl-updates"), evals.map(e => [e.version, e[key]]), key === "perplexity");
  lineChart(document.getElementById("chart-rate"), (status.history || []).map(h => [h.time - started, h.updates_per_s]), false);
  const label = p => p[1].name || p[0].slice(-6);
  barChart(document.getElementById("chart-speed"), peers.map(p => ({label: label(p), value: p[1].speed})), 0);
  barChart(document.getElementById("chart-steps"), peers.map(p => ({label: label(p), value: p[1].steps_per_lease})), 1);
  barChart(document.getElementById("chart-stale"), peers.map(p => ({label: label(p), value: p[1].mean_staleness})), 2);
  const body = document.getElementById("peers");
  while (body.firstChild) body.removeChild(body.firstChild);
  for (const [id, p] of peers) {
    const row = document.createElement("tr");
    row.setAttribute("data-peer", id);
    if (!p.alive) row.className = "dead";
    cell(row, "name", null, p.name || "-", true);
    cell(row, "id", null, id.slice(-10), true);
    cell(row, "device", null, p.device || "-", true);
    cell(row, "speed", p.speed, fixed(p.speed, 0));
    cell(row, "last_steps", p.last_steps, String(p.last_steps));
    cell(row, "steps_per_lease", p.steps_per_lease, fixed(p.steps_per_lease, 1));
    cell(row, "leases", p.leases, String(p.leases));
    cell(row, "applied", p.applied, String(p.applied));
    cell(row, "mean_staleness", p.mean_staleness, fixed(p.mean_staleness, 2));
    cell(row, "last_seen", p.last_seen, ago(now, p.last_seen));
    cell(row, "last_inner_loss", p.last_inner_loss, fixed(p.last_inner_loss, 4));
    const split = p.time_split;
    cell(row, "time_split", split ? split.computing : null, split ? ["computing", "uploading", "downloading", "waiting"]
      .map(k => (100 * split[k]).toFixed(0)).join("/") : "-");
    body.appendChild(row);
  }
  // verification of the work and the θ swarm: "off" where the run does not use them
  const v = status.verification;
  const expelled = v ? Object.keys(v.expelled || {}).length : null;
  setNum("verified", v ? v.checked : null, v ? v.checked + " (" + v.failed + ")" : "off");
  setNum("expelled", expelled, v ? String(expelled) : "-");
  const sw = status.swarm;
  setNum("seed-bytes", sw ? sw.seed_bytes_sent : null, sw ? fixed(sw.seed_bytes_sent / 1e6, 1) + " MB" : "off");
  const swarm = document.getElementById("swarm");
  while (swarm.firstChild) swarm.removeChild(swarm.firstChild);
  for (const b of (sw && sw.bodies) || []) {
    const row = document.createElement("tr");
    row.setAttribute("data-swarm", "v" + b.version + "-" + b.codec);
    cell(row, "version", b.version, String(b.version));
    cell(row, "codec", null, b.codec, true);
    cell(row, "holders", (b.holders || []).length, String((b.holders || []).length));
    cell(row, "dropped", (b.dropped || []).length, String((b.dropped || []).length));
    cell(row, "seed_copies", b.seed_copies, String(b.seed_copies));
    cell(row, "chunks", b.chunks, String(b.chunks));
    swarm.appendChild(row);
  }
  document.body.setAttribute("data-rendered-version", String(status.version));
  document.body.setAttribute("data-rendered-updated", String(status.updated));
}
async function poll() {
  const state = document.getElementById("state");
  try {
    const response = await fetch("status.json", {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
    state.textContent = "live (refreshed every " + POLL_MS / 1000 + " s)";
    state.className = "";
  } catch (error) {
    state.textContent = "cannot reach the coordinator: " + error.message;
    state.className = "bad";
  }
  setTimeout(poll, POLL_MS);
}
poll();
</script>
</body></html>
""".replace("__POLL_MS__", str(POLL_MS))
