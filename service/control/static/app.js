// The dashboard: the job list, and per job the partition (owners, memory) and the live
// metrics from the event stream, drawn with Plotly.
"use strict";

const state = { token: localStorage.getItem("dmuonToken") || "", job: null, stream: null };

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (state.token) headers.Authorization = `Bearer ${state.token}`;
  const resp = await fetch(path, { ...options, headers });
  if (resp.status === 401) {
    askForToken();
    throw new Error("this service needs an API token");
  }
  if (!resp.ok) throw new Error(`${path}: ${resp.status}`);
  return resp;
}

// the token form, in the header (which stays in view): shown and focused on a 401
function askForToken() {
  const form = document.getElementById("token-form");
  if (!form.hidden) return;
  form.hidden = false;
  document.getElementById("token").focus();
}

const fmtBytes = (n) => {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
};
const esc = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const rankLabels = (n) => Array.from({ length: n }, (_, r) => `rank ${r}`);

// ---- job list ---------------------------------------------------------------------
async function refreshJobs() {
  const jobs = await (await api("/v1/jobs?limit=50")).json();
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren(...jobs.map((job) => {
    const row = document.createElement("tr");
    row.dataset.id = job.id;
    row.className = job.id === state.job?.id ? "selected" : "";
    const created = new Date(job.created * 1000).toLocaleTimeString();
    row.innerHTML = `<td title="${esc(job.id)}">${esc(job.name)}</td>` +
      `<td>${statusBadge(job)}</td><td>${created}</td>`;
    row.addEventListener("click", () => selectJob(job.id));
    return row;
  }));
  const wanted = new URLSearchParams(location.hash.slice(1)).get("job");
  if (!state.job && !state.selecting && jobs.length) selectJob(wanted || (jobs.find((j) => j.status === "RUNNING") || jobs[0]).id);
  if (state.job) {
    const mine = jobs.find((j) => j.id === state.job.id);
    if (mine) {
      Object.assign(state.job, { status: mine.status, reason: mine.reason, message: mine.message });
      showFacts(state.job);
    }
  }
}

// A dry run is stored as SUCCEEDED with dry_run true: it is shown as what it is.
function statusBadge(job) {
  if (job.dry_run) {
    return `<span class="status DRYRUN" title="planned only: nothing ran on Ray">DRY RUN</span>`;
  }
  const why = job.status === "FAILED" && job.reason ? ` title="${esc(reasonLine(job.reason))}"` : "";
  return `<span class="status ${esc(job.status)}"${why}>${esc(job.status)}</span>`;
}

function reasonLine(reason) {
  const where = ["rank", "step"].filter((k) => reason[k] != null).map((k) => `${k} ${reason[k]}`);
  return `${reason.type}: ${reason.message}` + (where.length ? ` (${where.join(", ")})` : "");
}

// Why a FAILED job failed: its first failing rank's exception (type, message, rank, step,
// the innermost frames), else the message the control plane stored.
function showReason(job) {
  const box = document.getElementById("job-reason");
  const reason = job.status === "FAILED" ? job.reason : null;
  box.hidden = job.status !== "FAILED" || !(reason || job.message);
  if (box.hidden) return;
  box.querySelector(".reason-type").textContent = reason ? reason.type : "FAILED";
  box.querySelector(".reason-message").textContent = reason ? reason.message : job.message;
  const where = reason ? [["rank", reason.rank], ["step", reason.step], ["phase", reason.phase]]
    .filter(([, v]) => v != null).map(([k, v]) => `${k} ${v}`) : [];
  box.querySelector(".reason-where").textContent = where.join(" \u00b7 ");
  box.querySelector(".reason-frames").textContent = (reason?.frames || []).join("\n");
  box.querySelector(".reason-frames").hidden = !reason?.frames?.length;
}

