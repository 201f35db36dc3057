"""The HDF5 feature store: the one file format every later fedhead command reads.

Layout (format ``fedhead-features``, version 1)::

    /train/features      [N, D]  float16 (default) or float32, chunked (rows of 1024)
    /train/labels        [N]     int64
    /train/skipped_mask  [S]     uint8, one per source image: 1 = left out as unreadable (--skip-corrupt)
    /train/clients       [N]     int64, optional: the natural client id of each training row (index into
                                 /client_names), recorded at extraction (--client-folders, --clients-csv,
                                 --client-pattern) and read by ``--partition natural``
    /client_names        [K]     utf-8 strings, optional (with /train/clients): the name of client id k
    /test/...            the same for the test split
    /class_names         [C]     utf-8 strings
    /skipped/<split>     [K]     utf-8 paths of the source images left out as unreadable (usually empty)
    attrs: format, format_version, dataset, encoder, weights_source, weights_sha256, preprocessing (JSON),
           image_size, dtype, feature_dim, num_classes, fedhead_version, created, request (JSON), complete,
           n_skipped (images left out, all splits), content_sha256 (:func:`content_hash`, since 0.1.0's
           layered release; computed on load for older stores)
    /<split> attrs: n_done (rows written), n_read (source images consumed: rows + left out), n_skipped

S is the number of source images of the split and N = S - K the rows (N = S unless images were left out).
Stores written before ``skipped_mask``/``skipped`` existed lack them and read the same; a store without
``train/clients`` has no natural clients (every other partition reads it as before).

A store is written under ``<out>.partial`` and renamed to ``<out>`` only when complete, so a file under
the final name is always whole. Re-opening the ``.partial`` with the same request resumes at ``n_read``
(source images) / ``n_done`` (rows); ``n_done``/``n_read`` are updated after the rows and the file is
flushed, so a killed writer loses at most the batch in flight.

Full disks: HDF5 cannot recover from a failed write inside a process (measured with h5py 3.16 / HDF5 2.0:
the next flush or close fails, the file is left truncated and the interpreter can crash at exit). So the
writer makes sure HDF5 never has to grow the file while it encodes: the whole store is allocated when it is
created (``H5D_ALLOC_TIME_EARLY``, no fill write) after checking the free space and the file size limit
(``ulimit -f``) against its size, and the blocks are then reserved with ``posix_fallocate`` outside HDF5
(again on every resume). Appends then overwrite reserved blocks in place. Running out of room therefore
shows as an ``OSError`` before any encoding (``ENOSPC``/``EFBIG`` with the sizes), and a ``.partial`` keeps
its rows. HDF5 errors that still occur (a disk filled by someone else in the instant between the check and
the reservation, copy-on-write filesystems) are raised as ``OSError`` with the HDF5 errno; such a
``.partial`` may be unreadable and the next run then starts it afresh.
"""

from __future__ import annotations

import contextlib
import errno as errnos
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np

from fedhead import __version__
from fedhead.infra.devices import check_budget
from fedhead.infra.devices import size_text as _mb
from fedhead.infra.errors import SPACE_ERRNOS, FedheadError
from fedhead.infra.files import make_parent_dirs

FORMAT = "fedhead-features"
FORMAT_VERSION = 1
SPLITS = ("train", "test")
CHUNK_ROWS = 1024
METADATA_BYTES = 48 * 1024  # HDF5's own structures in a store (measured: 24-27 KiB), the arrays apart


def partial_path(out: str | os.PathLike) -> Path:
    return Path(str(out) + ".partial")


# ---------------------------------------------------------------- room on disk


