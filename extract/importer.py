"""``fedhead import``: features made elsewhere (``.npy`` / ``.npz`` / Parquet files, clip-retrieval's output) as a
feature store with a content hash, which every later command reads like an extracted one.

Sources, per split (``--train`` / ``--test``, labels ``--train-labels`` / ``--test-labels``):

* ``X.npy`` [N, D] features with ``y.npy`` [N] labels, or with a Parquet/CSV table whose ``--label-column`` holds
  them row by row;
* a Parquet file with an embedding column (``--embedding-column``: ``list<float>`` or ``fixed_size_list<float>``)
  and a label column (``--label-column``) in the same table;
* a clip-retrieval output folder: ``img_emb/img_emb_<i>.npy`` with ``metadata/metadata_<i>.parquet`` (or ``.csv``),
  ``i = 0, 1, ...`` in order, rows aligned, the labels in the metadata's ``--label-column``;
* or one ``.npz`` for both splits (``--npz``), its arrays named by ``--keys`` (default
  ``x_train,y_train,x_test,y_test``).

Labels are class indices or strings (mapped to the sorted training labels, or to ``--class-names FILE``, one name a
line); ``--clients`` names the column (or the ``.npz`` array, or a ``.npy`` file beside ``.npy`` labels) of each
training row's natural client, for ``--partition natural``.

Every file is hostile input: ``.npy``/``.npz`` are read with ``allow_pickle=False``, their headers checked against the
bytes the file holds before anything is allocated (object arrays refused), the allocation checked against the memory
budget, the shards of a folder kept inside it. Each refusal is one line and writes nothing; the store itself is
written under ``<out>.partial`` and renamed when whole (:func:`extract.store.write_store`).
"""

from __future__ import annotations

import csv
import math
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from extract.arrays import FeatureStore, store_attrs
from extract.store import content_hash, open_store
from fedhead.infra.devices import check_budget
from fedhead.infra.errors import FedheadError
from fedhead.infra.files import check_out, name_inside

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
TABLES = (".parquet", ".csv")
MAX_INFLATE = 1100  # deflate's best ratio is 1032:1: a compressed .npz member claiming more is refused
MAX_NAMES_BYTES = 64 << 20  # --class-names: a list of names, not a data file
SHARD = re.compile(r"img_emb_(\d+)\.npy")


def _refuse(param: str, path: Path | str, problem: str, fix: str) -> FedheadError:
    return FedheadError(f"The '{param}' parameter names {str(path)!r}, {problem}. {fix}")


def _file(path: Path | str, param: str, kinds: tuple[str, ...]) -> Path:
    """``path``: an existing regular file (no folder, pipe or device) whose suffix is one of ``kinds``."""
    p = Path(path)
    if not p.exists():
        raise _refuse(param, p, "which does not exist", "Check the path.")
    if not p.is_file():
        raise _refuse(param, p, "which is not a regular file", f"Name a {' or '.join(kinds)} file.")
    if p.suffix.lower() not in kinds:
        raise _refuse(param, p, f"whose kind {p.suffix or '(none)'!r} is not one it reads",
                      f"Name a {' or '.join(kinds)} file.")  # fmt: skip
    return p


# ---------------------------------------------------------------- .npy and .npz, read as hostile files


def _npy_header(f: BinaryIO, size: int, param: str, where: str) -> tuple[tuple, np.dtype, bool, int]:
    """Shape, dtype, Fortran order and header length of the ``.npy`` stream ``f`` of ``size`` bytes, after checking
    that the bytes after the header hold exactly what it claims (nothing allocated for a lying header)."""
    try:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"unsupported .npy version {version}")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except Exception as exc:  # noqa: BLE001 - any unreadable header is the same one line
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _refuse(param, where, f"which is not a .npy array ({why[:120]})", "Save it with numpy.save.") from None
    if dtype.hasobject:
        raise _refuse(
            param,
            where,
            f"an array of Python objects ({dtype})",
            "Save numbers (features) or integers/strings (labels); pickled objects are never read.",
        )
    header = f.tell()
    need = math.prod(int(s) for s in shape) * dtype.itemsize
    if size - header != need:
        raise _refuse(param, where, f"whose header claims {tuple(shape)} {dtype} ({need} bytes) but it holds "
                      f"{size - header} bytes", "Save it again with numpy.save.")  # fmt: skip
    check_budget(need, f"The '{param}' parameter names {where!r}, an array that")
    return tuple(shape), dtype, fortran, header


