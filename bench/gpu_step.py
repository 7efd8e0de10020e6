"""Step time of DMuon against FSDP2 + AdamW on one device (``bench.gpu``, check e).

At about 1B params (``gpu_train.BILLION``) in bf16 (params and compute; fp32 masters,
optimizer state and gradient reduce), 4 x 2,048 tokens per step: the median of 5 steps
after 3 warm-ups, each timed from a synchronized device to a synchronized device, with
the peak of ``torch.cuda.memory_allocated`` over the timed steps. DMuon runs its
defaults (Z3, Gram NS in fp16 on CUDA); AdamW is torch's fused one.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.gpu_train import (
    BILLION,
    STEP_BATCH,
    batches,
    build_dmuon,
    build_fsdp2_adamw,
    release,
    step,
)
from service.job.models.builtin import get_config, num_params

SETUPS = {"dmuon_z3": build_dmuon, "fsdp2_adamw": build_fsdp2_adamw}


def _timed(built, data: list[torch.Tensor], warmup: int, device: torch.device) -> dict:
    model, opt = built
    cuda = device.type == "cuda"
    for tokens in data[:warmup]:
        step(model, opt, tokens)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for tokens in data[warmup:]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(model, opt, tokens)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"step_s": statistics.median(times), "steps_s": times, "losses": losses,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def step_time(device: torch.device, tiny: bool) -> dict:
    config = get_config("tiny") if tiny else BILLION
    shape = STEP_BATCH["tiny" if tiny else "cuda"]
    warmup, timed = (1, 2) if tiny else (3, 5)
    data = batches(config, shape, warmup + timed, device)
    out = {"params": num_params(config), "tokens_per_step": shape[0] * shape[1],
           "warmup": warmup, "timed": timed}
    for name, build in SETUPS.items():
        out[name] = _timed(build(config, device, bf16=True), data, warmup, device)
        release()
    out["dmuon_over_fsdp2_adamw"] = out["dmuon_z3"]["step_s"] / out["fsdp2_adamw"]["step_s"]
    return out


def step_time_rows(r: dict) -> list[tuple]:
    case = f"{r['params']:,} params bf16, {r['tokens_per_step']:,} tokens"
    rows = []
    for name in SETUPS:
        peak = r[name]["peak_allocated_bytes"]
        rows.append(("step time", f"{name}, {case}", f"{r[name]['step_s'] * 1e3:.1f} ms"
                     + (f", peak {peak / 2**30:.1f} GiB" if peak is not None else ""),
                     f"median of {r['timed']}"))
    rows.append(("step time", "DMuon / FSDP2 + AdamW", f"{r['dmuon_over_fsdp2_adamw']:.2f}",
                 "measured"))
    return rows