def store_bytes(sizes: dict[str, int], feature_dim: int, dtype: str, text: int = 0) -> int:
    """Upper bound of a new store's size on disk: the arrays in whole chunks (as they are allocated) plus
    metadata, ``text`` being the bytes of its request, attributes and class names (stored about 3.5 times
    over, measured with 3 to 1000 classes; 4 allowed)."""
    item = np.dtype(dtype).itemsize
    total = METADATA_BYTES + 4 * text
    for n in sizes.values():
        rows = -(-n // CHUNK_ROWS) * CHUNK_ROWS if n > CHUNK_ROWS else n
        total += rows * (feature_dim * item + 8 + 1)
    return total


def check_room(path: Path, need: int) -> None:
    """Raise ``OSError`` (EFBIG or ENOSPC, with the sizes) unless ``path`` can grow by ``need`` bytes:
    the file size limit (``ulimit -f``, RLIMIT_FSIZE) and the free space of its filesystem."""
    import resource

    size = path.stat().st_size if path.exists() else 0
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft != resource.RLIM_INFINITY and size + need > soft:
        raise OSError(
            errnos.EFBIG,
            f"the file size limit ('ulimit -f') allows {_mb(soft)}, the store needs about {_mb(size + need)}",
        )
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise OSError(errnos.ENOSPC, f"needs about {_mb(need)}, {_mb(free)} free")


def reserve(path: Path) -> None:
    """Allocate every block of ``path`` (``posix_fallocate`` over its length) so that writing inside it
    cannot run out of space later; ``OSError(ENOSPC)`` if the disk cannot hold it. Filesystems without
    support are left as they are."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as exc:
        if exc.errno not in (errnos.EOPNOTSUPP, errnos.ENOSYS, errnos.EINVAL):
            st = os.statvfs(path)
            raise OSError(
                exc.errno,
                f"{exc.strerror}: reserving {_mb(os.fstat(fd).st_size)} for the store, "
                f"{_mb(st.f_bavail * st.f_frsize)} free",
            ) from None
    finally:
        os.close(fd)


_ERRNO = re.compile(r"errno = (\d+)")


@contextlib.contextmanager
def hdf5_io() -> Any:
    """Re-raise an HDF5 I/O failure (h5py raises OSError, RuntimeError or ValueError for them, the errno only
    in the text) as ``OSError`` with that errno; other errors pass unchanged."""
    try:
        yield
    except (OSError, RuntimeError, ValueError) as exc:
        if isinstance(exc, OSError) and exc.errno:
            raise
        m = _ERRNO.search(str(exc))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, f"{os.strerror(code)} (HDF5: {str(exc).splitlines()[0][:120]})") from exc


def write_error(path: Path, exc: OSError) -> FedheadError:
    """The one-line message for a failed write of ``path`` (a ``.partial``): what, why, and that the same
    command resumes."""
    why = exc.strerror or str(exc)
    if exc.errno in SPACE_ERRNOS:
        fix = "Free space (or raise the file size limit) and re-run the same command: it resumes."
        return FedheadError(f"No space left while writing {str(path)!r} ({why}). {fix}")
    return FedheadError(f"Writing {str(path)!r} failed ({why}). Fix the cause and re-run the same command: it resumes.")


# ---------------------------------------------------------------- writing


def _early(shape: tuple, chunks: tuple, dtype, fill: bool = False) -> dict:
    """create_dataset arguments: resizable along rows, every chunk allocated at creation; written with zeros
    then only if ``fill`` (rows past ``n_done`` are never read, so the big arrays skip that write)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    return dict(
        shape=shape,
        dtype=dtype,
        chunks=chunks,
        maxshape=(None, *shape[1:]),
        dcpl=dcpl,
        fillvalue=0 if fill else None,
        fill_time="alloc" if fill else "never",
    )


class StoreWriter:
    """Incremental, resumable writer. Use as a context manager; call :meth:`finish` at the end.

    ``request`` is a JSON-able dict of everything that determines the content (dataset, encoder, weights
    hash, image size, dtype, limit, ...): a partial file is resumed only if its request is identical.
    ``sizes`` are the source images per split; rows are allocated for all of them and the arrays are cut
    to the rows written when the store is finished (fewer if images were left out, see :meth:`append`).
    Raises ``OSError`` (ENOSPC/EFBIG with the sizes) if the store cannot fit; see the module docstring.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        request: dict,
        sizes: dict[str, int],
        feature_dim: int,
        class_names: list[str],
        attrs: dict[str, Any],
        dtype: str = "float16",
        client_names: Sequence[str] | None = None,
    ):
        if dtype not in ("float16", "float32"):
            raise FedheadError(f"The '--dtype' parameter must be 'float16' or 'float32'. Got {dtype!r} instead.")

        self.out = Path(out)
        self.tmp = partial_path(out)
        if self.out.is_dir():  # found now, not by the rename at the end of the work
            raise FedheadError(
                f"The '--out' parameter names {str(self.out)!r}, which is a folder, not a store "
                "file. Choose another --out."
            )
        make_parent_dirs(self.out, "--out")  # a file in the way: one line
        req = json.dumps(request, sort_keys=True)
        self.f = None
        if self.tmp.exists():
            try:
                f = h5py.File(self.tmp, "r+")
                same = (
                    f.attrs.get("format") == FORMAT
                    and f.attrs.get("request") == req
                    and "class_names" in f
                    and all(s in f and "features" in f[s] and "labels" in f[s] for s in sizes)
                    and (client_names is None) == ("clients" not in f.get("train", {}))
                )
            except OSError:
                f, same = None, False
            if same:
                self.f = f
            else:
                if f is not None:
                    f.close()
                self.tmp.unlink()
        if self.f is None:
            names = [*class_names, *(client_names or ())]
            text = len(req) + len(json.dumps(attrs, default=str)) + sum(len(n.encode()) + 16 for n in names)
            extra = 8 * sizes.get("train", 0) if client_names is not None else 0  # train/clients
            check_room(self.tmp, store_bytes(sizes, feature_dim, dtype, text) + extra)
            with hdf5_io():
                self.f = self._create(req, sizes, feature_dim, class_names, attrs, dtype, client_names)
        try:
            reserve(self.tmp)
        except OSError:
            self.close()
            raise

    def _create(
        self,
        req: str,
        sizes: dict[str, int],
        feature_dim: int,
        class_names: list[str],
        attrs: dict[str, Any],
        dtype: str,
        client_names: Sequence[str] | None = None,
    ):
        f = h5py.File(self.tmp, "w")
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["request"] = req
        f.attrs["complete"] = False
        f.attrs["n_skipped"] = 0
        f.attrs["content_sha256"] = "0" * 64  # its final value has this size: set at finish without growing the file
        f.attrs["dtype"] = dtype
        f.attrs["feature_dim"] = int(feature_dim)
        f.attrs["num_classes"] = len(class_names)
        f.attrs["fedhead_version"] = __version__
        f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for k, v in attrs.items():
            f.attrs[k] = json.dumps(v) if isinstance(v, (dict, list)) else v
        f.create_dataset("class_names", data=np.array(class_names, dtype=object), dtype=h5py.string_dtype("utf-8"))
        for split, n in sizes.items():
            g = f.create_group(split)
            for k in ("n_done", "n_read", "n_skipped"):
                g.attrs[k] = 0
            rows = max(1, min(CHUNK_ROWS, n))
            g.create_dataset("features", **_early((n, feature_dim), (rows, feature_dim), dtype))
            g.create_dataset("labels", **_early((n,), (rows,), "int64"))
            g.create_dataset("skipped_mask", **_early((n,), (rows,), "uint8", fill=True))
            f.create_dataset(
                f"skipped/{split}", shape=(0,), maxshape=(None,), chunks=(256,), dtype=h5py.string_dtype("utf-8")
            )
            if split == "train" and client_names is not None:
                g.create_dataset("clients", **_early((n,), (rows,), "int64"))
        if client_names is not None:
            f.create_dataset(
                "client_names", data=np.array(list(client_names), dtype=object), dtype=h5py.string_dtype("utf-8")
            )
        f.flush()
        return f

    def _splits(self) -> list[str]:
        return [k for k, g in self.f.items() if isinstance(g, h5py.Group) and "n_done" in g.attrs]

    def n_done(self, split: str) -> int:
        """Rows written."""
        return int(self.f[split].attrs["n_done"])

    def n_read(self, split: str) -> int:
        """Source images consumed: rows written plus images left out."""
        a = self.f[split].attrs
        return int(a["n_read"]) if "n_read" in a else int(a["n_done"])  # stores before n_read: no skips

    def n_skipped(self, split: str) -> int:
        return self.n_read(split) - self.n_done(split)

    def size(self, split: str) -> int:
        """Source images of the split."""
        g = self.f[split]
        return int((g["skipped_mask"] if "skipped_mask" in g else g["labels"]).shape[0])

    def skipped_indices(self, split: str) -> np.ndarray:
        """Source indices of the images left out so far."""
        g = self.f[split]
        if "skipped_mask" not in g or self.n_skipped(split) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(g["skipped_mask"][: self.n_read(split)]).astype(np.int64)

    def append(
        self,
        split: str,
        features: np.ndarray,
        labels: np.ndarray,
        skipped: Sequence[int] = (),
        clients: np.ndarray | None = None,
    ) -> None:
        """Write the next rows of ``split`` and record progress. The batch covers the next
        ``len(labels) + len(skipped)`` source images; ``skipped`` are the source indices among them that
        were left out (unreadable images), ``features``/``labels`` the others, in order; ``clients`` their
        client ids (a store made with ``client_names``, train split). The rows go in first, then the counters,
        then the file is flushed: a kill loses at most the batch in flight."""
        g = self.f[split]
        if ("clients" in g) != (clients is not None):
            raise ValueError(
                f"{split}: client ids given {clients is not None}, the store records them {'clients' in g}"
            )
        i, r = self.n_done(split), self.n_read(split)
        n, m = len(labels), len(labels) + len(skipped)
        if r + m > self.size(split):
            raise ValueError(f"{split}: {r} + {m} source images is more than the split's {self.size(split)}")
        with hdf5_io():
            if n:
                g["features"][i : i + n] = features
                g["labels"][i : i + n] = labels
                if clients is not None:
                    g["clients"][i : i + n] = clients
            if skipped or "skipped_mask" in g:  # every batch: a redone batch clears its old flags
                flags = np.zeros(m, dtype=np.uint8)
                flags[np.asarray(skipped, dtype=np.int64) - r] = 1
                g.require_dataset("skipped_mask", shape=g["labels"].shape, dtype="uint8")[r : r + m] = flags
            g.attrs.modify("n_done", i + n)
            g.attrs.modify("n_read", r + m)
            g.attrs.modify("n_skipped", r + m - i - n)
            self.f.flush()

    def finish(self, source_names: dict[str, Sequence[str]] | None = None) -> Path:
        """Record the images left out (``skipped/<split>``: their names from ``source_names``, else
        ``#<index>``), cut the arrays to the rows written, mark the store complete and rename it."""
        splits = self._splits()
        for split in splits:
            if self.n_read(split) != self.size(split):
                raise RuntimeError(f"split {split} incomplete: {self.n_read(split)}/{self.size(split)}")
        left = {s: self.skipped_indices(s) for s in splits}
        names = {s: [str(source_names[s][i]) if source_names else f"#{i}" for i in left[s]] for s in splits}
        if any(len(v) for v in left.values()):
            check_room(self.tmp, 16 * 1024 + 2 * sum(len(n.encode()) + 16 for v in names.values() for n in v))
        with hdf5_io():
            for split in splits:
                g, n = self.f[split], self.n_done(split)
                if len(left[split]):
                    key = f"skipped/{split}"
                    d = (
                        self.f[key]
                        if key in self.f
                        else self.f.create_dataset(
                            key, shape=(0,), maxshape=(None,), chunks=(256,), dtype=h5py.string_dtype("utf-8")
                        )
                    )
                    d.resize((len(names[split]),))
                    d[:] = np.array(names[split], dtype=object)
                for k in ("features", "labels", "clients"):
                    if k in g and g[k].shape[0] != n:
                        _shrink(g, k, n)
            self.f.attrs.modify("n_skipped", sum(len(v) for v in left.values()))
            self.f.attrs.modify("content_sha256", _file_content_hash(self.f))
            self.f.attrs.modify("complete", True)
            self.f.close()
        self.f = None
        os.replace(self.tmp, self.out)
        return self.out

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def content_hash(splits: dict[str, tuple[np.ndarray, np.ndarray]], class_names: Sequence[str]) -> str:
    """A store's content, independent of its path and file layout: SHA-256 over each split's features as float32
    and labels as int64 (the arrays :func:`load_store` gives), then the class names. Recorded at extraction as the
    ``content_sha256`` attribute; a run's identity names its store by it (:func:`store_content_hash`)."""
    h = hashlib.sha256()
    for s in (s for s in SPLITS if s in splits):
        x, y = splits[s]
        h.update(np.ascontiguousarray(x, dtype="<f4").tobytes())
        h.update(np.ascontiguousarray(y, dtype="<i8").tobytes())
    h.update("\n".join(class_names).encode())
    return h.hexdigest()


def _file_content_hash(f: h5py.File, block: int = 1 << 16) -> str:
    """:func:`content_hash` of an open store, read in blocks of rows (bounded memory)."""
    h = hashlib.sha256()
    for s in (s for s in SPLITS if s in f):
        x, y = f[s]["features"], f[s]["labels"]
        for i in range(0, x.shape[0], block):
            h.update(np.ascontiguousarray(x[i : i + block], dtype="<f4").tobytes())
        h.update(np.ascontiguousarray(y[()], dtype="<i8").tobytes())
    h.update("\n".join(_strings(f["class_names"])).encode())
    return h.hexdigest()


def store_content_hash(store: Features) -> str:
    """The store's ``content_sha256`` (recorded at extraction), computed from its arrays for a store written before
    the attribute existed (and kept on the loaded store)."""
    got = store.info.attrs.get("content_sha256") or store.extra.get("content_sha256")
    if not got:
        splits = {"train": (store.train_x, store.train_y), "test": (store.test_x, store.test_y)}
        got = store.extra["content_sha256"] = content_hash(splits, store.info.class_names)
    return str(got)


def _shrink(g: h5py.Group, name: str, n: int) -> None:
    """Cut dataset ``g[name]`` to its first ``n`` rows (copied if it was created fixed-size)."""
    d = g[name]
    if d.maxshape[0] is None:
        d.resize(n, axis=0)
        return
    data = d[:n]
    del g[name]
    g.create_dataset(name, data=data, maxshape=(None, *data.shape[1:]))


def write_store(
    out: str | os.PathLike,
    *,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    class_names: list[str],
    attrs: dict[str, Any],
    dtype: str = "float32",
    request: dict | None = None,
    train_clients: np.ndarray | None = None,
    client_names: Sequence[str] | None = None,
) -> Path:
    """Write a whole store from in-memory arrays (synthetic benchmarks, tests); ``train_clients`` (int ids into
    ``client_names``, default ``client0``, ``client1``, ...) records a natural client per training row."""
    if train_clients is not None and client_names is None:
        client_names = [f"client{k}" for k in range(int(np.max(train_clients, initial=-1)) + 1)]
    sizes = {"train": len(train[1]), "test": len(test[1])}
    request = request or {"in_memory": True, **{k: v for k, v in attrs.items() if isinstance(v, (str, int, float))}}
    with StoreWriter(
        out,
        request=request,
        sizes=sizes,
        feature_dim=train[0].shape[1],
        class_names=class_names,
        attrs=attrs,
        dtype=dtype,
        client_names=client_names,
    ) as w:
        w.append("train", train[0], train[1], clients=None if train_clients is None else np.asarray(train_clients))
        w.append("test", test[0], test[1])
        return w.finish()


# ---------------------------------------------------------------- reading


@dataclass
class StoreInfo:
    path: Path
    attrs: dict[str, Any]
    shapes: dict[str, tuple]
    class_names: list[str]
    skipped: dict[str, list[str]] = field(default_factory=dict)  # split -> images left out as unreadable
    client_names: list[str] = field(default_factory=list)  # natural client ids (train/clients); empty: none recorded

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def dataset(self) -> str:
        return str(self.attrs.get("dataset", ""))

    @property
    def encoder(self) -> str:
        return str(self.attrs.get("encoder", ""))

    @property
    def n_skipped(self) -> int:
        return sum(len(v) for v in self.skipped.values())


@dataclass
class Features:
    """A loaded store: numpy arrays (float32 features, int64 labels) plus metadata."""

    info: StoreInfo
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    extra: dict = field(default_factory=dict)
    train_clients: np.ndarray | None = None  # int64 [N]: each training row's natural client id, None if not recorded


def _decode(v: Any) -> Any:
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, np.ndarray):  # fedhead writes scalars; an array attribute compares as a list
        v = v.tolist()
    if isinstance(v, str) and v[:1] in "{[":
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def _strings(d: h5py.Dataset) -> list[str]:
    return [n.decode() if isinstance(n, bytes) else str(n) for n in d[()]]


def _names(f: h5py.File, name: str, p: Path, param: str) -> list[str]:
    """The strings of dataset ``name`` (class names, client names, skipped paths), refusing anything else."""
    d = f[name]
    if not isinstance(d, h5py.Dataset) or d.ndim != 1 or (h5py.check_string_dtype(d.dtype) is None
                                                          and d.dtype.kind not in "SU"):  # fmt: skip
        raise _bad_store(param, p, f"{name} is not a list of strings")
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in d[()]]


