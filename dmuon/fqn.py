"""Names of params as state dicts spell them, whatever wrappers the modules gained.

Activation checkpointing's wrapper and ``torch.compile``'s add a path segment
(``_checkpoint_wrapped_module``, ``_orig_mod``), before or after ``dedicate_params``;
torch.distributed.checkpoint's state-dict helpers leave them out, and so does DMuon when
it finds a param by name.
"""

from __future__ import annotations

from torch import nn

_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_fqn(name: str) -> str:
    """A module-path name as ``state_dict`` keys spell it."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(param)`` -> its canonical name."""
    return {id(p): canonical_fqn(n) for n, p in model.named_parameters()}


def params_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    """Canonical name -> the model's param now (a wrapper added since is no matter)."""
    return {canonical_fqn(n): p for n, p in model.named_parameters()}
