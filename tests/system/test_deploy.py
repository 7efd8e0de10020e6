"""The deployment: Dockerfile lint, every manifest against its schema, manifests vs. code.

Rendering needs no kustomize binary: ``render`` implements the subset of Kustomize that
deploy/ uses (resources, namespace, images, ConfigMap/Secret generators with fixed names,
JSON6902 patches: add/replace/remove) and refuses any other field, so an overlay cannot
use a feature it does not render. Where ``kubectl`` is installed, the output is also
compared with ``kubectl kustomize``. KubeRay resources are checked against the CRD
schemas in tests/data/kuberay (see the README there for their source).
"""

import base64
import copy
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata

import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml
from helpers.paths import ROOT

KUBERAY = os.path.join(ROOT, "tests", "data", "kuberay")
K8S_VERSION = "1.34"
TREES = ["base", "overlays/cpu-dev", "overlays/gpu", "overlays/gpu-postgres"]
# variables that Ray, NCCL, gloo and OpenMP read (not this project's code)
EXTERNAL_ENV = {"RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_health_check_period_ms",
                "RAY_health_check_timeout_ms", "RAY_health_check_failure_threshold",
                "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS"}


def _nodes(x):
    """Every mapping inside ``x``, depth first."""
    if isinstance(x, dict):
        yield x
        x = list(x.values())
    if isinstance(x, list):
        for value in x:
            yield from _nodes(value)


def _containers(docs):
    return [c for n in _nodes(docs) for key in ("containers", "initContainers")
            for c in n.get(key, [])]


def _json6902(doc, op):
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")]
    for key in parents:
        doc = doc[int(key) if isinstance(doc, list) else key]
    if isinstance(doc, list):
        last = len(doc) if last == "-" else int(last)
    assert op["op"] in ("add", "replace", "remove"), op
    if op["op"] != "add":
        doc[last]  # noqa: B018 - replacing or removing a missing path fails, as in Kustomize
    if op["op"] == "remove":
        del doc[last]
    elif op["op"] == "add" and isinstance(doc, list):
        doc.insert(last, op["value"])
    else:
        doc[last] = op["value"]


def _generated(kind, gen, where):
    data = {os.path.basename(f): open(os.path.join(where, f)).read()
            for f in gen.get("files", [])}
    pairs = list(gen.get("literals", []))
    for env in gen.get("envs", []):
        lines = open(os.path.join(where, env)).read().splitlines()
        pairs += [ln for ln in lines if ln.strip() and not ln.startswith("#")]
    data.update(p.split("=", 1) for p in pairs)
    doc = {"apiVersion": "v1", "kind": kind, "metadata": {"name": gen["name"]}}
    if kind == "Secret":
        doc["type"] = "Opaque"
        data = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    doc["data"] = data
    return doc


def render(where):
    """The resources of the kustomization in ``where`` (see the module docstring)."""
    with open(os.path.join(where, "kustomization.yaml")) as fh:
        k = yaml.safe_load(fh)
    known = {"apiVersion", "kind", "resources", "namespace", "images", "configMapGenerator",
             "secretGenerator", "generatorOptions", "patches"}
    assert set(k) <= known, f"{where}: Kustomize fields not rendered here: {set(k) - known}"
    assert all("=" not in f for g in k.get("configMapGenerator", []) for f in g.get("files", []))
    docs = []
    for res in k.get("resources", []):
        path = os.path.join(where, res)
        docs += render(path) if os.path.isdir(path) else [
            d for d in yaml.safe_load_all(open(path)) if d]
    gens = [("ConfigMap", g) for g in k.get("configMapGenerator", [])]
    gens += [("Secret", g) for g in k.get("secretGenerator", [])]
    if gens:
        assert k.get("generatorOptions") == {"disableNameSuffixHash": True}, where
    for kind, gen in gens:
        assert set(gen) <= {"name", "files", "literals", "envs", "behavior"}, gen
        new = _generated(kind, gen, where)
        same = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (kind, gen["name"])]
        assert gen.get("behavior", "create") == ("replace" if same else "create"), gen
        docs = [d for d in docs if not any(d is s for s in same)] + [new]
    for patch in k.get("patches", []):
        t = patch["target"]
        assert set(patch) == {"target", "patch"} and set(t) <= {"group", "version", "kind",
                                                                  "name"}, patch
        api = (t["group"] + "/" if t.get("group") else "") + t["version"]
        hits = [d for d in docs if d["apiVersion"] == api and d["kind"] == t["kind"]
                and d["metadata"]["name"] == t["name"]]
        assert len(hits) == 1, f"{where}: patch target {t} matched {len(hits)}"
        ops = yaml.safe_load(patch["patch"])
        assert isinstance(ops, list), f"{where}: only JSON6902 patches are rendered here"
        for op in ops:
            _json6902(hits[0], op)
    if "namespace" in k:
        for d in docs:
            d["metadata"]["namespace"] = k["namespace"]
    for c in _containers(docs):
        name, _, tag = c["image"].partition(":")
        for im in k.get("images", []):
            if im["name"] == name:
                c["image"] = f"{im.get('newName', name)}:{im.get('newTag', tag)}"
    return docs


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """{tree: resources}, rendered from a copy of deploy/ in which the gpu overlay's
    secrets.env was made from its example, as deploy/README.md tells the user to do."""
    deploy = tmp_path_factory.mktemp("deploy") / "deploy"
    shutil.copytree(os.path.join(ROOT, "deploy"), deploy)
    gpu = deploy / "overlays" / "gpu"
    shutil.copy(gpu / "secrets.env.example", gpu / "secrets.env")
    return {tree: render(str(deploy / tree)) for tree in TREES} | {"_dir": str(deploy)}


