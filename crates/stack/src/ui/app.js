// Strata dashboard: polls /ui/api/state once a second and draws each series on a canvas.
"use strict";

const COLORS = ["#6cb6ff", "#f0b35a", "#8fd18f", "#e38c8c", "#c39ae0", "#5fd0c8", "#d6d66b"];

function setupChart(fig) {
  const cap = document.createElement("figcaption");
  cap.textContent = fig.dataset.title;
  const canvas = document.createElement("canvas");
  const legend = document.createElement("div");
  legend.className = "legend";
  fig.append(cap, canvas, legend);
  return { fig, canvas, legend };
}

function fmt(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1000) return (v / 1000).toFixed(1) + "k";
  if (a >= 10) return v.toFixed(0);
  if (a >= 1) return v.toFixed(1);
  if (a >= 0.01) return v.toFixed(3);
  return v.toExponential(1);
}

// lines: [{name, values: [number|null]}], t: [seconds]
function draw(chart, t, lines, opts = {}) {
  const { canvas, legend, fig } = chart;
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 400, h = canvas.clientHeight || 180;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  ctx.clearRect(0, 0, w, h);
  const pad = { l: 48, r: 8, t: 8, b: 20 };
  let ymax = opts.ymax || 0;
  let points = 0;
  for (const l of lines) for (const v of l.values) if (v !== null && v !== undefined) {
    ymax = Math.max(ymax, v); points++;
  }
  if (!opts.ymax) ymax = ymax > 0 ? ymax * 1.15 : 1;
  const t0 = t.length ? t[0] : 0, t1 = t.length ? t[t.length - 1] : 1;
  const x = (s) => pad.l + (w - pad.l - pad.r) * (t1 > t0 ? (s - t0) / (t1 - t0) : 1);
  const y = (v) => h - pad.b - (h - pad.t - pad.b) * (v / ymax);
  ctx.strokeStyle = "#2a323c"; ctx.fillStyle = "#7d8896"; ctx.font = "11px system-ui";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const v = (ymax * i) / 4, yy = y(v);
    ctx.beginPath(); ctx.moveTo(pad.l, yy); ctx.lineTo(w - pad.r, yy); ctx.stroke();
    ctx.fillText(opts.percent ? (v * 100).toFixed(0) + "%" : fmt(v), 4, yy + 4);
  }
  ctx.fillText(`${Math.round(t1 - t0)} s`, w - pad.r - 30, h - 4);
  lines.forEach((l, i) => {
    ctx.strokeStyle = COLORS[i % COLORS.length]; ctx.lineWidth = 1.6;
    ctx.beginPath();
    let pen = false;
    l.values.forEach((v, j) => {
      if (v === null || v === undefined) { pen = false; return; }
      const xx = x(t[j]), yy = y(v);
      if (pen) ctx.lineTo(xx, yy); else ctx.moveTo(xx, yy);
      pen = true;
    });
    ctx.stroke();
  });
  legend.innerHTML = "";
  lines.forEach((l, i) => {
    const last = [...l.values].reverse().find((v) => v !== null && v !== undefined);
    const span = document.createElement("span");
    const dot = document.createElement("i");
    dot.style.background = COLORS[i % COLORS.length];
    span.append(dot, `${l.name}: ${last === undefined ? "–" : opts.percent ? (last * 100).toFixed(1) + "%" : fmt(last)}`);
    legend.append(span);
  });
  fig.dataset.points = String(points);
}

const charts = {};
document.querySelectorAll(".chart").forEach((fig) => { charts[fig.id] = setupChart(fig); });

function perReplica(series, key, names) {
  return Object.entries(series.replicas).map(([url, s]) => ({ name: names[url] || url, values: s[key] }));
}

