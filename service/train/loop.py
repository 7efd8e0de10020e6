"""``train_loop_per_worker`` for ``ray.train.torch.TorchTrainer``.

Ray Train has set up the process group (gloo on CPUs, NCCL on GPUs); this never calls
``init_process_group``. World ranks are grouped by Ray node id, gathered from every
worker (simulated nodes on one host share one IP, so Ray's node rank cannot tell them
apart), and the (replicate, shard) mesh puts each shard group on one node.
"""

from __future__ import annotations

import os
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import dmuon

from ..spec import JobSpec, parse_spec
from .corpus import batch_at, load_corpus, load_text_corpus
from .dtypes import DTYPES, muon_kwargs
from .models import build_model, causal_lm_loss, init_builtin, muon_predicate


def mesh_rows(node_ids: list[str], replicate: int, shard: int) -> list[list[int]]:
    """World ranks as ``replicate`` rows of ``shard`` ranks, each row on one node when a
    node has at least ``shard`` workers (rows then span nodes in whole-node blocks)."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(rank)
    ordered = [rank for ranks in by_node.values() for rank in ranks]
    if len(ordered) != replicate * shard:
        raise ValueError(f"{len(ordered)} workers for a {replicate} x {shard} mesh")
    return [ordered[r * shard:(r + 1) * shard] for r in range(replicate)]


def _device() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)  # DMuon and FSDP2 allocate on the current device
        return device
    return torch.device("cpu")


def build_mesh(replicate: int, shard: int) -> tuple[DeviceMesh, list[str]]:
    import ray

    node_ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    rows = mesh_rows(node_ids, replicate, shard)
    mesh = DeviceMesh(_device().type, torch.tensor(rows), mesh_dim_names=("replicate", "shard"))
    return mesh, node_ids


def build_training(spec: JobSpec, mesh: DeviceMesh):
    """Model with DMuon then FSDP2 applied, and its optimizer. Built on the meta device:
    each rank materialises only what it keeps (``dmuon.materialize``)."""
    z3 = spec.dmuon.mode == "z3"
    model = build_model(spec.llama_config(), dtype=DTYPES[spec.precision], device="meta")
    hsdp = mesh["replicate"].size() > 1
    dmuon.dedicate_params(model, mesh["shard"], predicate=muon_predicate,
                          replicate_mesh=mesh["replicate"] if hsdp else None,
                          reshard_after_forward=z3)
    fsdp_mesh = mesh if hsdp else mesh["shard"]
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=z3)
    dmuon.fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=z3)
    dmuon.materialize(model, seed=spec.seed, init_fn=init_builtin)
    opt = dmuon.Muon(model, **muon_kwargs(spec.optimizer))
    return model, opt


def _corpus(data_path: str | None, split: str) -> torch.Tensor:
    """The built-in corpus, or the file the entrypoint resolved and checked."""
    if data_path is None:
        return load_corpus(split)
    return load_text_corpus(data_path, split)


@torch.no_grad()
def validation_loss(model, spec: JobSpec, corpus, dp_rank: int, dp_size: int) -> float:
    total = torch.zeros(1, dtype=torch.float64)
    for i in range(spec.data.val_batches):
        batch = batch_at(corpus, i, spec.batch_size * dp_size, spec.seq_len, seed=spec.seed + 1)
        rows = batch[dp_rank * spec.batch_size:(dp_rank + 1) * spec.batch_size].to(_device())
        total += causal_lm_loss(model(rows[:, :-1]), rows[:, 1:]).double().cpu()
    dist.all_reduce(total)
    return total.item() / (dp_size * spec.data.val_batches)


def _record(model, opt, step, loss, elapsed, tokens) -> dict:
    ledger = dmuon.get_ledger(model).last_step_by_phase()
    return {
        "step": step, "rank": dist.get_rank(), "loss": loss, "step_time_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "bytes": {f"{dim}.{phase}": n for dim, phases in ledger.items()
                  for phase, n in phases.items()},
        "memory": dmuon.memory_report(model, opt),
        "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "time": time.time(),
    }


def run_training(spec: JobSpec, mesh: DeviceMesh, *, report, checkpoint_dir=None,
                 data_path=None, node_ids=None, node_ip=None, fallback_checkpoint=None):
    """The training loop on a built mesh; returns the model. ``report(record, path)``
    gets every step's record and, on checkpoint steps, the committed directory."""
    model, opt = build_training(spec, mesh)
    rank = dist.get_rank()
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    dp_rank, dp_size = r * mesh["shard"].size() + s, dist.get_world_size()
    corpus, val_corpus = _corpus(data_path, "train"), _corpus(data_path, "val")
    start = _resume(model, opt, checkpoint_dir, fallback_checkpoint)
    for step in range(start, spec.steps):
        t0 = time.perf_counter()
        batch = batch_at(corpus, step, spec.batch_size * dp_size, spec.seq_len, seed=spec.seed)
        rows = batch[dp_rank * spec.batch_size:(dp_rank + 1) * spec.batch_size].to(_device())
        loss = causal_lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        record = _record(model, opt, step + 1, loss.item(), time.perf_counter() - t0,
                         rows[:, :-1].numel())
        record.update(coord=[r, s], resumed_from=start,
                      node_id=node_ids[rank] if node_ids else None, node_ip=node_ip)
        if spec.data.val_every and (step + 1) % spec.data.val_every == 0:
            record["val_loss"] = validation_loss(model, spec, val_corpus, dp_rank, dp_size)
        path = None
        if checkpoint_dir and spec.checkpoint.interval and \
                (step + 1) % spec.checkpoint.interval == 0:
            path = os.path.join(checkpoint_dir, f"step_{step + 1:06d}")
            dmuon.checkpoint.save(path, model, opt, extra={"step": step + 1})
        report(record, path)
    return model


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import ray.util

    spec = parse_spec(config["spec"])
    torch.set_num_threads(int(config.get("threads", 1)))
    mesh, node_ids = build_mesh(config["replicate"], config["shard"])
    rank = dist.get_rank()

    def report(record, path):  # rank 0 hands the committed checkpoint to Ray Train
        checkpoint = ray.train.Checkpoint.from_directory(path) if path and rank == 0 else None
        ray.train.report(record, checkpoint=checkpoint)

    model = run_training(spec, mesh, report=report, checkpoint_dir=config.get("checkpoint_dir"),
                         data_path=config.get("data_path"), node_ids=node_ids,
                         node_ip=ray.util.get_node_ip_address(),
                         fallback_checkpoint=ray.train.get_checkpoint)
    if config.get("return_params"):
        params = dmuon.full_state_dict(model)
        if rank == 0:
            torch.save(params, config["return_params"])


def latest_committed(root: str | None) -> str | None:
    """The newest complete checkpoint under ``root`` (``save`` commits by rename)."""
    if not root or not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and "." not in d
                  and os.path.isfile(os.path.join(root, d, dmuon.checkpoint.MANIFEST)))
    return os.path.join(root, done[-1]) if done else None


def _resume(model, opt, checkpoint_dir: str | None, fallback=None) -> int:
    """Resume from the newest committed checkpoint. Ray Train's latest registered one
    (``fallback``) can lag behind it: a report still in flight when a worker dies is lost."""
    path = latest_committed(checkpoint_dir)
    if path is not None:
        return dmuon.checkpoint.load(path, model, opt)["step"]
    checkpoint = fallback() if fallback else None
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as path:
        return dmuon.checkpoint.load(path, model, opt)["step"]
