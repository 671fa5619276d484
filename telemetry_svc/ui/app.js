// kvfleet's trace UI: plain JavaScript over the telemetry service's JSON routes (Jaeger's query
// API under /api/traces, /api/services; the experiments under /api/experiments). No build step.
//
// Span names, attributes and experiment ids come from whoever sent them: every one of them goes
// into the DOM as text (el() appends strings as text nodes, cells use textContent), never as
// markup, and the page's Content-Security-Policy runs no script but this file.
"use strict";

const TOKEN_KEY = "kvfleet.telemetry.token";
const main = document.getElementById("main");
let generation = 0; // bumped on every navigation: a late answer for an old page is dropped
let refreshTimer = null;

// --- DOM and formatting helpers ------------------------------------------------------------------

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : String(child)); // a string becomes a text node
  }
  return node;
}

function table(headers, rows, numeric = new Set()) {
  return el("table", {},
    el("thead", {}, el("tr", {}, headers.map((h, i) => el("th", { class: numeric.has(i) ? "num" : null }, h)))),
    el("tbody", {}, rows));
}

function row(cells, numeric = new Set(), props = {}) {
  return el("tr", props, cells.map((c, i) => el("td", { class: numeric.has(i) ? "num" : null }, c)));
}

function fmtMicros(us) {
  if (us >= 1e6) return (us / 1e6).toPrecision(3) + " s";
  if (us >= 1e3) return (us / 1e3).toPrecision(3) + " ms";
  return Math.round(us) + " µs";
}

function fmtNanos(ns) {
  const sign = ns < 0 ? "−" : "";
  const a = Math.abs(ns);
  if (a >= 1e9) return sign + (a / 1e9).toPrecision(3) + " s";
  if (a >= 1e6) return sign + (a / 1e6).toPrecision(3) + " ms";
  if (a >= 1e3) return sign + (a / 1e3).toPrecision(3) + " µs";
  return sign + a + " ns";
}

function fmtTime(us) {
  return new Date(us / 1000).toLocaleString();
}

function fmtAgo(us) {
  const s = Math.max(0, Date.now() / 1000 - us / 1e6);
  if (s < 90) return Math.round(s) + " s ago";
  if (s < 5400) return Math.round(s / 60) + " min ago";
  return Math.round(s / 3600) + " h ago";
}

function tagValue(value) {
  return typeof value === "string" ? value : JSON.stringify(value);
}

function yesNo(value) {
  return value === null || value === undefined ? "unknown" : value ? "yes" : "no";
}

// --- the JSON routes -----------------------------------------------------------------------------

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path) {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = "Bearer " + token;
  const resp = await fetch(path, { headers });
  let body = null;
  try {
    body = await resp.json();
  } catch (_) {
    body = null;
  }
  if (!resp.ok) {
    const msg = body && Array.isArray(body.errors) && body.errors.length ? body.errors[0].msg : resp.statusText;
    throw new HttpError(resp.status, msg);
  }
  return body;
}

const enc = encodeURIComponent;

function errorBox(err) {
  const box = el("div", { class: "error-box", role: "alert" });
  if (err instanceof HttpError && err.status === 401) {
    box.append(el("b", {}, "This telemetry service protects its reads (--protect-reads). "),
      "Enter its token above. ", el("span", { class: "muted" }, err.message));
  } else if (err instanceof HttpError) {
    box.append(el("b", {}, `HTTP ${err.status}: `), err.message);
  } else {
    box.append(el("b", {}, "Failed: "), String(err && err.message ? err.message : err));
  }
  return box;
}

function warnings(list) {
  const msgs = (list || []).map((w) => (typeof w === "string" ? w : w.msg + (w.traceID ? ` (${w.traceID})` : "")));
  return msgs.length ? el("ul", { class: "warnings" }, msgs.map((m) => el("li", {}, m))) : null;
}

// --- traces: search and list ---------------------------------------------------------------------

