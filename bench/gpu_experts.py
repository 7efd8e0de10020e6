"""The MoE experts' backward: grouped (``dmuon.grouped_linear``, the
path the models run) against a select per expert (``weight[j]``, the models' old path,
written here as the reference).

Both evaluate the same SwiGLU experts (``gate``, ``up``: ``[E, ffn, dim]``, ``down``:
``[E, dim, ffn]``) on the same rows, grouped by expert as a dispatch hands them over;
what is timed is ``backward()`` alone (the forward builds the graph untimed). A select's
backward writes a zero tensor of the whole weight per expert and sums them, E x the
weights' bytes; the grouped one writes each gradient once (``grouped_mm`` on CUDA bf16
sm80+, else one ``unbind``). Realistic size (a DeepSeek-MoE-16B-like layer): 64
experts, dim 2,048, ffn 1,408, bf16, 16,384 tokens top 8; ``tiny``: a CPU-sized one.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from dmuon import RowGroups, grouped_linear, grouped_mm_fits

SIZES = {"full": dict(experts=64, dim=2048, ffn=1408, tokens=16384, top_k=8),
         "tiny": dict(experts=8, dim=64, ffn=32, tokens=256, top_k=2)}
WARMUP, REPEAT = 2, 5


def _setup(size: dict, device: torch.device, dtype: torch.dtype):
    """The experts' weights (leaves) and the routed rows, grouped by expert."""
    g = torch.Generator().manual_seed(0)
    E, d, f = size["experts"], size["dim"], size["ffn"]

    def weight(*shape):
        w = torch.randn(*shape, generator=g) * shape[-1] ** -0.5
        return w.to(device=device, dtype=dtype).requires_grad_(True)

    weights = {"gate": weight(E, f, d), "up": weight(E, f, d), "down": weight(E, d, f)}
    logits = torch.randn(size["tokens"], E, generator=g)
    choices = logits.topk(size["top_k"], dim=-1).indices.reshape(-1)
    sizes = torch.bincount(choices, minlength=E).tolist()  # set-up, not timed
    rows = torch.randn(len(choices), d, generator=g).to(device=device, dtype=dtype)
    ends = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    return weights, rows, RowGroups(sizes, ends)


def grouped(weights: dict, rows: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    h = F.silu(grouped_linear(rows, weights["gate"], groups)) * \
        grouped_linear(rows, weights["up"], groups)
    return grouped_linear(h, weights["down"], groups)


def select_loop(weights: dict, rows: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """The old path: each expert reads ``weight[j]``, a select on the 3-D weight."""
    outs = []
    for j, part in enumerate(rows.split(groups.sizes)):
        h = F.silu(F.linear(part, weights["gate"][j])) * F.linear(part, weights["up"][j])
        outs.append(F.linear(h, weights["down"][j]))
    return torch.cat(outs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _backward_seconds(fn, weights, rows, groups, device) -> tuple[float, dict]:
    """The median seconds of ``backward()`` over ``REPEAT`` runs, and the gradients."""
    times = []
    for i in range(WARMUP + REPEAT):
        for w in weights.values():
            w.grad = None
        loss = fn(weights, rows, groups).float().square().mean()
        _sync(device)
        start = time.perf_counter()
        loss.backward()
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times), {k: w.grad for k, w in weights.items()}


def experts_backward_rows(device: torch.device, tiny: bool) -> list[dict]:
    """One row per path: the backward's median milliseconds, the weights' gigabytes, and
    (for the grouped path) its gradients' largest relative distance from the select
    loop's; on CUDA each path's peak allocated bytes over the set-up's."""
    device = torch.device(device)
    size = SIZES["tiny" if tiny else "full"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights, rows, groups = _setup(size, device, dtype)
    out, grads = [], {}
    for name, fn in (("select_loop", select_loop), ("grouped", grouped)):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        seconds, grads[name] = _backward_seconds(fn, weights, rows, groups, device)
        row = {"path": name, **size, "dtype": str(dtype).removeprefix("torch."),
               "kernel": ("grouped_mm" if grouped_mm_fits(rows, weights["gate"])
                          else "unbind") if name == "grouped" else "select",
               "backward_ms": seconds * 1e3,
               "weight_gb": sum(w.nbytes for w in weights.values()) / 1e9}
        if device.type == "cuda":
            row["peak_extra_gb"] = (torch.cuda.max_memory_allocated(device) - base) / 1e9
        out.append(row)
    out[1]["grad_rel_diff"] = max(
        float((grads["grouped"][k].float() - grads["select_loop"][k].float()).abs().max()
              / grads["select_loop"][k].float().abs().max()) for k in weights)
    return out


def table_rows(rows: list[dict]) -> list[tuple[str, str, str, str]]:
    """(check, case, measured, verdict): each path's backward, the speed-up."""
    by = {r["path"]: r for r in rows}
    old, new = by["select_loop"], by["grouped"]
    case = (f"E={new['experts']} dim={new['dim']} ffn={new['ffn']} "
            f"{new['tokens']}x top{new['top_k']} {new['dtype']}")
    speedup = old["backward_ms"] / new["backward_ms"]
    return [("experts backward", f"{case} select loop", f"{old['backward_ms']:.2f} ms", ""),
            ("experts backward", f"{case} grouped ({new['kernel']})",
             f"{new['backward_ms']:.2f} ms", f"{speedup:.1f}x, grads within "
             f"{new['grad_rel_diff']:.1e}")]


if __name__ == "__main__":
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for r in experts_backward_rows(dev, tiny=dev.type == "cpu"):
        print(r)