// ---- one job ------------------------------------------------------------------------
async function selectJob(id) {
  if (state.stream) state.stream.abort();
  state.selecting = true;
  history.replaceState(null, "", `#job=${id}`);
  const [job, partition] = await Promise.all([
    api(`/v1/jobs/${id}`).then((r) => r.json()),
    api(`/v1/jobs/${id}/partition`).then((r) => r.json()),
  ]);
  state.job = { ...job, partition, steps: new Map(), latest: new Map(), dirty: false };
  state.selecting = false;
  clearLog();
  refreshLog();
  document.querySelectorAll("#jobs tbody tr").forEach((row) => {
    row.className = row.dataset.id === id ? "selected" : "";
  });
  showFacts(state.job);
  drawOwnership(partition);
  drawMemory(partition.ranks.map((r) => r.memory), "predicted by the planner");
  drawOwners(partition);
  drawRoutes(partition);
  drawMetrics();
  followEvents(id);
}

function showFacts(job) {
  document.getElementById("job-title").textContent = `${job.name} (${job.id})`;
  document.getElementById("job-title").dataset.status = job.status;
  const p = job.partition;
  const eta = etaText(job);  // a running job's alone
  const facts = {
    status: job.dry_run ? "dry run (planned, never run)" : job.status,
    model: modelName(job.spec.model), steps: job.spec.steps,
    layout: meshText(p.layout),
    "planned on": plannedOn(p.inventory),
    mode: p.modes ? `${p.modes.dmuon} (FSDP2 ${p.modes.fsdp})` : "-",
    imbalance: p.imbalance != null ? p.imbalance.toFixed(4) : "planned by the job",
    routes: routeCounts(p.optimizer_split?.routes) || "-",
    "last step": job.steps?.size || 0,
    "skipped (non-finite)": skippedSteps(job),
    optimizer: optimizerText(job.spec),
    ...(eta ? { ETA: eta } : {}),
    ...layoutFacts(job),
    ...pipelineFacts(p.pipeline),
  };
  document.getElementById("job-facts").innerHTML = Object.entries(facts)
    .map(([k, v]) => `<div><dt>${k}</dt><dd>${esc(v)}</dd></div>`).join("");
  document.getElementById("job-title").dataset.dryRun = job.dry_run ? "true" : "false";
  showReason(job);
  showPhase(job);
  showActions(job);
}

// An elastic job's range, and every start of a job's worker group: the layout it ran
// from which step, and for a resize or restart why and how many steps it lost.
function layoutFacts(job) {
  const facts = {};
  const range = (job.partition.elastic || []).filter((e) => !e.refused);
  if (range.length) facts["elastic layouts"] = range.map((e) => meshText(e.layout, false)).join(", ");
  const starts = job.layouts || [];
  if (starts.length) {
    const last = starts[starts.length - 1];
    facts.running = last.layout.join(" x ");
    facts["layout history"] = starts.map((e) => `${e.layout.join(" x ")} from step `
      + `${e.resumed_from + 1}` + (e.previous ? ` (${e.reason}; ${e.steps_lost} step${e.steps_lost === 1 ? "" : "s"} lost)` : ""))
      .join("; ");
  }
  return facts;
}

// A pipeline-parallel plan: each stage's layers, pp rank (its ranks) and NS load
function pipelineFacts(pipe) {
  if (!pipe) return {};
  const ranks = pipe.ranks.map((r) => r.ranks.join("-"));
  return {
    pipeline: `${pipe.schedule}, ${pipe.micro_batches} micro-batches, bubble `
      + `${pipe.bubble.toFixed(3)}; slowest stage ${pipe.slowest_s.toFixed(3)} s `
      + `(by layer count ${pipe.by_count.slowest_s.toFixed(3)} s)`,
    stages: pipe.stages.map((s) => `${s.stage}: layers ${s.layers[0]}-${s.layers[1] - 1}`
      + `${s.embedding ? " + embedding" : ""}${s.head ? " + head" : ""} on ranks `
      + `${ranks[s.pp_rank]}, NS ${(s.ns_flops_per_owner / 1e12).toFixed(2)} TFLOP/owner`)
      .join("; "),
  };
}

