"""A run's model (issue 23): the card and weights every run writes, ``fedhead predict`` on features and on images,
``fedhead.load_model``, and ``fedhead export`` (ONNX and TorchScript) against predict on the same images."""

import csv
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

import cli
import fedhead
from extract.store import load_store
from fedhead.core.synthetic import write_synthetic
from fedhead.federation.config import TrainConfig
from fedhead.federation.train import run_training

runner = CliRunner()
TINY = "test_efficientnet"  # timm's tiny test model, random init: a real encoder in a fraction of a second
CLASSES = ("ant", "bee", "cat")


def _train(store, out, head, **kw):
    opts = {} if head in ("ridge", "qda", "ridge-rf", "fedpft") else {"center": True, "scale": "rms", "rounds": 2}
    cfg = TrainConfig(features=str(store), head=head, clients=4, partition="shard", iid_reference=True, **opts, **kw)
    return run_training(cfg, out=out, progress=False)


def _one_line_error(res) -> str:
    assert res.exit_code != 0, res.output
    assert "Traceback" not in res.output, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def _correct(csv_path: Path) -> int:
    rows = list(csv.DictReader(open(csv_path)))
    return sum(r["label"] == r["class_1"] for r in rows)


# ---------------------------------------------------------------- features: train -> predict gives the run's numbers


@pytest.mark.parametrize("head", ["softmax", "ova2", "ridge", "qda", "ridge-rf"])
def test_train_then_predict_features_gives_the_summarys_count_of_correct(head, tiny_store, tmp_path):
    res = _train(tiny_store, tmp_path / "run", head)
    n = len(load_store(tiny_store).test_y)
    want = round(res.summary["final_accuracy"] * n)
    r = runner.invoke(cli.app, ["predict", "--model", str(res.run_dir), "--features", str(tiny_store), "--split",
                                "test", "--out", str(tmp_path / "p.csv"), "--top-k", "2"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert _correct(tmp_path / "p.csv") == want
    assert f"({want} of {n})" in r.stdout
    card = json.loads((res.run_dir / "model-seed0.json").read_text())
    assert card["metrics"]["test_correct"] == want and card["head"]["kind"] == head
    assert card["head"]["probabilities"] == ("sigmoid" if head == "ova2" else "softmax")
    assert card["features"]["centered"] is (head not in ("ridge", "qda", "ridge-rf"))
    # the IID reference's model is the IID run's head
    iid = fedhead.load_model(res.run_dir / "model-seed0-iid.json")
    s = load_store(tiny_store)
    assert int((iid.predict(s.test_x) == iid.classes_[s.test_y]).sum()) == round(res.summary["iid_final_accuracy"] * n)


def test_load_model_round_trip_equals_the_runs_evaluation(tiny_store, tmp_path):
    """load -> predict equals the run's own evaluation (the count of correct) and its saved head; probabilities
    follow scikit-learn's conventions (rows sum to 1, columns in the order of classes_)."""
    import torch

    res = _train(tiny_store, tmp_path / "run", "ova2")
    m = fedhead.load_model(res.run_dir)
    s = load_store(tiny_store)
    pred = m.predict(s.test_x)
    assert pred.dtype.kind == "U" and set(pred) <= set(m.classes_)
    assert int((pred == m.classes_[s.test_y]).sum()) == round(res.summary["final_accuracy"] * len(s.test_y))
    head = torch.load(res.run_dir / "head-seed0.pt")
    assert torch.equal(m.theta, head)
    p = m.predict_proba(s.test_x)
    assert p.shape == (len(s.test_y), len(m.classes_)) and np.allclose(p.sum(1), 1, atol=1e-6)
    assert np.array_equal(m.classes_[m.decision_function(s.test_x).argmax(1)], pred)


def test_model_files_have_the_permissions_of_every_other_output(tiny_store, tmp_path):
    res = _train(tiny_store, tmp_path / "run", "softmax")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in res.run_dir.iterdir() if p.is_file()}
    for name in ("model-seed0.safetensors", "model-seed0.json", "head-seed0.pt", "head-seed0-iid.pt"):
        assert modes[name] == modes["summary.json"] == modes["rounds.csv"], modes
    assert not [p for p in res.run_dir.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_store_of_another_encoder_is_refused_in_one_line(tiny_store, tmp_path):
    res = _train(tiny_store, tmp_path / "run", "softmax")
    other = write_synthetic(tmp_path / "other.h5", num_classes=10, train_per_class=4, test_per_class=2, dim=16,
                            latent=8, spread=1.0, seed=1)  # fmt: skip
    r = runner.invoke(cli.app, ["predict", "--model", str(res.run_dir), "--features", str(other),
                                "--out", str(tmp_path / "p.csv")])  # fmt: skip
    line = _one_line_error(r)
    assert "'--features'" in line and "differ from the model's" in line and "preprocessing" in line
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--top-k", "0"], "'--top-k'"),
        (["--split", "val"], "'--split'"),
        (["--seed", "7"], "'--seed'"),
        (["--images", "{run}/nowhere"], "'--images'"),
        (["--images", "{run}", "--features", "{store}"], "Got both"),
        ([], "Got neither"),
    ],
)
def test_bad_predict_inputs_are_refused_in_one_line(args, expect, tiny_store, tmp_path):
    res = _train(tiny_store, tmp_path / "run", "softmax")
    args = [a.format(run=res.run_dir, store=tiny_store) for a in args]
    if args[:1] in ([], ["--top-k"], ["--split"], ["--seed"]) and args:
        args += ["--features", str(tiny_store)]
    r = runner.invoke(cli.app, ["predict", "--model", str(res.run_dir), *args, "--out", str(tmp_path / "p.csv")])
    assert expect in _one_line_error(r)


