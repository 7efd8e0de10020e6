"""The reference's guides ``guides/integration-recipes.md`` and
``guides/pure-dmuon-routing.md``, their code done with the same dmuon calls and keywords
on 4 gloo ranks (the tests' Llama or a tiny Hugging Face Llama, float64 with
``ns_dtype=torch.float64`` where the comparison is to 1e-9), against the float64
single-process reference (torch.optim.Muon + AdamW at dmuon.Muon's defaults). The table
of usages tested elsewhere is test_guides_recipes.py's docstring.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.distributed as dist
from helpers.hf_build import hf_causal_lm
from helpers.model import DecoderLayer, build_model, get_config
from helpers.train import global_batches, local_rows, loss_of
from test_guides_parallel import reference
from test_guides_recipes import _attempt, assert_close, reference_train, train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.testing import run

STEPS, WORLD = 3, 4
HF_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             tie_word_embeddings=False, use_cache=False)


QWEN2VL = dict(  # a tiny Qwen2-VL: the text tower as LLAMA, two vision blocks
    text_config={**LLAMA, "bos_token_id": 0, "eos_token_id": 1,
                 "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}},
    vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2,
                       patch_size=4, spatial_merge_size=2, temporal_patch_size=2))


def tiny(seed=0, dtype=torch.float64):
    return build_model(get_config("tiny"), dtype=dtype, seed=seed)


def _custom_loop(mesh, seed=0):
    """integration-recipes.md "Custom training loops" (custom_loop.py)."""
    model = tiny(seed)
    dmuon.dedicate_params(
        model, mesh, predicate=lambda n, p: p.ndim == 2 and "proj" in n
    )
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)


def parallelize_model(model, mesh, config):
    """torchtitan's FSDP wrapping as it does it: ``fully_shard`` looked up when called,
    per block and at the root, on the data-parallel dim."""
    from torch.distributed.fsdp import fully_shard

    for block in model.model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def _torchtitan(world):
    """integration-recipes.md "torchtitan": DMuon before the framework's wrapping."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    config = types.SimpleNamespace(lr=0.02, adamw_lr=1e-3)
    model = tiny()
    dmuon.dedicate_params(
        model, mesh["dp"],
        predicate=lambda n, p: p.ndim == 2 and "proj" in n,
    )
    parallelize_model(model, mesh, config)
    return model, dmuon.Muon(model, lr=config.lr, adamw_lr=config.adamw_lr,
                             ns_dtype=torch.float64)


def _accumulate(model, optimizer, rank, world, accum_steps=2):
    """integration-recipes.md manual_overrides.py, "Gradient accumulation": each step's
    rows in ``accum_steps`` micro-batches."""
    dataloader = [part for batch in global_batches(2)
                  for part in local_rows(batch, rank, world).chunk(accum_steps)]
    for i, batch in enumerate(dataloader):
        ctx = dmuon.no_sync(model) if (i + 1) % accum_steps != 0 else contextlib.nullcontext()
        with ctx:
            loss = loss_of(model, batch) / accum_steps
            loss.backward()
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    return dmuon.full_state_dict(model)


def _checkpoint(mesh, model, optimizer, path):
    """integration-recipes.md "Checkpointing across integrations" (checkpoint_save.py),
    loaded into a fresh model (other seed) as a restart does."""
    model_sd = dmuon.get_model_state_dict(model)      # drains async broadcast first
    optim_sd = dmuon.get_optimizer_state_dict(model, optimizer)
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, path)
    dist.barrier()
    model, optimizer = _custom_loop(mesh, seed=1)
    ckpt = torch.load(path, map_location="cpu")
    dmuon.set_model_state_dict(model, ckpt["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, ckpt["optim"])
    return model, optimizer


def _local_batches(rank, world, steps=STEPS):
    return [local_rows(b, rank, world) for b in global_batches(steps)]


def hf_proj(n, p):
    return p.ndim == 2 and any(k in n for k in HF_PROJ)


def _hf(mesh, rank, world):
    """integration-recipes.md "HuggingFace Transformers and Accelerate" (hf_dmuon.py), a
    tiny Llama built from its config in place of the hub checkpoint."""
    model = hf_causal_lm("LlamaForCausalLM", LLAMA, seed=0)
    dmuon.dedicate_params(  # Step 1: mark dedicated params BEFORE fully_shard.
        model, mesh,
        predicate=lambda n, p: p.ndim == 2 and any(
            k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj",
                             "gate_proj", "up_proj", "down_proj")
        ),
    )
    for layer in model.model.layers:  # Step 2: apply FSDP2
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)  # Step 3
    dataloader = [{"input_ids": rows, "labels": rows} for rows in _local_batches(rank, world)]
    for batch in dataloader:
        optimizer.zero_grad()
        outputs = model(**batch)
        outputs.loss.backward()
        optimizer.step()
    return dmuon.full_state_dict(model)


