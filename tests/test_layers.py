"""The import layers of docs/architecture.md hold: import-linter's contracts in
pyproject.toml (who may import whom), and no module imports another in a circle."""
from __future__ import annotations

import ast
import graphlib
import os
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("quiverfs", "mountd", "coordinator", "digest_tools")


def lint_imports(root: str) -> subprocess.CompletedProcess[str]:
    """import-linter over the packages in ``root`` (its working directory comes first on
    the import path, ahead of the editable install)."""
    linter = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    return subprocess.run([linter, "--no-cache"], cwd=root, capture_output=True, text=True,
                          timeout=300)


def test_import_contracts_are_kept():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def _contracts() -> list[dict]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def test_the_ground_layer_names_every_quiverfs_module_but_the_roof():
    floors = next(c for c in _contracts() if c["type"] == "layers" and "containers" not in c)
    ground = {name.strip() for name in floors["layers"][-1].split(":")}
    assert floors["layers"][:2] == ["quiverfs.cli", "quiverfs.bench"]
    modules = {f"quiverfs.{name.removesuffix('.py')}" for name in os.listdir(
        os.path.join(ROOT, "quiverfs")) if name not in ("__init__.py", "__pycache__")}
    assert ground == modules - {"quiverfs.cli", "quiverfs.bench"}
    assert not any("ignore_imports" in c for c in _contracts())


@pytest.mark.parametrize("importer, imported, contract", [
    ("quiverfs/digest.py", "mountd.daemon", "The roof, the daemons"),
    ("quiverfs/heartbeat.py", "digest_tools.create", "The roof, the daemons"),
    ("mountd/cli.py", "quiverfs.bench.compare", "The roof, the daemons"),
    ("coordinator/state.py", "mountd.daemon", "The roof, the daemons"),
    ("mountd/store/content_store.py", "mountd.fetch.item_reader", "mountd's parts"),
    ("mountd/datasets/dataset.py", "mountd.view.view_jobs", "mountd's parts"),
    ("mountd/fs/job_files.py", "mountd.control.controller", "mountd's parts"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path, importer, imported, contract):
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    for package in PACKAGES:
        shutil.copytree(os.path.join(ROOT, package), tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    assert lint_imports(str(tmp_path)).returncode == 0
    with open(tmp_path / importer, "a", encoding="utf-8") as f:
        f.write(f"\nimport {imported}  # noqa\n")
    done = lint_imports(str(tmp_path))
    assert done.returncode != 0 and contract in done.stdout
    assert f"{importer[:-3].replace('/', '.')} -> {imported}" in done.stdout, done.stdout


def _modules(root: str) -> dict[str, str]:
    """Every module of the four packages, by dotted name: its file."""
    found = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    parts = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts.pop()
                    found[".".join(parts)] = os.path.join(folder, name)
    return found


def import_graph(root: str) -> dict[str, set[str]]:
    """Who imports whom among the packages' modules: every import statement, those
    under ``if TYPE_CHECKING:`` and inside functions included; ``from P import N``
    counts as an import of P.N where that is a module."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.endswith("__init__.py")
        edges = graph[name] = set()
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[:len(here) - node.level + 1]
                    base = ".".join(here + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
    return graph


def test_no_module_imports_another_in_a_circle():
    try:
        order = list(graphlib.TopologicalSorter(import_graph(ROOT)).static_order())
    except graphlib.CycleError as cycle:  # each module in it imports the one before it
        circle = " imports ".join(reversed(cycle.args[1]))
        raise AssertionError(f"an import circle: {circle}") from None
    assert "mountd.daemon" in order


def test_the_circle_test_finds_a_type_checking_circle(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "mountd" / "a.py").write_text("from mountd.b import B\n")
    (tmp_path / "mountd" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mountd import a\n")
    graph = import_graph(str(tmp_path))
    assert graph["mountd.a"] == {"mountd.b"} and graph["mountd.b"] == {"mountd.a"}


MAX_MODULE_LINES = 450  # a module longer than this holds more than one concern


def _lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return len(f.read().splitlines())


def test_no_product_module_is_longer_than_its_bound():
    long = {name: n for name, path in _modules(ROOT).items()
            if not name.startswith("quiverfs.bench") and (n := _lines(path)) > MAX_MODULE_LINES}
    assert not long, f"split these modules (lines): {long}"
