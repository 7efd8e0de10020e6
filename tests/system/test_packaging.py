"""What the package ships and the module paths it answers to: a wheel built from the
tree holds every module, the dashboard's static files and the store's migrations, and
its console scripts name modules it holds; ``service.train.entrypoint``, the driver's
old path (``ray job submit`` commands, deploy files and users' scripts name it), still
runs the driver."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile

from helpers.paths import ROOT


def _tree_files(folder: str, suffix: str = "") -> set[str]:
    """The files under ``folder`` (relative to the repository), caches aside."""
    out = set()
    for here, dirs, files in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out |= {os.path.relpath(os.path.join(here, f), ROOT).replace(os.sep, "/")
                for f in files if f.endswith(suffix)}
    return out


def build_wheel(tmp_path) -> str:
    """A wheel of a copy of the tree (the build writes nothing into the checkout)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for package in ("dmuon", "service"):
        shutil.copytree(os.path.join(ROOT, package), src / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, text=True, timeout=300)
    [wheel] = os.listdir(tmp_path / "dist")
    return str(tmp_path / "dist" / wheel)


def test_the_wheel_holds_the_modules_the_static_files_and_the_migrations(tmp_path):
    with zipfile.ZipFile(build_wheel(tmp_path)) as wheel:
        names = set(wheel.namelist())
        [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = configparser.ConfigParser()
        scripts.read_string(wheel.read(entry_points).decode())
    static = _tree_files("service/control/static")
    migrations = _tree_files("service/control/migrations", ".py")
    assert len(static) >= 5 and "service/control/static/index.html" in static
    assert "service/control/migrations/env.py" in migrations
    assert len([m for m in migrations if "/versions/" in m]) >= 2
    assert static <= names and migrations <= names, sorted((static | migrations) - names)
    modules = _tree_files("dmuon", ".py") | _tree_files("service", ".py")
    assert sorted(modules - names) == []
    assert dict(scripts["console_scripts"]) == {
        "dmuon-svc": "service.control.cli:main", "dmuon-serve": "service.control.serve:main"}
    for target in scripts["console_scripts"].values():
        module = target.split(":")[0].replace(".", "/")
        assert f"{module}.py" in names or f"{module}/__init__.py" in names, target


def test_the_drivers_old_module_path_runs_the_driver():
    from service.driver import job_driver
    from service.train import entrypoint

    assert entrypoint is job_driver  # a patch of the old path reaches the driver
    env = {**os.environ, "PYTHONPATH": ROOT}
    old, new = (subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=120)
                for module in ("service.train.entrypoint", "service.driver.job_driver"))
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    assert "--spec" in old.stdout
    # the same options, after the usage block (which names the file run)
    assert old.stdout.split("\n\n", 1)[1] == new.stdout.split("\n\n", 1)[1]