// R x N (replicate x shard), or R x N x T (replicate x shard x tp) under tensor
// parallelism, and the EP degree where experts are split; a plan stored before them has
// no tp or ep
function meshText(layout, named = true) {
  const tp = layout.tp || 1;
  const ep = layout.ep || 1;
  const pp = layout.pp || 1;
  const dims = [...(pp > 1 ? [pp] : []), layout.replicate, layout.shard,
    ...(tp > 1 ? [tp] : [])].join(" x ") + (ep > 1 ? `, ep ${ep}` : "");
  return named ? `${dims} (${pp > 1 ? "pp x " : ""}replicate x shard${tp > 1 ? " x tp" : ""})`
    : dims;
}

// each rank's label: its number and (r,s) or (r,s,t) coordinate, and its EP coordinate
// (s mod P: the EP group is P consecutive shard ranks) where experts are split
const rankCoords = (ranks, ep = 1) => ranks.map((r) => `rank ${r.rank} (${r.coord.join(",")})`
  + (ep > 1 ? ` ep ${r.coord[1] % ep}` : ""));

function skippedSteps(job) {
  // each record carries its rank's count so far: every rank skips the same steps
  const counts = [...(job.steps?.values() || [])].flat().map((r) => r.skipped_steps || 0);
  return counts.length ? Math.max(...counts) : 0;
}

function plannedOn(inv) {
  if (!inv) return "-";
  const nodes = `${inv.nodes} node${inv.nodes === 1 ? "" : "s"}`;
  return inv.source === "cluster" ? `the cluster's ${nodes}`
    : `${nodes} of ${inv.cpus_per_node} CPUs, assumed (${inv.reason})`;
}

// an owner is a (replicate, shard) slot: under tensor parallelism each of its T ranks
// (rank = slot x T + t) holds its TP shard of the slot's matrices
function ownedBy(partition) {
  const byRank = partition.ranks.map(() => []);
  const T = partition.tp_size || 1;
  for (const [name, p] of Object.entries(partition.params || {})) {
    for (let t = 0; t < T; t++) byRank[p.owner * T + t]?.push({ name, ...p });
  }
  return byRank;
}

function drawOwnership(partition) {
  const owned = ownedBy(partition);
  const ranks = partition.ranks;
  Plotly.react("ownership-chart", [{
    type: "bar", name: "elements", x: rankCoords(ranks, partition.ep_size || 1),
    y: ranks.map((r) => r.owned_elements), marker: { color: "#2c6fb7" },
    customdata: ranks.map((r, i) => [(r.ns_flops / 1e9).toFixed(3), owned[i].length]),
    hovertemplate: "%{x}: %{y:,} elements<br>NS %{customdata[0]} GFLOP" +
      "<br>%{customdata[1]} matrices<extra></extra>",
  }], { margin: MARGIN, yaxis: { title: { text: "elements" } } }, CHART);
}

// a unit as the partition (REST) names it, less its layer and a trailing .weight:
// q_proj, or an expert slice gate_proj[0:2] (its name's last part, not "experts")
function unitLabel(name) {
  const parts = name.split(".");
  return ["weight", "bias"].includes(parts[parts.length - 1]) && parts.length > 1
    ? parts[parts.length - 2] : parts[parts.length - 1];
}

function drawOwners(partition) {
  const box = document.getElementById("owners");
  box.replaceChildren(...ownedBy(partition).map((params, rank) => {
    const div = document.createElement("div");
    const layers = {};
    for (const p of params) (layers[p.boundary] ||= []).push(unitLabel(p.name));
    const where = partition.ranks[rank] ? ` (${partition.ranks[rank].coord.join(",")})` : "";
    div.innerHTML = `<h3>rank ${rank}${esc(where)}: ${params.length} matrices</h3>` + Object.entries(layers)
      .map(([layer, names]) => `<div>${esc(layer)}: ${esc(names.join(", "))}</div>`).join("");
    return div;
  }));
}

