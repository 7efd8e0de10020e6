"""Newton-Schulz orthogonalisation and its FLOP count.

The standard quintic iteration is the one of Keller Jordan's Muon as shipped in
``torch.optim._muon._zeropower_via_newtonschulz`` (same operation order, so the two are
bit-identical in the same dtype); only the compute dtype is selectable here. Gram NS,
the default, computes the same polynomial on the small Gram matrix, run as its authors
run it (Zhang, Amsel, Chen, Dao, "Gram Newton-Schulz", Dao AI Lab 2026; DeepSpeed's Muon
default): one restart at iteration 2, the whole iteration in one precision, half
precision where the device has fast half precision. Judge it by training quality
(bench/ns_quality.py), not by one matrix's singular values, which depend on the kernels.
"""

from __future__ import annotations

import torch

QUINTIC = (3.4445, -4.7750, 2.0315)

# Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign Methods and Their
# Application to the Muon Algorithm" (arXiv:2505.16932), Algorithm 1: per-iteration
# degree-5 coefficients for a lower spectral bound of 1e-3; every polynomial but the last
# is damped by a safety factor of 1.01 (a/1.01, b/1.01^3, c/1.01^5) for low precision.
_POLAR_EXPRESS_RAW = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
POLAR_EXPRESS = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]]
POLAR_EXPRESS.append(_POLAR_EXPRESS_RAW[-1])
# The seeds' reference implementation's default schedule: the first five Polar Express
# polynomials above, damped by a safety factor of 1.05 instead of 1.01
# (https://github.com/X-Square-Robot/dmuon/blob/f002f24/dmuon/optim/newton_schulz.py,
# _SAFETY_FACTOR); pass it as ns_coefficients.
POLAR_EXPRESS_COEFFICIENTS = [(a / 1.05, b / 1.05**3, c / 1.05**5)
                              for a, b, c in _POLAR_EXPRESS_RAW[:5]]
# Jiacheng You's per-iteration quintic coefficients, as the reference exports them.
YOU_COEFFICIENTS = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                    (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                    (2.8366, -3.0525, 1.2012)]
BACKENDS = ("gram", "standard")
BACKEND_ALIASES = {"direct": "standard"}  # the reference's name for the standard iteration
COEFFICIENT_NAMES = ("quintic", "polar_express")


def coefficient_schedule(coefficients, steps: int) -> list[tuple[float, float, float]]:
    """One (a, b, c) per iteration: fixed for "quintic" or a tuple, per-iteration for
    "polar_express" (its last polynomial repeats beyond the published list) and for a
    list of ``steps`` tuples (``POLAR_EXPRESS_COEFFICIENTS``, ``YOU_COEFFICIENTS``)."""
    if isinstance(coefficients, str):
        if coefficients == "quintic":
            return [QUINTIC] * steps
        if coefficients == "polar_express":
            return [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)]
        raise ValueError(
            f"ns_coefficients={coefficients!r} is not one of {list(COEFFICIENT_NAMES)} "
            "nor an (a, b, c) tuple"
        )
    coefficients = list(coefficients)
    if coefficients and isinstance(coefficients[0], (tuple, list)):
        if len(coefficients) != steps:
            raise ValueError(f"ns_coefficients lists {len(coefficients)} (a, b, c) "
                             f"iterations but ns_steps={steps}")
        return [coefficient_schedule(abc, 1)[0] for abc in coefficients]
    abc = tuple(float(c) for c in coefficients)
    if len(abc) != 3:
        raise ValueError(f"ns_coefficients must have 3 values (a, b, c), got {abc}")
    return [abc] * steps


def check_backend(backend: str) -> str:
    """The backend's canonical name ("direct" is "standard")."""
    if not isinstance(backend, str):
        raise TypeError(f"ns_backend={backend!r}: pass a name, one of {list(BACKENDS)} (or "
                        "'direct'), with the schedule as ns_coefficients, or a "
                        "dmuon.NewtonSchulz(backend, coefficients=...)")
    backend = BACKEND_ALIASES.get(backend, backend)
    if backend not in BACKENDS:
        raise ValueError(f"ns_backend={backend!r} is not one of {list(BACKENDS)} or 'direct'")
    return backend


