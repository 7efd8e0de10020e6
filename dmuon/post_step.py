"""The reference implementation's explicit post-backward and post-step calls:
``prepare_muon_grads`` (every gradient landed on its owner) and
``broadcast_all_updates``/``broadcast_all_updates_async`` (the owners' current values
published to every replica of their column). ``dmuon.Muon.step()`` does both by itself;
these are for a loop that changes owned values outside the step (a custom update, a
reload) or that wants the work at a point of its own choosing."""

from __future__ import annotations

from torch import nn

from .model_state import get_state


def prepare_muon_grads(model: nn.Module, *, use_reduce_stream: bool = False,
                       coalesce_wait: bool = False) -> None:
    """Every pending gradient reduce landed in its owner's master ``.grad`` (TP shards'
    too: their NS gathers at the step). ``use_reduce_stream``/``coalesce_wait`` choose the
    reference's CUDA stream waits and are checked, then unused: here each boundary's
    landing is waited for in the reduces' fixed order."""
    for name, flag in (("use_reduce_stream", use_reduce_stream),
                       ("coalesce_wait", coalesce_wait)):
        if not isinstance(flag, bool):
            raise TypeError(f"prepare_muon_grads: {name} must be a bool, got {flag!r}")
    get_state(model).finish_gradient_sync()


def broadcast_all_updates_async(model: nn.Module) -> None:
    """Publish every owner's current master to its column and start the HSDP replicate
    all-gathers without waiting (the next forward, any state-dict call or
    ``wait_all_post_step_broadcasts`` waits); one in flight is waited for first."""
    for b in get_state(model).boundaries:
        b.transfer.wait_gather()
        b.publish()
        b.transfer.start_replicate()


def broadcast_all_updates(model: nn.Module) -> None:
    """``broadcast_all_updates_async``, then wait: on return every replica holds its
    owners' current values."""
    broadcast_all_updates_async(model)
    get_state(model).drain()
