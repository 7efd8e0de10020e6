// The step charts' shared pieces: margins and axes (round ticks, the steps run on x), the
// QK-clip chart, the memory chart with each rank's peak within the step, and the job
// header's optimizer and ETA. A classic script: app.js calls these.
"use strict";

const CHART = { displayModeBar: false, responsive: true };
const MARGIN = { l: 60, r: 10, t: 10, b: 40 };
// a chart with a right axis: room for its tick labels, and the legend under the plot
// (at plotly's default place, right of the plot, it covered those labels). Plotly gives
// an overlaying axis tickmode "sync" (its ticks at the left axis's grid lines: 9.73,
// 7.5, 5.27, ...): "auto" picks round values, and that axis draws no grid of its own.
const RIGHT_AXIS = { overlaying: "y", side: "right", automargin: true, tickmode: "auto",
  nticks: 6, showgrid: false, zeroline: false };
// the legend at the figure's foot, below the x axis's title (not over it)
const RIGHT_MARGIN = { ...MARGIN, r: 60, b: 80 };
const LEGEND_BELOW = { orientation: "h", x: 0, y: 0, yref: "container", yanchor: "bottom" };

// whole steps only, at most about eight ticks, from the first step run to the last
// (autorange pads a lines+markers chart to 0..21 for 20 steps)
function stepAxis(steps, title = "step") {
  const lo = steps.length ? steps[0] : 0;
  const hi = steps.length ? steps[steps.length - 1] : 1;
  return { title: { text: title }, tickformat: "d",
    range: lo < hi ? [lo, hi] : [lo - 0.5, hi + 0.5],
    dtick: Math.max(1, Math.ceil(steps.length / 8)) };
}

// ---- QK-clip --------------------------------------------------------------------------
const qkTau = (job) => job.spec?.optimizer?.qk_clip?.tau ?? null;

// shown for a job with QK-clip: the step's largest max logit against tau (a dashed
// line), and the heads whose q/k rows were scaled (bars, right axis)
function drawQkClip(job, steps, first) {
  const tau = qkTau(job);
  const maxLogit = steps.map((s) => first(s, "max_logit"));
  const heads = steps.map((s) => first(s, "clipped_heads"));
  const figure = document.getElementById("qk-figure");
  figure.hidden = tau == null && !maxLogit.some((v) => v != null);
  if (figure.hidden) return;
  const traces = [{
    type: "scatter", mode: "lines", name: "max logit", x: steps, y: maxLogit,
  }, {
    type: "bar", name: "clipped heads", x: steps, yaxis: "y2", marker: { color: "#d6272855" },
    y: heads,
  }];
  if (tau != null && steps.length) {
    const ends = [steps[0], steps[steps.length - 1]];
    traces.splice(1, 0, { type: "scatter", mode: "lines", name: `tau ${tau}`, x: ends,
      y: [tau, tau], line: { dash: "dash", color: "#d62728" }, hoverinfo: "name" });
  }
  Plotly.react("qk-chart", traces, { margin: RIGHT_MARGIN, legend: LEGEND_BELOW,
    xaxis: stepAxis(steps), yaxis: { title: { text: "max logit" }, rangemode: "tozero" },
    // whole heads: ticks 1 apart (or a round multiple), never 0, 1, 1, 2
    yaxis2: { ...RIGHT_AXIS, title: { text: "heads" }, rangemode: "tozero", tickmode: "linear",
      tick0: 0, dtick: Math.max(1, Math.ceil(Math.max(0, ...heads) / 5)) },
  }, CHART);
}

// ---- memory -----------------------------------------------------------------------------
// After the step (stacked by kind) and, where the records have it, each rank's peak
// within the step: the kinds with the packed buffers at their high-water mark (Z3 frees
// them all by the step's end, so the bars alone never show them), and a GPU's peak
// allocated bytes.
function drawMemory(perRank, source, peaks = []) {
  document.getElementById("memory-caption").textContent = `Memory per rank by kind (${source})`;
  const bars = memoryKinds(perRank).map((kind) => ({
    type: "bar", name: kind, x: rankLabels(perRank.length), marker: { color: kindColour(kind) },
    y: perRank.map((m) => m[kind] || 0),
    hovertemplate: `%{x} ${kind}: %{y:,} B<extra></extra>`,
  }));
  const total = (m) => Object.values(m).reduce((a, b) => a + b, 0);
  const dmuonPeak = perRank.map((m, r) => peaks[r]?.packed_buffers == null ? null
    : total(m) - (m.packed_buffers || 0) + peaks[r].packed_buffers);
  const marks = [["peak in step", dmuonPeak, "diamond"],
    ["GPU peak allocated", perRank.map((_, r) => peaks[r]?.allocated ?? null), "x"]]
    .filter(([, y]) => y.some((v) => v != null)).map(([name, y, symbol]) => ({
      type: "scatter", mode: "markers", name, x: rankLabels(perRank.length), y,
      marker: { symbol, size: 11, color: "#1b2430" },
      hovertemplate: `%{x} ${name}: %{y:,} B<extra></extra>`,
    }));
  Plotly.react("memory-chart", [...bars, ...marks], { barmode: "stack", margin: MARGIN,
    legend: { orientation: "h", y: -0.2 }, yaxis: { title: { text: "bytes" } } }, CHART);
}

// ---- the job header ------------------------------------------------------------------------
// variant, Newton-Schulz backend and dtype (dmuon.Muon's default: by device), QK-clip
function optimizerText(spec) {
  const o = spec?.optimizer;
  if (!o) return "-";
  const ns = `NS ${o.ns_backend} ${o.ns_dtype || "dtype by device"}`;
  return `${o.variant}, ${ns}` + (o.qk_clip ? `, QK-clip tau ${o.qk_clip.tau}` : "");
}

// a running job's time left: the steps still to run at the median step time so far
// (a step's time is its slowest rank's); null until a step has a time
function etaText(job) {
  if (job.status !== "RUNNING" || !job.steps?.size) return null;
  const times = [...job.steps.values()].map((recs) => Math.max(
    ...recs.map((r) => r.step_time_s ?? 0))).filter((t) => t > 0).sort((a, b) => a - b);
  if (!times.length) return null;
  const median = times[Math.floor(times.length / 2)];
  const left = Math.max(0, job.spec.steps - Math.max(...job.steps.keys()));
  const seconds = Math.round(left * median);
  const at = new Date(Date.now() + seconds * 1000).toLocaleTimeString();
  return `${durationText(seconds)} (${left} steps at ${median.toFixed(2)} s, about ${at})`;
}

function durationText(seconds) {
  const h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60);
  const s = seconds % 60;
  return h ? `${h} h ${m} min` : m ? `${m} min ${s} s` : `${s} s`;
}