RESTART_AT = 2  # the authors' reset iteration


def restart_index(steps: int, restart: bool) -> int | None:
    """Iteration before which Gram NS rebuilds X and R from scratch, if it restarts."""
    return RESTART_AT if restart and steps > RESTART_AT else None


def default_ns_dtype(device: torch.device, backend: str, input_dtype: torch.dtype) -> torch.dtype:
    """NS precision when none is asked for. On CUDA half precision runs on the tensor
    cores: fp16 for Gram NS (its authors' choice: the normalised iterates stay within
    fp16's range, and fp16 keeps 3 more mantissa bits than bf16), bf16 for standard NS
    (torch.optim.Muon's). Elsewhere the input's precision: CPUs without bf16 instructions
    emulate half-precision matmuls, 58x slower than fp32 on one machine here."""
    if device.type == "cuda":
        return torch.float16 if backend == "gram" else torch.bfloat16
    return input_dtype


def norm_precision(dtype: torch.dtype) -> torch.dtype:
    """Where a matrix is divided by its norm before NS: its own precision, but fp32 for
    fp16, whose 5 exponent bits overflow the norm above 65504 and flush elements below
    6e-8 to zero (bf16 keeps fp32's exponent range)."""
    return torch.float32 if dtype == torch.float16 else dtype


def norm_floor(dtype: torch.dtype) -> float:
    """The least a Frobenius norm is divided by: the dtype's smallest normal number, so
    every nonzero matrix reaches unit norm (torch.optim.Muon's ``eps`` of 1e-7 left a
    momentum of norm below it unnormalised, and NS then stalled: 0.33 off the polar
    factor at element scale 1e-10), and an all-zero one stays zero (0 / floor)."""
    return torch.finfo(dtype).tiny


def _normalised_wide(G: torch.Tensor, dtype: torch.dtype):
    """G, oriented wide, over its Frobenius norm, then cast to ``dtype``: normalised
    first, so half precision only ever holds values of norm 1 (casting first lost
    fp16 to underflow at element scale 1e-7 and to overflow at 1e3)."""
    tall = G.size(-2) > G.size(-1)
    X = (G.mT if tall else G).to(norm_precision(G.dtype))
    norm = X.norm(dim=(-2, -1), keepdim=True).clamp(min=norm_floor(X.dtype))
    return (X / norm).to(dtype), tall


def _addmm(C, A, B, beta=1.0, alpha=1.0):
    """beta C + alpha A B, for matrices and batches of them, in one fused product."""
    if A.ndim == 3:
        return torch.baddbmm(C, A, B, beta=beta, alpha=alpha)
    return torch.addmm(C, A, B, beta=beta, alpha=alpha)


def _standard(X: torch.Tensor, schedule) -> torch.Tensor:
    for a, b, c in schedule:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c) if X.ndim == 3 else \
            torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a) if X.ndim == 3 else torch.addmm(X, B, X, beta=a)
    return X


