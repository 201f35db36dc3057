"""Every node reply checked before the server uses it: a reply is a hostile message, and a bad one is the failure of
its node (its partition's failure in rounds.csv), never the run's.

:func:`check_reply` is the one check, by kind:

- ``query``: ``partition-id`` in ``0..K-1``; ``num-examples``, ``class-counts [C]`` (int64, >= 0, summing to
  ``num-examples``) and ``noise-flipped`` (``<= num-examples``); a node that answers again (it rejoined) must
  report what its partition reported first. The statistics it carries are ``stats`` (below), checked apart so
  that bad statistics exclude the partition's statistics, not the node.
- ``stats``: the feature statistics (``feature-sum [D]`` float64, ``feature-sq``, ``feature-count`` =
  ``num-examples``) and a closed-form head's (``cf-classes`` = the held classes, ``cf-counts`` = their counts,
  ``cf-sums``, ``cf-gram``, ``cf-second`` of the shapes the head asks for), all finite.
- ``train``: ``partition-id`` and ``num-examples`` equal to the partition's first report; exactly the rule's wire
  keys (``msg.*``, shapes and dtypes of the server's own dry run), ``holds [C]`` equal to the classes its counts
  hold, SCAFFOLD's ``scaffold-delta``; floats finite; ``train-loss`` and ``client-ms`` finite numbers.
- ``validate``: ``partition-id`` as above; ``val-samples`` a count, ``val-correct`` in ``0..val-samples``, ``val-loss`` (a sum of cross-entropies) finite
  and >= 0, ``client-ms``.
- ``ccvr``: ``partition-id``, ``num-examples`` as above; ``ccvr-stats`` a whole number of class records
  (:meth:`fedhead.core.ccvr.ClassStats.from_bytes`) of held classes with their counts, finite.
- ``personalize``: ``partition-id`` as above; ``test-samples`` the size of the local test set the server sent,
  ``correct`` in ``0..test-samples``, ``drift`` in ``0..`` the drift set's size, ``beta`` (closed-form) a finite
  number > 0, ``client-ms``; ``val-correct`` (int64, one per beta) exactly when asked for, all ``-1`` (no
  validation part) or all counts >= 0; no other array.

Every array's size is checked from its ``.npy`` header against its bytes and the expected shape before numpy reads
it (no allocation a reply's header asks for). What this cannot catch: a node whose first report already lies
(its counts are then consistent), or a well-formed update with bad numbers (a scaled or flipped head): the robust
rules (``--aggregate median | trimmed-mean``, ``--norm-bound``) bound what such a node can do. Under SecAgg+
only the masked vectors' shapes are checked (:mod:`fedhead.flower.secure`).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedhead.core.ccvr import ClassStats

MAX_TAGS = 4096  # characters of a query reply's scaffold-tags
MAX_COUNT = 2**53  # a count beyond this is no count of samples (float64 sums stop being exact)
REASON_CHARS = 200


@dataclass(frozen=True)
class Expect:
    """What a partition's reply must hold. ``classes``/``dim``/``clients``: C, D, K of the run; ``pid``: the
    partition the node holds (None in a first query: any of ``0..K-1``); ``num_examples``/``class_counts``: the
    partition's first report (None: not known yet); ``message``: ``{key: (shape, dtype)}`` of the rule's wire form
    (train); ``scaffold``: SCAFFOLD's delta (of the ``head``'s shape) is expected; ``secure``: a query under secure aggregation (the id
    only); ``stats``: the feature statistics were asked for; ``closed_form``: the closed-form statistics' feature
    dim (None: not asked), with ``gram`` / ``second``."""

    classes: int
    dim: int
    clients: int
    pid: int | None = None
    num_examples: int | None = None
    class_counts: tuple | None = None
    message: dict | None = None
    scaffold: bool = False
    secure: bool = False
    stats: bool = False
    closed_form: int | None = None
    gram: bool = False
    second: bool = False
    head: tuple | None = None  # the head's shape [C, D+1] (SCAFFOLD's delta)
    tests: int | None = None  # personalize: the size of the local test set sent to the node
    drift: int | None = None  # personalize: the size of the drift set
    betas: int = 0  # personalize: the length of val-correct asked for (0: none)


class BadReply(Exception):
    """A reply that fails a check (never leaves this module: :func:`check_reply` returns its reason)."""


def check_reply(kind: str, reply: Any, expect: Expect) -> str | None:
    """None when ``reply`` (a Flower ``Message`` without error) is a well-formed ``kind`` reply for ``expect``,
    else the one-line reason to record as its node's failure. Never raises."""
    try:
        content = reply.content
        KINDS[kind](content, expect)
    except BadReply as exc:
        return _reason(kind, str(exc))
    except KeyError as exc:
        if kind not in KINDS:
            return _reason(kind, f"unknown reply kind {kind!r}")
        return _reason(kind, f"missing {exc}")
    except Exception as exc:  # noqa: BLE001 - any malformed record is the node's failure
        return _reason(kind, f"malformed record ({type(exc).__name__}: {exc})")
    return None