def test_a_model_without_an_image_encoder_refuses_images_in_one_line(tiny_store, tmp_path):
    res = _train(tiny_store, tmp_path / "run", "softmax")
    img = tmp_path / "x.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(img)
    out = ["--out", str(tmp_path / "p.csv")]  # never the default predictions.csv in the working directory
    r = runner.invoke(cli.app, ["predict", "--model", str(res.run_dir), "--images", str(img), *out])
    assert "no image encoder" in _one_line_error(r)
    for bad, expect in (([str(tmp_path / "none")], "'--model'"), ([str(img)], "'--model'")):
        assert expect in _one_line_error(
            runner.invoke(cli.app, ["predict", "--model", *bad, "--images", str(img), *out])
        )


# ---------------------------------------------------------------- images: a real (tiny) encoder


def _images(root: Path, n_train=8, n_test=4, size=12):
    rng = np.random.default_rng(1)
    for split, n in (("train", n_train), ("test", n_test)):
        for c, cls in enumerate(CLASSES):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                base = np.array([(c * 90) % 256, (c * 40 + 60) % 256, (255 - c * 70) % 256], dtype=np.float64)
                img = np.clip(base + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(root / split / cls / f"{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """A store of a tiny image folder extracted with a random-init timm encoder, and an OvA-LP run on it."""
    from extract.run import extract_features

    root = tmp_path_factory.mktemp("imgmodel")
    data = _images(root / "data")
    store = extract_features("imagefolder", data, TINY, pretrained=False, image_size=32, out=root / "s.h5",
                             progress=False, batch_size=5)  # fmt: skip
    res = _train(store, root / "run", "ova2")
    return {"data": data, "store": store, "run": res.run_dir, "summary": res.summary}


def test_predict_images_equals_the_runs_evaluation_and_the_stores_features(image_run, tmp_path):
    """The test images, encoded again from their files, give the store's features bit for bit and so the run's
    own count of correct predictions; labels come from the folder layout."""
    r = runner.invoke(cli.app, ["predict", "--model", str(image_run["run"]), "--images", str(image_run["data"] / "test"),
                                "--out", str(tmp_path / "p.csv")])  # fmt: skip
    assert r.exit_code == 0, r.output
    n = 4 * len(CLASSES)
    want = round(image_run["summary"]["final_accuracy"] * n)
    assert _correct(tmp_path / "p.csv") == want and f"({want} of {n})" in r.stdout
    assert "confusion matrix" in r.stdout
    m = fedhead.load_model(image_run["run"])
    paths = sorted(str(p) for p in (image_run["data"] / "test").rglob("*.png"))
    assert np.array_equal(m.round_features(m.features(paths)), load_store(image_run["store"]).test_x)
    # the Python API on paths, PIL images and uint8 arrays alike
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    by_path = m.predict(paths)
    assert np.array_equal(by_path, m.predict([Image.open(p) for p in paths]))
    assert np.array_equal(by_path, m.predict(np.stack(arrays)))
    assert np.allclose(m.predict_proba(paths), m.predict_proba(arrays))


def test_predict_on_a_corrupt_image_names_it_in_one_line(image_run, tmp_path):
    folder = tmp_path / "imgs" / "bee"
    folder.mkdir(parents=True)
    Image.fromarray(np.zeros((12, 12, 3), np.uint8)).save(folder / "good.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    r = runner.invoke(cli.app, ["predict", "--model", str(image_run["run"]), "--images", str(tmp_path / "imgs"),
                                "--out", str(tmp_path / "p.csv")])  # fmt: skip
    line = _one_line_error(r)
    assert str(folder / "broken.png") in line and "not an image" in line
    assert not (tmp_path / "p.csv").exists()


def test_an_image_encoder_that_differs_from_the_models_is_refused_in_one_line(image_run, tmp_path):
    """The card says which weights and preprocessing the head was trained on: an encoder that loads otherwise (here
    the card's preprocessing edited to another size) is refused before any image is classified."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(image_run["run"], run)
    card = json.loads((run / "model-seed0.json").read_text())
    card["store"]["preprocessing"]["crop_pct"] = 0.5
    (run / "model-seed0.json").write_text(json.dumps(card))
    argv = [
        "predict",
        "--model",
        str(run),
        "--images",
        str(image_run["data"] / "test"),
        "--out",
        str(tmp_path / "p.csv"),
    ]
    line = _one_line_error(runner.invoke(cli.app, argv))
    assert "differs from the one it was trained on" in line and "crop_pct" in line


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_export_parity_with_predict_on_the_same_images(fmt, image_run, tmp_path):
    """The exported file, run without fedhead (onnxruntime / torch.jit), classifies the test images as fedhead
    predict does: the same predictions (so the same accuracy) and logits within float rounding."""
    import torch

    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
    out = tmp_path / f"m.{fmt}"
    r = runner.invoke(cli.app, ["export", "--model", str(image_run["run"]), "--format", fmt, "--out", str(out),
                                "--input-size", "12x12"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE((image_run["run"] / "summary.json").stat().st_mode)
    m = fedhead.load_model(image_run["run"])
    paths = sorted(str(p) for p in (image_run["data"] / "test").rglob("*.png"))
    images = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths])
    want = m.decision_function(paths)
    if fmt == "onnx":
        import onnxruntime as ort

        sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        logits, probs = sess.run(["logits", "probabilities"], {"images": images})
        assert json.loads(sess.get_modelmeta().custom_metadata_map["classes"]) == list(CLASSES)
        # the client-side example (numpy, Pillow, onnxruntime only) on the same folder
        from fedhead.examples import onnx_classify

        ex_paths, names, _ = onnx_classify.classify(str(out), str(image_run["data"] / "test"))
        assert ex_paths == paths and names == list(m.classes_[want.argmax(1)])
    else:
        loaded = torch.jit.load(str(out))
        with torch.no_grad():  # in predict's batches: a convolution's rounding may follow the batch size
            outs = [loaded(torch.from_numpy(images[i : i + m.batch_size])) for i in range(0, len(images), m.batch_size)]
            logits, probs = (torch.cat(t).numpy() for t in zip(*outs))
    assert np.array_equal(logits.argmax(1), want.argmax(1))
    if fmt == "torchscript":  # the module fedhead export traced: the same logits bit for bit; predict's within
        # float32 rounding (the head's product and the preprocessing group their operations differently, and which
        # way rounds last depends on the CPU's kernels: equal bits on an AVX-512 machine, 1 ulp apart on AVX2)
        from fedhead.federation.export import build_classifier, parse_size

        with torch.no_grad():
            clf = build_classifier(m, parse_size("12x12", m)).eval()
            eager = [
                clf(torch.from_numpy(images[i : i + m.batch_size]))[0] for i in range(0, len(images), m.batch_size)
            ]
        assert np.array_equal(logits, torch.cat(eager).numpy())
        assert np.allclose(logits, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))
    else:  # onnxruntime's own kernels: float rounding apart
        assert np.allclose(logits, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert np.allclose(probs.sum(1), 1, atol=1e-5)
    labels = np.asarray([CLASSES.index(Path(p).parent.name) for p in paths])
    assert int((logits.argmax(1) == labels).sum()) == round(image_run["summary"]["final_accuracy"] * len(paths))


def test_export_refuses_bad_inputs_in_one_line(image_run, tiny_store, tmp_path):
    run = str(image_run["run"])
    for args, expect in (
        (["--format", "tflite"], "'--format'"),
        (["--input-size", "12by12"], "'--input-size'"),
        (["--input-size", "0x12"], "'--input-size'"),
        ([], "'--input-size'"),  # an image folder's images have no one size
    ):
        r = runner.invoke(cli.app, ["export", "--model", run, "--out", str(tmp_path / "m.onnx"), *args])
        assert expect in _one_line_error(r), args
    assert not (tmp_path / "m.onnx").exists()
    res = _train(tiny_store, tmp_path / "syn", "softmax")
    r = runner.invoke(cli.app, ["export", "--model", str(res.run_dir), "--out", str(tmp_path / "m.onnx"),
                                "--input-size", "8x8"])  # fmt: skip
    assert "no image encoder" in _one_line_error(r)


def test_export_refuses_a_head_that_is_not_linear_in_one_line(tiny_store, tmp_path):
    res = _train(tiny_store, tmp_path / "qda", "qda")
    r = runner.invoke(cli.app, ["export", "--model", str(res.run_dir), "--out", str(tmp_path / "m.onnx"),
                                "--input-size", "8x8"])  # fmt: skip
    assert "'qda' head, which is not linear" in _one_line_error(r)
    assert not (tmp_path / "m.onnx").exists()


def test_digit_images_are_written_losslessly(tmp_path):
    """The demo's PNG files decode to the digits' own test images (so predict reproduces the store's features)."""
    from extract.datasets import decode_image, load_dataset
    from fedhead.commands import write_digit_images

    n = write_digit_images(tmp_path)
    split = load_dataset("digits", None, "test")
    assert n == len(split) == len(list(tmp_path.rglob("*.png")))
    for i in (0, 7, n - 1):
        path = tmp_path / split.class_names[split.labels[i]] / f"{i}.png"
        assert np.array_equal(decode_image(str(path)), split.images[i])
    assert os.access(tmp_path, os.W_OK)
