"""Newton-Schulz backends against the SVD, each other, and torch.optim.Muon."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import dmuon
from dmuon.newton_schulz import coefficient_schedule
from dmuon.testing import run

RATIOS = (1, 2, 4, 8)
COEFFS = ("quintic", "polar_express", (3.0, -3.2, 1.2))


def _svd_reference(G: torch.Tensor, coefficients, steps=5) -> torch.Tensor:
    """U f(Σ/‖G‖_F) Vᵀ, f the composition of the odd quintics a x + b x³ + c x⁵."""
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    x = S / G.double().norm()
    for a, b, c in coefficient_schedule(coefficients, steps):
        x = a * x + b * x**3 + c * x**5
    return U @ torch.diag(x) @ Vh


@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.parametrize("coefficients", COEFFS, ids=["quintic", "polar_express", "tuple"])
@pytest.mark.parametrize("ratio", RATIOS)
def test_float64_gram_equals_standard_equals_svd(ratio, coefficients, restart):
    g = torch.Generator().manual_seed(ratio)
    for shape in ((48, 48 * ratio), (48 * ratio, 48)):  # wide and tall
        G = torch.randn(*shape, generator=g, dtype=torch.float64)
        svd = _svd_reference(G, coefficients)
        std = dmuon.newton_schulz(G, backend="standard", coefficients=coefficients,
                                  dtype=torch.float64)
        gram = dmuon.newton_schulz(G, backend="gram", coefficients=coefficients,
                                   dtype=torch.float64, restart=restart)
        assert (gram - std).abs().max() <= 1e-10
        assert (std - svd).abs().max() <= 1e-10
        assert (gram - svd).abs().max() <= 1e-10


def test_standard_bf16_is_bit_identical_to_torch_muon():
    """On a bf16 input the two run the same operations. (An fp32 input differs:
    torch.optim.Muon casts to bf16 before normalising, DMuon after.)"""
    from torch.optim._muon import _zeropower_via_newtonschulz

    G = torch.randn(96, 40, generator=torch.Generator().manual_seed(0)).bfloat16()
    ours = dmuon.newton_schulz(G, backend="standard", dtype=torch.bfloat16)
    theirs = _zeropower_via_newtonschulz(G, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.equal(ours, theirs)


# fp16 NS normalised in fp32 first stays within 0.4 % of float64 NS at every element scale
# here (fp16's unit roundoff 4.9e-4, grown over five iterations); 2e-2 leaves a 5x margin
# for other CPUs' kernels. Casting before normalising gave 19 % at 1e-7 and a zero output
# at 1e3, so the bound separates the two by an order of magnitude either way.
FP16_BOUND = 2e-2
SCALES = (1e-8, 1e-6, 1e3)


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("backend", ["standard", "gram"])
@pytest.mark.parametrize("scale", SCALES)
def test_fp16_ns_normalises_before_casting(backend, scale):
    G0 = torch.randn(64, 256, generator=torch.Generator().manual_seed(11))
    for G in (G0 * scale, (G0 * scale).mT):  # wide and tall
        ref = dmuon.newton_schulz(G.double(), backend="standard", dtype=torch.float64)
        out = dmuon.newton_schulz(G, backend=backend, dtype=torch.float16)
        assert out.isfinite().all()
        assert _relative(out, ref) <= FP16_BOUND, (backend, scale)


def _tp_fp16_ns(rank, world, scale):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dmuon.tp import tp_newton_schulz, tp_shard_of

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    full = torch.randn(64, 256, generator=torch.Generator().manual_seed(12)) * scale
    out = {}
    for dim in (0, 1):  # split on its longer dim: the tall matrix by rows, the wide by columns
        matrix = full if dim == 1 else full.mT.contiguous()
        param = distribute_tensor(matrix, mesh, [Shard(dim)])
        out[dim] = tp_newton_schulz(param.to_local(), tp_shard_of(param), steps=5,
                                    backend="gram", coefficients="quintic",
                                    dtype=torch.float16, eps=1e-7, ledger=dmuon.comm.Ledger())
    return out


@pytest.mark.parametrize("scale", SCALES)
def test_fp16_tp_gram_ns_sums_the_first_gram_in_fp32(scale):
    """Two TP peers, each holding half of the columns (the Gram all-reduce rule) or half
    of the rows of the transposed matrix (the rows are its longer dim: Gram rule too)."""
    full = torch.randn(64, 256, generator=torch.Generator().manual_seed(12)) * scale
    results = run(_tp_fp16_ns, scale, world_size=2)
    for dim in (0, 1):
        matrix = full if dim == 1 else full.mT
        ref = dmuon.newton_schulz(matrix.double(), backend="standard", dtype=torch.float64)
        out = torch.cat([r[dim] for r in results], dim=dim)
        assert out.isfinite().all(), (dim, scale)
        assert _relative(out, ref) <= FP16_BOUND, (dim, scale)


def test_batched_3d_equals_per_slice_loop():
    G = torch.randn(5, 24, 72, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for backend in ("gram", "standard"):
        batched = dmuon.newton_schulz(G, backend=backend, dtype=torch.float64)
        loop = torch.stack([dmuon.newton_schulz(g, backend=backend, dtype=torch.float64)
                            for g in G])
        assert (batched - loop).abs().max() <= 1e-12


@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.parametrize("backend", ["gram", "standard"])
def test_ns_flops_match_flop_counter(backend, restart):
    for shape in ((64, 64), (64, 256), (512, 64), (3, 32, 96)):
        with FlopCounterMode(display=False) as counter:
            dmuon.newton_schulz(torch.randn(*shape), backend=backend, dtype=torch.float32,
                                restart=restart)
        assert counter.get_total_flops() == dmuon.ns_flops(shape, 5, backend, restart)
    m, n = 64, 256  # standard: per iteration X Xᵀ, A·A, B·X
    assert dmuon.ns_flops((m, n), 5, "standard") == 5 * (4 * m * m * n + 2 * m**3)


class _MatmulDtypes(TorchDispatchMode):
    """Records the dtype of every matrix product (an independent view of the precision)."""

    PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.PRODUCTS:
            self.dtypes.add(out.dtype)
        return out


@pytest.mark.parametrize("backend", ["gram", "standard"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_default_runs_every_product_in_the_input_precision(backend, dtype):
    """No bf16 by default on the CPU (emulated there: 58x slower than fp32 on one machine
    here), and Gram NS's m x m iteration is not promoted: its authors run the whole
    iteration in one precision."""
    G = torch.randn(32, 96, dtype=dtype, generator=torch.Generator().manual_seed(0))
    with _MatmulDtypes() as seen:
        out = dmuon.newton_schulz(G, backend=backend)
    assert out.dtype == dtype and seen.dtypes == {dtype}
    with _MatmulDtypes() as seen:
        dmuon.newton_schulz(G.float(), backend=backend, gram_dtype=torch.float64)
    promoted = {torch.float32, torch.float64} if backend == "gram" else {torch.float32}
    assert seen.dtypes == promoted  # higher precision for the m x m iteration stays an option


def test_cuda_default_is_half_precision():
    from dmuon.newton_schulz import default_ns_dtype

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert default_ns_dtype(cuda, "gram", torch.float32) == torch.float16
    assert default_ns_dtype(cuda, "standard", torch.float32) == torch.bfloat16
    assert default_ns_dtype(cpu, "gram", torch.float32) == torch.float32


def test_restart_is_at_iteration_2():
    """Gram NS with the restart equals Gram NS run in two calls: 2 iterations, then the
    rest on the result (float64, where the restart changes nothing but rounding)."""
    from dmuon.newton_schulz import QUINTIC, _gram

    X = torch.randn(24, 80, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    X = X / X.norm()
    whole = _gram(X, [QUINTIC] * 5, restart=True)
    split = _gram(_gram(X, [QUINTIC] * 2, restart=False), [QUINTIC] * 3, restart=False)
    assert (whole - split).abs().max() <= 1e-12
    assert dmuon.ns_flops((24, 80), 5, "gram", True) == \
        dmuon.ns_flops((24, 80), 2, "gram", False) + dmuon.ns_flops((24, 80), 3, "gram", False)


# A momentum far below torch.optim.Muon's eps (1e-7) in norm: global clipping or a tiny
# lr leaves one (Megatron-LM issue 5394). Normalised by a floor at the dtype's smallest
# normal, NS reaches the polar factor as at any other scale: the bound is FP16_BOUND's
# (fp16's, the widest of the three), as the normalised input is the same matrix.
@pytest.mark.parametrize("backend", ["standard", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1e-10, 1e-12])
def test_ns_normalises_a_matrix_whose_norm_is_below_eps(backend, dtype, scale):
    G = torch.randn(128, 512, generator=torch.Generator().manual_seed(8)) * scale
    for M in (G, G.mT):
        unit = M.double() / M.double().norm()  # the same direction at unit norm
        ref = dmuon.newton_schulz(unit, backend="standard", dtype=torch.float64)
        out = dmuon.newton_schulz(M, backend=backend, dtype=dtype)
        assert _relative(out, ref) <= FP16_BOUND, (backend, dtype, scale)


@pytest.mark.parametrize("backend", ["standard", "gram"])
def test_ns_of_zero_is_zero(backend):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = dmuon.newton_schulz(torch.zeros(32, 96), backend=backend, dtype=dtype)
        assert out.isfinite().all() and not out.any()