REMAKE = "Re-create it with 'fedhead extract --overwrite'."


def _bad_store(param: str, p: Path, problem: str, fix: str = REMAKE) -> FedheadError:
    return FedheadError(f"The '{param}' parameter names {str(p)!r}, a store whose {problem}. {fix}")


def _check_layout(f: h5py.File, p: Path, param: str, attrs: dict, names: list[str]) -> None:
    """Structure checks (metadata only, microseconds): version, splits, shapes, dimensions, class count."""
    version = attrs.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise _bad_store(
            param,
            p,
            f"format version is {version!r}, newer than the {FORMAT_VERSION} this fedhead reads",
            "Upgrade fedhead to read it, or re-create it with this one ('fedhead extract --overwrite').",
        )
    dims = {}
    for s in SPLITS:
        g = f.get(s)
        if not isinstance(g, h5py.Group) or "features" not in g or "labels" not in g:
            raise _bad_store(param, p, f"{s} split is missing (no /{s}/features and /{s}/labels)")
        x, y = g["features"], g["labels"]
        if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise _bad_store(param, p, f"{s} split has features {x.shape} and labels {y.shape}, not [N, D] and [N]")
        if not np.issubdtype(y.dtype, np.integer):
            raise _bad_store(param, p, f"{s}/labels are {y.dtype}, not integers")
        dims[s] = int(x.shape[1])
    declared = attrs.get("feature_dim")
    if len(set(dims.values())) > 1 or (declared is not None and dims["train"] != declared):
        got = ", ".join(f"{s} {d}" for s, d in dims.items())
        raise _bad_store(
            param,
            p,
            f"feature dimension differs between splits or from its feature_dim "
            f"attribute ({got}; feature_dim {declared})",
        )
    declared = attrs.get("num_classes")
    if declared is not None and declared != len(names):
        raise _bad_store(param, p, f"num_classes attribute ({declared}) differs from its {len(names)} class names")
    if "clients" in f["train"]:
        c = f["train"]["clients"]
        if c.shape != f["train"]["labels"].shape or not np.issubdtype(c.dtype, np.integer) or "client_names" not in f:
            raise _bad_store(param, p, f"train/clients ({c.shape}, {c.dtype}) is not one integer client id per row")


