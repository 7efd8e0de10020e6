"""``dmuon.mode: auto`` for Llama-3 8B and 70B on 1, 8 and 64 GPUs of 80 GB: the mode the
planner picks, why, and one rank's predicted memory in each mode. bf16 compute, fp32
masters and reduce, one 8192-token sequence per GPU, with and without per-block
activation checkpointing. Prints a table; writes bench/results/modes.json."""

from __future__ import annotations

import json
import pathlib

from service.job.plan.inventory import synthetic_inventory
from service.job.plan.modes import GB
from service.job.plan.predict import predict
from service.job.spec import parse_spec

RESULTS = pathlib.Path(__file__).parent / "results"


def choice(model: str, gpus: int, checkpointed: bool):
    spec = parse_spec({
        "model": model, "batch_size": 1, "seq_len": 8192,
        "activation_checkpointing": "non_reentrant" if checkpointed else "none",
        "precision": {"master_dtype": "float32", "param_dtype": "bfloat16",
                      "reduce_dtype": "float32"},
        "dmuon": {"mode": "auto", "device_memory_gb": 80.0},
        "resources_per_worker": {"CPU": 1, "GPU": 1}})
    nodes, per_node = (1, gpus) if gpus <= 8 else (gpus // 8, 8)
    return predict(spec, synthetic_inventory(nodes, per_node)).modes


def main() -> None:
    rows, out = [], []
    for checkpointed in (True, False):
        for model in ("llama3-8b", "llama3-70b"):
            for gpus in (1, 8, 64):
                m = choice(model, gpus, checkpointed)
                out.append({"model": model, "gpus": gpus, "checkpointed": checkpointed,
                            **m.to_dict()})
                rows.append(f"| {model} | {gpus} | {'yes' if checkpointed else 'no'} | "
                            f"**{m.dmuon.upper()}** | {m.z3_bytes / GB:.1f} | "
                            f"{m.z2_bytes / GB:.1f} | {'yes' if m.fits else 'no'} | {m.reason} |")
    print("| model | GPUs | act. ckpt | mode | Z3 GB/rank | Z2 GB/rank | fits 80 GB | why |")
    print("|---|---:|---|---|---:|---:|---|---|")
    print("\n".join(rows))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "modes.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
