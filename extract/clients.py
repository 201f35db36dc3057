"""Natural clients: the client each training image belongs to, recorded in the store at extraction.

Three sources, one at a time (``fedhead extract``):

* ``--client-folders``: the image folder is ``train/<client>/<class>/<file>`` (the test split may be
  ``test/<class>/<file>`` or nested the same way; its clients are not recorded);
* ``--clients-csv FILE``: a CSV file whose rows map an image file to its client (``file,client``; a first
  row ``file,client`` is a header). ``file`` is the path relative to ``--data-dir``
  (``train/cat/1.png``), relative to the train folder (``cat/1.png``) or the bare file name when that is
  unique; every training image needs a row;
* ``--client-pattern REGEX``: a regular expression with a named group ``client``, searched in each
  training file's name (``re.search``); ``'^(?P<client>[^_]+)_'`` takes Speech Commands' speaker id. For
  ``--dataset webdataset`` it is searched in each record's key (its last part);
* ``--client-column NAME``: a column of the table or file list (``--dataset parquet``, ``hf-disk``, ``filelist``,
  :mod:`extract.formats`), read by the dataset's loader.

Client ids are the sorted client names' indices (``train/clients`` int64 and ``client_names`` in the store,
see :mod:`extract.store`); ``--partition natural`` makes one federated client per id.
"""

from __future__ import annotations

import csv
import hashlib
import re
from pathlib import Path

import numpy as np

from extract import datasets as D
from extract import formats as F
from fedhead.infra.devices import check_budget
from fedhead.infra.errors import FedheadError

SOURCES = ("--client-folders", "--clients-csv", "--client-pattern", "--client-column")
FOLDERS_LAYOUT = "<data-dir>/train/<client>/<class>/*.jpg and <data-dir>/test/<class>/*.jpg"
CSV_INFLATE = 8  # memory per byte of a clients CSV once read (two strings and a dict entry per short row)


def check_sources(folders: bool, csv_path, pattern, column: str | None = None) -> str | None:
    """The one source of client ids given (its flag), None if none; refuses two at once in one line."""
    given = [f for f, v in zip(SOURCES, (folders, csv_path, pattern, column)) if v]
    if len(given) > 1:
        raise FedheadError(
            f"The '{given[1]}' parameter cannot be combined with {given[0]}: a store records one client per "
            f"image, from one source. Got both. Keep one of {', '.join(SOURCES)}."
        )
    if pattern is not None:
        compile_pattern(pattern)
    return given[0] if given else None


def compile_pattern(pattern: str) -> re.Pattern:
    """``--client-pattern`` compiled; one line if it is not a regular expression with a group ``client``."""
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise FedheadError(
            f"The '--client-pattern' parameter must be a regular expression. Got {pattern!r} instead ({exc}). "
            "Use e.g. '^(?P<client>[^_]+)_'."
        ) from None
    if "client" not in rx.groupindex:
        raise FedheadError(
            f"The '--client-pattern' parameter must have a named group 'client'. Got {pattern!r} instead. "
            "Use e.g. '^(?P<client>[^_]+)_' (the client is what the group matches)."
        )
    return rx


def client_folders(data_dir: Path, split: str, *, rgb: bool = True) -> D.ImageSplit:
    """The ``--client-folders`` layout: ``train/<client>/<class>/<file>``; the test split ``test/<class>/<file>``
    or nested the same way. Classes are the sorted class folder names over every client; the train split carries
    each image's client name (``split.clients``)."""
    data_dir = Path(data_dir) if data_dir is not None else None
    tr = data_dir / "train" if data_dir is not None else None
    if tr is None or not tr.is_dir() or not (data_dir / split).is_dir():
        raise _layout(data_dir, f"no {'train' if tr is None or not tr.is_dir() else split}/ folder")
    clients = sorted(p.name for p in tr.iterdir() if p.is_dir())
    classes = sorted({c.name for k in clients for c in (tr / k).iterdir() if c.is_dir()})
    if not classes:
        raise _layout(data_dir, "train/ has no <client>/<class>/ folders")
    folder = data_dir / split
    tops = sorted(p.name for p in folder.iterdir() if p.is_dir())
    nested = split == "train" or any(p not in classes for p in tops)
    groups = [(k, folder / k) for k in tops] if nested else [(None, folder)]
    paths, labels, owners = [], [], []
    for client, root in groups:
        extra = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in classes)
        if extra:
            raise _layout(data_dir, f"{split}/{client + '/' if client else ''} has classes missing from train/: "
                          f"{extra[:3]}")  # fmt: skip
        for c, cls in enumerate(classes):
            if (root / cls).is_dir():
                files = D.images_in(root / cls)
                paths += files
                labels += [c] * len(files)
                owners += [client] * len(files)
    if not paths:
        raise _layout(data_dir, f"{split}/ has no image files")
    out = D.ImageSplit("imagefolder", split, np.asarray(labels, dtype=np.int64), classes, paths=paths, rgb=rgb)
    if split == "train":
        out.clients = np.asarray(owners, dtype=object)
    return out


