"""The formats of extract/formats.py: the same images as an image folder, WebDataset shards, a Parquet table, a
saved Hugging Face dataset and a CSV list give the same store; natural clients from a column and a key pattern;
corrupt records named and skipped; bad input refused in one line with nothing written."""

from __future__ import annotations

import csv
import io
import json
import pickle
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from extract import formats as F
from extract.datasets import load_dataset
from extract.engines import Job, run_rank
from extract.run import extract_features
from extract.store import load_store, open_store
from fedhead.infra.errors import FedheadError

TINY, SIZE = "test_efficientnet", 32
CLASSES = ("ant", "bee", "cat")
HOLDINGS = {"alice": (2, 1, 0), "bob": (0, 2, 1), "carol": (1, 0, 2)}  # client -> training images per class
PATTERN = r"^(?P<client>[^_]+)_"


def _png(rng, c: int) -> bytes:
    base = np.array([c * 90 % 256, (c * 40 + 60) % 256, (255 - c * 70) % 256], dtype=np.float64)
    arr = np.clip(base + rng.normal(0, 25, (12, 12, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _records(root: Path) -> dict[str, list[dict]]:
    """The images of an image folder under ``root/images``, in the order the image folder reads them."""
    rng = np.random.default_rng(0)
    recs: dict[str, list[dict]] = {"train": [], "test": []}
    for c, cls in enumerate(CLASSES):
        for client, per in HOLDINGS.items():
            recs["train"] += [dict(stem=f"{client}_{i}", cls=cls, client=client) for i in range(per[c])]
        recs["test"] += [dict(stem=f"t{i}", cls=cls, client="") for i in range(2)]
    for split, rs in recs.items():
        rs.sort(key=lambda r: (CLASSES.index(r["cls"]), r["stem"]))
        for r in rs:
            r["png"] = _png(rng, CLASSES.index(r["cls"]))
            r["rel"] = f"images/{split}/{r['cls']}/{r['stem']}.png"
            (root / r["rel"]).parent.mkdir(parents=True, exist_ok=True)
            (root / r["rel"]).write_bytes(r["png"])
    return recs


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _shards(root: Path, recs) -> None:
    """train-000000.tar (labels as .cls text), train-000001.tar (labels in .json), test-000000.tar."""
    (root / "wds").mkdir()
    tr = recs["train"]
    half = len(tr) // 2
    _tar(root / "wds/train-000000.tar",
         [m for r in tr[:half] for m in ((f"{r['cls']}/{r['stem']}.png", r["png"]),
                                         (f"{r['cls']}/{r['stem']}.cls", r["cls"].encode()))])  # fmt: skip
    _tar(root / "wds/train-000001.tar",
         [m for r in tr[half:] for m in ((f"{r['cls']}/{r['stem']}.png", r["png"]),
                                         (f"{r['cls']}/{r['stem']}.json", json.dumps({"label": r["cls"]}).encode()))])  # fmt: skip
    _tar(root / "wds/test-000000.tar",
         [m for r in recs["test"] for m in ((f"{r['cls']}/{r['stem']}.png", r["png"]),
                                            (f"{r['cls']}/{r['stem']}.cls", r["cls"].encode()))])  # fmt: skip


def _parquet(root: Path, recs) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "pq").mkdir()
    for split, rs in recs.items():
        image = (
            pa.array([{"bytes": r["png"], "path": r["rel"]} for r in rs])
            if split == "train"
            else pa.array([r["png"] for r in rs], pa.binary())
        )  # fmt: skip  (the HF struct, plain bytes)
        t = pa.table({"img": image, "label": [r["cls"] for r in rs], "owner": [r["client"] for r in rs]})
        pq.write_table(t, root / f"pq/{split}-00000-of-00001.parquet", row_group_size=4)


def _hf(root: Path, recs) -> None:
    import datasets

    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES)),
                               "who": datasets.Value("string")})  # fmt: skip
    dd = datasets.DatasetDict({
        s: datasets.Dataset.from_dict({"image": [{"bytes": r["png"], "path": None} for r in rs],
                                       "label": [CLASSES.index(r["cls"]) for r in rs],
                                       "who": [r["client"] for r in rs]}, features=feats)
        for s, rs in recs.items()
    })  # fmt: skip
    dd.save_to_disk(str(root / "hf"))


