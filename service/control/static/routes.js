// Each parameter's route (the plan's optimizer_split.routes): muon (Newton-Schulz on an
// owner), adamw (AdamW on an owner: broadcast/reduce) or sharded_adamw (FSDP2's shards),
// with the dtypes dmuon.param_policy set (a dash: not set, the param's own) and the
// overrides that matched. A classic script: app.js calls these; esc is app.js's.
"use strict";

const ROUTE_DTYPES = ["param_dtype", "grad_dtype", "output_dtype", "master_dtype", "optim_dtype"];

// "12 muon, 5 adamw, 2 sharded_adamw", in that order; "" for a plan stored before routes
function routeCounts(routes) {
  const counts = {};
  for (const r of Object.values(routes || {})) counts[r.route] = (counts[r.route] || 0) + 1;
  return ["muon", "adamw", "sharded_adamw"].filter((k) => counts[k])
    .map((k) => `${counts[k]} ${k}`).join(", ");
}

function drawRoutes(partition) {
  const routes = partition.optimizer_split?.routes || {};
  const figure = document.getElementById("routes-figure");
  figure.hidden = !Object.keys(routes).length;
  const head = ["parameter", "route", ...ROUTE_DTYPES.map((f) => f.replace("_dtype", "")),
    "cast inputs", "overrides"];
  const cell = (v) => `<td>${esc(v == null || v === false ? "-" : v === true ? "yes" : v)}</td>`;
  const rows = Object.entries(routes).map(([name, r]) =>
    `<tr data-route="${esc(r.route)}"><td>${esc(name)}</td>${cell(r.route)}` +
    ROUTE_DTYPES.map((f) => cell(r[f])).join("") + cell(r.cast_forward_inputs) +
    cell((r.matched || []).join(", ") || null) + "</tr>");
  document.getElementById("routes").innerHTML =
    `<thead><tr>${head.map((h) => `<th>${esc(h)}</th>`).join("")}</tr></thead>` +
    `<tbody>${rows.join("")}</tbody>`;
}
