"""The reference implementation's Newton-Schulz backend objects and kernel reports:
``NewtonSchulz`` (for ``Muon(ns_backend=...)``), ``gram_newton_schulz``,
``get_ns_backend`` and ``get_backend_status``.

Their meaning is the reference's docstrings' (its API.md). The differences: NS here is
``torch.matmul``/``addmm`` (cuBLAS on CUDA, the CPU's BLAS elsewhere), so ``kernel``
takes ``"auto"`` and ``"cublas"`` (both that), and its CUDA kernels ``"quack"`` and
``"cute_sm80"`` are refused at construction, as the reference refuses a kernel it
cannot load. Gram NS restarts once, at iteration 2 (the reference's default
``restart_iterations=[2]``), or never (``[]``).
"""

from __future__ import annotations

import warnings

import torch

from .newton_schulz import (
    POLAR_EXPRESS_COEFFICIENTS,
    RESTART_AT,
    check_backend,
    coefficient_schedule,
    newton_schulz,
)

KERNELS = ("auto", "cublas")
_CUDA_ONLY_KERNELS = ("quack", "cute_sm80")


def _kernel(kernel: str, deterministic: bool) -> str:
    if kernel in _CUDA_ONLY_KERNELS:
        raise ValueError(f"NewtonSchulz(kernel={kernel!r}) is not available: NS here is "
                         "torch.matmul (cuBLAS on CUDA); use kernel='auto' or 'cublas'")
    if kernel not in KERNELS:
        raise ValueError(f"NewtonSchulz(kernel={kernel!r}) is not one of "
                         f"{list(KERNELS + _CUDA_ONLY_KERNELS)}")
    if deterministic and kernel not in ("auto", "cublas"):
        warnings.warn(f"NewtonSchulz: kernel={kernel!r} wins over deterministic=True",
                      UserWarning, stacklevel=3)
    return "cublas"


def _restart(restart_iterations) -> bool:
    """Whether Gram NS restarts (at iteration 2, the only place it can here)."""
    if restart_iterations is None:
        return True
    at = [int(i) for i in restart_iterations]
    if at not in ([], [RESTART_AT]):
        raise ValueError(f"restart_iterations={at}: Gram NS here restarts at iteration "
                         f"{RESTART_AT} ([{RESTART_AT}], the default) or never ([])")
    return bool(at)


class NewtonSchulz:
    """A Newton-Schulz configuration, passed whole as ``dmuon.Muon(ns_backend=...)``:
    ``backend`` ``"gram"`` (Gram-space NS with its restart) or ``"direct"`` (the
    standard iteration; also ``"standard"``); ``coefficients`` one ``(a, b, c)`` per
    iteration (default ``POLAR_EXPRESS_COEFFICIENTS``), whose count is the number of
    iterations; ``restart_iterations`` ``[2]`` (default) or ``[]``; ``kernel`` and
    ``deterministic`` as the module docstring says."""

    def __init__(self, backend: str = "gram", kernel: str = "auto", coefficients=None,
                 restart_iterations=None, deterministic: bool = False) -> None:
        self.backend = check_backend(backend)
        self.kernel = _kernel(kernel, deterministic)
        coefficients = POLAR_EXPRESS_COEFFICIENTS if coefficients is None else coefficients
        steps = len(coefficients) if coefficients and isinstance(
            coefficients[0], (tuple, list)) else 5
        self.coefficients = coefficient_schedule(coefficients, steps)
        self.restart = _restart(restart_iterations)

    @property
    def steps(self) -> int:
        return len(self.coefficients)

    def group_options(self) -> dict:
        """What this object sets in a Muon param group."""
        return {"ns_backend": self.backend, "ns_coefficients": self.coefficients,
                "ns_steps": self.steps, "ns_restart": self.restart}

    def local(self, G: torch.Tensor, steps: int | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
        """NS of a full matrix (or a batch of them), in ``dtype`` (default: the device's
        NS precision); ``steps`` is ignored, as in the reference: the coefficients
        count the iterations."""
        return newton_schulz(G, self.steps, self.backend, self.coefficients, dtype,
                             restart=self.restart)

    def __repr__(self) -> str:
        return (f"NewtonSchulz(backend={self.backend!r}, kernel={self.kernel!r}, "
                f"steps={self.steps}, restart={self.restart})")


def gram_newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=None,
                       restart_iterations=None, deterministic: bool = False) -> torch.Tensor:
    """Gram-space NS of a full matrix, as ``NewtonSchulz("gram", ...).local(G)``, in
    ``G``'s dtype (computed in the device's NS precision). ``steps`` is ignored (the
    coefficients count the iterations); ``eps``: the norm's floor here is the dtype's
    smallest normal (``dmuon.newton_schulz``)."""
    ns = NewtonSchulz("gram", coefficients=coefficients, restart_iterations=restart_iterations,
                      deterministic=deterministic)
    return ns.local(G).to(G.dtype)


def get_backend_status() -> dict:
    """The NS kernel report (the reference's keys): ``sm_version`` (0 without CUDA),
    ``auto_choice``, ``quack_available``, ``cute_sm80_available`` (never here),
    ``cublas_always_available``; and ``matmul``, what runs."""
    cuda = torch.cuda.is_available()
    major, minor = torch.cuda.get_device_capability() if cuda else (0, 0)
    return {"sm_version": major * 10 + minor, "auto_choice": "cublas" if cuda else "cpu",
            "quack_available": False, "cute_sm80_available": False,
            "cublas_always_available": True,
            "matmul": "torch.matmul/addmm" + ("" if cuda else " on the CPU")}


def get_ns_backend() -> str:
    """One line for a start-up log, in the reference's form
    ``"Gram NS · kernel=<name> (SM<ver>, <detail>)"``."""
    s = get_backend_status()
    return f"Gram NS · kernel={s['auto_choice']} (SM{s['sm_version']}, {s['matmul']})"


def group_options(backend) -> dict:
    """A Muon group's NS options from its ``ns_backend``: a ``NewtonSchulz`` sets the
    backend, schedule, iteration count and restart; a name, the backend alone."""
    if isinstance(backend, NewtonSchulz):
        return backend.group_options()
    return {"ns_backend": check_backend(backend)}