function parseTags(text) {
  // "key=value key2=value2" -> {"key": "value", ...} (Jaeger's `tags` parameter)
  const tags = {};
  for (const part of text.trim().split(/\s+/).filter(Boolean)) {
    const at = part.indexOf("=");
    if (at <= 0) throw new Error(`tag ${JSON.stringify(part)} is not key=value`);
    tags[part.slice(0, at)] = part.slice(at + 1);
  }
  return tags;
}

function traceFacts(trace) {
  const spans = trace.spans;
  const ids = new Set(spans.map((s) => s.spanID));
  const start = Math.min(...spans.map((s) => s.startTime));
  const end = Math.max(...spans.map((s) => s.startTime + s.duration));
  const roots = spans.filter((s) => !parentOf(s, ids)).sort((a, b) => a.startTime - b.startTime);
  const services = {};
  for (const s of spans) {
    const name = (trace.processes[s.processID] || {}).serviceName || "?";
    services[name] = (services[name] || 0) + 1;
  }
  return { start, end, root: roots[0] || spans[0], services };
}

function parentOf(span, ids) {
  // Jaeger's rule: the parent is the first reference (CHILD_OF); one not in this trace is none.
  const ref = (span.references || []).find((r) => r.refType === "CHILD_OF");
  return ref && ids.has(ref.spanID) ? ref.spanID : null;
}

async function viewTraces(gen, query) {
  const params = new URLSearchParams(query || "");
  const services = (await api("/api/services")).data;
  const service = params.get("service") || (services.includes("kvfleet-scheduler") ? "kvfleet-scheduler" : services[0]);
  const operations = service ? (await api(`/api/services/${enc(service)}/operations`)).data : [];
  const field = (name, input) => el("label", {}, name, input);
  const serviceSel = el("select", { name: "service", id: "search-service" },
    services.map((s) => el("option", { value: s, selected: s === service }, s)));
  serviceSel.addEventListener("change", () => { location.hash = "#/traces?" + new URLSearchParams({ service: serviceSel.value }); });
  const opSel = el("select", { name: "operation", id: "search-operation" }, el("option", { value: "" }, "all"),
    operations.map((o) => el("option", { value: o, selected: o === params.get("operation") }, o)));
  const inputs = {
    tags: el("input", { name: "tags", id: "search-tags", class: "tags", placeholder: "kvfleet.session.id=s-… error=true" }),
    minDuration: el("input", { name: "minDuration", id: "search-min", size: 7, placeholder: "10ms" }),
    maxDuration: el("input", { name: "maxDuration", id: "search-max", size: 7, placeholder: "1.5s" }),
    limit: el("input", { name: "limit", id: "search-limit", size: 4, value: "20" }),
  };
  for (const [k, input] of Object.entries(inputs)) if (params.has(k)) input.value = params.get(k);
  const form = el("form", { class: "search", id: "search-form" },
    field("service", serviceSel), field("operation", opSel), field("tags", inputs.tags),
    field("min duration", inputs.minDuration), field("max duration", inputs.maxDuration), field("limit", inputs.limit),
    el("button", { type: "submit", id: "search-button" }, "Find traces"));
  const results = el("div", { id: "results" });
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams({ service: serviceSel.value, search: "1" });
    if (opSel.value) q.set("operation", opSel.value);
    for (const [k, input] of Object.entries(inputs)) if (input.value.trim()) q.set(k, input.value.trim());
    const hash = "#/traces?" + q;
    if (location.hash === hash) route(); else location.hash = hash;
  });
  render(gen, el("h1", {}, "Traces"), services.length ? form : el("p", { class: "muted" }, "No span in the store yet."),
    results);
  if (!service) return;
  const apiParams = new URLSearchParams({ service });
  for (const k of ["operation", "minDuration", "maxDuration", "limit"]) if (params.get(k)) apiParams.set(k, params.get(k));
  if (!apiParams.has("limit")) apiParams.set("limit", "20");
  try {
    if (params.get("tags")) apiParams.set("tags", JSON.stringify(parseTags(params.get("tags"))));
    const body = await api("/api/traces?" + apiParams);
    if (gen !== generation) return;
    results.replaceChildren(traceList(body.data), warnings(body.errors) || "");
  } catch (err) {
    if (gen === generation) results.replaceChildren(errorBox(err));
  }
}

