"""docs/migration.md holds: every name it marks "same" is importable from ``dmuon`` with
the signature it shows (positional params in order, keywords by name with the same
default), and each line of "Defaults that differ" gives the reference's behaviour."""

from __future__ import annotations

import ast
import inspect
import math
import pathlib
import re

import pytest
import torch
from torch import nn

import dmuon
from dmuon.optim import adjusted_lr

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "migration.md"


def _rows(heading: str) -> list[list[str]]:
    section = DOC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")]
            for line in section.splitlines() if line.startswith("| ")]
    return rows[1:]  # the header


def _resolve(path: str):
    obj = dmuon
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _check_signature(code: str) -> None:
    """``name(params)`` read as a ``def``: each listed param exists in the real signature
    (positional ones at the same position), with the listed default."""
    name, _, rest = code.partition("(")
    fn = ast.parse(f"def f({rest[:-1]}): pass").body[0].args
    target = _resolve(name)
    real = list(inspect.signature(target.__init__ if inspect.isclass(target) else target)
                .parameters.values())
    real = [p for p in real if p.name != "self"]
    positional = fn.args[:len(fn.args) - len(fn.defaults)]
    for i, _arg in enumerate(positional):
        assert real[i].default is inspect.Parameter.empty, (code, real[i].name)
    documented = fn.args[len(positional):] + fn.kwonlyargs
    defaults = fn.defaults + fn.kw_defaults
    by_name = {p.name: p for p in real}
    for arg, default in zip(documented, defaults):
        assert arg.arg in by_name, (code, arg.arg)
        value = eval(compile(ast.Expression(default), "doc", "eval"), {"torch": torch})
        assert by_name[arg.arg].default == value, (code, arg.arg)


def test_every_name_marked_same_is_importable_with_its_signature():
    same = [r for r in _rows("Names of the reference's `dmuon` package") if r[1] == "same"]
    assert len(same) >= 10
    for cell, _, _ in same:
        for code in re.findall(r"`([^`]+)`", cell):
            if "(" in code:
                _check_signature(code)
            else:
                assert hasattr(dmuon, code), code


class _Nested(nn.Module):
    """A vision tower whose blocks hold layers: ``visual.blocks.N.layers.M``."""

    def __init__(self):
        super().__init__()
        block = lambda: nn.Module()  # noqa: E731
        self.visual = nn.Module()
        self.visual.blocks = nn.ModuleList([block() for _ in range(2)])
        for b in self.visual.blocks:
            b.layers = nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(2)])


def _partition(model, **kwargs):
    return dmuon.partition(model, predicate=lambda n, p: p.ndim == 2, shard_size=2, **kwargs)


def _muon_group_checks(rank, world):
    """The optimizer lines, on a 1-rank dedicated model (Muon needs one)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2, hook_boundary_strict=False)
    dmuon.fully_shard(model, mesh=mesh)
    adamw = lambda o: next(g for g in o.param_groups if g["kind"] == "adamw")  # noqa: E731
    muon = lambda o: next(g for g in o.param_groups if g["kind"] == "muon")  # noqa: E731
    return {**_reduce_dtypes(mesh),
        "adamw_betas": adamw(dmuon.Muon(model, adamw_betas=(0.9, 0.999)))["betas"],
        "adamw_weight_decay": adamw(dmuon.Muon(model, adamw_weight_decay=0.01))["weight_decay"],
        "adjust_lr": muon(dmuon.Muon(model, adjust_lr_fn="match_rms_adamw"))["adjust_lr_fn"],
        "ns_coefficients": muon(dmuon.Muon(
            model, ns_coefficients=dmuon.POLAR_EXPRESS_COEFFICIENTS))["ns_coefficients"],
    }


def _reduce_dtypes(mesh) -> dict:
    """The dtype DMuon reduces gradients in, with compute_dtype and with the line's policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = torch.bfloat16
    out = {}
    for key, dtype in {"compute_dtype": dict(compute_dtype=bf16), "compute_dtype_reduce": dict(
            mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16))}.items():
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
        dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2, hook_boundary_strict=False,
                              **dtype)
        out[key] = [(b.param_dtype, b.reduce_dtype) for b in dmuon.get_state(model).boundaries]
    return out


@pytest.fixture(scope="module")
def optimizer_lines():
    from dmuon.testing import run

    return run(_muon_group_checks, world_size=1)[0]