def _layout(data_dir, problem: str) -> FedheadError:
    return FedheadError(
        f"The '--data-dir' parameter {str(data_dir)!r} does not hold client folders ({problem}). "
        f"Expected layout with --client-folders: {FOLDERS_LAYOUT}."
    )


def from_pattern(paths: list[str], pattern: str) -> np.ndarray:
    """Each file's client: what the group ``client`` of ``pattern`` matches in its file name."""
    rx = compile_pattern(pattern)
    names = []
    for p in paths:
        m = rx.search(Path(p).name)
        if m is None or not m.group("client"):
            bad = sum(1 for q in paths if (mm := rx.search(Path(q).name)) is None or not mm.group("client"))
            raise FedheadError(
                f"The '--client-pattern' parameter {pattern!r} does not match the training file {Path(p).name!r} "
                f"({bad} of {len(paths)} files unmatched). Use a pattern whose group 'client' matches every "
                "training file's name."
            )
        names.append(m.group("client"))
    return np.asarray(names, dtype=object)


def _read_csv(csv_path: Path) -> dict[str, str]:
    if not Path(csv_path).is_file():
        raise FedheadError(
            f"The '--clients-csv' parameter names {str(csv_path)!r}, which is not a file. "
            "Give a CSV file of rows 'file,client'."
        )
    check_budget(CSV_INFLATE * Path(csv_path).stat().st_size, f"The '--clients-csv' file {str(csv_path)!r}")
    rows = {}
    i = 0
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            for i, row in enumerate(csv.reader(f)):
                if i == 0 and [c.strip().lower() for c in row[:2]] == ["file", "client"]:
                    continue
                if not row or not "".join(row).strip():
                    continue
                if len(row) < 2 or not row[0].strip() or not row[1].strip() or not "".join(row[:2]).isprintable():
                    raise FedheadError(
                        f"The '--clients-csv' parameter names {str(csv_path)!r}, whose row {i + 1} "
                        f"({','.join(row)!r}) is not 'file,client' (two fields of printable text). Give every row so."
                    )
                rows[Path(row[0].strip()).as_posix()] = row[1].strip()
    except (UnicodeDecodeError, csv.Error, OSError) as exc:  # not UTF-8 text, a NUL byte, a field over csv's limit
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FedheadError(
            f"The '--clients-csv' parameter names {str(csv_path)!r}, which cannot be read as UTF-8 CSV near row "
            f"{i + 1} ({why}). Give a UTF-8 text file of rows 'file,client'."
        ) from None
    return rows


def from_csv(paths: list[str], csv_path, data_dir: Path) -> np.ndarray:
    """Each file's client from ``--clients-csv`` (keys: relative to ``data_dir``, to its train folder, or the
    file name when unique among the CSV's keys)."""
    rows = _read_csv(Path(csv_path))
    by_name: dict[str, str | None] = {}
    for k, v in rows.items():
        n = Path(k).name
        by_name[n] = v if n not in by_name else None  # a name seen twice is ambiguous
    root, train = Path(data_dir).resolve(), (Path(data_dir) / "train").resolve()
    names, missing = [], []
    for p in paths:
        full = Path(p).resolve()
        keys = [full.relative_to(r).as_posix() for r in (root, train) if full.is_relative_to(r)]
        got = next((rows[k] for k in keys if k in rows), None) or by_name.get(full.name)
        if got is None:
            missing.append(keys[0] if keys else full.name)
        names.append(got)
    if missing:
        raise FedheadError(
            f"The '--clients-csv' parameter names {str(csv_path)!r}, which has no row for the training file "
            f"{missing[0]!r} ({len(missing)} of {len(paths)} lack one). Add a row 'file,client' for every "
            "training image (file relative to --data-dir, e.g. train/<class>/<file>)."
        )
    return np.asarray(names, dtype=object)


def encode(names: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Per-sample client names -> (int64 ids into the sorted unique names, the names)."""
    uniq, ids = np.unique(np.asarray(names, dtype=str), return_inverse=True)
    return ids.astype(np.int64), [str(u) for u in uniq]


def identity(ids: np.ndarray, names: list[str]) -> str:
    """SHA-256 of an assignment (part of the store's request: another assignment is another store)."""
    h = hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    h.update("\n".join(names).encode())
    return h.hexdigest()


def assign(split: D.ImageSplit, source: str, data_dir, csv_path, pattern) -> tuple[np.ndarray, list[str]]:
    """The training split's client ids and names from the given ``source`` (one of :data:`SOURCES`)."""
    if source in ("--client-folders", "--client-column"):
        return encode(split.clients)
    if split.source is not None and source == "--client-pattern":
        return encode(from_pattern(F.pattern_keys(split), pattern))
    if split.paths is None or split.source is not None:
        raise FedheadError(
            f"The '{source}' parameter needs a dataset of image files (imagefolder, tinyimagenet, filelist): their "
            f"names say the client. Got the dataset {split.name!r} instead. Extract an image folder, or drop "
            f"{source} (tables take --client-column)."
        )
    names = (
        from_csv(split.paths, csv_path, data_dir) if source == "--clients-csv" else from_pattern(split.paths, pattern)
    )
    return encode(names)