function traceList(traces) {
  if (!traces.length) return el("p", { class: "muted", id: "no-traces" }, "No trace matches.");
  const rows = traces.map((t) => {
    const f = traceFacts(t);
    const go = () => { location.hash = "#/trace/" + t.traceID; };
    return row([
      el("a", { href: "#/trace/" + t.traceID }, f.root.operationName),
      Object.entries(f.services).map(([s, n]) => `${s} (${n})`).join(", "),
      String(t.spans.length), fmtMicros(f.end - f.start), fmtTime(f.start), el("span", { class: "mono" }, t.traceID),
    ], new Set([2, 3]), { class: "link trace-row", dataset: { traceId: t.traceID }, onclick: go });
  });
  return el("div", {}, el("p", { class: "muted" }, `${traces.length} traces, newest first`),
    table(["trace (root span)", "services (spans)", "spans", "duration", "started", "trace ID"], rows, new Set([2, 3])));
}

// --- one trace: the waterfall --------------------------------------------------------------------

function spanTree(spans) {
  // [{span, depth}] in waterfall order: each span followed by its children, by start time.
  const ids = new Set(spans.map((s) => s.spanID));
  const children = new Map();
  const roots = [];
  for (const s of spans) {
    const parent = parentOf(s, ids);
    if (parent) (children.get(parent) || children.set(parent, []).get(parent)).push(s);
    else roots.push(s);
  }
  const byStart = (a, b) => a.startTime - b.startTime || a.operationName.localeCompare(b.operationName);
  const out = [];
  const walk = (span, depth) => {
    out.push({ span, depth });
    for (const c of (children.get(span.spanID) || []).sort(byStart)) walk(c, depth + 1);
  };
  roots.sort(byStart).forEach((r) => walk(r, 0));
  return out;
}

async function viewTrace(gen, traceID) {
  const body = await api("/api/traces/" + enc(traceID));
  const trace = body.data[0];
  const f = traceFacts(trace);
  const total = Math.max(f.end - f.start, 1);
  const serviceIndex = {};
  Object.keys(f.services).sort().forEach((s, i) => { serviceIndex[s] = i % 8; });
  const ticks = el("div", { class: "wf-ticks" },
    [0, 0.25, 0.5, 0.75, 1].map((q) => { const t = el("span", {}, fmtMicros(q * total)); t.style.left = q * 100 + "%"; return t; }));
  const ids = new Set(trace.spans.map((s) => s.spanID));
  const wf = el("div", { class: "waterfall", id: "waterfall", role: "table" },
    el("div", { class: "wf-head" }, el("div", { class: "span-label" }, "span"), ticks));
  for (const { span, depth } of spanTree(trace.spans)) {
    const proc = trace.processes[span.processID] || { serviceName: "?", tags: [] };
    const isError = (span.tags || []).some((t) => t.key === "error" && t.value === true);
    const label = el("div", { class: "span-label" },
      el("span", { class: "span-name" }, span.operationName), el("span", { class: "span-service" }, proc.serviceName));
    label.style.paddingLeft = 0.5 + depth * 1.1 + "em";
    const bar = el("div", { class: `span-bar svc-${serviceIndex[proc.serviceName]}` });
    const left = ((span.startTime - f.start) / total) * 100;
    bar.style.left = left + "%";
    bar.style.width = Math.max((span.duration / total) * 100, 0.15) + "%";
    const dur = el("span", { class: "span-duration" }, fmtMicros(span.duration));
    const end = left + (span.duration / total) * 100;
    if (end < 85) dur.style.left = end + "%"; // after the bar; near the right edge, before it
    else { dur.style.right = 100 - left + "%"; dur.classList.add("before"); }
    const parent = parentOf(span, ids);
    const rowEl = el("div", {
      class: "span-row" + (isError ? " error" : ""), role: "row",
      dataset: { spanId: span.spanID, depth: String(depth), parentId: parent || "" },
    }, label, el("div", { class: "span-timeline" }, bar, dur));
    let detail = null;
    rowEl.addEventListener("click", () => {
      if (detail) { detail.remove(); detail = null; rowEl.classList.remove("open"); return; }
      detail = spanDetail(span, proc, f.start, trace.traceID);
      rowEl.after(detail);
      rowEl.classList.add("open");
    });
    wf.append(rowEl);
  }
  const legend = Object.keys(serviceIndex).map((s) =>
    el("span", {}, el("span", { class: `swatch svc-${serviceIndex[s]}` }), `${s} (${f.services[s]})`));
  render(gen,
    el("h1", {}, f.root.operationName),
    el("div", { class: "summary-line" },
      el("span", {}, "trace ", el("b", { class: "mono" }, trace.traceID)),
      el("span", {}, "started ", el("b", {}, fmtTime(f.start))),
      el("span", {}, "duration ", el("b", {}, fmtMicros(f.end - f.start))),
      el("span", {}, "spans ", el("b", { id: "span-count" }, String(trace.spans.length))),
      legend),
    warnings(trace.warnings), el("p", { class: "muted" }, "Click a span for its attributes, events and links."), wf);
}