def read_npy(path: Path | str, param: str) -> np.ndarray:
    """The array of the ``.npy`` file ``path`` (``allow_pickle=False``, the header checked against the file size)."""
    p = _file(path, param, (".npy",))
    with open(p, "rb") as f:
        _npy_header(f, os.fstat(f.fileno()).st_size, param, str(p))
    return np.load(p, allow_pickle=False)


def read_npz(path: Path | str, keys: list[str], param: str) -> dict[str, np.ndarray]:
    """The arrays ``keys`` of the ``.npz`` file ``path``, each member's header checked against its declared size
    (and the compression ratio) before it is read; a missing name is refused listing the names present."""
    p = _file(path, param, (".npz",))
    try:
        z = zipfile.ZipFile(p)
    except (zipfile.BadZipFile, OSError) as exc:
        raise _refuse(param, p, f"which is not a .npz archive ({exc})", "Save it with numpy.savez.") from None
    with z:
        members = {i.filename[:-4]: i for i in z.infolist() if i.filename.endswith(".npy")}
        missing = [k for k in keys if k not in members]
        if missing:
            raise _refuse(param, p, f"which holds no array {missing[0]!r} (it holds: {', '.join(sorted(members))})",
                          "Name its arrays with --keys X_TRAIN,Y_TRAIN,X_TEST,Y_TEST.")  # fmt: skip
        out = {}
        for k in keys:
            info = members[k]
            where = f"{p}:{k}"
            if info.compress_type != zipfile.ZIP_STORED and info.compress_size * MAX_INFLATE < info.file_size:
                raise _refuse(param, where, "a member that claims to inflate beyond what deflate can",
                              "Save it again with numpy.savez.")  # fmt: skip
            with z.open(info) as f:
                _npy_header(f, info.file_size, param, where)
            with z.open(info) as f:
                try:
                    out[k] = np.lib.format.read_array(f, allow_pickle=False)
                except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
                    raise _refuse(param, where, f"which cannot be read ({exc})", "Save it again.") from None
        return out


# ---------------------------------------------------------------- Parquet and CSV tables


def require_pyarrow(param: str) -> None:
    """One line with the install hint where pyarrow (the ``data`` extra) is missing."""
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        raise FedheadError(
            f"The '{param}' parameter names a Parquet or CSV file, which needs pyarrow. Got none installed. "
            "Install it with pip install 'fedhead[data]' (or use .npy / .npz files)."
        )


def read_table(path: Path | str, columns: list[str], param: str) -> dict[str, Any]:
    """The columns ``columns`` of the Parquet or CSV file ``path`` (pyarrow arrays, one chunk each); a missing
    column is refused listing the columns present."""
    p = _file(path, param, TABLES)
    require_pyarrow(param)
    try:
        if p.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(p)
            present = list(pf.schema_arrow.names)
            meta = pf.metadata
            wanted = [present.index(c) for c in columns if c in present]
            need = sum(meta.row_group(g).column(j).total_uncompressed_size for g in range(meta.num_row_groups)
                       for j in wanted)  # fmt: skip
        else:
            import pyarrow.csv as pcsv

            with open(p, "rb") as f:  # the header row alone
                first = f.readline(1 << 20).decode("utf-8", "replace").strip()
            present = next(iter(csv.reader([first])), [])
            need = p.stat().st_size * 4
    except Exception as exc:  # noqa: BLE001 - a damaged file is one line whatever pyarrow raised
        raise _refuse(param, p, f"which cannot be read as a table ({str(exc).splitlines()[0][:120]})",
                      "Check the file.") from None  # fmt: skip
    missing = [c for c in columns if c not in present]
    if missing:
        raise _refuse(param, p, f"whose table has no column {missing[0]!r} (its columns: {', '.join(present)})",
                      "Name the column with --label-column / --embedding-column / --clients.")  # fmt: skip
    check_budget(need * 2, f"The '{param}' parameter names {str(p)!r}, a table that")
    try:
        if p.suffix.lower() == ".parquet":
            table = pf.read(columns=columns)
        else:
            table = pcsv.read_csv(p, convert_options=pcsv.ConvertOptions(include_columns=columns))
    except Exception as exc:  # noqa: BLE001
        raise _refuse(param, p, f"which cannot be read ({str(exc).splitlines()[0][:120]})", "Check the file.") from None
    return {c: table.column(c).combine_chunks() for c in columns}


