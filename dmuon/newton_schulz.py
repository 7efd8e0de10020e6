"""Newton-Schulz orthogonalisation and its FLOP count.

The standard quintic iteration is the one of Keller Jordan's Muon as shipped in
``torch.optim._muon._zeropower_via_newtonschulz`` (same operation order, so the two are
bit-identical in the same dtype); only the compute dtype is selectable here.
"""

from __future__ import annotations

import torch

QUINTIC = (3.4445, -4.7750, 2.0315)
COEFFICIENT_SETS = {"quintic": QUINTIC}
BACKENDS = ("standard",)


def resolve_coefficients(coefficients) -> tuple[float, float, float]:
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(
                f"ns_coefficients={coefficients!r} is not one of {sorted(COEFFICIENT_SETS)} "
                "nor an (a, b, c) tuple"
            )
        return COEFFICIENT_SETS[coefficients]
    coefficients = tuple(float(c) for c in coefficients)
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must have 3 values (a, b, c), got {coefficients}")
    return coefficients


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"ns_backend={backend!r} is not one of {list(BACKENDS)}")
    return backend


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    backend: str = "standard",
    coefficients="quintic",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U Vᵀ of a 2-D matrix ``G`` in ``dtype``."""
    if G.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(G.shape)}")
    check_backend(backend)
    a, b, c = resolve_coefficients(coefficients)
    X = G.to(dtype)
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.T if tall else X


def ns_flops(shape, steps: int = 5, backend: str = "standard") -> int:
    """Matmul FLOPs of one NS call, counted as FlopCounterMode does (2 per multiply-add)."""
    check_backend(backend)
    m, n = sorted(int(d) for d in shape[-2:])
    batch = 1
    for d in shape[:-2]:
        batch *= int(d)
    # per iteration: X Xᵀ (m x n x m), A·A (m x m x m), B·X (m x m x n)
    return batch * steps * (2 * m * n * m + 2 * m * m * m + 2 * m * m * n)
