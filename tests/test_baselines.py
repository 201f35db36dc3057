"""Closed-form heads, --init, the central ceiling, CCVR and the classic baselines inside 'fedhead train';
'fedhead bench baselines'; the Python API and a user's own head; bad input of the method options."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import crash_at, small_cfg
from typer.testing import CliRunner

import cli
from extract.store import load_store
from fedhead.core.closedform import accumulate, message_bytes
from fedhead.federation.config import TrainConfig
from fedhead.federation.train import run_training

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)


def cfg(store, **kw):
    return small_cfg(store, shards_per_client=1, **kw)


def test_closed_form_head_is_one_exchange_with_exact_bytes(tiny_store, tmp_path):
    res = run_training(
        cfg(tiny_store, head="ridge", rounds=50, central_reference=True), out=tmp_path / "r", progress=False
    )
    assert len(res.rows) == 1 and res.rows[0]["stage"] == "statistics"
    s = load_store(tiny_store)
    D, C = s.train_x.shape[1], s.info.num_classes
    from fedhead.core.partitions import create_partition

    parts = create_partition("shard", s.train_y, 8, seed=0, shards_per_client=1)
    held = [len(np.unique(s.train_y[p])) for p in parts]
    up = sum(message_bytes(h, D, gram=True) for h in held)
    assert res.rows[0]["bytes_total"] == up + 8 * C * (D + 1) * 4  # the solved head goes back once
    assert res.rows[0]["bytes_up_per_client"] == pytest.approx(up / 8)
    # the federated solve is the pooled one (with the ridge_lambda validation chose): its own central solve gives
    # the same accuracy under any partition; the tuned ceiling is the best of it, the probe, ridge and LDA
    s = res.summary
    assert s["central_own_accuracy"] == pytest.approx(s["final_accuracy"])
    assert s["central_accuracy"] >= s["central_own_accuracy"] or s["central_method"] != "own"
    assert s["rounds"] == 1


def test_init_round_then_training_and_central_fields(tiny_store, tmp_path):
    res = run_training(
        cfg(tiny_store, head="softmax", init="lda", central_reference=True), out=tmp_path / "r", progress=False
    )
    assert [r["stage"] for r in res.rows] == ["statistics", "train", "train"]
    ridge = run_training(cfg(tiny_store, head="lda"), out=tmp_path / "lda", progress=False)
    # round 1 is the LDA head itself (mapped to the centred features: the same predictions)
    assert res.rows[0]["accuracy"] == pytest.approx(ridge.rows[0]["accuracy"])
    assert res.rows[0]["bytes_up_per_client"] > res.rows[1]["bytes_up_per_client"]
    s = res.summary
    for k in ("central_accuracy", "final_ratio_to_central", "rounds_to_99_central", "mb_per_client_to_99_central"):
        assert k in s
    rows = list(csv.DictReader(open(tmp_path / "r" / "rounds.csv")))
    assert float(rows[-1]["ratio_to_central"]) == pytest.approx(s["final_ratio_to_central"], rel=1e-5)
    assert s["central_accuracy"] > 0.5


def test_central_ceiling_is_the_converged_optimum(tiny_store):
    """The ceiling's L-BFGS reaches a point where the regularised pooled gradient vanishes."""
    from fedhead.core.central import central_head
    from fedhead.core.heads import create_head
    from fedhead.federation.clients import federated_feature_stats, prepare

    s = load_store(tiny_store)
    st = federated_feature_stats(s.train_x, [np.arange(len(s.train_y))], True, "none")
    x = prepare(s.train_x, st, "cpu").double()
    y = torch.as_tensor(s.train_y)
    head = create_head("softmax")
    theta, it = central_head(head, x, y, 10, 1e-3)
    theta = theta.clone().requires_grad_(True)
    from fedhead.core.heads import LossContext

    ctx = LossContext(
        round=10**9, present=torch.ones(1, 10, dtype=torch.bool), counts=torch.ones(1, 10), u=torch.zeros(1, len(y))
    )
    loss = (
        head.loss((x @ theta.T)[None], y[None], torch.ones(1, len(y), dtype=x.dtype), ctx)[0]
        + 0.5e-3 * (theta * theta).sum()
    )
    (g,) = torch.autograd.grad(loss, theta)
    assert 0 < it and float(g.abs().max()) < 1e-5