def embeddings(col: Any, param: str, where: str) -> np.ndarray:
    """A ``list<number>`` / ``large_list`` / ``fixed_size_list`` column as a [rows, D] array (every row of one
    length, no null row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = col.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        raise _refuse(param, where, f"whose embedding column is {t}, not a list of numbers",
                      "Store each embedding as a list<float> (or fixed_size_list) cell.")  # fmt: skip
    if not (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type)):
        raise _refuse(param, where, f"whose embedding column holds {t.value_type}, not numbers", "Store floats.")
    if col.null_count:
        raise _refuse(param, where, f"whose embedding column has {col.null_count} empty (null) rows",
                      "Drop those rows from every column.")  # fmt: skip
    n = len(col)
    if pa.types.is_fixed_size_list(t):
        dim = t.list_size
    else:
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        dim = int(lengths[0]) if n else 0
        if n and (lengths != dim).any():
            i = int(np.flatnonzero(lengths != dim)[0])
            raise _refuse(param, where, f"whose embeddings differ in length ({dim} in row 0, {int(lengths[i])} in "
                          f"row {i})", "Give every row an embedding of the same dimension.")  # fmt: skip
    values = col.flatten().to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=np.float64 if values.dtype.kind == "f" else values.dtype).reshape(n, dim)


def column_values(col: Any, param: str, where: str, what: str) -> np.ndarray:
    """A label or client column as numpy (integers, or strings), refusing empty cells."""
    import pyarrow as pa

    if col.null_count:
        raise _refuse(param, where, f"whose {what} column has {col.null_count} empty cells",
                      f"Give every row a {what}.")  # fmt: skip
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_dictionary(col.type):
        return np.array(col.cast(pa.string()).to_pylist(), dtype=str)
    return col.to_numpy(zero_copy_only=False)


# ---------------------------------------------------------------- one split's sources


@dataclass
class Columns:
    """The column names of a table source."""

    embedding: str = "embedding"
    label: str = "label"
    clients: str | None = None  # train split only


@dataclass
class Split:
    """One split read: features, labels, clients (train), and the files they came from."""

    x: np.ndarray
    y: np.ndarray
    clients: np.ndarray | None = None
    files: list[str] = field(default_factory=list)


def _labels_file(path: Path, rows: int, param: str, cols: Columns) -> tuple[np.ndarray, np.ndarray | None]:
    """Labels (and clients) from ``path``: a ``.npy`` of labels, or a Parquet/CSV table's label column."""
    if path.suffix.lower() == ".npy":
        if cols.clients and not Path(cols.clients).is_file():
            raise FedheadError(
                f"The '--clients' parameter must name a .npy file of one client per row beside the .npy labels "
                f"{str(path)!r} (a column needs a Parquet/CSV table). Got {cols.clients!r} instead. Save the clients "
                "with numpy.save, or give the labels as a table with that column."
            )
        return read_npy(path, param), (read_npy(cols.clients, "--clients") if cols.clients else None)
    names = [cols.label] + ([cols.clients] if cols.clients else [])
    t = read_table(path, names, param)
    clients = column_values(t[cols.clients], param, str(path), "client") if cols.clients else None
    return column_values(t[cols.label], param, str(path), "label"), clients


