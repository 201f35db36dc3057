"""Features without a store (issue 41): ``fedhead.FeatureStore.from_arrays`` gives the store the trainer consumes with
the content hash of the store written from the same arrays; ``fedhead.run(features=(X, y, X_test, y_test))`` is the
run on that store (same summary, same rows) and keeps the store in its run directory, so the run resumes; ``fedhead
import`` turns .npy pairs, one .npz, Parquet embedding columns and clip-retrieval output folders into that same store,
and refuses bad files in one line, writing nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import crash_at, one_line_error
from typer.testing import CliRunner

import fedhead
from cli import app
from extract.arrays import FeatureStore
from extract.store import load_store, open_store, store_content_hash, write_store
from fedhead.federation import job as job_module
from fedhead.infra.errors import FedheadError

runner = CliRunner()
CLASSES = ["cat", "dog", "emu"]
FAST = dict(clients=4, partition="dirichlet", alpha=0.5, min_size=0, device="cpu", plots=False)


def _arrays(seed: int = 0, n: int = 90, m: int = 30, d: int = 6):
    """Separable features (rounded to float16 values, which every reader keeps exactly) and labels 0..2."""
    rng = np.random.default_rng(seed)
    y, yt = rng.integers(0, 3, n), rng.integers(0, 3, m)
    centres = rng.normal(size=(3, d)) * 3
    x = (centres[y] + rng.normal(size=(n, d))).astype("f2").astype("f4")
    xt = (centres[yt] + rng.normal(size=(m, d))).astype("f2").astype("f4")
    return x, y, xt, yt


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The arrays, the store written from them (class names CLASSES) and its content hash."""
    d = tmp_path_factory.mktemp("import")
    x, y, xt, yt = _arrays()
    ref = write_store(d / "ref.h5", train=(x, y), test=(xt, yt), class_names=CLASSES, attrs={"dataset": "arrays"})
    return {"dir": d, "arrays": (x, y, xt, yt), "store": ref, "sha": store_content_hash(load_store(ref))}


# ---------------------------------------------------------------- FeatureStore.from_arrays


def test_from_arrays_has_the_content_hash_of_the_store_written_from_them(data, tmp_path):
    x, y, xt, yt = data["arrays"]
    s = fedhead.FeatureStore.from_arrays(x.astype("f8"), y, xt, yt, class_names=CLASSES)
    assert s.content_sha256 == data["sha"] == store_content_hash(s)
    assert s.train_x.dtype == np.float32 and s.info.num_classes == 3 and s.in_memory
    names = np.array(CLASSES)  # string labels map to the sorted training labels: the same classes, the same hash
    assert FeatureStore.from_arrays(x, names[y], xt, names[yt]).content_sha256 == data["sha"]
    saved = s.save(tmp_path / "s.h5")
    back = FeatureStore.load(saved)
    assert back.content_sha256 == open_store(saved).attrs["content_sha256"] == data["sha"]
    assert np.array_equal(back.train_x, x) and back.info.class_names == CLASSES and not back.in_memory
    raw = np.array(["b", "a", "c"])[y % 3]  # natural clients by name: ids into the sorted names
    ids = FeatureStore.from_arrays(x, y, xt, yt, clients=raw)
    assert ids.info.client_names == ["a", "b", "c"] and ids.train_clients.tolist() == ["abc".index(v) for v in raw]
    assert load_store(ids.save(tmp_path / "c.h5")).info.client_names == ["a", "b", "c"]


