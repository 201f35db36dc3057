"""The command line's help imports no torch: ``fedhead --help``, ``fedhead bench --help`` and ``fedhead flower
--help`` list their commands from cli.py's COMMANDS table without importing a command module (the listing's help
lines are the table's, held equal to the commands' docstrings here), and ``fedhead train --help`` builds its options
from the experiment table whose registries (heads, aggregators, ...) import torch only on first use
(fedhead.infra.lazy). Each check runs in a fresh interpreter, since the suite's own process has torch already."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import cli
from fedhead.infra.lazy import LazyModule, lazy_module, on_import
from fedhead.interface.usage import OneLineCommand, lazy_group

REPO = Path(__file__).resolve().parents[1]

# runs cli.main() on the arguments given, then reports (on stderr's last line) the exit code, whether torch was
# imported and the registered heads (importing fedhead.core after the check: it imports no torch either)
MAIN = """
import json, sys
import cli
sys.argv = ["fedhead", *sys.argv[1:]]
code = 0
try:
    cli.main()
except SystemExit as exc:
    code = exc.code
torch = "torch" in sys.modules
import fedhead.core
from fedhead.core.heads import HEADS
print(json.dumps({"code": code, "torch": torch, "heads": sorted(HEADS)}), file=sys.stderr)
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "1000", "NO_COLOR": "1", "TERM": "dumb", "PYTHONPATH": str(REPO)}
    env.pop("FEDHEAD_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )


def _main(*argv: str) -> tuple[str, str, dict]:
    r = _python(MAIN, *argv)
    assert r.returncode == 0, r.stderr[-3000:]
    *err, report = r.stderr.rstrip("\n").split("\n")
    return r.stdout, "\n".join(err), json.loads(report)


def _listed(out: str) -> list[str]:
    """The command names of a help's Commands panel, in order."""
    panel = out.split("Commands ", 1)[1]
    names = []
    for line in panel.splitlines():
        cell = line.lstrip("│|").strip()
        if line.startswith(("│ ", "| ")) and line[2:3] != " " and cell:
            names.append(cell.split()[0])
    return names


def _table(group):
    return [name for _, _, name, g, _ in cli.COMMANDS if g == group]


@pytest.mark.parametrize(
    "argv, listed",
    [
        (["--help"], _table(None) + ["bench", "flower"]),
        (["bench", "--help"], _table("bench")),
        (["flower", "--help"], _table("flower")),
        (["bench"], _table("bench")),  # a group without a command prints its help too
    ],
)
def test_group_help_lists_every_command_without_importing_them(argv, listed):
    out, err, rep = _main(*argv)
    assert rep["code"] in (0, 2), err  # click exits 2 for a group called without a command (no_args_is_help)
    text = out + err
    assert _listed(text) == listed
    assert not rep["torch"], "the help imported torch"
    for name in listed:  # each listing line is the table's help (the test below holds it to the docstring)
        helps = [h for _, _, n, g, h in cli.COMMANDS if n == name and g == (None if argv[0] == "--help" else argv[0])]
        for h in helps:
            assert " ".join(h.split()[:6]) in " ".join(text.split())


def test_train_help_imports_no_torch_and_lists_every_head():
    out, err, rep = _main("train", "--help")
    assert rep["code"] == 0, err
    assert not rep["torch"], "fedhead train --help imported torch"
    assert "--head" in out and "--aggregate" in out and "--server-opt" in out
    head_line = " ".join(line for line in out.splitlines() if "--head " in line)
    assert rep["heads"] and all(name in out for name in rep["heads"]), (rep["heads"], head_line)


def test_mistyped_command_is_one_line_with_suggestion_and_no_torch():
    r = _python(MAIN, "trian")
    *err, report = r.stderr.rstrip("\n").split("\n")
    rep = json.loads(report)
    assert rep["code"] == 2 and not rep["torch"]
    assert err == ["error: No such command 'trian'. Did you mean 'train'? See 'fedhead --help'."]
    r = _python(MAIN, "bench", "ablaton")
    *err, _ = r.stderr.rstrip("\n").split("\n")
    assert err == ["error: No such command 'ablaton'. Did you mean 'ablation'? See 'fedhead bench --help'."]


def test_core_experiment_and_commands_import_no_torch_until_used():
    code = """
import sys
import fedhead.core, fedhead.federation.experiment, fedhead.interface.options, fedhead.commands
print("torch" in sys.modules)
from fedhead.core import closedform, engine, heads, moments
from fedhead.core.heads import LossContext, create_head
from fedhead.federation import export
proxy = heads.torch
print("torch" in sys.modules, type(proxy).__name__, type(heads.F).__name__)
logits = proxy.randn(3, 5, 4, requires_grad=True)  # the first use imports torch
y = proxy.randint(0, 4, (3, 5))
c = proxy.ones(3, 4)
loss = create_head("ova2").loss(logits, y, proxy.ones(3, 5), LossContext(2, c > 0, c, proxy.rand(3, 5)))
loss.sum().backward()
import torch
import torch.nn.functional
print(bool(torch.isfinite(logits.grad).all()), "randn" in vars(proxy), proxy.randn is torch.randn)
print(heads.torch is torch, engine.torch is torch, heads.F is torch.nn.functional)  # the globals hold torch now
print(closedform.F64 is torch.float64, moments.F64 is torch.float64)
print(issubclass(export.ImageClassifier, torch.nn.Module))
"""
    r = _python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False", "False", "LazyModule", "LazyModule"] + ["True"] * 9


def test_table_help_is_the_first_paragraph_of_each_commands_docstring():
    """The listing's help lines (cli.COMMANDS, shown without importing the commands) cannot drift from the
    commands' docstrings: each is the first paragraph of the real command's help, its lines joined."""
    root = typer.main.get_command(cli.app)  # every command registered (imports every module)
    for module, attr, name, group, text in cli.COMMANDS:
        cmd = (root if group is None else root.commands[group]).commands[name]
        first = inspect.cleandoc(cmd.help or "").split("\n\n")[0]
        assert text == " ".join(first.split()), f"cli.COMMANDS' help of {group or 'fedhead'} {name} ({module}.{attr})"


def test_missing_module_is_skipped():
    ghost = ("fedhead.no_such_module", "ghost_cmd", "ghost", None, "Not installed.")
    assert not cli._installed(ghost[0]) and cli._build(*ghost[:3]) is None
    assert "ghost" not in cli._commands_of(None) and "train" in cli._commands_of(None)


def test_lazy_group_builds_a_command_only_when_it_is_resolved():
    built = []

    def hello(name: str = typer.Option("you", help="who")):
        """Say hello.

        More text."""
        typer.echo(f"hello {name}")

    def load_hello():
        built.append("hello")
        one = typer.Typer(add_completion=False)
        one.command("hello", cls=OneLineCommand)(hello)
        return typer.main.get_command(one)

    table = {"hello": ("Say hello.", load_hello), "gone": ("Not installed.", lambda: None)}
    app = typer.Typer(cls=lazy_group(lambda: table), add_completion=False)

    @app.callback()
    def _root():
        pass

    runner = CliRunner()
    res = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "Say hello." in res.output and "gone" in res.output and built == []
    res = runner.invoke(app, ["hello", "--name", "fedhead"])
    assert res.exit_code == 0 and res.output == "hello fedhead\n" and built == ["hello"]
    res = runner.invoke(app, ["gone"])
    assert res.exit_code == 2 and "No such command 'gone'" in res.output


def test_lazy_module_imports_on_first_use_and_keeps_attributes(tmp_path, monkeypatch):
    (tmp_path / "fh_lazy_probe.py").write_text("VALUE = 41\nimport sys\nIMPORTS = sys.modules.get('fh_lazy_seen', 0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fh_lazy_probe", raising=False)
    seen = []
    on_import("fh_lazy_probe", lambda m: seen.append(m.VALUE))
    proxy = lazy_module("fh_lazy_probe")
    assert isinstance(proxy, LazyModule) and "fh_lazy_probe" not in sys.modules and seen == []
    assert proxy.VALUE == 41 and "fh_lazy_probe" in sys.modules and seen == [41]
    assert vars(proxy)["VALUE"] == 41  # kept on the proxy: the next read is a plain attribute lookup
    with pytest.raises(AttributeError):
        getattr(proxy, "MISSING")  # noqa: B009
    assert lazy_module("fh_lazy_probe") is sys.modules["fh_lazy_probe"]  # already imported: the module itself
    on_import("fh_lazy_probe", lambda m: seen.append(-m.VALUE))  # already imported: runs at once
    assert seen == [41, -41]
    monkeypatch.delitem(sys.modules, "fh_lazy_probe")
