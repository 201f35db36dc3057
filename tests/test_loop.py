"""The one round loop (issue 22): train, Flower and scratch run the same loop function; a run's identity names its
store by content and a refusal names each differing setting; --resume with more rounds extends a finished or
interrupted run to what a run started with that many rounds gives."""

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import crash_at
from typer.testing import CliRunner

import fedhead.federation.job as job_module
from cli import app
from extract.store import load_store, store_content_hash
from fedhead.federation import loop
from fedhead.federation.config import TrainConfig
from fedhead.federation.rundir import FINAL_STATE, read_csv
from fedhead.federation.train import head_run_dir, run_training
from fedhead.infra.errors import FedheadError

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def cfg_for(store, **kw):
    base = dict(features=str(store), clients=8, rounds=2, local_epochs=1, batch_size=16, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def accs(rows):
    return [float(r["accuracy"]) for r in rows]


def same_nan(a, b):
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b)) and len(a) == len(b)


def test_train_flower_and_scratch_run_the_same_loop_function():
    import fedhead.federation.train as T
    import fedhead.scratch.runner as R

    pytest.importorskip("flwr")
    import fedhead.flower.strategy as S

    # train and Flower enter through the same head run (run_head), which runs the loop's one function
    assert T.run_job is loop.run_job and S.run_head is T.run_head and R.run_job is loop.run_job
    from fedhead.federation.transport import Transport

    assert issubclass(S.FedheadStrategy, Transport) and issubclass(R.ScratchJob, loop.Job)
    # no other round loop: the only `for rnd in range(` of the federation, Flower and scratch is the loop's
    found = []
    for pkg in ("fedhead/federation", "fedhead/flower", "fedhead/scratch"):
        for p in (REPO / pkg).glob("*.py"):
            found += [
                f"{p.name}:{i}" for i, line in enumerate(p.read_text().splitlines()) if "for rnd in range(" in line
            ]
    assert found and all(f.startswith("loop.py:") for f in found), found


def test_flower_rounds_go_through_the_loops_job(tiny_store, tmp_path, monkeypatch):
    """Behaviourally: a train run and a Flower run (in process) both call HeadJob.round once per round."""
    pytest.importorskip("flwr")
    from test_flower_sim import LocalGrid, task_identity  # noqa: F401

    from fedhead.flower.client_app import make_client_app
    from fedhead.flower.inprocess import sim_nodes
    from fedhead.flower.inprocess import task_identity as flower_task_identity
    from fedhead.flower.server_app import run_server
    from fedhead.flower.strategy import ServerSettings

    calls = []
    real = job_module.HeadJob.round

    def spy(self, unit, rnd):
        calls.append((type(self.transport).__name__, rnd))
        return real(self, unit, rnd)

    monkeypatch.setattr(job_module.HeadJob, "round", spy)
    cfg = cfg_for(tiny_store, clients=4, rounds=2, head="ova2")
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    with flower_task_identity():
        grid = LocalGrid(make_client_app(str(tiny_store)), sim_nodes(cfg.clients))
        res = run_server(grid, cfg_for(tiny_store, clients=4, rounds=2, head="ova2"),
                         ServerSettings(out=str(tmp_path / "flower"), wait_timeout=5))  # fmt: skip
    assert calls == [
        ("InProcessTransport", 1),
        ("InProcessTransport", 2),
        ("FedheadStrategy", 1),
        ("FedheadStrategy", 2),
    ]
    np.testing.assert_allclose(accs(res.rows), accs(ref.rows), atol=1e-9)


# ---------------------------------------------------------------- identity and refusals


def test_resume_with_the_same_store_under_another_path(tiny_store, tmp_path, monkeypatch):
    """The identity names the store by its content: the absolute path, a relative one or a copy are the same run."""
    kw = dict(head="ova2", rounds=3)
    full = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "full", progress=False)
    restore = crash_at(monkeypatch, job_module, "evaluate", 2)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg_for(tiny_store, **kw), out=tmp_path / "cut", progress=False)
    restore()
    copy = tmp_path / "elsewhere" / "copy.h5"
    copy.parent.mkdir()
    shutil.copy(tiny_store, copy)
    monkeypatch.chdir(copy.parent)
    resumed = run_training(cfg_for("copy.h5", **kw), out=tmp_path / "cut", resume=True, progress=False)
    assert accs(resumed.rows) == accs(full.rows)
    record = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert record["store"]["content_sha256"] == store_content_hash(load_store(tiny_store))
    assert (
        record["identity"]
        == head_run_dir(cfg_for(tiny_store, **kw).resolved(), load_store(tiny_store), tmp_path, False).hash
    )


def test_a_refused_resume_names_each_differing_setting(tiny_store, tmp_path):
    run_training(cfg_for(tiny_store, head="ova2"), out=tmp_path / "r", progress=False)
    with pytest.raises(FedheadError) as e:
        run_training(cfg_for(tiny_store, head="ova2", lr=0.05, batch_size=8), out=tmp_path / "r", resume=True)
    msg = str(e.value)
    assert (
        "different configuration" in msg
        and "batch_size 16 (the run) -> 8" in msg
        and "lr 0.01 (the run) -> 0.05" in msg
    )
    assert "\n" not in msg


