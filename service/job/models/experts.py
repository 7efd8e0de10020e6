"""MoE experts under expert parallelism (EP): which params are the experts, and how an
experts module sends its tokens to the EP ranks that hold their experts.

An experts module (the built-in ``Experts``, Hugging Face's ``Qwen3MoeExperts``) holds
each of its weights as one 3-D tensor ``(experts, out, in)`` and is called as
``experts(hidden[n, dim], top_k_index[n, k], top_k_weights[n, k])``. After
``dmuon.shard_experts`` each EP rank holds E/P of them; ``use_expert_parallel`` then
replaces each module's forward (on the instance: the module's own call, which DMuon's
hook boundary gathers the experts in, stays the outer one) by ``dmuon.dispatch_combine``
over the EP group, the local experts computed together from the gathered 3-D params
(``dmuon.grouped_linear``). At EP 1 it routes the same way without the
exchanges.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

EXPERTS_MODULE = "experts"
# Hugging Face's fused-expert layouts this module evaluates (``use_experts_implementation``)
_HF_LAYOUT = {"is_concatenated": True, "is_transposed": False, "has_bias": False,
              "has_gate": True, "has_post_expert_norm": False}


def is_expert(name: str, param) -> bool:
    """The expert-parallel params: 3-D weights held by a module named ``experts``."""
    return param.ndim == 3 and name.rpartition(".")[0].rpartition(".")[2] == EXPERTS_MODULE


def experts_per_token(model: nn.Module) -> int | None:
    """top_k: the experts each token runs, as the model's config names it (Hugging
    Face's ``num_experts_per_tok``, the built-in ``top_k``); None where it names none."""
    config = getattr(model, "config", None)
    return getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None)


def _holds_experts(name: str, module: nn.Module) -> bool:
    return name.rpartition(".")[2] == EXPERTS_MODULE and any(
        is_expert(f"{name}.{p}", t) for p, t in module.named_parameters(recurse=False))


def _hf_grouped(module: nn.Module, rows: torch.Tensor, groups) -> torch.Tensor:
    """Hugging Face's fused experts on rows grouped by local expert: the fused gate/up
    projection, the gate, down, each one grouped product of the whole 3-D weight."""
    import dmuon

    h = module._apply_gate(dmuon.grouped_linear(rows, module.gate_up_proj, groups))
    return dmuon.grouped_linear(h, module.down_proj, groups)


def _expert_rule(module: nn.Module):
    """``rule(module, rows, groups)``: the local experts of ``module`` on their rows, or
    None for a layout this module does not evaluate."""
    if hasattr(module, "grouped"):  # the built-in experts
        return lambda m, rows, groups: m.grouped(rows, groups)
    if all(hasattr(module, a) for a in ("gate_up_proj", "down_proj", "_apply_gate")) and \
            all(getattr(module, k, v) == v for k, v in _HF_LAYOUT.items()):
        return _hf_grouped
    return None


def _dispatching_forward(module: nn.Module, rule, ep_group, ledger):
    import dmuon

    def forward(hidden_states, top_k_index, top_k_weights):
        return dmuon.dispatch_combine(hidden_states, top_k_index, top_k_weights,
                                      functools.partial(rule, module), module.num_experts,
                                      ep_group, ledger)

    return forward


def use_expert_parallel(model: nn.Module, ep_group, ledger=None) -> int:
    """Dispatch every experts module's tokens over ``ep_group`` (``dmuon.shard_experts``'s
    return), its all-to-all bytes recorded on ``ledger`` (``dmuon.get_ledger(model)``);
    returns how many modules now dispatch. With no group or a 1-rank one the experts run
    locally, routed the same way (one sort, one host sync, grouped products), in place
    of Hugging Face's eager loop (a select and a ``nonzero`` per expert); a layout this
    module does not evaluate keeps its own forward there, and is refused under EP."""
    import torch.distributed as dist

    local = ep_group is None or dist.get_world_size(ep_group) == 1
    switched = 0
    for name, module in model.named_modules():
        if not _holds_experts(name, module):
            continue
        rule = _expert_rule(module)
        if rule is None and not local:
            raise NotImplementedError(
                f"expert parallelism: {type(module).__name__} is not an experts layout "
                "this service evaluates (the built-in MoE, Hugging Face's fused "
                "gate_up_proj/down_proj)")
        if rule is not None:
            module.forward = _dispatching_forward(module, rule, None if local else ep_group,
                                                  None if local else ledger)
            switched += 1
    return switched
