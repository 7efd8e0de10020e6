"""``python -m service.job.plan --model llama3-70b --nodes 8 --gpus-per-node 8 [--tp 8]
[--ep 8]``: the verdict (fits, or not and the smallest layout that does), then the
layout, the per-rank predictions and the mode for a model on synthetic GPU nodes. Exit
code 0 when the layout fits, 1 when it does not, 2 for a usage error."""

from __future__ import annotations

import argparse
import sys

import torch

from dmuon import planning

from ..models.dtypes import DTYPES
from ..spec import SpecError, parse_spec
from ..spec.recipe_section import DMuonSpec
from .inventory import synthetic_inventory
from .layout_choice import PlacementError
from .modes import DEFAULT_GPU_GB, GB
from .planner_model import SEQ_CAP, names, planner_model
from .predict import BANDWIDTH, MetaModel, predict
from .verdict import verdict

PROG = "python -m service.job.plan"


def _degree(v: str):
    return v if v == "auto" else int(v)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="the verdict, layout, predictions "
                                 "and mode of a model on synthetic GPU nodes; exit code 0 "
                                 "when it fits, 1 when it does not, 2 for a usage error")
    ap.add_argument("--model", default="llama3-8b",
                    help=f"{', '.join(names())}, or a Hugging Face config.json (or a "
                         "directory with one)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    # unset: the spec's default, and the reason says so; auto: the planner decides
    ap.add_argument("--mode", choices=("auto", "z2", "z3"),
                    help=f"dmuon.mode (default: {DMuonSpec.model_fields['mode'].default})")
    ap.add_argument("--master-dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--param-dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--reduce-dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per GPU")
    ap.add_argument("--seq-len", type=int,
                    help=f"tokens per sequence (default: the model's longest, at most "
                         f"{SEQ_CAP})")
    ap.add_argument("--device-memory-gb", type=float, default=DEFAULT_GPU_GB)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--nvlink-gbps", type=float, default=BANDWIDTH["nvlink"] / 1e9)
    ap.add_argument("--ib-gbps", type=float, default=BANDWIDTH["infiniband"] / 1e9)
    ap.add_argument("--tp", default="1", type=_degree,
                    help="tensor-parallel degree T (layout.tp), or auto")
    ap.add_argument("--ep", default="1", type=_degree,
                    help="expert-parallel degree P (layout.ep), or auto")
    ap.add_argument("--pp", default="1", type=_degree,
                    help="pipeline-parallel degree (layout.pp), or auto: planned, not yet "
                         "run by workers")
    ap.add_argument("--pp-schedule", default="1f1b", help="1f1b, interleaved or gpipe")
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="micro-batches per step per data-parallel rank (default: 1, "
                         "2 x pp with --pp)")
    ap.add_argument("--ranks", type=int, default=8, help="rows to print (0: all)")
    return ap


