"""QK-clip's reference, written for the tests from the Kimi K2 report (section 2.1) in
plain loops: the causal max logit of each query head, and the report's per-head rule
with this project's GQA split (each head's logits scale by ``gamma_h = min(1, tau /
S_h)``: its key head by ``sqrt(gamma_g)``, ``gamma_g`` its group's least gamma, each query
head by ``gamma_h / sqrt(gamma_g)``)."""

from __future__ import annotations

import math

import torch

from helpers.train import lr_lambda, reference_ns, reference_optimizers

RTOL = 1e-9  # float64 throughout: the clip and its record are exact to rounding


def causal_head_maxima(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per query head, the max over batch and causal pairs of q . k / sqrt(head_dim);
    q ``[B, H_q, T, D]`` and k ``[B, H_kv, T, D]`` after RoPE."""
    t, d = q.shape[2], q.shape[3]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    return logits.amax(dim=(0, 2, 3))


@torch.no_grad()
def clip_heads(attn, maxima: list[float], tau: float) -> None:
    """Scales ``attn.q_proj``/``attn.k_proj`` rows in place by the rule above."""
    d = attn.head_dim
    kv = attn.k_proj.weight.shape[0] // d
    rep = len(maxima) // kv
    for g in range(kv):
        gammas = [min(1.0, tau / maxima[h]) for h in range(g * rep, (g + 1) * rep)]
        group = min(gammas)
        attn.k_proj.weight[g * d:(g + 1) * d] *= math.sqrt(group)
        for i, gamma in enumerate(gammas):
            h = g * rep + i
            attn.q_proj.weight[h * d:(h + 1) * d] *= gamma / math.sqrt(group)


def assert_same_record(want: list, got: list, where) -> None:
    """Per step, the (max logit, heads clipped) the reference measured and a rank's."""
    for step, ((max_logit, clipped), (got_max, got_clipped)) in enumerate(zip(want, got)):
        assert abs(got_max - max_logit) <= RTOL * max_logit, (where, step, got_max)
        assert got_clipped == clipped, (where, step, got_clipped, clipped)


def assert_clip_ends_at_tau(measured: list, now: list, lasts: list, tau: float) -> None:
    """A step at lr 0 moves nothing but the clip. ``measured``/``now``: per layer, per
    head, the max logits on that step's attention inputs before/after it; ``lasts``:
    each rank's (max logit, heads clipped) of it. The heads over tau end at tau, every
    other head is where it was, and every rank counted the same heads."""
    clipped = [(i, h) for i, m in enumerate(measured) for h, s in enumerate(m) if s > tau]
    assert clipped, measured  # the check can fail
    for max_logit, count in lasts:
        assert count == len(clipped), (count, clipped)
        assert abs(max_logit - max(max(m) for m in measured)) <= RTOL * max_logit
    for i, m in enumerate(measured):
        for h, s in enumerate(m):
            assert abs(now[i][h] - min(s, tau)) <= RTOL * min(s, tau), (i, h, s, now[i][h])


def reference_run(model, predicate, loss_of, step_maxima, tau: float, batches):
    """torch.optim.Muon + AdamW in one process (float64 NS, the tests' schedule), each
    step's clip applied after its update from the maxima ``step_maxima()`` measured in
    its forward, as the report does. Returns the final state dict and, per step, the
    largest max logit and the heads over tau."""
    named = list(model.named_parameters())
    opts = reference_optimizers([p for n, p in named if predicate(n, p)],
                                [p for n, p in named if not predicate(n, p)])
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in opts]
    record = []
    with reference_ns():
        for batch in batches:
            loss_of(model, batch).backward()
            maxima = step_maxima()
            for o in opts:
                o.step()
            for layer, m in zip(model.model.layers, maxima):
                clip_heads(layer.self_attn, m, tau)
            record.append((max(max(m) for m in maxima),
                           sum(s > tau for m in maxima for s in m)))
            for s in scheds:
                s.step()
            for o in opts:
                o.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, record