def _bad(x, y, xt, yt):
    nan = x.copy()
    nan[4, 1] = np.nan
    return [
        (dict(y_test=yt.astype("f8")), "y_test", "integer or string labels"),
        (dict(X_test=xt[:, :4]), "X_test", "dimension of 'X' (6)"),
        (dict(y=y[:10]), "y", "one label per row of 'X' (90 rows)"),
        (dict(X=nan), "X", "NaN or inf in row 4"),
        (dict(X=x[:, 0]), "X", "2-D array"),
        (dict(X=np.array([["a"] * 6] * 90)), "X", "real numbers"),
        (dict(y_test=yt + 3), "y_test", "class indices in 0..2"),
        (dict(y=-y), "y", "class indices"),
        (dict(class_names=["a", "a", "b"]), "class_names", "distinct"),
        (dict(y=np.array(CLASSES)[y]), "y_test", "same kind"),
        (dict(clients=np.arange(5)), "clients", "one label per row"),
        (dict(X=np.full((90, 6), 1e39)), "X", "beyond float32's range"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_from_arrays_refuses_bad_arrays_in_one_line_naming_the_parameter(data, case):
    x, y, xt, yt = data["arrays"]
    change, param, text = _bad(x, y, xt, yt)[case]
    kw = {"X": x, "y": y, "X_test": xt, "y_test": yt, "class_names": CLASSES if case >= 6 and case != 7 else None,
          **change}  # fmt: skip
    with pytest.raises(FedheadError) as exc:
        FeatureStore.from_arrays(**kw)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"The '{param}' parameter ") and text in msg and " Got " in msg, msg


def test_string_test_labels_must_be_training_classes(data):
    x, y, xt, yt = data["arrays"]
    names = np.array(["cat", "dog", "yak"])
    with pytest.raises(FedheadError, match=r"^The 'y_test' parameter must be labels among the classes .*'yak'"):
        FeatureStore.from_arrays(x, np.array(CLASSES)[y], xt, names[yt])


# ---------------------------------------------------------------- fedhead.run on arrays


def _same_rows(a: list[dict], b: list[dict]) -> bool:
    """Rows equal but for what the clock measures (NaN equal to NaN)."""
    timed = ("client_ms", "server_ms")

    def same(u, v):
        return u == v or (isinstance(u, float) and isinstance(v, float) and math.isnan(u) and math.isnan(v))

    return len(a) == len(b) and all(same(r[k], s[k]) for r, s in zip(a, b) for k in r if k not in timed)


ACCURACIES = ("final_accuracy", "val_accuracy", "test_accuracy_at_selected", "selected_round", "acc95_round")


@pytest.mark.parametrize("head, extra", [("ridge", {}), ("ova2", {"rounds": 2})])
def test_run_on_arrays_equals_the_run_on_their_store_and_resumes(data, tmp_path, head, extra):
    x, y, xt, yt = data["arrays"]
    kw = {**FAST, "head": head, **extra}
    on_store = fedhead.run(features=str(data["store"]), out=tmp_path / "store", **kw)
    on_arrays = fedhead.run(features=(x, y, xt, yt), out=tmp_path / "arrays", **kw)
    for k in ACCURACIES:
        assert on_store.summary[k] == on_arrays.summary[k], k
    assert _same_rows(on_store.rows, on_arrays.rows)
    # the run keeps its store: config.toml names it, its content is the arrays', the run resumes from its own files
    kept = tmp_path / "arrays" / "features.h5"
    assert 'features = "' + str(kept.resolve()) + '"' in (tmp_path / "arrays" / "config.toml").read_text()
    record = json.loads((tmp_path / "arrays" / "config.json").read_text())["store"]
    assert record["content_sha256"] == FeatureStore.from_arrays(x, y, xt, yt).content_sha256
    assert store_content_hash(load_store(kept)) == record["content_sha256"]
    model = fedhead.load_model(tmp_path / "arrays")  # the run's model, like any other run's
    assert list(model.classes_) == ["0", "1", "2"] and (model.predict(xt) == yt.astype(str)).mean() > 0.5
    again = fedhead.run(out=tmp_path / "arrays", resume=True)
    assert again.summary["final_accuracy"] == on_arrays.summary["final_accuracy"]
    same = fedhead.run(features=FeatureStore.from_arrays(x, y, xt, yt), out=tmp_path / "arrays", resume=True, **kw)
    assert same.summary["final_accuracy"] == on_arrays.summary["final_accuracy"]
    other = FeatureStore.from_arrays(x, y, xt, yt, class_names=CLASSES)  # other class names: another store
    with pytest.raises(FedheadError, match=r"different configuration: the feature store's content \(sha256\)"):
        fedhead.run(features=other, out=tmp_path / "arrays", resume=True, **kw)


def test_an_interrupted_run_on_arrays_resumes_from_its_own_directory(data, tmp_path, monkeypatch):
    """The run directory holds the store (features.h5, named by config.toml): ``run(out=DIR, resume=True)`` alone
    continues a run on arrays that was cut mid-way, to the rows of the uninterrupted run."""
    kw = {**FAST, "head": "ova2", "rounds": 3}
    full = fedhead.run(features=data["arrays"], out=tmp_path / "full", **kw)
    restore = crash_at(monkeypatch, job_module, "evaluate", 2)
    with pytest.raises(KeyboardInterrupt):
        fedhead.run(features=data["arrays"], out=tmp_path / "cut", **kw)
    restore()
    assert (tmp_path / "cut" / "features.h5").is_file() and not (tmp_path / "cut" / "summary.json").exists()
    resumed = fedhead.run(out=tmp_path / "cut", resume=True)
    assert _same_rows(resumed.rows, full.rows)


def test_run_takes_a_store_read_from_a_file_and_refuses_other_features(data, tmp_path):
    loaded = FeatureStore.load(data["store"])
    res = fedhead.run(features=loaded, out=tmp_path / "r", head="ridge", **FAST)
    assert not (tmp_path / "r" / "features.h5").exists()  # the file it came from is the run's store
    assert json.loads((tmp_path / "r" / "config.json").read_text())["store"]["path"] == str(data["store"])
    assert res.summary["final_accuracy"] > 0.5
    with pytest.raises(FedheadError, match=r"^The 'features' parameter must be a store file, a FeatureStore"):
        fedhead.run(features=data["arrays"][:3], out=tmp_path / "b", head="ridge", **FAST)
    assert not (tmp_path / "b").exists()
    x, y, xt, yt = data["arrays"]
    with pytest.raises(FedheadError, match=r"^The 'X_test' parameter must be features of the dimension"):
        fedhead.run(features=(x, y, xt[:, :2], yt), out=tmp_path / "c", head="ridge", **FAST)
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------- fedhead import


def _table(x, labels, **more) -> pa.Table:
    return pa.table({"embedding": pa.array(list(x), pa.list_(pa.float32())), "label": labels, **more})


@pytest.fixture(scope="module")
def files(data):
    """The arrays as every source fedhead import reads."""
    d = data["dir"] / "files"
    d.mkdir()
    x, y, xt, yt = data["arrays"]
    for name, a in {"X": x, "y": y, "Xt": xt, "yt": yt}.items():
        np.save(d / f"{name}.npy", a)
    (d / "names.txt").write_text("\n".join(CLASSES) + "\n")
    np.savez(d / "a.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    np.savez_compressed(d / "b.npz", xa=x, ya=y, xb=xt, yb=yt)
    names = np.array(CLASSES)
    pq.write_table(_table(x, names[y]), d / "train.parquet")
    fixed = pa.array(list(xt), pa.list_(pa.float32(), x.shape[1]))  # fixed_size_list, as some writers store it
    pq.write_table(pa.table({"embedding": fixed, "label": names[yt]}), d / "test.parquet")
    for split, (xs, ys) in {"clip-train": (x, y), "clip-test": (xt, yt)}.items():
        (d / split / "img_emb").mkdir(parents=True)
        (d / split / "metadata").mkdir()
        for i, (a, b) in enumerate([(0, len(xs) // 3), (len(xs) // 3, len(xs))]):  # two shards, as clip-retrieval
            np.save(d / split / f"img_emb/img_emb_{i}.npy", xs[a:b].astype("f2"))  # writes float16 embeddings
            meta = pa.table({"url": [f"https://x/{j}.jpg" for j in range(a, b)], "label": names[ys[a:b]]})
            if split == "clip-test" and i == 1:
                meta.to_pandas().to_csv(d / split / f"metadata/metadata_{i}.csv", index=False)
            else:
                pq.write_table(meta, d / split / f"metadata/metadata_{i}.parquet")
    np.save(d / "emb.npy", x)  # one clip-retrieval shard named directly: embeddings + its metadata table
    pq.write_table(pa.table({"caption": ["c"] * len(y), "label": names[y], "site": np.array(["s1", "s2"])[y % 2]}),
                   d / "meta.parquet")  # fmt: skip
    return d


SOURCES = {
    "npy": lambda d: [
        "--train",
        d / "X.npy",
        "--train-labels",
        d / "y.npy",
        "--test",
        d / "Xt.npy",
        "--test-labels",
        d / "yt.npy",
        "--class-names",
        d / "names.txt",
    ],  # fmt: skip
    "npz": lambda d: ["--npz", d / "a.npz", "--class-names", d / "names.txt"],
    "npz-keys": lambda d: ["--npz", d / "b.npz", "--keys", "xa,ya,xb,yb", "--class-names", d / "names.txt"],
    "parquet": lambda d: ["--train", d / "train.parquet", "--test", d / "test.parquet"],
    "clip-folder": lambda d: ["--train", d / "clip-train", "--test", d / "clip-test"],
    "clip-shard": lambda d: [
        "--train",
        d / "emb.npy",
        "--train-labels",
        d / "meta.parquet",
        "--test",
        d / "test.parquet",
    ],  # fmt: skip
}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_import_writes_the_store_write_store_writes(data, files, tmp_path, source):
    out = tmp_path / "s.h5"
    res = runner.invoke(app, ["import", *map(str, SOURCES[source](files)), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(out)
    store = load_store(out)
    assert store_content_hash(store) == open_store(out).attrs["content_sha256"] == data["sha"]
    assert store.info.class_names == CLASSES and store.info.attrs["source"] == "import"
    again = runner.invoke(app, ["import", *map(str, SOURCES[source](files)), "--out", str(out)])
    assert again.exit_code == 0, again.output  # the same content at --out: kept
    if source == "npz":  # float16 halves the store; its features are float16 already, so its content is the same
        half = tmp_path / "half.h5"
        for _ in range(2):  # the second run finds the same content there
            res = runner.invoke(app, ["import", *map(str, SOURCES[source](files)), "--out", str(half), "--dtype",
                                      "float16"])  # fmt: skip
            assert res.exit_code == 0, res.output
        assert open_store(half).attrs["dtype"] == "float16" and store_content_hash(load_store(half)) == data["sha"]


def test_imported_store_trains_with_fedhead_train_and_natural_clients(files, tmp_path):
    out = tmp_path / "s.h5"
    args = ["--train", files / "emb.npy", "--train-labels", files / "meta.parquet", "--clients", "site", "--test",
            files / "test.parquet"]  # fmt: skip
    assert runner.invoke(app, ["import", *map(str, args), "--out", str(out), "--name", "mine"]).exit_code == 0
    info = open_store(out)
    assert info.client_names == ["s1", "s2"] and info.dataset == "mine"
    for partition in ("iid", "natural"):
        run = tmp_path / partition
        res = runner.invoke(app, ["train", "--features", str(out), "--head", "ridge", "--partition", partition,
                                  "--clients", "2", "--device", "cpu", "--no-plots", "--out", str(run)])  # fmt: skip
        assert res.exit_code == 0, res.output
        assert json.loads((run / "summary.json").read_text())["final_accuracy"] > 0.5
    res = runner.invoke(app, ["predict", "--model", str(run), "--features", str(out), "--out", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output  # no encoder: the model classifies the store's features
    np.save(tmp_path / "c.npy", np.arange(90) % 3)  # with .npy labels, the clients are a .npy file too
    args = ["--train", files / "X.npy", "--train-labels", files / "y.npy", "--test", files / "Xt.npy", "--test-labels",
            files / "yt.npy", "--clients", tmp_path / "c.npy", "--out", tmp_path / "c.h5"]  # fmt: skip
    assert runner.invoke(app, ["import", *map(str, args)]).exit_code == 0
    assert load_store(tmp_path / "c.h5").train_clients.tolist() == (np.arange(90) % 3).tolist()


def _bad_files(d: Path, files: Path, x, y, xt, yt) -> dict:
    """name -> (the import's arguments, a phrase of its one-line refusal)."""
    np.save(d / "y50.npy", y[:50])
    nan = x.copy()
    nan[7, 2] = np.inf
    np.save(d / "Xnan.npy", nan)
    np.save(d / "obj.npy", np.array([{"a": 1}] * len(y), dtype=object), allow_pickle=True)
    np.save(d / "Xt5.npy", xt[:, :5])
    (d / "trunc.npy").write_bytes((files / "X.npy").read_bytes()[:-40])
    (d / "notnpy.npy").write_bytes(b"PK\x03\x04 not an array")
    np.savez(d / "keys.npz", x_train=x, y_train=y, x_test=xt)
    names = np.array(["cat", "dog", "yak"])
    pq.write_table(_table(xt, names[yt]), d / "te_yak.parquet")
    pq.write_table(pa.table({"emb": pa.array(list(x), pa.list_(pa.float32())), "label": y}), d / "tr_emb.parquet")
    ragged = pa.array([list(r) for r in x[:-1]] + [list(x[-1][:3])], pa.list_(pa.float32()))
    pq.write_table(pa.table({"embedding": ragged, "label": np.array(CLASSES)[y]}), d / "ragged.parquet")
    npy = {"--train": files / "X.npy", "--train-labels": files / "y.npy", "--test": files / "Xt.npy",
           "--test-labels": files / "yt.npy"}  # fmt: skip

    def args(**change):
        return [str(v) for k, p in {**npy, **{f"--{k.replace('_', '-')}": v for k, v in change.items()}}.items()
                for v in (k, p)]  # fmt: skip

    return {
        "rows": (args(train_labels=d / "y50.npy"), "one label per row of '--train' (90 rows)"),
        "nan": (args(train=d / "Xnan.npy"), "'--train' parameter must be finite numbers"),
        "object": (args(train_labels=d / "obj.npy"), "an array of Python objects"),
        "dim": (args(test=d / "Xt5.npy"), "'--test' parameter must be features of the dimension of '--train' (6)"),
        "truncated": (args(train=d / "trunc.npy"), "whose header claims (90, 6) float32"),
        "not-npy": (args(train=d / "notnpy.npy"), "which is not a .npy array"),
        "missing-file": (args(train=d / "none.npy"), "which does not exist"),
        "column": (
            ["--train", str(d / "tr_emb.parquet"), "--test", str(files / "test.parquet")],
            "has no column 'embedding' (its columns: emb, label)",
        ),  # fmt: skip
        "client-column": (
            ["--train", str(files / "train.parquet"), "--test", str(files / "test.parquet"), "--clients", "site"],
            "has no column 'site' (its columns: embedding, label)",
        ),  # fmt: skip
        "npz-name": (["--npz", str(d / "keys.npz")], "holds no array 'y_test' (it holds: x_test, x_train, y_train)"),
        "test-class": (
            ["--train", str(files / "train.parquet"), "--test", str(d / "te_yak.parquet")],
            "must be labels among the classes",
        ),  # fmt: skip
        "ragged": (
            ["--train", str(d / "ragged.parquet"), "--test", str(files / "test.parquet")],
            "whose embeddings differ in length",
        ),  # fmt: skip
        "no-labels": (
            ["--train", str(files / "X.npy"), "--test", str(files / "Xt.npy")],
            "'--train-labels' parameter is required",
        ),  # fmt: skip
    }


BAD = ["rows", "nan", "object", "dim", "truncated", "not-npy", "missing-file", "column", "client-column", "npz-name",
       "test-class", "ragged", "no-labels"]  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_import_refuses_bad_files_in_one_line_and_writes_nothing(data, files, tmp_path, case):
    args, phrase = _bad_files(tmp_path, files, *data["arrays"])[case]
    out = tmp_path / "out" / "s.h5"
    line = one_line_error(runner.invoke(app, ["import", *args, "--out", str(out)]))
    assert phrase in line, line
    assert not out.exists() and not Path(str(out) + ".partial").exists()


def test_import_keeps_other_features_at_out_unless_overwrite(files, tmp_path):
    out = tmp_path / "s.h5"
    write_store(out, train=(np.ones((3, 2), "f4"), np.zeros(3, int)), test=(np.ones((1, 2), "f4"), np.zeros(1, int)),
                class_names=["a"], attrs={})  # fmt: skip
    before = out.read_bytes()
    args = ["import", "--npz", str(files / "a.npz"), "--out", str(out)]
    assert "--overwrite" in one_line_error(runner.invoke(app, args))
    assert out.read_bytes() == before
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 0
    assert load_store(out).info.num_classes == 3
    npz = tmp_path / "a.npz"
    npz.write_bytes((files / "a.npz").read_bytes())
    line = one_line_error(runner.invoke(app, ["import", "--npz", str(npz), "--out", str(npz), "--overwrite"]))
    assert "one of the files it reads" in line and npz.read_bytes() == (files / "a.npz").read_bytes()


def test_import_refuses_hostile_files_before_allocating(data, files, tmp_path):
    """A .npy or .npz member whose header claims a huge array (a few bytes on disk) and a clip-retrieval shard that
    is a symlink out of its folder: one line each, nothing allocated or written."""
    import zipfile

    bomb = tmp_path / "bomb.npy"
    with open(bomb, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (10**9, 1000)})
        f.write(b"\0" * 64)
    zbomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(zbomb, "w", zipfile.ZIP_DEFLATED) as z:
        for k in ("x_train", "y_train", "x_test", "y_test"):
            z.writestr(f"{k}.npy", bomb.read_bytes())
    clip = tmp_path / "clip"
    (clip / "img_emb").mkdir(parents=True)
    (clip / "metadata").mkdir()
    (clip / "img_emb" / "img_emb_0.npy").symlink_to(files / "X.npy")  # outside the folder
    (clip / "metadata" / "metadata_0.parquet").write_bytes((files / "meta.parquet").read_bytes())
    out = tmp_path / "s.h5"
    cases = [
        (
            [
                "--train",
                bomb,
                "--train-labels",
                files / "y.npy",
                "--test",
                files / "Xt.npy",
                "--test-labels",
                files / "yt.npy",
            ],
            "whose header claims (1000000000, 1000) float32",
        ),  # fmt: skip
        (["--npz", zbomb], "whose header claims (1000000000, 1000) float32"),
        (["--train", clip, "--test", files / "test.parquet"], "outside its folder"),
    ]
    for args, phrase in cases:
        line = one_line_error(runner.invoke(app, ["import", *map(str, args), "--out", str(out)]))
        assert phrase in line, line
        assert not out.exists() and not Path(str(out) + ".partial").exists()
