"""Newton-Schulz error by precision and element scale, against float64 NS.

Each backend in fp16, bf16 and fp32 against the same backend in float64
(``dmuon.newton_schulz(G, dtype=torch.float64)``: the iteration is the same, so what is
left is rounding, underflow and overflow), at element scales from 1e-12 (a momentum-averaged
gradient of a large matrix sits at 1e-5 to 1e-7 per element) to 1e3. The error is the
relative Frobenius distance ‖O - O₆₄‖ / ‖O₆₄‖; an output of zeros scores 1.
"""

from __future__ import annotations

import torch

import dmuon

# 1e-12 and 1e-10: a momentum whose norm is below torch.optim.Muon's eps (issue 50)
SCALES = (1e-12, 1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 1.0, 1e3)
BACKENDS = ("standard", "gram")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Rectangular, wide and tall: a projection of a small model and a Llama-like k/v
# projection (1,024 x 4,096); on the CPU two small ones whose Frobenius norm at element
# scale 1e3 still exceeds fp16's largest value (65,504), as the large ones' does.
SHAPES = {"cuda": ((256, 1024), (1024, 4096)), "cpu": ((64, 256), (256, 96))}
# what a correct implementation keeps within: fp16 and bf16 round to 11 and 8 bits
# (unit roundoff 4.9e-4 and 3.9e-3), which five NS iterations amplify to about 2e-3 and
# 1.3e-2 at 256 x 1024 (issue 42's table); fp32's 6e-8 likewise stays below 1e-4
BOUNDS = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-4}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.to(torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())


def ns_errors(device: torch.device, tiny: bool) -> list[dict]:
    """One row per (shape, backend, dtype, scale) with its relative error."""
    rows = []
    for shape in SHAPES["cpu" if tiny else device.type]:
        base = torch.randn(*shape, generator=torch.Generator().manual_seed(0),
                           dtype=torch.float64).to(device)
        for scale in SCALES:
            G = (base * scale).to(torch.float32)  # the gradient as it arrives
            for backend in BACKENDS:
                ref = dmuon.newton_schulz(G.to(torch.float64), backend=backend,
                                          dtype=torch.float64)
                for dtype in DTYPES:
                    out = dmuon.newton_schulz(G, backend=backend, dtype=dtype)
                    rows.append({"shape": list(shape), "backend": backend,
                                 "dtype": dtype_name(dtype), "scale": scale,
                                 "rel_error": relative_error(out, ref)})
    return rows


def table_rows(rows: list[dict]) -> list[tuple[str, str, str, str]]:
    """(check, case, measured, verdict) per shape, backend and dtype: the errors at each
    scale, in ``SCALES`` order, against the dtype's bound."""
    out = []
    keys = dict.fromkeys((tuple(r["shape"]), r["backend"], r["dtype"]) for r in rows)
    for shape, backend, dtype in keys:
        errors = [r["rel_error"] for r in rows if (tuple(r["shape"]), r["backend"],
                                                   r["dtype"]) == (shape, backend, dtype)]
        bound = BOUNDS[dtype]
        over = [f"{s:g}" for s, e in zip(SCALES, errors) if not e < bound]
        out.append(("NS error vs float64", f"{shape[0]}x{shape[1]} {backend} {dtype}",
                    " ".join(f"{e:.1e}" for e in errors),
                    f"< {bound:g}: ok" if not over else f"over {bound:g} at {','.join(over)}"))
    return out