def _gram(X: torch.Tensor, schedule, restart: bool, gram_sum=None,
          inner: torch.dtype | None = None, first_gram: torch.Tensor | None = None,
          ) -> torch.Tensor:
    """NS on the m x m Gram matrix R = X Xᵀ of a wide X (m <= n).

    X_k = Q_k X_0 with Q_k a polynomial in R_0, so the iteration runs on m x m
    matrices: P = aI + Z with Z = bR + cR², Q <- P Q, R <- P R P (each one fused
    product with its additive term, as its authors write it),
    and only X Xᵀ and the final Q X touch the n-long dimension, in X's dtype. The
    m x m iteration runs in ``inner`` (default: X's dtype, not promoted).
    ``restart`` rebuilds X <- Q X and R once, at iteration 2, which bounds the error
    growth of R <- P R P. ``gram_sum`` completes X Xᵀ when X holds a shard of the matrix's
    columns (tensor parallel); there the caller normalises X and passes its first Gram
    (``first_gram``), which it sums in full precision.
    """
    inner = inner or X.dtype

    def gram(x):
        r = x.to(inner) @ x.to(inner).mT
        return gram_sum(r) if gram_sum is not None else r

    steps, restart_at = len(schedule), restart_index(len(schedule), restart)
    R, Q = (gram(X) if first_gram is None else first_gram.to(inner)), None
    for i, (a, b, c) in enumerate(schedule):
        if i == restart_at:
            X, Q = Q.to(X.dtype) @ X, None
            R = gram(X)
        Z = _addmm(R, R, R, beta=b, alpha=c)  # P = aI + Z
        if i + 1 < steps and i + 1 != restart_at:
            RP = _addmm(R, R, Z, beta=a)
            R = _addmm(RP, Z, RP, beta=a)  # P R P
        if Q is None:  # P itself, made from Z in place once Z is no longer needed
            Q = Z
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = _addmm(Q, Z, Q, beta=a)  # P Q
    return Q.to(X.dtype) @ X


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    backend: str = "gram",
    coefficients="quintic",
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    restart: bool = True,
    gram_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U Vᵀ of ``G`` (2-D, or 3-D batched over
    its first dim: each (out, in) slice on its own) in ``dtype`` (default:
    ``default_ns_dtype`` for G's device).

    ``backend="gram"`` (the default) iterates on the small Gram matrix, restarting once
    at iteration 2 (``restart``), with the m x m iteration in ``gram_dtype`` (default:
    ``dtype``; a higher precision is an option); it needs fewer FLOPs for rectangular
    matrices (``ns_flops``) and falls back to the standard iteration for square ones.
    ``"standard"`` is the iteration of Keller Jordan's Muon as in ``torch.optim.Muon``.
    ``eps`` is accepted for torch.optim.Muon's signature; the norm's floor is
    ``norm_floor`` (the dtype's smallest normal), not ``eps``.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"newton_schulz needs a 2-D matrix (or 3-D batch), got {tuple(G.shape)}")
    backend = check_backend(backend)
    schedule = coefficient_schedule(coefficients, steps)
    dtype = dtype or default_ns_dtype(G.device, backend, G.dtype)
    X, tall = _normalised_wide(G, dtype)
    if backend == "gram" and X.size(-2) < X.size(-1):
        X = _gram(X, schedule, restart, inner=gram_dtype)
    else:
        X = _standard(X, schedule)
    return X.mT if tall else X


def gram_matmuls(steps: int, restart: bool) -> int:
    """m x m x m products of Gram NS, as ``_gram`` issues them."""
    restart_at = restart_index(steps, restart)
    count = 0
    for i in range(steps):
        q_is_identity = i in (0, restart_at)
        updates_r = i + 1 < steps and i + 1 != restart_at
        count += 1 + (0 if q_is_identity else 1) + (2 if updates_r else 0)
    return count


def ns_flops(shape, steps: int = 5, backend: str = "gram", restart: bool = True) -> int:
    """Matmul FLOPs of one NS call, counted as FlopCounterMode does (2 per multiply-add)."""
    backend = check_backend(backend)
    m, n = sorted(int(d) for d in shape[-2:])
    batch = 1
    for d in shape[:-2]:
        batch *= int(d)
    if backend == "gram" and m < n:
        rect_products = 2 + (2 if restart_index(steps, restart) is not None else 0)
        return batch * (rect_products * 2 * m * m * n + gram_matmuls(steps, restart) * 2 * m**3)
    # per iteration: X Xᵀ (m x n x m), A·A (m x m x m), B·X (m x m x n)
    return batch * steps * (2 * m * n * m + 2 * m * m * m + 2 * m * m * n)
