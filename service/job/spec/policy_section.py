"""``dmuon.param_policy``: pure-DMuon routing, in the structure of the reference's
``param_policy`` (its guide "Pure DMuon Routing"): ``defaults``, then the ordered
``overrides`` whose ``name`` tokens (``contains``, the legacy alias) occur in a param's
full name, each setting only the fields of its ``set``; a missing route is ``"muon"``.

Torch-free: dtypes are names (``bf16``/``bfloat16``, ``fp32``/``float32``...), kept as
the spec's dtype names; the workers' side (``service.job.models.routing``) turns them
into torch dtypes for ``dmuon.dedicate_params(param_policy=...)``. What needs the model
(a 1-D param routed to Muon, a dtype its storage cannot follow) the planner refuses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer, model_validator

from .field_types import DtypeAlias, StrictModel, either, text

Token = text(256, 1)
Tokens = either(lambda v: "many" if isinstance(v, list) else "one", one=Token,
                many=Annotated[list[Token], Field(min_length=1, max_length=64)])


class PolicyFields(StrictModel):
    """A policy's fields (``dmuon.DMuonParamPolicy``'s): only those given are set, so an
    override changes just them (``null`` sets a dtype back to none: the param's own)."""

    route: Literal["muon", "adamw", "sharded_adamw"] | None = Field(
        None, description="muon: Muon on an owner; adamw: AdamW on an owner (broadcast/"
                          "reduce); sharded_adamw: FSDP2's shards (all-gather/reduce-scatter)")
    param_dtype: DtypeAlias | None = Field(None, description="forward compute and its gather")
    grad_dtype: DtypeAlias | None = Field(None, description="gradient buffers and their reduce")
    output_dtype: DtypeAlias | None = Field(None, description="outputs cast at the boundary")
    cast_forward_inputs: bool | None = Field(None, description="inputs cast to param_dtype")
    master_dtype: DtypeAlias | None = Field(None, description="the owner's master copy")
    optim_dtype: DtypeAlias | None = Field(None, description="the optimizer's state and math")
    muon_forward_unshard: Literal["broadcast", "all_gather"] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler):
        # stored as written: an unset field must stay unset when the driver re-reads it
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}

    def given(self) -> dict:
        """The fields set, by name (dtypes by the spec's names)."""
        return {k: getattr(self, k) for k in self.model_fields_set}


class PolicyOverride(StrictModel):
    name: Tokens = Field(description="a token, or a list of them: the override applies to "
                                     "a param whose full name contains any")
    set: PolicyFields

    @model_validator(mode="before")
    @classmethod
    def _contains(cls, data: Any):
        # ``contains``: the reference's legacy alias of ``name``
        if isinstance(data, dict) and "contains" in data:
            if "name" in data:
                raise ValueError("name and contains (its legacy alias) both given; give one")
            data = {("name" if k == "contains" else k): v for k, v in data.items()}
        return data


class ParamPolicySpec(StrictModel):
    """``{defaults: {...}, overrides: [{name: [...], set: {...}}, ...]}``."""

    defaults: PolicyFields = Field(default_factory=PolicyFields)
    overrides: list[PolicyOverride] = Field(default_factory=list, max_length=256)

    def as_dict(self) -> dict:
        """The reference's ``param_policy`` dict, dtypes by name."""
        return {"defaults": self.defaults.given(),
                "overrides": [{"name": o.name, "set": o.set.given()} for o in self.overrides]}
