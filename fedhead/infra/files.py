"""Atomic outputs: every file is written to a temporary name beside it and renamed; outputs that cannot be
written (a file in the way, a folder where a file goes) are refused before any work; a write that fails for want
of space becomes one line."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

from fedhead.infra.errors import SPACE_ERRNOS, FedheadError


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
def _atomic_fd(path: str | os.PathLike) -> Iterator[tuple[int, Path]]:
    """:func:`atomic_path` with the temporary file's descriptor: write through it (never reopen the name)."""
    path = Path(path)
    if path.is_dir():
        raise FedheadError(f"Cannot write {str(path)!r}: it is a folder. Move it or choose another output.")
    make_parent_dirs(path)
    # mkstemp opens O_CREAT | O_EXCL | O_NOFOLLOW (mode 0600): a name planted in the folder is never followed
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        yield fd, tmp
        _still_ours(fd, tmp, path)
        os.replace(tmp, path)
    finally:
        os.close(fd)
        if os.path.lexists(tmp):
            tmp.unlink()


def _still_ours(fd: int, tmp: Path, path: Path) -> None:
    """Refuse to rename ``tmp`` onto ``path`` unless the name still holds a regular file (a symlink swapped in while
    it was written would become the output). Writers that replace the name themselves (safetensors) are fine."""
    if not stat.S_ISREG(os.lstat(tmp).st_mode):
        raise FedheadError(
            f"The temporary file {str(tmp)!r} was replaced by a symlink or another kind of file while fedhead wrote "
            f"{str(path)!r} (someone else writes in that folder); nothing was written. Write the output to a folder "
            "only you can write."
        )


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (created ``O_EXCL | O_NOFOLLOW``, mode 0600); on success it is renamed
    onto ``path`` atomically, refused if the name no longer holds the file fedhead created."""
    with _atomic_fd(path) as (_, tmp):
        yield tmp


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``data`` to ``path`` atomically, written through the temporary file's own descriptor."""
    with _atomic_fd(path) as (fd, _):
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


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

    with _atomic_fd(path) as (fd, _):
        with os.fdopen(os.dup(fd), "wb") as f:
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


def name_inside(folder: str | os.PathLike, name: Any, where: str) -> Path:
    """``folder / name`` for a file name read from a file (a model card, a list): a relative path without ``..``
    that stays inside ``folder`` once symlinks are resolved, else a one-line error (``where`` names the file and
    the entry, e.g. ``"The model card 'x.json' (weights_file)"``)."""
    folder = Path(folder)
    bad = not isinstance(name, str) or not name or "\x00" in name
    if not bad:
        rel = Path(name)
        bad = rel.is_absolute() or ".." in rel.parts or rel.drive != ""
    if not bad:
        try:
            (folder / name).resolve().relative_to(folder.resolve())
        except (ValueError, OSError, RuntimeError):
            bad = True
    if bad:
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise FedheadError(
            f"{where} names {shown}, which is outside its folder {str(folder)!r} (absolute, '..', a symlink out, "
            "or not a file name); fedhead reads only files inside it. Put the file in that folder and name it "
            "relative to it."
        )
    return folder / name