def _list(root: Path, recs) -> None:
    with open(root / "list.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "client", "split"])
        for split, rs in recs.items():
            for r in rs:
                w.writerow([r["rel"], r["cls"], r["client"], split])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("formats")
    recs = _records(root)
    _shards(root, recs)
    _parquet(root, recs)
    _hf(root, recs)
    _list(root, recs)
    return root


def _extract(dataset: str, data_dir, out: Path, **kw) -> Path:
    return extract_features(
        dataset, data_dir, TINY, pretrained=False, image_size=SIZE, out=out, progress=False, batch_size=4, **kw
    )


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.h5"
    return load_store(_extract("imagefolder", data / "images", out, client_pattern=PATTERN))


FORMATS = {
    "webdataset": lambda d: (
        None,
        dict(
            train_shards=str(d / "wds/train-{000000..000001}.tar"),
            test_shards=str(d / "wds/test-*.tar"),
            client_pattern=PATTERN,
            num_workers=1,
        ),
    ),  # fmt: skip
    "parquet": lambda d: (d / "pq", dict(image_column="img", client_column="owner", num_workers=1)),
    "hf-disk": lambda d: (d / "hf", dict(client_column="who")),
    "filelist": lambda d: (d / "list.csv", dict(client_column="client")),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_gives_the_image_folders_store(fmt, data, reference, tmp_path):
    data_dir, kw = FORMATS[fmt](data)
    s = load_store(_extract(fmt, data_dir, tmp_path / "s.h5", **kw))
    assert s.info.class_names == list(CLASSES) == reference.info.class_names
    for a, b in ((s.train_x, reference.train_x), (s.test_x, reference.test_x), (s.train_y, reference.train_y),
                 (s.test_y, reference.test_y)):  # fmt: skip
        assert np.array_equal(a, b)
    # natural clients: from a column, or the pattern on the WebDataset key / the file name
    assert s.info.client_names == reference.info.client_names == sorted(HOLDINGS)
    assert np.array_equal(s.train_clients, reference.train_clients)
    request = open_store(s.info.path).attrs["request"]
    assert set(request["records_sha256"]) == {"train", "test"}


def test_class_names_rule_and_label_kinds():
    def scan(raw, names=None):
        kinds = {}
        for k, v in enumerate(raw):
            if v is not None:
                kinds.setdefault(F._kind(v), f"part{k}")
        return F.Scan("--data-dir", names=[f"r{k}" for k in range(len(raw))], raw=raw, kinds=kinds, class_names=names)

    tr = scan([2, 0, None, 2])
    assert F.to_split("parquet", "train", tr, tr, True).class_names == ["0", "1", "2"]
    te = scan([1, 2])
    assert F.to_split("parquet", "test", te, tr, True).labels.tolist() == [1, 2]
    with pytest.raises(FedheadError, match="label 3, which no training record has"):
        F.to_split("parquet", "test", scan([3]), tr, True)
    trs = scan(["cat", "ant"])
    assert F.to_split("parquet", "train", trs, trs, True).class_names == ["ant", "cat"]
    with pytest.raises(FedheadError, match="'bee', which no training record has"):
        F.to_split("parquet", "test", scan(["bee"]), trs, True)
    with pytest.raises(FedheadError, match="two kinds of label"):
        F.to_split("parquet", "test", scan(["ant"]), tr, True)
    named = scan([0, 1], names=["x", "y"])
    assert F.to_split("hf-disk", "train", named, named, True).class_names == ["x", "y"]


def test_sources_pickle_and_subset(data):
    """A split's records read the same after pickling (DataLoader workers) and through a --limit subset."""
    splits = [
        load_dataset("webdataset", data / "wds", "train", options={}),
        load_dataset("parquet", data / "pq", "train", options={"image_column": "img"}),
        load_dataset("hf-disk", data / "hf", "train", options={}),
    ]
    for split in splits:
        first = split.source.read(0)
        again = pickle.loads(pickle.dumps(split))
        assert again.source.read(0) == first and again.paths == split.paths
        idx = np.array([1, len(split) - 1])
        sub = split.subset(idx)
        assert [sub.source.read(k) for k in range(2)] == [split.source.read(int(i)) for i in idx]
        assert sub.paths == [split.paths[int(i)] for i in idx] and np.array_equal(sub.labels, split.labels[idx])
        assert np.array_equal(sub.image(0), split.image(1))


def test_other_spellings_read_the_same_records(data, tmp_path):
    """Arrow IPC (feather file, stream) tables read as the Parquet ones; a JSON-lines list and a folder of
    train.csv/test.csv read as the CSV list with a split column."""
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    (tmp_path / "arrow").mkdir()
    for split in ("train", "test"):
        t = pq.read_table(data / f"pq/{split}-00000-of-00001.parquet")
        if split == "train":
            feather.write_feather(t, tmp_path / "arrow/train.feather", chunksize=3)
        else:
            with pa.ipc.new_stream(tmp_path / "arrow/test.arrow", t.schema) as w:
                w.write_table(t, max_chunksize=3)
    opts = {"image_column": "img", "client_column": "owner"}
    for split in ("train", "test"):
        a, b = (load_dataset("parquet", d, split, options=opts) for d in (data / "pq", tmp_path / "arrow"))
        assert np.array_equal(a.labels, b.labels) and a.class_names == b.class_names
        assert all(a.source.read(i) == b.source.read(i) for i in range(len(a)))
    rows = list(csv.DictReader(open(data / "list.csv")))
    jsonl = "".join(json.dumps(r) + "\n" for r in rows)
    for split in ("train", "test"):  # header-less: path,label,client
        lines = [f"{r['path']},{r['label']},{r['client']}\n" for r in rows if r["split"] == split]
        (data / f"{split}.csv").write_text("".join(lines))
    (data / "list.jsonl").write_text(jsonl)
    for split in ("train", "test"):
        ref = load_dataset("filelist", data / "list.csv", split, options={"client_column": "client"})
        for d in (data / "list.jsonl", data):
            got = load_dataset("filelist", d, split, options={"client_column": "client"})
            assert np.array_equal(ref.labels, got.labels) and ref.class_names == got.class_names
            assert ref.paths == got.paths and (split == "test" or np.array_equal(ref.clients, got.clients))
    (tmp_path / "list.jsonl").write_text(jsonl)
    (tmp_path / "images").symlink_to(data / "images")
    with pytest.raises(FedheadError, match="outside its folder"):  # a symlink out of the list's folder
        load_dataset("filelist", tmp_path / "list.jsonl", "train", options={})


def test_a_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "braceexpand", None)  # import braceexpand then raises ImportError
    with pytest.raises(FedheadError, match=r"pip install 'fedhead\[data\]'"):
        F.expand("x-{0..1}.tar", "--train-shards")


def test_corrupt_records_are_named_and_skipped(data, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = (data / "images/train/ant/alice_0.png").read_bytes()
    _tar(tmp_path / "train-0.tar", [("a.png", good), ("a.cls", b"ant"), ("b.png", b"not a png"), ("b.cls", b"ant"),
                                    ("c.cls", b"bee"), ("d.png", good), ("d.pyd", b"\x80\x04K\x01."),
                                    ("e.png", good), ("e.cls", b"bee")])  # fmt: skip
    _tar(tmp_path / "test-0.tar", [("t.png", good), ("t.cls", b"ant")])
    bad = load_dataset("webdataset", tmp_path, "train", options={}).source.bad
    assert bad[2].startswith("no image member") and "its .pyd member is never unpickled" in bad[3] and len(bad) == 2
    with pytest.raises(FedheadError, match=r"train-0\.tar:b' is not an image"):
        _extract("webdataset", tmp_path, tmp_path / "w.h5")
    path = _extract("webdataset", tmp_path, tmp_path / "w.h5", skip_corrupt=True)
    info = open_store(path)
    assert [p.rsplit(":", 1)[1] for p in info.skipped["train"]] == ["b", "c", "d"]
    assert load_store(path).train_y.tolist() == [0, 1]
    (tmp_path / "pq").mkdir()
    for split in ("train", "test"):
        pq.write_table(pa.table({"image": pa.array([good, None, good], pa.binary()), "label": [0, 1, 1]}),
                       tmp_path / f"pq/{split}.parquet")  # fmt: skip
    with pytest.raises(FedheadError, match=r"train\.parquet:1' is no image bytes"):
        _extract("parquet", tmp_path / "pq", tmp_path / "p.h5")
    info = open_store(_extract("parquet", tmp_path / "pq", tmp_path / "p.h5", skip_corrupt=True))
    assert info.skipped["train"] == [str((tmp_path / "pq/train.parquet").resolve()) + ":1"]


def _bad_inputs(d: Path, tmp: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp / "notar").mkdir()
    (tmp / "notar/train-0.tar").write_bytes(b"this is no tar file" * 10)
    (tmp / "notar/test-0.tar").write_bytes(b"this is no tar file" * 10)
    (tmp / "notpq").mkdir()
    for split in ("train", "test"):
        (tmp / f"notpq/{split}.parquet").write_bytes(b"PAR1 but not parquet" * 10)
    (tmp / "empty").mkdir()
    for split in ("train", "test"):
        pq.write_table(pa.table({"image": pa.array([], pa.binary()), "label": pa.array([], pa.int64())}),
                       tmp / f"empty/{split}.parquet")  # fmt: skip
    (tmp / "kinds").mkdir()
    png = (d / "images/train/ant/alice_0.png").read_bytes()
    _tar(tmp / "kinds/train-0.tar", [("a.png", png), ("a.cls", b"0")])
    _tar(tmp / "kinds/train-1.tar", [("b.png", png), ("b.cls", b"ant")])
    _tar(tmp / "kinds/test-0.tar", [("c.png", png), ("c.cls", b"0")])
    (tmp / "unseen").mkdir()
    _tar(tmp / "unseen/train-0.tar", [("a.png", png), ("a.cls", b"ant")])
    _tar(tmp / "unseen/test-0.tar", [("c.png", png), ("c.cls", b"zebra")])
    (tmp / "out.csv").write_text("path,label,split\n../escape.png,ant,train\n")
    wds = ["--dataset", "webdataset"]
    return {
        "no shard": (
            wds
            + [
                "--train-shards",
                str(d / "wds/train-{000007..000008}.tar"),
                "--test-shards",
                str(d / "wds/test-000000.tar"),
            ],
            "'--train-shards' parameter matches no file",
        ),  # fmt: skip
        "not a tar": (wds + ["--data-dir", str(tmp / "notar")], "not a readable uncompressed tar shard"),
        "no column": (["--dataset", "parquet", "--data-dir", str(d / "pq")], "lacks (it has: img, label, owner)"),
        "not a table": (["--dataset", "parquet", "--data-dir", str(tmp / "notpq")], "not a readable Parquet or Arrow"),
        "empty table": (["--dataset", "parquet", "--data-dir", str(tmp / "empty")], "Got an empty train split"),
        "label kinds": (wds + ["--data-dir", str(tmp / "kinds")], "train-0.tar' holds integer labels"),
        "unseen label": (wds + ["--data-dir", str(tmp / "unseen")], "'zebra', which no training record has"),
        "escaping path": (["--dataset", "filelist", "--data-dir", str(tmp / "out.csv")], "outside its folder"),
        "option elsewhere": (
            ["--dataset", "imagefolder", "--data-dir", str(d / "images"), "--image-column", "x"],
            "'--image-column' parameter applies to --dataset filelist, hf-disk, parquet",
        ),  # fmt: skip
        "pattern on a table": (
            ["--dataset", "parquet", "--data-dir", str(d / "pq"), "--image-column", "img", "--client-pattern", PATTERN],
            "Use --client-column",
        ),  # fmt: skip
    }


def test_bad_inputs_one_line_nothing_written(data, tmp_path, monkeypatch):
    from cli import app

    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)
    out = tmp_path / "a.h5"
    for case, (args, needle) in _bad_inputs(data, tmp_path).items():
        r = CliRunner().invoke(app, ["extract", *args, "--encoder", TINY, "--no-pretrained", "--out", str(out)])
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.exit_code == 2, (case, r.exit_code, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, r.stderr)
        assert needle in lines[0], (case, lines[0])
        assert not out.exists() and not Path(str(out) + ".partial").exists(), case


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_sharded_extraction_of_a_format_equals_its_one_process_store(fmt, data, tmp_path):
    """The shard/part/merge path (extract/shards.py) over records of tar shards and tables: the same store, natural
    clients included, as one process gives (the formats' options reach each rank's prepare)."""
    data_dir, kw = FORMATS[fmt](data)
    kw = {**kw, "num_workers": 0, "threads": 1}
    one = _extract(fmt, data_dir, tmp_path / "one.h5", **kw)
    kw = {**kw, "pretrained": False, "image_size": SIZE, "batch_size": 4}
    out = tmp_path / "sharded.h5"
    run_rank(Job(fmt, data_dir, TINY, kw, out=out, shard_images=4, progress=False), 0, 1)
    a, b = load_store(one), load_store(out)
    assert open_store(one).attrs["content_sha256"] == open_store(out).attrs["content_sha256"]
    assert open_store(one).attrs["request"] == open_store(out).attrs["request"]
    assert np.array_equal(a.train_clients, b.train_clients) and a.info.client_names == b.info.client_names
