"""What ``dmuon-svc`` prints: its diagnostics through ``logging`` (stderr), a failed
job's reason in one line, and a plan's per-rank predictions as tables. Nothing here
imports torch: the CLI runs where only the client is installed."""

from __future__ import annotations

import logging
import sys

_HANDLER_TAG = "_dmuon_cli_handler"


class _Format(logging.Formatter):
    """Informational lines as they are; warnings and errors prefixed ``warning:`` and
    ``error:``, as command-line tools do."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {message}"
        return message


def setup_logging(level: int = logging.INFO, names=("service.control.cli",)) -> None:
    """One stderr handler on each logger in ``names`` (replacing one set up before, so
    calling ``main`` twice in a process does not print twice)."""
    for name in names:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if getattr(h, _HANDLER_TAG, False)]:
            logger.removeHandler(handler)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Format())
        setattr(handler, _HANDLER_TAG, True)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


def losses_line(last: dict) -> str:
    """``loss 5.2625 at step 40 (mean of the ranks)  val_loss 5.3010 at step 40``: a job's
    newest figures (``GET /v1/jobs/{id}``'s ``last``)."""
    loss = last.get("loss")
    line = (f"loss {loss:.4f}" if loss is not None else "loss non-finite") + \
        f" at step {last['step']} (mean of the ranks)"
    if "val_loss" in last:
        val = last["val_loss"]
        line += (f"  val_loss {val:.4f}" if val is not None else "  val_loss non-finite") \
            + f" at step {last['val_step']}"
    return line


# -- a failed job's reason -------------------------------------------------------------------
def failure_line(job: dict) -> str | None:
    """``FAILED: <type>: <message> (rank R, step S)`` from a failed job's ``reason``;
    None when the job did not fail or the service gives no reason (older servers). Only
    the message's first line: ``reason_details`` gives the rest."""
    reason = job.get("reason")
    if job.get("status") != "FAILED" or not reason:
        return None
    if isinstance(reason, str):
        return f"FAILED: {reason.strip().splitlines()[0] if reason.strip() else reason}"
    lines = str(reason.get("message") or "").strip().splitlines()
    text = ": ".join(part for part in (reason.get("type"), lines[0] if lines else None)
                     if part)
    where = ", ".join(f"{key} {reason[key]}" for key in ("rank", "step")
                      if reason.get(key) is not None)
    return f"FAILED: {text or 'no reason given'}" + (f" ({where})" if where else "")


def _frame(frame) -> str:
    if isinstance(frame, dict):
        file = frame.get("filename") or frame.get("file") or "?"
        line = frame.get("lineno") or frame.get("line")
        name = frame.get("name") or frame.get("function")
        return f"{file}:{line}" + (f" in {name}" if name else "") if line else str(file)
    return str(frame).rstrip()


def reason_details(job: dict) -> list[str]:
    """The rest of a failed job's reason: the message's further lines and the last
    frames, most recent call last, indented for a terminal."""
    reason = job.get("reason")
    if job.get("status") != "FAILED" or not isinstance(reason, dict):
        return []
    more = str(reason.get("message") or "").strip().splitlines()[1:]
    frames = reason.get("frames") or []
    return ([f"    {line}" for line in more]
            + (["  last frames (most recent call last):"] if frames else [])
            + [f"    {_frame(f)}" for f in frames])


# -- numbers ---------------------------------------------------------------------------------
def si(value: float, unit: str) -> str:
    """``value`` with an SI prefix: ``512 B``, ``65.54 kB``, ``1.23 GFLOP``."""
    value = float(value)
    for prefix in ("", "k", "M", "G", "T", "P", "E"):
        if abs(value) < 1000 or prefix == "E":
            break
        value /= 1000
    return f"{value:.4g} {unit}" if prefix == "" else f"{value:.2f} {prefix}{unit}"


def seconds(value: float) -> str:
    if value < 1e-3:
        return f"{value * 1e6:.1f} us"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def grid(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Right-aligned columns, two spaces apart."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    return ["  ".join(cell.rjust(w) for cell, w in zip(line, widths))
            for line in [headers, *rows]]


# -- a plan ----------------------------------------------------------------------------------
def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def plan_summary(plan: dict) -> list[str]:
    """The layout, the nodes it was planned on, the mode and the parameter split."""
    lay, inv = plan["layout"], plan.get("inventory") or {}
    kind = "GPU" if (plan.get("scaling") or {}).get("use_gpu") else "CPU"
    tp = lay.get("tp", 1)  # a plan stored before tensor parallelism has none
    world = lay["replicate"] * lay["shard"] * tp
    mesh, dims = (f"{lay['replicate']} x {lay['shard']}", "replicate x shard") if tp == 1 \
        else (f"{lay['replicate']} x {lay['shard']} x {tp}", "replicate x shard x tp")
    if lay.get("ep", 1) > 1:  # experts split over EP groups of consecutive shard ranks
        mesh, dims = f"{mesh}, ep {lay['ep']}", f"{dims}; experts over ep"
    lines = [f"layout {mesh} ({dims}) on {_plural(lay['nodes'], 'node')}: {world} {kind} "
             "workers"]
    if inv.get("gpus_per_node") is not None:
        lines.append(f"planned on {_plural(inv['nodes'], 'assumed node')} of "
                     f"{_plural(inv['gpus_per_node'], 'GPU')} ({inv.get('reason')})")
    elif inv.get("source") == "assumed":
        lines.append(f"planned on {_plural(inv['nodes'], 'assumed node')} of "
                     f"{inv.get('cpus_per_node')} CPUs ({inv.get('reason')})")
    elif inv:
        lines.append(f"planned on the cluster's {_plural(inv.get('nodes', 0), 'node')}")
    if plan.get("deferred"):
        lines.append(f"deferred: {plan['deferred']}")
    modes = plan.get("modes")
    if modes:
        fits = "fits" if modes["fits"] else "does not fit"
        lines += [f"mode {modes['dmuon'].upper()} (FSDP2 {modes['fsdp'].upper()}): "
                  f"{modes['reason']}",
                  f"one rank needs Z2 {si(modes['z2_bytes'], 'B')}, Z3 "
                  f"{si(modes['z3_bytes'], 'B')} of {si(modes['device_bytes'], 'B')} "
                  f"({fits})"]
    part, groups = plan.get("partition"), plan.get("optimizer_split")
    if part and groups:
        elements = sum(p["numel"] for p in part["params"].values())
        lines.append(f"Muon: {_plural(len(groups['muon']), 'param')}, {elements:,} elements "
                     f"(P_M), imbalance {part['imbalance']:.4f}; AdamW: "
                     f"{_plural(len(groups['adamw']), 'param')}")
    return lines


def memory_table(ranks: list[dict], ep: int = 1) -> list[str]:
    """Per rank: owned Muon elements, Newton-Schulz FLOPs per step, the bytes held after
    a step by kind, and the packed buffers' peak during one; under EP its coordinate
    (shard index mod P)."""
    kinds = list(ranks[0]["memory"])
    headers = ["rank", "(r,s,t)" if len(ranks[0]["coord"]) == 3 else "(r,s)",
               *(["ep"] if ep > 1 else []),
               "Muon elements", "NS FLOP/step", *(k.replace("_", " ") for k in kinds),
               "packed peak"]
    rows = [[str(r["rank"]), "(" + ",".join(map(str, r["coord"])) + ")",
             *([str(r["coord"][1] % ep)] if ep > 1 else []),
             f"{r['owned_elements']:,}",
             si(r["ns_flops"], "FLOP"), *(si(r["memory"][k], "B") for k in kinds),
             si(r["packed_peak"], "B")] for r in ranks]
    return grid(headers, rows)


def _ledger_keys(ranks: list[dict]) -> list[tuple[str, str]]:
    keys: list[tuple[str, str]] = []
    for r in ranks:
        keys += [(dim, phase) for dim, phases in r["ledger"].items() for phase in phases
                 if (dim, phase) not in keys]
    return keys


def traffic_table(ranks: list[dict]) -> list[str]:
    """Per rank: bytes sent per step by mesh dim and phase, and their time."""
    keys = _ledger_keys(ranks)
    headers = ["rank", *(f"{dim} {phase}" for dim, phase in keys), "comm time"]
    rows = [[str(r["rank"]), *(si(r["ledger"].get(dim, {}).get(phase, 0), "B")
                               for dim, phase in keys), seconds(r["comm_seconds"])]
            for r in ranks]
    return grid(headers, rows)


def plan_text(plan: dict) -> str:
    """``dmuon-svc plan``'s answer for a terminal (``--json`` gives the document)."""
    if plan.get("pipeline"):  # a pipeline-parallel layout: its stages and pp ranks
        from service.job.plan.stage_split import pipeline_text

        return "\n".join(pipeline_text(plan))
    lines = plan_summary(plan)
    ranks = plan.get("ranks") or []
    if ranks:
        lines += ["", "held per rank after a step (packed peak: during one)",
                  *memory_table(ranks, plan["layout"].get("ep", 1)), "",
                  "bytes per step per rank, by mesh dim and phase",
                  *traffic_table(ranks)]
    return "\n".join(lines)