function render(state) {
  const s = state.series, t = s.t;
  const names = {};
  for (const r of state.replicas) names[r.url] = r.name;
  draw(charts["chart-ttft"], t, [
    { name: "p50", values: s.ttft_p50 }, { name: "p90", values: s.ttft_p90 }, { name: "p99", values: s.ttft_p99 }]);
  draw(charts["chart-itl"], t, [
    { name: "p50", values: s.itl_p50 }, { name: "p90", values: s.itl_p90 }, { name: "p99", values: s.itl_p99 }]);
  draw(charts["chart-tps"], t, [{ name: "output tok/s", values: s.output_tokens_per_s }]);
  draw(charts["chart-rps"], t, [{ name: "req/s", values: s.requests_per_s }]);
  draw(charts["chart-queue"], t, perReplica(s, "queue", names));
  draw(charts["chart-kv"], t, perReplica(s, "kv", names), { percent: true, ymax: 1 });
  draw(charts["chart-prefix"], t, [{ name: "hit rate", values: s.prefix_hit_rate }], { percent: true, ymax: 1 });
  draw(charts["chart-picks"], t, perReplica(s, "picks_per_s", names));
  // Share of each tenant's cacheable gateway requests answered by the exact or semantic cache.
  draw(charts["chart-cache"], t, Object.entries(state.cache_hit_rate || {})
    .map(([tenant, values]) => ({ name: tenant, values })), { percent: true, ymax: 1 });

  const pools = document.querySelector("#pools tbody");
  pools.innerHTML = "";
  for (const p of state.pools || []) {
    const tr = document.createElement("tr");
    tr.dataset.pool = p.name;
    tr.dataset.ready = String(p.ready);
    const cells = [p.name, p.model, (p.adapters || []).join(", ") || "–", p.replicas,
      `${p.ready} / ${p.desired}`,
      p.min_replicas === p.max_replicas ? String(p.max_replicas) : `${p.min_replicas}..${p.max_replicas}`,
      p.waiting ?? "–", p.running ?? "–",
      p.requests_per_s === null || p.requests_per_s === undefined ? "–" : fmt(p.requests_per_s)];
    cells.forEach((c) => {
      const td = document.createElement("td");
      td.textContent = String(c);
      tr.append(td);
    });
    pools.append(tr);
  }

  const body = document.querySelector("#replicas tbody");
  body.innerHTML = "";
  for (const r of state.replicas) {
    const tr = document.createElement("tr");
    tr.dataset.replica = r.name;
    tr.dataset.ready = String(r.ready);
    const cells = [r.name, r.url, r.state, r.ready ? "yes" : "no", r.model,
      (r.adapters || []).join(", ") || "–",
      r.waiting ?? "–", r.running ?? "–",
      r.kv_usage === null || r.kv_usage === undefined ? "–" : (r.kv_usage * 100).toFixed(1) + "%"];
    cells.forEach((c, i) => {
      const td = document.createElement("td");
      td.textContent = String(c);
      if (i === 3) td.className = r.ready ? "ok" : "bad";
      tr.append(td);
    });
    body.append(tr);
  }
  const ready = state.replicas.filter((r) => r.ready).length;
  let summary = `${ready}/${state.replicas.length} replicas ready`;
  const c = state.controller;
  if (c) {
    summary = `${c.ready} ready / ${c.desired} desired replicas` + (c.reason ? ` (${c.reason})` : "");
    if (c.rollout) summary += ` · rollout ${c.rollout.baseline} → ${c.rollout.canary}: ${c.rollout.phase}, ${c.rollout.weight}% canary`;
    document.body.dataset.desired = String(c.desired);
    document.body.dataset.readyReplicas = String(c.ready);
  }
  document.getElementById("summary").textContent = summary;
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  document.body.dataset.ticks = String(t.length);
}

async function poll() {
  try {
    const resp = await fetch("/ui/api/state", { cache: "no-store" });
    if (resp.ok) render(await resp.json());
  } catch (e) {
    document.getElementById("summary").textContent = "disconnected";
  }
  setTimeout(poll, 1000);
}
poll();
