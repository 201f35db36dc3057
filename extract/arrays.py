"""Features that come from elsewhere (another pipeline's embeddings, arrays already in memory) as the store the
trainer consumes: :class:`FeatureStore` (``fedhead.FeatureStore``).

``FeatureStore.from_arrays(X, y, X_test, y_test)`` checks the arrays as hostile input (2-D real features, finite,
the same dimension in both splits; 1-D integer labels in ``0..K-1`` or string labels mapped to sorted class names;
one label, and optionally one natural client, per row) and gives the in-memory :class:`~extract.store.Features`
that :func:`fedhead.run` trains on, with the content hash (:func:`~extract.store.content_hash`) that a store written
from the same arrays records: the features are held as float32, as :func:`~extract.store.load_store` gives them, so
``FeatureStore.from_arrays(...).save(path)`` and ``load_store(path)`` give the same arrays and the same hash.

Every refusal is one :class:`~fedhead.infra.errors.FedheadError` line naming the parameter (``The 'y_test' parameter
must ... Got ... instead. <fix>``); ``fedhead import`` (:mod:`extract.importer`) uses the same checks with its flags
as the names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from extract.store import (
    FORMAT,
    FORMAT_VERSION,
    Features,
    StoreInfo,
    content_hash,
    load_store,
    open_store,
    partial_path,
    store_content_hash,
    write_store,
)
from fedhead.infra.devices import check_budget
from fedhead.infra.errors import FedheadError, shown

# how each array is named in the messages: the Python API's parameters (fedhead import passes its flags)
PY_NAMES = {
    "x": "X",
    "y": "y",
    "x_test": "X_test",
    "y_test": "y_test",
    "class_names": "class_names",
    "clients": "clients",
    "client_names": "client_names",
}
# what the store writer sets itself (or derives from the arrays), left out of the attributes a copy passes it
WRITER_ATTRS = ("format", "format_version", "request", "complete", "n_skipped", "content_sha256", "dtype",
                "feature_dim", "num_classes", "fedhead_version", "created")  # fmt: skip


def _bad(param: str, want: str, got: str, fix: str) -> FedheadError:
    return FedheadError(f"The '{param}' parameter must be {want}. Got {got} instead. {fix}")


def _describe(a: np.ndarray) -> str:
    return f"an array of shape {tuple(a.shape)} and dtype {a.dtype}"


def as_array(value: Any, param: str) -> np.ndarray:
    """``value`` (a numpy array, a list, a CPU tensor) as a numpy array, refusing what numpy cannot make one of."""
    if isinstance(value, (str, bytes, os.PathLike)):
        raise _bad(param, "an array", shown(value), "Load the file first, or import it with 'fedhead import'.")
    try:
        return np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _bad(param, "an array", f"{type(value).__name__} ({why})", "Pass a numpy array.") from None


def check_features(value: Any, param: str) -> np.ndarray:
    """2-D real features, at least one row and one column, finite once held as float32: the float32 array."""
    x = as_array(value, param)
    if x.dtype.kind not in "fiu" or x.dtype.hasobject:
        raise _bad(param, "an array of real numbers (float or integer)", _describe(x),
                   "Convert the features to float32 (x.astype('float32')).")  # fmt: skip
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise _bad(param, "a 2-D array [rows, dimension] with at least one row and one column", _describe(x),
                   "Reshape it to one row per sample (x.reshape(len(x), -1)).")  # fmt: skip
    check_budget(x.shape[0] * x.shape[1] * 4, f"The '{param}' parameter, {_describe(x)},")
    with np.errstate(over="ignore", invalid="ignore"):  # beyond float32's range: inf, refused below
        x32 = np.ascontiguousarray(x, dtype=np.float32)
    ok = np.isfinite(x32).all(axis=1)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        beyond = " (beyond float32's range)" if np.isfinite(x[i]).all() else ""
        raise _bad(param, "finite numbers", f"NaN or inf{beyond} in row {i}",
                   "Drop or repair those rows (np.isfinite(x).all(axis=1) finds them).")  # fmt: skip
    return x32


def check_labels(value: Any, rows: int, param: str, of: str) -> np.ndarray:
    """1-D labels, one per row of ``of``: integers (int64) or strings (a str array); floats and booleans refused."""
    y = as_array(value, param)
    if y.dtype.kind == "O":
        if all(isinstance(v, str) for v in y.ravel().tolist()):
            y = y.astype(str)
        else:
            kinds = sorted({type(v).__name__ for v in y.ravel().tolist()})
            raise _bad(param, "integer or string labels", f"an object array of {', '.join(kinds)}",
                       "Pass the labels as integers or as strings.")  # fmt: skip
    if y.dtype.kind == "S":
        y = y.astype(str)
    if y.dtype.kind not in "iuU":
        fix = "Cast integral float labels with y.astype('int64')." if y.dtype.kind == "f" else "Pass class indices."
        raise _bad(param, "integer or string labels", _describe(y), fix)
    if y.ndim != 1 or len(y) != rows:
        raise _bad(param, f"1-D, one label per row of '{of}' ({rows} rows)", _describe(y),
                   f"Give one label per row of '{of}'.")  # fmt: skip
    return y.astype(np.int64) if y.dtype.kind in "iu" else y


def check_names(value: Any, param: str, what: str) -> list[str] | None:
    """A list of distinct, non-empty strings (class or client names), or None."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raise _bad(param, f"a list of {what} names", shown(value), f"Pass a list, e.g. [{value!r}].")
    names = list(value)
    bad = next((n for n in names if not isinstance(n, str) or not n or "\n" in n), None)
    if bad is not None:
        raise _bad(param, f"a list of non-empty one-line strings ({what} names)", shown(bad),
                   f"Name every {what} with a string.")  # fmt: skip
    seen: set[str] = set()
    dup = next((n for n in names if n in seen or seen.add(n)), None)
    if dup is not None:
        raise _bad(param, f"distinct {what} names", f"{dup!r} twice", f"Name each {what} once.")
    if not names:
        raise _bad(param, f"at least one {what} name", "an empty list", f"Name the {what}es.")
    return names


