"""Asynchronous rounds on a simulated clock (issue 40, part 3): FedBuff with equally fast clients and K = M = clients
per round is synchronous FedAvg; the clock is deterministic for a seed; a cut FedBuff run resumes to the same
result; dropped and late clients never contribute; bad input is one line. Nothing here reads the wall clock."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import crash_at

import fedhead.federation.job as job_module
from fedhead.core.clock import EventQueue, TimingModel, staleness_weight, sync_round
from fedhead.federation import compare
from fedhead.federation.config import TrainConfig
from fedhead.federation.experiment import check_transport
from fedhead.federation.inprocess import InProcessTransport
from fedhead.federation.train import run_training
from fedhead.infra.errors import FedheadError


def cfg_for(store, **kw):
    base = dict(features=str(store), clients=8, rounds=4, local_steps=3, batch_size=16, device="cpu", head="ova2",
                partition="dirichlet", clients_per_round=4)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def head(run) -> torch.Tensor:
    return torch.load(run.run_dir / "head-seed0.pt")


def column(rows, name):
    return [r.get(name) for r in rows]


def test_fedbuff_with_equal_speeds_and_k_equal_to_the_round_is_fedavg(tiny_store, tmp_path):
    sync = run_training(cfg_for(tiny_store, timing_sigma=0.0), out=tmp_path / "sync", progress=False)
    buf = run_training(cfg_for(tiny_store, timing_sigma=0.0, async_rule="fedbuff"), out=tmp_path / "b", progress=False)
    assert torch.allclose(head(sync), head(buf), atol=1e-6)
    for key in ("round", "accuracy", "train_loss", "clients_trained"):
        assert column(sync.rows, key) == column(buf.rows, key), key
    assert column(buf.rows, "staleness_mean") == [0.0] * 4
    # the same clock: one round is the slowest client's dispatch, equal for all here
    assert np.allclose([float(r["sim_time_s"]) for r in sync.rows], [float(r["sim_time_s"]) for r in buf.rows])


def test_the_clock_is_deterministic_for_a_seed(tiny_store, tmp_path):
    kw = dict(async_rule="fedbuff", buffer_size=2, stragglers=0.3, seeds=[3])
    a = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "a", progress=False)
    b = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "b", progress=False)
    c = run_training(cfg_for(tiny_store, **{**kw, "seeds": [4]}), out=tmp_path / "c", progress=False)
    assert column(a.rows, "sim_time_s") == column(b.rows, "sim_time_s")
    assert column(a.rows, "accuracy") == column(b.rows, "accuracy")
    assert column(a.rows, "sim_time_s") != column(c.rows, "sim_time_s")
    times = [float(t) for t in column(a.rows, "sim_time_s")]
    assert times == sorted(times) and times[0] > 0
    x, y = compare.curve(compare.load_run(a.run_dir), "accuracy", "sim_time_s")  # compare --x sim_time_s
    assert x.tolist() == pytest.approx(times, rel=1e-5) and y.tolist() == pytest.approx(column(a.rows, "accuracy"))
    speeds = TimingModel(stragglers=0.3).client_rates(8, 3)
    assert all(np.array_equal(x, y) for x, y in zip(speeds, TimingModel(stragglers=0.3).client_rates(8, 3)))


@pytest.mark.parametrize("rule", ["fedbuff", "fedasync"])
def test_a_cut_async_run_resumes_to_the_uninterrupted_result(tiny_store, tmp_path, monkeypatch, rule):
    kw = dict(async_rule=rule, buffer_size=2, concurrency=4, stragglers=0.25, rounds=5) if rule == "fedbuff" else dict(
        async_rule=rule, concurrency=3, stragglers=0.25, rounds=8)  # fmt: skip
    full = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "full", progress=False)
    restore = crash_at(monkeypatch, job_module, "evaluate", 3)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg_for(tiny_store, **kw), out=tmp_path / "cut", progress=False)
    restore()
    resumed = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "cut", resume=True, progress=False)
    for key in ("accuracy", "train_loss", "sim_time_s", "staleness_mean", "clients_trained"):
        assert column(resumed.rows, key) == column(full.rows, key), key
    assert torch.equal(head(resumed), head(full))
    assert any(float(s) > 0 for s in column(full.rows, "staleness_mean"))  # stale updates did happen


def test_a_finished_fedbuff_run_extended_by_resume_is_the_longer_run(tiny_store, tmp_path):
    """The clients still in flight at the end, and their heads, are in the final state: --resume with more rounds
    continues the clock where it stopped."""
    kw = dict(async_rule="fedbuff", buffer_size=2, stragglers=0.25)
    ref = run_training(cfg_for(tiny_store, rounds=5, **kw), out=tmp_path / "ref", progress=False)
    run_training(cfg_for(tiny_store, rounds=3, **kw), out=tmp_path / "ext", progress=False)
    ext = run_training(cfg_for(tiny_store, rounds=5, **kw), out=tmp_path / "ext", resume=True, progress=False)
    for key in ("accuracy", "sim_time_s", "staleness_mean"):
        assert column(ext.rows, key) == column(ref.rows, key), key
    assert torch.equal(head(ext), head(ref))


def test_sync_round_deadline_over_selection_and_dropouts():
    sel = np.array([1, 3, 5, 7, 9])
    t = np.array([4.0, 1.0, 3.0, 2.0, 9.0])
    lost = np.array([False, False, True, False, False])
    kept, took = sync_round(sel, t, lost, keep=3, deadline=None)  # over-selection: the first 3 that come back
    assert kept.tolist() == [1, 3, 7] and took == 4.0
    kept, took = sync_round(sel, t, lost, keep=5, deadline=5.0)  # short of 5 by the deadline: the round is 5 s
    assert kept.tolist() == [1, 3, 7] and took == 5.0
    kept, took = sync_round(sel, t, lost, keep=5, deadline=None)  # no deadline: until the last is back or lost
    assert kept.tolist() == [1, 3, 7, 9] and took == 9.0


def test_a_dropped_client_never_contributes(tiny_store, tmp_path, monkeypatch):
    trained = []
    real = InProcessTransport.train_round

    def spy(self, theta, selected, seed, rnd, server):
        trained.append((rnd, [int(k) for k in selected]))
        return real(self, theta, selected, seed, rnd, server)

    monkeypatch.setattr(InProcessTransport, "train_round", spy)
    run_training(cfg_for(tiny_store, dropout=0.5, rounds=6), out=tmp_path / "s", progress=False)
    timing = TimingModel(dropout=0.5)
    assert trained and any(len(k) < 4 for _, k in trained)  # some rounds lost clients
    assert all(not timing.dropped(0, rnd, k) for rnd, ks in trained for k in ks)
    # the event queue: a lost dispatch frees its slot and is never buffered
    q = EventQueue()
    q.dispatch(np.arange(8), 1, np.arange(1.0, 9.0), timing, seed=0)
    lost = {f.client for f in q.flights if f.dropped}
    arrived = []
    while q.flights:
        arrived += [f.client for f in q.advance() if not f.dropped]
    assert lost and set(arrived) == set(range(8)) - lost and q.now == 8.0


def test_a_deadline_nobody_meets_keeps_the_head(tiny_store, tmp_path):
    run = run_training(cfg_for(tiny_store, deadline=1e-9, rounds=2), out=tmp_path / "d", progress=False)
    assert column(run.rows, "clients_trained") == [0, 0]
    assert [float(t) for t in column(run.rows, "sim_time_s")] == pytest.approx([1e-9, 2e-9])
    assert torch.count_nonzero(head(run)) == 0


def test_staleness_weights():
    assert staleness_weight("sqrt", 0) == 1.0 and staleness_weight("sqrt", 3) == 0.5
    assert staleness_weight("poly", 3, 0.5) == 0.5 and staleness_weight("constant", 9) == 1.0


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(async_rule="fedbuff", buffer_size=5), ["buffer_size", "5", "concurrency (4"]),
        (dict(async_rule="fedbuff", buffer_size=5, concurrency=9), ["concurrency", "9", "clients (8)"]),
        (dict(deadline=-1.0), ["deadline", "-1"]),
        (dict(async_rule="fedbuff", aggregate="median"), ["aggregate", "median", "fedbuff"]),
        (dict(async_rule="fedasync", scaffold=True, optimizer="sgd"), ["scaffold", "fedasync"]),
        (dict(over_selection=2.0), ["over_selection", "12 clients", "clients 8"]),
        (dict(async_rule="fedbuff", deadline=3.0), ["deadline", "async_rule"]),
        (dict(async_rule="fedbuff", head="ridge", local_steps=None, rounds=1), ["async_rule", "closed-form"]),
        (dict(dropout=1.0), ["dropout", "1"]),
        (dict(async_mixing=0.7), ["async_mixing", "fedasync"]),
    ],
)
def test_bad_async_input_is_one_line(tiny_store, kw, words):
    """In fedhead.run's spelling (the command line names the same --flags)."""
    with pytest.raises(FedheadError) as e:
        cfg_for(tiny_store, **kw).resolved()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_the_simulated_clocks_sync_rules_are_refused_on_flower_in_one_line(tiny_store):
    """FedBuff runs on Flower (pushed and pulled messages: test_async_flower.py); a deadline, over-selection and
    dropouts are the simulated clock's."""
    check_transport(cfg_for(tiny_store, async_rule="fedbuff", buffer_size=2), "flower")
    for kw in (dict(deadline=3.0), dict(over_selection=0.3), dict(dropout=0.1)):
        with pytest.raises(FedheadError) as e:
            check_transport(cfg_for(tiny_store, **kw), "flower")
        msg = str(e.value)
        assert "Flower rounds stay synchronous" in msg and "\n" not in msg, msg
    assert math.isfinite(TimingModel().durations(0, np.ones(3), 10.0, 10.0).sum())
