"""The README, docs/ and deploy/README.md stay true: the README's size, the links, and
every make target, module, flag, CLI option, `dmuon` name, job spec and benchmark table
they show; and every repository path or module they, or a comment or docstring of the
project's Python files, name exists.

Nothing here runs a command (no Ray, no network); each check reads the names and flags a
command uses from the code that defines them."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import io
import json
import pathlib
import re
import subprocess
import tokenize

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DEPLOY = ROOT / "deploy" / "README.md"
DOCS = [README, *PAGES, DEPLOY, ROOT / "CHANGELOG.md"]
# pages that describe the current API (the changelog names what was, migration.md the
# reference implementation's names)
API_PAGES = [README] + [ROOT / "docs" / p for p in ("core.md", "jobs.md", "correctness.md")]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
# a path or module of this repository: not inside a URL or another path (/tmp/dmuon/..., a
# `X-Square-Robot/dmuon` name) and not an attribute (`self.service`)
REPO_PATH = re.compile(r"(?<![\w./<:-])((?:dmuon|service|bench|tests|deploy|docs)/[\w./-]*)")
# `a.b/c` is two names in short (`dmuon.get/set_model_state_dict`): neither is checked
REPO_MODULE = re.compile(
    r"(?<![\w./<:-])((?:dmuon|service|bench|tests)(?:\.[A-Za-z_]\w*)+)(?![\w/])")
UP_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+\w[\w./-]*)")
# `dmuon.db`, `bench.json`: a file's name, not a module
FILE_SUFFIXES = {"db", "json", "jsonl", "md", "py", "toml", "txt", "yaml", "yml"}
SOURCES = ("dmuon", "service", "tests", "bench", "deploy")


def doc_id(doc: pathlib.Path) -> str:
    return str(doc.relative_to(ROOT))


def blocks(doc: pathlib.Path) -> list[str]:
    """Its fenced and indented code blocks, continuation lines joined."""
    text = doc.read_text()
    found = [m.group(2) for m in FENCE.finditer(text)]
    found.append("\n".join(re.findall(r"^(?: {4}|\t)(.*)$", FENCE.sub("", text), re.M)))
    return [b.replace("\\\n", " ") for b in found]


def spans(doc: pathlib.Path) -> list[str]:
    """Its inline code spans (one may run over a line break)."""
    prose = FENCE.sub("", doc.read_text())
    return [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", prose)]


def code(doc: pathlib.Path) -> list[str]:
    return blocks(doc) + spans(doc)


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_is_at_most_12_kb():
    # 12,000 bytes: within 12 KB whether a KB is 1,000 or 1,024 bytes
    assert len(README.read_bytes()) <= 12_000


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / p.split("#")[0]).resolve()
              for p in re.findall(r"\]\(([^)\s]+)\)", README.read_text())}
    assert PAGES and [p.name for p in PAGES if p.resolve() not in linked] == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_links_point_to_files_and_headings_that_exist(doc):
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md":
            heads = re.findall(r"^#+ (.*)$", FENCE.sub("", target.read_text()), re.M)
            if anchor not in {slug(h) for h in heads}:
                broken.append(link)
    assert broken == []


@functools.cache
def _defines(file: pathlib.Path) -> set[str]:
    """The names a module binds at its top level (defs, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


@functools.cache
def _spec_dmuon_keys() -> frozenset[str]:
    """The keys of a job spec's `dmuon:` section (`dmuon.mode` names one, not a module)."""
    from service.job.spec import JobSpec

    return frozenset(JobSpec.model_fields["dmuon"].annotation.model_fields)


def module_exists(dotted: str) -> bool:
    """`a.b.c`: folders and modules down to a module, then one name that it defines."""
    parts = dotted.split(".")
    if parts[0] == "dmuon" and len(parts) == 2 and parts[1] in _spec_dmuon_keys():
        return True
    here = ROOT
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
        elif (here / f"{part}.py").is_file():
            return i + 1 == len(parts) or parts[i + 1] in _defines(here / f"{part}.py")
        else:
            init = here / "__init__.py"
            return init.is_file() and part in _defines(init)
    return True


def named_paths(text: str) -> set[str]:
    """The repository paths and dotted modules a text names; of a pattern
    (`bench/results/<bench>_<date>.md`, `overlap*.json`), the folder it is in."""
    named = set()
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".,:;")
        if text[m.end():m.end() + 1] in ("<", "*", "{", "["):
            path = path.rpartition("/")[0] + "/"
        named.add(path)
    return named | {m.rstrip(".") for m in REPO_MODULE.findall(text)}


def _exists(name: str) -> bool:
    if "/" not in name:
        return name.rpartition(".")[2] in FILE_SUFFIXES or module_exists(name)
    # a path, or a module's name in a file (`tests/helpers/elastic.GROW_COUNTS`)
    file, _, attr = name.rpartition(".")
    return (ROOT / name).exists() or ((ROOT / f"{file}.py").is_file()
                                      and attr in _defines(ROOT / f"{file}.py"))