def _global_batch(args, seq_len: int, tp) -> dict:
    """``global_batch_tokens`` for ``--micro-batches`` (or 2 x pp with ``--pp``) on the
    data-parallel ranks the nodes leave over tp and pp."""
    pp = args.pp if isinstance(args.pp, int) else 1
    micros = args.micro_batches or (2 * pp if pp > 1 or args.pp == "auto" else None)
    if micros is None:
        return {}
    T = tp if isinstance(tp, int) else 1
    dp = max(1, args.nodes * args.gpus_per_node // (T * pp))
    return {"global_batch_tokens": micros * args.batch_size * seq_len * dp}


def _spec_maker(args, model):
    """The spec for a TP degree, the rest as the arguments say."""
    precision = {"master_dtype": args.master_dtype, "param_dtype": args.param_dtype,
                 "reduce_dtype": args.reduce_dtype}
    seq_len = args.seq_len or model.default_seq_len()

    def spec_for(tp):
        return parse_spec({**_global_batch(args, seq_len, tp),
            "model": model.spec, "precision": precision, "batch_size": args.batch_size,
            "seq_len": seq_len,
            "activation_checkpointing":
                "non_reentrant" if args.activation_checkpointing else "none",
            "dmuon": {**({"mode": args.mode} if args.mode else {}),
                      "device_memory_gb": args.device_memory_gb, **model.dmuon},
            "layout": {"tp": tp, "ep": args.ep, "pp": args.pp,
                       "pp_schedule": args.pp_schedule},
            "resources_per_worker": {"CPU": 1, "GPU": 1}})
    return spec_for


def plan(args) -> int:
    model = planner_model(args.model)
    spec_for = _spec_maker(args, model)
    spec = spec_for(args.tp)
    meta = MetaModel(spec, model.source)
    if args.pp != 1:
        return pipeline(spec, args, meta)
    bandwidth = {"nvlink": args.nvlink_gbps * 1e9, "infiniband": args.ib_gbps * 1e9}
    placement = predict(spec, synthetic_inventory(args.nodes, args.gpus_per_node),
                        bandwidth=bandwidth, model_source=meta)
    line, fits = verdict(placement, spec_for, args.gpus_per_node, args.tp, meta, bandwidth)
    print(line)
    table = placement.table().splitlines()
    print("\n".join(table[:2 + args.ranks] if args.ranks else table))
    m = placement.modes
    print(f"P_M = {placement.plan.total_elements:,} elements; packed buffers per rank: "
          f"Z2 {placement.z2_packed_bytes / 1e9:.2f} GB resident, "
          f"Z3 {placement.ranks[0].packed_peak / 1e9:.2f} GB peak"
          if m.dmuon == "z3" else f"P_M = {placement.plan.total_elements:,} elements")
    print(f"mode {m.dmuon.upper()} (FSDP2 {m.fsdp.upper()}): {m.reason}; one rank needs "
          f"Z2 {m.z2_bytes / GB:.1f} GB, Z3 {m.z3_bytes / GB:.1f} GB of "
          f"{m.device_bytes / GB:.0f} GB")
    print(communicators_line(placement.layout))
    return 0 if fits else 1


def pipeline(spec, args, meta) -> int:
    """``--pp``: the pipeline plan (the stage split, each pp rank's ranks, stages, NS
    load, memory and pp bytes), as a job with this layout stores and runs it."""
    from ..plan_document import PlanDocument
    from .make import pipeline_document

    nodes = synthetic_inventory(args.nodes, args.gpus_per_node)
    doc = pipeline_document(spec, nodes, {"source": "assumed", "nodes": args.nodes,
                                          "gpus_per_node": args.gpus_per_node}, meta)
    if doc is None:  # pp: auto, and pp 1 fits
        args.pp = 1
        return plan(args)
    assert isinstance(doc, PlanDocument)
    print("\n".join(pipeline_lines(doc.model_dump(mode="json"))))
    return 0 if doc.modes.fits else 1


def pipeline_lines(plan: dict) -> list[str]:
    """A pipeline plan for a terminal: the verdict, the split, each stage and pp rank."""
    from .stage_split import pipeline_text

    return pipeline_text(plan)


def communicators_line(layout) -> str:
    """DMuon's own process groups on one rank, and the device memory NCCL keeps for
    them, which no tensor holds and the peak above leaves out."""
    n = planning.communicators_per_rank(layout.replicate, layout.ep)
    return (f"DMuon process groups per rank: {n} (about "
            f"{n * planning.COMMUNICATOR_BYTES / GB:.1f} GB of NCCL buffers beside the peak, at "
            f"{planning.COMMUNICATOR_BYTES / 2**20:.0f} MiB each: NVIDIA/nccl issue 964)")


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1:
        ap.error("--nodes and --gpus-per-node must be at least 1")
    try:
        return plan(args)
    except (ValueError, SpecError, PlacementError) as e:  # SpecError is a ValueError
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