function spanDetail(span, proc, traceStart, traceID) {
  const tags = (span.tags || []).map((t) => row([el("span", { class: "mono" }, t.key), t.type, tagValue(t.value)]));
  const procTags = (proc.tags || []).map((t) => row([el("span", { class: "mono" }, t.key), tagValue(t.value)]));
  const logs = (span.logs || []).map((l) => row([fmtMicros(l.timestamp - traceStart),
    l.fields.map((x) => `${x.key}=${tagValue(x.value)}`).join("  ")]));
  const refs = (span.references || []).map((r) => row([r.refType,
    r.traceID === traceID ? "this trace" : el("a", { href: "#/trace/" + r.traceID, class: "mono" }, r.traceID),
    el("span", { class: "mono" }, r.spanID)]));
  return el("div", { class: "span-detail", dataset: { detailOf: span.spanID } },
    el("p", {}, el("b", {}, span.operationName), ` — span ${span.spanID}, starts at +${fmtMicros(span.startTime - traceStart)}, `
      + `lasts ${fmtMicros(span.duration)}`),
    tags.length ? table(["attribute", "type", "value"], tags) : el("p", { class: "muted" }, "no attributes"),
    logs.length ? [el("h3", {}, "events"), table(["at", "fields"], logs)] : null,
    refs.length ? [el("h3", {}, "references"), table(["kind", "trace", "span"], refs)] : null,
    el("h3", {}, `process: ${proc.serviceName}`), procTags.length ? table(["resource attribute", "value"], procTags) : null,
    (span.warnings || []).length ? warnings(span.warnings) : null);
}

// --- experiments ---------------------------------------------------------------------------------

async function viewExperiments(gen) {
  const list = (await api("/api/experiments")).data;
  const rows = list.map((e) => row([
    el("a", { href: "#/experiment/" + enc(e.experiment_id) }, e.experiment_id),
    String(e.control_spans), String(e.candidate_spans), String(e.other_spans), e.artifact_kinds.join(", "),
  ], new Set([1, 2, 3]), {
    class: "link experiment-row", dataset: { experimentId: e.experiment_id },
    onclick: () => { location.hash = "#/experiment/" + enc(e.experiment_id); },
  }));
  render(gen, el("h1", {}, "Experiments"),
    list.length
      ? table(["experiment", "control spans", "candidate spans", "other spans", "artifacts"], rows, new Set([1, 2, 3]))
      : el("p", { class: "muted" }, "No experiment in the store yet: `kvfleet experiment` runs one."));
}

function verdict(passed) {
  if (passed === null || passed === undefined) return el("span", { class: "badge na" }, "not evaluated");
  return passed ? el("span", { class: "badge pass" }, "pass") : el("span", { class: "badge fail" }, "fail");
}

function savingCell(saving, base) {
  const pct = base ? ` (${((saving / base) * 100).toFixed(1)} %)` : "";
  return el("span", { class: "saving " + (saving > 0 ? "pos" : saving < 0 ? "neg" : "") }, fmtNanos(saving) + pct);
}

