"""Every dotted name of fedhead that a docstring, a comment or a documentation page points to exists: a
``fedhead.a.b.name`` (or ``extract.a.name``) anywhere in the sources and pages, and a relative Sphinx target
(``:func:`.engine.train_members```), imports and resolves. A function that moves leaves no stale pointer behind."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Dotted names that are not Python objects, each with why.
NOT_PYTHON = {
    "fedhead.methods": "the entry-point group of plugin packages (fedhead/core/plugins.py)",
    "fedhead.run_dir": "an MLflow tag (fedhead/federation/tracking.py)",
    "fedhead.unit": "an MLflow tag (fedhead/federation/tracking.py)",
    "fedhead.rows": "an MLflow tag (fedhead/federation/tracking.py)",
    "fedhead.secagg": "the key of a Flower reply's metric record (fedhead/flower/masking.py)",
    "fedhead.state": "a metadata key of the safetensors checkpoints (fedhead/infra/safestate.py)",
}

DOTTED = re.compile(r"(?<![\w./-])((?:fedhead|extract)(?:\.[A-Za-z_]\w*)+)")
RELATIVE_ROLE = re.compile(r":(?:func|meth|class|attr|mod|data|obj|exc):`~?(\.[\w.]+)`")
FILE_SUFFIXES = (".py", ".md", ".h5", ".toml", ".json", ".yml", ".yaml", ".csv", ".txt", ".png", ".onnx")

# Run in a fresh interpreter: importing every referenced module (the examples register plugins) must not change
# the registries of this test worker. Reads {name: [where]} on stdin, prints the names that do not resolve.
RESOLVE = r"""
import importlib, json, sys
names = json.load(sys.stdin)
bad = {}
for name, where in names.items():
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and ".".join(parts[:i]).startswith(e.name) and e.name.split(".")[0] in ("fedhead", "extract"):
                continue  # not a module: the attribute path starts further up
            bad[name] = f"{where[0]}: import fails ({e})"
            break
        try:
            for a in parts[i:]:
                obj = getattr(obj, a)
        except AttributeError:
            bad[name] = f"{', '.join(where[:3])}: no {'.'.join(parts[i:])!r} in {'.'.join(parts[:i])}"
        break
    else:
        bad[name] = f"{where[0]}: no such module"
print(json.dumps(bad))
"""


def sources() -> list[Path]:
    """The package's sources and pages: what mkdocs renders and what a reader of the code follows."""
    found = [*REPO.glob("fedhead/**/*.py"), *REPO.glob("extract/**/*.py"), REPO / "cli.py"]
    found += [*REPO.glob("fedhead/**/*.md"), *REPO.glob("docs/*.md"), *REPO.glob("docs/*.py"), REPO / "README.md"]
    return sorted(p for p in found if "__pycache__" not in p.parts)


def module_of(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def references() -> dict[str, list[str]]:
    """Every referenced dotted name, with where (``file:line``) it is named."""
    refs: dict[str, list[str]] = {}
    for path in sources():
        rel = path.relative_to(REPO)
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            names = [m.group(1) for m in DOTTED.finditer(line)]
            if path.suffix == ".py" and rel.parts[0] in ("fedhead", "extract"):
                package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
                for m in RELATIVE_ROLE.finditer(line):
                    up = len(m.group(1)) - len(m.group(1).lstrip("."))
                    base = package.split(".")[: len(package.split(".")) - (up - 1)]
                    names.append(".".join([*base, m.group(1).lstrip(".")]))
            for name in names:
                if name.endswith(FILE_SUFFIXES) or name in NOT_PYTHON:
                    continue
                refs.setdefault(name, []).append(f"{rel}:{n}")
    return refs


def test_the_collector_sees_the_references():
    refs = references()
    assert "fedhead.core.closedform.StatsAccumulator" in refs  # docs/extending.md, docs/api.md
    assert "fedhead.scratch.engine.train_members" in refs  # :func:`.engine.train_members` in fedhead/scratch
    assert not any(name in refs for name in NOT_PYTHON)
    assert len(refs) > 100


def test_every_dotted_reference_resolves():
    refs = references()
    r = subprocess.run(
        [sys.executable, "-c", RESOLVE], input=json.dumps(refs), capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert r.returncode == 0, r.stderr
    bad = json.loads(r.stdout.strip().splitlines()[-1])
    assert not bad, "stale references (grep -rn 'def NAME\\|class NAME' fedhead extract):\n" + "\n".join(
        f"{name}  ({why})" for name, why in sorted(bad.items())
    )
