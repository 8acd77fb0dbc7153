// Nalar Serve dashboard: polls dashboard/data and draws tables and plain SVG charts.
// No libraries and nothing fetched from elsewhere: the cluster may have no network.
"use strict";

const POLL_MS = 1500;
const SVG = "http://www.w3.org/2000/svg";
const QUANTILES = ["p50", "p90", "p99"];

const dash = "–";
const pct = (x) => (x == null ? dash : (100 * x).toFixed(1) + " %");
const num = (x, digits = 0) => (x == null ? dash : Number(x).toFixed(digits));
// Seconds as "12.5 ms", "250 ms" or "2.50 s".
const ms = (s) => (s == null ? dash : s >= 1 ? s.toFixed(2) + " s"
  : (1000 * s).toFixed(s < 0.1 ? 1 : 0) + " ms");
const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

function el(tag, attrs = {}, text) {
  const node = tag in { svg: 1, path: 1, line: 1, rect: 1, text: 1, g: 1 }
    ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text != null) node.textContent = text;
  return node;
}

function cell(text, cls) {
  return el("td", cls ? { class: cls } : {}, text);
}

function meter(fraction) {
  const td = el("td");
  if (fraction != null) {
    const bar = el("span", { class: "meter" });
    bar.append(el("span", { style: `width:${Math.min(100, 100 * fraction)}%` }));
    td.append(bar);
  }
  td.append(pct(fraction));
  return td;
}

function adapterList(w) {
  const hosted = w.hosted_adapters.map((name) => `${name} (host)`);
  const all = w.adapters.concat(hosted);
  return all.length ? all.join(", ") : "none";
}

function hitSources(hits) {
  return [hits.local_cache_hit, hits.second_tier, hits.external_kv_transfer]
    .map((tokens) => num(tokens)).join(" / ");
}

function renderWorkers(workers) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren(...workers.map((w) => {
    const row = el("tr", { "data-worker": w.worker });
    row.append(cell(w.worker, "worker-id"), cell(num(w.running)), cell(num(w.waiting)),
      meter(w.kv_usage), cell(pct(w.hit_ratio)), cell(hitSources(w.hits_by_source), "sources"),
      cell(num(w.tokens_per_s, 1)),
      cell(pct(w.acceptance)), cell(num(w.requests), "requests"),
      cell(adapterList(w), "adapters"));
    return row;
  }));
  const total = workers.reduce((sum, w) => sum + w.requests, 0);
  document.getElementById("total-requests").textContent = total;
}

function renderNow(id, stats) {
  const box = document.getElementById(id);
  if (!stats || !stats.n) {
    box.textContent = "no requests in the last minute";
    return;
  }
  box.replaceChildren("last minute (" + stats.n + "): ");
  for (const q of QUANTILES) {
    box.append(q + " ", el("b", { class: q }, ms(stats[q])), "  ");
  }
}

// The smallest 1, 2 or 5 times a power of ten at or above x: a round top for an axis.
function niceCeil(x) {
  const power = 10 ** Math.floor(Math.log10(x));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= x);
}

