"""The ``fedhead`` command line. This file only registers commands; they live in their modules."""

from __future__ import annotations

import typer

from fedhead import __version__
from fedhead.infra.errors import enter_cli_names
from fedhead.interface.usage import OneLineCommand, OneLineGroup  # click usage errors as one 'error:' line

app = typer.Typer(
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


@app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print fedhead's version and exit."
    ),
) -> None:
    # every command's errors name the flags ('--lr'), where the Python API names the fields ('lr')
    ctx.call_on_close(enter_cli_names())


def _register() -> None:
    import importlib

    # (module, attribute, command name, typer app); a module that is missing is skipped so that the
    # core commands work while optional parts are absent.
    commands = [
        ("extract.commands", "extract_cmd", "extract", app),
        ("extract.commands", "info_cmd", "info", app),
        ("fedhead.commands", "train_cmd", "train", app),
        ("fedhead.commands", "compare_cmd", "compare", app),
        ("fedhead.commands", "synth_cmd", "synth", app),
        ("fedhead.commands", "demo_cmd", "demo", app),
        ("fedhead.deploy", "predict_cmd", "predict", app),
        ("fedhead.deploy", "export_cmd", "export", app),
        ("fedhead.scratch.commands", "scratch_cmd", "scratch", app),
        ("extract.bench", "bench_extract_cmd", "extract", bench_app),
        ("fedhead.bench.commands", "ablation_cmd", "ablation", bench_app),
        ("fedhead.bench.commands", "partitions_cmd", "partitions", bench_app),
        ("fedhead.bench.commands", "encoders_cmd", "encoders", bench_app),
        ("fedhead.bench.commands", "noise_cmd", "noise", bench_app),
        ("fedhead.bench.commands", "participation_cmd", "participation", bench_app),
        ("fedhead.bench.commands", "geometry_cmd", "geometry", bench_app),
        ("fedhead.bench.baselines", "baselines_cmd", "baselines", bench_app),
        ("fedhead.bench.privacy", "privacy_cmd", "privacy", bench_app),
        ("fedhead.bench.papers", "papers_cmd", "papers", bench_app),
        ("fedhead.bench.speed", "speed_cmd", "speed", bench_app),
        ("fedhead.flower.commands", "simulate_cmd", "simulate", flower_app),
        ("fedhead.flower.commands", "superlink_cmd", "superlink", flower_app),
        ("fedhead.flower.commands", "supernode_cmd", "supernode", flower_app),
        ("fedhead.flower.commands", "bench_cmd", "flower", bench_app),
        ("fedhead.flower.churn", "deploy_cmd", "deploy", bench_app),
    ]
    for module, attr, name, target in commands:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
                continue
            raise
        fn = getattr(mod, attr, None)
        if fn is not None:
            target.command(name, cls=OneLineCommand)(fn)
    app.add_typer(bench_app, name="bench")
    app.add_typer(flower_app, name="flower")


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
