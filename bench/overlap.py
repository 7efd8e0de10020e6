"""Overlap on a slow link: 4 gloo ranks in a network namespace of their own whose
loopback is throttled with a token bucket (``tc qdisc ... tbf``; netem is not available
on these machines, tbf is, and a 200 Mbit/s bucket measured 201 Mbit/s). One run
compares FSDP2 + AdamW, naive FSDP2 + Muon, DMuon-Z2, DMuon-Z3 with prefetch on and off,
and HSDP 2x2 with the replicate all-gather async and sync.

Per set-up (medians over steps, slowest rank; the set-ups take turns, as in
``bench._setups.take_turns``): the step time, the time the ranks sat waiting for
parameter all-gathers ("exposed gather": what prefetch exists to hide) and for the
replicate all-gather, the time in FSDP2's own collective-issuing hooks, and the CPU time
of the ranks together. On the shared bucket it also counts the bytes through the bucket
per step (the qdisc's own counter) and prints DMuon-Z3's link floor: those bytes at the
rate plus its optimizer step; and the CPU floor: the ranks' CPU time over the cores.
Needs root and iproute2; everything it makes (its namespaces) it removes. Prints a table
and writes bench/results/overlap*.json (named by the arguments that differ from the
defaults).

``--links per-rank`` is the closer model of a cluster: each rank in a namespace of its
own with a full-duplex link (a veth to a private bridge, a bucket of ``--rate`` in each
direction). ``--links nodes``: two hosts of half the ranks each, whose ranks talk over
the host's loopback, unthrottled, while the host's link is throttled; HSDP's shard
groups stay within a host. On the throttled loopback every byte of all 4 ranks, both
directions, shares one bucket. ``--world 2`` runs 2 ranks (no HSDP set-ups), one per
core of this machine, where 4 ranks share 2 cores: it shows what overlap gains when a
rank's transfers do not take CPU from another rank's compute.

    python -m bench.overlap [--rate 3gbit] [--steps 4] [--rounds 3] [--links per-rank|nodes]
                            [--dmuon-fsdp root] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

RESULTS = pathlib.Path(__file__).parent / "results"
SETUPS = ("fsdp2_adamw", "naive_fsdp2_muon", "dmuon_z2", "dmuon_z3", "dmuon_z3_no_prefetch",
          "dmuon_z3_prefetch2", "dmuon_z3_hsdp2x2_async", "dmuon_z3_hsdp2x2_sync")


def setups(world: int) -> tuple[str, ...]:
    """The set-ups a world runs: HSDP 2x2 needs 4 ranks."""
    return SETUPS if world == 4 else tuple(s for s in SETUPS if "hsdp" not in s)


class Waits:
    """Seconds this rank spends in DMuon's waits, by kind, and in FSDP2's own hooks that
    issue collectives (on the CPU FSDP2 has no streams, so its all-gathers and
    reduce-scatters block there); bench-side timing of the methods, so production code
    carries no clock."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        from dmuon.testing import probe_point

        self.seconds = {"gather": 0.0, "replicate": 0.0, "reduce": 0.0, "fsdp2": 0.0}
        for kind, owner, name in (("gather", *probe_point("wait_gather")),
                                  ("replicate", *probe_point("wait_replicate")),
                                  ("reduce", *probe_point("land")),
                                  ("fsdp2", FSDPParamGroup, "unshard"),
                                  ("fsdp2", FSDPParamGroup, "wait_for_unshard"),
                                  ("fsdp2", FSDPParamGroup, "post_backward")):
            setattr(owner, name, self._timed(kind, getattr(owner, name)))

    def _timed(self, kind, method):
        def timed(owner, *args, **kwargs):
            t0 = time.perf_counter()
            out = method(owner, *args, **kwargs)
            self.seconds[kind] += time.perf_counter() - t0
            return out
        return timed

    def take(self) -> dict:
        out, self.seconds = self.seconds, dict.fromkeys(self.seconds, 0.0)
        return out


def _cpu_seconds() -> float:
    """CPU time of this process, its gloo threads included."""
    t = os.times()
    return t.user + t.system


class BucketBytes:
    """Bytes through the shared bucket per step, from the qdisc's own counter (``tc -s``):
    everything on the link, FSDP2's collectives and the headers included, which DMuon's
    ledger does not count. Read on one rank as each step begins, before the barrier (the
    read takes milliseconds; the barrier, not the other ranks' timed step, absorbs
    them), so a step's figure is what passed since the previous step of the same set-up
    began (the first step of a turn is untimed and its figure dropped)."""

    def __init__(self, active: bool):
        self.active, self.last = active, None

    def _sent(self) -> int:
        out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "lo"], check=True,
                             capture_output=True, text=True, timeout=30).stdout
        return int(re.search(r"Sent (\d+) bytes", out).group(1))

    def since_last(self) -> float:
        if not self.active:
            return 0.0
        now = self._sent()
        last, self.last = self.last, now
        return float(now - last) if last is not None else 0.0


