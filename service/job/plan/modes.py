"""``dmuon.mode: auto``: the seeds' Z2/Z3 decision tree made executable, on the
planner's memory model of one rank.

The tree (seeds, "Z2 vs Z3 Modes"), in order:
1. a model above 10B parameters starts with Z3;
2. when even Z3 does not fit the device, stay with Z3 ("OOM with DMuon-Z3? Do not
   switch to Z2 first"): the plan says it does not fit;
3. with one rank per shard group Z2 saves no bytes ((N-1)/N = 0): Z3;
4. below 3B parameters on 8 or more GPUs Z2 is the candidate: taken when the resident
   packed buffers (P_M x bytes per element) fit in what Z3 leaves free of the device;
   below 3B on fewer GPUs, Z3 (communication does not dominate there);
5. from 3B to 10B ("for most models above 3B, stay with Z3"): Z2 only when the
   resident P_M takes at most half of what Z3 leaves free (the seeds' 7B example on
   8 GPUs: "significant but not prohibitive for an 80 GB GPU").
"Fits" means at most HEADROOM of the device's memory. On CPU workers the tree counts
workers as it counts GPUs, and the explanation names them ("107K parameters on 4 CPU
workers (< 8): Z3").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..spec.recipe_section import DMuonSpec

GB = 1e9
HEADROOM = 0.9  # allocator fragmentation, CUDA context, NCCL buffers
DEFAULT_GPU_GB = 80.0  # H100/H200 SXM class
DEFAULT_CPU_GB = 16.0


@dataclass
class ModeChoice:
    dmuon: str  # "z2" | "z3"
    fsdp: str
    reason: str
    params: int  # the model's parameters
    gpus: int  # world size
    device_bytes: int
    z2_bytes: int  # one rank's peak, the worst rank
    z3_bytes: int
    resident_pm_bytes: int  # Z2's packed buffers: P_M x param bytes
    fits: bool

    def to_dict(self) -> dict:
        return asdict(self)


def activation_bytes(*, tokens: int, hidden: int, layers: int, vocab: int, elt: int,
                     checkpointed: bool, tp: int = 1, logits_split: int = 1) -> int:
    """A stated estimate of one rank's activations for one micro-batch: 34 x tokens x
    hidden bytes per block at 2-byte activations (Korthikanti et al. 2022, attention
    scores not stored, as with flash attention), scaled to ``elt``; with per-block
    activation checkpointing each block keeps its input and one block is recomputed at a
    time. Under tensor parallelism with sequence parallel (``tp`` = T) all of it is 1/T
    (their 34 sbh/t: the norms' and residual stream's activations are sequence shards,
    attention's and the MLP's inner ones head and column shards), and a kept block input
    is a sequence shard. Plus the logits in ``elt`` and their fp32 copy for the loss,
    divided by ``logits_split``: 1 when the head all-gathers them (every TP rank holds
    the whole logits), T when they stay sharded on the vocabulary."""
    block = 34 * tokens * hidden * elt // 2 // tp
    kept = (layers * tokens * hidden * elt // tp + block) if checkpointed else layers * block
    return kept + tokens * vocab * (elt + 4) // logits_split


def parameter_count(n: int) -> str:
    """``n`` parameters as people write them: ``3.28M``, ``8.03B``, ``70.6B``, ``640``
    (three significant digits; a small model is not "0.00B")."""
    if n < 1000:
        return str(n)
    for scale, suffix in ((1e3, "K"), (1e6, "M"), (1e9, "B"), (1e12, "T")):
        shown = f"{n / scale:.3g}"
        if float(shown) < 1000 or suffix == "T":  # 999,950 is 1M, not 1e+03K
            return shown + suffix
    raise AssertionError("unreachable")


def workers(n: int, device: str) -> str:
    """``8 GPUs``, ``1 GPU``, ``4 CPU workers``: what the ranks run on."""
    if device == "GPU":
        return f"{n} GPU" + ("" if n == 1 else "s")
    return f"{n} {device} worker" + ("" if n == 1 else "s")


def decide(spec: DMuonSpec, *, params: int, gpus: int, shard: int, device_bytes: int,
           z2_bytes: int, z3_bytes: int, resident_pm: int, device: str = "GPU") -> ModeChoice:
    """The mode to run: the spec's when it names one (or the default, z3, when it names
    none), else the tree above. The reason says which of the three it was; ``gpus`` is
    the world size, whatever ``device`` ("GPU" or "CPU") the workers have, and the
    explanation names it."""
    mode = spec.mode
    usable = HEADROOM * device_bytes
    b, size = params / 1e9, parameter_count(params)
    memory = "the device's" if device == "GPU" else f"a {device} worker's"
    if mode != "auto":
        dmuon, reason = mode, (f"set by the spec (dmuon.mode: {mode})"
                               if "mode" in spec.model_fields_set else
                               f"the default: the spec sets no dmuon.mode ({mode}; "
                               "dmuon.mode: auto lets the planner choose)")
    elif params > 10e9:
        dmuon, reason = "z3", f"{size} parameters > 10B: Z3, the seeds' default"
        if z3_bytes > usable:  # step 2 says so too
            reason += f"; {_not_even_z3(z3_bytes, memory, device_bytes)}"
    elif z3_bytes > usable:
        dmuon, reason = "z3", _not_even_z3(z3_bytes, memory, device_bytes)
    elif shard == 1:
        dmuon, reason = "z3", "one rank per shard group: Z2 would save no bytes"
    else:
        free, extra = usable - z3_bytes, z2_bytes - z3_bytes
        dmuon, reason = _by_size(b, size, workers(gpus, device), gpus, free, extra,
                                 resident_pm)
    if mode == "auto":
        reason = f"chosen by dmuon.mode: auto: {reason}"
    fits = (z2_bytes if dmuon == "z2" else z3_bytes) <= usable
    return ModeChoice(dmuon, spec.fsdp_mode(dmuon), reason, params, gpus, int(device_bytes),
                      int(z2_bytes), int(z3_bytes), int(resident_pm), fits)


def _not_even_z3(z3_bytes: int, memory: str, device_bytes: float) -> str:
    return (f"even Z3 needs {z3_bytes / GB:.1f} GB of {memory} {device_bytes / GB:.0f} GB: "
            "it does not fit; do not switch to Z2 (check activations and accumulation "
            "first)")


def _by_size(b: float, size: str, on: str, world: int, free: float, extra: float,
             resident_pm: int):
    """Steps 4 and 5 of the tree; ``size`` and ``on`` say the model's parameters and
    the workers in words (``3.28M``, ``4 CPU workers``)."""
    pm = f"resident P_M {_gb(resident_pm)}"
    if b < 3:
        if world < 8:
            return "z3", f"{size} parameters on {on} (< 8): Z3"
        if extra <= free:
            return "z2", (f"{size} parameters (< 3B) on {on} (>= 8): Z2, its {pm} "
                          f"fits in the {free / GB:.1f} GB Z3 leaves free")
        return "z3", f"{size} parameters: Z2's {pm} exceeds the {free / GB:.1f} GB free"
    if extra <= free / 2:
        return "z2", (f"{size} parameters (3-10B): Z2, its {pm} is at most half of the "
                      f"{free / GB:.1f} GB Z3 leaves free")
    return "z3", (f"{size} parameters (3-10B): Z3, Z2's {pm} would take more than half "
                  f"of the {free / GB:.1f} GB Z3 leaves free")


def _gb(n: int) -> str:
    """Bytes in GB, or in MB when that would read 0.00 GB."""
    return f"{n / GB:.2f} GB" if n >= 0.01 * GB else f"{n / 1e6:.2f} MB"