def _qwen_vl(mesh, rank, world):
    """custom-hook-boundaries.md, "Example 3: Nested Qwen-VL-style model", a tiny
    Qwen2-VL from its config in place of the hub checkpoint, trained on text."""
    model = hf_causal_lm("Qwen2VLForConditionalGeneration", QWEN2VL, seed=0)

    def boundary(m):
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VLDecoderLayer,
            Qwen2VLVisionBlock,
        )
        return isinstance(m, (Qwen2VLDecoderLayer, Qwen2VLVisionBlock))

    dmuon.dedicate_params(
        model, mesh,
        predicate=lambda n, p: p.ndim == 2 and any(
            k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj",
                             "gate_proj", "up_proj", "down_proj")
        ),
        hook_boundary_predicate=boundary,
        hook_boundary_strict=True,
    )
    # transformers 5 holds the guide's model.model.layers and model.visual.blocks here
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    for block in model.model.visual.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)
    final = train(model, optimizer, _local_batches(rank, world), hf_loss)
    return {"boundaries": [b.name for b in dmuon.get_state(model).boundaries], "final": final}


def hf_loss(model, rows):
    return model(input_ids=rows, labels=rows).loss


def _integration(rank, world, path):
    mesh = init_device_mesh("cpu", (world,))
    out = {"patched": fully_shard is dmuon.fully_shard}
    model, optimizer = _custom_loop(mesh)
    out["custom"] = train(model, optimizer, _local_batches(rank, world), loss_of)
    model, optimizer = _custom_loop(mesh)
    train(model, optimizer, _local_batches(rank, world)[:STEPS - 1], loss_of)
    restored = _attempt(lambda: _checkpoint(mesh, model, optimizer, path))
    out["restored"] = restored if isinstance(restored[0], str) else train(
        *restored, _local_batches(rank, world)[STEPS - 1:], loss_of)
    out["torchtitan"] = train(*_torchtitan(world), _local_batches(rank, world), loss_of)
    out["accumulated"] = _accumulate(*_custom_loop(mesh), rank, world)
    out["hf"] = _hf(mesh, rank, world)
    out["qwen_vl"] = _qwen_vl(mesh, rank, world)
    return out


@functools.cache
def integration_runs():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return run(_integration, f"{tmp}/checkpoint.pt", world_size=WORLD)


def test_import_makes_fully_shard_skip_dedicated_params():
    """integration-recipes.md, "Design principle" 1: after ``import dmuon``, FSDP2's
    public ``fully_shard`` is the one that skips dedicated params."""
    assert all(res["patched"] for res in integration_runs())


def test_custom_training_loop_matches_the_float64_reference():
    """integration-recipes.md, "Custom training loops" (custom_loop.py): a 1-D unnamed
    mesh, ``dedicate_params`` before ``fully_shard``, ``Muon(lr=0.02, adamw_lr=1e-3)``."""
    for res in integration_runs():
        assert_close(res["custom"], reference())


def test_torchtitan_recipe_matches_the_float64_reference():
    """integration-recipes.md, "torchtitan": ``dedicate_params(model, mesh["dp"], ...)``
    before a framework function that calls ``fully_shard``."""
    for res in integration_runs():
        assert_close(res["torchtitan"], reference())


def test_no_sync_accumulation_matches_the_whole_batch():
    """integration-recipes.md, "Custom training loops" (manual_overrides.py, gradient
    accumulation): ``no_sync`` on all but the last micro-batch, ``loss / accum_steps``,
    two steps of two micro-batches equal two whole-batch steps."""
    for res in integration_runs():
        assert_close(res["accumulated"], reference(steps=2))


