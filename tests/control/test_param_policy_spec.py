"""``dmuon.param_policy`` in a job spec, refused or planned by the control plane's own
app (FastAPI's TestClient, no Ray): each malformed policy is a 422 naming its field as
the user wrote it (``spec.dmuon.param_policy.overrides[0].name``); a policy the model
refuses (a 1-D norm left on Muon, a master dtype the params are not built in) is a 422
naming ``spec.dmuon.param_policy`` before anything runs; a dry run stores each param's
route; and the stored spec reads back as the same policy (an override's unset fields
stay unset, so they do not reset the defaults)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.control.app import create_app
from service.control.settings import Settings
from service.job.spec import parse_spec

TOKEN = "policy-token"
ROUTES = {"defaults": {"route": "muon"},
          "overrides": [{"name": ["embed_tokens", "lm_head"], "set": {"route": "sharded_adamw"}},
                        {"name": "norm", "set": {"route": "adamw"}}]}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    settings = Settings(api_token=TOKEN, db=str(root / "dmuon.db"), storage=str(root / "runs"),
                        ray_address=None, local_ray=False, local_cpus=2)
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        yield c


def _post(client, policy, spec=None, **dmuon):
    spec = {"name": "p", "model": "tiny", "steps": 2, "seq_len": 16, "batch_size": 4,
            "layout": {"replicate": 1, "shard": 2},
            "dmuon": {"param_policy": policy, **dmuon}, **(spec or {})}
    r = client.post("/v1/jobs", json={"spec": spec, "dry_run": True},
                    headers={"Authorization": f"Bearer {TOKEN}"})
    return r.status_code, r.json()


@pytest.mark.parametrize("policy,field", [
    ({"overrides": [{"set": {"route": "adamw"}}]}, "spec.dmuon.param_policy.overrides[0].name"),
    ({"overrides": [ROUTES["overrides"][0], {"name": [], "set": {}}]},
     "spec.dmuon.param_policy.overrides[1].name"),
    ({"overrides": [{"name": "norm", "set": {"route": "sgd"}}]},
     "spec.dmuon.param_policy.overrides[0].set.route"),
    ({"defaults": {"param_dtype": "int8"}}, "spec.dmuon.param_policy.defaults.param_dtype"),
    ({"defaults": {"route": "muon", "dtype": "bf16"}}, "spec.dmuon.param_policy.defaults.dtype"),
    ({"overrides": [{"name": "norm", "set": {}, "route": "adamw"}]},
     "spec.dmuon.param_policy.overrides[0].route"),
    ({"default": {}}, "spec.dmuon.param_policy.default"),
    ({"overrides": [{"name": "a", "contains": "b", "set": {}}]},
     "spec.dmuon.param_policy.overrides[0]"),
])
def test_a_malformed_policy_is_a_422_naming_its_field(client, policy, field):
    status, body = _post(client, policy)
    assert status == 422 and [d["field"] for d in body["detail"]] == [field], body


def test_a_policy_beside_the_regex_rule_is_refused(client):
    status, body = _post(client, ROUTES, muon_params=r".*proj\.weight")
    assert status == 422 and [d["field"] for d in body["detail"]] == \
        ["spec.dmuon.param_policy"], body


@pytest.mark.parametrize("policy,spec,says", [
    ({"defaults": {"route": "muon"}}, None,
     "'model.layers.0.input_layernorm.weight' (64,) is routed to 'muon'"),
    ({**ROUTES, "defaults": {"master_dtype": "bf16"}}, None,
     "master_dtype=torch.bfloat16 differs"),
    # the embeddings' dtypes would be FSDP2's mixed precision, which precision sets too
    ({**ROUTES, "defaults": {"param_dtype": "bf16"}}, {"precision": {"param_dtype": "bfloat16"}},
     "sets the dtypes of sharded_adamw params ('model.embed_tokens.weight')"),
])
def test_a_policy_the_model_refuses_is_a_422_before_anything_runs(client, policy, spec, says):
    status, body = _post(client, policy, spec)
    assert status == 422, body
    (entry,) = body["detail"]
    assert entry["field"] == "spec.dmuon.param_policy" and says in entry["message"], entry


def test_a_dry_run_stores_each_params_route(client):
    status, job = _post(client, ROUTES)
    assert status == 201, job
    part = client.get(f"/v1/jobs/{job['id']}/partition").json()
    routes = {n: r["route"] for n, r in part["optimizer_split"]["routes"].items()}
    assert routes["model.embed_tokens.weight"] == routes["lm_head.weight"] == "sharded_adamw"
    assert routes["model.norm.weight"] == routes["model.layers.1.input_layernorm.weight"] \
        == "adamw"
    assert routes["model.layers.1.mlp.down_proj.weight"] == "muon"
    assert {a["param"] for a in part["params"].values()} == \
        {n for n, r in routes.items() if r != "sharded_adamw"}


def test_the_stored_spec_reads_back_as_the_same_policy():
    policy = {"defaults": {"route": "muon", "param_dtype": "bf16", "grad_dtype": None},
              "overrides": [{"contains": "norm", "set": {"route": "adamw"}},
                            {"name": ["head"], "set": {"param_dtype": "float32",
                                                       "cast_forward_inputs": True}}]}
    first = parse_spec({"dmuon": {"param_policy": policy}})
    stored = first.model_dump(mode="json")
    assert stored["dmuon"]["param_policy"] == {
        "defaults": {"route": "muon", "param_dtype": "bfloat16", "grad_dtype": None},
        "overrides": [{"name": "norm", "set": {"route": "adamw"}},
                      {"name": ["head"], "set": {"param_dtype": "float32",
                                                 "cast_forward_inputs": True}}]}
    assert parse_spec(stored).dmuon.param_policy.as_dict() == \
        first.dmuon.param_policy.as_dict() == stored["dmuon"]["param_policy"]
