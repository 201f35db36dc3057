"""fedhead train: contract over every head and partition, determinism, resume, outputs, CLI, bad input."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import crash_at
from typer.testing import CliRunner

from cli import app
from extract.store import load_store
from fedhead.core.closedform import is_closed_form
from fedhead.core.heads import head_names
from fedhead.core.partitions import partition_names
from fedhead.federation.clients import sample_clients
from fedhead.federation.config import TrainConfig, applicable
from fedhead.federation.rundir import read_csv
from fedhead.federation.train import run_training

runner = CliRunner()


def cfg_for(store, **kw):
    base = dict(features=str(store), clients=8, rounds=2, local_epochs=1, batch_size=16, device="cpu")
    # the base's --rounds etc. only where they apply (a closed-form head takes none); the case's own options as given
    return TrainConfig(**{**applicable({**base, **kw}), **kw})


@pytest.mark.parametrize("partition", partition_names())
@pytest.mark.parametrize("head", head_names())
def test_contract_every_head_and_partition(tiny_store, tmp_path, head, partition):
    pp = {"shards_per_client": 2} if partition == "shard" else {}
    res = run_training(
        cfg_for(tiny_store, head=head, partition=partition, partition_params=pp), out=tmp_path / "run", progress=False
    )
    d = res.run_dir
    for f in ("config.json", "rounds.csv", "summary.json", "clients.csv"):
        assert (d / f).exists(), f
    rows = read_csv(d / "rounds.csv")
    # a closed-form head is one exchange of statistics, whatever --rounds says
    assert [int(r["round"]) for r in rows] == ([1] if is_closed_form(head) else [1, 2])
    for r in rows:
        assert 0.0 <= float(r["accuracy"]) <= 1.0
        assert float(r["client_ms"]) > 0 and float(r["bytes_total"]) > 0
    s = json.loads((d / "summary.json").read_text())
    assert s["final_accuracy"] == pytest.approx(float(rows[-1]["accuracy"]), abs=1e-6)
    clients = read_csv(d / "clients.csv")
    assert len(clients) == 8
    assert sum(int(c["size"]) for c in clients) <= 400
    assert not (d / "checkpoint.safetensors").exists()


def test_training_learns_and_ova2_stage1_is_one_round(tiny_store, tmp_path):
    res = run_training(
        cfg_for(
            tiny_store,
            head="ova2",
            rounds=4,
            partition="shard",
            partition_params={"shards_per_client": 2},
            iid_reference=True,
        ),
        out=tmp_path / "r",
        progress=False,
    )
    rows = res.rows
    assert [r["stage"] for r in rows if r["run"] == "main"] == ["stage1", "stage2", "stage2", "stage2"]
    assert res.summary["final_accuracy"] > 0.3  # 10 classes: chance is 0.1, IID probe 0.63
    main = [r for r in rows if r["run"] == "main"]
    iid = [r for r in rows if r["run"] == "iid"]
    for m, i in zip(main, iid):
        assert m["ratio_to_iid"] == pytest.approx(m["accuracy"] / i["accuracy"])
    assert res.summary["final_ratio_to_iid"] == pytest.approx(main[-1]["accuracy"] / iid[-1]["accuracy"])


def test_same_seed_same_results_bit_for_bit(tiny_store, tmp_path):
    kw = dict(head="ova2", partition="dirichlet", participation=0.5, noise="symmetric", noise_rate=0.3)
    a = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "a", progress=False)
    b = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "b", progress=False)
    c = run_training(cfg_for(tiny_store, seeds=[1], **kw), out=tmp_path / "c", progress=False)
    assert [r["accuracy"] for r in a.rows] == [r["accuracy"] for r in b.rows]
    assert torch.equal(torch.load(a.run_dir / "head-seed0.pt"), torch.load(b.run_dir / "head-seed0.pt"))
    assert not torch.equal(torch.load(a.run_dir / "head-seed0.pt"), torch.load(c.run_dir / "head-seed1.pt"))
    assert 0.25 < a.summary["realised_noise_rate"] <= 0.3


def test_participation_is_the_same_for_every_head():
    a = sample_clients(100, 0.1, 42, 7)
    assert len(a) == 10 and np.array_equal(a, sample_clients(100, 0.1, 42, 7))
    assert not np.array_equal(a, sample_clients(100, 0.1, 42, 8))


def test_multi_seed_mean_and_std(tiny_store, tmp_path):
    res = run_training(cfg_for(tiny_store, seeds=[0, 42]), out=tmp_path / "r", progress=False)
    finals = [p["final_accuracy"] for p in res.summary["per_seed"]]
    assert res.summary["final_accuracy"] == pytest.approx(np.mean(finals))
    assert res.summary["final_accuracy_std"] == pytest.approx(np.std(finals, ddof=1))


def test_resume_equals_uninterrupted(tiny_store, tmp_path, monkeypatch):
    import fedhead.federation.job as train  # the round loop evaluates there

    kw = dict(head="ova2", partition="shard", rounds=4, seeds=[0, 1], iid_reference=True, participation=0.5)
    monkeypatch.setenv("FEDHEAD_THREADS", "1")  # the uninterrupted and the interrupted run: one thread
    full = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "full", progress=False)

    restore = crash_at(monkeypatch, train, "evaluate", 7)  # dies in the middle of the second run
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg_for(tiny_store, **kw), out=tmp_path / "cut", progress=False)
    restore()
    assert (tmp_path / "cut" / "checkpoint.safetensors").exists()
    assert not (tmp_path / "cut" / "summary.json").exists()
    monkeypatch.setenv("FEDHEAD_THREADS", "2")  # the resumed run keeps the recorded count, not this one
    resumed = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "cut", resume=True, progress=False)
    assert json.loads((resumed.run_dir / "config.json").read_text())["cpu_threads"] == 1
    assert [r["accuracy"] for r in resumed.rows] == [r["accuracy"] for r in full.rows]
    for s in (0, 1):
        assert torch.equal(
            torch.load(full.run_dir / f"head-seed{s}.pt"), torch.load(resumed.run_dir / f"head-seed{s}.pt")
        )
    # a finished run resumed again is reused, and a different configuration is refused
    again = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "cut", resume=True, progress=False)
    assert again.summary["final_accuracy"] == resumed.summary["final_accuracy"]
    r = runner.invoke(
        app,
        [
            "train",
            "--features",
            str(tiny_store),
            "--clients",
            "8",
            "--rounds",
            "5",
            "--out",
            str(tmp_path / "cut"),
            "--resume",
        ],
    )
    assert r.exit_code != 0 and "different configuration" in r.output


def test_loop_backend_gives_the_same_run(tiny_store, tmp_path):
    kw = dict(head="fedabc", partition="dirichlet", rounds=2)
    a = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "a", progress=False)
    b = run_training(cfg_for(tiny_store, backend="loop", **kw), out=tmp_path / "b", progress=False)
    torch.testing.assert_close(
        torch.load(a.run_dir / "head-seed0.pt"), torch.load(b.run_dir / "head-seed0.pt"), atol=1e-5, rtol=1e-4
    )


def test_cli_smoke(tiny_store, tmp_path):
    r = runner.invoke(
        app,
        [
            "train",
            "--features",
            str(tiny_store),
            "--head",
            "softmax",
            "--partition",
            "shard",
            "--shards-per-client",
            "1",
            "--clients",
            "10",
            "--rounds",
            "2",
            "--recipe",
            "paper",
            "--iid-reference",
            "--seeds",
            "0",
            "--seeds",
            "42",
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "final acc" in r.stdout
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["config"]["optimizer"] == "adamw" and cfg["config"]["seeds"] == [0, 42]
    assert cfg["store"]["dataset"] == "synthetic-10"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--partition", "dirichlet", "--alpha", "0"], "'--alpha'"),
        (["--partition", "bernoulli-dirichlet", "--p", "1.5"], "'--p'"),
        (["--partition", "shard", "--shards-per-client", "20", "--distinct-labels"], "'--shards-per-client'"),
        (["--partition", "shard", "--shards-per-client", "100", "--clients", "8"], "'--shards-per-client'"),
        (["--clients", "100000"], "'--clients'"),
        (["--participation", "0"], "'--participation'"),
        (["--noise", "symmetric", "--noise-rate", "1.2"], "'--noise-rate'"),
        (["--noise", "asymmetric", "--noise-rate", "0.2"], "cyclic"),
        (["--head", "ovaa"], "Did you mean ova"),
        (["--partition", "diriclet"], "dirichlet"),
        (["--optimizer", "adam"], "'--optimizer'"),
        (["--alpha", "0.5"], "does not apply"),
    ],
)
def test_bad_input_one_line_nothing_written(tiny_store, tmp_path, args, needle):
    out = tmp_path / "run"
    r = runner.invoke(
        app, ["train", "--features", str(tiny_store), "--clients", "8", "--rounds", "1", "--out", str(out), *args]
    )
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.output
    assert not out.exists()


def test_missing_and_foreign_store(tmp_path):
    import h5py

    r = runner.invoke(app, ["train", "--features", str(tmp_path / "nope.h5")])
    assert r.exit_code == 2 and "does not exist" in r.output
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.zeros(3)
    r = runner.invoke(app, ["train", "--features", str(foreign)])
    assert r.exit_code == 2 and "not a fedhead feature store" in r.output
    (tmp_path / "garbage.h5").write_bytes(b"not hdf5 at all")
    r = runner.invoke(app, ["train", "--features", str(tmp_path / "garbage.h5")])
    assert r.exit_code == 2 and "not a readable fedhead feature store" in r.output


def test_debug_variable_shows_traceback(tiny_store, tmp_path):
    cmd = [
        sys.executable,
        "-c",
        "from cli import main; main()",
        "train",
        "--features",
        str(tiny_store),
        "--partition",
        "dirichlet",
        "--alpha",
        "0",
        "--out",
        str(tmp_path / "x"),
    ]
    plain = subprocess.run(cmd, capture_output=True, text=True)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    debug = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "FEDHEAD_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_synth_cli_writes_a_store_and_refuses_bad_sizes(tmp_path):
    out = tmp_path / "s.h5"
    r = runner.invoke(
        app,
        [
            "synth",
            "--out",
            str(out),
            "--num-classes",
            "5",
            "--train-per-class",
            "20",
            "--test-per-class",
            "10",
            "--dim",
            "8",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "probe accuracy" in r.output
    s = load_store(out)
    assert s.train_x.shape == (100, 8) and s.test_x.shape == (50, 8) and (s.train_x >= 0).all()
    r = runner.invoke(app, ["synth", "--out", str(tmp_path / "bad.h5"), "--num-classes", "1"])
    assert r.exit_code == 2 and "'--num-classes'" in r.output
    assert not (tmp_path / "bad.h5").exists()


def test_fast_recipe_uses_local_steps_unless_epochs_given():
    from fedhead.federation.config import TrainConfig
    from fedhead.infra.errors import FedheadError

    fast = TrainConfig(features="x.h5", recipe="fast").resolved()
    assert (fast.local_steps, fast.head, fast.init) == (30, "softmax", "ridge")
    own = TrainConfig(features="x.h5", recipe="fast", local_epochs=2).resolved()
    assert (own.local_steps, own.local_epochs) == (None, 2)
    default = TrainConfig(features="x.h5").resolved()
    assert (default.local_steps, default.local_epochs) == (None, 3)
    with pytest.raises(FedheadError, match="'local_steps'.*'local_epochs'"):
        TrainConfig(features="x.h5", local_steps=5, local_epochs=2).resolved()
