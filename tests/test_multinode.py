"""Two hosts in network namespaces: HSDP across hosts, node loss and link faults.

Host a (10.200.0.11) runs the Ray head and the entrypoint; host b (10.200.0.12) a worker
node. Each node has 2 CPUs, below the job's 4 workers, so a restarted worker group must
wait for host b to come back.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import pytest
import torch
from _netns import RAY_PORT, TwoHosts, namespaces_available

from dmuon.testing import run

REASON = namespaces_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
SPEC = {"name": "mn", "model": "tiny", "steps": 10, "batch_size": 4, "seq_len": 32,
        "checkpoint": {"interval": 2}, "data": {"val_every": 0}, "max_failures": 3}
TIMELINE: dict[str, float] = {}


def _loopback(rank, world, spec_data):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from service.spec import parse_spec
    from service.train.loop import run_training

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = run_training(parse_spec(spec_data), mesh, report=lambda record, path: None)
    return dmuon.full_state_dict(model)


@functools.cache
def loopback_params():
    """The same spec on one host over loopback, 2 x 2, without Ray."""
    return run(_loopback, SPEC)[0]


@pytest.fixture
def hosts():
    hosts = TwoHosts()
    try:
        hosts.head_dir = hosts.start_head()
        hosts.b_dir = hosts.add_worker_node()
        yield hosts
    finally:
        hosts.close()
        assert hosts.leftovers() == []


def _submit(hosts: TwoHosts, job_id: str, hold_before: tuple[int, ...] = ()):
    """Start the job; every rank waits before each step in ``hold_before`` until the test
    calls ``_release``, so that a fault lands at an exact step (the metrics the test
    watches lag the workers by up to a few steps)."""
    spec = os.path.join(hosts.root, f"{job_id}.json")
    with open(spec, "w") as fh:
        json.dump(SPEC, fh)
    storage = os.path.join(hosts.root, "runs")
    params = os.path.join(hosts.root, f"{job_id}.pt")
    holds = os.path.join(hosts.root, f"{job_id}-holds")
    os.makedirs(holds)
    for step in hold_before:
        open(os.path.join(holds, f"step_{step}"), "w").close()
    wrapper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_faults.py")
    proc = hosts.popen("a", [sys.executable, wrapper, "entrypoint", f"hold:{holds}", "--",
                             "--spec", spec, "--storage", storage, "--job-id", job_id,
                             "--final-params", params], f"{job_id}.log",
                       RAY_ADDRESS=f"{hosts.ip['a']}:{RAY_PORT}")
    return proc, os.path.join(storage, job_id, "metrics.jsonl"), params


def _release(hosts: TwoHosts, job_id: str, step: int) -> None:
    os.remove(os.path.join(hosts.root, f"{job_id}-holds", f"step_{step}"))


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.endswith("\n")]


def _wait_for_step(path, step, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r["step"] >= step for r in _records(path)):
            return
        assert proc.poll() is None, "job ended early"
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")


def _finish(hosts, proc, job_id, timeout=300):
    rc = proc.wait(timeout=timeout)
    with open(os.path.join(hosts.root, f"{job_id}.log")) as fh:
        log = fh.read()
    assert rc == 0, log[-3000:]
    return log


def _assert_equal_to_loopback(params_path):
    params = torch.load(params_path)
    for key, value in loopback_params().items():
        assert torch.equal(params[key], value), key


def test_hsdp_across_hosts_equals_loopback(hosts):
    proc, metrics, params = _submit(hosts, "clean")
    _finish(hosts, proc, "clean")
    records = _records(metrics)
    ip_of_row = {}
    for r in records:
        ip_of_row.setdefault(r["coord"][0], set()).add(r["node_ip"])
    assert ip_of_row == {0: {hosts.ip["a"]}, 1: {hosts.ip["b"]}} or \
        ip_of_row == {0: {hosts.ip["b"]}, 1: {hosts.ip["a"]}}  # replicate peers on 2 IPs
    assert all(r["resumed_from"] == 0 for r in records)
    _assert_equal_to_loopback(params)


def _restarted(records):
    return [r for r in records if r["resumed_from"] > 0]


def test_short_link_outage_stalls_then_raylet_kill_resumes(hosts):
    proc, metrics, params = _submit(hosts, "faults", hold_before=(4, 7))
    _wait_for_step(metrics, 3, proc)
    hosts.link("b", up=False)  # 1 s: under the 3 s health-check window
    _release(hosts, "faults", 4)  # step 4 starts while the link is down
    time.sleep(1.0)
    hosts.link("b", up=True)
    _wait_for_step(metrics, 6, proc)
    before_kill = _records(metrics)
    assert sorted({r["step"] for r in before_kill}) == list(range(1, 7))  # no step lost
    assert all(sum(r["step"] == s for r in before_kill) == 4 for s in range(1, 7))
    assert all(r["resumed_from"] == 0 for r in before_kill)  # stalled, no restart
    killed_at = time.time()
    hosts.kill_raylet(hosts.b_dir)  # every rank has finished step 6 and waits before 7
    time.sleep(8)  # the job now waits: host a alone cannot hold 4 workers
    hosts.kill_node(hosts.b_dir)  # what is left of the dead node's processes
    _release(hosts, "faults", 7)
    hosts.add_worker_node()
    _finish(hosts, proc, "faults")
    records = _records(metrics)
    resumed = _restarted(records)
    assert {r["resumed_from"] for r in resumed} == {6}  # the checkpoint of step 6
    TIMELINE["raylet_kill_to_first_resumed_step_s"] = round(
        min(r["time"] for r in resumed) - killed_at, 1)
    assert sorted({r["step"] for r in resumed}) == list(range(7, SPEC["steps"] + 1))
    _assert_equal_to_loopback(params)


def test_long_link_outage_declares_node_dead_and_resumes(hosts):
    proc, metrics, params = _submit(hosts, "partition", hold_before=(5,))
    _wait_for_step(metrics, 4, proc)
    down_at = time.time()
    hosts.link("b", up=False)  # 10 s: well past the 3 s health-check window
    _release(hosts, "partition", 5)  # step 5 starts while the link is down
    time.sleep(10)
    hosts.link("b", up=True)
    hosts.kill_node(hosts.b_dir)  # declared dead: an operator replaces the node
    hosts.add_worker_node()
    _finish(hosts, proc, "partition")
    resumed = _restarted(_records(metrics))
    assert {r["resumed_from"] for r in resumed} == {4}, "the job did not resume from step 4"
    TIMELINE["link_down_to_first_resumed_step_s"] = round(
        min(r["time"] for r in resumed) - down_at, 1)
    _assert_equal_to_loopback(params)
    print(json.dumps({"recovery": TIMELINE}))
