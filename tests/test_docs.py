"""The README and docs/ stay true: the README's size, the links, and every make target,
module, flag, CLI option, `dmuon` name, job spec and benchmark table they show.

Nothing here runs a command (no Ray, no network); each check reads the names and flags a
command uses from the code that defines them."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import pathlib
import re
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *PAGES, ROOT / "CHANGELOG.md"]
# pages that describe the current API (the changelog names what was, migration.md the
# reference implementation's names)
API_PAGES = [README] + [ROOT / "docs" / p for p in ("core.md", "jobs.md", "correctness.md")]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
REPO_PATH = re.compile(r"(?<![\w./<-])((?:dmuon|service|bench|tests|deploy|docs)/[\w./-]*)")


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


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
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


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "migration.md"],
                         ids=lambda p: p.name)
def test_repository_paths_named_in_the_text_exist(doc):
    named = {m.rstrip(".,:") for s in spans(doc) for m in REPO_PATH.findall(s)}
    named = {p for p in named if not p.startswith("bench/results/") and "*" not in p}
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


def test_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    used = {t for d in DOCS for s in code(d)
            for t in re.findall(r"(?:^|[\s;&(])make ([a-z][\w-]*)", s)}
    assert used and sorted(used - targets) == []


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
    from service.cli import app

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
    source = (ROOT / "service" / "api" / "serve.py").read_text()
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


@pytest.mark.parametrize("doc", API_PAGES, ids=lambda p: p.name)
def test_dmuon_names_exist(doc):
    names = {n for s in code(doc)
             for n in re.findall(r"(?<![\w.])dmuon\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", s)}
    assert sorted(n for n in names if not resolves(n)) == []


def test_job_specs_shown_parse():
    from service.spec import parse_spec

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
