"""Small shared helpers: atomic file writes, progress bars on stderr, device and thread choice."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .errors import FedheadError


# ---------------------------------------------------------------- atomic files


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


# ---------------------------------------------------------------- progress and console


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def stdout_console():
    """Results console; wide enough for the result tables when stdout is a pipe or a file."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def make_progress(transient: bool = False):
    """A rich progress bar on stderr (so stdout stays clean for results)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr_console(),
        transient=transient,
        disable=os.environ.get("FEDHEAD_NO_PROGRESS", "") not in ("", "0"),
    )


# ---------------------------------------------------------------- devices


def resolve_device(device: str):
    """``auto`` picks CUDA when available; ``cuda`` without a GPU is a one-line error."""
    import torch

    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise FedheadError(
            f"The '--device' parameter must be one of 'auto', 'cpu', 'cuda'. Got {device!r} instead."
        )
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FedheadError(
            f"The '--device' parameter is {device!r} but no CUDA device is available. Use --device cpu."
        )
    return torch.device(device)


def busy_cores(window: float = 0.1) -> float:
    """Cores that other processes keep busy right now: ``/proc/stat`` sampled ``window`` seconds apart (this
    process sleeps meanwhile), else the 1-minute load average. The load average alone lags by a minute, so
    a job started right after another one of ours took the finished job's core as busy."""
    import time

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v[:8]), v[3] + v[4]  # total and idle+iowait jiffies (user..steal)

    try:
        t0, i0 = sample()
        time.sleep(window)
        t1, i1 = sample()
        if t1 > t0:
            return (os.cpu_count() or 1) * (1.0 - (i1 - i0) / (t1 - t0))
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def set_cpu_threads(n: int | None = None) -> int:
    """Intra-op threads on CPU: ``n``, else ``FEDHEAD_THREADS`` if set, else the cores not already busy.

    OpenMP threads that must share cores with other busy processes wait on each other: measured here, a
    round took 2-4x longer with 2 threads than with 1 when the 2 cores were already loaded. So the default
    leaves out the cores that other processes use now (:func:`busy_cores`; at least one thread)."""
    import torch

    if n is None:
        n = int(os.environ.get("FEDHEAD_THREADS", "0"))
    if not n:
        cores = os.cpu_count() or 1
        n = max(1, cores - int(busy_cores() + 0.5))
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()