def _reason(kind: str, text: str) -> str:
    text = " ".join(str(text).split())
    return f"bad {kind} reply refused: {text}"[:REASON_CHARS]


# ---------------------------------------------------------------- the kinds


def _query(content, e: Expect) -> None:
    m = _metrics(content)
    pid = _int(m, "partition-id", 0, e.clients - 1)
    if e.pid is not None and pid != e.pid:
        raise BadReply(f"partition-id {pid}, but the node holds partition {e.pid}")
    if "config" in content.config_records:
        tags = content["config"].get("scaffold-tags", "")
        if not isinstance(tags, str) or len(tags) > MAX_TAGS:
            raise BadReply("scaffold-tags is not a short string")
    if e.secure:
        return
    n = _int(m, "num-examples", 0, MAX_COUNT)
    _same(n, e.num_examples, "num-examples")
    counts = _array(content, "class-counts", (e.classes,), np.int64)
    if (counts < 0).any() or int(counts.sum()) != n:
        raise BadReply(f"class-counts do not add up to num-examples {n}")
    if e.class_counts is not None and not np.array_equal(counts, np.asarray(e.class_counts)):
        raise BadReply("class-counts differ from the partition's first report")
    if "noise-flipped" in m:
        _int(m, "noise-flipped", 0, n)


