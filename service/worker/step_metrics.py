"""One rank's record of one step: loss, throughput (tokens/s on this rank and in total),
model FLOPs utilisation, LR per group, gradient norm, bytes moved and memory (after the
step, and its peak within the step)."""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist
from torch import nn

import dmuon
from service.job.models.experts import experts_per_token, is_expert

# Dense bf16 tensor-core peaks from NVIDIA's datasheets (SXM parts), FLOP/s per GPU
GPU_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def flops_per_token(model: nn.Module, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (params outside the embeddings; of an MoE layer's
    experts the top_k a token runs) for the matmuls, forward and backward, plus 12 x
    layers x hidden x seq_len for attention scores (PaLM's appendix B, as torchtitan
    counts)."""
    top_k = experts_per_token(model) or 1
    # an expert tensor's elements a token runs: top_k of its experts, whatever the
    # layer's E and however many of them this rank holds (EP)
    dense = sum(p.numel() / p.shape[0] * top_k if is_expert(name, p) else p.numel()
                for name, p in model.named_parameters()
                if not isinstance(model.get_submodule(name.rsplit(".", 1)[0]), nn.Embedding))
    return 6.0 * dense + 12.0 * n_layers * hidden * seq_len


def peak_flops(spec_peak_tflops: float | None, device: torch.device) -> float | None:
    """The spec's peak, else the GPU's dense bf16 peak when known; None on CPUs."""
    if spec_peak_tflops is not None:
        return spec_peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAKS.items():
            if key in name:
                return peak
    return None


def step_peak(model) -> dict:
    """This rank's peak bytes within the step just run, beside ``memory`` (taken after
    it, when Z3 has freed every packed buffer): ``packed_buffers``, the most DMuon's
    gather buffers held at once (its boundary hooks' trace, kept from one record to the
    next; None at the first record, before the trace ran), and on a GPU ``allocated``,
    torch's peak of allocated bytes, reset here for the next step."""
    peak = {"packed_buffers": dmuon.get_state(model).take_packed_peak()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["allocated"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    return peak


def ledger_bytes(model) -> dict[str, int]:
    """The last step's bytes of ``model``'s ledger, as ``"dim.phase"`` -> bytes."""
    return {f"{dim}.{phase}": n
            for dim, phases in dmuon.get_ledger(model).last_step_by_phase().items()
            for phase, n in phases.items()}


def step_record(model, opt, *, step: int, loss: float, elapsed: float, tokens: int,
                global_tokens: int, flops_token: float, peak: float | None,
                lr: dict, grad_norm: float | None) -> dict:
    rate = tokens / elapsed if elapsed else 0.0
    return {
        "step": step, "rank": dist.get_rank(), "loss": loss, "step_time_s": elapsed,
        "tokens_per_s": rate,
        "tokens_per_s_total": global_tokens / elapsed if elapsed else 0.0,
        "mfu": rate * flops_token / peak if peak else None,
        "lr": lr, "grad_norm": grad_norm,
        # QK-clip's figures of the step (None without it): every rank holds the same
        "max_logit": getattr(opt, "max_logit", None),
        "clipped_heads": getattr(opt, "clipped_heads", None)
        if getattr(opt, "max_logit", None) is not None else None,
        "bytes": ledger_bytes(model),
        "memory": dmuon.memory_report(model, opt),
        "peak_memory": step_peak(model),
        "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "time": time.time(),
    }
