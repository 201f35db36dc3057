"""The HDF5 feature store: the one file format every later fedhead command reads.

Layout (format ``fedhead-features``, version 1)::

    /train/features   [N, D]  float16 (default) or float32, chunked (rows of 1024)
    /train/labels     [N]     int64
    /test/features    [M, D]
    /test/labels      [M]
    /class_names      [C]     utf-8 strings
    attrs: format, format_version, dataset, encoder, weights_source, weights_sha256, preprocessing (JSON),
           image_size, dtype, feature_dim, num_classes, fedhead_version, created, request (JSON), complete
    /<split> attrs: n_done (rows written so far; equals N when the split is complete)

A store is written under ``<out>.partial`` and renamed to ``<out>`` only when complete, so a file under
the final name is always whole. Re-opening the ``.partial`` with the same request resumes at ``n_done``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from fedhead import __version__
from fedhead.errors import FedheadError

FORMAT = "fedhead-features"
FORMAT_VERSION = 1
SPLITS = ("train", "test")
CHUNK_ROWS = 1024


def partial_path(out: str | os.PathLike) -> Path:
    return Path(str(out) + ".partial")


class StoreWriter:
    """Incremental, resumable writer. Use as a context manager; call :meth:`finish` at the end.

    ``request`` is a JSON-able dict of everything that determines the content (dataset, encoder, weights
    hash, image size, dtype, limit, ...): a partial file is resumed only if its request is identical.
    """

    def __init__(self, out: str | os.PathLike, *, request: dict, sizes: dict[str, int], feature_dim: int,
                 class_names: list[str], attrs: dict[str, Any], dtype: str = "float16"):
        if dtype not in ("float16", "float32"):
            raise FedheadError(f"The '--dtype' parameter must be 'float16' or 'float32'. Got {dtype!r} instead.")
        self.out = Path(out)
        self.tmp = partial_path(out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        req = json.dumps(request, sort_keys=True)
        self.f = None
        if self.tmp.exists():
            try:
                f = h5py.File(self.tmp, "r+")
                same = (f.attrs.get("format") == FORMAT and f.attrs.get("request") == req
                        and "class_names" in f and all(s in f and "features" in f[s] and "labels" in f[s]
                                                       for s in sizes))
            except OSError:
                f, same = None, False
            if same:
                self.f = f
            else:
                if f is not None:
                    f.close()
                self.tmp.unlink()
        if self.f is None:
            f = h5py.File(self.tmp, "w")
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["request"] = req
            f.attrs["complete"] = False
            f.attrs["dtype"] = dtype
            f.attrs["feature_dim"] = int(feature_dim)
            f.attrs["num_classes"] = len(class_names)
            f.attrs["fedhead_version"] = __version__
            f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            for k, v in attrs.items():
                f.attrs[k] = json.dumps(v) if isinstance(v, (dict, list)) else v
            f.create_dataset("class_names", data=np.array(class_names, dtype=object),
                             dtype=h5py.string_dtype("utf-8"))
            for split, n in sizes.items():
                g = f.create_group(split)
                g.attrs["n_done"] = 0
                g.create_dataset("features", shape=(n, feature_dim), dtype=dtype,
                                 chunks=(max(1, min(CHUNK_ROWS, n)), feature_dim))
                g.create_dataset("labels", shape=(n,), dtype="int64")
            f.flush()
            self.f = f

    def n_done(self, split: str) -> int:
        return int(self.f[split].attrs["n_done"])

    def size(self, split: str) -> int:
        return int(self.f[split]["labels"].shape[0])

    def append(self, split: str, features: np.ndarray, labels: np.ndarray) -> None:
        """Write the next rows of ``split`` and record progress (the file is flushed, so a kill loses
        at most the rows of the batch in flight)."""
        g = self.f[split]
        i = int(g.attrs["n_done"])
        n = len(labels)
        g["features"][i:i + n] = features
        g["labels"][i:i + n] = labels
        g.attrs["n_done"] = i + n
        self.f.flush()

    def finish(self) -> Path:
        for split in self.f.keys():
            if isinstance(self.f[split], h5py.Group) and self.n_done(split) != self.size(split):
                raise RuntimeError(f"split {split} incomplete: {self.n_done(split)}/{self.size(split)}")
        self.f.attrs["complete"] = True
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


def write_store(out: str | os.PathLike, *, train: tuple[np.ndarray, np.ndarray],
                test: tuple[np.ndarray, np.ndarray], class_names: list[str], attrs: dict[str, Any],
                dtype: str = "float32", request: dict | None = None) -> Path:
    """Write a whole store from in-memory arrays (synthetic benchmarks, tests)."""
    sizes = {"train": len(train[1]), "test": len(test[1])}
    request = request or {"in_memory": True, **{k: v for k, v in attrs.items() if isinstance(v, (str, int, float))}}
    with StoreWriter(out, request=request, sizes=sizes, feature_dim=train[0].shape[1],
                     class_names=class_names, attrs=attrs, dtype=dtype) as w:
        w.append("train", train[0], train[1])
        w.append("test", test[0], test[1])
        return w.finish()


# ---------------------------------------------------------------- reading


@dataclass
class StoreInfo:
    path: Path
    attrs: dict[str, Any]
    shapes: dict[str, tuple]
    class_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def dataset(self) -> str:
        return str(self.attrs.get("dataset", ""))

    @property
    def encoder(self) -> str:
        return str(self.attrs.get("encoder", ""))


@dataclass
class Features:
    """A loaded store: numpy arrays (float32 features, int64 labels) plus metadata."""

    info: StoreInfo
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    extra: dict = field(default_factory=dict)


def _decode(v: Any) -> Any:
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, str) and v[:1] in "{[":
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def open_store(path: str | os.PathLike, param: str = "--features") -> StoreInfo:
    """Read a store's metadata, refusing missing, partial, corrupt or foreign files in one line."""
    p = Path(path)
    if not p.exists():
        if partial_path(p).exists():
            raise FedheadError(f"The '{param}' parameter names {str(p)!r}, which is only partly written "
                               f"({partial_path(p).name} exists). Re-run the same 'fedhead extract' to finish it.")
        raise FedheadError(f"The '{param}' parameter names {str(p)!r}, which does not exist. "
                           "Create it with 'fedhead extract'.")
    try:
        with h5py.File(p, "r") as f:
            attrs = {k: _decode(v) for k, v in f.attrs.items()}
            if attrs.get("format") != FORMAT:
                raise FedheadError(f"The '{param}' parameter names {str(p)!r}, an HDF5 file that is not a "
                                   "fedhead feature store. Create one with 'fedhead extract'.")
            if not attrs.get("complete", False):
                raise FedheadError(f"The '{param}' parameter names {str(p)!r}, a store that was never "
                                   "completed. Re-run 'fedhead extract' with --overwrite.")
            shapes = {f"{s}/{k}": tuple(f[s][k].shape) for s in SPLITS if s in f for k in ("features", "labels")}
            names = [n.decode() if isinstance(n, bytes) else str(n) for n in f["class_names"][()]]
    except FedheadError:
        raise
    except (OSError, KeyError) as exc:
        raise FedheadError(f"The '{param}' parameter names {str(p)!r}, which is not a readable fedhead "
                           f"feature store ({exc}). Re-create it with 'fedhead extract --overwrite'.") from None
    return StoreInfo(path=p, attrs=attrs, shapes=shapes, class_names=names)


def load_store(path: str | os.PathLike, param: str = "--features") -> Features:
    """Load the whole store into memory once (features as float32)."""
    info = open_store(path, param)
    with h5py.File(info.path, "r") as f:
        arrs = {}
        for s in SPLITS:
            arrs[s] = (np.asarray(f[s]["features"][()], dtype=np.float32),
                       np.asarray(f[s]["labels"][()], dtype=np.int64))
    return Features(info=info, train_x=arrs["train"][0], train_y=arrs["train"][1],
                    test_x=arrs["test"][0], test_y=arrs["test"][1])
