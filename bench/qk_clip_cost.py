"""The cost of QK-clip's max logits on the CPU: the built-in model's forward + backward
with its attention modules recording their per-head max logits (``dmuon.qk_clip``,
tracked as ``dmuon.Muon(qk_clip=...)`` tracks them) against the same without.

One process, one thread, float32, batch 8 at the preset's ``max_seq_len``; median of 7
runs taken in turns after one warm-up, ms; and ``dmuon.qk_clip.max_logits`` alone on
q/k of the layers' shapes, times the layers. Then the fallback pass's work on one
Llama-3-8B layer (32 query over 8 key heads, head_dim 128) at 8,192 tokens, counted on
the meta device (no memory, no time): FLOPs by torch's FlopCounterMode and bytes written
as the sum of every op's freshly allocated outputs plus what in-place ops overwrite.
Prints the tables and writes a dated record in bench/results/.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

import dmuon
from service.job.models.builtin import build_model, causal_lm_loss

PRESETS, BATCH, REPEATS = ("tiny", "small"), 8, 7


def _alternating(fns) -> list[float]:
    """Each function's median time, run in turns (one warm-up each) so that the load of
    a shared machine falls on all of them alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(REPEATS):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _step(model, tokens):
    def step():
        causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)
    return step


def measure(preset: str) -> dict:
    plain, tracked = build_model(preset, seed=0), build_model(preset, seed=0)
    c = plain.config
    tokens = torch.randint(0, c.vocab_size, (BATCH, c.max_seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    clip = dmuon.qk_clip.QKClip(tracked, dmuon.qk_clip.TAU, {})  # tracking, as Muon does
    assert len(clip.attention) == c.n_layers
    g = torch.Generator().manual_seed(1)
    q = torch.randn(BATCH, c.n_heads, c.max_seq_len, c.head_dim, generator=g)
    k = torch.randn(BATCH, c.n_kv_heads, c.max_seq_len, c.head_dim, generator=g)
    base, with_max, alone = _alternating([_step(plain, tokens), _step(tracked, tokens),
                                          lambda: dmuon.qk_clip.max_logits(q, k)])
    clip.clip([], None, skip=True)  # raises if a layer recorded no max logits
    return {"preset": preset, "batch": BATCH, "seq": c.max_seq_len, "heads": c.n_heads,
            "layers": c.n_layers, "plain_ms": base * 1e3, "tracked_ms": with_max * 1e3,
            "max_logits_ms": alone * c.n_layers * 1e3,
            "overhead": with_max / base - 1, "max_logits_share": alone * c.n_layers / base}


class _Written(TorchDispatchMode):
    """Bytes the ops write: outputs of ops that allocate, and the in-place ops' targets
    (their whole view: an upper bound for ``masked_fill_``)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        views = any(r.alias_info for r in func._schema.returns)
        if func._schema.is_mutable or not views:
            self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                              if isinstance(t, torch.Tensor))
        return out


LAYER = {"batch": 1, "heads": 32, "kv_heads": 8, "head_dim": 128, "seq": 8192}  # Llama-3-8B


def pass_cost(dtype: torch.dtype) -> dict:
    """The fallback max-logit pass's FLOPs and bytes written on one ``LAYER``."""
    b, d, t = LAYER["batch"], LAYER["head_dim"], LAYER["seq"]
    q = torch.empty(b, LAYER["heads"], t, d, dtype=dtype, device="meta")
    k = torch.empty(b, LAYER["kv_heads"], t, d, dtype=dtype, device="meta")
    written = _Written()
    with FlopCounterMode(display=False) as flops, written:
        dmuon.qk_clip.max_logits(q, k)
    return {"dtype": str(dtype).removeprefix("torch."), **LAYER,
            "flops": flops.get_total_flops(), "bytes_written": written.bytes}


def _cost_table(costs: list[dict]) -> str:
    lines = ["| q/k dtype | tokens | heads (q / kv) | FLOPs | GB written |", "|---" * 5 + "|"]
    lines += [f"| {c['dtype']} | {c['seq']} | {c['heads']} / {c['kv_heads']} | "
              f"{c['flops']:.2e} | {c['bytes_written'] / 1e9:.2f} |" for c in costs]
    return "\n".join(lines)


def main() -> None:
    from bench._record import write_record

    torch.set_num_threads(1)
    rows = [measure(p) for p in PRESETS]
    lines = ["| model | batch x seq | fwd+bwd, ms | with max logits, ms | overhead | "
             "max logits alone (all layers), ms | share of fwd+bwd |", "|---" * 7 + "|"]
    lines += [f"| {r['preset']} ({r['layers']} layers, {r['heads']} heads) | "
              f"{r['batch']} x {r['seq']} | {r['plain_ms']:.1f} | {r['tracked_ms']:.1f} | "
              f"{100 * r['overhead']:+.1f} % | {r['max_logits_ms']:.1f} | "
              f"{100 * r['max_logits_share']:.1f} % |" for r in rows]
    costs = [pass_cost(dtype) for dtype in (torch.bfloat16, torch.float32)]
    table = "\n".join(lines) + "\n\nThe fallback pass on one Llama-3-8B layer:\n\n" + \
        _cost_table(costs)
    print(table)
    write_record("qk_clip_cost", "QK-clip: the cost of recording max logits (CPU)", table,
                 {"rows": rows, "layer_pass": costs},
                 notes=f"One thread, float32; median of {REPEATS}. The layer pass is "
                 "counted on the meta device, where bf16 logits stay bf16 (CUDA's "
                 "fallback writes them in float32: the float32 row's bytes).")


if __name__ == "__main__":
    main()
