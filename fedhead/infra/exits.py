"""Exceptions become exits: one line on stderr and an exit code for every command (:func:`cli_errors`).

A :class:`fedhead.infra.errors.FedheadError` becomes ``error: <message>`` with exit code 2 (subclasses set their
own ``exit_code`` and ``prefix``: :class:`fedhead.infra.signals.Interrupted` exits 130/143 with no prefix); any
other exception becomes one line with exit code 1. SIGINT and SIGTERM become
:class:`~fedhead.infra.signals.Interrupted` inside a command (commands re-raise it saying how to resume). With
``FEDHEAD_DEBUG=1`` the original traceback is shown instead.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

from fedhead.infra.errors import SPACE_ERRNOS, FedheadError, cli_names
from fedhead.infra.signals import signals_raise


def debug_enabled() -> bool:
    return os.environ.get("FEDHEAD_DEBUG", "") not in ("", "0", "false", "no")


def report(exc: BaseException) -> int:
    """Print one line for ``exc`` on stderr and return the exit code to use."""
    if isinstance(exc, FedheadError):
        line = str(exc).replace("\n", " ")
        print(f"{exc.prefix}{line}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        print("interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    if isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS:
        where = f" {exc.filename!r}" if exc.filename else ""
        print(
            f"error: No space left while writing{where} ({exc.strerror}); free space (or raise the file size "
            "limit) and re-run the same command: finished work is reused",
            file=sys.stderr,
        )
        return 2
    if isinstance(exc, MemoryError):
        print("error: out of memory; lower --batch-size or --block-clients, or use a smaller store", file=sys.stderr)
        return 1
    line = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    print(f"internal error: {line} (set FEDHEAD_DEBUG=1 for the traceback)", file=sys.stderr)
    return 1


def cli_errors(fn: Callable) -> Callable:
    """Decorate a typer command: map exceptions to one line and an exit code; messages name the flags
    (:func:`~fedhead.infra.errors.cli_names`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with signals_raise(), cli_names():  # SIGINT/SIGTERM -> Interrupted: exit 130/143 with one line
                return fn(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - this is the one place exceptions become exits
            if debug_enabled():
                raise
            code = report(exc)
            raise SystemExit(code) from None

    return wrapper
