"""Prepared script for a machine with NVIDIA GPUs (no CPU fallback; CI never runs it).

    torchrun --nproc-per-node N -m bench.gpu          # N = 1 works; N >= 2 shows overlap

1. Newton-Schulz timings on rank 0 at Llama-3 8B and 70B projection shapes: Gram NS in
   fp16 (the CUDA default) and bf16 against standard NS in bf16 (torch.optim.Muon's),
   CUDA-event medians of 10 after 3 warm-ups, ms.
2. Training steps of a Llama-style model (meta init, bf16 params, fp32 reduce, Z3,
   prefetch 1) on all N ranks with NCCL, the last two under ``torch.profiler``: the
   Chrome trace is written, and the share of NCCL kernel time that overlaps compute
   kernels on other streams is printed. With N = 1 DMuon's collectives are local
   no-ops, so there is no NCCL kernel to overlap.

Writes bench/results/gpu.json (and gpu_trace_rank0.json), or into $OUT when set.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics

import torch
import torch.distributed as dist

import dmuon

SHAPES = {"llama3-8b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
          "llama3-70b": [(8192, 8192), (1024, 8192), (28672, 8192), (8192, 28672)]}
VARIANTS = (("gram", torch.float16), ("gram", torch.bfloat16), ("standard", torch.bfloat16))


def _out_dir() -> pathlib.Path:
    out = pathlib.Path(os.environ.get("OUT") or pathlib.Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _cuda_ms(fn, warmup=3, repeats=10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ns_timings() -> list[dict]:
    rows = []
    for model, shapes in SHAPES.items():
        for shape in shapes:
            G = torch.randn(*shape, device="cuda")
            row = {"model": model, "shape": list(shape)}
            for backend, dtype in VARIANTS:
                row[f"{backend}_{str(dtype)[6:]}"] = _cuda_ms(
                    lambda G=G, b=backend, d=dtype: dmuon.newton_schulz(G, backend=b, dtype=d))
            rows.append(row)
    return rows


def _build(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from service.models.builtin import ModelConfig, build_model, init_builtin
    from service.models.params import split_params

    config = ModelConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=4,
                         ffn_dim=5632, max_seq_len=2048)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("shard",))
    model = build_model(config, device="meta")
    dmuon.dedicate_params(model, mesh, predicate=split_params(model).predicate, prefetch=1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh, mp_policy=policy)
    dmuon.fully_shard(model, mesh=mesh, mp_policy=policy)
    dmuon.materialize(model, seed=0, init_fn=init_builtin)
    return model, dmuon.Muon(model, adamw_lr=3e-4), config


def _overlap(trace_path: pathlib.Path) -> dict:
    """NCCL kernel time, and the part of it during which a compute kernel ran on
    another stream, from the profiler's Chrome trace."""
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"]
              if e.get("cat") == "kernel" and "dur" in e]
    nccl = [e for e in events if "nccl" in e["name"].lower()]
    compute = [e for e in events if "nccl" not in e["name"].lower()]
    total = sum(e["dur"] for e in nccl)
    overlapped = 0.0
    for n in nccl:
        lo, hi = n["ts"], n["ts"] + n["dur"]
        spans = sorted((max(lo, c["ts"]), min(hi, c["ts"] + c["dur"])) for c in compute
                       if c.get("tid") != n.get("tid") and c["ts"] < hi and c["ts"] + c["dur"] > lo)
        end = lo
        for a, b in spans:
            a = max(a, end)
            if b > a:
                overlapped, end = overlapped + (b - a), b
    return {"nccl_kernel_us": total, "overlapped_us": overlapped,
            "overlapped_share": overlapped / total if total else None}


def training_profile(rank: int, world: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from service.models.builtin import causal_lm_loss

    model, opt, config = _build(world)
    tokens = torch.randint(0, config.vocab_size, (4, 1025), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(rank))

    def step():
        causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    step_ms = _cuda_ms(step, warmup=3, repeats=5)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    trace = _out_dir() / f"gpu_trace_rank{rank}.json"
    prof.export_chrome_trace(str(trace))
    return {"world": world, "step_ms": step_ms, **_overlap(trace)}


def main() -> None:
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"device": torch.cuda.get_device_name(), "ns": ns_timings() if rank == 0 else []}
    dist.barrier()
    result["training"] = training_profile(rank, world)
    if rank == 0:
        print("| model | shape | " + " | ".join(f"{b} {str(d)[6:]} (ms)" for b, d in VARIANTS)
              + " |\n|---|---|" + "---:|" * len(VARIANTS))
        for r in result["ns"]:
            print(f"| {r['model']} | {r['shape'][0]}x{r['shape'][1]} | " + " | ".join(
                f"{r[f'{b}_{str(d)[6:]}']:.2f}" for b, d in VARIANTS) + " |")
        print(f"training step: {result['training']}")
        (_out_dir() / "gpu.json").write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
