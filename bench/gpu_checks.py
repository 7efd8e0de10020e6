"""The single-device checks of ``bench.gpu`` that train: the side-stream race made
deterministic, ``block.compile()`` and CUDA graphs against eager, and ``memory_report``
against the CUDA caching allocator. Each returns a JSON-able dict; ``*_rows`` turn it into
(check, case, measured, verdict) rows of the printed table."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import dmuon
from bench.gpu_train import (
    CHECK_BATCH,
    batches,
    build_dmuon,
    check_config,
    max_rel_diff,
    release,
    train,
)
from dmuon.testing import probe_point
from service.job.models.params import split_params

STEPS = 4  # CUDA graph trees warm up, record, then replay: 4 steps replay twice
SLEEP_CYCLES = 20_000_000  # a spin kernel of about 10 ms at the H200's 1.98 GHz
EQUAL = 1e-6  # losses of runs that compute the same thing (same kernels, same order)
CLOSE = 1e-3  # compiled (fused, reordered) against eager after STEPS steps
MIB = 1 << 20


def _data(device: torch.device, tiny: bool):
    config = check_config(tiny)
    return config, batches(config, CHECK_BATCH["tiny" if tiny else "cuda"], STEPS, device)


@contextlib.contextmanager
def side_stream_delayed(device: torch.device):
    """Bench-only hook: ``Streams.issuing`` wrapped so that a long kernel is queued on
    DMuon's side stream as soon as it is entered, ahead of whatever is issued under it
    (a shard group of one rank: the copy into the packed buffer, or of the gradient).
    A consumer that does not wait for the side stream then reads before the copy lands,
    every time. Yields a one-item list counting the delays queued."""
    owner, attr = probe_point("side_stream")
    issuing, calls = getattr(owner, attr), [0]

    @functools.wraps(issuing)
    @contextlib.contextmanager
    def delayed(self, *args, **kwargs):
        with issuing(self, *args, **kwargs) as value:
            calls[0] += 1
            if device.type == "cuda":  # the side stream is current here
                torch.cuda._sleep(SLEEP_CYCLES)
            yield value

    setattr(owner, attr, delayed)
    try:
        yield calls
    finally:
        setattr(owner, attr, issuing)


def stream_race(device: torch.device, tiny: bool) -> dict:
    """DMuon-Z3 (fp32) trained twice as it is and once with the side stream delayed;
    the consumer waits for the side stream exactly when the delayed run's losses equal
    the plain ones. Math attention: the fused kernels' backward may sum in any order."""
    config, data = _data(device, tiny)
    with sdpa_kernel(SDPBackend.MATH):
        plain = train(build_dmuon(config, device), data)
        release()
        again = train(build_dmuon(config, device), data)
        release()
        with side_stream_delayed(device) as calls:
            delayed = train(build_dmuon(config, device), data)
        release()
    cuda = device.type == "cuda"
    diff = max_rel_diff(delayed, plain)
    return {"applicable": cuda,
            "note": None if cuda else "not applicable on cpu: no streams (the hook is "
                                      "installed and queues nothing)",
            "sleep_cycles": SLEEP_CYCLES, "delays_queued": calls[0],
            "losses": {"plain": plain, "plain_again": again, "side_stream_delayed": delayed},
            "noise": max_rel_diff(again, plain), "max_rel_diff": diff,
            "consumer_waits": diff <= EQUAL if cuda else None}


def stream_race_rows(r: dict) -> list[tuple]:
    case = f"Z3, {len(r['losses']['plain'])} steps, {r['delays_queued']} delays"
    measured = f"max rel diff {r['max_rel_diff']:.1e} (noise {r['noise']:.1e})"
    if not r["applicable"]:
        verdict = "not applicable on cpu"
    else:
        verdict = "consumer waits: ok" if r["consumer_waits"] else "RACE: losses differ"
    return [("stream race (side stream delayed)", case, measured, verdict)]