function medianBars(c, k) {
  const top = Math.max(c, k, 1);
  const bar = (v, cls) => { const d = el("div", { class: cls }); d.style.width = (v / top) * 100 + "%"; return d; };
  return el("div", { class: "bars", title: "median: control (top), candidate (bottom)" }, bar(c, "svc-0"), bar(k, "svc-1"));
}

function card(key, value) {
  return el("div", { class: "card" }, el("div", { class: "k" }, key), el("div", { class: "v" }, value));
}

async function viewExperiment(gen, experimentID) {
  const s = (await api(`/api/experiments/${enc(experimentID)}/summary`)).data;
  const exact = s.exactness;
  const prov = s.provenance;
  const gates = s.gate_details.map((g) => row([g.name, g.kind, g.span, verdict(g.passed), g.reason], new Set(),
    { class: "gate-row", dataset: { gate: g.name } }));
  const comps = Object.entries(s.comparison_ns).map(([name, c]) => row([
    el("span", { class: "mono" }, name), `${c.n_control} / ${c.n_candidate}`, medianBars(c.control_median, c.candidate_median),
    fmtNanos(c.control_median), fmtNanos(c.candidate_median), savingCell(c.median_saving, c.control_median),
    `[${fmtNanos(c.median_saving_ci95[0])}, ${fmtNanos(c.median_saving_ci95[1])}]`,
    fmtNanos(c.control_p90), fmtNanos(c.candidate_p90), savingCell(c.p90_saving, c.control_p90),
    c.mann_whitney_p.toPrecision(3),
  ], new Set([1, 3, 4, 5, 6, 7, 8, 9, 10])));
  const pc = s.profile_contract;
  const perStepNames = [...new Set([...Object.keys(pc.spans_per_step.control || {}), ...Object.keys(pc.spans_per_step.candidate || {})])].sort();
  const perStep = perStepNames.map((n) => row([el("span", { class: "mono" }, n),
    String(pc.spans_per_step.control?.[n] ?? "–"), String(pc.spans_per_step.candidate?.[n] ?? "–")], new Set([1, 2])));
  const hashes = Object.entries(s.artifact_sha256).map(([k, v]) => row([k, el("span", { class: "mono" }, v ?? "not recorded")]));
  const json = JSON.stringify(s, null, 2);
  const download = el("a", { download: `${s.experiment_id}-summary.json`, id: "summary-download" }, "download the summary JSON");
  download.href = URL.createObjectURL(new Blob([json], { type: "application/json" }));
  render(gen,
    el("h1", {}, "Experiment ", el("span", { class: "mono", id: "experiment-id" }, s.experiment_id)),
    el("div", { class: "decision " + s.status, id: "decision" },
      el("div", { class: "status", id: "decision-status" }, s.status.replace(/_/g, " ")),
      el("div", {}, el("b", {}, "authorize: "), s.decision.authorize ? "yes" : "no"),
      el("div", {}, el("b", {}, "next: "), s.decision.next_action)),
    el("div", { class: "cards" },
      card("bitwise exact across arms", yesNo(exact.bitwise_exact)),
      card("completion tokens per arm", exact.completion_tokens_per_arm ?? "–"),
      card("gates passed", `${s.gate_details.filter((g) => g.passed).length} / ${s.gate_details.length}`),
      card("treatment", prov.sole_treatment ?? "–"),
      card("project commit", prov.project_commit ? prov.project_commit.slice(0, 12) : "–")),
    el("h2", {}, "Gates"),
    table(["gate", "kind", "span", "verdict", "why"], gates),
    el("h2", {}, "Comparisons per span (saving = control − candidate; positive: the candidate is faster)"),
    comps.length
      ? table(["span", "n (control / candidate)", "medians", "control median", "candidate median", "median saving",
        "saving 95 % CI", "control p90", "candidate p90", "p90 saving", "Mann-Whitney p"], comps,
        new Set([1, 3, 4, 5, 6, 7, 8, 9, 10]))
      : el("p", { class: "muted" }, "No span name has samples in both arms yet."),
    el("h2", {}, "Profile contract"),
    el("p", {}, `step span ${pc.step_span}: ${pc.samples_per_arm.control} control, ${pc.samples_per_arm.candidate} candidate steps; `
      + `spans per step the same in both arms: ${yesNo(pc.spans_per_step_consistent)}`),
    perStep.length ? table(["span", "per control step", "per candidate step"], perStep, new Set([1, 2])) : null,
    el("h2", {}, "Artifacts"), table(["artifact", "sha256"], hashes),
    el("h2", {}, "Methods"),
    el("ul", {}, Object.entries(prov.methods).map(([k, v]) => el("li", {}, el("b", {}, k + ": "), v))),
    el("h2", {}, "Summary JSON"),
    el("p", {}, download, el("span", { class: "muted" }, " — the document GetSummary answers, as kvfleet experiment writes it")),
    el("details", {}, el("summary", {}, "show"), el("pre", { class: "json", id: "summary-json" }, json)));
}