def _one(docs, kind, name=None):
    hits = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(hits) == 1, (kind, name, len(hits))
    return hits[0]


@functools.lru_cache
def _crd_validator(kind):
    schema = yaml.safe_load(open(os.path.join(KUBERAY, f"{kind.lower()}-v1.schema.yaml")))

    for node in _nodes(schema):  # unknown fields are errors (kubectl's strict validation)
        if "properties" in node:
            node.setdefault("additionalProperties", False)
    defs_path = os.path.join(os.path.dirname(kubernetes_validate.__file__),
                             "kubernetes-json-schema", f"v{K8S_VERSION}.0-local-strict",
                             "_definitions.json")
    defs = referencing.Resource.from_contents(json.load(open(defs_path)))
    registry = referencing.Registry().with_resource(defs.id(), defs)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _validate(doc):
    if doc["apiVersion"] == "ray.io/v1":
        assert "rayClusterSpec" not in doc["spec"], "not transcribed: see tests/data/kuberay"
        _crd_validator(doc["kind"]).validate(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_dockerfile_passes_hadolint():
    hadolint = os.path.join(os.path.dirname(sys.executable), "hadolint")
    out = subprocess.run([hadolint, os.path.join(ROOT, "Dockerfile")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("tree", TREES)
def test_render_matches_kubectl_kustomize(rendered, tree):
    out = subprocess.run(["kubectl", "kustomize", os.path.join(rendered["_dir"], tree)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(yaml.safe_load_all(out), key=key) == sorted(rendered[tree], key=key)


@pytest.mark.parametrize("tree", TREES)
def test_every_manifest_validates(rendered, tree):
    kinds = [d["kind"] for d in rendered[tree]]
    assert {"RayCluster", "RayJob", "Deployment", "Service", "ConfigMap"} <= set(kinds)
    for doc in rendered[tree]:
        _validate(doc)


def test_validators_reject_broken_manifests(rendered):
    docs = rendered["overlays/gpu"]
    cluster, job = _one(docs, "RayCluster"), _one(docs, "RayJob")
    broken = [copy.deepcopy(d) for d in (cluster, cluster, cluster, job, job)]
    broken[0]["spec"]["workerGroupSpecs"][0]["replicas"] = "two"        # wrong type
    broken[1]["spec"]["headGroupSpec"]["rayStartParam"] = {}             # misspelt field
    head = broken[2]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["ports"][0]["containerPort"] = "6379"                           # pod template
    del broken[3]["spec"]["entrypoint"]                                  # required
    broken[4]["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["env"] = {"A": "b"}
    for doc in broken:
        with pytest.raises(jsonschema.ValidationError):
            _validate(doc)
    deployment = copy.deepcopy(_one(docs, "Deployment"))
    deployment["spec"]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        _validate(deployment)


@pytest.mark.parametrize("tree", TREES)
def test_rayjob_runs_the_entrypoint_on_the_mounted_spec(rendered, tree, tmp_path,
                                                         monkeypatch):
    from service.driver import job_driver as entrypoint
    from service.job import spec

    docs = rendered[tree]
    cluster, job = _one(docs, "RayCluster"), _one(docs, "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", entrypoint.__name__]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in head["volumes"]}
    loaded, stop = [], RuntimeError("parsed")

    def load_from_configmap(path):  # the file the driver reads on the head pod
        volume = volumes[mounts[os.path.dirname(path)]]
        data = _one(docs, "ConfigMap", volume["configMap"]["name"])["data"]
        local = tmp_path / os.path.basename(path)
        local.write_text(data[os.path.basename(path)])
        loaded.append(spec.load_spec(str(local)))
        return loaded[-1]

    monkeypatch.setattr(entrypoint, "load_spec", load_from_configmap)
    monkeypatch.setattr(entrypoint, "connect_ray", lambda *a: (_ for _ in ()).throw(stop))
    with pytest.raises(RuntimeError, match="parsed"):
        entrypoint.main(argv[3:])  # argparse exits (SystemExit) on a flag it does not know
    storage = argv[argv.index("--storage") + 1]
    assert volumes[mounts[storage]]["persistentVolumeClaim"]["claimName"] == "dmuon-storage"
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"] == {
        "dashboard-host": "0.0.0.0", "num-cpus": "0"}  # job API reachable; no workers
    # sizing: the planner lays the job out as R = worker pods x N = workers per pod
    from service.job.plan.inventory import synthetic_inventory
    from service.job.plan.predict import predict

    worker = cluster["spec"]["workerGroupSpecs"][0]
    res = worker["template"]["spec"]["containers"][0]["resources"]
    gpus = int(res["limits"].get("nvidia.com/gpu", 0))
    assert int(worker["rayStartParams"].get("num-gpus", 0)) == gpus
    assert res["requests"].get("nvidia.com/gpu") == res["limits"].get("nvidia.com/gpu")
    assert worker["replicas"] == worker["minReplicas"] == worker["maxReplicas"]
    cpus = int(worker["rayStartParams"].get("num-cpus", res["limits"]["cpu"]))
    placement = predict(loaded[0], synthetic_inventory(worker["replicas"], gpus, cpus))
    per_pod = gpus if gpus else cpus // int(loaded[0].resources_per_worker.CPU)
    assert (placement.layout.replicate, placement.layout.shard) == (worker["replicas"], per_pod)


def test_control_plane_matches_the_code(rendered, tmp_path, monkeypatch):
    import uvicorn

    import service.control.serve
    from service.control.app import create_app

    docs = rendered["overlays/gpu"]
    deployment, svc = _one(docs, "Deployment"), _one(docs, "Service")
    cluster = _one(docs, "RayCluster")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["dmuon-serve"]
    script = metadata.entry_points(group="console_scripts", name="dmuon-serve")
    assert [e.value for e in script] == ["service.control.serve:main"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    for name, value in env.items():
        monkeypatch.setenv(name, value or "from-a-secret")
    monkeypatch.setenv("DMUON_DB", str(tmp_path / "db.sqlite"))  # the PVC's path is not here
    ran = {}  # what main would bind and serve (nothing binds here: 0.0.0.0 is no loopback)
    monkeypatch.setattr(service.control.serve, "_bound_socket",
                        lambda host, port: ran.update(bound=(host, port)) or "socket")
    def run(self, sockets=None):  # a server that started, served, and was stopped
        ran.update(config=self.config, sockets=sockets)
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert service.control.serve.main([]) == 0
    port, config = container["ports"][0], ran["config"]
    assert config.port == port["containerPort"] == service.control.serve.DEFAULT_PORT
    assert config.host == "0.0.0.0" and config.app == "service.control.app:create_app"
    assert ran["bound"] == ("0.0.0.0", config.port) and ran["sockets"] == ["socket"]
    assert svc["spec"]["ports"][0]["targetPort"] == port["name"]
    app = create_app()
    routes = {path: {m.upper() for m in ops} for path, ops in app.openapi()["paths"].items()}
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert "GET" in routes[get["path"]] and get["port"] == port["name"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    dashboard = next(p["containerPort"] for p in head["ports"] if p["name"] == "dashboard")
    assert env["RAY_ADDRESS"] == f"http://{cluster['metadata']['name']}-head-svc:{dashboard}"
    assert env["DMUON_SERVICE_URL"] == (f"http://{svc['metadata']['name']}:"
                                        f"{svc['spec']['ports'][0]['port']}")


def test_images_and_versions_agree(rendered):
    import ray

    dockerfile = open(os.path.join(ROOT, "Dockerfile")).read()
    args = dict(re.findall(r"^ARG (\w+)=(\S*)", dockerfile, re.M))
    version = metadata.version("dmuon")
    assert args["RAY_IMAGE"] == f"rayproject/ray:{ray.__version__}-py311-cpu"
    assert args["DMUON_VERSION"] == version
    for tree in TREES[1:]:
        docs = rendered[tree]
        assert _one(docs, "RayCluster")["spec"]["rayVersion"] == ray.__version__
        images = {c["image"] for c in _containers(docs)}
        assert len(images) == 1, images  # head, workers, submitter and control plane
        gpu = any("nvidia.com/gpu" in c["resources"]["limits"] for c in _containers(docs))
        assert images.pop().endswith(f":{version}-{'gpu' if gpu else 'cpu'}")


@pytest.mark.parametrize("tree", TREES[1:])
def test_env_names_and_secrets_agree_with_the_code(rendered, tree):
    source = ""
    for folder, _, files in os.walk(os.path.join(ROOT, "service")):
        source += "".join(open(os.path.join(folder, f)).read() for f in files
                          if f.endswith(".py"))
    from service.control.settings import Settings

    settings = {f"DMUON_{name.upper()}" for name in Settings.model_fields}
    docs = rendered[tree]
    secret = _one(docs, "Secret")
    for c in _containers(docs):
        for e in c.get("env", []):
            assert e["name"] in EXTERNAL_ENV | settings or (
                e["name"].startswith("DMUON_") and f'"{e["name"]}"' in source), e["name"]
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]
