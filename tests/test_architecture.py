"""The shape of the code (issue 22), checked by the suite so that a change that breaks it fails a test: the layers
and the absence of import cycles (import-linter's contracts in pyproject.toml), imports at module level, and no
function longer than 100 lines."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("fedhead", "extract") for p in sorted((REPO / d).rglob("*.py"))]

# The modules that import flwr at module level: the core CLI registers fedhead.flower.commands without the optional
# extra, so it may import them only inside the functions that need Flower.
FLWR_MODULES = ("fedhead.flower.client_app", "fedhead.flower.server_app", "fedhead.flower.strategy",
                "fedhead.flower.secure", "fedhead.flower.inprocess", "fedhead.flower.node")  # fmt: skip


def test_import_linter_contracts_are_kept():
    """The layers (wings > interface > federation > core > extraction > infra) and no cycles between the modules of
    a package: `lint-imports` (the contracts live in pyproject.toml)."""
    pytest.importorskip("importlinter")
    exe = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run([str(exe), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert "0 broken" in r.stdout


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_in_fedhead_is_longer_than_100_lines():
    long = []
    for p in SOURCES:
        if p.parts[len(REPO.parts)] != "fedhead":
            continue
        for f in _functions(ast.parse(p.read_text())):
            n = f.end_lineno - f.lineno + 1
            if n > 100:
                long.append(f"{p.relative_to(REPO)}:{f.lineno} {f.name} ({n} lines)")
    assert not long, long


def _internal(node: ast.ImportFrom) -> str | None:
    if node.level:
        return "relative"
    top = (node.module or "").split(".")[0]
    return node.module if top in ("fedhead", "extract") else None


def test_imports_of_fedhead_and_extract_stand_at_module_level():
    """Inside a function only an import of a module that needs flwr (an optional dependency), and every import
    absolute."""
    hidden = []
    for p in SOURCES:
        tree = ast.parse(p.read_text())
        top = {id(n) for n in tree.body}
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (mod := _internal(n)):
                where = f"{p.relative_to(REPO)}:{n.lineno} {mod}"
                if mod == "relative":
                    hidden.append(where + " (relative)")
                elif id(n) not in top and mod not in FLWR_MODULES:
                    hidden.append(where)
    assert not hidden, hidden