const METRIC_CHARTS = ["loss-chart", "throughput-chart", "lr-chart", "qk-chart",
  "steptime-chart", "bytes-chart"];

// over the ranks with a finite loss (a non-finite one is stored as null), as the
// trackers log it; null when no rank has one
function meanLoss(recs) {
  const losses = recs.map((r) => r.loss).filter((v) => v != null);
  return losses.length ? losses.reduce((a, b) => a + b, 0) / losses.length : null;
}

function drawMetrics() {
  const job = state.job;
  const waiting = waitingFor(job);
  if (waiting) {
    document.getElementById("qk-figure").hidden = qkTau(job) == null;
    drawWaiting(METRIC_CHARTS, waiting);
    showFacts(job);
    return;
  }
  drawSteps(job);
  showFacts(job);
}

function drawSteps(job) {
  const steps = [...job.steps.keys()].sort((a, b) => a - b);
  const first = (s, key) => job.steps.get(s).find((r) => r[key] != null)?.[key] ?? null;
  const valSteps = steps.filter((s) => first(s, "val_loss") != null);
  Plotly.react("loss-chart", [{
    type: "scatter", mode: "lines+markers", name: "loss", x: steps, cliponaxis: false,
    y: steps.map((s) => meanLoss(job.steps.get(s))),
  }, {
    type: "scatter", mode: "lines+markers", name: "val loss", x: valSteps, cliponaxis: false,
    y: valSteps.map((s) => first(s, "val_loss")),
  }], { margin: MARGIN, xaxis: stepAxis(steps) }, CHART);
  drawThroughput(steps, first);
  const lrKinds = [...new Set(steps.flatMap((s) => Object.keys(first(s, "lr") || {})))];
  Plotly.react("lr-chart", [...lrKinds.map((kind) => ({
    type: "scatter", mode: "lines", name: `lr ${kind}`, x: steps,
    y: steps.map((s) => (first(s, "lr") || {})[kind] ?? null),
  })), {
    type: "scatter", mode: "lines", name: "grad norm", x: steps, yaxis: "y2",
    y: steps.map((s) => first(s, "grad_norm")),
  }], { margin: RIGHT_MARGIN, legend: LEGEND_BELOW, xaxis: stepAxis(steps),
         yaxis2: RIGHT_AXIS }, CHART);
  drawQkClip(job, steps, first);
  const world = job.partition.ranks.length;
  Plotly.react("steptime-chart", [...Array(world).keys()].map((rank) => ({
    type: "scatter", mode: "lines", name: `rank ${rank}`, x: steps,
    y: steps.map((s) => job.steps.get(s).find((r) => r.rank === rank)?.step_time_s ?? null),
  })), { margin: MARGIN, xaxis: stepAxis(steps), yaxis: { title: { text: "seconds" } } },
  CHART);
  const latest = [...Array(world).keys()].map((rank) => job.latest.get(rank));
  if (world && latest.every(Boolean)) {  // a deferred plan has no ranks yet
    drawMemory(latest.map((r) => r.memory), `measured at step ${latest[0].step}; `
      + "bars: after the step", latest.map((r) => r.peak_memory || {}));
    const phases = [...new Set(latest.flatMap((r) => Object.keys(r.bytes)))];
    Plotly.react("bytes-chart", phases.map((phase) => ({
      type: "bar", name: phase, x: rankLabels(world), y: latest.map((r) => r.bytes[phase] || 0),
      hovertemplate: `%{x} ${phase}: %{y:,} B<extra></extra>`,
    })), { barmode: "stack", margin: MARGIN, legend: { orientation: "h", y: -0.2 } }, CHART);
  }
}

