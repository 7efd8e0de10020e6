"""The architecture, checked from the source (AST, no tool): the import graph has no cycle
in ``dmuon/`` or ``service/``; ``service/`` is four sides, a folder each, whose imports
point one way (control -> job <- driver -> worker -> job -> dmuon), with no cycle between
them; no file name is used twice and ``__init__.py`` files only re-export; the request
path the docs list follows the imports; and the code keeps its shape: no file over 500
lines, no function over 60 (45 in ``dmuon/``), no block of six lines repeated with the
same shape."""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from functools import cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("dmuon", "service")
CONTROL_PLANE = ("service.control.app", "service.control.serve", "service.control.cli")
WORKERS = ("service.driver", "service.worker")
PATH_DOC = os.path.join(ROOT, "docs", "job-path.md")


@cache
def modules() -> dict[str, str]:
    """Module name -> file, for every module of the two packages."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3]
                    mod = rel.replace(os.sep, ".")
                    out[mod.removesuffix(".__init__")] = os.path.join(folder, name)
    return out


def _base(mod: str, path: str, level: int) -> str:
    package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    parts = package.split(".")
    return ".".join(parts[:len(parts) - level + 1])


@cache
def imports(mod: str) -> frozenset[str]:
    """The project modules ``mod`` imports, at any depth of its code (function bodies too)."""
    path, found = modules()[mod], set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(p for p in (_base(mod, path, node.level), base) if p)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules()]
            found.update(subs or [base])
    return frozenset(m for m in found if m in modules() and m != mod)


def _cycle_from(start: str) -> list[str] | None:
    stack, on_path, done = [(start, iter(sorted(imports(start))))], [start], set()
    while stack:
        mod, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.pop()
            done.add(mod)
        elif child in on_path:
            return on_path[on_path.index(child):] + [child]
        elif child not in done:
            stack.append((child, iter(sorted(imports(child)))))
            on_path.append(child)
    return None


def _unresolved(mod: str, path: str, node: ast.ImportFrom) -> list[str]:
    """What a relative import names that is no module of the project (nor, for ``from
    .. import x``, a name its package defines): the graph above would drop it silently,
    and the import fail only when the file runs."""
    base = ".".join(p for p in (_base(mod, path, node.level), node.module or "") if p)
    if base not in modules():
        return [base]
    source = open(modules()[base]).read()
    return [f"{base}.{a.name}" for a in node.names if not node.module
            and f"{base}.{a.name}" not in modules()
            and not re.search(rf"^(def |class )?{a.name}\b", source, flags=re.M)]


def test_every_relative_import_names_a_module_of_the_project():
    missing = [f"{path}:{node.lineno} {name}" for mod, path in modules().items()
               for node in ast.walk(ast.parse(open(path).read(), path))
               if isinstance(node, ast.ImportFrom) and node.level
               for name in _unresolved(mod, path, node)]
    assert not missing, missing


def test_no_import_cycle_in_dmuon_or_service():
    cycles = {" -> ".join(c) for c in map(_cycle_from, sorted(modules())) if c}
    assert not cycles, "\n".join(sorted(cycles))


def reachable(start: str) -> dict[str, str]:
    """Every module ``start`` reaches, with the module that first imports it."""
    seen, todo = {start: ""}, [start]
    while todo:
        mod = todo.pop()
        for child in sorted(imports(mod)):
            if child not in seen:
                seen[child] = mod
                todo.append(child)
    return seen


def test_the_control_plane_imports_nothing_of_the_workers_package():
    for start in CONTROL_PLANE:
        seen = reachable(start)
        bad = sorted(m for m in seen if m.startswith(WORKERS))
        assert not bad, f"{start} reaches {bad[0]} (imported by {seen[bad[0]]})"


def test_dmuon_imports_nothing_of_the_service():
    for mod in modules():
        if mod.startswith("dmuon"):
            assert not [m for m in imports(mod) if m.startswith("service")], mod


# dmuon's public surface: the package's own names, and the modules made to be imported
PUBLIC_DMUON = ("dmuon", "dmuon.planning", "dmuon.testing", "dmuon.checkpoint", "dmuon.utils",
                "dmuon.qk_clip")


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


@cache
def _dmuon_all() -> frozenset[str]:
    """``dmuon.__all__``, read from the source: ``dmuon.partition`` is the function."""
    tree = ast.parse(open(modules()["dmuon"]).read())
    node = next(n for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", "") == "__all__")
    return frozenset(ast.literal_eval(node.value))


def private_dmuon_uses(source: str, filename: str) -> list[str]:
    """Each import of a private dmuon module, or attribute path through one
    (``dmuon.model_state.get_state``), in ``source``."""
    private = [m for m in modules() if m.startswith("dmuon.") and m not in PUBLIC_DMUON]
    # as an attribute, ``dmuon.partition`` is the function that shadows its module
    shadowed = {m for m in private if m.split(".")[1] in _dmuon_all()}
    hits = {}  # line -> the private module used there
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Attribute):
            names = [_dotted(node)]
        else:
            continue
        attribute = isinstance(node, ast.Attribute)
        for m in (m for m in private if not (attribute and m in shadowed)):
            if any(n == m or n.startswith(m + ".") for n in names):
                hits[node.lineno] = m
    return [f"{filename}:{line} {m}" for line, m in sorted(hits.items())]


def test_service_and_bench_use_only_dmuons_public_modules():
    planted = ("import dmuon\nfrom dmuon.model_state import get_state\ndmuon.buffers.Boundary\n"
               "from dmuon.partition import DedicationPlan\ndmuon.partition(model)\n")
    assert [h.split()[1] for h in private_dmuon_uses(planted, "planted.py")] == [
        "dmuon.model_state", "dmuon.buffers", "dmuon.partition"]
    hits, scanned = [], 0
    for package in ("service", "bench"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                hits += private_dmuon_uses(open(path).read(), os.path.relpath(path, ROOT))
                scanned += 1
    assert scanned >= 100 and hits == [], "\n".join(hits)


# The four sides of service/, a folder each: the job model, shared by all; the control
# plane; the Ray job's driver; what each Ray Train worker runs
SIDES = ("service.job", "service.control", "service.driver", "service.worker")
# what each side may import: control -> job <- driver -> worker -> job -> dmuon
MAY_IMPORT = {"service.job": set(), "service.control": {"service.job"},
              "service.driver": {"service.job", "service.worker"},
              "service.worker": {"service.job"}}
# on no side: the package's docstring, the demos (they may import any side; no side
# imports them) and the old path of the driver (``service.train.entrypoint``, an alias)
OUTSIDE = ("service", "service.dev", "service.train")
# the job model runs everywhere: none of the other sides' frameworks
NOT_ON_THE_JOB_SIDE = ("ray", "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic",
                       "click")
# ``dmuon-svc prepare --ray`` tokenizes on a cluster with Ray Data (imported in that
# function only): the one exception, until the prepare tool has a side of its own
JOB_SIDE_RAY = {"service.job.inputs.prepare": {"ray"}}


def side_of(mod: str) -> str | None:
    return next((s for s in SIDES if mod == s or mod.startswith(s + ".")), None)


def side_violations(graph: dict[str, frozenset]) -> list[str]:
    """Each import from one side into a side it may not import, or into no side."""
    return sorted(f"{mod} -> {dep}" for mod, deps in graph.items() if side_of(mod)
                  for dep in deps if dep.startswith("service")
                  and side_of(dep) != side_of(mod)
                  and side_of(dep) not in MAY_IMPORT[side_of(mod)])


def side_graph(graph: dict[str, frozenset]) -> dict[str, set[str]]:
    """Side -> the other sides its modules import."""
    out = {s: set() for s in SIDES}
    for mod, deps in graph.items():
        for dep in deps:
            if side_of(mod) and side_of(dep) and side_of(dep) != side_of(mod):
                out[side_of(mod)].add(side_of(dep))
    return out


def side_cycle(sides: dict[str, set[str]]) -> list[str] | None:
    """A cycle between sides, if any (a depth-first search over at most four nodes)."""
    def walk(path):
        for nxt in sorted(sides[path[-1]]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            found = walk(path + [nxt])
            if found:
                return found
        return None
    return next(filter(None, (walk([s]) for s in sorted(sides))), None)


def test_each_module_of_the_service_is_on_one_side():
    service = [m for m in modules() if m.startswith("service")]
    assert {side_of(m) for m in service} == {*SIDES, None}
    loose = [m for m in service if side_of(m) is None
             and not any(m == o or m.startswith(o + ".") for o in OUTSIDE if o != "service")
             and m != "service"]
    assert loose == []
    assert {m for m in service if m.startswith("service.train")} == {
        "service.train", "service.train.entrypoint"}


def test_each_side_imports_only_the_sides_below_it():
    graph = {m: imports(m) for m in modules() if m.startswith("service")}
    planted = {**graph, "service.worker.loop": graph["service.worker.loop"]
               | {"service.driver.reports"}}
    assert side_violations(planted) == ["service.worker.loop -> service.driver.reports"]
    planted = {**graph, "service.job.plan.make": graph["service.job.plan.make"]
               | {"service.dev.demo"}}
    assert side_violations(planted) == ["service.job.plan.make -> service.dev.demo"]
    assert side_violations(graph) == []


def test_no_cycle_between_the_sides():
    graph = {m: imports(m) for m in modules() if m.startswith("service")}
    sides = side_graph(graph)
    assert sides == {"service.job": set(), "service.control": {"service.job"},
                     "service.driver": {"service.job", "service.worker"},
                     "service.worker": {"service.job"}}
    assert side_cycle(sides) is None
    planted = {**graph, "service.job.spec.job_spec": graph["service.job.spec.job_spec"]
               | {"service.driver.register"}}
    assert side_cycle(side_graph(planted)) == [
        "service.job", "service.driver", "service.job"]


def _third_party(path: str) -> set[str]:
    """The top-level names of what a file imports, at any depth, but its own packages."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - set(PACKAGES)


