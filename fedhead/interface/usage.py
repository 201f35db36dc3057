"""Click's usage errors (a value of the wrong type, a missing argument, an unknown option or command) as the
project's one line: ``error: <message> See '<command> --help'.`` on stderr, exit code 2.

Typer prints these as a multi-line rich panel below the usage line (or, with ``rich_markup_mode=None``, click
prints usage, a hint and the message on three lines); ``pretty_exceptions_enable=False`` only changes how an
uncaught exception's traceback is shown. The errors arise while click parses a command line, before any
command code runs (so :func:`fedhead.infra.exits.cli_errors` never sees them): :class:`OneLineGroup` and
:class:`OneLineCommand` catch them there, in ``parse_args`` (and, for a group, ``resolve_command``), and report
them through :func:`fedhead.infra.exits.report`. Help is untouched: ``--help`` and a group called without a command
still print the rich help.
"""

from __future__ import annotations

import re

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


class OneLineGroup(_OneLineParse, TyperGroup):
    """A typer group whose usage errors, and those of its commands, are one line (see the module docstring)."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            raise _one_line(exc) from None