def _check_clients(p: Path, param: str, clients: np.ndarray, k: int) -> None:
    """Client ids in [0, K) for the store's K client names."""
    out = (clients < 0) | (clients >= k)
    if out.any():
        i = int(np.flatnonzero(out)[0])
        raise _bad_store(param, p, f"train/clients hold {int(clients[i])} at row {i}, outside [0, {k}) client names")


def _first_nonfinite(x: np.ndarray, start: int = 0) -> int | None:
    """Row of the first NaN/inf in ``x`` (blocks of about 4M values: no full-size temporary), else None."""
    step = max(1, (1 << 22) // max(1, x.shape[1] if x.ndim == 2 else 1))
    for i in range(0, len(x), step):
        ok = np.isfinite(x[i : i + step])
        if not ok.all():
            return start + i + int(np.flatnonzero(~ok.reshape(len(ok), -1).all(axis=1))[0])
    return None


def _check_values(
    p: Path,
    param: str,
    split: str,
    x: np.ndarray | None,
    y: np.ndarray,
    num_classes: int,
    attrs: dict,
    bad_row: int | None = None,
) -> None:
    """Value checks: finite features (``x``, or ``bad_row`` found by the caller) and labels in [0, C)."""
    bad_row = _first_nonfinite(x) if x is not None else bad_row
    if bad_row is not None:
        hint = (
            " (it was made with --precision fp16/bf16: use fp32)" if attrs.get("precision") in ("fp16", "bf16") else ""
        )
        raise _bad_store(
            param,
            p,
            f"{split}/features hold NaN or inf (first at row {bad_row})",
            f"Re-create it with 'fedhead extract --overwrite'{hint}.",
        )
    if len(y):
        out = (y < 0) | (y >= num_classes)
        if out.any():
            i = int(np.flatnonzero(out)[0])
            raise _bad_store(
                param,
                p,
                f"{split}/labels hold {int(y[i])} at row {i}, outside [0, {num_classes}) "
                f"for its {num_classes} class names",
            )


# ---------------------------------------------------------------- what a store may claim (a hostile file)

MAX_INFLATE = 1100  # deflate's best ratio is 1032:1: a compressed chunk may claim that much more than it holds
MAX_CHUNK_BYTES = 64 << 20  # a chunk is read whole: HDF5 allows 4 GiB; fedhead writes 1024 rows (16 MiB at D 4096)


def _link(f: h5py.File, name: str, p: Path, param: str) -> Any:
    """The link of path ``name`` (None where it is absent or below something that is not a group), refusing a
    soft or external link on the way: a store's objects are all its own."""
    g, parts = f, name.strip("/").split("/")
    for i, part in enumerate(parts):
        link = g.get(part, getlink=True)
        if link is None:
            return None
        if not isinstance(link, h5py.HardLink):
            raise _bad_store(param, p, f"{'/'.join(parts[: i + 1])} links to an object outside it (external or soft "
                             "link)")  # fmt: skip
        if i == len(parts) - 1:
            return link
        g = g[part]
        if not isinstance(g, h5py.Group):
            return None
    return None


def claimed_bytes(d: h5py.Dataset) -> int:
    """Bytes a full read of ``d`` allocates (variable-length items count their 16-byte references)."""
    return int(np.prod(d.shape, dtype=object)) * int(d.id.get_type().get_size())


def _check_storage(p: Path, param: str, name: str, d: Any) -> None:
    """Refuse, from metadata, a dataset ``name`` whose shape claims more than the file holds for it: storage outside
    the file (external or virtual), chunks not all written (they read as fill values that cost memory and were never
    data), a chunk larger than :data:`MAX_CHUNK_BYTES`, or compressed chunks that would inflate more than deflate
    can (:data:`MAX_INFLATE`)."""
    if not isinstance(d, h5py.Dataset):
        raise _bad_store(param, p, f"{name} is a {type(d).__name__.lower()}, not an array")
    if d.is_virtual or d.external:
        raise _bad_store(
            param,
            p,
            f"{name} keeps its values in files outside it ({'virtual' if d.is_virtual else 'external'} storage)",
        )
    need, held = claimed_bytes(d), int(d.id.get_storage_size())
    if d.chunks is None:  # contiguous: the values are in the file, or it reads as fill values
        ok = held >= need
    else:
        item = int(d.id.get_type().get_size())
        chunk = int(np.prod(d.chunks, dtype=object)) * item
        if chunk > MAX_CHUNK_BYTES and chunk > need:
            raise _bad_store(param, p, f"{name} is stored in chunks of {_mb(chunk)}, read whole, for {_mb(need)} "
                             "of values")  # fmt: skip
        grid = int(np.prod([-(-n // c) for n, c in zip(d.shape, d.chunks)], dtype=object))
        have = int(d.id.get_num_chunks()) if need else 0
        filtered = bool(d._filters)
        ok = have >= grid and (held >= need if not filtered else held * MAX_INFLATE >= have * chunk)
    if not ok and need:
        raise _bad_store(param, p, f"{name} claims {d.shape} ({_mb(need)}) but the file holds {_mb(held)} for it")


def _read_plan(f: h5py.File) -> list[str]:
    """The datasets :func:`open_store` and :func:`load_store` read."""
    names = ["class_names"]
    for s in SPLITS:
        names += [f"{s}/features", f"{s}/labels"]
    if isinstance(f.get("train"), h5py.Group) and "clients" in f["train"]:
        names += ["train/clients", "client_names"]
    g = f.get("skipped")
    if isinstance(g, h5py.Group):
        names += [f"skipped/{k}" for k in g]
    return names


def _check_file(f: h5py.File, p: Path, param: str) -> None:
    """Every dataset read: a hard link of this file, its storage in this file and covering its shape."""
    for name in _read_plan(f):
        if _link(f, name, p, param) is not None:
            _check_storage(p, param, name, f[name])


def _load_bytes(info: StoreInfo) -> int:
    """Peak bytes of :func:`load_store`: float32 features, int64 labels and clients, and the largest array read
    in the file's dtype before its conversion."""
    item = 2 if info.attrs.get("dtype") == "float16" else 4
    total, temp = 0, 0
    for k, shape in info.shapes.items():
        n = int(np.prod(shape, dtype=object))
        total += n * (4 if k.endswith("features") else 8)
        temp = max(temp, n * item if k.endswith("features") else 0)
    return total + temp


def open_store(path: str | os.PathLike, param: str = "--features", check_values: bool = False) -> StoreInfo:
    """Read a store's metadata, refusing missing, partial, corrupt or foreign files in one line.

    Also refuses, from the metadata alone (microseconds): a newer ``format_version``, a missing split,
    mismatched shapes, a feature dimension that differs between splits or from ``feature_dim``, and a
    class count that differs from the class names. The values (NaN/inf features, labels outside
    [0, num_classes)) are checked by :func:`load_store` on the arrays it loads anyway, or here with
    ``check_values=True``, which reads the features block by block (measured on CIFAR-10's 60,000 x 1280
    float16 store: 1.4 ms without, 0.1 s with ``check_values``, warm page cache)."""
    p = Path(path)
    if not p.exists():
        if partial_path(p).exists():
            raise FedheadError(
                f"The '{param}' parameter names {str(p)!r}, which is only partly written "
                f"({partial_path(p).name} exists). Re-run the same 'fedhead extract' to finish it."
            )
        raise FedheadError(
            f"The '{param}' parameter names {str(p)!r}, which does not exist. Create it with 'fedhead extract' "
            "(or 'fedhead import' for features made elsewhere)."
        )
    if p.is_dir():
        found = sorted(q.name for q in p.glob("*.h5"))[:3]
        hint = f" It holds {', '.join(found)}: name one of them." if found else ""
        raise FedheadError(
            f"The '{param}' parameter names {str(p)!r}, a folder, not a feature store (the .h5 file 'fedhead "
            f"extract' writes).{hint or ' Name the store file, e.g. cache/cifar10/<encoder>.h5.'}"
        )
    try:
        with h5py.File(p, "r") as f:
            attrs = {k: _decode(v) for k, v in f.attrs.items()}
            if attrs.get("format") != FORMAT:
                raise FedheadError(
                    f"The '{param}' parameter names {str(p)!r}, an HDF5 file that is not a "
                    "fedhead feature store. Create one with 'fedhead extract'."
                )
            if attrs.get("complete") not in (True, 1):
                if p.name.endswith(".partial"):  # the store an extraction is writing (or was, when stopped)
                    raise FedheadError(
                        f"The '{param}' parameter names {str(p)!r}, a store still being written. Re-run the same "
                        f"'fedhead extract' to finish it (it resumes), then name {p.name[: -len('.partial')]!r}."
                    )
                raise FedheadError(
                    f"The '{param}' parameter names {str(p)!r}, a store that was never "
                    "completed. Re-run 'fedhead extract' with --overwrite."
                )
            _check_file(f, p, param)
            names = _names(f, "class_names", p, param)
            _check_layout(f, p, param, attrs, names)
            shapes = {f"{s}/{k}": tuple(f[s][k].shape) for s in SPLITS for k in ("features", "labels", "clients")
                      if k in f[s]}  # fmt: skip
            clients = _names(f, "client_names", p, param) if "clients" in f["train"] else []
            g = f.get("skipped", {})
            if not isinstance(g, (h5py.Group, dict)):
                raise _bad_store(param, p, "skipped is not a group of lists of paths")
            order = [*[s for s in SPLITS if s in g], *[s for s in g if s not in SPLITS]]
            skipped = {s: _names(f, f"skipped/{s}", p, param) for s in order}
            if check_values:
                for s in SPLITS:
                    x = f[s]["features"]
                    rows = x.chunks[0] if x.chunks else CHUNK_ROWS
                    step = rows * max(1, (1 << 22) // (rows * max(1, x.shape[1])))  # whole chunks, ~4M values
                    bad = next(
                        (
                            r
                            for i in range(0, x.shape[0], step)
                            if (r := _first_nonfinite(x[i : i + step], i)) is not None
                        ),
                        None,
                    )
                    _check_values(p, param, s, None, f[s]["labels"][()], len(names), attrs, bad)
                if clients:
                    _check_clients(p, param, f["train"]["clients"][()], len(clients))
    except FedheadError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError, TypeError) as exc:  # HDF5's errors on a damaged file
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FedheadError(
            f"The '{param}' parameter names {str(p)!r}, which is not a readable fedhead "
            f"feature store ({why}). Re-create it with 'fedhead extract --overwrite'."
        ) from None
    return StoreInfo(
        path=p,
        attrs=attrs,
        shapes=shapes,
        class_names=names,
        skipped={s: v for s, v in skipped.items() if v},
        client_names=clients,
    )


def load_store(path: str | os.PathLike, param: str = "--features") -> Features:
    """Load the whole store into memory once (features as float32), refusing the problems
    :func:`open_store` finds plus NaN/inf features and labels outside [0, num_classes) (a blockwise pass
    over the loaded arrays: 12.5 ms for CIFAR-10's 60,000 x 1280, next to 0.4 s to load them)."""
    info = open_store(path, param)
    check_budget(_load_bytes(info), f"The '{param}' parameter names {str(info.path)!r}, a store that")
    try:
        with h5py.File(info.path, "r") as f:
            arrs = {}
            for s in SPLITS:
                arrs[s] = (
                    np.asarray(f[s]["features"][()], dtype=np.float32),
                    np.asarray(f[s]["labels"][()], dtype=np.int64),
                )
            clients = np.asarray(f["train"]["clients"][()], dtype=np.int64) if info.client_names else None
    except (OSError, KeyError, ValueError, RuntimeError) as exc:  # damaged after its metadata (HDF5 read errors)
        raise FedheadError(
            f"The '{param}' parameter names {str(info.path)!r}, whose arrays cannot be read "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}). {REMAKE}"
        ) from None
    for s in SPLITS:
        _check_values(info.path, param, s, arrs[s][0], arrs[s][1], info.num_classes, info.attrs)
    if clients is not None:
        _check_clients(info.path, param, clients, len(info.client_names))
    return Features(
        info=info,
        train_x=arrs["train"][0],
        train_y=arrs["train"][1],
        test_x=arrs["test"][0],
        test_y=arrs["test"][1],
        train_clients=clients,
    )