// --- the scheduler, from its exported tick spans ---------------------------------------------------

// The scheduler's own figures, asked now through the telemetry service (GET /api/scheduler):
// a 404 (no --scheduler) or 502 (it did not answer) leaves a note in their place.
async function liveScheduler() {
  let d;
  try {
    d = (await api("/api/scheduler")).data;
  } catch (e) {
    if (e instanceof HttpError && e.status === 401) throw e;
    return [el("h2", {}, "Live"), el("p", { class: "muted", id: "no-live" }, "No live snapshot: " + e.message)];
  }
  const t = d.telemetry;
  const n = (x, digits = 0) => (x === undefined || x === null ? "–" : Number(x).toFixed(digits));
  const workers = d.workers.map((w) => row([w.worker_id, w.address, w.live ? "live" : "dead", w.model, w.device,
    n(w.sessions), `${n(w.kv_tokens)} / ${n(w.kv_capacity_tokens)}`, n(w.reserved_tokens)], new Set([5, 6, 7]),
  { class: "worker-row", dataset: { worker: w.worker_id, live: String(Boolean(w.live)) } }));
  return [
    el("h2", {}, "Live"),
    el("p", { class: "muted" }, `GetTelemetry and ListWorkers of the scheduler at ${d.scheduler}, asked now.`),
    el("div", { class: "cards", id: "live-snapshot" },
      card("tick", n(t.ticks)), card("active sessions", n(t.active_sessions)), card("queued", n(t.queue_depth)),
      card("live workers", el("span", { id: "live-workers" }, n(t.live_workers))),
      card("decode tok/s", n(t.decode_tokens_per_sec, 1)), card("prefill tok/s", n(t.prefill_tokens_per_sec, 1)),
      card("KV pressure", n(t.kv_pressure, 3)), card("rejected", n(t.rejected_admissions_total))),
    table(["worker", "address", "state", "model", "device", "sessions", "KV tokens / capacity", "reserved"], workers,
      new Set([5, 6, 7])),
  ];
}

