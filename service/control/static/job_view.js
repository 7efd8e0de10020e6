// The selected job's state around its charts: its phase until the first step record
// (the words `dmuon-svc submit --follow` uses), a cancel button, the log view (the last
// lines of its driver's output), and one colour per memory kind for every memory chart.
// A classic script: app.js calls these; MEMORY_KINDS comes from /memory-kinds.js.
"use strict";

const LOG_LINES = 200;
const TERMINAL = ["SUCCEEDED", "FAILED", "STOPPED"];
// Plotly's default colour cycle, given to the kinds in dmuon.MEMORY_KINDS order, so the
// planner's prediction and the measured figures draw a kind in the same colour
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const PHASES = {
  PENDING: ["placing", "queued until the service hands the job to Ray"],
  RUNNING: ["building", "Ray runs the job: its workers start, build and shard the model, " +
    "then run the first step"],
};

// kinds in MEMORY_KINDS order, then any other kind by name; each with its own colour
function memoryKinds(perRank) {
  const seen = new Set(perRank.flatMap((m) => Object.keys(m)));
  const known = MEMORY_KINDS.filter((k) => seen.has(k));
  return [...known, ...[...seen].filter((k) => !MEMORY_KINDS.includes(k)).sort()];
}

function kindColour(kind) {
  let i = MEMORY_KINDS.indexOf(kind);
  if (i < 0) i = MEMORY_KINDS.length + [...kind].reduce((h, c) => h + c.charCodeAt(0), 0);
  return PALETTE[i % PALETTE.length];
}

// ---- the phase before the first step ------------------------------------------------
function waitingFor(job) {
  if (job.steps.size) return null;
  if (job.dry_run) return "dry run: planned only, nothing ran";
  if (!job.caughtUp) return "reading the step records";
  if (PHASES[job.status]) return "waiting for the first step";
  return "no step was recorded";
}

// PENDING: placing; RUNNING until its first record: building (with the seconds so far)
function showPhase(job) {
  const box = document.getElementById("job-phase");
  const known = job.caughtUp || job.status === "PENDING";
  const phase = known && !job.steps.size && !job.dry_run && PHASES[job.status];
  box.hidden = !phase;
  box.dataset.phase = phase ? phase[0] : "";
  if (!phase) return;
  if (job.status === "RUNNING" && job.runningSince == null) {
    const entry = (job.history || []).find((h) => h.status === "RUNNING");
    job.runningSince = entry ? entry.time : Date.now() / 1000;
  }
  const since = job.status === "RUNNING" ? job.runningSince : job.created;
  const seconds = Math.max(0, Math.round(Date.now() / 1000 - since));
  box.textContent = `${phase[0]} (${seconds} s): ${phase[1]}`;
}

// empty charts without axes while there is nothing to draw, saying why
function drawWaiting(ids, text) {
  for (const id of ids) {
    Plotly.react(id, [], {
      margin: { l: 10, r: 10, t: 10, b: 10 },
      xaxis: { visible: false }, yaxis: { visible: false },
      annotations: [{ text, showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5,
        font: { color: "#5b6675" } }],
    }, { displayModeBar: false, responsive: true });
  }
}

// ---- cancel ---------------------------------------------------------------------------
function showActions(job) {
  const ended = job.dry_run || !PHASES[job.status];
  document.getElementById("cancel-job").hidden = ended;
  if (ended) document.getElementById("action-note").textContent = "";
}

async function cancelJob() {
  const job = state.job;
  if (!job || !confirm(`Cancel ${job.name} (${job.id})?`)) return;
  const button = document.getElementById("cancel-job");
  button.disabled = true;
  try {
    const done = await (await api(`/v1/jobs/${job.id}/cancel`, { method: "POST" })).json();
    if (state.job?.id === done.id) {
      Object.assign(state.job, { status: done.status, message: done.message });
      state.job.dirty = true;
    }
    await refreshJobs();
  } catch (err) {
    document.getElementById("action-note").textContent = `cancel failed: ${err.message}`;
  } finally {
    button.disabled = false;
  }
}

// ---- the log view ---------------------------------------------------------------------
const ANSI = /\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-_]/g;

async function refreshLog() {
  const job = state.job;
  if (!job || !document.getElementById("log-view").open) return;
  const note = document.getElementById("log-note");
  try {
    const text = await (await api(`/v1/jobs/${job.id}/logs?tail=${LOG_LINES}`)).text();
    if (state.job?.id !== job.id) return;  // another job was selected meanwhile
    const pre = document.getElementById("job-log");
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.textContent = text.replace(ANSI, "").replace(/\n$/, "");
    pre.dataset.job = job.id;
    if (atEnd) pre.scrollTop = pre.scrollHeight;
    note.textContent = text ? `read ${new Date().toLocaleTimeString()}` : "no output yet";
  } catch (err) {
    note.textContent = err.message;
  }
}

function clearLog() {
  const pre = document.getElementById("job-log");
  pre.textContent = "";
  delete pre.dataset.job;
  document.getElementById("log-note").textContent = "";
}

document.getElementById("cancel-job").addEventListener("click", () => cancelJob());
document.getElementById("log-view").addEventListener("toggle", () => refreshLog());
setInterval(() => {  // a running job's log grows
  if (state.job && !TERMINAL.includes(state.job.status)) refreshLog();
}, 3000);
