"""Partial participation as the papers run it (issue 26, item 3): a fixed number of clients a round,
``--clients-per-round``, the same clients in-process and on Flower, and a round that touches only them."""

from __future__ import annotations

import numpy as np
import pytest

import fedhead.core.engine as engine
from fedhead.core.sampling import per_round, round_clients, sample_clients
from fedhead.federation.config import TrainConfig
from fedhead.federation.train import run_training
from fedhead.infra.errors import FedheadError


def cfg_for(store, **kw) -> TrainConfig:
    base = dict(features=str(store), clients=8, rounds=3, local_epochs=1, batch_size=16, device="cpu", head="ova2")
    return TrainConfig(**{**base, **kw})


def test_clients_per_round_is_the_fraction_that_rounds_to_it():
    cfg = TrainConfig(features="x.h5", clients=9275, clients_per_round=10)
    frac = TrainConfig(features="x.h5", clients=9275, participation=10 / 9275)
    assert per_round(cfg) == per_round(frac) == 10
    for rnd in (1, 2, 50):
        a = round_clients(cfg, 42, rnd)
        assert len(a) == 10 and np.array_equal(a, round_clients(frac, 42, rnd))
        assert np.array_equal(a, sample_clients(9275, 1.0, 42, rnd, count=10))
    assert not np.array_equal(round_clients(cfg, 42, 1), round_clients(cfg, 42, 2))


def test_a_round_trains_and_prepares_only_its_clients(tiny_store, tmp_path, monkeypatch):
    """Every round trains exactly --clients-per-round clients, and the engine lays out a batch plan for those
    only (a round's cost follows the sampled clients, not the federation)."""
    planned = []
    real = engine.local_plan
    monkeypatch.setattr(engine, "local_plan", lambda part, seed, rnd, cid, *a: planned.append((rnd, cid)) or real(
        part, seed, rnd, cid, *a))  # fmt: skip
    cfg = cfg_for(tiny_store, partition="iid", clients=20, clients_per_round=3)
    res = run_training(cfg, out=tmp_path / "r", progress=False)
    assert [int(r["clients_trained"]) for r in res.rows] == [3, 3, 3]
    resolved = cfg.resolved()
    for rnd in (1, 2, 3):
        assert sorted(c for r, c in planned if r == rnd) == round_clients(resolved, 0, rnd).tolist()
    # the same run as the fraction 3/20 = 0.15
    frac = run_training(cfg_for(tiny_store, partition="iid", clients=20, participation=0.15), out=tmp_path / "f",
                        progress=False)  # fmt: skip
    assert [r["accuracy"] for r in frac.rows] == [r["accuracy"] for r in res.rows]


@pytest.mark.parametrize(
    "kw,match",
    [
        # from Python the message names the fields (the CLI names the flags: tests/test_bad_inputs.py)
        (dict(clients_per_round=3, participation=0.5), r"'clients_per_round' \(3\) and 'participation' \(0.5\)"),
        (dict(clients_per_round=9), r"'clients_per_round' parameter must be <= clients \(8\). Got 9"),
        (dict(clients_per_round=0), r"'clients_per_round'"),
    ],
)
def test_clients_per_round_refused_in_one_line(tiny_store, kw, match):
    with pytest.raises(FedheadError, match=match) as exc:
        cfg_for(tiny_store, **kw).resolved()
    assert "\n" not in str(exc.value)


def test_flower_samples_the_same_clients(tmp_path):
    """The Flower strategy (over the in-process grid) trains the clients fedhead train does, round by round."""
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")
    from test_flower_sim import cfg_of, local_run

    from fedhead.core.synthetic import write_synthetic
    from fedhead.flower.inprocess import task_identity as flower_task_identity

    store = write_synthetic(tmp_path / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16)
    cfg = cfg_of(store, clients=6, clients_per_round=2)
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    with flower_task_identity():
        res = local_run(cfg_of(store, clients=6, clients_per_round=2), tmp_path / "flower")
    assert [int(r["clients_trained"]) for r in res.rows] == [int(r["clients_trained"]) for r in ref.rows] == [2, 2, 2]
    np.testing.assert_allclose([float(r["accuracy"]) for r in res.rows], [r["accuracy"] for r in ref.rows], atol=1e-9)


def test_checkpoint_keeps_the_class_counts_sparse():
    """A seed's per-client class counts travel through the checkpoint as their non-zeros, and come back equal (an
    earlier checkpoint's dense counts load as they are)."""
    from fedhead.federation.job import _dense_counts, _sparse_counts

    counts = np.zeros((1000, 300), dtype=np.int64)
    counts[np.arange(1000), np.arange(1000) % 300] = 7
    row = {"seed": 3, "sizes": counts.sum(1), "counts": counts}
    state = _sparse_counts(row)
    assert "counts" not in state and len(state["nonzero"][2]) == 1000
    back = _dense_counts(state)
    assert back["seed"] == 3 and np.array_equal(back["counts"], counts) and np.array_equal(back["sizes"], row["sizes"])
    old = {"seed": 0, "sizes": [2, 1], "counts": [[1, 1], [0, 1]]}
    assert _dense_counts(old) == old


def test_scaffold_variates_that_cannot_fit_are_refused(tiny_store, tmp_path, monkeypatch):
    """SCAFFOLD keeps every client's variate in process: refused in one line when they exceed free memory."""
    import fedhead.federation.inprocess as inprocess

    monkeypatch.setattr(inprocess, "available_memory", lambda: 10_000)  # bytes: less than 20 clients' variates
    with pytest.raises(FedheadError, match=r"'--scaffold'.*20 clients x 10 x 17 floats.*Flower") as exc:
        run_training(
            cfg_for(tiny_store, clients=20, scaffold=True, optimizer="sgd"), out=tmp_path / "r", progress=False
        )
    assert "\n" not in str(exc.value)


def test_error_feedback_residuals_that_cannot_fit_are_refused(tiny_store, tmp_path, monkeypatch):
    """A compressing rule with error feedback keeps every client's residual in process: refused in one line."""
    import fedhead.federation.inprocess as inprocess

    monkeypatch.setattr(inprocess, "available_memory", lambda: 10_000)  # bytes: less than 20 clients' residuals
    with pytest.raises(
        FedheadError, match=r"'--aggregate fedavg-int8'.*20 clients x 10 x 17.*--no-error-feedback"
    ) as e:
        run_training(
            cfg_for(tiny_store, clients=20, aggregate="fedavg-int8", head="ova2"), out=tmp_path / "r", progress=False
        )
    assert "\n" not in str(e.value)
    # without error feedback nothing is kept per client: the run goes
    run_training(
        cfg_for(tiny_store, clients=20, aggregate="fedavg-int8", head="ova2", error_feedback=False, rounds=1),
        out=tmp_path / "ok",
        progress=False,
    )