// A line per quantile over the last five minutes; y from 0 to a round value above every p99.
function renderChart(id, points, spanS, now) {
  const svg = document.getElementById(id);
  const W = 600, H = 220, left = 52, right = 22, top = 10, bottom = 24;
  const top_ = niceCeil(Math.max(1e-3, ...points.map((p) => p.p99 || 0)));
  const x = (t) => left + (W - left - right) * (1 - (now - t) / spanS);
  const y = (v) => top + (H - top - bottom) * (1 - v / top_);
  const parts = [];
  for (let i = 0; i <= 4; i++) {
    const v = (top_ * i) / 4;
    parts.push(el("line", { class: "grid", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
    parts.push(el("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end" }, ms(v)));
  }
  for (let m = 0; m <= spanS / 60; m++) {
    const t = now - 60 * m;
    parts.push(el("text", { x: x(t), y: H - 6, "text-anchor": "middle" },
      m === 0 ? "now" : `-${m} min`));
  }
  for (const q of QUANTILES) {
    const d = points.map((p, i) => (i ? "L" : "M") + x(p.t).toFixed(1) + " " + y(p[q]).toFixed(1));
    if (d.length) parts.push(el("path", { class: q, d: d.join(" ") }));
  }
  if (!points.length) {
    parts.push(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no samples yet"));
  }
  svg.replaceChildren(...parts);
}

function renderShare(share, workers) {
  const svg = document.getElementById("share-chart");
  const names = [...new Set([...workers.map((w) => w.worker), ...Object.keys(share)])].sort();
  const total = names.reduce((sum, n) => sum + (share[n] || 0), 0);
  const rowH = 24, W = 600, left = 110, right = 90;
  svg.setAttribute("viewBox", `0 0 ${W} ${Math.max(1, names.length) * rowH + 4}`);
  svg.replaceChildren(...names.flatMap((name, i) => {
    const count = share[name] || 0;
    const width = total ? ((W - left - right) * count) / total : 0;
    const yy = i * rowH + 4;
    return [
      el("text", { class: "label", x: 0, y: yy + 14 }, name),
      el("rect", { x: left, y: yy, width: Math.max(width, 1), height: rowH - 8, rx: 2 }),
      el("text", { x: left + width + 6, y: yy + 13 },
        `${count} (${total ? ((100 * count) / total).toFixed(0) : 0} %)`),
    ];
  }));
}

function renderDecisions(decisions) {
  const body = document.querySelector("#decisions tbody");
  body.replaceChildren(...decisions.map((d) => {  // newest first
    const row = el("tr");
    row.append(cell(clock(d.at)), cell(d.worker_id, "worker-id"), cell(d.policy),
      cell(num(d.prompt_tokens)), cell(num(d.cached_tokens)), cell(d.fallback || dash));
    return row;
  }));
}

function renderIndex(index, health) {
  const facts = [];
  if (index && !index.error) {
    facts.push(["backend", index.backend], ["entries (digests)", num(index.digests)],
      ["in second tiers", num(index.tier_digests)],
      ["workers with entries", num(index.workers)],
      ["last event", index.last_event_age_s == null ? "never"
        : num(index.last_event_age_s, 1) + " s ago"]);
  } else if (index) {
    facts.push(["index", index.error]);
  }
  if (health) {
    facts.push(["router lookups", health.healthy ? "healthy" : "failing"],
      ["lookups", num(health.lookups)]);
    if (health.last_error) facts.push(["last error", health.last_error]);
    for (const [reason, n] of Object.entries(health.fallbacks || {})) {
      facts.push(["fallbacks: " + reason, num(n)]);
    }
  }
  document.getElementById("index").replaceChildren(...facts.flatMap(([k, v]) => {
    const dd = el("dd", {}, v);
    if (v === "healthy") dd.className = "good";
    if (v === "failing") dd.className = "bad";
    return [el("dt", {}, k), dd];
  }));
}

function render(data) {
  document.getElementById("model").textContent = data.model;
  document.getElementById("workers-answered").textContent =
    data.scrape.answered + (data.scrape.skipped ? ` (+${data.scrape.skipped} late)` : "");
  renderWorkers(data.workers);
  const span = 300;
  renderNow("ttft-now", data.latency.ttft_last_minute);
  renderNow("itl-now", data.latency.itl_last_minute);
  renderChart("ttft-chart", data.latency.ttft, span, data.time);
  renderChart("itl-chart", data.latency.itl, span, data.time);
  renderShare(data.routing.share, data.workers);
  renderDecisions(data.routing.recent);
  renderIndex(data.index, data.routing.health);
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("dashboard/data", { cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const data = await response.json();
    render(data);
    status.textContent = "updated " + clock(data.time);
    status.className = "status ok";
  } catch (error) {
    status.textContent = "no data: " + error.message;
    status.className = "status error";
  }
}

poll();
setInterval(poll, POLL_MS);
