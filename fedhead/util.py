"""Small shared helpers: atomic file writes, progress bars on stderr, device and thread choice, one writer
per output (:func:`exclusive_writer`), SIGINT/SIGTERM as exceptions (:func:`signals_raise`)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .errors import SPACE_ERRNOS, FedheadError

# ---------------------------------------------------------------- atomic files


def blocking_file(path: str | os.PathLike) -> Path | None:
    """The nearest existing ancestor of ``path`` if it is not a folder (a file in the way of creating
    ``path``'s parent folders), else None. Creates nothing."""
    for p in Path(path).parents:
        if p.is_dir():
            return None
        if p.exists() or p.is_symlink():
            return p
    return None


def make_parent_dirs(path: str | os.PathLike, param: str | None = None) -> list[Path]:
    """``mkdir -p`` of ``path``'s parent; a file in the way is a one-line error naming ``param`` (the option
    that gave ``path``). Returns the folders it created, innermost first (so that a caller can remove them
    again if nothing got written)."""
    path = Path(path)
    missing = []
    for p in path.parents:
        if p.is_dir():
            break
        missing.append(p)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        blocker = blocking_file(path) or Path(exc.filename or path.parent)
        if param:
            raise FedheadError(
                f"The '{param}' parameter names {str(path)!r}, below {str(blocker)!r}, which is a "
                f"file, not a folder. Choose another {param}."
            ) from None
        raise FedheadError(
            f"Cannot create the folder {str(path.parent)!r}: {str(blocker)!r} is a file, not a "
            "folder. Move it or choose another output."
        ) from None
    return missing


def remove_empty_dirs(dirs: list[Path]) -> None:
    """Remove the folders ``dirs`` (innermost first) while they are empty; others are left alone."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            break


def check_out(path: str | os.PathLike, param: str = "--out", kind: str = "file") -> Path:
    """Refuse, before any work, an output that cannot be written: ``path`` below a file, or an existing
    ``path`` of the wrong kind (a folder where a file is to be written, ``kind="file"``; a file where a folder
    is, ``kind="dir"``). Creates nothing; returns ``path`` as a Path."""
    path = Path(path)
    blocker = blocking_file(path)
    if blocker is not None:
        raise FedheadError(
            f"The '{param}' parameter names {str(path)!r}, below {str(blocker)!r}, which is a "
            f"file, not a folder. Choose another {param}."
        )
    if kind == "file" and path.is_dir():
        raise FedheadError(
            f"The '{param}' parameter names {str(path)!r}, which is a folder, not a file. Give {param} a file name."
        )
    if kind == "dir" and (path.exists() or path.is_symlink()) and not path.is_dir():
        raise FedheadError(
            f"The '{param}' parameter names {str(path)!r}, which is a file, not a folder. Choose another {param}."
        )
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path`` atomically."""
    path = Path(path)
    if path.is_dir():
        raise FedheadError(f"Cannot write {str(path)!r}: it is a folder. Move it or choose another output.")
    make_parent_dirs(path)
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


class _KeepWriteError:
    """A file wrapper for ``torch.save``: torch reports a failed write as a RuntimeError without the errno;
    this keeps the OSError so that it can be raised instead."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, b):
        try:
            return self.f.write(b)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self):
        return self.f.flush()


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file renamed onto ``path``; a failed write raises its OSError (ENOSPC,
    EFBIG, ...) and leaves nothing behind (the final name keeps its previous content)."""
    import torch

    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            w = _KeepWriteError(f)
            try:
                torch.save(obj, w)
            except RuntimeError:
                if w.error is not None:
                    raise w.error from None
                raise


def space_error(exc: OSError, where: str, resume: str) -> "FedheadError | None":
    """The one line for a write that failed for want of space (None for other errors)."""
    if exc.errno not in SPACE_ERRNOS:
        return None
    why = (exc.strerror or str(exc)).replace("\n", " ")
    return FedheadError(
        f"No space left while writing {where} ({why}); free space (or raise the file size limit) and {resume}."
    )


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
        disable=os.environ.get("FEDHEAD_NO_PROGRESS", "") not in ("", "0"),
    )


# ---------------------------------------------------------------- devices


def resolve_device(device: str):
    """``auto`` picks CUDA when available; ``cuda`` without a GPU is a one-line error."""
    import torch

    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise FedheadError(f"The '--device' parameter must be one of 'auto', 'cpu', 'cuda'. Got {device!r} instead.")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FedheadError(f"The '--device' parameter is {device!r} but no CUDA device is available. Use --device cpu.")
    return torch.device(device)


DENORMALS_ENV = "FEDHEAD_DENORMALS"  # "keep": leave subnormal arithmetic on (bench speed's comparison)
_FLUSH_STATE: dict = {}  # (thread, torch.get_num_threads()) -> whether every intra-op thread flushes


def _pool_flushes() -> bool:
    """Whether every intra-op thread flushes a subnormal result to zero, probed by values: normal numbers whose
    product is subnormal, in a tensor large enough to reach every thread, must multiply to exact zeros. (The
    result is read as integers: a float comparison would itself treat a subnormal as zero on a flushing thread.)"""
    import torch

    n = 65536 * max(1, torch.get_num_threads()) * 2
    x = torch.full((n,), 1e-30, dtype=torch.float32)
    return not bool(torch.mul(x, 1e-9).view(torch.int32).ne(0).any())


