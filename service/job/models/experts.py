"""MoE experts under expert parallelism (EP): which params are the experts, and how an
experts module sends its tokens to the EP ranks that hold their experts.

An experts module (the built-in ``Experts``, Hugging Face's ``Qwen3MoeExperts``) holds
each of its weights as one 3-D tensor ``(experts, out, in)`` and is called as
``experts(hidden[n, dim], top_k_index[n, k], top_k_weights[n, k])``. After
``dmuon.shard_experts`` each EP rank holds E/P of them; ``use_expert_parallel`` then
replaces each module's forward (on the instance: the module's own call, which DMuon's
hook boundary gathers the experts in, stays the outer one) by ``dmuon.dispatch_combine``
over the EP group, each local expert reading the gathered 3-D params at its call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
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


def _hf_expert(module: nn.Module, j: int, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's eager expert ``j``: fused gate/up projection, gate, down."""
    h = module._apply_gate(F.linear(x, module.gate_up_proj[j]))
    return F.linear(h, module.down_proj[j])


def _expert_rule(module: nn.Module):
    """``rule(module, j, rows)``: local expert ``j`` of ``module`` on its rows."""
    if hasattr(module, "expert"):  # the built-in experts
        return lambda m, j, x: m.expert(j, x)
    if all(hasattr(module, a) for a in ("gate_up_proj", "down_proj", "_apply_gate")) and \
            all(getattr(module, k, v) == v for k, v in _HF_LAYOUT.items()):
        return _hf_expert
    raise NotImplementedError(f"expert parallelism: {type(module).__name__} is not an "
                              "experts layout this service evaluates (the built-in MoE, "
                              "Hugging Face's fused gate_up_proj/down_proj)")


def _local_count(module: nn.Module) -> int:
    """This rank's experts: dim 0 of its 3-D params, E/P after ``dmuon.shard_experts``."""
    return next(p for p in module.parameters(recurse=False) if p.ndim == 3).shape[0]


def _dispatching_forward(module: nn.Module, rule, ep_group, ledger):
    import dmuon

    def forward(hidden_states, top_k_index, top_k_weights):
        experts = [functools.partial(rule, module, j) for j in range(_local_count(module))]
        return dmuon.dispatch_combine(hidden_states, top_k_index, top_k_weights, experts,
                                      module.num_experts, ep_group, ledger)

    return forward


def use_expert_parallel(model: nn.Module, ep_group, ledger=None) -> int:
    """Dispatch every experts module's tokens over ``ep_group`` (``dmuon.shard_experts``'s
    return), its all-to-all bytes recorded on ``ledger`` (``dmuon.get_ledger(model)``);
    returns how many modules now dispatch. A 1-rank group changes nothing: the experts
    run locally."""
    import torch.distributed as dist

    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return 0
    switched = 0
    for name, module in model.named_modules():
        if _holds_experts(name, module):
            module.forward = _dispatching_forward(module, _expert_rule(module), ep_group,
                                                  ledger)
            switched += 1
    return switched