def test_store_content_hash_is_recorded_at_extraction(tiny_store):
    s = load_store(tiny_store)
    recorded = s.info.attrs["content_sha256"]
    s.info.attrs.pop("content_sha256")
    assert store_content_hash(s) == recorded  # computed from the arrays for a store without the attribute


# ---------------------------------------------------------------- extension: --resume with more rounds


@pytest.mark.parametrize(
    "kw",
    [
        dict(head="ova2", seeds=[0, 1], iid_reference=True, participation=0.5),
        dict(head="softmax", init="ridge", eval_every=2, calibrate="ccvr", ccvr_samples=20),
        dict(head="ova2", scaffold=True, server_opt="fedadam", optimizer="sgd"),
    ],
    ids=["seeds-iid", "init-evalevery-ccvr", "scaffold-fedadam"],
)
def test_resume_with_more_rounds_extends_a_finished_run(tiny_store, tmp_path, monkeypatch, kw):
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    ref = run_training(cfg_for(tiny_store, rounds=5, **kw), out=tmp_path / "ref", progress=False)
    short = run_training(cfg_for(tiny_store, rounds=3, **kw), out=tmp_path / "ext", progress=False)
    assert (tmp_path / "ext" / FINAL_STATE).exists() and not (tmp_path / "ext" / "checkpoint.safetensors").exists()
    assert len(short.rows) < len(ref.rows)
    ext = run_training(cfg_for(tiny_store, rounds=5, **kw), out=tmp_path / "ext", resume=True, progress=False)
    assert same_nan(accs(ext.rows), accs(ref.rows))
    assert [r["stage"] for r in ext.rows] == [r["stage"] for r in ref.rows]
    for f in ("head-seed0.pt",):
        assert torch.equal(torch.load(tmp_path / "ext" / f), torch.load(tmp_path / "ref" / f))
    assert ext.summary["final_accuracy"] == ref.summary["final_accuracy"]
    for col in ("accuracy", "stage", "bytes_total", "run", "clients_trained"):  # rounds.csv as written
        assert [r[col] for r in read_csv(tmp_path / "ext" / "rounds.csv")] == [
            r[col] for r in read_csv(tmp_path / "ref" / "rounds.csv")
        ], col
    # the extended run is now the 5-round run: resumed again it is reported, and a 3-round resume is refused
    again = run_training(cfg_for(tiny_store, rounds=5, **kw), out=tmp_path / "ext", resume=True, progress=False)
    assert again.summary["final_accuracy"] == ref.summary["final_accuracy"]
    with pytest.raises(FedheadError, match="different configuration"):
        run_training(cfg_for(tiny_store, rounds=3, **kw), out=tmp_path / "ext", resume=True, progress=False)


def test_an_interrupted_extension_resumes(tiny_store, tmp_path, monkeypatch):
    """Interrupted in the second seed's extension: the first seed's extended rounds and the second's final state
    both survive in the checkpoint; the run then ends as a run started with the new rounds."""
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    kw = dict(head="ova2", seeds=[0, 1])
    ref = run_training(cfg_for(tiny_store, rounds=4, **kw), out=tmp_path / "ref", progress=False)
    run_training(cfg_for(tiny_store, rounds=2, **kw), out=tmp_path / "ext", progress=False)
    restore = crash_at(
        monkeypatch, job_module, "evaluate", 3
    )  # seed 0 extended by rounds 3-4, dies in seed 1's round 3
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg_for(tiny_store, rounds=4, **kw), out=tmp_path / "ext", resume=True, progress=False)
    restore()
    assert (tmp_path / "ext" / "checkpoint.safetensors").exists()
    res = run_training(cfg_for(tiny_store, rounds=4, **kw), out=tmp_path / "ext", resume=True, progress=False)
    assert accs(res.rows) == accs(ref.rows)
    for s in (0, 1):
        assert torch.equal(
            torch.load(tmp_path / "ext" / f"head-seed{s}.pt"), torch.load(tmp_path / "ref" / f"head-seed{s}.pt")
        )


def test_cli_resume_with_more_rounds(tiny_store, tmp_path):
    args = ["train", "--features", str(tiny_store), "--clients", "8", "--local-epochs", "1", "--batch-size", "16",
            "--device", "cpu", "--out", str(tmp_path / "r")]  # fmt: skip
    assert runner.invoke(app, [*args, "--rounds", "2"]).exit_code == 0
    r = runner.invoke(app, [*args, "--rounds", "4", "--resume"])
    assert r.exit_code == 0, r.output
    assert [int(x["round"]) for x in read_csv(tmp_path / "r" / "rounds.csv")] == [1, 2, 3, 4]
    assert os.path.exists(tmp_path / "r" / FINAL_STATE)