def _flush_omp_threads() -> None:
    """Set flush-to-zero on every thread of torch's OpenMP pool: a parallel region of libgomp (the runtime torch
    loaded) in which each thread sets its own floating-point control word. Threads started later copy the
    control word of the thread that starts them, so one call covers the pool as it grows."""
    import ctypes

    import torch

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and line.rstrip().endswith((".so", ".1"))}
    except OSError:
        return
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        callback_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        callback = callback_type(lambda _: torch.set_flush_denormal(True))
        lib.GOMP_parallel.argtypes = [callback_type, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        lib.GOMP_parallel.restype = None
        lib.GOMP_parallel(callback, None, 0, 0)


def flush_denormals() -> bool:
    """Flush subnormal floats to zero on this thread and on torch's intra-op threads (x86: FTZ and DAZ).

    A decaying optimizer state (squares of tiny gradients, momentum of classes a client never sees) falls into
    the subnormal range, which x86 CPUs compute about ten times slower: measured at paper scale, 2.9 s a round
    instead of 0.68 s. Flushed, such a number is 0, which a head's training cannot tell from it (an AdamW step
    divides by sqrt(v) + 1e-8; 1e-38 is far below both). The engines call this before they train; the setting
    stays for the process (as TensorFlow sets it on its own threads). Returns whether every thread flushes (False
    where the CPU has no such mode, or with ``FEDHEAD_DENORMALS=keep``, which leaves subnormals on for
    ``fedhead bench speed``'s comparison)."""
    import torch

    if os.environ.get(DENORMALS_ENV, "") == "keep":
        return False
    import threading

    key = (threading.get_ident(), torch.get_num_threads())  # each thread starts its own OpenMP pool
    if _FLUSH_STATE.get(key):
        return True
    if not torch.set_flush_denormal(True):
        _FLUSH_STATE[key] = False
        return False
    ok = _pool_flushes()
    if not ok:  # the pool started before this thread flushed: set it in each of its threads
        with contextlib.suppress(OSError, AttributeError):
            _flush_omp_threads()
        ok = _pool_flushes()
    _FLUSH_STATE[key] = ok
    return ok


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


def available_memory() -> int | None:
    """Bytes of memory this machine can still give (``MemAvailable`` on Linux; free pages elsewhere), or None when
    the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


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


# ---------------------------------------------------------------- one writer per output


_HELD_LOCKS: set[int] = set()  # descriptors of the exclusive_writer locks this process holds


def _forget_locks_in_child() -> None:
    """In a forked child (DataLoader workers, multiprocessing): close the inherited lock descriptors, so that
    the lock belongs to the process that took it alone and is released the moment that process dies."""
    for fd in list(_HELD_LOCKS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


def _lock_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f" (pid {text})" if text.isdigit() else ""


@contextlib.contextmanager
def exclusive_writer(target: str | os.PathLike, what: str | None = None, param: str = "--out") -> Iterator[Path]:
    """Make this process the only fedhead writer of ``target`` for the duration of the block.

    Takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<target>.lock`` (created beside ``target``, parent folders
    too) and writes this process's pid into it. If another process holds the lock, raises at once
    ``FedheadError("another fedhead process (pid N) is writing <what>; wait for it or choose another <param>")``
    (``what`` defaults to ``target``). Yields the lock file's path. On exit the lock file is removed and the
    lock released.

    Only the kernel's lock counts, never the file or the pid in it: the kernel releases a flock when the
    last descriptor of its holder closes, so a process killed by any signal (SIGKILL included) leaves at most
    a stale ``.lock`` file that the next writer simply takes over. (A holder that finds the file replaced or
    removed under it after locking, a race with a releasing holder, retries on the new file.)

    Advisory: it excludes only processes that call this helper for the same ``target``; a second call in the
    same process fails too (no re-entry). The lock is this process's alone: children forked inside the block
    (DataLoader workers) close their copy of the descriptor at once, and exec'd programs never get it, so a
    killed holder's lingering children cannot keep it.

    A file in the way of the lock's folder is a one-line error naming ``param``; folders created for the
    lock are removed again (if empty) when the block ends by an exception.
    """
    target = Path(target)
    lock = Path(str(target) + ".lock")
    what = what or str(target)
    created = make_parent_dirs(lock, param)  # a file in the way: the one-line error, nothing created
    try:
        fd = _take_lock(lock, target, what, param)
    except BaseException:
        remove_empty_dirs(created)
        raise
    _HELD_LOCKS.add(fd)
    failed = False
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield lock
    except BaseException:
        failed = True
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # still held here, so nobody else can be using this file
        _HELD_LOCKS.discard(fd)
        os.close(fd)
        if failed:  # refused or stopped: the folders made for the lock go again if nothing is in them
            remove_empty_dirs(created)


def _take_lock(lock: Path, target: Path, what: str, param: str) -> int:
    """Open and flock ``lock`` (see :func:`exclusive_writer`); returns the locked descriptor."""
    import fcntl

    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise FedheadError(
                f"The '{param}' parameter names {str(target)!r}, beside which fedhead cannot "
                f"create its lock file ({exc.strerror}). Choose another {param}."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise FedheadError(
                f"another fedhead process{holder} is writing {what}; wait for it or choose another {param}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            st, now = os.fstat(fd), os.stat(lock)
            current = (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)
        except FileNotFoundError:
            current = False
        if current:
            return fd
        os.close(fd)  # locked a file its previous holder had just removed: take the one now at that path


# ---------------------------------------------------------------- SIGINT / SIGTERM as exceptions


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
