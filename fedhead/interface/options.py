"""The typer options of the experiment's fields, derived from the table (:mod:`fedhead.federation.experiment`).

:func:`with_experiment_options` gives a command one option per field (flag ``--`` + the name with ``-`` for ``_``),
in the field's help panel, with its default shown (``[default: ...]``, escaped so rich markup cannot swallow
bracketed text), and the hidden aliases of renamed flags. The command receives the parsed values as one
:class:`ExperimentArgs`, which knows which options were given on the command line (so flags can override an
experiment file, ``--config``) and builds the :class:`~fedhead.federation.config.TrainConfig`.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import click
import typer
from click.core import ParameterSource
from rich.markup import escape

from fedhead.core.flwr_partitions import parse_partition_args
from fedhead.federation.api import resolved_run
from fedhead.federation.config import TrainConfig, load_experiment
from fedhead.federation.experiment import (
    FIELD_LIST,
    REQUIRED,
    RUN_OPTIONS,
    Field,
    check_transport,
    field_help,
    parse_pair,
    parse_seeds,
    plugin_fields,
)
from fedhead.infra.errors import FedheadError

UNSET = object()


def help_text(f: Field, default_text: str | None = None) -> str:
    """The field's help, escaped for rich markup, with its unit and default: ``... [default: 50]``."""
    text = escape(field_help(f))
    if f.unit:
        text += f" ({escape(f.unit)})"
    if tuple(f.transports) == ("flower",):
        text += " (Flower runs only)"
    elif tuple(f.transports) == ("in-process",):
        text += " (fedhead train and bench only)"
    return f"{text} \\[default: {escape(default_text or f.shown_default())}]"


def option(
    f: Field,
    *,
    default: Any = UNSET,
    default_text: str | None = None,
    hidden: bool = False,
    flag: str = "",
    panel: str | None | object = UNSET,
):
    """``(annotation, typer.Option)`` of field ``f`` (or a run option), for a command's signature; in the field's
    help panel unless ``panel`` says another (None: the command's own "Options")."""
    default = f.default if default is UNSET else default
    default = None if default is REQUIRED else default
    flag = flag or f.flag
    panel = f.group if panel is UNSET else panel
    kw = dict(help=help_text(f, default_text), show_default=False, rich_help_panel=panel, hidden=hidden)
    if f.type is bool:
        if default is None:
            return Optional[bool], typer.Option(None, f"{flag}/--no-{flag[2:]}", **kw)
        if default:  # on unless switched off: --plots/--no-plots
            return bool, typer.Option(True, f"{flag}/--no-{flag[2:]}", **kw)
        return bool, typer.Option(bool(default), flag, **kw)
    if f.type is list:  # seeds: repeated or comma-separated
        return Optional[List[str]], typer.Option(None, flag, metavar="INT[,INT...]", **kw)
    if f.type is tuple:  # server_betas: "b1,b2"
        return Optional[str], typer.Option(None, flag, metavar="B1,B2", **kw)
    if f.type is dict:  # partition_arg: repeated KEY=VALUE
        return Optional[List[str]], typer.Option(None, flag, metavar="KEY=VALUE", **kw)
    t = Path if f.name in ("features", "out") else f.type
    return (t if default is not None else Optional[t]), typer.Option(default, flag, **kw)


@dataclass
class ExperimentArgs:
    """The experiment options of one command invocation, parsed."""

    values: dict  # every experiment option's value (given or default), parsed: seeds a list of ints, betas a pair
    given: set  # the options given on the command line
    command_defaults: dict = field(default_factory=dict)  # this command's defaults that differ from the table's
    config: Path | None = None  # --config FILE
    print_config: bool = False  # --print-config

    def given_values(self) -> dict:
        return {n: self.values[n] for n in self.given}

    def fields(self) -> dict:
        """TrainConfig's keyword arguments: the command's own defaults, then the experiment file's values, then
        the options given on the command line."""
        kw = {n: v for n, v in self.command_defaults.items() if n in self.values}
        if self.config is not None:
            kw.update(load_experiment(self.config))
        kw.update(self.given_values())
        return kw

    def train_config(self, transport: str, **extra) -> TrainConfig:
        """The run these options (and ``--config``) describe; a field of another transport is refused."""
        kw = {**self.fields(), **extra}
        if kw.get("features") in (None, ""):
            raise FedheadError(
                "The '--features' parameter is required. Got none. Name a feature store written by "
                "'fedhead extract', or give --config FILE with features = \"PATH\"."
            )
        kw["features"] = str(kw["features"])
        cfg = TrainConfig(**kw)
        check_transport(cfg, transport)
        return cfg


def _parse(name: str, value: Any) -> Any:
    if value is None:
        return None
    if name == "seeds":
        return parse_seeds(value)
    if name == "server_betas":
        pair = parse_pair(value)
        if pair is None:
            raise FedheadError(
                f"The '--server-betas' parameter must be two numbers beta1,beta2. Got {value!r} instead. "
                "Example: --server-betas 0.9,0.99"
            )
        return pair
    if name == "features":
        return str(value)
    if name == "partition_arg":  # repeated KEY=VALUE: one dict (an empty list: not given)
        return parse_partition_args(value) or None
    return value


