"""The formats large datasets come in, for ``fedhead extract``: WebDataset tar shards, Parquet / Arrow tables, a
Hugging Face dataset saved with ``save_to_disk``, and a CSV or JSON-lines file list.

Each is a registered dataset (:func:`extract.datasets.register_dataset`) whose split is an
:class:`extract.datasets.ImageSplit` with ``paths`` holding the record names and ``source`` a
:class:`extract.datasets.RecordSource` that reads a record's image bytes (the file list's split holds plain image
files and no source). The DataLoader workers decode records as they decode image files, so batching, ``--limit``,
``--skip-corrupt``, resume and the store's request work as for an image folder.

Where the data is (``--data-dir``, or ``--train-shards`` / ``--test-shards`` for the sharded formats)
    webdataset  ``--data-dir DIR`` holding ``train-*.tar`` and ``test-*.tar`` (or ``train/*.tar``, ``test/*.tar``),
                or ``--train-shards PATTERN --test-shards PATTERN``: a local path, glob or brace pattern such as
                ``shards/train-{000000..000009}.tar``. Members are grouped by key as WebDataset groups them
                (``key.jpg``/``key.png``/``key.webp``... and the label ``key.cls`` (an integer or a class name) or
                ``key.json`` (its field ``--label-column``, default ``label``)). Uncompressed tars only; members
                are read at the offsets in their headers, never extracted; ``.pyd``/``.pth``/pickle members are
                never read.
    parquet     ``--data-dir DIR`` holding ``train*.parquet`` / ``test*.parquet`` (also ``.arrow``, ``.feather``;
                directly, under ``train/`` and ``test/``, or under ``data/`` as on the Hugging Face hub), or
                ``--train-shards`` / ``--test-shards`` patterns. Columns ``--image-column`` (default ``image``:
                image bytes, or the Hugging Face struct ``{bytes, path}``) and ``--label-column`` (default
                ``label``: integers or strings). Read one row group (Arrow: one record batch) at a time.
    hf-disk     ``--data-dir DIR`` written by ``DatasetDict.save_to_disk`` with splits ``train`` and ``test``.
    filelist    ``--data-dir LIST`` (``.csv`` or ``.jsonl``) with a ``split`` column, or a folder holding
                ``train.csv`` and ``test.csv`` (or ``.jsonl``). CSV rows ``path,label[,client][,split]``: a first
                row naming the ``--image-column`` (default ``path``) is a header, else the columns are these four
                in this order. Paths are relative to the list's folder and must stay inside it.

Natural clients: ``--client-column NAME`` (parquet, hf-disk, filelist) or ``--client-pattern REGEX`` applied to
the WebDataset key's last part (webdataset) or the file name (filelist).

Class names, the same rule in every format: the ClassLabel names when the data has them (hf-disk; a Parquet table
written by ``datasets`` carries them too); for integer labels ``0..K-1`` as strings (K = the largest training
label + 1); for string labels the sorted set of the training labels. A test label absent from the training classes
is a one-line error, and so are two kinds of label (integers and text) in one dataset.

Corrupt records (image bytes that do not decode, a record without an image member or image bytes, a label that
does not parse) are named ``<shard>:<key>`` or ``<table>:<row>`` and stop the run or are skipped with
``--skip-corrupt``, like unreadable image files. A file list's bad row is a one-line error at once.
"""

from __future__ import annotations

import csv
import glob
import importlib
import json
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from extract import datasets as D
from fedhead.infra.devices import check_budget
from fedhead.infra.errors import FedheadError
from fedhead.infra.files import name_inside

FORMATS = ("webdataset", "parquet", "hf-disk", "filelist")
MAX_IMAGE_BYTES = 256 << 20  # one record's image bytes
MAX_LABEL_BYTES = 64 << 10  # one .cls / .json member
MAX_GROUP_BYTES = 4 << 30  # one Parquet row group, uncompressed
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm")  # first found is read
PICKLE_SUFFIXES = ("pyd", "pth", "pt", "pickle", "pkl")  # never read: unpickling runs code
TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")
LIST_SUFFIXES = (".csv", ".jsonl")
LIST_COLUMNS = ("path", "label", "client", "split")  # a header-less CSV's columns, in order
LIST_INFLATE = 8  # memory per byte of a file list once read
_INT = re.compile(r"[+-]?\d+")