def _clip_folder(folder: Path, param: str, cols: Columns) -> Split:
    """A clip-retrieval output folder: ``img_emb/img_emb_<i>.npy`` with ``metadata/metadata_<i>.parquet`` (or
    ``.csv``), shards ``0..n-1`` in order, each pair row-aligned."""
    emb = folder / "img_emb"
    found = sorted(int(m.group(1)) for p in (emb.iterdir() if emb.is_dir() else ()) if (m := SHARD.fullmatch(p.name)))
    if not found or found != list(range(len(found))):
        listed = f"shards {found}" if found else "no img_emb/img_emb_<i>.npy"
        raise _refuse(param, folder, f"a folder with {listed}",
                      "Name a clip-retrieval output folder (img_emb/img_emb_0.npy, metadata/metadata_0.parquet, "
                      "...), or the .npy and its labels file.")  # fmt: skip
    xs, ys, cs, files = [], [], [], []
    for i in found:
        x = read_npy(name_inside(folder, f"img_emb/img_emb_{i}.npy", f"The '{param}' folder"), param)
        meta = next((f"metadata/metadata_{i}{s}" for s in TABLES if (folder / f"metadata/metadata_{i}{s}").exists()),
                    f"metadata/metadata_{i}.parquet")  # fmt: skip
        y, c = _labels_file(name_inside(folder, meta, f"The '{param}' folder"), len(x), param, cols)
        if len(y) != len(x):
            raise _refuse(
                param,
                folder / meta,
                f"whose {len(y)} rows do not match the {len(x)} embeddings of img_emb/img_emb_{i}.npy",
                "Keep each metadata file row-aligned with its embeddings.",
            )
        xs.append(x), ys.append(y), cs.append(c), files.extend([f"img_emb/img_emb_{i}.npy", meta])
    y = np.concatenate(ys) if len({a.dtype.kind for a in ys}) == 1 else np.concatenate([a.astype(str) for a in ys])
    return Split(np.concatenate(xs), y, None if cols.clients is None else np.concatenate(cs), files)


def read_split(features: Path, labels: Path | None, split: str, cols: Columns) -> Split:
    """One split from its ``--<split>`` source and optional ``--<split>-labels`` file."""
    param, lparam = f"--{split}", f"--{split}-labels"
    if Path(features).is_dir():
        s = _clip_folder(Path(features), param, cols)
        if labels is not None:
            s.y, s.clients = _labels_file(_file(labels, lparam, (".npy", *TABLES)), len(s.x), lparam, cols)
        return s
    path = _file(features, param, (".npy", ".parquet"))
    if path.suffix.lower() == ".npy":
        if labels is None:
            raise FedheadError(
                f"The '{lparam}' parameter is required with {param} {str(path)!r} (a .npy of "
                f"features). Got none. Give a .npy of labels or a Parquet/CSV with --label-column."
            )
        x = read_npy(path, param)
        y, c = _labels_file(_file(labels, lparam, (".npy", *TABLES)), len(x), lparam, cols)
        return Split(x, y, c, [path.name, Path(labels).name])
    names = [cols.embedding] + ([cols.label] if labels is None else [])
    names += [cols.clients] if cols.clients and labels is None else []
    t = read_table(path, names, param)
    x = embeddings(t[cols.embedding], param, str(path))
    if labels is not None:
        y, c = _labels_file(_file(labels, lparam, (".npy", *TABLES)), len(x), lparam, cols)
        return Split(x, y, c, [path.name, Path(labels).name])
    c = column_values(t[cols.clients], param, str(path), "client") if cols.clients else None
    return Split(x, column_values(t[cols.label], param, str(path), "label"), c, [path.name])


def read_class_names(path: Path | str | None) -> list[str] | None:
    """``--class-names FILE``: one class name a line (UTF-8; blank lines at the end ignored)."""
    if path is None:
        return None
    p = _file(path, "--class-names", (".txt", ".csv", ".names", ""))
    if p.stat().st_size > MAX_NAMES_BYTES:
        raise _refuse("--class-names", p, f"a file of {p.stat().st_size} bytes", "Name a text file of class names.")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise _refuse("--class-names", p, "which is not UTF-8 text", "Save it as UTF-8, one name a line.") from None
    while lines and not lines[-1].strip():
        lines.pop()
    return [line.strip() for line in lines]


# ---------------------------------------------------------------- the command's work