def test_ccvr_adds_a_calibration_exchange(tiny_store, tmp_path):
    res = run_training(
        cfg(tiny_store, head="softmax", recipe="paper", calibrate="ccvr", ccvr_samples=400),
        out=tmp_path / "c",
        progress=False,
    )
    main = res.rows
    assert main[-1]["stage"] == "ccvr" and main[-1]["round"] == 4
    assert res.summary["uncalibrated_accuracy"] == pytest.approx(main[-2]["accuracy"])
    # shard-1 under the paper's recipe collapses to one class; calibration on virtual features recovers it
    assert main[-1]["accuracy"] > main[-2]["accuracy"] + 0.2


def test_fedprox_zero_is_fedavg_and_baselines_run(tiny_store, tmp_path):
    a = run_training(cfg(tiny_store, head="ova2"), out=tmp_path / "a", progress=False)
    run_training(cfg(tiny_store, head="ova2", prox_mu=0.0), out=tmp_path / "b", progress=False)
    assert torch.equal(torch.load(tmp_path / "a" / "head-seed0.pt"), torch.load(tmp_path / "b" / "head-seed0.pt"))
    for kw in (dict(prox_mu=0.1), dict(scaffold=True), dict(server_opt="fedadam"), dict(head="fedlc")):
        r = run_training(
            cfg(tiny_store, **{"head": "ova2", **kw}), out=tmp_path / str(len(kw)) / str(kw)[2:9], progress=False
        )
        assert 0.0 < r.summary["final_accuracy"] <= 1.0
    s = run_training(cfg(tiny_store, head="ova2", scaffold=True), out=tmp_path / "s", progress=False)
    assert s.rows[1]["bytes_up_per_client"] == 2 * a.rows[1]["bytes_up_per_client"]  # variates travel too


def test_resume_keeps_server_optimizer_and_scaffold_state(tiny_store, tmp_path, monkeypatch):
    import fedhead.federation.job as train  # the round loop evaluates there

    kw = dict(head="ova2", rounds=4, scaffold=True, server_opt="fedyogi", participation=0.5)
    full = run_training(cfg(tiny_store, **kw), out=tmp_path / "full", progress=False)
    restore = crash_at(monkeypatch, train, "evaluate", 3)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg(tiny_store, **kw), out=tmp_path / "cut", progress=False)
    restore()
    res = run_training(cfg(tiny_store, **kw), out=tmp_path / "cut", resume=True, progress=False)
    assert [r["accuracy"] for r in res.rows] == [r["accuracy"] for r in full.rows]