def need(module: str) -> object:
    """Import a package of the ``data`` extra, or a one-line error saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pkg = module.split(".")[0]
        raise FedheadError(
            f"The '--dataset' parameter needs the Python package {pkg!r} for this format. Got it without {pkg} "
            "installed. Install it with: pip install 'fedhead[data]'."
        ) from None


# ---------------------------------------------------------------- a split as a reader finds it


@dataclass
class Scan:
    """One split's records before their labels become class indices."""

    param: str  # the option that named the data ('--data-dir', '--train-shards', ...)
    names: list = field(default_factory=list)  # each record's name
    raw: list = field(default_factory=list)  # each record's label: int, str, or None (a bad record)
    kinds: dict = field(default_factory=dict)  # 'int'/'str' -> the first part (shard, table, row) holding one
    clients: list | None = None
    source: object = None  # a RecordSource; None for a file list (its names are image files)
    class_names: list | None = None  # ClassLabel names, when the data has them
    parts: list = field(default_factory=list)  # the shards / tables read


def _kind(value) -> str:
    return "int" if isinstance(value, (int, np.integer)) else "str"


def _note_kind(scan: Scan, value, part: str) -> None:
    if value is not None:
        scan.kinds.setdefault(_kind(value), part)


def _check_kinds(scans: list[Scan]) -> None:
    seen: dict = {}
    for s in scans:
        for k, part in s.kinds.items():
            seen.setdefault(k, (part, s.param))
    if len(seen) > 1:
        (a, pa), (b, _) = seen["int"], seen["str"]
        raise FedheadError(
            f"The '{pa}' parameter gives records with two kinds of label: {a!r} holds integer labels, {b!r} text "
            f"labels. Got both. Give every shard, table or row the same kind (all class indices or all class names)."
        )


def _classes(train: Scan) -> list[str]:
    if train.class_names is not None:
        return [str(n) for n in train.class_names]
    valid = [v for v in train.raw if v is not None]
    if not valid:
        raise FedheadError(
            f"The '{train.param}' parameter holds no training record with a readable label. Got "
            f"{len(train.raw)} records, all corrupt. Give labelled training records."
        )
    if "int" in train.kinds:
        top = max(int(v) for v in valid)
        return [str(k) for k in range(top + 1)]
    return sorted({str(v) for v in valid})


def to_split(fmt: str, split: str, scan: Scan, train: Scan, rgb: bool) -> D.ImageSplit:
    """The :class:`ImageSplit` of a scanned split: labels as indices into the class names (see the module
    docstring for the rule), bad records labelled 0 (they are never encoded)."""
    if not scan.names:
        raise FedheadError(
            f"The '{scan.param}' parameter holds no {split} records ({', '.join(scan.parts[:3]) or 'no table'}). "
            f"Got an empty {split} split. Give a dataset with {split} records."
        )
    _check_kinds([train, scan])
    names = _classes(train)
    index = {n: k for k, n in enumerate(names)}
    labels = np.zeros(len(scan.raw), dtype=np.int64)
    for i, v in enumerate(scan.raw):
        if v is None:
            continue
        k = index.get(str(v)) if isinstance(v, str) else (int(v) if 0 <= int(v) < len(names) else None)
        if k is None:
            raise FedheadError(
                f"The '{scan.param}' parameter holds the {split} record {scan.names[i]!r} with label {v!r}, which no "
                f"training record has (classes: {', '.join(names[:5])}{'...' if len(names) > 5 else ''}). Got it "
                f"in {split}. Give {split} records only the training classes."
            )
        labels[i] = k
    out = D.ImageSplit(fmt, split, labels, names, paths=list(scan.names), rgb=rgb, source=scan.source)
    out.meta["hash_records"] = True
    if scan.clients is not None and split == "train":
        out.clients = np.asarray(_clients(scan), dtype=object)
    return out


def _clients(scan: Scan) -> list[str]:
    """The training records' clients (``--client-column``), each a non-empty name."""
    out = [None if v is None else str(v).strip() for v in scan.clients]
    for i, v in enumerate(out):
        if not v:
            raise FedheadError(
                f"The '--client-column' parameter names a column that is empty for the training record "
                f"{scan.names[i]!r}. Got no client. Give every training record a client."
            )
    return out


_SCANS: dict = {}  # (format, split, inputs, file stats) -> Scan: the test split reuses the training scan


