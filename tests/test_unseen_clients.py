"""``--eval-unseen-clients``: the per-client accuracy of the clients no round has sampled yet, beside everyone's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import crash_at

from fedhead.core.clientacc import (
    CLIENT_FIELDS,
    UNSEEN_FIELDS,
    client_accuracy,
    client_summary,
    client_weights,
    unseen_summary,
)
from fedhead.core.sampling import round_clients
from fedhead.federation.config import TrainConfig
from fedhead.federation.rundir import read_csv
from fedhead.federation.train import run_training


def test_unseen_summary_is_the_client_summary_of_the_clients_not_trained():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, (30, 6))
    counts[3] = 0  # a client without samples has no accuracy, trained or not
    totals = np.array([4, 4, 0, 4, 4, 4])  # class 2 has no test sample
    counts[7] = [0, 0, 9, 0, 0, 0]  # ... so this client has none either
    w = client_weights(counts, totals)
    correct = np.array([1, 3, 0, 2, 4, 0])
    trained = rng.random(30) < 0.4
    got = unseen_summary(w, correct, totals, trained)
    every = client_accuracy(w, correct, totals)
    keep = ~trained & (counts[:, [0, 1, 3, 4, 5]].sum(1) > 0)
    want = client_summary(every[keep[w.valid]])
    assert got["unseen_clients"] == int(keep.sum())
    assert {k: got[f"unseen_{k}"] for k in CLIENT_FIELDS} == pytest.approx(want)
    none = unseen_summary(w, correct, totals, np.ones(30, dtype=bool))
    assert none["unseen_clients"] == 0 and all(math.isnan(none[f"unseen_{k}"]) for k in CLIENT_FIELDS)


def _cfg(store, **kw):
    base = dict(features=str(store), clients=20, participation=0.1, rounds=4, local_epochs=1, device="cpu",
                plots=False, head="ova2")  # fmt: skip
    return TrainConfig(**{**base, **kw})


def test_rounds_report_the_clients_no_round_has_sampled(tiny_store, tmp_path):
    cfg = _cfg(tiny_store, eval_unseen_clients=True)
    res = run_training(cfg, out=tmp_path / "on", progress=False)
    rows = read_csv(tmp_path / "on" / "rounds.csv")
    sizes = np.array([int(r["size"]) for r in read_csv(tmp_path / "on" / "clients.csv")])
    sampled = np.zeros(cfg.clients, dtype=bool)
    for r in rows:
        sampled[round_clients(cfg, 0, int(r["round"]))] = True
        assert int(r["unseen_clients"]) == int(((sizes > 0) & ~sampled).sum()) > 0
    assert float(rows[-1]["unseen_client_accuracy_worst10"]) <= float(rows[-1]["unseen_client_accuracy_mean"])
    assert res.summary["unseen_clients"] == int(rows[-1]["unseen_clients"])
    # the flag adds columns and changes nothing else
    off = read_csv(run_training(_cfg(tiny_store), out=tmp_path / "off", progress=False).run_dir / "rounds.csv")
    assert not set(UNSEEN_FIELDS) & set(off[0])
    for key in ("accuracy", *CLIENT_FIELDS):
        assert [r[key] for r in rows] == [r[key] for r in off]
    full = read_csv(run_training(_cfg(tiny_store, participation=1.0, eval_unseen_clients=True, rounds=1),
                                 out=tmp_path / "full", progress=False).run_dir / "rounds.csv")  # fmt: skip
    assert full[0]["unseen_clients"] == "0" and full[0]["unseen_client_accuracy_mean"] == ""  # none: NaN, blank


def test_a_resumed_run_knows_which_clients_trained_before_the_cut(tiny_store, tmp_path, monkeypatch):
    import fedhead.federation.job as job

    cfg = _cfg(tiny_store, eval_unseen_clients=True)
    full = run_training(cfg, out=tmp_path / "full", progress=False)
    restore = crash_at(monkeypatch, job, "evaluate", 3)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, out=tmp_path / "cut", progress=False)
    restore()
    res = run_training(cfg, out=tmp_path / "cut", resume=True, progress=False)
    for key in ("accuracy", *UNSEEN_FIELDS):
        assert [r.get(key) for r in res.rows] == [r.get(key) for r in full.rows], key


def test_flower_reports_the_same_unseen_clients(tiny_store, tmp_path):
    """Flower's ServerApp (over the in-process grid) runs the same round loop: the same unseen-client rows."""
    pytest.importorskip("flwr")
    from fedhead.flower.client_app import make_client_app
    from fedhead.flower.inprocess import InProcessGrid, sim_nodes, task_identity
    from fedhead.flower.server_app import run_server
    from fedhead.flower.strategy import ServerSettings

    cfg = _cfg(tiny_store, clients=10, participation=0.3, rounds=2, eval_unseen_clients=True)
    with task_identity():
        grid = InProcessGrid(make_client_app(str(tiny_store)), sim_nodes(cfg.clients))
        run_server(grid, cfg, ServerSettings(out=str(tmp_path / "flower"), resume=False, wait_timeout=5))
    sim = read_csv(run_training(cfg, out=tmp_path / "sim", progress=False).run_dir / "rounds.csv")
    flower = read_csv(tmp_path / "flower" / "rounds.csv")
    assert [r["unseen_clients"] for r in flower] == [r["unseen_clients"] for r in sim] != ["0", "0"]
    for key in ("accuracy", *UNSEEN_FIELDS[:-1]):
        assert [float(r[key]) for r in flower] == pytest.approx([float(r[key]) for r in sim], abs=1e-5)
