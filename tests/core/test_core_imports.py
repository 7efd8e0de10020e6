"""The core stands alone: no module of tests/core (nor a tests/ helper it imports, followed
transitively) imports ``service``, at any nesting level, and every module of dmuon/
imports only the standard library, torch and dmuon itself."""

from __future__ import annotations

import ast
import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
CORE = TESTS / "core"
ALLOWED = {"torch", "dmuon"}  # besides the standard library


def _imports(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, module, the statement) of every import in the module, including
    those inside functions and classes and calls of ``importlib.import_module`` or
    ``__import__`` with a constant name; relative imports give the module ``"."``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ast.unparse(node)) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." if node.level else node.module or "",
                          ast.unparse(node)))
        elif isinstance(node, ast.Call) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                and (getattr(node.func, "id", None) == "__import__"
                     or getattr(node.func, "attr", None) == "import_module"):
            found.append((node.lineno, node.args[0].value, ast.unparse(node)))
    return found


def _local_module(name: str, search: list[pathlib.Path]) -> pathlib.Path | None:
    """A module that pytest's ``pythonpath`` (tests/: the ``helpers`` package) or its
    rootdir import (the test's folder) finds."""
    for folder in search:
        if (folder / f"{name.replace('.', '/')}.py").is_file():
            return folder / f"{name.replace('.', '/')}.py"
    return None


def _shown(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def service_imports(start: list[pathlib.Path], search: list[pathlib.Path]) -> list[str]:
    """``file:line statement`` for each import of ``service`` in ``start`` and in the local
    modules (``helpers.train``, ``helpers.model``, a sibling test) they import, followed
    transitively."""
    todo, seen, hits = list(start), set(), []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for line, module, stmt in _imports(ast.parse(path.read_text(), str(path))):
            if module.split(".")[0] == "service":
                hits.append(f"{_shown(path)}:{line} {stmt}")
            elif (local := _local_module(module, search)) is not None:
                todo.append(local)
    return sorted(hits)


def foreign_imports(package: pathlib.Path) -> list[str]:
    """``file:line statement`` for each import in ``package`` (recursively) of a module
    that is neither the standard library, torch, nor the package itself."""
    hits = []
    for path in sorted(package.rglob("*.py")):
        for line, module, stmt in _imports(ast.parse(path.read_text(), str(path))):
            top = module if module == "." else module.split(".")[0]
            if top != "." and top not in ALLOWED and top not in sys.stdlib_module_names:
                hits.append(f"{path.relative_to(package.parent)}:{line} {stmt}")
    return hits


def test_the_scans_find_what_they_look_for(tmp_path):
    """Each scan fails on a sample that breaks its rule: ``service`` imported through a
    helper, inside a function, and by import_module; a third-party import in a package."""
    (tmp_path / "_helper.py").write_text("def f():\n    from service.worker import models\n")
    (tmp_path / "test_x.py").write_text(
        "import os\nfrom _helper import f\n\n\ndef test():\n    import service.control.ray_head\n"
        "    __import__('importlib').import_module('service.control.cli')\n")
    hits = service_imports([tmp_path / "test_x.py"], [tmp_path])
    assert len(hits) == 3, hits
    assert any("_helper.py:2 from service.worker import models" in h for h in hits), hits
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import os\nimport torch\nfrom . import sub\n")
    (pkg / "sub" / "m.py").write_text("def f():\n    import numpy\n    import dmuon.model_state\n")
    assert foreign_imports(pkg) == ["pkg/sub/m.py:2 import numpy"]


def test_no_core_test_imports_service():
    start = sorted(CORE.rglob("*.py"))
    assert len(start) >= 20  # the scan sees the core's tests
    hits = service_imports(start, [CORE, TESTS])
    assert hits == [], "core tests import service/:\n" + "\n".join(hits)


def test_dmuon_imports_only_the_standard_library_and_torch():
    hits = foreign_imports(ROOT / "dmuon")
    assert hits == [], "dmuon/ imports beyond stdlib, torch and dmuon:\n" + "\n".join(hits)
