"""A fine-tuned model read back from its run (issue 39): ``fedhead.load_model`` on a ``fedhead finetune`` run gives
a :class:`FinetunedModel` that reproduces the run's final test accuracy; ``fedhead predict`` classifies image files
with it and ``fedhead export`` writes it as TorchScript / ONNX held to its own logits; a card or tensor file that
does not match the model is one line, with nothing loaded."""

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import cli
import fedhead
from extract import datasets as D
from extract.encoders import load_encoder, preprocess_batch
from fedhead.core.peft import FineTuned, TuneSpec, attach, trainable_state
from fedhead.federation.finetuned import FinetunedModel
from fedhead.infra.errors import FedheadError
from fedhead.scratch.finetune import FinetuneConfig, load_images, run_finetune

runner = CliRunner()
LIMIT = 120
# the tests of a trained run: its fixture imports the PEFT library (transformers: 10-35 s on 2 busy cores) and trains
SLOW = pytest.mark.slow(reason="a fedhead finetune run (LoRA through the PEFT library) in a module fixture")


def _cfg() -> FinetuneConfig:
    return FinetuneConfig(dataset="digits", data_dir=None, encoder="test_vit", pretrained=False, image_size=32,
                          peft="lora", clients=3, rounds=1, limit=LIMIT, plots=False, device="cpu")  # fmt: skip


@pytest.fixture(scope="module")
def ft_run(tmp_path_factory):
    """A tiny LoRA run (test_vit, random init, digits, 3 clients, 1 round) and its raw test images (8x8 digits)."""
    out = tmp_path_factory.mktemp("ftmodel") / "run"
    summary = run_finetune(_cfg(), out)
    test = D.load_dataset("digits", None, "test")
    test = test.subset(D.select_limit(test.labels, LIMIT))
    return {"run": out, "summary": summary, "images": test.images, "labels": np.asarray(test.labels)}


def _one_line(res) -> str:
    assert res.exit_code != 0, res.output
    assert "Traceback" not in res.output, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def _refused(fn) -> str:
    with pytest.raises(FedheadError) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text
    return text