def _sources() -> dict | None:
    """name -> whether the option came from the command line (None outside a click invocation)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return None
    return {n: ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE for n in ctx.params}


def deprecated_flag(old: str, new: str, how: str = "") -> None:
    """The one deprecation line of a renamed flag (stderr: results stay on stdout)."""
    print(f"warning: '{old}' is deprecated; use '{new}'{how}.", file=sys.stderr)


def with_experiment_options(
    fn=None,
    *,
    names: list[str] | None = None,
    exclude: tuple = (),
    defaults: dict | None = None,
    run_options: tuple = (),
    config: bool = False,
    lead: tuple = (),
):
    """Give the typer command ``fn(<own options>, ..., experiment: ExperimentArgs)`` an option per experiment field
    (``names``, default all, minus ``exclude``; ``lead`` first, in the command's own panel), then the
    ``run_options`` (out, resume, ...; passed to ``fn`` by name), and with ``config`` the ``--config`` /
    ``--print-config`` options. They stand where ``experiment`` stands in ``fn``'s signature (own options after it
    follow them). ``defaults``: this command's own defaults, name -> value or (value, shown text)."""
    if fn is None:
        return functools.partial(
            with_experiment_options,
            names=names,
            exclude=exclude,
            defaults=defaults,
            run_options=run_options,
            config=config,
            lead=lead,
        )
    chosen = [f for f in FIELD_LIST if (names is None or f.name in names) and f.name not in exclude]
    if names is None:  # every field: the parameters of plugins' heads and partitions too (--gamma)
        chosen += [f for f in _plugin_fields() if f.name not in exclude]
    table = {f.name: f for f in chosen}
    chosen.sort(key=lambda f: lead.index(f.name) if f.name in lead else len(lead))
    own_defaults = {k: (v if isinstance(v, tuple) else (v, None)) for k, v in (defaults or {}).items()}
    params, aliases = _field_params(chosen, own_defaults, lead)
    for name in run_options:
        value, text = own_defaults.get(name, (UNSET, None))
        params.append((name, *option(RUN_OPTIONS[name], default=value, default_text=text)))
    if config:
        params += CONFIG_PARAMS
    signature = list(inspect.signature(fn, eval_str=True).parameters.values())
    at = next((i for i, p in enumerate(signature) if p.name == "experiment"), len(signature))
    kw_only = inspect.Parameter.KEYWORD_ONLY
    own = [
        (i, p.replace(kind=kw_only))
        for i, p in enumerate(signature)
        if p.name not in ("experiment", *run_options) and p.kind != inspect.Parameter.VAR_KEYWORD
    ]
    extra = [inspect.Parameter(n, kw_only, default=o, annotation=t) for n, t, o in params]
    ordered = [p for i, p in own if i < at] + extra + [p for i, p in own if i > at]
    names_here = [f.name for f in chosen]
    command_defaults = {n: v for n, (v, _) in own_defaults.items() if n in names_here and v is not UNSET}

    @functools.wraps(fn)
    def wrapper(**kw):
        sources = _sources()
        values = {n: kw.pop(n) for n in names_here}
        given = {n for n in names_here if (sources[n] if sources is not None else values[n] != table[n].default)}
        for alias, (f, old) in aliases.items():
            v = kw.pop(alias)
            if v is not None and (sources is None or sources.get(alias)):
                deprecated_flag(old, f.flag, " (repeated or comma-separated)" if f.type is list else "")
                values[f.name] = list(values[f.name] or []) + list(v) if f.type is list else v
                given.add(f.name)
        values = {n: _parse(n, v) for n, v in values.items()}
        parsed_defaults = {n: _parse(n, v) for n, v in command_defaults.items()}
        args = ExperimentArgs(values, given, parsed_defaults, kw.pop("config", None), kw.pop("print_config", False))
        return fn(**kw, experiment=args)

    wrapper.__signature__ = inspect.Signature(ordered)
    wrapper.__annotations__ = {p.name: p.annotation for p in ordered}
    if hasattr(wrapper, "__wrapped__"):
        del wrapper.__wrapped__
    return wrapper


def _plugin_fields() -> list[Field]:
    """:func:`~fedhead.federation.experiment.plugin_fields`; a plugin that cannot be loaded costs its flags only
    (the run that names it gets the one-line error)."""
    try:
        return plugin_fields()
    except FedheadError:
        return []


def _field_params(chosen: list[Field], own_defaults: dict, lead: tuple) -> tuple[list, dict]:
    """The (name, annotation, option) of each field, each followed by the hidden aliases of its old flags."""
    params, aliases = [], {}
    for f in chosen:
        value, text = own_defaults.get(f.name, (UNSET, None))
        panel = None if f.name in lead else UNSET
        params.append((f.name, *option(f, default=value, default_text=text, panel=panel)))
        for i, old in enumerate(f.old_flags):
            alias = f"deprecated_{f.name}_{i}"
            aliases[alias] = (f, old)
            params.append((alias, *option(f, default=None, hidden=True, flag=old)))
    return params, aliases


CONFIG_PARAMS = [
    (
        "config",
        Optional[Path],
        typer.Option(
            None,
            "--config",
            help="experiment file (TOML; keys = the options' names with _ for -); options given on the command line "
            "override its values \\[default: none]",
        ),
    ),
    (
        "print_config",
        bool,
        typer.Option(
            False,
            "--print-config",
            help="print the resolved experiment file on stdout and exit without training \\[default: off]",
        ),
    ),
]


def resolved_toml(cfg: TrainConfig) -> str:
    """``--print-config``: the experiment resolved as the run will be (recipe filled in, a closed-form head's
    switches as the trainer sets them), as an experiment file that runs it again."""
    return resolved_run(cfg).to_toml()