async function viewScheduler(gen) {
  const live = await liveScheduler();
  const services = (await api("/api/services")).data;
  const schedulers = services.filter((s) => s.includes("scheduler"));
  const ticks = [];
  for (const service of schedulers) {
    const body = await api("/api/traces?" + new URLSearchParams({ service, operation: "tick", limit: "40" }));
    for (const t of body.data) {
      for (const s of t.spans) {
        if (s.operationName !== "tick" || (t.processes[s.processID] || {}).serviceName !== service) continue;
        const tags = Object.fromEntries((s.tags || []).map((x) => [x.key, x.value]));
        ticks.push({ span: s, traceID: t.traceID, service, tags });
      }
    }
  }
  const seen = new Set();
  const latest = ticks.sort((a, b) => b.span.startTime - a.span.startTime)
    .filter((t) => !seen.has(t.span.spanID) && seen.add(t.span.spanID)).slice(0, 60);
  const note = el("p", { class: "muted" },
    "The latest ticks the scheduler exported as spans (their kvfleet.tick.* attributes), newest first. "
    + "This is what the store holds; the live figures above are the scheduler's own. Refreshed every 5 s.");
  if (!latest.length) {
    render(gen, el("h1", {}, "Scheduler"), live, el("h2", {}, "Exported ticks"), note,
      el("p", { class: "muted", id: "no-ticks" }, "No tick span in the store yet."));
  } else {
    const t0 = latest[0];
    const chart = el("div", { class: "chart", title: "decode batch per tick, oldest left" },
      latest.slice().reverse().map((t) => {
        const d = el("div", { title: `tick ${t.tags["kvfleet.tick"]}: decode batch ${t.tags["kvfleet.tick.decode_batch"]}` });
        const top = Math.max(...latest.map((x) => Number(x.tags["kvfleet.tick.decode_batch"]) || 0), 1);
        d.style.height = ((Number(t.tags["kvfleet.tick.decode_batch"]) || 0) / top) * 100 + "%";
        return d;
      }));
    const rows = latest.map((t) => row([
      el("a", { href: "#/trace/" + t.traceID }, String(t.tags["kvfleet.tick"] ?? "?")), fmtTime(t.span.startTime),
      fmtMicros(t.span.duration), String(t.tags["kvfleet.tick.decode_batch"] ?? "–"),
      String(t.tags["kvfleet.tick.prefill_tokens"] ?? "–"), t.tags["experiment.arm"] ?? "", t.service,
    ], new Set([0, 2, 3, 4]), { class: "tick-row", dataset: { tick: String(t.tags["kvfleet.tick"] ?? "") } }));
    render(gen, el("h1", {}, "Scheduler"), live, el("h2", {}, "Exported ticks"), note,
      el("div", { class: "cards", id: "latest-tick" },
        card("latest tick", String(t0.tags["kvfleet.tick"] ?? "?")),
        card("exported", fmtAgo(t0.span.startTime + t0.span.duration)),
        card("decode batch", String(t0.tags["kvfleet.tick.decode_batch"] ?? "–")),
        card("prefill tokens", String(t0.tags["kvfleet.tick.prefill_tokens"] ?? "–")),
        card("tick duration", fmtMicros(t0.span.duration))),
      el("h2", {}, "Decode batch per tick"), chart,
      el("h2", {}, "Ticks"),
      table(["tick", "started", "duration", "decode batch", "prefill tokens", "arm", "service"], rows, new Set([0, 2, 3, 4])));
  }
  refreshTimer = setTimeout(() => { if (gen === generation) route(); }, 5000);
}

// --- navigation ----------------------------------------------------------------------------------

function render(gen, ...nodes) {
  if (gen !== generation) return; // the user went elsewhere meanwhile
  main.replaceChildren(...nodes.flat().filter((n) => n !== null && n !== undefined && n !== ""));
}

const ROUTES = [
  [/^#\/traces(?:\?(.*))?$/, "traces", (gen, m) => viewTraces(gen, m[1])],
  [/^#\/trace\/([0-9a-fA-F]{1,32})$/, "traces", (gen, m) => viewTrace(gen, m[1])],
  [/^#\/experiments$/, "experiments", (gen) => viewExperiments(gen)],
  [/^#\/experiment\/(.+)$/, "experiments", (gen, m) => viewExperiment(gen, decodeURIComponent(m[1]))],
  [/^#\/scheduler$/, "scheduler", (gen) => viewScheduler(gen)],
];

async function route() {
  clearTimeout(refreshTimer);
  const gen = ++generation;
  const hash = location.hash || "#/traces";
  const found = ROUTES.map(([re, nav, view]) => [hash.match(re), nav, view]).find(([m]) => m);
  if (!found) { location.hash = "#/traces"; return; }
  const [match, nav, view] = found;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.nav === nav);
  try {
    await view(gen, match);
  } catch (err) {
    render(gen, errorBox(err));
  }
  if (gen === generation) document.body.dataset.loaded = hash; // tests wait on this
}

document.getElementById("token").value = sessionStorage.getItem(TOKEN_KEY) || "";
document.getElementById("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const token = document.getElementById("token").value.trim();
  if (token) sessionStorage.setItem(TOKEN_KEY, token); else sessionStorage.removeItem(TOKEN_KEY);
  route();
});
window.addEventListener("hashchange", route);
route();