def encode_labels(
    y: np.ndarray, y_test: np.ndarray, class_names: list[str] | None, names: dict[str, str]
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Both splits' labels as class indices and the class names. Integers: in ``0..K-1`` (K: the class names given,
    else the largest label + 1; names default to ``"0"``, ``"1"``, ...). Strings: the class names given, else the
    training labels' sorted distinct values; a test label that is not a class is refused."""
    if (y.dtype.kind == "U") != (y_test.dtype.kind == "U"):
        s, n = ("y", "y_test") if y.dtype.kind == "U" else ("y_test", "y")
        got = _describe(y_test if n == "y_test" else y)
        fix = "Give both splits' labels as strings, or both as class indices."
        raise _bad(names[n], f"labels of the same kind as '{names[s]}' (strings)", got, fix)
    if y.dtype.kind == "U":
        classes = class_names if class_names is not None else sorted(set(y.tolist()))
        index = {c: k for k, c in enumerate(classes)}
        out = []
        for key, arr in (("y", y), ("y_test", y_test)):
            unknown = sorted(set(arr.tolist()) - set(index))
            if unknown:
                where = (
                    f"'{names['class_names']}'" if class_names is not None else f"the training labels ('{names['y']}')"
                )
                listed = ", ".join(repr(u) for u in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
                raise _bad(names[key], f"labels among the classes of {where}", f"{len(unknown)} other: {listed}",
                           f"Drop those rows, or name every class ({names['class_names']}).")  # fmt: skip
            out.append(np.array([index[v] for v in arr.tolist()], dtype=np.int64))
        return out[0], out[1], list(classes)
    k = len(class_names) if class_names is not None else int(max(y.max(), y_test.max(initial=0))) + 1
    for key, arr in (("y", y), ("y_test", y_test)):
        bad = (arr < 0) | (arr >= k)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            why = f"the {k} class names of '{names['class_names']}'" if class_names is not None else "class indices"
            raise _bad(names[key], f"class indices in 0..{k - 1} ({why})", f"{int(arr[i])} in row {i}",
                       "Map the labels to 0..K-1 first, or give them as strings.")  # fmt: skip
    return y, y_test, class_names if class_names is not None else [str(c) for c in range(k)]


def encode_clients(
    clients: Any, rows: int, client_names: list[str] | None, names: dict[str, str]
) -> tuple[np.ndarray | None, list[str] | None]:
    """Each training row's natural client as an id into the client names (strings: the sorted distinct names, as
    ``fedhead extract`` records them; integers: ids in ``0..K-1``, named ``client0``, ... unless named)."""
    if clients is None:
        if client_names is not None:
            raise _bad(names["client_names"], "given with 'clients'", "client names alone",
                       "Give each training row's client as well, or leave the names out.")  # fmt: skip
        return None, None
    c = check_labels(clients, rows, names["clients"], names["x"])
    if c.dtype.kind == "U":
        listed = client_names if client_names is not None else sorted(set(c.tolist()))
        index = {n: k for k, n in enumerate(listed)}
        unknown = sorted(set(c.tolist()) - set(index))
        if unknown:
            raise _bad(names["clients"], f"clients named in '{names['client_names']}'", repr(unknown[0]),
                       "Name every client.")  # fmt: skip
        return np.array([index[v] for v in c.tolist()], dtype=np.int64), list(listed)
    k = len(client_names) if client_names is not None else int(c.max()) + 1
    bad = (c < 0) | (c >= k)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise _bad(names["clients"], f"client ids in 0..{k - 1}", f"{int(c[i])} in row {i}",
                   "Number the clients from 0, or give them as strings.")  # fmt: skip
    return c, client_names if client_names is not None else [f"client{i}" for i in range(k)]


def store_attrs(name: str, extra: dict | None = None) -> dict:
    """The attributes a store of imported features records besides its arrays: no encoder (the features were made
    elsewhere, so a model trained on them classifies features, ``fedhead predict --features``, not images)."""
    return {"dataset": name, "encoder": "", "weights_source": "none", "weights_sha256": "", "source": "arrays",
            **(extra or {})}  # fmt: skip


def save_features(store: Features, path: str | os.PathLike, dtype: str = "float32", attrs: dict | None = None) -> Path:
    """Write ``store``'s arrays as a store file at ``path`` (:func:`~extract.store.write_store`: atomically, a
    ``.partial`` renamed when whole) with ``attrs`` (default: its own metadata besides what the writer sets)."""
    partial_path(path).unlink(missing_ok=True)  # a stale one of an interrupted write: written afresh
    if attrs is None:
        attrs = {k: v for k, v in store.info.attrs.items() if k not in WRITER_ATTRS}
    out = write_store(
        path,
        train=(store.train_x, store.train_y),
        test=(store.test_x, store.test_y),
        class_names=list(store.info.class_names),
        attrs=attrs,
        dtype=dtype,
        train_clients=store.train_clients,
        client_names=list(store.info.client_names) if store.train_clients is not None else None,
    )
    return Path(out)


def keep_store(store: Features, path: Path) -> Path:
    """``store`` written to ``path`` unless the file there holds it already (the same content hash): the store of a
    run on in-memory features, kept in its run directory (``fedhead.run(features=arrays)``)."""
    if path.is_file():
        try:
            if open_store(path).attrs.get("content_sha256") == store_content_hash(store):
                return path
        except FedheadError:
            pass  # not a readable store: written again
    return save_features(store, path)


@dataclass(repr=False)
class FeatureStore(Features):
    """A feature store made from arrays (:meth:`from_arrays`) or read from a file (:meth:`load`): what
    :func:`fedhead.run` trains on (``fedhead.run(features=store, ...)``), with the content hash of the store
    :meth:`save` writes (``content_sha256``)."""

    name: str = field(default="arrays")

    @classmethod
    def from_arrays(
        cls,
        X: Any,
        y: Any,
        X_test: Any,
        y_test: Any,
        class_names: Sequence[str] | None = None,
        clients: Any = None,
        client_names: Sequence[str] | None = None,
        name: str = "arrays",
        *,
        names: dict[str, str] | None = None,
    ) -> "FeatureStore":
        """The store of ``X`` [N, D] with labels ``y`` [N] and the test split ``X_test`` [M, D], ``y_test`` [M].

        Labels are class indices in ``0..K-1`` (``class_names``: their K names, default ``"0"`` ... ``"K-1"`` with K
        the largest label + 1) or strings (the classes: ``class_names``, default the training labels' sorted
        distinct values). ``clients`` [N]: each training row's natural client (ids or names; ``client_names``
        names the ids), for ``partition="natural"``. ``name``: the store's ``dataset`` attribute. Features are
        held as float32 (what :func:`~extract.store.load_store` gives). Bad input raises one
        :class:`~fedhead.infra.errors.FedheadError` line naming the parameter; ``names`` renames the parameters
        in those messages (``fedhead import`` names its flags)."""
        n = {**PY_NAMES, **(names or {})}
        x, xt = check_features(X, n["x"]), check_features(X_test, n["x_test"])
        if x.shape[1] != xt.shape[1]:
            raise _bad(n["x_test"], f"features of the dimension of '{n['x']}' ({x.shape[1]})",
                       f"dimension {xt.shape[1]}", "Encode both splits with the same encoder.")  # fmt: skip
        yy = check_labels(y, len(x), n["y"], n["x"])
        yt = check_labels(y_test, len(xt), n["y_test"], n["x_test"])
        classes = check_names(class_names, n["class_names"], "class")
        yy, yt, classes = encode_labels(yy, yt, classes, n)
        ids, clients_named = encode_clients(clients, len(x), check_names(client_names, n["client_names"], "client"), n)
        if not isinstance(name, str) or not name or "\n" in name:
            raise _bad("name", "a non-empty one-line string", shown(name), "Name the data, e.g. 'arrays'.")
        digest = content_hash({"train": (x, yy), "test": (xt, yt)}, classes)
        attrs = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            **store_attrs(name),
            "dtype": "float32",
            "feature_dim": int(x.shape[1]),
            "num_classes": len(classes),
            "complete": True,
            "n_skipped": 0,
            "content_sha256": digest,
        }
        shapes = {"train/features": x.shape, "train/labels": yy.shape, "test/features": xt.shape,
                  "test/labels": yt.shape, **({"train/clients": ids.shape} if ids is not None else {})}  # fmt: skip
        info = StoreInfo(path=Path(""), attrs=attrs, shapes=shapes, class_names=classes,
                         client_names=list(clients_named or []))  # fmt: skip
        return cls(info=info, train_x=x, train_y=yy, test_x=xt, test_y=yt, train_clients=ids, name=name)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FeatureStore":
        """The store file ``path`` (:func:`~extract.store.load_store`, with its checks)."""
        f = load_store(path, "path")
        return cls(info=f.info, train_x=f.train_x, train_y=f.train_y, test_x=f.test_x, test_y=f.test_y,
                   extra=f.extra, train_clients=f.train_clients, name=f.info.dataset or Path(path).stem)  # fmt: skip

    @property
    def content_sha256(self) -> str:
        """The content hash (:func:`~extract.store.content_hash`): the same as the store :meth:`save` writes."""
        got = self.info.attrs.get("content_sha256")
        if not got:
            splits = {"train": (self.train_x, self.train_y), "test": (self.test_x, self.test_y)}
            got = self.info.attrs["content_sha256"] = content_hash(splits, self.info.class_names)
        return str(got)

    @property
    def in_memory(self) -> bool:
        """Whether the store exists only in memory (made by :meth:`from_arrays`, not read from or saved to a file)."""
        return not str(self.info.path) or str(self.info.path) == "."

    def save(self, path: str | os.PathLike, dtype: str = "float32", attrs: dict | None = None) -> Path:
        """Write the store to ``path`` (atomically: a ``.partial`` renamed when whole; a file there is replaced) and
        return the path. With ``dtype="float32"`` (default) the file holds exactly these arrays and the same
        content hash; ``"float16"`` halves it (and rounds the features, so its hash is that of the rounded ones)."""
        return save_features(self, path, dtype, {**store_attrs(self.name), **(attrs or {})})

    def __repr__(self) -> str:
        train, test = self.train_x.shape, self.test_x.shape
        where = "in memory" if self.in_memory else str(self.info.path)
        return (
            f"FeatureStore({self.name!r}, train {train[0]} x {train[1]}, test {test[0]}, "
            f"{len(self.info.class_names)} classes, {where}, sha256 {self.content_sha256[:12]}...)"
        )
