"""The documentation: the README's quickstart runs as written, its list of keys is the registries', the README stays
short, no page names a path of one machine, CITATION.cff and LICENSE match pyproject. (``make test`` builds the
site itself with ``mkdocs build --strict``.)"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _hooks():
    """docs/hooks.py, the generator of the documentation's tables (the mkdocs hook)."""
    spec = importlib.util.spec_from_file_location("fedhead_docs_hooks", REPO / "docs" / "hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _commands() -> set[str]:
    """The names of ``fedhead``'s top-level commands."""
    import typer

    import cli

    return set(typer.main.get_command(cli.app).commands)


def quickstart_steps(text: str) -> list[str]:
    """The README's quickstart block as shell steps: comments dropped, continued lines joined, a here-document
    (``<<'EOF'`` ... ``EOF``) kept whole with its command."""
    block = text.split("<!-- --8<-- [start:quickstart] -->", 1)[1].split("<!-- --8<-- [end:quickstart] -->", 1)[0]
    block = block.strip().removeprefix("```bash").removesuffix("```").strip("\n")
    steps: list[str] = []
    lines = iter(block.replace("\\\n", " ").splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        heredoc = re.search(r"<<'(\w+)'", line)
        if heredoc:
            body = []
            for more in lines:
                body.append(more)
                if more.strip() == heredoc.group(1):
                    break
            line = "\n".join([line, *body])
        steps.append(line)
    return steps


def test_readme_is_short_and_names_no_path_of_one_machine():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    pages = [README, REPO / "CITATION.cff", REPO / "mkdocs.yml", *sorted((REPO / "docs").glob("*.md"))]
    machine = re.compile(r"(?<![\w.])(/work/|/home/|/tmp/|/root/|\.\./shared)")
    found = [f"{p.name}: {m.group(0)}" for p in pages for m in machine.finditer(p.read_text())]
    assert not found, found


def test_readme_lists_every_registered_key():
    """The README's table of keys is exactly what docs/hooks.py makes from the built-in registries (regenerate it
    with ``python docs/hooks.py`` when a head, partition, rule or method is added). It runs in a fresh interpreter
    without plugins: the registries of this one hold what other tests registered."""
    env = {k: v for k, v in os.environ.items() if k != "FEDHEAD_PLUGINS"}
    made = subprocess.run(
        [sys.executable, str(REPO / "docs" / "hooks.py")], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    hooks = _hooks()
    text = README.read_text()
    block = hooks.README_BEGIN + text.split(hooks.README_BEGIN, 1)[1].split(hooks.README_END, 1)[0] + hooks.README_END
    assert block + "\n" == made.stdout, "README's keys are stale; paste the output of `python docs/hooks.py`"
    for name in ("softmax", "ova2", "ridge", "shard", "dirichlet", "fedavg", "fedadam", "paper", "ridge+ft"):
        assert f"`{name}`" in block


def test_quickstart_parser_keeps_every_command():
    steps = quickstart_steps(README.read_text())
    assert steps[0].startswith("python - <<'EOF'") and steps[0].endswith("EOF")
    commands = [s.split()[1] for s in steps[1:]]
    assert commands == ["extract", "train", "predict", "export"]
    assert all(s.startswith("fedhead ") for s in steps[1:])


@pytest.mark.slow
def test_readme_quickstart_runs_as_written(tmp_path):
    """Every step of the README's quickstart, as written, in an empty folder. ``fedhead predict`` and ``fedhead
    export`` come from another branch: until they are registered commands the test runs the steps before them
    and skips the rest (and says so)."""
    bindir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",  # `python` and `fedhead` of this install
        "FEDHEAD_THREADS": "1",
        "FEDHEAD_NO_PROGRESS": "1",
    }
    for step in quickstart_steps(README.read_text()):
        command = step.split()[1] if step.startswith("fedhead ") else ""
        if command in ("predict", "export") and command not in _commands():
            pytest.skip(f"'fedhead {command}' is not a command of this branch yet (the model branch adds it)")
        r = subprocess.run(["bash", "-c", step], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{step}\n{r.stdout}\n{r.stderr}"
        if step.startswith("fedhead train"):
            assert (tmp_path / "run" / "summary.json").is_file()
        if step.startswith("fedhead predict"):
            assert "accuracy" in r.stdout.lower()
    assert (tmp_path / "model.onnx").stat().st_size > 0


def test_citation_and_license_match_pyproject():
    yaml = pytest.importorskip("yaml")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["message"] and cff["authors"]
    assert cff["license"] == project["license"]["text"] == "Apache-2.0"
    assert cff["version"] == project["version"]
    titles = [r["title"] for r in cff["references"]]
    for seed in ("OvA-LP", "FedOVA", "FedABC", "Divide-and-Conquer"):
        assert any(t.startswith(seed) for t in titles), seed
    for ref in cff["references"]:
        assert ref["type"] and ref["authors"] and ref["year"], ref["title"]
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text


def test_docs_cite_the_examples_and_the_deployment_guide_from_their_one_copy():
    """The examples are shown verbatim (their tests execute the files); the deployment guide and the changelog are
    included from their files, not copied."""
    pages = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    for example in sorted((REPO / "fedhead" / "examples").glob("*.py")):
        shown = example.read_text().rstrip("\n") in pages or f'--8<-- "fedhead/examples/{example.name}"' in pages
        assert shown, example.name
    assert '--8<-- "fedhead/flower/DEPLOY.md"' in (REPO / "docs" / "deployment.md").read_text()
    assert '--8<-- "CHANGELOG.md"' in (REPO / "docs" / "changelog.md").read_text()
    assert '--8<-- "README.md:quickstart"' in (REPO / "docs" / "quickstart.md").read_text()


def test_mkdocs_nav_names_every_page():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text().split("\nhooks:")[0])

    def pages(nav):
        for item in nav:
            for value in item.values():
                yield from pages(value) if isinstance(value, list) else [value]

    listed = set(pages(config["nav"]))
    present = {p.name for p in (REPO / "docs").glob("*.md")}
    assert present <= listed, present - listed  # no page left out of the navigation
    assert {"model.md", "tracking.md"} <= listed  # the pages of `fedhead predict`/`export` and of tracking


def test_sphinx_roles_become_markdown_code_spans():
    """The API reference renders the docstrings as Markdown: docs/hooks.py rewrites their Sphinx roles (which would
    show as raw ``:func:`` text) into code spans, linked (mkdocs-autorefs, optional) where the target resolves."""
    md = _hooks().roles_to_markdown
    assert md("see :func:`~fedhead.core.linalg.clip_rows` and :class:`Head`.") == "see `clip_rows` and `Head`."
    assert md(":meth:`the solve <ClosedFormHead.solve>`, :attr:`!closed_form`, :py:mod:`.engine`") == (
        "`the solve`, `closed_form`, `engine`"
    )
    assert md(":data:`DRAW_ENV` :exc:`ValueError`", lambda target: None) == "`DRAW_ENV` `ValueError`"
    linked = md(":func:`~a.b.f`", lambda target: f"x.{target}")
    assert linked == '<autoref identifier="x.a.b.f" optional><code>f</code></autoref>'
    assert md("``literal`` and `code`") == "``literal`` and `code`"


def test_api_reference_docstrings_keep_no_sphinx_role():
    """Every docstring of the package as the API reference loads it (Griffe, with mkdocs.yml's extension): no role
    left, names resolved in the docstring's own scope."""
    griffe = pytest.importorskip("griffe")
    hooks = _hooks()
    assert "docs/hooks.py:SphinxRoles" in (REPO / "mkdocs.yml").read_text()
    pkg = griffe.load("fedhead", search_paths=[str(REPO)], extensions=griffe.load_extensions(hooks.SphinxRoles))
    left, todo, seen = [], [pkg], 0
    while todo:
        obj = todo.pop()
        if obj.docstring is not None:
            seen += 1
            left += [f"{obj.path}: {m.group(0)}" for m in hooks.ROLE.finditer(obj.docstring.value)]
        todo += [m for m in obj.members.values() if not m.is_alias]
    assert seen > 500 and not left, left
    doc = pkg["core.closedform.ClosedFormHead"].docstring.value
    assert '<autoref identifier="fedhead.core.closedform.ClosedFormHead.closed_form" optional>' in doc
    doc = pkg["scratch.algorithms"].docstring.value
    assert '<autoref identifier="fedhead.scratch.engine" optional><code>engine</code></autoref>' in doc