// MFU needs a peak (the GPU's, or the spec's metrics.peak_tflops): without one (CPUs)
// it is null and gets no axis
function drawThroughput(steps, first) {
  const mfu = steps.map((s) => first(s, "mfu"));
  const traces = [{
    type: "scatter", mode: "lines", name: "tokens/s (all ranks)", x: steps,
    y: steps.map((s) => first(s, "tokens_per_s_total")),
  }];
  const layout = { margin: MARGIN, xaxis: stepAxis(steps) };
  if (mfu.some((v) => v != null)) {
    traces.push({ type: "scatter", mode: "lines", name: "MFU", x: steps, yaxis: "y2", y: mfu });
    Object.assign(layout, { margin: RIGHT_MARGIN, legend: LEGEND_BELOW, yaxis2: RIGHT_AXIS });
  }
  document.getElementById("throughput-caption").textContent =
    `Throughput: tokens/s of all ranks${layout.yaxis2 ? ", MFU (right)" : ""}`;
  Plotly.react("throughput-chart", traces, layout, CHART);
}

function onMetrics(rec) {
  const job = state.job;
  if (!job.steps.has(rec.step)) job.steps.set(rec.step, []);
  const recs = job.steps.get(rec.step);
  if (!recs.some((r) => r.rank === rec.rank)) recs.push(rec);
  if ((job.latest.get(rec.rank)?.step ?? -1) <= rec.step) job.latest.set(rec.rank, rec);
  if (rec.layout_event && !(job.layouts || []).some((e) => e.step === rec.step)) {
    job.layouts = [...(job.layouts || []), { step: rec.step, ...rec.layout_event }];
  }
  job.dirty = true;
}

// Server-sent events read with fetch (EventSource cannot send the Authorization header).
async function followEvents(id) {
  const controller = new AbortController();
  state.stream = controller;
  let lastId = 0;
  while (!controller.signal.aborted) {
    try {
      const resp = await api(`/v1/jobs/${id}/events`,
        { signal: controller.signal, headers: { "Last-Event-ID": String(lastId) } });
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = parseEvent(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
          if (event.id) lastId = Number(event.id);
          if (event.type === "metrics") onMetrics(JSON.parse(event.data));
          if (event.type === "status") Object.assign(state.job, JSON.parse(event.data));
          // the stream sends the stored records before its first status event; drawn
          // now, so the charts and the phase line never disagree
          if (event.type === "status") {
            Object.assign(state.job, { caughtUp: true, dirty: false });
            drawMetrics();
          }
          if (event.type === "status" && TERMINAL.includes(state.job.status)) {
            refreshLog();  // the driver's last lines, now complete
            return;
          }
        }
      }
    } catch (err) {
      if (controller.signal.aborted) return;
      await new Promise((r) => setTimeout(r, 2000));  // the service restarts: reconnect
    }
  }
}

function parseEvent(block) {
  const event = { type: "message", data: "", id: null };
  for (const line of block.split("\n")) {
    const [field, ...rest] = line.split(":");
    const value = rest.join(":").replace(/^ /, "");
    if (field === "event") event.type = value;
    else if (field === "data") event.data += value;
    else if (field === "id") event.id = value;
  }
  return event;
}

// ---- start --------------------------------------------------------------------------
document.getElementById("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.token = document.getElementById("token").value;
  localStorage.setItem("dmuonToken", state.token);
  document.getElementById("token-form").hidden = true;
  refreshJobs().catch(() => {});
  refreshLog();  // an open log view that was refused shows the log now
});
api("/version").then((r) => r.json()).then((v) => {
  document.getElementById("version").textContent = `dmuon ${v.dmuon} · torch ${v.torch}`;
}).catch(() => {});
setInterval(() => {
  if (state.job?.dirty) { state.job.dirty = false; drawMetrics(); }
  else if (state.job) showPhase(state.job);  // its seconds count on
}, 500);
const poll = () => refreshJobs().catch((err) => console.warn(err.message));
poll();
setInterval(poll, 3000);
