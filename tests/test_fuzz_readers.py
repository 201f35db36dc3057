"""Hypothesis fuzz pass over the readers of files from elsewhere (issue 42): the feature store (``open_store``,
``load_store``), the model card and its weights (``load_model``), the experiment file (``load_experiment``,
``TrainConfig.from_toml``) and the clients CSV (``extract.clients.from_csv``).

Property, for every mutated input: a valid result or a :class:`FedheadError` of one line; no other exception (no
KeyError, ValueError, OSError, TypeError or h5py error leaking), no hang (each example under its ``deadline``) and
bounded memory (the Python-heap peak of every example, numpy's arrays included, under :data:`PEAK_BYTES` while the
mutations claim arrays of up to 32M rows).

Time budget: the whole module runs in under 60 s on one core (``max_examples`` per test below; measured 25-35 s
on this machine's shared cores). The examples are derandomised (``derandomize=True``): the same inputs every run,
so a failure here is a reader bug to fix, not a flaky draw.
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedhead.infra.errors import FedheadError

PEAK_BYTES = 64 << 20  # the base inputs load in well under 1 MB
BIG = 32_000_000  # rows a mutated dataset may claim
COMMON = dict(
    deadline=3000,  # ms per example (a bomb refused by its metadata takes milliseconds)
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def bounded(fn, *args, **kw):
    """``fn(*args, **kw)``: its result or ``None`` after a one-line FedheadError; asserts the heap peak."""
    tracemalloc.start()
    try:
        return fn(*args, **kw)
    except FedheadError as exc:
        assert "\n" not in str(exc).strip(), str(exc)
        return None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < PEAK_BYTES, f"peak {peak / 1e6:.0f} MB"


# ---------------------------------------------------------------- the feature store


@pytest.fixture(scope="module")
def base_store(tmp_path_factory):
    from extract.store import write_store

    rng = np.random.default_rng(0)
    d = tmp_path_factory.mktemp("fuzz-store")
    train = (rng.standard_normal((24, 4)).astype(np.float32), rng.integers(0, 3, 24))
    test = (rng.standard_normal((9, 4)).astype(np.float32), rng.integers(0, 3, 9))
    return write_store(d / "base.h5", train=train, test=test, class_names=["a", "b", "c"], attrs={"dataset": "t"},
                       train_clients=np.arange(24) % 2)  # fmt: skip


PATHS = ["train", "test", "train/features", "train/labels", "test/features", "test/labels", "class_names",
         "train/clients", "client_names", "skipped", "skipped/train"]  # fmt: skip
ATTRS = ["format", "format_version", "complete", "feature_dim", "num_classes", "dtype", "request", "preprocessing",
         "content_sha256", "n_skipped"]  # fmt: skip
attr_values = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_subnormal=False),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.booleans(),
    st.sampled_from(["fedhead-features", "{", "[1, 2", '{"a": 1}', "float16", "float32"]),
    st.lists(st.integers(-5, 5), min_size=1, max_size=4).map(np.array),
)
DTYPES = ["<f2", "<f4", "<f8", "<i1", "<i8", "<u1", "S3", "str", "bool", "<c8"]
dims = st.sampled_from([0, 1, 3, 4, 9, 24, 1024, BIG])
replace_op = st.tuples(
    st.just("replace"),
    st.sampled_from(PATHS[2:]),
    st.lists(dims, min_size=0, max_size=3).map(tuple),
    st.sampled_from(DTYPES),
    st.sampled_from(["contiguous", "chunked", "gzip", "written"]),
)
store_ops = st.lists(
    st.one_of(
        st.tuples(st.just("attr"), st.sampled_from(ATTRS), attr_values),
        st.tuples(st.just("delete"), st.sampled_from(PATHS)),
        replace_op,
        st.tuples(st.just("group"), st.sampled_from(PATHS[2:])),
        st.tuples(st.just("softlink"), st.sampled_from(PATHS[2:]), st.sampled_from(PATHS)),
        st.tuples(
            st.just("values"),
            st.sampled_from(["train/features", "train/labels", "train/clients"]),
            st.sampled_from([np.nan, np.inf, -1, 3, 2**40]),
        ),
        st.tuples(st.just("truncate"), st.floats(0.05, 0.999, allow_subnormal=False)),
        st.tuples(
            st.just("flip"),
            st.lists(st.tuples(st.floats(0, 0.999, allow_subnormal=False), st.integers(0, 255)), max_size=6),
        ),
    ),
    min_size=1,
    max_size=3,
)


def _new_dataset(f: h5py.File, path: str, shape: tuple, dtype: str, how: str) -> None:
    dt = h5py.string_dtype() if dtype == "str" else np.dtype(dtype)
    n = int(np.prod(shape, dtype=object)) if shape else 1
    if path in f:
        del f[path]
    if how == "written" and n * 8 < (1 << 20):
        data = np.zeros(shape, dtype=object if dtype == "str" else dt)
        if dtype == "str":
            data[...] = "x"
        f.create_dataset(path, data=data, dtype=dt)
    elif how == "contiguous" or not shape or 0 in shape:
        f.create_dataset(path, shape=shape, dtype=dt)
    else:
        chunks = tuple(min(max(1, s), 1024) for s in shape)
        f.create_dataset(path, shape=shape, dtype=dt, chunks=chunks, compression="gzip" if how == "gzip" else None)


def mutate_store(path: Path, ops) -> None:
    for op in ops:
        kind = op[0]
        if kind in ("truncate", "flip"):
            data = bytearray(path.read_bytes())
            if kind == "truncate":
                data = data[: int(len(data) * op[1])]
            else:
                for where, byte in op[1]:
                    data[int(len(data) * where)] = byte
            path.write_bytes(bytes(data))
            continue
        try:
            with h5py.File(path, "r+") as f:
                if kind == "attr":
                    f.attrs[op[1]] = op[2]
                elif kind == "delete" and op[1] in f:
                    del f[op[1]]
                elif kind == "replace":
                    _new_dataset(f, *op[1:])
                elif kind == "group":
                    if op[1] in f:
                        del f[op[1]]
                    f.create_group(op[1])
                elif kind == "softlink":
                    if op[1] in f:
                        del f[op[1]]
                    f[op[1]] = h5py.SoftLink("/" + op[2])
                elif kind == "values" and op[1] in f and isinstance(f[op[1]], h5py.Dataset):
                    d = f[op[1]]
                    if d.size and d.ndim:
                        d[0] = op[2] if d.dtype.kind == "f" or not isinstance(op[2], float) else 0
        except (OSError, ValueError, TypeError, KeyError, RuntimeError, OverflowError):
            pass  # a mutation h5py cannot make (a file already damaged): the reader gets the file as it is


@settings(max_examples=150, **COMMON)
@given(ops=store_ops)
def test_fuzz_feature_store(ops, base_store, tmp_path_factory):
    from extract.store import load_store, open_store

    p = tmp_path_factory.mktemp("s") / "store.h5"
    shutil.copy(base_store, p)
    mutate_store(p, ops)
    info = bounded(open_store, p, check_values=True)
    got = bounded(load_store, p)
    if got is not None:
        assert info is not None
        assert got.train_x.dtype == np.float32 and got.train_x.shape[0] == got.train_y.shape[0]
        assert np.isfinite(got.train_x).all() and got.train_y.min(initial=0) >= 0


# ---------------------------------------------------------------- the model card and its weights


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, base_store):
    import torch

    from extract.store import load_store
    from fedhead.federation.clients import FeatureStats
    from fedhead.federation.config import TrainConfig
    from fedhead.federation.model import write_model

    store = load_store(base_store)
    out = {}
    for head, params, centered, width in (("softmax", {}, True, 4), ("ridge-rf", {"rf_width": 6}, False, 6)):
        d = tmp_path_factory.mktemp(f"fuzz-model-{head}")
        theta = torch.randn(3, width + 1, generator=torch.Generator().manual_seed(0))
        stats = FeatureStats(store.train_x.mean(0) if centered else None, 1.0, 0, 0)
        cfg = TrainConfig(features=str(base_store), head=head, clients=2, head_params=params)
        out[head] = write_model(d, (0, "main"), theta, stats, cfg, store, {"test_accuracy": 0.5})
    return out


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.sampled_from([0, 1, -1, 3, 4, 6, 8, 2**31, 4_000_000, 10**12]),
        st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
        st.text(max_size=12),
        st.sampled_from(["softmax", "sigmoid", "float16", "qda", "ridge-rf", "../x", "/etc/hostname", "file:/etc/x"]),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8,
)
CARD_PATHS = [("classes",), ("head",), ("head", "kind"), ("head", "params"), ("head", "params", "rf_width"),
              ("head", "probabilities"), ("head", "linear"), ("features",), ("features", "scale"),
              ("features", "centered"), ("features", "store_dtype"), ("store",), ("store", "feature_dim"),
              ("store", "batch_size"), ("store", "source_size"), ("store", "image_size"), ("store", "encoder"),
              ("store", "weights_source"), ("store", "cpu_threads"), ("weights_file",), ("weights_file_sha256",),
              ("format_version",), ("format",), ("metrics",)]  # fmt: skip
card_ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.sampled_from(CARD_PATHS), json_values),
        st.tuples(st.just("drop"), st.sampled_from(CARD_PATHS)),
    ),
    max_size=3,
)
tensor_specs = st.dictionaries(
    st.sampled_from(["weight", "bias", "feature_mean", "quadratic", "extra"]),
    st.tuples(
        st.lists(st.sampled_from([0, 1, 3, 4, 5, 6, 7]), max_size=3),
        st.sampled_from(["f32", "f64", "i64", "f16", "nan"]),
    ),
    max_size=4,
)


def _set(card: dict, path: tuple, value, drop: bool = False) -> None:
    node = card
    for k in path[:-1]:
        if not isinstance(node, dict) or not isinstance(node.get(k), dict):
            return
        node = node[k]
    if isinstance(node, dict):
        if drop:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value


@settings(max_examples=150, **COMMON)
@given(head=st.sampled_from(["softmax", "ridge-rf"]), ops=card_ops, tensors=st.none() | tensor_specs,
       resign=st.booleans(), text=st.none() | st.sampled_from(["", "{", "[]", "null", "1e999999", '{"format": 1}']))  # fmt: skip
def test_fuzz_model_card(head, ops, tensors, resign, text, base_model, tmp_path_factory):
    import hashlib

    import torch
    from safetensors.torch import save_file

    from fedhead.federation.model import load_model

    d = tmp_path_factory.mktemp("m")
    src = base_model[head]
    for q in src.parent.glob("model-seed0*"):
        shutil.copy(q, d / q.name)
    card_path = d / src.name
    card = json.loads(card_path.read_text())
    for op in ops:
        _set(card, op[1], op[2] if op[0] == "set" else None, drop=op[0] == "drop")
    if tensors is not None:
        dt = {
            "f32": torch.float32,
            "f64": torch.float64,
            "i64": torch.int64,
            "f16": torch.float16,
            "nan": torch.float32,
        }
        made = {k: torch.zeros(shape, dtype=dt[kind]) + (float("nan") if kind == "nan" else 0) for k, (shape, kind)
                in tensors.items()}  # fmt: skip
        w = d / "model-seed0.safetensors"
        save_file(made, str(w))
        if resign and isinstance(card, dict):
            card["weights_file_sha256"] = hashlib.sha256(w.read_bytes()).hexdigest()
    card_path.write_text(text if text is not None else json.dumps(card))
    model = bounded(load_model, card_path)
    if model is not None:  # a card that loads classifies
        x = np.zeros((2, model.n_features_in_), np.float32)
        assert bounded(model.predict_proba, x) is not None


# ---------------------------------------------------------------- the experiment file


def _field_names() -> list[str]:
    from fedhead.federation.config import FIELDS

    return sorted(FIELDS)


toml_scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, -1, 2, 10, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
    st.text(max_size=12),
    st.sampled_from(["softmax", "iid", "dirichlet", "fedavg", "auto", "cpu", "0,1", "1e-3", "../x"]),
)
toml_values = st.one_of(toml_scalars, st.lists(st.integers(-3, 100), max_size=4),
                        st.lists(st.floats(-1, 2, allow_subnormal=False), max_size=3), st.dictionaries(st.text(max_size=6), toml_scalars,
                        max_size=3))  # fmt: skip


@pytest.fixture(scope="module")
def warm_config(tmp_path_factory):
    """The first TrainConfig imports the heads, partitions and plugins (seconds): before the timed examples."""
    from fedhead.federation.config import TrainConfig

    p = tmp_path_factory.mktemp("t") / "warm.toml"
    p.write_text('head = "softmax"\nclients = 4\n')
    TrainConfig.from_toml(p, features="x.h5")


@settings(max_examples=200, **COMMON)
@given(data=st.data(), raw=st.none() | st.binary(max_size=200))
def test_fuzz_experiment_file(data, raw, tmp_path_factory, warm_config):
    import tomli_w

    from fedhead.federation.config import TrainConfig, load_experiment

    keys = st.one_of(st.sampled_from(_field_names() + ["plugin_params", "out", "resume", "head_params"]),
                     st.text(min_size=1, max_size=8))  # fmt: skip
    doc = data.draw(st.dictionaries(keys, toml_values, max_size=5))
    p = tmp_path_factory.mktemp("t") / "x.toml"
    if raw is not None:
        p.write_bytes(raw)
    else:
        p.write_text(tomli_w.dumps(doc))
    fields = bounded(load_experiment, p)
    if fields is not None:
        bounded(TrainConfig.from_toml, p, features="x.h5")


# ---------------------------------------------------------------- the clients CSV


@settings(max_examples=150, **COMMON)
@given(
    rows=st.lists(st.lists(st.text(max_size=12), max_size=4), max_size=6),
    raw=st.none() | st.binary(max_size=300),
    huge=st.booleans(),
)
def test_fuzz_clients_csv(rows, raw, huge, tmp_path_factory):
    import csv

    from extract.clients import from_csv

    d = tmp_path_factory.mktemp("c")
    (d / "train" / "cat").mkdir(parents=True)
    paths = [str(d / "train" / "cat" / f"{i}.png") for i in range(3)]
    p = d / "clients.csv"
    if raw is not None:
        p.write_bytes(raw + (b"a," + b"x" * 200_000 + b"\n" if huge else b""))
    else:
        with open(p, "w", newline="", encoding="utf-8", errors="surrogatepass") as f:
            try:
                csv.writer(f).writerows(rows)
            except UnicodeEncodeError:
                pass
    got = bounded(from_csv, paths, p, d)
    if got is not None:
        assert len(got) == len(paths)