def stale_paths(text: str, folder: pathlib.Path = ROOT) -> list[str]:
    """What `text`, found in `folder`, names that the repository does not hold: its
    repository paths and modules, less the paths git ignores (a bench's output, such as
    bench/results/api.json, is made when the bench runs), and its `../` paths that lead out
    of the repository or to nothing."""
    missing = sorted(p for p in named_paths(text) if not _exists(p))
    paths = "\n".join(p for p in missing if "/" in p)
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT,
                             input=paths, capture_output=True, text=True).stdout.split()
    up = [p for p in UP_PATH.findall(text) if not _in_the_repository(folder / p)]
    return [p for p in missing if p not in ignored] + sorted(up)


def _in_the_repository(path: pathlib.Path) -> bool:
    return path.exists() and path.resolve().is_relative_to(ROOT)


def python_prose(source: str) -> str:
    """The comments and docstrings of a Python file, one text."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    parts = [t.string for t in tokens if t.type == tokenize.COMMENT]
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    parts += [ast.get_docstring(n, clean=False) or "" for n in ast.walk(ast.parse(source))
              if isinstance(n, kinds)]
    return "\n".join(parts)


def python_files() -> list[pathlib.Path]:
    """The project's Python files, tracked or new (not ignored)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "--", *(f"{d}/*.py" for d in SOURCES)], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    return [ROOT / p for p in listed if (ROOT / p).is_file()]


def stale_in_comments(files: list[pathlib.Path]) -> dict[str, list[str]]:
    """File -> the stale paths its comments and docstrings name, for the files with any."""
    stale = {str(f): stale_paths(python_prose(f.read_text()), f.parent) for f in files}
    return {f: s for f, s in stale.items() if s}


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_repository_paths_named_in_the_text_exist(doc):
    assert stale_paths(doc.read_text(), doc.parent) == []


def test_repository_paths_named_in_comments_and_docstrings_exist():
    files = python_files()
    assert len(files) > 100 and ROOT / "tests" / "test_docs.py" in files
    assert stale_in_comments(files) == {}


# Planted: the same checks on a copy with stale names added, beside names that are not
# this repository's (a URL, another machine's path, a glob, an ignored output, a spec key)
PLANTED = ("`service/entrypoint.py`", "`service.entrypoint.TorchConfig`",
           "`tests/test_compile.py`", "`../shared/seeds/`")
NOT_OURS = ("https://github.com/X-Square-Robot/dmuon/blob/f002f24/dmuon/optim/muon.py",
            "`/tmp/dmuon/service/x.py`", "`bench/results/overlap*.json`",
            "`bench/results/api.json`", "`dmuon.mode: auto`", "`dmuon.db`")


def test_a_stale_path_planted_in_deploy_readme_fails_the_check(tmp_path):
    copy = tmp_path / "deploy" / "README.md"
    copy.parent.mkdir()
    copy.write_text(DEPLOY.read_text() + "\n".join(("", *NOT_OURS, "")))
    test_repository_paths_named_in_the_text_exist(copy)
    copy.write_text(copy.read_text() + "The timeout is set in `service/entrypoint.py`.\n")
    with pytest.raises(AssertionError, match="service/entrypoint.py"):
        test_repository_paths_named_in_the_text_exist(copy)
    copy.write_text(copy.read_text() + "\n".join(PLANTED))
    assert stale_paths(copy.read_text(), DEPLOY.parent) == [
        "service.entrypoint.TorchConfig", "service/entrypoint.py", "tests/test_compile.py",
        "../shared/seeds/"]


def test_a_stale_path_planted_in_a_comment_or_docstring_fails_the_check(tmp_path):
    source = (ROOT / "tests" / "helpers" / "model.py").read_text()
    (tmp_path / "as_is.py").write_text(source + "\n".join(f"# {n}" for n in NOT_OURS))
    (tmp_path / "comment.py").write_text(source + "# see service/worker/models.py\n")
    (tmp_path / "docstring.py").write_text(
        source + 'def f():\n    """Like service.worker.models.build."""\n')
    (tmp_path / "code.py").write_text(source + 'PATH = "service/worker/models.py"\n')
    stale = stale_in_comments(sorted(tmp_path.iterdir()))
    assert stale == {str(tmp_path / "comment.py"): ["service/worker/models.py"],
                     str(tmp_path / "docstring.py"): ["service.worker.models.build"]}


def test_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    used = {t for d in DOCS for s in code(d)
            for t in re.findall(r"(?:^|[\s;&(])make ([a-z][\w-]*)", s)}
    assert used and sorted(used - targets) == []


