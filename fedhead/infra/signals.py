"""SIGINT and SIGTERM as exceptions at consistent points, and the test hook that pauses a job mid-way."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from fedhead.infra.errors import FedheadError


class Interrupted(FedheadError):
    """SIGINT or SIGTERM, raised by :func:`signals_raise`. ``signum`` is the signal; ``exit_code`` is
    128 + signum (130 for SIGINT, 143 for SIGTERM), the shell's convention. ``cli_errors`` prints the
    message as is (no ``error:`` prefix) and exits with ``exit_code``; commands re-raise it with a message
    that says how to resume, e.g. ``raise Interrupted(exc.signum, "interrupted; re-run ...") from None``."""

    prefix = ""

    def __init__(self, signum: int, message: str | None = None):
        import signal

        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(
            message
            or f"interrupted by {signal.Signals(self.signum).name}; nothing half-written is "
            "left: re-run the same command"
        )


class _SignalState:
    """Process-wide, as signal handlers are: how deep inside :func:`signals_deferred` the main thread is,
    and a signal that arrived there and waits for the block's end."""

    depth = 0
    pending: int | None = None


def _raise_interrupted(signum, frame):
    if _SignalState.depth > 0:
        _SignalState.pending = signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_raise(signums: tuple = ()) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM (or ``signums``) raise :class:`Interrupted` in the main thread.

    Python runs the handler between bytecodes, so a C call in progress (a forward, an HDF5 write) completes
    first; inside :func:`signals_deferred` the exception waits for that block's end. The previous handlers
    are restored on exit. Outside the main thread it changes nothing (Python delivers signals there only).
    Child processes forked inside inherit the handlers: reset them with :func:`worker_signals`."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = signums or (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, _raise_interrupted) for s in signums}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """A critical section for :func:`signals_raise`: a SIGINT/SIGTERM arriving inside raises
    :class:`Interrupted` when the (outermost) block ends, also when it ends by another exception, which then
    becomes the interrupt's ``__context__``."""
    _SignalState.depth += 1
    try:
        yield
    finally:
        _SignalState.depth -= 1
        if _SignalState.depth == 0 and _SignalState.pending is not None:
            signum, _SignalState.pending = _SignalState.pending, None
            raise Interrupted(signum)


def worker_signals(*_args) -> None:
    """``worker_init_fn`` for DataLoader workers forked inside :func:`signals_raise`: ignore SIGINT (a
    Ctrl-C reaches the whole process group; the main process handles it and stops its workers)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


ROUNDS_PAUSE_ENV = "FEDHEAD_TEST_PAUSE_AFTER_ROUNDS"  # test hook "k:FILE": after the k-th round (or job), pause


def pause_hook(env: str, count: int) -> None:
    """Test hook: with ``env="k:FILE"`` set, when ``count == k`` write this pid into FILE and sleep (up to 10
    minutes) until a signal arrives, so a test can signal a run that is surely mid-way (extraction batches:
    ``FEDHEAD_TEST_PAUSE_AFTER_BATCHES``; training rounds: ``FEDHEAD_TEST_PAUSE_AFTER_ROUNDS``)."""
    import time

    spec = os.environ.get(env, "")
    if not spec:
        return
    k, _, marker = spec.partition(":")
    if k.isdigit() and count == int(k):
        Path(marker).write_text(f"{os.getpid()}\n")
        for _ in range(6000):  # a signal raises here (main thread) or sets the stop flag
            if _StopFlag.event.is_set():
                break
            time.sleep(0.1)


class _StopFlag:
    """Set by :func:`signals_flag`'s handlers; read by :func:`raise_if_stopped` in any thread."""

    import threading as _threading

    event = _threading.Event()
    signum: int | None = None


def _set_stop_flag(signum, frame):
    _StopFlag.signum = signum
    _StopFlag.event.set()


@contextlib.contextmanager
def signals_flag() -> Iterator[None]:
    """For work that runs outside the main thread (Flower's simulation runs the ServerApp in a thread while
    the main thread drives Ray): SIGINT/SIGTERM only set a flag, which that work checks at a consistent point
    with :func:`raise_if_stopped`. Install after any library that sets its own handlers (Ray aborts the
    process on SIGTERM); the previous handlers are restored on exit."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _StopFlag.event.clear()
    old = {s: signal.signal(s, _set_stop_flag) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def raise_if_stopped() -> None:
    """Raise :class:`Interrupted` if a signal arrived under :func:`signals_flag` (and clear the flag)."""
    if _StopFlag.event.is_set():
        _StopFlag.event.clear()
        raise Interrupted(_StopFlag.signum or 15)
