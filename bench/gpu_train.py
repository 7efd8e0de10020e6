"""The models and the training loop the single-device checks share (``bench.gpu``).

World size 1: every set-up is a shard group of one rank, DMuon's own collectives send
nothing, and FSDP2's run on one rank. The same seed and batches for every set-up, so
their losses compare step by step.
"""

from __future__ import annotations

import gc
import math

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import dmuon
from service.job.models.builtin import ModelConfig, build_model, causal_lm_loss, get_config
from service.job.models.params import split_params

# (b)-(d) on a model small enough to compile in a minute; (e) at about 1B params
# (20 Llama-3-style layers of d = 2,048, GQA 16/4 heads, vocabulary 32,000: 1.03B)
CHECK = ModelConfig(vocab_size=4096, dim=512, n_layers=4, n_heads=8, n_kv_heads=4,
                    ffn_dim=1536, max_seq_len=512)
BILLION = ModelConfig(vocab_size=32000, dim=2048, n_layers=20, n_heads=16, n_kv_heads=4,
                      ffn_dim=5632, max_seq_len=2048)
# (batch, sequence) per step
CHECK_BATCH = {"cuda": (4, 256), "tiny": (2, 16)}
STEP_BATCH = {"cuda": (4, 2048), "tiny": (2, 16)}


def check_config(tiny: bool) -> ModelConfig:
    return get_config("tiny") if tiny else CHECK


def batches(config: ModelConfig, shape: tuple[int, int], steps: int,
            device: torch.device) -> list[torch.Tensor]:
    """``steps`` batches of ``shape`` token ids (one extra position for the targets)."""
    g = torch.Generator().manual_seed(0)
    return list(torch.randint(0, config.vocab_size, (steps, shape[0], shape[1] + 1),
                              generator=g).to(device))


def _mesh(device: torch.device):
    return init_device_mesh(device.type, (1,), mesh_dim_names=("shard",))


def _fsdp(model, mesh, z3: bool, bf16: bool) -> None:
    kwargs = {"reshard_after_forward": z3}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh, **kwargs)
    dmuon.fully_shard(model, mesh=mesh, **kwargs)


def build_dmuon(config: ModelConfig, device: torch.device, *, z3: bool = True,
                compile_kwargs: dict | None = None, bf16: bool = False):
    """DMuon (Z3, or Z2 with ``z3=False``) + FSDP2 per block, each block compiled with
    ``block.compile(**compile_kwargs)`` when given; fp32 params unless ``bf16``."""
    model = build_model(config, device=device, seed=0)
    if compile_kwargs is not None:
        for layer in model.model.layers:
            layer.compile(**compile_kwargs)
    mesh = _mesh(device)
    dmuon.dedicate_params(model, mesh, predicate=split_params(model).predicate,
                          reshard_after_forward=z3)
    _fsdp(model, mesh, z3, bf16)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)


def build_fsdp2_adamw(config: ModelConfig, device: torch.device, *, bf16: bool = False):
    """FSDP2 per block + torch.optim.AdamW (fused on CUDA), the baseline of (e)."""
    model = build_model(config, device=device, seed=0)
    _fsdp(model, _mesh(device), True, bf16)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                    fused=device.type == "cuda")


def step(model, opt, tokens: torch.Tensor) -> torch.Tensor:
    """One training step; returns the loss (a tensor: reading it waits for the device)."""
    # a new iteration for CUDA graph trees (reduce-overhead): the previous replay's
    # outputs may be overwritten from here on; a no-op without CUDA graphs
    torch.compiler.cudagraph_mark_step_begin()
    loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def train(built, data: list[torch.Tensor]) -> list[float]:
    """The losses of one step per batch."""
    model, opt = built
    return [float(step(model, opt, tokens)) for tokens in data]


def release() -> None:
    """Drop what the last set-up left (models hold reference cycles) and, on CUDA, hand
    cached blocks back, so the next set-up's memory figures are its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_rel_diff(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference of two runs' losses, step by step (inf where one
    is not finite)."""
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)]
    return max(diffs) if all(math.isfinite(d) for d in diffs) else math.inf