def _worker(rank, world, rounds, steps, batch, seq, fsdp_layers, shared_bucket):
    import torch.distributed as dist

    from bench._setups import SETUPS as ALL
    from bench._setups import NSClock, build, take_turns
    from service.job.models.builtin import causal_lm_loss
    from service.worker.corpus import batch_at, load_corpus

    waits, clock, bucket = Waits(), NSClock(), BucketBytes(shared_bucket and rank == 0)
    corpus = load_corpus("train", max_bytes=1_000_000)

    def step(name, model, opt, index) -> dict:
        tokens = batch_at(corpus, index, batch * world, seq)[rank * batch:(rank + 1) * batch]
        bucket_bytes = bucket.since_last()
        dist.barrier()
        waits.take()
        c0, t0 = _cpu_seconds(), time.perf_counter()
        loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        elapsed, wait = time.perf_counter() - t0, waits.take()
        ledger = getattr(opt, "ledger", None)
        return {"step_s": elapsed, "forward_s": t1 - t0, "backward_s": t2 - t1,
                "gather_wait_s": wait["gather"], "replicate_wait_s": wait["replicate"],
                "reduce_wait_s": wait["reduce"], "fsdp2_s": wait["fsdp2"],
                "ns_s": clock.take()["ns"], "cpu_s": _cpu_seconds() - c0,
                "dmuon_wire_bytes": float(ledger.last_step()) if ledger else 0.0,
                "bucket_bytes": bucket_bytes}

    with clock.installed():
        built = {name: build(ALL[name], world, "small", clock, fsdp_layers=fsdp_layers)
                 for name in setups(world)}
        records = take_turns(built, rounds, steps, step)
    return {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            for name, rows in records.items()}


def inside(args) -> dict:
    """The measurements, run inside the throttled namespace."""
    from dmuon.testing import run

    return _slowest(run(_worker, args.rounds, args.steps, args.batch, args.seq,
                        args.dmuon_fsdp == "layers", True, world_size=args.world))


SUMMED = ("cpu_s", "dmuon_wire_bytes")  # figures of the job, not of one rank


def _slowest(per_rank: list[dict]) -> dict:
    """Per set-up and figure, the slowest rank's median (summed over ranks: ``SUMMED``)."""
    return {name: {k: (sum if k in SUMMED else max)(r[name][k] for r in per_rank)
                   for k in per_rank[0][name]} for name in per_rank[0]}