# The reference's Polar Express schedule, from the paper's published polynomials
# (Amsel et al., arXiv:2505.16932) and its safety factor 1.05 (a/f, b/f^3, c/f^5).
_PAPER = [(8.28721201814563, -23.595886519098837, 17.300387312530933),
          (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
          (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
          (3.3184196573706015, -2.488488024314874, 0.51004894012372),
          (2.300652019954817, -1.6689039845747493, 0.4188073119525673)]
_REFERENCE_SCHEDULE = [(a / 1.05, b / 1.05**3, c / 1.05**5) for a, b, c in _PAPER]


def _default_checks(lines) -> dict:
    from dmuon.newton_schulz import coefficient_schedule

    return {
        "adjust_lr": lambda: lines["adjust_lr"] == "match_rms_adamw" and math.isclose(
            adjusted_lr(0.02, "match_rms_adamw", (64, 172)), 0.02 * 0.2 * math.sqrt(172)),
        "adamw_betas": lambda: lines["adamw_betas"] == (0.9, 0.999),
        "adamw_weight_decay": lambda: lines["adamw_weight_decay"] == 0.01,
        "ns_coefficients": lambda: coefficient_schedule(lines["ns_coefficients"], 5)
        == _REFERENCE_SCHEDULE,
        "polar_express_safety": lambda: coefficient_schedule(
            dmuon.POLAR_EXPRESS_COEFFICIENTS, 5) == _REFERENCE_SCHEDULE,
        "strict_heuristic": lambda: _partition(
            nn.Sequential(nn.Linear(4, 4)), hook_boundary_strict=False).params["0.weight"]
        .boundary == "0",
        "nested_layers": _nested_layers,
        "compute_dtype_reduce": lambda: lines["compute_dtype"] == [(torch.bfloat16,
                                                                     torch.float32)]
        and lines["compute_dtype_reduce"] == [(torch.bfloat16, torch.bfloat16)],
    }


def _nested_layers() -> bool:
    model = _Nested()
    outer_blocks = set(model.visual.blocks)
    outer = _partition(model, hook_boundary_predicate=lambda m: m in outer_blocks)
    deepest = _partition(model)
    return {a.boundary for a in outer.params.values()} == {"visual.blocks.0",
                                                           "visual.blocks.1"} \
        and {a.boundary for a in deepest.params.values()} == {
            f"visual.blocks.{b}.layers.{i}" for b in (0, 1) for i in (0, 1)}


def test_each_documented_default_change_gives_the_reference_behaviour(optimizer_lines):
    rows = _rows("Defaults that differ")
    checks = _default_checks(optimizer_lines)
    assert [r[0] for r in rows] == list(checks)
    for row in rows:
        assert checks[row[0]](), row
    with pytest.raises(ValueError, match="hook boundary"):
        _partition(nn.Sequential(nn.Linear(4, 4)))  # the default here refuses it


# Every name in the reference's ``dmuon.__all__`` and every keyword of its
# ``dedicate_params`` (its API.md, X-Square-Robot/dmuon @ f002f24).
REFERENCE_NAMES = (
    "dedicate_params dedicate_params_ddp dedicate_params_ddp_tp replicate replicate_tp "
    "install_patch Muon NewtonSchulz newton_schulz gram_newton_schulz get_backend_status "
    "get_ns_backend get_comm_ctx get_dedicated_params get_owned_params DedicatedCommContext "
    "DMuonParamPolicy clip_grad_norm_ clip_grad_norm_buckets_ "
    "try_clip_optimizer_grad_norm_buckets_ register_muon_grad_clip_strategy "
    "MuonGradClipStats GradClipBucket GradClipBucketStats SegmentedGradClipResult "
    "summarize_comm_plan summarize_param_groups no_sync prepare_muon_grads wait_all_reduces "
    "wait_all_replicate_broadcasts wait_all_post_step_broadcasts broadcast_all_updates "
    "broadcast_all_updates_async collect_forward_unshard_profile get_model_state_dict "
    "set_model_state_dict get_optimizer_state_dict set_optimizer_state_dict "
    "YOU_COEFFICIENTS POLAR_EXPRESS_COEFFICIENTS").split()
REFERENCE_DEDICATE_KEYWORDS = (
    "compute_dtype reshard_after_forward replicate_mesh hook_boundary_predicate "
    "hook_boundary_strict hook_boundary_resolver assignment_group_key_fn route_hint_fn "
    "max_owners_per_group owner_strategy owner_cost_model hsdp_column_balance "
    "pack_small_params tp_buffer_reuse replicate_broadcast_bucket_mb muon_forward_unshard "
    "delay_stage2_to_optimizer param_policy param_policy_fn process_group_policy").split()
STATUSES = ("same", "same, different internals", "different", "refused, because")


def test_every_reference_name_and_keyword_has_a_line():
    rows = _rows("Names of the reference's `dmuon` package") + \
        _rows("Keywords of `dedicate_params` without a line above")
    assert {r[1] for r in rows} <= set(STATUSES), {r[1] for r in rows} - set(STATUSES)
    cells = [r[0] for r in rows]
    lacking = [n for n in REFERENCE_NAMES
               if not any(re.search(rf"`(utils\.)?{re.escape(n)}[`(]", c) for c in cells)]
    assert not lacking, f"names without a line: {lacking}"
    lacking = [k for k in REFERENCE_DEDICATE_KEYWORDS
               if not any(re.search(rf"\b{k}\b", c) for c in cells)]
    assert not lacking, f"dedicate_params keywords without a line: {lacking}"