@pytest.mark.slow
def test_bench_baselines_quick(tiny_store, tmp_path):
    out = tmp_path / "bl"
    r = runner.invoke(
        cli.app,
        [
            "bench",
            "baselines",
            "--features",
            str(tiny_store),
            "--quick",
            "--rounds",
            "3",
            "--clients",
            "8",
            "--methods",
            "ridge,ncm,ridge+ft,ova2,ova2-fedprox",
            "--partitions",
            "iid,shard-1",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    rep = (out / "report.md").read_text()
    for s in ("Ratio to the central ceiling", "ridge+ft", "MB uploaded per client"):
        assert s in rep
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 10
    ridge = [x for x in rows if x["bench_method"] == "ridge"]
    # the federated ridge is its own pooled solve (with the lambda validation chose)
    assert all(float(x["res_central_own_accuracy"]) == pytest.approx(float(x["res_final_accuracy"])) for x in ridge)
    for png in ("baselines-accuracy.png", "baselines-frontier.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    again = runner.invoke(
        cli.app,
        [
            "bench",
            "baselines",
            "--features",
            str(tiny_store),
            "--quick",
            "--rounds",
            "3",
            "--clients",
            "8",
            "--methods",
            "ridge,ncm,ridge+ft,ova2,ova2-fedprox",
            "--partitions",
            "iid,shard-1",
            "--out",
            str(out),
        ],
    )
    assert again.exit_code == 0 and "10 reused" in (out / "report.md").read_text()


BAD = [
    (["--init", "nope"], "--init"),
    (["--head", "ridge", "--init", "ncm"], "--init"),
    (["--head", "ridge", "--ridge-lambda", "0"], "--ridge-lambda"),
    (["--head", "cof", "--cof-gamma", "-1"], "--cof-gamma"),
    (["--prox-mu", "-0.1"], "--prox-mu"),
    (["--server-opt", "fedadam", "--server-lr", "0"], "--server-lr"),
    (["--server-opt", "fedadam", "--server-betas", "1.2,0.9"], "--server-betas"),
    (["--server-opt", "fedadam", "--server-betas", "0.9"], "--server-betas"),
    (["--server-opt", "sgd"], "--server-opt"),
    (["--server-opt", "fedadam", "--server-momentum", "0.9"], "--server-momentum"),
    (["--head", "ridge", "--calibrate", "ccvr"], "--calibrate"),
    (["--calibrate", "platt"], "--calibrate"),
    (["--init", "ridge", "--init-scale", "0"], "--init-scale"),
    (["--head", "lda", "--lda-shrinkage", "-1"], "--lda-shrinkage"),
    (["--head", "fedlc", "--fedlc-tau", "-1"], "--fedlc-tau"),
]


@pytest.mark.parametrize("args,flag", BAD)
def test_bad_method_options_are_one_line_errors(tiny_store, tmp_path, args, flag):
    out = tmp_path / "bad"
    r = runner.invoke(
        cli.app, ["train", "--features", str(tiny_store), "--clients", "4", "--rounds", "1", "--out", str(out), *args]
    )
    assert r.exit_code != 0
    msg = r.output.strip()
    assert flag in msg and "Traceback" not in msg and "internal error" not in msg and len(msg.splitlines()) == 1
    assert not out.exists()


def test_ill_conditioned_solve_is_one_line(tmp_path):
    """More dimensions than samples and no shrinkage: LDA cannot solve; the error names the parameter."""
    from fedhead.core.synthetic import write_synthetic

    st = write_synthetic(
        tmp_path / "wide.h5", num_classes=3, train_per_class=4, test_per_class=2, dim=40, latent=4, spread=1.0, seed=0
    )
    r = runner.invoke(
        cli.app,
        [
            "train",
            "--features",
            str(st),
            "--clients",
            "2",
            "--head",
            "lda",
            "--lda-shrinkage",
            "0",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert r.exit_code != 0 and "--lda-shrinkage" in r.output and "Traceback" not in r.output


@pytest.mark.slow
def test_readme_example_runs_as_written(tiny_store, tmp_path):
    """The example file of docs/extending.md, executed as a user would, and its head through the CLI via FEDHEAD_PLUGINS."""
    from conftest import run_example_with_plugin

    example = "fedhead/examples/custom_head.py"
    readme = (REPO / "docs" / "extending.md").read_text()
    assert example in readme
    assert (REPO / example).read_text().rstrip("\n") in readme  # the docs show this very file
    out = run_example_with_plugin(
        example, "fedhead.examples.custom_head", tiny_store, tmp_path, ["--head", "smooth-softmax"], "smooth+ridge"
    )
    assert "statistics" in out and "ratio to central:" in out
    summary = json.loads((tmp_path / "ex" / "summary.json").read_text())
    assert summary["head"] == "smooth-softmax"


def test_statistics_streamed_in_client_blocks_bound_memory():
    """1000 clients: the accumulator holds a few D x D sums, never one matrix per client."""
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.random((5000, 32), dtype=np.float32))
    y = torch.as_tensor(rng.integers(0, 20, 5000))
    parts = np.array_split(rng.permutation(5000), 1000)
    acc = accumulate(x, y, parts, 20, gram=True, cof=True, block_rows=512)
    assert acc.clients == 1000
    tensors = [v for v in vars(acc).values() if isinstance(v, torch.Tensor)]
    assert sum(t.numel() for t in tensors) < 4 * 33 * 33 + 20 * 33 + 100


def test_recipe_fast_is_softmax_from_a_ridge_start(tiny_store, tmp_path):
    res = run_training(
        TrainConfig(features=str(tiny_store), recipe="fast", clients=4, rounds=2, local_epochs=1),
        out=tmp_path / "f",
        progress=False,
    )
    cfg = json.loads((tmp_path / "f" / "config.json").read_text())["config"]
    assert cfg["head"] == "softmax" and cfg["init"] == "ridge" and cfg["optimizer"] == "sgd" and cfg["center"]
    assert [r["stage"] for r in res.rows] == ["statistics", "train"]
    # an explicit closed-form head keeps its one exchange: the recipe's start does not apply to it
    r = run_training(
        TrainConfig(features=str(tiny_store), recipe="fast", head="ridge", clients=4),
        out=tmp_path / "r",
        progress=False,
    )
    assert len(r.rows) == 1