def _measure_args(args) -> list[str]:
    """What a measuring process (``--inside``) is told of the run."""
    return ["--world", str(args.world), "--steps", str(args.steps), "--rounds",
            str(args.rounds), "--batch", str(args.batch), "--seq", str(args.seq),
            "--dmuon-fsdp", args.dmuon_fsdp]


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def throttled(args) -> dict:
    """Make the namespace, throttle its loopback, run ``inside`` there, remove it."""
    ns = f"dmo{os.getpid() % 100000}"
    _sh("ip", "netns", "add", ns)
    try:
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf",
            "rate", args.rate, "burst", "256kb", "latency", "200ms")
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.overlap",
                   "--inside", out.name, *_measure_args(args)]
            subprocess.run(cmd, check=True, timeout=3600,
                           env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
            return json.loads(pathlib.Path(out.name).read_text())
    finally:
        _sh("ip", "netns", "del", ns)


LINK = "dmlink0"  # the rank's side of its veth: one name in every namespace
SUBNET = "10.201.0"


def rank_inside(args) -> None:
    """One rank in its host's namespace (``--links per-rank``, ``nodes``): joins the
    others over the bridge, measures, writes its figures to ``args.inside``."""
    import torch
    import torch.distributed as dist

    from dmuon.testing import PG_TIMEOUT, leave_process_group

    torch.set_num_threads(1)
    rank = args.rank
    os.environ.update(MASTER_ADDR=f"{SUBNET}.11", MASTER_PORT="29531",
                      GLOO_SOCKET_IFNAME=LINK, OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=PG_TIMEOUT)
    result = _worker(rank, args.world, args.rounds, args.steps, args.batch, args.seq,
                     args.dmuon_fsdp == "layers", False)
    pathlib.Path(args.inside).write_text(json.dumps(result))
    leave_process_group()


def linked_hosts(args) -> dict:
    """Hosts as namespaces joined by a bridge, each host's veth throttled both ways: a
    host per rank (``--links per-rank``), or two hosts of half the ranks each
    (``--links nodes``), whose ranks talk to each other over the host's own loopback,
    unthrottled, as over NVLink. On two hosts HSDP 2x2 keeps its shard groups within a
    host and sends only the replicate stage across, as a planner would lay it out."""
    tag = os.getpid() % 100000
    count = args.world if args.links == "per-rank" else 2
    hosts, bridge = [f"dmr{tag}_{h}" for h in range(count)], f"dmrb{tag}"
    made = []
    try:
        for ns in (*hosts, bridge):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        _sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", bridge, "link", "set", "br0", "up")
        bucket = ["tbf", "rate", args.rate, "burst", "256kb", "latency", "200ms"]
        for h, ns in enumerate(hosts):
            _sh("ip", "link", "add", LINK, "netns", ns, "type", "veth", "peer", "name",
                f"p{h}", "netns", bridge)
            _sh("ip", "-n", bridge, "link", "set", f"p{h}", "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{11 + h}/24", "dev", LINK)
            _sh("ip", "-n", ns, "link", "set", LINK, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", LINK, "root", *bucket)
            _sh("ip", "netns", "exec", bridge, "tc", "qdisc", "replace", "dev", f"p{h}",
                "root", *bucket)
        with tempfile.TemporaryDirectory() as out:
            procs = [subprocess.Popen(
                ["ip", "netns", "exec", hosts[r * count // args.world], sys.executable, "-m",
                 "bench.overlap", "--rank", str(r), "--inside", f"{out}/rank{r}.json",
                 *_measure_args(args)])
                for r in range(args.world)]
            if any(p.wait(timeout=3600) for p in procs):
                raise RuntimeError("a rank failed")
            return _slowest([json.loads(pathlib.Path(f"{out}/rank{r}.json").read_text())
                             for r in range(args.world)])
    finally:
        for ns in made:
            _sh("ip", "netns", "del", ns)


def report(args, r: dict) -> dict:
    base = r["fsdp2_adamw"]["step_s"]
    on, off = r["dmuon_z3"], r["dmuon_z3_no_prefetch"]
    where = {"per-rank": "a full-duplex link per rank",
             "nodes": f"2 hosts of {args.world // 2} ranks, a full-duplex link per host",
             "shared": f"loopback shared by the {args.world} ranks"}[args.links]
    print(f"\n{where} throttled to {args.rate} (tbf), model 'small', "
          f"{args.batch} x {args.seq} tokens per rank, medians of {args.rounds} turns of "
          f"{args.steps} steps; DMuon's layers FSDP2-wrapped: {args.dmuon_fsdp}")
    print("| set-up | step (ms) | / FSDP2+AdamW | exposed gather wait (ms) |"
          " replicate wait (ms) | NS (ms) | in FSDP2's hooks (ms) |"
          f" CPU, {args.world} ranks (ms) | through the bucket (MB) |"
          "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in r.items():
        bucket = f"{row['bucket_bytes'] / 1e6:.1f}" if args.links == "shared" else "-"
        print(f"| {name} | {row['step_s'] * 1e3:.0f} | {row['step_s'] / base:.3f} |"
              f" {row['gather_wait_s'] * 1e3:.0f} | {row['replicate_wait_s'] * 1e3:.0f} |"
              f" {row['ns_s'] * 1e3:.0f} | {row['fsdp2_s'] * 1e3:.0f} |"
              f" {row['cpu_s'] * 1e3:.0f} | {bucket} |")
    summary = {
        "prefetch_saving": 1 - on["step_s"] / off["step_s"],
        "exposed_gather_removed_s": off["gather_wait_s"] - on["gather_wait_s"],
        "z3_over_fsdp2_adamw": on["step_s"] / base,
        "z2_over_fsdp2_adamw": r["dmuon_z2"]["step_s"] / base,
    }
    print(f"\nprefetch: {summary['prefetch_saving']:.1%} less time per step (target >= 20%),"
          f" exposed gather wait {off['gather_wait_s'] * 1e3:.0f} -> "
          f"{on['gather_wait_s'] * 1e3:.0f} ms")
    print(f"DMuon-Z3 / FSDP2+AdamW: {summary['z3_over_fsdp2_adamw']:.3f} (target <= 0.95); "
          f"Z2: {summary['z2_over_fsdp2_adamw']:.3f}")
    if "dmuon_z3_hsdp2x2_sync" in r:
        summary.update(_replicate_async(r["dmuon_z3_hsdp2x2_sync"],
                                        r["dmuon_z3_hsdp2x2_async"]))
    if args.links == "shared":
        summary.update(_link_floor(args.rate, on, off))
    summary.update(_cpu_floor(args.world, on, off))
    return summary


def _replicate_async(sync: dict, asyn: dict) -> dict:
    gain, wait = sync["step_s"] - asyn["step_s"], sync["replicate_wait_s"]
    print(f"HSDP async gains {gain * 1e3:.0f} ms per step; the sync replicate all-gather "
          f"waits {wait * 1e3:.0f} ms (target: gain >= half of it)")
    return {"async_gain_s": gain, "replicate_wait_sync_s": wait}


def bits_per_second(rate: str) -> float:
    """A tc rate in bits (``3gbit``, ``1500mbit``)."""
    found = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate)
    if found is None:
        raise argparse.ArgumentTypeError(f"{rate!r} is not in bits (e.g. 3gbit, 1500mbit)")
    number, unit = found.groups()
    return float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit]


def _tc_rate(text: str) -> str:
    """The rate as tc takes it, once it parses (a bad one fails before the run)."""
    bits_per_second(text)
    return text


def _link_floor(rate: str, on: dict, off: dict) -> dict:
    """The least step time of DMuon-Z3 on the shared bucket: the bytes the bucket passed
    in a step (its own counter) all move during forward and backward (the optimizer step
    sends none), so the step takes at least their time at the rate plus the optimizer
    step's own."""
    link_s = on["bucket_bytes"] * 8 / bits_per_second(rate)
    opt_step_s = on["step_s"] - on["forward_s"] - on["backward_s"]
    floor = link_s + opt_step_s
    print(f"DMuon-Z3 link floor: {on['bucket_bytes'] / 1e6:.1f} MB per step through the "
          f"bucket (DMuon's ledger, summed over ranks: {on['dmuon_wire_bytes'] / 1e6:.1f}"
          f" MB; the rest is FSDP2's and the headers) = {link_s * 1e3:.0f} ms at {rate},"
          f" + the optimizer step {opt_step_s * 1e3:.0f} ms = {floor * 1e3:.0f} ms: "
          f"prefetch can save at most {1 - floor / off['step_s']:.1%}")
    return {"z3_link_s": link_s, "z3_floor_s": floor,
            "prefetch_saving_bound": 1 - floor / off["step_s"]}


def _cpu_floor(world: int, on: dict, off: dict) -> dict:
    """The ranks' CPU time per step, spread over the cores they share, bounds the step
    from below too: overlap moves the transfers' CPU work (gloo's threads, the kernel's
    TCP and qdisc) under the compute, it does not remove it."""
    from bench._setups import shared_cores

    cores = shared_cores(world)
    floor = on["cpu_s"] / cores
    print(f"DMuon-Z3 CPU floor: {on['cpu_s'] * 1e3:.0f} ms of CPU per step on {cores} cores"
          f" = {floor * 1e3:.0f} ms: prefetch can save at most {1 - floor / off['step_s']:.1%}")
    return {"z3_cpu_floor_s": floor, "cores": cores}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="3gbit", type=_tc_rate,
                    help="tbf rate of the namespace's loopback, in bits")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per turn")
    ap.add_argument("--rounds", type=int, default=3, help="turns per set-up")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--links", choices=("shared", "per-rank", "nodes"), default="shared")
    ap.add_argument("--world", type=int, choices=(2, 4), default=4,
                    help="ranks; at 2 each has a core of its own here (no HSDP set-ups)")
    ap.add_argument("--dmuon-fsdp", choices=("layers", "root"), default="layers",
                    help="DMuon set-ups: FSDP2 per layer and at the root (their layers "
                         "keep only norms for FSDP2), or at the root only")
    ap.add_argument("--inside", help=argparse.SUPPRESS)  # the namespace's side
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # per-rank: this rank
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_inside(args)
        return
    if args.inside:
        pathlib.Path(args.inside).write_text(json.dumps(inside(args)))
        return
    results = throttled(args) if args.links == "shared" else linked_hosts(args)
    summary = report(args, results)
    RESULTS.mkdir(exist_ok=True)
    name = "overlap" + ("" if args.links == "shared" else "_" + args.links.replace("-", "_"))
    name += "" if args.world == 4 else f"_world{args.world}"
    name += "" if (args.batch, args.seq) == (4, 64) else f"_{args.batch}x{args.seq}"
    name += "" if args.dmuon_fsdp == "layers" else f"_fsdp_{args.dmuon_fsdp}"
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {"args": vars(args), "results": results, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