def test_the_job_side_imports_no_ray_web_sql_or_cli_framework():
    hits = {m: _third_party(p) & set(NOT_ON_THE_JOB_SIDE) for m, p in modules().items()
            if side_of(m) == "service.job"}
    assert {m: h for m, h in hits.items() if h} == JOB_SIDE_RAY


def test_no_file_name_is_used_twice_in_the_service():
    """``__init__.py`` and ``__main__.py`` aside: a file's name says what it holds."""
    seen: dict[str, list[str]] = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "service")):
        for name in files:
            if name.endswith(".py") and name not in ("__init__.py", "__main__.py"):
                seen.setdefault(name, []).append(os.path.relpath(folder, ROOT))
    assert len(seen) >= 80
    assert {n: f for n, f in seen.items() if len(f) > 1} == {}


def only_reexports(source: str) -> bool:
    """A docstring, imports and ``__all__``: nothing an ``__init__.py`` runs or defines."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return all(isinstance(n, (ast.Import, ast.ImportFrom)) or (
        isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["__all__"])
        for n in body)


def test_init_files_only_reexport():
    assert only_reexports('"""Doc."""\nfrom .a import b\n__all__ = ["b"]\n')
    assert not only_reexports('"""Doc."""\nfrom .a import b\n\n\ndef c():\n    return b\n')
    inits = [p for m, p in modules().items() if m.startswith("service")
             and p.endswith("__init__.py")]
    assert len(inits) >= 12
    assert [os.path.relpath(p, ROOT) for p in inits if not only_reexports(open(p).read())] == []


def test_each_job_directory_name_is_written_in_one_place():
    """``service/job/job_dir.py`` names every file under ``<storage>/<job>/``; no other
    file of the service spells one out (a planted one is found)."""
    tree = ast.parse(open(modules()["service.job.job_dir"]).read())
    names = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)]
    assert "metrics.jsonl" in names and "dcp" in names and len(names) >= 10

    def spelled(source: str) -> set[str]:
        """The names used as a path's part (``os.path.join``, ``open``, a dict of files
        to write): a name can also be a word ("export", a phase; "job_token", a field)."""
        found = set()
        for call in ast.walk(ast.parse(source)):
            if isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(
                    call.func, "id", "")) in ("join", "open", "exists", "isdir", "isfile"):
                found |= {a.value for a in call.args
                          if isinstance(a, ast.Constant) and a.value in names}
        return found

    assert spelled('path = os.path.join(job, "plan.json")') == {"plan.json"}
    hits = {mod: spelled(open(path).read()) for mod, path in modules().items()
            if mod.startswith("service.") and mod != "service.job.job_dir"}
    assert {m: h for m, h in hits.items() if h} == {}


def _path_files() -> list[str]:
    """The files of the numbered list under "## The path of a job" in the docs."""
    text = open(PATH_DOC).read()
    section = text.split("## The path of a job", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([\w/]+\.py)`", section, flags=re.M)


def _module(file: str) -> str:
    return file[:-3].replace("/", ".").removesuffix(".__init__")


def _leads_to(before: str, mod: str) -> bool:
    """``before`` imports ``mod`` (itself, or through a package it imports), or names it
    as a module to run (``python -m``)."""
    direct = imports(before)
    through = {m for p in direct if modules()[p].endswith("__init__.py") for m in imports(p)}
    named = re.search(rf"[\"']{re.escape(mod)}[\"']", open(modules()[before]).read())
    return mod in direct or mod in through or named is not None


def test_the_request_path_in_the_docs_follows_the_imports():
    """From ``POST /v1/jobs`` to ``optimizer.step()``: at most 12 files, each one handed
    the job by one before it."""
    files = _path_files()
    assert "service/control/routes/jobs.py" in files and files[-1] == "dmuon/optim.py", files
    assert 2 <= len(files) <= 12, files
    for i, after in enumerate(files[1:], 1):
        mod = _module(after)
        assert any(_leads_to(_module(b), mod) for b in files[:i]), \
            f"no file before {after} in the list leads to it"


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_files_and_functions_keep_their_size():
    too_long = []
    for mod, path in modules().items():
        source, where = open(path).read(), os.path.relpath(path, ROOT)
        if source.count("\n") > 500:
            too_long.append(f"{where}: {source.count(chr(10))} lines")
        limit = 45 if mod.startswith("dmuon") else 60
        too_long += [f"{where}:{fn.lineno} {fn.name}: {fn.end_lineno - fn.lineno + 1} lines"
                     for fn in _functions(ast.parse(source))
                     if fn.end_lineno - fn.lineno + 1 > limit]
    assert not too_long, "\n".join(too_long)


def _shape(line: str) -> str:
    """A line with its names, strings and numbers replaced: lines of the same shape."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.NAME and tok.string not in KEYWORDS:
                out.append("N")
            elif tok.type in (tokenize.STRING, tokenize.NUMBER):
                out.append("L")
            elif tok.type == tokenize.OP:
                out.append(tok.string)
            elif tok.type == tokenize.NAME:
                out.append(tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return line.strip()
    return " ".join(out)


KEYWORDS = {"def", "return", "if", "else", "elif", "for", "in", "not", "and", "or", "with",
            "as", "try", "except", "raise", "import", "from", "class", "while", "yield",
            "lambda", "is", "None", "True", "False", "async", "await", "finally", "pass"}


def _code_lines(path: str) -> list[tuple[int, str]]:
    out = []
    for number, line in enumerate(open(path).read().splitlines(), 1):
        text = line.strip()
        if text and not text.startswith(("#", '"""', "'''", "@")) and \
                not re.fullmatch(r"[\])}]+,?|\)\s*(->.*)?:", text) and \
                not text.startswith(("import ", "from ")):
            shape = _shape(text)
            if shape.count(" ") >= 3:  # thin lines (a name, a field, a literal) say little
                out.append((number, shape))
    return out


def _near(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Overlapping windows of one run of same-shaped lines."""
    return a[0] == b[0] and abs(a[1] - b[1]) < 6


def test_no_block_of_six_lines_is_repeated():
    """Runs of six code lines of one shape (names, strings and numbers aside), thin lines
    and lists of like lines passed over, as the ``duplicates`` tool reads them. Migrations
    are left out: each is a frozen copy of the schema as it was then."""
    first: dict[tuple, tuple[str, int]] = {}
    repeats = []
    for path in sorted(modules().values()):
        where = os.path.relpath(path, ROOT)
        if "/migrations/" in where:
            continue
        lines = _code_lines(path)
        for i in range(len(lines) - 5):
            window = tuple(shape for _, shape in lines[i:i + 6])
            if len(set(window)) < 3:  # a list of like lines (fields, table rows)
                continue
            here = (where, lines[i][0])
            seen = first.setdefault(window, here)
            if seen != here and not _near(seen, here):
                repeats.append(f"{where}:{here[1]} repeats {seen[0]}:{seen[1]}")
    assert not repeats, "\n".join(repeats)


# "about 150": the cap of issue 51
CLASS_LIMIT = 150


def test_no_class_grows_past_about_150_lines():
    """The function caps pushed length into classes (Muon held three param-group
    dialects, the NS schedule, NorMuon and QK-clip): a class is one concern too."""
    too_long = []
    for path in modules().values():
        tree = ast.parse(open(path).read())
        too_long += [f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name}: "
                     f"{node.end_lineno - node.lineno + 1} lines"
                     for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                     and node.end_lineno - node.lineno + 1 > CLASS_LIMIT]
    assert not too_long, "\n".join(too_long)


def _writes_into_state(tree) -> list[int]:
    """Lines that assign an attribute of a DedicatedModel held as ``state``,
    ``self._state`` or ``get_state(...)``, or ``setattr`` on one."""
    def is_state(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "state") or \
            (isinstance(node, ast.Attribute) and node.attr == "_state") or \
            (isinstance(node, ast.Call) and getattr(node.func, "attr",
                                                    getattr(node.func, "id", "")) == "get_state")

    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Attribute) and is_state(leaf.value):
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" \
                and node.args and is_state(node.args[0]):
            lines.append(node.lineno)
    return sorted(lines)


def test_nothing_assigns_into_the_dedicated_model_from_another_module():
    """``DedicatedModel`` is built in one constructor; other modules ask it or call its
    methods (tests, whose hooks live in tests/, aside)."""
    found = [f"{os.path.relpath(path, ROOT)}:{line}" for mod, path in modules().items()
             if mod != "dmuon.model_state" for line in _writes_into_state(
                 ast.parse(open(path).read()))]
    assert found == []


def test_the_state_write_check_catches_one():
    planted = ast.parse("state.reduce = None\nself._state.needs_init = False\n"
                        "setattr(state, 'x', 1)\nget_state(m).flag = 1\nother.x = 1\n")
    assert _writes_into_state(planted) == [1, 2, 3, 4]