def _copy(ft_run, tmp_path) -> Path:
    """A copy of the run's model files (seed 0) in ``tmp_path / "run"``, to edit."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("model-seed0.json", "model-seed0.safetensors"):
        shutil.copy(ft_run["run"] / name, run / name)
    return run


@SLOW
def test_load_model_reproduces_the_runs_final_test_accuracy(ft_run):
    m = fedhead.load_model(ft_run["run"])
    assert isinstance(m, FinetunedModel) and m.classes == [str(c) for c in range(10)]
    card = json.loads((ft_run["run"] / "model-seed0.json").read_text())
    assert m.card == card and not any(p.requires_grad for p in m.net.parameters())
    # the run's own test images (load_images: the same --limit subset, resized as training did) are these
    data = load_images(_cfg(), load_encoder("test_vit", pretrained=False, image_size=32))
    assert np.array_equal(data.test_y, ft_run["labels"])
    images, labels = ft_run["images"], ft_run["labels"]
    pred = m.predict(images)
    assert int((pred == labels).sum()) == round(card["final_accuracy"] * len(labels))
    assert ft_run["summary"]["final_accuracy"] == pytest.approx(card["final_accuracy"])
    probs = m.predict_proba(images[:7])
    assert probs.shape == (7, 10) and np.allclose(probs.sum(1), 1, atol=1e-6)
    # one image at a time, as a list of arrays or PIL images: the same classes
    few = images[:5]
    assert np.array_equal(m.predict(list(few)), pred[:5])
    assert np.array_equal(m.predict([Image.fromarray(a) for a in few]), pred[:5])
    assert "uint8 images" in _refused(lambda: m.predict(images.astype(np.float32)))


@SLOW
def test_predict_cli_classifies_png_files_into_a_csv(ft_run, tmp_path):
    images, labels = ft_run["images"][:12], ft_run["labels"][:12]
    for i, (img, y) in enumerate(zip(images, labels)):
        (tmp_path / "imgs" / str(y)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(tmp_path / "imgs" / str(y) / f"{i:03d}.png")
    out = tmp_path / "p.csv"
    r = runner.invoke(cli.app, ["predict", "--model", str(ft_run["run"]), "--images", str(tmp_path / "imgs"),
                                "--out", str(out), "--device", "cpu"])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(out)))
    assert list(rows[0]) == ["source", "label"] + [f"{k}_{i}" for i in (1, 2, 3) for k in ("class", "probability")]
    m = fedhead.load_model(ft_run["run"])
    paths = [r_["source"] for r_ in rows]
    want = m.predict([np.asarray(Image.open(p).convert("RGB")) for p in paths])
    assert [r_["class_1"] for r_ in rows] == [m.classes[i] for i in want]
    correct = sum(r_["label"] == r_["class_1"] for r_ in rows)
    assert f"accuracy {correct / 12:.4f} ({correct} of 12)" in r.stdout and "confusion matrix" in r.stdout
    assert "fine-tuned with --peft lora" in r.stdout
    line = _one_line(runner.invoke(cli.app, ["predict", "--model", str(ft_run["run"]), "--features",
                                             str(tmp_path / "p.csv"), "--out", str(tmp_path / "q.csv")]))  # fmt: skip
    assert "'--features'" in line and "--images" in line
    line = _one_line(runner.invoke(cli.app, ["predict", "--model", str(ft_run["run"]), "--client", "0", "--images",
                                             str(tmp_path / "imgs"), "--out", str(tmp_path / "q.csv")]))  # fmt: skip
    assert "'--client'" in line and "fine-tuned" in line
    assert not (tmp_path / "q.csv").exists()


@SLOW
@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_export_matches_the_models_own_logits(fmt, ft_run, tmp_path):
    if fmt == "onnx":
        pytest.importorskip("onnx")
        ort = pytest.importorskip("onnxruntime")
    out = tmp_path / f"m.{fmt}"
    r = runner.invoke(cli.app, ["export", "--model", str(ft_run["run"]), "--format", fmt, "--out", str(out),
                                "--input-size", "8x8"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "[N, 8, 8, 3]" in r.stdout and "[N, 10]" in r.stdout
    m = fedhead.load_model(ft_run["run"])
    images = ft_run["images"][:5]  # another batch size than the check's (2)
    want = m.logits(images).numpy()
    if fmt == "onnx":
        sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        logits, probs = sess.run(["logits", "probabilities"], {"images": images})
        meta = sess.get_modelmeta().custom_metadata_map
        assert json.loads(meta["classes"]) == m.classes
        assert json.loads(meta["fedhead_model"])["format"] == "fedhead-finetuned/1"
    else:
        with torch.no_grad():
            logits, probs = (t.numpy() for t in torch.jit.load(str(out))(torch.from_numpy(images)))
    assert np.allclose(logits, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert np.array_equal(logits.argmax(1), want.argmax(1)) and np.allclose(probs.sum(1), 1, atol=1e-5)


@SLOW
def test_a_tensor_file_of_another_shape_is_one_line(ft_run, tmp_path):
    run = _copy(ft_run, tmp_path)
    tensors = load_file(str(run / "model-seed0.safetensors"))
    name = next(k for k in tensors if "lora_A" in k)
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, str(run / "model-seed0.safetensors"))
    text = _refused(lambda: fedhead.load_model(run))
    assert name in text and "trainable tensors" in text
    line = _one_line(runner.invoke(cli.app, ["export", "--model", str(run), "--out", str(tmp_path / "m.pt"),
                                             "--format", "torchscript"]))  # fmt: skip
    assert name in line and not (tmp_path / "m.pt").exists()
    tensors.pop(name)
    save_file(tensors, str(run / "model-seed0.safetensors"))
    assert f"missing {name}" in _refused(lambda: fedhead.load_model(run))
    (run / "model-seed0.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    assert "readable safetensors" in _refused(lambda: fedhead.load_model(run))


@SLOW
def test_a_rank_other_than_the_files_is_one_line(ft_run, tmp_path):
    run = _copy(ft_run, tmp_path)
    card = json.loads((run / "model-seed0.json").read_text())
    card["tuning"]["lora_rank"] = 4
    (run / "model-seed0.json").write_text(json.dumps(card))
    text = _refused(lambda: fedhead.load_model(run))
    assert "lora_A" in text and "[8, 64], the model's F32 [4, 64]" in text


# ---------------------------------------------------------------- a card written here (no training: the fast tier)


def _synthetic(folder: Path, peft: str = "bitfit", tensors: dict | None = None) -> Path:
    """A fine-tuned model's card and tensor file as a run writes them, for test_vit (random init) with ``peft``'s
    trainable tensors drawn at random (``tensors``: these instead); returns the folder."""
    enc = load_encoder("test_vit", pretrained=False, image_size=32)
    if tensors is None:
        model = FineTuned(enc.model, enc.feature_dim, 3, 32)
        attach(model, TuneSpec(peft=peft), 0)
        g = torch.Generator().manual_seed(3)
        tensors = {n: 0.1 * torch.randn(t.shape, generator=g) for n, t in trainable_state(model).items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model-seed0.safetensors"))
    card = {"format": "fedhead-finetuned/1", "seed": 0, "encoder": "test_vit", "weights": None, "pretrained": False,
            "weights_source": enc.weights_source, "weights_sha256": enc.weights_sha256, "image_size": 32,
            "preprocessing": enc.preprocessing.as_dict(), "feature_dim": enc.feature_dim,
            "tuning": TuneSpec(peft=peft).as_dict(), "classes": ["ant", "bee", "cat"], "final_accuracy": 0.5,
            "rounds": 1, "tensors": "model-seed0.safetensors"}  # fmt: skip
    (folder / "model-seed0.json").write_text(json.dumps(card))
    return folder


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return _synthetic(tmp_path_factory.mktemp("written") / "run")


def test_a_written_model_classifies_with_its_tensors(written, tmp_path):
    """BitFit (no PEFT library): the loaded model's logits are the encoder with the file's biases and classifier,
    through the eval transform (extract.encoders.preprocess_batch)."""
    run = _copy({"run": written}, tmp_path)
    m = fedhead.load_model(run / "model-seed0.json")
    assert isinstance(m, FinetunedModel) and m.classes == ["ant", "bee", "cat"]
    enc = load_encoder("test_vit", pretrained=False, image_size=32)
    ref = FineTuned(enc.model, enc.feature_dim, 3, 32)
    attach(ref, TuneSpec(peft="bitfit"), 0)
    with torch.no_grad():
        for n, t in load_file(str(run / "model-seed0.safetensors")).items():
            dict(ref.named_parameters())[n].copy_(t)
    images = np.random.default_rng(0).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    with torch.no_grad():
        want = ref.eval()(preprocess_batch(torch.from_numpy(images), enc.preprocessing))
    assert torch.equal(m.logits(images), want) and float(want.std()) > 0
    assert np.array_equal(m.predict(images), want.argmax(1).numpy())
    line = _one_line(runner.invoke(cli.app, ["predict", "--model", str(run), "--client", "0", "--images",
                                             str(tmp_path), "--out", str(tmp_path / "q.csv")]))  # fmt: skip
    assert "'--client'" in line and "fine-tuned" in line


@pytest.mark.parametrize(
    "edit, expect",
    [
        ({"weights_sha256": "0" * 64}, "weights differ from the run's"),
        ({"weights_sha256": "abc"}, "'weights_sha256' is 64 hex digits"),
        ({"tensors": "../model-seed0.safetensors"}, "outside its folder"),
        ({"classes": ["a", "b"]}, "classifier fits its 2 classes"),
        ({"tuning": {"peft": "lora", "lora_rank": 10**9}}, "lora_rank is an integer in [1, 1024]"),
        ({"tuning": {"peft": "head"}}, "tuning fits its encoder"),
        ({"tuning": {"peft": "full"}}, "missing encoder."),
        ({"tuning": {"peft": "bitfit", "unknown": 1}}, "'tuning' is an object"),
        ({"image_size": "32"}, "'image_size' is an integer"),
        ({"preprocessing": {"crop_pct": 0.5}}, "another preprocessing"),
        ({"weights": "/etc/ckpt.pth"}, "checkpoint 'ckpt.pth' is missing"),
    ],
)
def test_a_card_that_does_not_match_is_one_line(edit, expect, written, tmp_path):
    run = _copy({"run": written}, tmp_path)
    card = json.loads((run / "model-seed0.json").read_text())
    card.update(edit)
    (run / "model-seed0.json").write_text(json.dumps(card))
    assert expect in _refused(lambda: fedhead.load_model(run))


def test_a_tensor_that_is_not_finite_is_one_line(written, tmp_path):
    run = _copy({"run": written}, tmp_path)
    tensors = load_file(str(run / "model-seed0.safetensors"))
    tensors["classifier.bias"][1] = float("nan")
    save_file(tensors, str(run / "model-seed0.safetensors"))
    assert "finite" in _refused(lambda: fedhead.load_model(run))