def _flag_names(npz: bool, train_labels: bool, test_labels: bool) -> dict[str, str]:
    """How the messages of :meth:`FeatureStore.from_arrays <extract.arrays.FeatureStore.from_arrays>` name each
    array: the flag it came from (a table's labels: its split's flag)."""
    common = {"class_names": "--class-names", "clients": "--clients", "client_names": "--clients"}
    if npz:
        return {"x": "--npz[x_train]", "y": "--npz[y_train]", "x_test": "--npz[x_test]", "y_test": "--npz[y_test]",
                **common}  # fmt: skip
    return {"x": "--train", "y": "--train-labels" if train_labels else "--train", "x_test": "--test",
            "y_test": "--test-labels" if test_labels else "--test", **common}  # fmt: skip


def _written_hash(store: FeatureStore, dtype: str) -> str:
    """The content hash of ``store`` written as ``dtype`` (float16 rounds the features)."""
    if dtype == "float32":
        return store.content_sha256
    splits = {"train": (store.train_x.astype(dtype), store.train_y), "test": (store.test_x.astype(dtype), store.test_y)}
    return content_hash(splits, store.info.class_names)


def import_features(
    out: Path | str,
    *,
    train: Path | str | None = None,
    train_labels: Path | str | None = None,
    test: Path | str | None = None,
    test_labels: Path | str | None = None,
    npz: Path | str | None = None,
    keys: str = ",".join(NPZ_KEYS),
    embedding_column: str = "embedding",
    label_column: str = "label",
    clients: str | None = None,
    class_names: Path | str | None = None,
    name: str | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Read the sources (module docstring), check them (:meth:`FeatureStore.from_arrays
    <extract.arrays.FeatureStore.from_arrays>`, the flags as the names) and write the store ``out``. An existing
    ``out`` with the same content is kept as it is; another one needs ``overwrite``. Returns ``out``."""
    out = Path(out)
    if dtype not in ("float16", "float32"):
        raise FedheadError(f"The '--dtype' parameter must be 'float32' or 'float16'. Got {dtype!r} instead.")
    check_out(out, "--out")
    inputs = [Path(p) for p in (train, train_labels, test, test_labels, npz, class_names) if p is not None]
    if out.exists() and any(p.exists() and out.samefile(p) for p in inputs):
        raise _refuse("--out", out, "which is one of the files it reads", "Choose another --out.")
    if npz is not None:
        if any(v is not None for v in (train, train_labels, test, test_labels)):
            raise FedheadError("The '--npz' parameter holds both splits. Got --train/--test as well. Give one of them.")
        names = [k.strip() for k in keys.split(",")]
        if len(names) != 4 or not all(names):
            raise FedheadError(f"The '--keys' parameter must be 4 array names. Got {keys!r} instead. "
                               "Use e.g. x_train,y_train,x_test,y_test.")  # fmt: skip
        arrays = read_npz(npz, names + ([clients] if clients else []), "--npz")
        a, b = Split(arrays[names[0]], arrays[names[1]], arrays.get(clients)), Split(arrays[names[2]], arrays[names[3]])
        a.files = [Path(npz).name]
    else:
        for flag, v in (("--train", train), ("--test", test)):
            if v is None:
                raise FedheadError(f"The '{flag}' parameter is required (or --npz). Got none. Name the features file.")
        a = read_split(Path(train), None if train_labels is None else Path(train_labels), "train",
                       Columns(embedding_column, label_column, clients))  # fmt: skip
        b = read_split(Path(test), None if test_labels is None else Path(test_labels), "test",
                       Columns(embedding_column, label_column, None))  # fmt: skip
    flags = _flag_names(npz is not None, train_labels is not None, test_labels is not None)
    store = FeatureStore.from_arrays(
        a.x, a.y, b.x, b.y, class_names=read_class_names(class_names), clients=a.clients,
        name=name or Path(npz or train).stem, names=flags,
    )  # fmt: skip
    if out.exists() and not overwrite:
        try:
            same = open_store(out, "--out").attrs.get("content_sha256") == _written_hash(store, dtype)
        except FedheadError:
            same = False
        if same:
            return out
        raise _refuse(
            "--out", out, "which exists and holds other features", "Add --overwrite, or choose another --out."
        )
    attrs = store_attrs(store.name, {"source": "import", "imported_from": {"train": a.files, "test": b.files}})
    return store.save(out, dtype=dtype, attrs=attrs)
