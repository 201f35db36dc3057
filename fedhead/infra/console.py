"""Consoles and progress: progress bars and logs on stderr, results on stdout (so output can be piped)."""

from __future__ import annotations

import os


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def stdout_console():
    """Results console; wide enough for the result tables when stdout is a pipe or a file."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def make_progress(transient: bool = False, enabled: bool = True):
    """A rich progress bar on stderr (so stdout stays clean for results); ``enabled=False`` shows nothing."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr_console(),
        transient=transient,
        disable=not enabled or os.environ.get("FEDHEAD_NO_PROGRESS", "") not in ("", "0"),
    )
