"""A fuzz pass over the Flower reply records a server receives (issue 42): well-formed ``query``, ``stats``,
``train`` and ``ccvr`` replies, mutated by Hypothesis, through :func:`fedhead.flower.replies.check_reply`. Every
mutation that breaks the protocol is a refusal (a one-line reason, the node's failure), any mutation at all is
never an exception, and every well-formed reply is accepted. Bounded: a few hundred examples, well under 60 s."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")
hypothesis = pytest.importorskip("hypothesis")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedhead.core.ccvr import ClassStats  # noqa: E402
from fedhead.flower.inprocess import task_identity  # noqa: E402
from fedhead.flower.replies import Expect, check_reply  # noqa: E402

C, D, K, PID, N = 3, 4, 4, 1, 10
COUNTS = np.array([6, 4, 0], dtype=np.int64)
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def expect(kind: str) -> Expect:
    if kind == "query":
        return Expect(C, D, K)
    if kind == "stats":
        return Expect(C, D, K, stats=True, closed_form=D, gram=True)
    msg = {"weighted": ((C, D + 1), np.dtype(np.float32))}
    return Expect(C, D, K, pid=PID, num_examples=N, class_counts=tuple(COUNTS), message=msg, head=(C, D + 1))


def good(kind: str) -> tuple[dict, dict]:
    """A well-formed reply of ``kind``: its arrays and metrics (numpy arrays and Python numbers)."""
    rng = np.random.default_rng(0)
    if kind == "query":
        return {"class-counts": COUNTS.copy()}, {"partition-id": PID, "num-examples": N, "noise-flipped": 2}
    if kind == "stats":
        held = np.flatnonzero(COUNTS)
        arrays = {
            "class-counts": COUNTS.copy(),
            "feature-sum": rng.normal(size=D),
            "cf-classes": held.astype(np.int64),
            "cf-counts": COUNTS[held].copy(),
            "cf-sums": rng.normal(size=(len(held), D)),
            "cf-gram": rng.normal(size=(D + 1) * (D + 2) // 2),
        }
        return arrays, {"partition-id": PID, "num-examples": N, "feature-sq": 3.5, "feature-count": N, "stats-ms": 1.0}
    if kind == "train":
        arrays = {
            "msg.weighted": rng.normal(size=(C, D + 1)).astype(np.float32),
            "holds": (COUNTS > 0).astype(np.uint8),
        }
        return arrays, {"partition-id": PID, "num-examples": N, "train-loss": 0.7, "client-ms": 3.0}
    held = np.flatnonzero(COUNTS)
    covs = np.stack([np.eye(D)] * len(held))
    blob = ClassStats(held, COUNTS[held], rng.normal(size=(len(held), D)), covs).to_bytes()
    return {"ccvr-stats": np.frombuffer(blob, dtype=np.uint8).copy()}, {
        "partition-id": PID,
        "num-examples": N,
        "client-ms": 2.0,
    }


def reply(arrays: dict, metrics: dict, raw: dict | None = None) -> Message:
    """A reply message with these contents (``raw``: arrays given as Flower Arrays of arbitrary bytes)."""
    recs = {k: Array(v) for k, v in arrays.items()}
    recs.update(raw or {})
    with task_identity():
        req = Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=1001, message_type="query")
        return Message(RecordDict({"arrays": ArrayRecord(recs), "metrics": MetricRecord(metrics)}), reply_to=req)


def raw_array(data: bytes, shape=(3,), dtype="float32") -> Array:
    return Array(dtype=dtype, shape=tuple(shape), stype="numpy.ndarray", data=bytes(data))


def npy(a: np.ndarray) -> bytes:
    f = io.BytesIO()
    np.save(f, a, allow_pickle=False)
    return f.getvalue()


KINDS = ["query", "stats", "train", "ccvr"]


@pytest.mark.parametrize("kind", KINDS)
def test_well_formed_replies_are_accepted(kind):
    arrays, metrics = good(kind)
    assert check_reply(kind, reply(arrays, metrics), expect(kind)) is None


# mutations that break the protocol, each applied to (arrays, metrics, raw); all must be refused
BAD_INT_VALUES = st.one_of(
    st.just(float("nan")),
    st.just(float("inf")),
    st.just(-1),
    st.just(2**62),
    st.just(0.5),
    st.lists(st.integers(0, 3), max_size=3),
    st.lists(st.floats(allow_subnormal=False), max_size=2),
)  # fmt: skip (a MetricRecord holds numbers and lists of numbers only)
BAD_FLOAT_VALUES = st.one_of(
    st.just(float("nan")), st.just(float("inf")), st.just(-float("inf")), st.lists(st.floats(allow_subnormal=False), max_size=2)
)  # fmt: skip


@st.composite
def broken(draw):
    kind = draw(st.sampled_from(KINDS))
    arrays, metrics = good(kind)
    raw = {}
    how = draw(st.sampled_from(["drop-array", "drop-metric", "bad-metric", "count", "dtype", "shape", "nonfinite",
                                "bytes", "header", "pid"]))  # fmt: skip
    akey = draw(st.sampled_from(sorted(arrays)))
    if (kind == "ccvr" and how in ("dtype", "nonfinite")) or (kind == "query" and how == "nonfinite"):
        how = "shape"
    if how == "drop-array":
        arrays.pop(akey)
    elif how == "drop-metric":
        mkey = draw(st.sampled_from(sorted(k for k in metrics if k not in ("noise-flipped", "stats-ms"))))
        metrics.pop(mkey)
    elif how == "bad-metric":
        mkey = draw(st.sampled_from(sorted(k for k in metrics if k not in ("noise-flipped", "stats-ms"))))
        floats = ("train-loss", "client-ms", "feature-sq")
        metrics[mkey] = draw(BAD_FLOAT_VALUES if mkey in floats else BAD_INT_VALUES)
    elif how == "count":
        metrics["num-examples"] = N + draw(st.integers(1, 10**12))
    elif how == "pid":
        metrics["partition-id"] = draw(
            st.sampled_from([K, -1, 10**9] + ([0, 2, 3] if kind in ("train", "ccvr") else []))
        )
    elif how == "dtype":
        a = arrays[akey]
        other = np.float64 if a.dtype != np.float64 else np.float32
        arrays[akey] = a.astype(other)
    elif how == "shape":
        a = arrays[akey].reshape(-1)
        cut = draw(st.integers(1, max(1, a.size)))
        arrays[akey] = np.concatenate([a, a[:1]]) if draw(st.booleans()) or cut == a.size else a[cut:]
    elif how == "nonfinite" and any(v.dtype.kind == "f" for v in arrays.values()):
        floats = sorted(k for k, v in arrays.items() if v.dtype.kind == "f")
        key = draw(st.sampled_from(floats))
        a = arrays[key].copy()
        a.reshape(-1)[draw(st.integers(0, a.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        arrays[key] = a
    elif how == "bytes":
        raw[akey] = raw_array(draw(st.binary(max_size=200)))
        arrays.pop(akey)
    elif how == "header":  # a header that claims far more values than the bytes hold
        a = arrays.pop(akey)
        data = npy(a).replace(repr(a.shape).encode(), repr((10**6,) + a.shape[1:]).encode().replace(b" ", b""), 1)
        raw[akey] = raw_array(data[: len(npy(a))], a.shape, str(a.dtype))
    return kind, arrays, metrics, raw, how


@FUZZ
@given(broken())
def test_every_broken_reply_is_a_refusal_never_an_exception(case):
    kind, arrays, metrics, raw, how = case
    why = check_reply(kind, reply(arrays, metrics, raw), expect(kind))
    assert isinstance(why, str) and why.startswith(f"bad {kind} reply refused") and "\n" not in why, (how, why)


@FUZZ
@given(
    kind=st.sampled_from(KINDS),
    key=st.text(min_size=1, max_size=12),
    data=st.binary(max_size=300),
    mkey=st.text(min_size=1, max_size=12),
    mval=st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True, allow_subnormal=False), st.booleans()),
)
def test_arbitrary_records_never_raise(kind, key, data, mkey, mval):
    """Whatever a node puts in its reply (any key, any bytes as an array, any metric), the check answers."""
    arrays, metrics = good(kind)
    try:
        m = reply(arrays, {**metrics, mkey: mval}, {key: raw_array(data)})
    except Exception:  # noqa: BLE001 - a record Flower itself cannot hold never reaches the server
        return
    why = check_reply(kind, m, expect(kind))
    assert why is None or isinstance(why, str)
