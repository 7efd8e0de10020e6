"""DMuon reaches FSDP2 through its public API: no private torch attribute is assigned
anywhere in dmuon/, and importing dmuon leaves FSDP2's functions as they were (it
rebinds one public name, ``torch.distributed.fsdp.fully_shard``)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _torch_names(tree: ast.Module) -> set[str]:
    """Names a module binds to torch objects by its imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_assignments(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    torch_names, found = _torch_names(tree), []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr.startswith("_") \
                    and _root(t) in torch_names:
                found.append(f"{path.name}:{node.lineno} {ast.unparse(t)}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" \
                and _root(node.args[0]) in torch_names and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).startswith("_"):
            found.append(f"{path.name}:{node.lineno} setattr {ast.unparse(node.args[0])}")
    return found


def test_the_scan_finds_a_private_assignment(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch.distributed.fsdp._fully_shard._fully_shard as fs\n"
                      "from torch.distributed import fsdp\n"
                      "fs._get_modules_and_states = None\nfsdp._x = 1\n")
    assert len(_private_assignments(sample)) == 2


def test_no_private_torch_attribute_is_assigned_in_dmuon():
    found = [hit for f in sorted((ROOT / "dmuon").glob("*.py")) for hit in _private_assignments(f)]
    assert found == []


def test_importing_dmuon_replaces_no_fsdp2_function():
    """FSDP2's functions stay as they are; only the public name
    ``torch.distributed.fsdp.fully_shard`` is rebound, to a wrapper of FSDP2's own."""
    code = (
        "import torch.distributed.fsdp as fsdp\n"
        "from torch.distributed.fsdp import FSDPModule, fully_shard\n"
        "from torch.distributed.fsdp._fully_shard import _fully_shard as fs\n"
        "before = (fs._get_modules_and_states, FSDPModule.set_requires_gradient_sync,"
        " fs.fully_shard)\n"
        "import dmuon\n"
        "after = (fs._get_modules_and_states, FSDPModule.set_requires_gradient_sync,"
        " fs.fully_shard)\n"
        "assert all(a is b for a, b in zip(before, after)), 'replaced'\n"
        "assert fsdp.fully_shard is dmuon.fully_shard is not fully_shard, 'not rebound'\n"
        "assert fsdp.fully_shard.__wrapped__ is fully_shard is fs.fully_shard\n"
        "assert fsdp.fully_shard.state is fully_shard.state\n"
        "print('same')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "same", out.stderr