def _stat(paths) -> tuple:
    return tuple((str(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths if os.path.exists(p))


def _cached(key: tuple, make) -> Scan:
    if key not in _SCANS:
        if len(_SCANS) > 8:
            _SCANS.clear()
        _SCANS[key] = make()
    return _SCANS[key]


def _load(fmt: str, split: str, rgb: bool, scan_split) -> D.ImageSplit:
    """Scan ``split`` (and the training split, whose labels give the classes) with ``scan_split(split)``."""
    train = scan_split("train")
    scan = train if split == "train" else scan_split(split)
    return to_split(fmt, split, scan, train, rgb)


def _no_dir(fmt: str, shards: bool) -> FedheadError:
    alt = " or --train-shards and --test-shards" if shards else ""
    return FedheadError(
        f"The '--data-dir' parameter is required for dataset {fmt!r}{alt}. Got none. Expected: {D.LAYOUTS[fmt]}."
    )


# ---------------------------------------------------------------- shard lists


def expand(spec: str, param: str) -> list[str]:
    """The files of a path, glob or brace pattern (``shards/train-{000000..000009}.tar``), in pattern order; each
    expanded pattern must match a file."""
    braceexpand = need("braceexpand")
    out = []
    for pat in braceexpand.braceexpand(str(spec)):
        hits = sorted(glob.glob(pat)) if glob.has_magic(pat) else [pat]
        hits = [h for h in hits if os.path.isfile(h)]
        if not hits:
            raise FedheadError(
                f"The '{param}' parameter matches no file: {pat!r} does not exist. Got {str(spec)!r}. Give a local "
                "path or a brace pattern such as 'shards/train-{000000..000009}.tar'."
            )
        out += [os.path.abspath(h) for h in hits]
    return out


def split_files(fmt: str, data_dir: Path | None, split: str, options: dict, suffixes: tuple) -> tuple[list, str]:
    """A split's shard / table files and the option that named them: ``--<split>-shards`` if given, else the
    files of ``--data-dir`` whose names start with the split (directly, in ``<split>/`` or in ``data/``)."""
    spec = options.get(f"{split}_shards")
    if spec:
        return expand(spec, f"--{split}-shards"), f"--{split}-shards"
    if data_dir is None:
        raise _no_dir(fmt, True)
    if not data_dir.is_dir():
        raise FedheadError(
            f"The '--data-dir' parameter must be a folder for dataset {fmt!r}. Got {str(data_dir)!r}. Expected: "
            f"{D.LAYOUTS[fmt]}."
        )
    for folder, stem in ((data_dir, f"{split}*"), (data_dir / split, "*"), (data_dir / "data", f"{split}*")):
        found = sorted(str(p.resolve()) for p in folder.glob(stem) if p.is_file() and p.suffix.lower() in suffixes)
        if found:
            return found, "--data-dir"
    raise FedheadError(
        f"The '--data-dir' parameter {str(data_dir)!r} holds no {split} {'/'.join(suffixes)} files. Got none. "
        f"Expected: {D.LAYOUTS[fmt]}."
    )


# ---------------------------------------------------------------- WebDataset tar shards


class TarRecords:
    """Image members of tar shards, read at their header offsets with ``os.pread`` (one shard open at a time per
    process, opened lazily after a fork)."""

    def __init__(self, shards, shard_of, offset, size, bad, names, keys):
        self.shards, self.names, self.keys = list(shards), list(names), list(keys)
        self.shard_of = np.asarray(shard_of, dtype=np.int32)
        self.offset = np.asarray(offset, dtype=np.int64)
        self.size = np.asarray(size, dtype=np.int64)
        self.bad = dict(bad)
        self._open = None  # (pid, shard index, fd)

    def __getstate__(self):
        return {**self.__dict__, "_open": None}

    def __len__(self) -> int:
        return len(self.names)

    def name(self, i: int) -> str:
        return self.names[i]

    def subset(self, idx: np.ndarray) -> "TarRecords":
        pos = {int(j): k for k, j in enumerate(idx)}
        bad = {pos[j]: r for j, r in self.bad.items() if j in pos}
        pick = [self.names[j] for j in idx], [self.keys[j] for j in idx]
        return TarRecords(self.shards, self.shard_of[idx], self.offset[idx], self.size[idx], bad, *pick)

    def _fd(self, s: int) -> int:
        if self._open is None or self._open[0] != os.getpid() or self._open[1] != s:
            if self._open is not None and self._open[0] == os.getpid():
                os.close(self._open[2])
            self._open = (os.getpid(), s, os.open(self.shards[s], os.O_RDONLY))
        return self._open[2]

    def read(self, i: int) -> bytes:
        if i in self.bad:
            raise D.BadRecord(self.bad[i])
        size = int(self.size[i])
        data = os.pread(self._fd(int(self.shard_of[i])), size, int(self.offset[i]))
        if len(data) != size:
            raise D.BadRecord(f"cut short ({len(data)} of {size} bytes: the shard ends inside it)")
        return data


def _tar_members(path: str, param: str) -> list[dict]:
    """The regular members of a tar shard as (offset, size) entries, from its headers (nothing extracted)."""
    members = []
    try:
        with tarfile.open(path, mode="r:") as tf:
            for m in tf:
                if m.isreg():
                    members.append({"fname": m.name, "data": (m.offset_data, m.size), "__url__": path})
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise FedheadError(
            f"The '{param}' parameter names {path!r}, which is not a readable uncompressed tar shard "
            f"({type(exc).__name__}: {str(exc)[:80]}). Got that file. Give WebDataset .tar shards (decompress "
            f".tar.gz ones first)."
        ) from None
    return members


def _member_label(fd: int, rec: dict, label_field: str) -> tuple[object, str | None]:
    """A record's label from its ``.cls`` or ``.json`` member: (label, None) or (None, what is wrong)."""
    ext = "cls" if "cls" in rec else "json" if "json" in rec else None
    if ext is None:
        pickled = [e for e in rec if e in PICKLE_SUFFIXES]
        why = f"; its .{pickled[0]} member is never unpickled" if pickled else ""
        return None, f"no label member (.cls or .json){why}"
    off, size = rec[ext]
    if size > MAX_LABEL_BYTES:
        return None, f"its .{ext} label member holds {size} bytes, more than a label"
    try:
        text = os.pread(fd, size, off).decode("utf-8").strip()
        value = json.loads(text).get(label_field) if ext == "json" else text
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None, f"its .{ext} label member does not parse"
    if isinstance(value, str) and _INT.fullmatch(value.strip()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "":
        return None, f"its .{ext} label member holds no label ({str(value)[:40]!r})"
    return value, None


def _scan_shard(path: str, param: str, label_field: str, scan: Scan, cols: dict) -> None:
    """Append a shard's records (grouped by key as WebDataset groups them) to ``scan`` and ``cols``."""
    tariters = need("webdataset.tariterators")
    s = len(scan.parts)
    scan.parts.append(path)
    try:
        samples = list(tariters.group_by_keys(iter(_tar_members(path, param))))
    except ValueError as exc:
        raise FedheadError(
            f"The '{param}' parameter names {path!r}, whose records are not grouped as WebDataset groups them "
            f"({str(exc.args[0])[:100]}). Got a repeated member. Give each key's members once, next to each other."
        ) from None
    with open(path, "rb") as f:
        for rec in samples:
            i, key = len(scan.names), rec["__key__"]
            scan.names.append(f"{path}:{key}")
            cols["keys"].append(key)
            label, why = _member_label(f.fileno(), rec, label_field)
            image = next((e for e in IMAGE_SUFFIXES if e in rec), None)
            off, size = rec[image] if image else (0, 0)
            if image is None:
                why = why or f"no image member ({', '.join('.' + e for e in IMAGE_SUFFIXES[:4])}...)"
            elif size > MAX_IMAGE_BYTES:
                why = why or f"its .{image} member holds {size} bytes, more than {MAX_IMAGE_BYTES}"
            if why:
                cols["bad"][i] = why
                label = None
            _note_kind(scan, label, path)
            scan.raw.append(label)
            cols["at"].append((s, off, size))


def _scan_webdataset(data_dir, split: str, options: dict) -> Scan:
    shards, param = split_files("webdataset", data_dir, split, options, (".tar",))
    label_field = options.get("label_column") or "label"

    def make() -> Scan:
        scan, cols = Scan(param), {"keys": [], "bad": {}, "at": []}
        for path in shards:
            _scan_shard(path, param, label_field, scan, cols)
        at = np.asarray(cols["at"], dtype=np.int64).reshape(-1, 3)
        scan.source = TarRecords(shards, at[:, 0], at[:, 1], at[:, 2], cols["bad"], scan.names, cols["keys"])
        return scan

    return _cached(("webdataset", split, tuple(shards), label_field, _stat(shards)), make)


@D.register_dataset(
    "webdataset",
    "<data-dir>/{train,test}-*.tar, or --train-shards/--test-shards 'shards/train-{000000..000009}.tar' "
    "(WebDataset shards: key.jpg|png|webp + key.cls or key.json)",
    "Write shards with webdataset's ShardWriter (uncompressed .tar).",
    options=("train_shards", "test_shards", "label_column"),
)
def _webdataset(data_dir, split, *, rgb=True, download=False, options=None):
    return _load("webdataset", split, rgb, lambda s: _scan_webdataset(data_dir, s, options or {}))


# ---------------------------------------------------------------- Parquet / Arrow tables


class ArrowBatches:
    """The record batches of an Arrow IPC file (feather v2: each batch read when asked, decompressed then) or stream
    (a ``datasets`` cache file: uncompressed, its batches memory-mapped views, nothing copied)."""

    def __init__(self, path: str):
        pa = need("pyarrow")
        try:
            self.reader = pa.ipc.open_file(pa.memory_map(path, "r"))
            self.schema, self.batches = self.reader.schema, None
            self.count = self.reader.num_record_batches
        except pa.ArrowInvalid:
            stream = pa.ipc.open_stream(pa.memory_map(path, "r"))
            self.schema, self.batches = stream.schema, list(stream)
            self.count = len(self.batches)

    def batch(self, g: int):
        return self.batches[g] if self.batches is not None else self.reader.get_batch(g)


class TableRecords:
    """Rows of Parquet / Arrow tables: a record's image is read with its row group (Arrow: record batch), one
    group kept per process (the DataLoader reads rows in order)."""

    def __init__(self, files, column, where, bad, names):
        self.files, self.column, self.names = list(files), column, list(names)
        self.where = np.asarray(where, dtype=np.int64).reshape(-1, 3)  # file, group, row in group
        self.bad = dict(bad)
        self._group = None  # (pid, file, group, array)
        self._file = None  # (pid, file, opened)

    def __getstate__(self):
        return {**self.__dict__, "_group": None, "_file": None}

    def __len__(self) -> int:
        return len(self.names)

    def name(self, i: int) -> str:
        return self.names[i]

    def subset(self, idx: np.ndarray) -> "TableRecords":
        pos = {int(j): k for k, j in enumerate(idx)}
        bad = {pos[j]: r for j, r in self.bad.items() if j in pos}
        return TableRecords(self.files, self.column, self.where[idx], bad, [self.names[j] for j in idx])

    def _opened(self, f: int):
        if self._file is None or self._file[:2] != (os.getpid(), f):
            path = self.files[f]
            pq = need("pyarrow.parquet")
            table = pq.ParquetFile(path) if path.endswith(".parquet") else ArrowBatches(path)
            self._file = (os.getpid(), f, table)
        return self._file[2]

    def _column(self, f: int, g: int):
        if self._group is None or self._group[:3] != (os.getpid(), f, g):
            opened = self._opened(f)
            if isinstance(opened, ArrowBatches):
                col = opened.batch(g).column(self.column)
            else:
                col = opened.read_row_group(g, columns=[self.column]).column(0).combine_chunks()
            self._group = (os.getpid(), f, g, col)
        return self._group[3]

    def read(self, i: int) -> bytes:
        if i in self.bad:
            raise D.BadRecord(self.bad[i])
        f, g, r = (int(v) for v in self.where[i])
        value = self._column(f, g)[r].as_py()
        path = None
        if isinstance(value, dict):
            value, path = value.get("bytes"), value.get("path")
        if not isinstance(value, (bytes, bytearray)):
            only = f" (only the path {str(path)[:60]!r}, which fedhead does not follow)" if path else ""
            raise D.BadRecord(f"no image bytes{only}")
        return bytes(value)


def _columns_of(schema, path: str, param: str, wanted: dict) -> None:
    for flag, name in wanted.items():
        if name is not None and name not in schema.names:
            raise FedheadError(
                f"The '{flag}' parameter names the column {name!r}, which the table {path!r} lacks (it has: "
                f"{', '.join(schema.names[:12])}). Got {name!r}. Name one of its columns with {flag}."
            )
    image = schema.field(wanted["--image-column"]).type
    pa = need("pyarrow")
    ok = pa.types.is_binary(image) or pa.types.is_large_binary(image)
    ok = ok or (pa.types.is_struct(image) and image.get_field_index("bytes") >= 0)
    if not ok:
        raise FedheadError(
            f"The '--image-column' parameter names the column {wanted['--image-column']!r} of {path!r}, of type "
            f"{image}, which holds no image bytes. Got {image}. Name a binary column or a struct {{bytes, path}}."
        )


def _values(arr, path: str, flag: str) -> tuple[list, str | None]:
    """A label or client column chunk as Python values and its kind ('int', 'str')."""
    pa = need("pyarrow")
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if pa.types.is_integer(arr.type):
        return arr.to_pylist(), "int"
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return arr.to_pylist(), "str"
    raise FedheadError(
        f"The '{flag}' parameter names a column of {path!r} of type {arr.type}. Got {arr.type}. Name a column of "
        "integers or strings."
    )


def hf_class_names(schema, label: str) -> list | None:
    """The ClassLabel names that ``datasets`` writes into a table's schema metadata, if any."""
    meta = (schema.metadata or {}).get(b"huggingface")
    try:
        feature = json.loads(meta)["info"]["features"][label] if meta else None
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and isinstance(feature.get("names"), list):
        return [str(n) for n in feature["names"]]
    return None


def _groups(path: str, param: str):
    """(schema, [(group index, reader of columns)]) of a Parquet or Arrow table."""
    pq = need("pyarrow.parquet")
    pa = need("pyarrow")
    try:
        if path.endswith(".parquet"):
            pf = pq.ParquetFile(path)
            md = pf.metadata
            for g in range(md.num_row_groups):
                if md.row_group(g).total_byte_size > MAX_GROUP_BYTES:
                    raise FedheadError(
                        f"The '{param}' parameter names {path!r}, whose row group {g} holds "
                        f"{md.row_group(g).total_byte_size} bytes, more than {MAX_GROUP_BYTES}. Got that table. "
                        "Rewrite it with smaller row groups (pyarrow's row_group_size)."
                    )
            return pf.schema_arrow, [
                (g, lambda cols, g=g: pf.read_row_group(g, columns=cols)) for g in range(md.num_row_groups)
            ]
        arrow = ArrowBatches(path)
        return arrow.schema, [(g, lambda cols, g=g: pa.Table.from_batches([arrow.batch(g)]).select(cols))
                              for g in range(arrow.count)]  # fmt: skip
    except (pa.ArrowException, OSError) as exc:
        raise _table_error(path, param, exc) from None


def _table_error(path: str, param: str, exc: Exception) -> FedheadError:
    return FedheadError(
        f"The '{param}' parameter names {path!r}, which is not a readable Parquet or Arrow table "
        f"({type(exc).__name__}: {str(exc)[:80]}). Got that file. Give .parquet, .arrow or .feather tables."
    )


def scan_tables(files: list, param: str, options: dict, class_names=None) -> Scan:
    """The records of Parquet / Arrow tables: labels and clients read column by column, group by group."""
    image, label = options.get("image_column") or "image", options.get("label_column") or "label"
    client = options.get("client_column")
    scan, where, bad = Scan(param, class_names=class_names), [], {}
    scan.clients = [] if client else None
    for f, path in enumerate(files):
        scan.parts.append(path)
        schema, groups = _groups(path, param)
        _columns_of(schema, path, param, {"--image-column": image, "--label-column": label, "--client-column": client})
        if scan.class_names is None and f == 0:
            scan.class_names = hf_class_names(schema, label)
        first = len(where)
        for g, read in groups:
            try:
                cols = read([label] + ([client] if client else []))
            except (need("pyarrow").ArrowException, OSError) as exc:
                raise _table_error(path, param, exc) from None
            rows = cols.num_rows
            labels, kind = _values(cols.column(0).combine_chunks(), path, "--label-column")
            owners = _values(cols.column(1).combine_chunks(), path, "--client-column")[0] if client else None
            for r in range(rows):
                i, value = len(scan.names), labels[r]
                scan.names.append(f"{path}:{len(where) - first}")
                where.append((f, g, r))
                if value is None or value == "":
                    bad[i] = "no label (null)"
                    value = None
                _note_kind(scan, value, path)
                scan.raw.append(value)
                if client:
                    scan.clients.append(owners[r])
    scan.source = TableRecords(files, image, where, bad, scan.names)
    return scan


def _scan_parquet(data_dir, split: str, options: dict) -> Scan:
    files, param = split_files("parquet", data_dir, split, options, TABLE_SUFFIXES)
    key = tuple(sorted((k, str(v)) for k, v in options.items() if k not in ("train_shards", "test_shards")))
    return _cached(("parquet", split, tuple(files), key, _stat(files)), lambda: scan_tables(files, param, options))


TABLE_OPTIONS = ("image_column", "label_column", "client_column")


@D.register_dataset(
    "parquet",
    "<data-dir>/{train,test}*.parquet (or .arrow/.feather; also <data-dir>/{train,test}/*, <data-dir>/data/), or "
    "--train-shards/--test-shards patterns; columns --image-column (bytes or {bytes, path}) and --label-column",
    "Write tables with pyarrow or datasets' to_parquet.",
    options=("train_shards", "test_shards", *TABLE_OPTIONS),
)
def _parquet(data_dir, split, *, rgb=True, download=False, options=None):
    return _load("parquet", split, rgb, lambda s: _scan_parquet(data_dir, s, options or {}))


# ---------------------------------------------------------------- a saved Hugging Face dataset


def _scan_hf(data_dir: Path | None, split: str, options: dict) -> Scan:
    if data_dir is None:
        raise _no_dir("hf-disk", False)
    datasets = need("datasets")
    try:
        dd = datasets.load_from_disk(str(data_dir))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise FedheadError(
            f"The '--data-dir' parameter {str(data_dir)!r} holds no dataset saved with save_to_disk "
            f"({type(exc).__name__}: {str(exc)[:80]}). Got that folder. Expected: {D.LAYOUTS['hf-disk']}."
        ) from None
    if not isinstance(dd, datasets.DatasetDict) or split not in dd:
        has = ", ".join(dd) if isinstance(dd, datasets.DatasetDict) else "a single Dataset"
        raise FedheadError(
            f"The '--data-dir' parameter {str(data_dir)!r} holds no {split} split (it has: {has}). Got that "
            "folder. Save a DatasetDict with splits train and test."
        )
    ds = dd[split]
    label = options.get("label_column") or "label"
    feature = ds.features.get(label)
    names = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    files = [c["filename"] for c in ds.cache_files]
    if not files or ds._indices is not None:
        raise FedheadError(
            f"The '--data-dir' parameter {str(data_dir)!r} holds a {split} split that is not its Arrow files "
            "as they are. Got an in-memory or index-mapped dataset. Save it with save_to_disk."
        )
    return scan_tables(files, "--data-dir", options, class_names=names)


@D.register_dataset(
    "hf-disk",
    "<data-dir> written by datasets' DatasetDict.save_to_disk, splits train and test (image feature + ClassLabel)",
    "Save it with DatasetDict.save_to_disk(DIR).",
    options=TABLE_OPTIONS,
)
def _hf_disk(data_dir, split, *, rgb=True, download=False, options=None):
    opts = options or {}
    key = tuple(sorted((k, str(v)) for k, v in opts.items()))

    def scan(s: str) -> Scan:
        return _cached(("hf-disk", s, str(data_dir), key, _stat(Path(data_dir or ".").glob("*/*.arrow"))),
                       lambda: _scan_hf(data_dir, s, opts))  # fmt: skip

    return _load("hf-disk", split, rgb, scan)


# ---------------------------------------------------------------- a CSV / JSON-lines file list


def _list_rows(path: Path, image: str) -> list[dict]:
    """A file list's rows as dicts (CSV: header row if it names ``image``, else :data:`LIST_COLUMNS` in order)."""
    check_budget(LIST_INFLATE * path.stat().st_size, f"The '--data-dir' file list {str(path)!r}")
    rows: list[dict] = []
    n = 0
    try:
        with open(path, newline="", encoding="utf-8") as f:
            if path.suffix.lower() == ".jsonl":
                for n, line in enumerate(f, 1):
                    if line.strip():
                        obj = json.loads(line)
                        if not isinstance(obj, dict):
                            raise ValueError("not a JSON object")
                        rows.append({**obj, "__row__": n})
                return rows
            header = None
            for n, row in enumerate(csv.reader(f), 1):
                if not row or not "".join(row).strip():
                    continue
                if header is None and n == 1 and image in [c.strip() for c in row]:
                    header = [c.strip() for c in row]
                    continue
                cols = header or LIST_COLUMNS
                rows.append({**dict(zip(cols, (c.strip() for c in row))), "__row__": n})
    except (UnicodeDecodeError, csv.Error, ValueError, OSError) as exc:
        raise FedheadError(
            f"The '--data-dir' parameter names {str(path)!r}, which cannot be read as a file list near row {n} "
            f"({type(exc).__name__}: {str(exc)[:60]}). Got that file. Give UTF-8 CSV or JSON lines."
        ) from None
    return rows


def _list_file(data_dir: Path | None, split: str) -> tuple[Path, bool]:
    """The list holding ``split`` and whether its rows need a ``split`` column (one list for both splits)."""
    if data_dir is None:
        raise _no_dir("filelist", False)
    if data_dir.is_file() and data_dir.suffix.lower() in LIST_SUFFIXES:
        return data_dir, True
    for suffix in LIST_SUFFIXES:
        if (data_dir / f"{split}{suffix}").is_file():
            return data_dir / f"{split}{suffix}", False
    raise FedheadError(
        f"The '--data-dir' parameter {str(data_dir)!r} is neither a .csv/.jsonl file list nor a folder holding "
        f"{split}.csv or {split}.jsonl. Got that path. Expected: {D.LAYOUTS['filelist']}."
    )


def _scan_filelist(data_dir: Path | None, split: str, options: dict) -> Scan:
    path, by_column = _list_file(data_dir, split)
    image, label = options.get("image_column") or "path", options.get("label_column") or "label"
    client = options.get("client_column")
    scan = Scan("--data-dir", parts=[str(path)])
    scan.clients = [] if client else None
    where = f"The '--data-dir' file list {str(path)!r}"
    for row in _list_rows(path, image):
        at = f"{where} (row {row['__row__']})"
        if by_column and str(row.get("split", "")).strip() not in ("train", "test"):
            raise FedheadError(f"{at} has no 'split' column of train or test. Got {row.get('split')!r}. Give each "
                               "row a split, or give a folder holding train.csv and test.csv.")  # fmt: skip
        if by_column and row["split"].strip() != split:
            continue
        file = name_inside(path.parent, row.get(image), at)
        value = row.get(label)
        if isinstance(value, str) and _INT.fullmatch(value.strip()):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "":
            raise FedheadError(f"{at} has no label in its column {label!r}. Got {value!r}. Give every row a label.")
        _note_kind(scan, value, f"{path.name} row {row['__row__']}")
        scan.names.append(os.path.abspath(file))
        scan.raw.append(value)
        if client:
            scan.clients.append(row.get(client))
    return scan


@D.register_dataset(
    "filelist",
    "<data-dir>=LIST.csv|.jsonl with rows path,label[,client][,split] (a split column), or a folder holding "
    "train.csv and test.csv; paths relative to the list's folder",
    "Write one row per image: its path (relative to the list), its label, optionally its client and split.",
    options=TABLE_OPTIONS,
)
def _filelist(data_dir, split, *, rgb=True, download=False, options=None):
    opts = options or {}
    key = tuple(sorted((k, str(v)) for k, v in opts.items()))

    def scan(s: str) -> Scan:
        path = _list_file(data_dir, s)[0]
        return _cached(("filelist", s, str(path), key, _stat([path])), lambda: _scan_filelist(data_dir, s, opts))

    return _load("filelist", split, rgb, scan)  # plain image files (no source): read and named as an image folder's


def pattern_keys(split: D.ImageSplit) -> list[str]:
    """What ``--client-pattern`` searches for each record of a split: the WebDataset key (its last part); one
    line for the table formats (their records have no names: use ``--client-column``)."""
    if isinstance(split.source, TarRecords):
        return [k.rsplit("/", 1)[-1] for k in split.source.keys]
    raise FedheadError(
        f"The '--client-pattern' parameter applies to image files and WebDataset keys. Got --dataset {split.name}, "
        "whose records have no names. Use --client-column NAME."
    )