def test_make_demo_installs_the_runtime_lock_only_and_test_the_test_lock(tmp_path):
    """``make -n`` on a fresh venv path: the commands each target would run."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("make is not installed")

    def commands(target):
        return subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}",
                               "CHROMIUM=/bin/sh"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout

    demo, test = commands("demo"), commands("test")
    assert "pip install -q -r requirements.lock" in demo
    assert "requirements-test.lock" not in demo
    assert "pip install -q -r requirements-test.lock" in test


def test_python_modules_and_their_flags_exist():
    missing = []
    for s in (s for d in DOCS for s in code(d)):
        for module, args in re.findall(r"python -m ([\w.]+)((?: +[^\s;|&#]+)*)", s):
            spec = importlib.util.find_spec(module)
            if spec is None:
                missing.append(module)
                continue
            origin = pathlib.Path(spec.origin)
            if spec.submodule_search_locations:  # a package runs its __main__
                origin = origin.parent / "__main__.py"
            source = origin.read_text()
            missing += [f"{module} {f}" for f in re.findall(r"(?<!\S)(--[\w-]+)", args)
                        if f != "--help" and f'"{f}"' not in source]
    assert missing == []


def test_dmuon_svc_commands_and_options_exist():
    from service.control.cli import app

    def options(command):
        return {o for p in command.params for o in p.opts + p.secondary_opts} | {"--help"}

    wrong = []
    for s in (s for d in DOCS for s in code(d)):
        for call in re.findall(r"dmuon-svc ([^|;#`\n&]*)", s):
            words = call.split()
            command = app
            if words and re.fullmatch(r"[a-z]+", words[0]):
                command = app.commands.get(words[0])
                if command is None:
                    wrong.append(call)
                    continue
            flags = re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", call)
            wrong += [f"{call}: {f}" for f in flags if f not in options(command)]
    assert wrong == []


def test_dmuon_serve_flags_exist():
    source = (ROOT / "service" / "control" / "serve.py").read_text()
    used = {f for d in DOCS for s in code(d)
            for call in re.findall(r"dmuon-serve((?: +--[\w-]+)*)", s)
            for f in call.split()}
    assert {"--keep-ray", "--stop-ray"} <= used
    assert sorted(f for f in used if f'"{f}"' not in source) == []


def resolves(dotted: str) -> bool:
    obj, path = importlib.import_module("dmuon"), "dmuon"
    for part in dotted.split("."):
        path = f"{path}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif hasattr(obj, "__path__") and importlib.util.find_spec(path):
            obj = importlib.import_module(path)
        else:
            return False
    return True


@pytest.mark.parametrize("doc", API_PAGES, ids=doc_id)
def test_dmuon_names_exist(doc):
    names = {n for s in code(doc)
             for n in re.findall(r"(?<![\w.])dmuon\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", s)}
    assert sorted(n for n in names if not resolves(n)) == []


def test_job_specs_shown_parse():
    from service.job.spec import parse_spec

    specs = [yaml.safe_load(m.group(2)) for d in DOCS for m in FENCE.finditer(d.read_text())
             if m.group(1) == "yaml" and m.group(2).startswith("# job.yaml")]
    specs += [json.loads(body)["spec"] for d in DOCS for s in code(d)
              for body in re.findall(r"-d '(\{.*?\})'", s)]
    assert len(specs) >= 3
    for spec in specs:
        parse_spec(spec)


def test_readme_core_example_calls_dmuon_with_keywords_it_takes():
    import dmuon

    source = next(m.group(2) for m in FENCE.finditer(README.read_text()) if m.group(1) == "python")
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", "") == "dmuon"]
    assert len(calls) >= 4
    for call in calls:
        takes = inspect.signature(getattr(dmuon, call.func.attr)).parameters
        assert {k.arg for k in call.keywords} <= set(takes), call.func.attr


def test_benchmark_tables_come_from_tracked_dated_records():
    tracked = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    tables = re.findall(r"(?:^\|.*\n)+", FENCE.sub("", page), re.M)
    assert tables
    for table in tables:
        sources = [p for p in tracked if p.endswith(".md") and table in (ROOT / p).read_text()]
        assert sources, f"not in a tracked record:\n{table}"
        # the header bench/_record.py writes: "<date>, <machine>, `python -m bench.<bench>`"
        date, machine, bench = re.search(r"^(\d{4}-\d{2}-\d{2}), (\S+), `python -m bench\.(\w+)`",
                                         (ROOT / sources[0]).read_text(), re.M).groups()
        assert sources[0] == f"bench/results/{bench}_{machine}_{date}.md" and sources[0] in page
        assert sources[0][:-3] + ".json" in tracked


def _modules_missing(root: pathlib.Path, page: str) -> list[str]:
    return [str(p.relative_to(root)) for top in ("dmuon", "service")
            for p in sorted((root / top).rglob("*.py"))
            if p.name != "__init__.py" and p.name not in page]


def test_architecture_page_names_every_module():
    """Every module under dmuon/ and service/ (``__init__.py`` aside) is named on
    docs/architecture.md by its file name: a module added without a line there fails."""
    assert _modules_missing(ROOT, (ROOT / "docs" / "architecture.md").read_text()) == []


def test_a_module_left_off_the_architecture_page_fails_the_check(tmp_path):
    (tmp_path / "dmuon").mkdir()
    (tmp_path / "service").mkdir()
    for name in ("__init__.py", "listed.py", "unlisted.py"):
        (tmp_path / "dmuon" / name).write_text("")
    assert _modules_missing(tmp_path, "listed.py  the one named") == ["dmuon/unlisted.py"]