def _compiled(config, device, data, reference, *, z3: bool, kwargs: dict) -> dict:
    """Train with every block compiled by ``block.compile(**kwargs)``; what it raised
    (a refusal) instead, if it did."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = {"z3": z3, "compile": kwargs}
    try:
        losses = train(build_dmuon(config, device, z3=z3, compile_kwargs=kwargs), data)
    except Exception as e:  # noqa: BLE001 - what the core answers is the measurement
        return {**out, "raised": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        torch._dynamo.reset()
        release()
    # that dynamo compiled something, and whether inductor ran the graphs as CUDA graphs
    seen = {"unique_graphs": counters["stats"]["unique_graphs"],
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}
    return {**out, "losses": losses, "max_rel_diff": max_rel_diff(losses, reference),
            "counters": seen}


def compile_check(device: torch.device, tiny: bool) -> dict:
    """``block.compile()`` under Z3, then ``mode="reduce-overhead"`` (CUDA graphs) under
    Z2, each against eager in the same ZeRO mode; then reduce-overhead under Z3, which
    the core refuses (its packed storage moves every step). On the CPU the compile check
    runs dynamo with its ``eager`` backend (inductor needs minutes of C++ builds on two
    cores) and the CUDA-graph ones do not apply."""
    config, data = _data(device, tiny)
    cuda = device.type == "cuda"
    eager_z3 = train(build_dmuon(config, device), data)
    release()
    out = {"eager_z3": {"losses": eager_z3},
           "block_compile_z3": _compiled(config, device, data, eager_z3, z3=True,
                                         kwargs={} if cuda else {"backend": "eager"})}
    graphs = {"mode": "reduce-overhead"}
    if not cuda:
        skipped = {"compile": graphs, "note": "not applicable on cpu: CUDA graphs"}
        return {**out, "reduce_overhead_z2": {"z3": False, **skipped},
                "reduce_overhead_z3": {"z3": True, **skipped}}
    eager_z2 = train(build_dmuon(config, device, z3=False), data)
    release()
    out["eager_z2"] = {"losses": eager_z2}
    out["reduce_overhead_z2"] = _compiled(config, device, data, eager_z2, z3=False,
                                          kwargs=graphs)
    out["reduce_overhead_z3"] = _compiled(config, device, data, eager_z3, z3=True,
                                          kwargs=graphs)
    return out


def _compile_row(name: str, r: dict, refusal_expected: bool = False) -> tuple:
    kwargs = ", ".join(f"{k}={v!r}" for k, v in r["compile"].items())
    case = f"{'Z3' if r['z3'] else 'Z2'} block.compile({kwargs})"
    if "note" in r:
        return (name, case, "-", r["note"])
    if "raised" in r:
        return (name, case, r["raised"][:120], "refused: ok" if refusal_expected else "RAISED")
    ok = r["max_rel_diff"] <= CLOSE
    verdict = ("NOT REFUSED; " if refusal_expected else "") + (
        f"loss within {CLOSE:g} of eager" if ok else "LOSS DIFFERS")
    seen = r["counters"]
    return (name, case, f"max rel diff {r['max_rel_diff']:.1e}; {seen['unique_graphs']} "
            f"graphs, {seen['cudagraph_skips']} CUDA-graph skips", verdict)


def compile_rows(r: dict) -> list[tuple]:
    return [_compile_row("compile vs eager", r["block_compile_z3"]),
            _compile_row("CUDA graphs vs eager", r["reduce_overhead_z2"]),
            _compile_row("CUDA graphs under Z3", r["reduce_overhead_z3"], True)]


def memory_check(device: torch.device, tiny: bool) -> dict:
    """One boundary's gather and free after a step (every boundary freed by then, the
    optimizer's state made), measured by ``dmuon.memory_report`` and, on CUDA, by
    ``torch.cuda.memory_allocated`` (after a synchronize: the side stream's work is
    done); expected: the block's Muon matrices in fp32, from the module's shapes."""
    config, data = _data(device, tiny)
    model, opt = build_dmuon(config, device)
    train((model, opt), data[:1])
    rule = split_params(model).predicate
    expected = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if n.startswith("model.layers.0.") and rule(n))
    boundary = dmuon.get_state(model).boundaries[0]

    def now() -> tuple[int, int | None]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() if device.type == "cuda" else None
        return dmuon.memory_report(model, opt)["packed_buffers"], allocated

    before = now()
    boundary.transfer.start_gather("forward")
    boundary.transfer.wait_gather()
    gathered = now()
    boundary.free()
    freed = now()
    release()
    delta = lambda a, b: None if b[1] is None else b[1] - a[1]  # noqa: E731
    return {"boundary": boundary.name, "expected_bytes": expected,
            "gather": {"report_delta": gathered[0] - before[0],
                       "allocated_delta": delta(before, gathered)},
            "free": {"report_delta": freed[0] - gathered[0],
                     "allocated_delta": delta(gathered, freed)},
            # the caching allocator rounds a block up to 512 B and hands out a cached
            # block whole when less than 1 MiB of it would be left over
            "allocator_slack_bytes": MIB + 512}


def memory_rows(r: dict) -> list[tuple]:
    rows = []
    for phase, sign in (("gather", 1), ("free", -1)):
        report, allocated = r[phase]["report_delta"], r[phase]["allocated_delta"]
        ok = report == sign * r["expected_bytes"]
        measured = f"report {report:+,} B"
        if allocated is not None:
            measured += f", memory_allocated {allocated:+,} B"
            ok = ok and 0 <= sign * (allocated - report) <= r["allocator_slack_bytes"]
        rows.append(("memory_report vs allocator", f"{r['boundary']} {phase}", measured,
                     f"ok (expected {sign * r['expected_bytes']:+,} B)" if ok
                     else f"MISMATCH (expected {sign * r['expected_bytes']:+,} B)"))
    return rows
