"""The single-device check, run when a GPU is lent (one H200: world size 1, as NCCL
cannot put two ranks on one GPU); ``make bench-gpu``, about 5 minutes there.

    torchrun --nproc-per-node 1 -m bench.gpu      # or: python -m bench.gpu
    python -m bench.gpu --device cpu --tiny        # the suite's form: gloo, seconds

a. Newton-Schulz error in fp16, bf16 and fp32 at element scales 1e-8 to 1e3 against
   float64 NS, standard and Gram, at 256 x 1024 and 1,024 x 4,096 (``bench.gpu_ns``).
b. The side-stream race made deterministic: a 10 ms kernel queued on DMuon's side stream
   as ``Streams.issuing`` is entered, ahead of the copy a one-rank group makes there;
   the losses of 4 steps must equal a run without it (``bench.gpu_checks``).
c. ``block.compile()`` against eager under Z3, ``mode="reduce-overhead"`` (CUDA graphs)
   against eager under Z2, and what the core answers to CUDA graphs under Z3.
d. ``dmuon.memory_report`` against ``torch.cuda.memory_allocated`` around one
   boundary's gather and free.
e. Step time of DMuon against FSDP2 + fused AdamW at 1.03B params in bf16
   (``bench.gpu_step``).
f. The MoE experts' backward, grouped (``F.grouped_mm``) against a select per expert
   (``bench.gpu_experts``).
g. QK-clip's max logits from ``flex_attention``'s max scores against the fallback, and
   the max-logit pass's share of a layer's forward (``bench.gpu_qk_clip``).

A check that raises is recorded with its error and the others still run (a lent device's
minutes are few): ``--only`` reruns some. Prints one table and writes one dated record
(Markdown and JSON) in bench/results/, or into ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

import torch
import torch.distributed as dist

from bench._record import write_record
from bench.gpu_checks import (
    compile_check,
    compile_rows,
    memory_check,
    memory_rows,
    stream_race,
    stream_race_rows,
)
from bench.gpu_experts import experts_backward_rows
from bench.gpu_experts import table_rows as experts_rows
from bench.gpu_ns import ns_errors
from bench.gpu_ns import table_rows as ns_rows
from bench.gpu_qk_clip import max_logit_rows
from bench.gpu_qk_clip import table_rows as max_logit_table
from bench.gpu_step import step_time, step_time_rows

# name: (measure(device, tiny) -> dict, rows(dict) -> table rows)
CHECKS = {"ns_error": (ns_errors, ns_rows), "stream_race": (stream_race, stream_race_rows),
          "compile": (compile_check, compile_rows), "memory": (memory_check, memory_rows),
          "step_time": (step_time, step_time_rows),
          "experts_backward": (experts_backward_rows, experts_rows),
          "max_logit": (max_logit_rows, max_logit_table)}


def _join_group(device: torch.device) -> None:
    """A process group of one rank: torchrun's, or an in-process store (no port)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise SystemExit(f"bench.gpu runs on one rank (world size {dist.get_world_size()})")


def measure(device: torch.device, tiny: bool, only: list[str]) -> dict:
    """Every check's result (or its error) and the seconds it took; each check's rows
    are printed as it ends, so a run cut short by its time limit still shows them."""
    results, seconds = {}, {}
    for name, (check, _) in CHECKS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            results[name] = check(device, tiny)
        except Exception as e:  # noqa: BLE001 - recorded; the other checks still run
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {seconds[name]} s", table({name: results[name]}), sep="\n",
              flush=True)
    return {"checks": results, "seconds": seconds}


def table(checks: dict) -> str:
    lines = ["| check | case | measured | verdict |", "|---|---|---|---|"]
    for name, result in checks.items():
        rows = [(name, "-", result["error"][:160], "ERROR")] if "error" in result \
            else CHECKS[name][1](result)
        lines += ["| " + " | ".join(" ".join(str(c).replace("|", "/").split()) for c in row)
                  + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="small shapes and the tiny model (the suite's CPU form)")
    parser.add_argument("--only", default="", help=f"comma-separated of {list(CHECKS)}")
    args = parser.parse_args()
    only = [c for c in args.only.split(",") if c]
    if unknown := set(only) - set(CHECKS):
        parser.error(f"--only: unknown check(s) {sorted(unknown)}; valid: {list(CHECKS)}")
    # cuBLAS picks the same kernels run after run: the race check compares losses
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _join_group(device)
    data = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "tiny": args.tiny, "world_size": 1,
            **measure(device, args.tiny, only)}
    dist.destroy_process_group()
    text = table(data["checks"])
    print(text)
    path = write_record("gpu", "Single-device check", text, data,
                        notes=f"{data['device']}, torch {data['torch']}, world size 1"
                              f"{', --tiny' if args.tiny else ''}; seconds per check: "
                              f"{data['seconds']}.")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
