"""Click's usage errors (a value of the wrong type, a missing argument, an unknown option or command) as the
project's one line: ``error: <message> See '<command> --help'.`` on stderr, exit code 2.

Typer prints these as a multi-line rich panel below the usage line (or, with ``rich_markup_mode=None``, click
prints usage, a hint and the message on three lines); ``pretty_exceptions_enable=False`` only changes how an
uncaught exception's traceback is shown. The errors arise while click parses a command line, before any
command code runs (so :func:`fedhead.infra.exits.cli_errors` never sees them): :class:`OneLineGroup` and
:class:`OneLineCommand` catch them there, in ``parse_args`` (and, for a group, ``resolve_command``), and report
them through :func:`fedhead.infra.exits.report`. Help is untouched: ``--help`` and a group called without a command
still print the rich help.

A group's commands may be lazy (:func:`lazy_group`, click's "lazy loading subcommands"): the group lists them from a
table (name, the listing's help line, a function that builds the command) and imports a command's module only when
the command is resolved, so that ``fedhead --help``, ``fedhead bench --help`` and ``fedhead train --help`` import
neither the other commands nor what they need (torch).
"""

from __future__ import annotations

import re
from typing import Callable, ClassVar, Mapping, Optional

import click
from typer.core import TyperCommand, TyperGroup

from fedhead.infra.errors import FedheadError
from fedhead.infra.exits import report


def _one_line(exc: click.UsageError) -> SystemExit:
    # each sentence once (typer 0.20 with click 8.5 appends its "Did you mean ...?" to a command typo twice)
    msg = " ".join(dict.fromkeys(re.split(r"(?<=[.?!])\s+", exc.format_message().strip())))
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and ctx.command.get_help_option(ctx) is not None:
        end = "" if msg.endswith((".", "?", "!", ")")) else "."
        msg = f"{msg}{end} See '{ctx.command_path} {ctx.help_option_names[0]}'."
    report(FedheadError(msg))
    return SystemExit(exc.exit_code)


class _OneLineParse:
    """``parse_args`` reporting a usage error in one line (help requests pass through)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            raise _one_line(exc) from None


class OneLineCommand(_OneLineParse, TyperCommand):
    """A typer command whose usage errors are one line (see the module docstring)."""


# name -> (the help line the group's listing shows, a function that builds the command: None where it is missing)
LazyCommands = Mapping[str, tuple[str, Callable[[], Optional[click.Command]]]]


class _Unloaded(click.Command):
    """A lazy group's command before its module is imported: its name and the listing's help line."""

    def __init__(self, name: str, help: str, load: Callable[[], Optional[click.Command]]):
        super().__init__(name, help=help)
        self.load = load

    def invoke(self, ctx: click.Context):
        raise RuntimeError(f"the command {self.name!r} was invoked before it was loaded (resolve it with get_command)")


class OneLineGroup(_OneLineParse, TyperGroup):
    """A typer group whose usage errors, and those of its commands, are one line (see the module docstring).

    Its commands may be lazy: :attr:`lazy_commands` (set by :func:`lazy_group`) names them, in the listing's order,
    each with its help line and a function that builds it. Until one is resolved (:meth:`get_command`, which click
    calls to run it) the group holds a stand-in that only the help's listing sees; so the listing, the suggestions
    for a mistyped name and ``--help`` import nothing of the commands."""

    lazy_commands: ClassVar[Callable[[], LazyCommands]] = staticmethod(dict)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._listing = False
        given = dict(self.commands)  # the commands registered on the typer app (all of them for cli.app)
        self.commands.clear()
        for name, (text, load) in self.lazy_commands().items():
            self.commands[name] = given.pop(name) if name in given else _Unloaded(name, text, load)
        self.commands.update(given)  # the sub-groups (bench, flower) after the commands, as typer orders them

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        cmd = self.commands.get(cmd_name)
        if not isinstance(cmd, _Unloaded) or self._listing:
            return cmd
        real = cmd.load()  # imports the command's module
        if real is None:  # its module is missing (an optional part not installed)
            del self.commands[cmd_name]
        else:
            self.commands[cmd_name] = real
        return real

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._listing = True  # the listing takes the stand-ins' help lines: no command's module is imported
        try:
            return super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def resolve_command(self, ctx: click.Context, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            raise _one_line(exc) from None


def lazy_group(commands: Callable[[], LazyCommands]) -> type[OneLineGroup]:
    """A :class:`OneLineGroup` class (typer's ``cls=``) whose group lists ``commands()`` (called when typer builds
    the group) and imports each only when it is resolved; a command registered on the typer app itself is kept."""
    return type("LazyOneLineGroup", (OneLineGroup,), {"lazy_commands": staticmethod(commands)})