def test_checkpoint_save_and_restore_continues_bit_identically():
    """integration-recipes.md, "Checkpointing across integrations": rank 0 saves the
    getters' dicts, ``dist.barrier()``, ``torch.load(..., map_location="cpu")`` and the
    two setters; step 3 after the restore equals step 3 of the run that saved."""
    for res in integration_runs():
        assert isinstance(res["restored"], dict), res["restored"]
        for key, value in res["custom"].items():
            assert torch.equal(res["restored"][key], value), key


def test_hugging_face_recipe_matches_the_float64_reference():
    """integration-recipes.md, "HuggingFace Transformers and Accelerate": the guide's
    predicate on the projection names, ``fully_shard`` on ``model.model.layers``, the
    loop on ``model(**batch).loss``."""
    model = hf_causal_lm("LlamaForCausalLM", LLAMA, seed=0)
    ref = reference_train(model, hf_proj, global_batches(STEPS), hf_loss)
    for res in integration_runs():
        assert_close(res["hf"], ref)


def test_nested_qwen_vl_example_matches_the_float64_reference():
    """guides/custom-hook-boundaries.md, "Example 3: Nested Qwen-VL-style model": the
    guide's predicate and ``isinstance`` boundary on the decoder layers and vision
    blocks; one hook site per decoder layer (the vision blocks hold no projection of
    those names), and 3 text steps as one process takes them."""
    model = hf_causal_lm("Qwen2VLForConditionalGeneration", QWEN2VL, seed=0)
    ref = reference_train(model, hf_proj, global_batches(STEPS), hf_loss)
    for res in integration_runs():
        assert res["qwen_vl"]["boundaries"] == [f"model.language_model.layers.{i}"
                                                for i in range(2)]
        assert_close(res["qwen_vl"]["final"], ref)


# -- guides/pure-dmuon-routing.md ---------------------------------------------------------

GUIDE_POLICY = {  # "Routing Policy", as the guide writes it
    "defaults": {
        "route": "muon",
        "param_dtype": torch.bfloat16,
        "grad_dtype": None,
        "master_dtype": torch.float32,
        "optim_dtype": torch.float32,
    },
    "overrides": [
        {
            "name": ["embed_tokens", "word_embeddings", "wte", "lm_head"],
            "set": {"route": "sharded_adamw"},
        },
        {
            "name": ["norm", "ln_", ".bias"],
            "set": {"route": "adamw"},
        },
        {
            "name": ["action_head", "action_decoder"],
            "set": {
                "param_dtype": torch.float32,
                "grad_dtype": torch.float32,
                "output_dtype": torch.float32,
                "cast_forward_inputs": True,
            },
        },
    ],
}
TransformerDecoderLayer = DecoderLayer


def guide_hook_boundary(model, also=None):
    """"Hook Boundaries", the guide's function; ``also``: one more module accepted."""
    terminal_module_ids = {
        id(module)
        for module in (
            getattr(model, "lm_head", None),
            getattr(getattr(model, "model", None), "embed_tokens", None),
        )
        if isinstance(module, (torch.nn.Embedding, torch.nn.Linear))
    }

    def hook_boundary(module):
        if id(module) in terminal_module_ids or module is also:
            return True
        return isinstance(module, TransformerDecoderLayer)

    return hook_boundary


def fp32():
    """The float64 reference's initial values in float32 (``master_dtype`` must be the
    params' own)."""
    return tiny().to(torch.float32)


def _dedicate_pure(model, mesh, policy=GUIDE_POLICY, also=None):
    dmuon.dedicate_params(model, mesh, predicate=lambda name, param: param.requires_grad,
                          param_policy=policy,
                          hook_boundary_predicate=guide_hook_boundary(model, also))