def _stats(content, e: Expect) -> None:
    m = _metrics(content)
    _int(m, "partition-id", 0, e.clients - 1)
    n = _int(m, "num-examples", 0, MAX_COUNT)
    if e.stats:
        _finite(_array(content, "feature-sum", (e.dim,), np.float64), "feature-sum")
        if _number(m, "feature-sq") < 0:
            raise BadReply("feature-sq is negative")
        if _int(m, "feature-count", 0, MAX_COUNT) != n:
            raise BadReply(f"feature-count differs from num-examples {n}")
    if e.closed_form is None:
        return
    D = e.closed_form
    counts = _array(content, "class-counts", (e.classes,), np.int64)
    held = np.flatnonzero(counts > 0)
    k = len(held)
    classes = _array(content, "cf-classes", (k,), np.int64)
    if not np.array_equal(classes, held):
        raise BadReply("cf-classes are not the classes of class-counts")
    if not np.array_equal(_array(content, "cf-counts", (k,), np.int64), counts[held]):
        raise BadReply("cf-counts differ from class-counts")
    _finite(_array(content, "cf-sums", (k, D), np.float64), "cf-sums")
    if e.gram:
        _finite(_array(content, "cf-gram", ((D + 1) * (D + 2) // 2,), np.float64), "cf-gram")
    elif "cf-gram" in content["arrays"]:
        raise BadReply("cf-gram was not asked for")
    if e.second:
        _finite(_array(content, "cf-second", (k, D * (D + 1) // 2), np.float64), "cf-second")
    elif "cf-second" in content["arrays"]:
        raise BadReply("cf-second was not asked for")
    if "stats-ms" in m:
        _number(m, "stats-ms", 0.0)


def _train(content, e: Expect) -> None:
    m = _metrics(content)
    _own(m, e)
    n = _int(m, "num-examples", 0, MAX_COUNT)
    _same(n, e.num_examples, "num-examples")
    if "scaffold-lost" in m:
        if not e.scaffold or _int(m, "scaffold-lost", 0, 1) != 1:
            raise BadReply("scaffold-lost without SCAFFOLD")
        return
    if "residual-lost" in m:
        _int(m, "residual-lost", 0, 1)
    _number(m, "train-loss")
    _number(m, "client-ms", 0.0)
    if n == 0:
        return  # an empty client: skipped, nothing of it is read
    want = {f"msg.{k}": v for k, v in (e.message or {}).items()}
    want["holds"] = ((e.classes,), np.uint8)
    if e.scaffold:
        want["scaffold-delta"] = None
    got = set(content["arrays"].keys())
    if got != set(want):
        raise BadReply(f"arrays {sorted(got)[:8]}, expected {sorted(want)}")
    for key, spec in want.items():
        if spec is None:  # scaffold-delta: the head's shape, float32
            spec = (e.head or (e.classes, e.dim + 1), np.float32)
        a = _array(content, key, tuple(spec[0]), spec[1])
        if a.dtype.kind == "f":
            _finite(a, key)
    holds = _array(content, "holds", (e.classes,), np.uint8)
    if e.class_counts is not None and not np.array_equal(holds.astype(bool), np.asarray(e.class_counts) > 0):
        raise BadReply("holds differ from the classes of the partition's class counts")


def _ccvr(content, e: Expect) -> None:
    m = _metrics(content)
    _own(m, e)
    n = _int(m, "num-examples", 0, MAX_COUNT)
    _same(n, e.num_examples, "num-examples")
    _number(m, "client-ms", 0.0)
    D = e.dim
    per = 4 + 8 + 8 * D + 8 * (D * (D + 1) // 2)
    arr = content["arrays"]["ccvr-stats"]
    size = _npy_size(arr, np.uint8)
    if size % per or size // per > e.classes:
        raise BadReply(f"ccvr-stats of {size} bytes are not at most {e.classes} records of {per} bytes")
    blob = _array(content, "ccvr-stats", (size,), np.uint8).tobytes()
    if not blob:
        if n:
            raise BadReply("no ccvr-stats from a partition with samples")
        return
    s = ClassStats.from_bytes(blob, D)
    classes = np.asarray(s.classes)
    if len(np.unique(classes)) != len(classes) or ((classes < 0) | (classes >= e.classes)).any():
        raise BadReply("ccvr-stats name classes outside the run's or twice")
    if e.class_counts is not None and not np.array_equal(np.asarray(s.counts), np.asarray(e.class_counts)[classes]):
        raise BadReply("ccvr-stats counts differ from the partition's class counts")
    if (np.asarray(s.counts) < 1).any():
        raise BadReply("ccvr-stats hold a class without samples")
    _finite(np.asarray(s.means), "ccvr-stats means")
    _finite(np.asarray(s.covs), "ccvr-stats covariances")


def _validate(content, e: Expect) -> None:
    m = _metrics(content)
    _own(m, e)
    n = _int(m, "val-samples", 0, MAX_COUNT)
    _int(m, "val-correct", 0, n)
    _number(m, "val-loss", 0.0)
    _number(m, "client-ms", 0.0)


def _personal(content, e: Expect) -> None:
    m = _metrics(content)
    _own(m, e)
    n = _int(m, "test-samples", 0, MAX_COUNT)
    if e.tests is not None and n != int(e.tests):
        raise BadReply(f"test-samples {n}, but the server sent a local test set of {int(e.tests)}")
    _int(m, "correct", 0, n)
    _int(m, "drift", 0, int(e.drift or 0))
    _number(m, "client-ms", 0.0)
    if "beta" in m and _number(m, "beta", 0.0) <= 0:
        raise BadReply("beta is not > 0")
    keys = set(content["arrays"].keys()) if "arrays" in content.array_records else set()
    if keys != ({"val-correct"} if e.betas else set()):
        raise BadReply(f"arrays {sorted(keys)[:8]}, expected {['val-correct'] if e.betas else []}")
    if e.betas:
        v = _array(content, "val-correct", (e.betas,), np.int64)
        if not ((v == -1).all() or ((v >= 0) & (v <= MAX_COUNT)).all()):
            raise BadReply("val-correct are neither all -1 nor all counts")


KINDS = {"query": _query, "stats": _stats, "train": _train, "ccvr": _ccvr, "validate": _validate,
         "personalize": _personal}  # fmt: skip


# ---------------------------------------------------------------- fields


def _metrics(content):
    if "metrics" not in content.metric_records:
        raise BadReply("no metrics record")
    return content["metrics"]


def _own(m, e: Expect) -> None:
    pid = _int(m, "partition-id", 0, e.clients - 1)
    if e.pid is not None and pid != e.pid:
        raise BadReply(f"partition-id {pid}, but the node holds partition {e.pid}")


def _same(n: int, first: int | None, what: str) -> None:
    if first is not None and n != int(first):
        raise BadReply(f"{what} {n}, but the partition reported {int(first)} first")


def _int(m, key: str, lo: int, hi: int) -> int:
    v = m[key]
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise BadReply(f"{key} is not an integer")
    v = int(v)
    if not lo <= v <= hi:
        raise BadReply(f"{key} {v} outside [{lo}, {hi}]")
    return v


def _number(m, key: str, lo: float | None = None) -> float:
    v = m[key]
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise BadReply(f"{key} is not a number")
    v = float(v)
    if not math.isfinite(v) or (lo is not None and v < lo):
        raise BadReply(f"{key} {v!r} is not a finite number" + (f" >= {lo:g}" if lo is not None else ""))
    return v


def _finite(a: np.ndarray, what: str) -> None:
    if not np.isfinite(a).all():
        raise BadReply(f"{what} holds inf or nan")


def npy_count(data: bytes) -> tuple[int, np.dtype]:
    """The element count and dtype of ``.npy`` bytes, from the header, after checking that the bytes hold exactly
    that many elements (C order): nothing is allocated for what a header claims."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadReply("an array's data are not bytes")
    f = io.BytesIO(bytes(data[:65536]))
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dt = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dt = np.lib.format.read_array_header_2_0(f)
        else:
            raise BadReply(f"unsupported .npy version {version}")
    except BadReply:
        raise
    except Exception as exc:  # noqa: BLE001
        raise BadReply(f"not a .npy array ({exc})") from None
    if fortran or dt.hasobject:
        raise BadReply(f"a Fortran-order or object array ({dt})")
    count = math.prod(int(s) for s in shape)
    if len(data) - f.tell() != count * dt.itemsize:
        raise BadReply(f"an array of {len(data)} bytes does not hold its header's shape {tuple(shape)}")
    return count, dt


def _npy_size(arr, dtype) -> int:
    """The element count of a Flower Array of ``dtype`` (:func:`npy_count`)."""
    from flwr.app import Array

    if not isinstance(arr, Array):
        raise BadReply("an array is not a Flower Array")
    count, dt = npy_count(arr.data)
    if dt != np.dtype(dtype):
        raise BadReply(f"dtype {dt}, expected {np.dtype(dtype)}")
    return count


def _array(content, key: str, shape: tuple, dtype) -> np.ndarray:
    """``content["arrays"][key]`` as numpy, of exactly ``shape`` and ``dtype`` (sizes checked first)."""
    if "arrays" not in content.array_records:
        raise BadReply("no arrays record")
    arr = content["arrays"][key]
    count = _npy_size(arr, dtype)
    if count != math.prod(shape):
        raise BadReply(f"{key} has {count} values, expected shape {shape}")
    a = np.load(io.BytesIO(bytes(arr.data)), allow_pickle=False)
    if a.size != math.prod(shape) or a.dtype != np.dtype(dtype):
        raise BadReply(f"{key} has shape {a.shape} {a.dtype}, expected {shape} {np.dtype(dtype)}")
    return a.reshape(shape)
