"""One writer per output: an advisory ``flock`` that the kernel releases when its holder dies."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Iterator

from fedhead.infra.errors import FedheadError
from fedhead.infra.files import make_parent_dirs, remove_empty_dirs

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

    The lock file is opened ``O_NOFOLLOW`` without ``O_TRUNC``: a symlink planted at its name is a one-line error
    naming it, and a file there that fedhead did not make (not a regular file, hard-linked, more than a pid) is
    refused and left as it is, never truncated.
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


_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
MAX_LOCK_BYTES = 32  # a lock file holds its holder's pid and a newline


def _check_lock_file(fd: int, lock: Path, target: Path, param: str) -> None:
    """Refuse a ``lock`` that fedhead did not make (it is truncated and removed later): not a regular file, a file
    with other names (a hard link), or one holding more than a pid."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > MAX_LOCK_BYTES:
        why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"a file with {st.st_nlink} names" if st.st_nlink != 1 else f"{st.st_size} bytes, more than a pid")  # fmt: skip
        raise FedheadError(
            f"The lock file {str(lock)!r} of '{param}' {str(target)!r} is not a fedhead lock file ({why}); "
            f"fedhead leaves it as it is. Remove it or choose another {param}."
        )


def _take_lock(lock: Path, target: Path, what: str, param: str) -> int:
    """Open and flock ``lock`` (see :func:`exclusive_writer`); returns the locked descriptor."""
    import fcntl

    while True:
        try:  # never through a symlink, never truncated here, never blocking on a planted FIFO
            fd = os.open(lock, _LOCK_FLAGS, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FedheadError(
                    f"The lock file {str(lock)!r} of '{param}' {str(target)!r} is a symlink; fedhead does not "
                    f"write through it. Remove it (it is not fedhead's) or choose another {param}."
                ) from None
            raise FedheadError(
                f"The '{param}' parameter names {str(target)!r}, beside which fedhead cannot "
                f"create its lock file ({exc.strerror}). Choose another {param}."
            ) from None
        try:
            _check_lock_file(fd, lock, target, param)
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