def _pure(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    out = {"verbatim": _attempt(lambda: _dedicate_pure(fp32(), mesh))}
    cast = {**GUIDE_POLICY, "overrides": [*GUIDE_POLICY["overrides"], {
        "name": ["q_proj"], "set": {"param_dtype": torch.float32, "cast_forward_inputs": True}}]}
    model = fp32()
    out["mixed_cast"] = _attempt(lambda: _dedicate_pure(model, mesh, cast, model.model.norm))
    model = fp32()
    _dedicate_pure(model, mesh, also=model.model.norm)  # the final norm: its own boundary
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    out["summary"] = dmuon.summarize_param_groups(model, optimizer)
    with torch.no_grad():  # the dtype the head computes in: the policy's, from FSDP2
        out["logits"] = model(global_batches(1)[0][:2, :-1]).dtype
    out["final"] = train(model, optimizer, _local_batches(rank, world), loss_of)
    semantic = dmuon.Muon(model, param_groups=[{"params": list(model.parameters()),
                                                "group_name": "all"}])
    out["semantic"] = [(g["group_name"], g["dmuon_route"]) for g in semantic.param_groups]
    return out


@functools.cache
def pure_runs():
    return run(_pure, world_size=WORLD)


def _expected_route(name):
    """The guide's "practical LLM policy" on the tests' Llama."""
    if "embed_tokens" in name or "lm_head" in name:
        return "sharded_adamw", [0]
    return ("adamw", [1]) if "norm" in name else ("muon", [])


def test_guide_hook_boundary_needs_the_final_norm():
    """guides/pure-dmuon-routing.md, "Hook Boundaries": the guide's function accepts
    decoder layers, the embedding and the head; the final norm (``"adamw"`` route,
    called outside the layers) has no boundary, so strict setup names it."""
    for res in pure_runs():
        kind, message = res["verbatim"]
        assert kind == "ValueError" and "'model.norm.weight'" in message, message


def test_validation_summary_shows_the_route_split():
    """guides/pure-dmuon-routing.md, "Validation": ``summarize_param_groups(model,
    optimizer)``: projection matrices under Muon, norms under AdamW, only the embedding
    and head under sharded AdamW, each row with its matched override indices."""
    names = [n for n, _ in tiny().named_parameters()]
    for res in pure_runs():
        rows = {r["name"]: r for r in res["summary"]["params"]}
        assert sorted(rows) == sorted(names)
        for name, row in rows.items():
            assert (row["route"], row["matched_overrides"]) == _expected_route(name), name
        counts = {r: v["params"] for r, v in res["summary"]["all_routes"].items()}
        assert counts == {"muon": 14, "adamw": 5, "sharded_adamw": 2}
        assert res["logits"] == torch.bfloat16  # the head computes in the policy's dtype


def test_validation_summary_rows_show_the_policys_dtypes():
    """guides/pure-dmuon-routing.md, "Validation": "The parameter rows also show
    ``param_dtype``, ``grad_dtype``": the policy's bf16 on every row (``grad_dtype=None``
    is FSDP2's: the param dtype)."""
    for res in pure_runs():
        for row in res["summary"]["params"]:
            assert row["param_dtype"] == row["grad_dtype"] == str(torch.bfloat16), row


def test_guide_policy_trains_as_bf16_compute_of_the_reference():
    """guides/pure-dmuon-routing.md, "Routing Policy": the guide's policy (bf16 compute,
    fp32 masters) for 3 steps against the float64 reference. Muon matrices and norms:
    within a fifth of the distance the reference moved them. The embedding and head
    (AdamW, whose first steps follow the sign of each gradient, bf16's for near-zero
    ones): within twice the most 3 AdamW steps can move an element."""
    ref, init = reference(), tiny().state_dict()
    for res in pure_runs():
        for key, value in ref.items():
            diff = (res["final"][key].double() - value).abs().max().item()
            if _expected_route(key)[0] == "sharded_adamw":
                assert diff <= 2 * STEPS * 1e-3, (key, diff)
            else:
                assert diff <= 0.2 * (value - init[key]).abs().max().item(), (key, diff)


def test_mixed_dtypes_with_cast_forward_inputs_in_one_boundary_are_refused():
    """guides/pure-dmuon-routing.md, "Hook Boundaries": an fp32 override with
    ``cast_forward_inputs`` on a param inside a bf16 decoder layer raises at setup."""
    for res in pure_runs():
        assert res["mixed_cast"][0] == "ValueError", res["mixed_cast"]
        assert "q_proj" in res["mixed_cast"][1]


def test_a_semantic_group_splits_by_route():
    """guides/pure-dmuon-routing.md, "Control Surface": one optimizer group holding Muon
    matrices and AdamW-routed params becomes route-specific subgroups, each keeping the
    route the policy chose."""
    for res in pure_runs():
        assert res["semantic"] == [("all/muon", "muon"), ("all/adamw", "adamw")]
