"""Which params get Muon, and where DMuon's hook boundaries are, for any model.

The rule (Muon's own, as its authors apply it): 2-D and 3-D weights inside the repeated
blocks get Muon; everything else gets AdamW: embeddings, the LM head, norms, biases and
MoE routers (a block's module named ``gate``/``router``, or whose class says Router or
Gate; ``gate_proj`` is a projection and stays with Muon). The repeated blocks are the
largest ``nn.ModuleList`` whose children share one class (``model.layers`` in Llama
and Qwen, ``transformer.h`` in GPT-2); each block is one hook boundary and one FSDP2
unit. A module inside a block that holds 3-D Muon weights itself (an MoE's experts) is
a hook boundary of its own, nested in its block: under expert parallelism its params
are laid out apart from the block's dense ones, and DMuon gathers a boundary as one.
The spec's FQN regexes (``dmuon.muon_params``, ``dmuon.adamw_params``,
``dmuon.hook_boundaries``) override the rule; the plan lists the outcome.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

ROUTER_NAMES = ("gate", "router")


class ParamRuleError(ValueError):
    """A model or override the rule cannot apply to; the message names the spec field."""


def find_blocks(model: nn.Module) -> list[str]:
    """FQNs of the repeated blocks: the children of the ``nn.ModuleList`` of one class
    holding the most parameters ([] when there is none)."""
    best, best_size = None, -1
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and \
                len({type(child) for child in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = name, size
    if best is None:
        return []
    return [f"{best}.{i}" if best else str(i) for i in range(len(model.get_submodule(best)))]


def _is_router(module_fqn: str, module: nn.Module) -> bool:
    leaf = module_fqn.rsplit(".", 1)[-1]
    kind = type(module).__name__
    return leaf in ROUTER_NAMES or "Router" in kind or kind.endswith("Gate")


@dataclass
class ParamSplit:
    muon: list[str] = field(default_factory=list)
    adamw: list[str] = field(default_factory=list)
    boundaries: list[str] = field(default_factory=list)  # hook boundaries (module FQNs)
    fsdp_units: list[str] = field(default_factory=list)  # fully_shard per module
    reasons: dict[str, str] = field(default_factory=dict)  # param FQN -> why AdamW
    # dmuon.param_policy (service.job.models.routing): the AdamW params on an owner, each
    # param's route and policy, and the policy as dmuon.dedicate_params takes it
    owner_adamw: list[str] = field(default_factory=list)
    routes: dict[str, dict] = field(default_factory=dict)
    param_policy: dict | None = None

    def predicate(self, name: str, _param=None) -> bool:
        """Whether DMuon dedicates ``name``: a Muon param, or one routed to AdamW on an
        owner."""
        return name in self._muon_set

    def selected(self, name: str, _param=None) -> bool:
        """What ``dmuon.dedicate_params`` (and ``dmuon.partition``) is given: with a
        policy every param, which it routes (its sharded_adamw ones left to FSDP2 with
        their dtypes); else the Muon params."""
        return self.param_policy is not None or name in self._muon_set

    def boundary_predicate(self, model: nn.Module):
        ids = {id(model.get_submodule(b)) for b in self.boundaries}
        return lambda module: id(module) in ids

    def __post_init__(self):
        self._muon_set = set(self.muon) | set(self.owner_adamw)

    def to_dict(self) -> dict:
        """The plan's ``param_groups``; ``routes``: each param's route (without a policy:
        muon, or sharded_adamw for FSDP2's AdamW) and its policy's fields."""
        routes = self.routes or {**{n: {"route": "muon"} for n in self.muon},
                                 **{n: {"route": "sharded_adamw"} for n in self.adamw}}
        return {"muon": self.muon, "adamw": self.adamw, "hook_boundaries": self.boundaries,
                "adamw_why": self.reasons, "routes": routes}


def _owning_block(name: str, blocks: list[str]) -> str | None:
    for block in blocks:
        if name.startswith(block + "."):
            return block
    return None


def _derived(model: nn.Module, name: str, param, blocks: list[str]) -> str | None:
    """None when the rule gives ``name`` Muon, else the reason it gets AdamW."""
    if _owning_block(name, blocks) is None:
        return "outside the repeated blocks"
    if param.ndim not in (2, 3):
        return f"{param.ndim}-D"
    module_fqn = name.rsplit(".", 1)[0]
    module = model.get_submodule(module_fqn)
    if isinstance(module, nn.Embedding):
        return "embedding"
    if _is_router(module_fqn, module):
        return "MoE router"
    return None


def _with_expert_boundaries(model: nn.Module, blocks: list[str], muon: list[str]) -> list[str]:
    """The blocks and, nested in them, every other module holding a 3-D Muon param
    directly, in module order."""
    params, whole = dict(model.named_parameters()), set(blocks)
    holders = {name.rpartition(".")[0] for name in muon if params[name].ndim == 3}
    return [n for n, _ in model.named_modules() if n in whole or
            (n in holders and _owning_block(n + ".", blocks) is not None)]


def split_params(model: nn.Module, *, muon_params: str | None = None,
                 adamw_params: str | None = None,
                 hook_boundaries: str | None = None) -> ParamSplit:
    """The Muon/AdamW split and the hook boundaries of ``model`` (meta tensors are fine)."""
    blocks = find_blocks(model)
    if hook_boundaries is not None:
        boundaries = [n for n, _ in model.named_modules() if n and re.fullmatch(hook_boundaries, n)]
        if not boundaries:
            raise ParamRuleError(f"dmuon.hook_boundaries: {hook_boundaries!r} matches no module")
    elif not blocks:
        raise ParamRuleError("model: no repeated blocks (an nn.ModuleList of one class) to "
                             "derive the Muon params from; set dmuon.hook_boundaries and "
                             "dmuon.muon_params")
    else:
        boundaries = blocks
    split = ParamSplit(boundaries=boundaries, fsdp_units=blocks or boundaries)
    for name, param in model.named_parameters():
        why = _derived(model, name, param, boundaries)
        if adamw_params is not None and re.fullmatch(adamw_params, name):
            why = "dmuon.adamw_params"
        elif muon_params is not None and re.fullmatch(muon_params, name):
            if param.ndim not in (2, 3):
                raise ParamRuleError(f"dmuon.muon_params: selects {name!r} of shape "
                                     f"{tuple(param.shape)}; Muon takes 2-D or 3-D weights")
            if _owning_block(name, boundaries) is None:
                raise ParamRuleError(f"dmuon.muon_params: {name!r} lies in no hook boundary; "
                                     "widen dmuon.hook_boundaries")
            why = None
        if why is None:
            split.muon.append(name)
        else:
            split.adamw.append(name)
            split.reasons[name] = why
    if hook_boundaries is None:
        split.boundaries = _with_expert_boundaries(model, blocks, split.muon)
    split.__post_init__()
    if not split.muon:
        raise ParamRuleError("dmuon.muon_params: no parameter gets Muon")
    return split
