"""The ``fedhead`` command line. This file only registers commands; they live in their modules, and a command run
from the shell imports only its own (:func:`main`)."""

from __future__ import annotations

import typer

from fedhead import __version__
from fedhead.infra.errors import enter_cli_names
from fedhead.interface.usage import OneLineCommand, OneLineGroup  # click usage errors as one 'error:' line

_app = typer.Typer(
    name="fedhead",
    help="Federated fine-tuning of linear heads on frozen foundation-model features (OvA-LP).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=OneLineGroup,
)
bench_app = typer.Typer(
    help="Benchmarks that reproduce the papers' experiments and measure speed.", no_args_is_help=True, cls=OneLineGroup
)
flower_app = typer.Typer(
    help="Real federation on Flower (needs the 'fedhead\\[flower]' extra).", no_args_is_help=True, cls=OneLineGroup
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"fedhead {__version__}")
        raise typer.Exit()


@_app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print fedhead's version and exit."
    ),
) -> None:
    # every command's errors name the flags ('--lr'), where the Python API names the fields ('lr')
    ctx.call_on_close(enter_cli_names())


# (module, attribute, command name, group): every command; a module that is missing is skipped so that the core
# commands work while optional parts are absent.
COMMANDS = [
    ("extract.commands", "extract_cmd", "extract", None),
    ("extract.commands", "info_cmd", "info", None),
    ("fedhead.commands", "train_cmd", "train", None),
    ("fedhead.commands", "compare_cmd", "compare", None),
    ("fedhead.commands", "synth_cmd", "synth", None),
    ("fedhead.commands", "demo_cmd", "demo", None),
    ("fedhead.deploy", "predict_cmd", "predict", None),
    ("fedhead.deploy", "export_cmd", "export", None),
    ("fedhead.scratch.commands", "scratch_cmd", "scratch", None),
    ("extract.bench", "bench_extract_cmd", "extract", "bench"),
    ("fedhead.bench.commands", "ablation_cmd", "ablation", "bench"),
    ("fedhead.bench.commands", "partitions_cmd", "partitions", "bench"),
    ("fedhead.bench.commands", "encoders_cmd", "encoders", "bench"),
    ("fedhead.bench.commands", "noise_cmd", "noise", "bench"),
    ("fedhead.bench.commands", "participation_cmd", "participation", "bench"),
    ("fedhead.bench.commands", "geometry_cmd", "geometry", "bench"),
    ("fedhead.bench.baselines", "baselines_cmd", "baselines", "bench"),
    ("fedhead.bench.privacy", "privacy_cmd", "privacy", "bench"),
    ("fedhead.bench.papers", "papers_cmd", "papers", "bench"),
    ("fedhead.bench.speed", "speed_cmd", "speed", "bench"),
    ("fedhead.bench.tune", "tune_cmd", "tune", "bench"),
    ("fedhead.flower.commands", "simulate_cmd", "simulate", "flower"),
    ("fedhead.flower.commands", "superlink_cmd", "superlink", "flower"),
    ("fedhead.flower.launch", "supernode_cmd", "supernode", "flower"),
    ("fedhead.flower.commands", "bench_cmd", "flower", "bench"),
    ("fedhead.flower.churn", "deploy_cmd", "deploy", "bench"),
]
_GROUPS = {None: _app, "bench": bench_app, "flower": flower_app}
_registered: set = set()


def wanted(argv: list[str]) -> tuple | None:
    """The (group, command) that ``argv`` (without the program) runs, or None when it names none of them (help,
    --version, a group's help, a typo: then every command is registered, for the listing or the error)."""
    if not argv or argv[0].startswith("-"):
        return None
    group = argv[0] if argv[0] in ("bench", "flower") else None
    if group and (len(argv) < 2 or argv[1].startswith("-")):
        return None
    name = argv[1] if group else argv[0]
    return (group, name) if any(c[3] == group and c[2] == name for c in COMMANDS) else None


def _register(only: tuple | None = None) -> None:
    """Register the command ``only`` (group, name), importing its module alone (a SuperNode's ``fedhead flower
    supernode`` then starts without torch), or every command (None). Each command is registered once."""
    import importlib

    for module, attr, name, group in COMMANDS:
        if (only is not None and (group, name) != only) or (group, name) in _registered:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
                continue
            raise
        fn = getattr(mod, attr, None)
        if fn is not None:
            _GROUPS[group].command(name, cls=OneLineCommand)(fn)
            _registered.add((group, name))


_app.add_typer(bench_app, name="bench")
_app.add_typer(flower_app, name="flower")


def __getattr__(name: str):
    """``cli.app``: the command line with every command registered (tests, ``typer.testing.CliRunner``)."""
    if name == "app":
        _register()
        return _app
    raise AttributeError(f"module 'cli' has no attribute {name!r}")


def main() -> None:
    import sys

    if sys.argv[1:] != ["--version"]:
        _register(wanted(sys.argv[1:]))
    _app()


if __name__ == "__main__":
    main()
