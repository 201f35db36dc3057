"""Compressed client updates (fedhead.core.compress): the int8 and top-k compressors, error feedback's bookkeeping,
the rules against FedAvg where they are lossless, exact bytes, the simulator's backends and forms, Flower against
``fedhead train``, and the residuals across a resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import crash_at, small_cfg

from fedhead.core.aggregate import Accumulator, FedAvg, create_aggregator
from fedhead.core.compress import (
    Int8FedAvg,
    Residuals,
    TopKFedAvg,
    int8_dequantize,
    int8_quantize,
    topk_count,
    topk_densify,
    topk_sparsify,
)
from fedhead.federation.rundir import CHECKPOINT, read_state
from fedhead.federation.train import run_training
from fedhead.infra.errors import FedheadError


def cfg(store, **kw):
    return small_cfg(store, shards_per_client=2, **kw)


# ---------------------------------------------------------------- the compressors


def test_int8_round_trip_is_within_half_a_step_per_entry():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(3, 5, 9, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
    u[1, 2] = 0.0  # a zero row: scale 0, codes 0
    codes, scale = int8_quantize(u)
    assert codes.dtype == torch.int8 and scale.shape == (3, 5)
    assert int(codes.abs().max()) == 127 and scale[1, 2] == 0 and not codes[1, 2].any()
    # the largest entry of every non-zero row is +-127 exactly
    assert torch.equal(codes.abs().amax(-1)[scale > 0].to(torch.int64), torch.full((14,), 127))
    err = (u - int8_dequantize(codes, scale)).abs()
    assert bool((err <= scale.unsqueeze(-1) / 2 * (1 + 1e-6)).all())
    # round half to even, deterministic: 0.5 and 2.5 steps go to 0 and 2
    half = torch.tensor([[[127.0, 0.5, 2.5, -0.5]]])
    assert int8_quantize(half)[0].tolist() == [[[127, 0, 2, 0]]]


def test_topk_keeps_exactly_k_largest_with_ties_to_the_lower_index():
    g = torch.Generator().manual_seed(1)
    u = torch.randn(4, 6, 11, generator=g)
    k = topk_count(0.1, 66)
    assert k == 7 and topk_count(0.07, 100) == 7 and topk_count(1e-9, 10) == 1 and topk_count(1.0, 66) == 66
    values, index = topk_sparsify(u, k)
    assert values.shape == index.shape == (4, k) and index.dtype == torch.int32
    dense = topk_densify(values, index, (6, 11))
    assert ((dense != 0).sum((1, 2)) == k).all()
    flat = u.reshape(4, -1).abs()
    kth = flat.sort(1, descending=True).values[:, k - 1 : k]
    assert torch.equal(dense.reshape(4, -1).abs() >= kth, dense.reshape(4, -1) != 0)
    tied = torch.ones(2, 3, 4)
    tied[1, 2, 3] = -2.0  # the largest, then ties: the lowest flat indices
    _, idx = topk_sparsify(tied, 3)
    assert idx.tolist() == [[0, 1, 2], [0, 1, 11]]


# ---------------------------------------------------------------- error feedback


@pytest.mark.parametrize("rule", [Int8FedAvg(), TopKFedAvg(fraction=0.05)], ids=["int8", "topk"])
def test_error_feedback_sends_every_update_in_the_end(rule):
    """Over rounds, sum_t q_k,t + e_k,T == sum_t delta_k,t per client (float64): what compression drops is sent
    later, nothing is lost. Without error feedback the identity fails (the residual is dropped)."""
    g = torch.Generator().manual_seed(2)
    K, C, D1, ids = 3, 4, 10, [5, 0, 2]
    rule.residuals = Residuals.zeros(6, C, D1, "cpu", dtype=torch.float64)
    sent, deltas = torch.zeros(K, C, D1, dtype=torch.float64), torch.zeros(K, C, D1, dtype=torch.float64)
    sizes, holds = torch.ones(K, dtype=torch.float64), torch.ones(K, C, dtype=torch.bool)
    for _ in range(6):
        theta = torch.randn(C, D1, generator=g, dtype=torch.float64)
        trained = theta + torch.randn(K, C, D1, generator=g, dtype=torch.float64)
        msg = rule.message(theta, trained, sizes, holds, ids=ids)  # sizes 1: the message is q_k itself
        sent += msg["weighted"]
        deltas += trained - theta
    e = rule.residuals.e[ids]
    assert e.abs().max() > 1e-3  # compression really dropped something this round
    torch.testing.assert_close(sent + e, deltas, atol=1e-12, rtol=0)
    assert not rule.residuals.e[[1, 3, 4]].any()  # clients that never sent keep a zero residual
    plain = type(rule)(error_feedback=False)
    kept = torch.zeros(K, C, D1, dtype=torch.float64)
    for _ in range(2):
        kept += plain.message(theta, trained, sizes, holds)["weighted"]
    assert (kept - 2 * (trained - theta)).abs().max() > 1e-3


def test_error_feedback_without_residuals_or_ids_is_one_line():
    rule, theta = Int8FedAvg(), torch.zeros(2, 3)
    with pytest.raises(FedheadError, match="no client ids"):
        rule.message(theta, theta[None], torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
    rule.residuals = Residuals.held_by([4], torch.zeros(1, 2, 3))
    with pytest.raises(FedheadError, match=r"not client\(s\) \[3\]"):
        rule.message(theta, theta[None], torch.ones(1), torch.ones(1, 2, dtype=torch.bool), ids=[3])
    with pytest.raises(FedheadError, match="'fraction'"):
        TopKFedAvg(fraction=0.0)


# ---------------------------------------------------------------- against FedAvg, bytes


def _aggregate(rule, theta, trained, sizes, holds, ids):
    acc = Accumulator(rule, theta)
    acc.add(trained, sizes, holds, ids=ids)
    return acc.finish()


def test_lossless_settings_equal_fedavg():
    """top-k with fraction 1 sends the whole update; int8 is exact when every row's update is integers with
    max |.| = 127 (scale 1): both give FedAvg's head (to float rounding: theta + mean delta vs mean W)."""
    g = torch.Generator().manual_seed(3)
    K, C, D1 = 4, 5, 8
    theta = torch.round(torch.randn(C, D1, generator=g) * 64) / 64  # dyadic: theta + step and W - theta are exact
    steps = torch.randint(-127, 128, (K, C, D1), generator=g).float()
    steps[:, :, 0] = 127.0
    trained = theta + steps * 2.0**-7  # exact in float32; int8 of u = steps * 2^-7: scale 2^-7, exact codes
    sizes, holds = torch.tensor([3.0, 10.0, 1.0, 6.0]), torch.ones(K, C, dtype=torch.bool)
    ref = _aggregate(FedAvg(), theta, trained, sizes, holds, None)
    for rule in (TopKFedAvg(fraction=1.0), Int8FedAvg()):
        rule.residuals = Residuals.zeros(K, C, D1, "cpu")
        torch.testing.assert_close(_aggregate(rule, theta, trained, sizes, holds, [0, 1, 2, 3]), ref, atol=1e-6, rtol=0)
        assert not rule.residuals.e.any()  # nothing held back
    lossy = TopKFedAvg(fraction=0.5, error_feedback=False)
    assert (_aggregate(lossy, theta, trained, sizes, holds, None) - ref).abs().max() > 1e-2


def test_bytes_are_the_wire_forms():
    theta = torch.zeros(5, 7)
    assert Int8FedAvg().nbytes(theta) == 5 * 7 * 1 + 5 * 4  # int8 codes + float32 scales
    assert TopKFedAvg(fraction=0.1).nbytes(theta) == 4 * (4 + 4)  # k = ceil(3.5) values + int32 indices
    assert create_aggregator("fedavg").nbytes(theta) == 5 * 7 * 4
    for rule in (Int8FedAvg(error_feedback=False), TopKFedAvg(fraction=0.1, error_feedback=False)):
        sent = rule.wire(theta, torch.randn(1, 5, 7), torch.ones(1), torch.ones(1, 5, dtype=torch.bool))
        assert sum(v[0].numel() * v.element_size() for v in sent.values()) == rule.nbytes(theta)


def test_a_run_counts_the_compressed_bytes(tiny_store, tmp_path):
    C, D1 = 10, 17
    dense = run_training(cfg(tiny_store), out=tmp_path / "d", progress=False)
    for agg, extra, per_round in (
        ("fedavg-int8", {}, C * D1 + 4 * C),
        ("fedavg-topk", {"topk_fraction": 0.25}, math.ceil(0.25 * C * D1) * 8),
    ):
        r = run_training(cfg(tiny_store, aggregate=agg, **extra), out=tmp_path / agg, progress=False)
        centring = (16 + 2) * 4  # round 1 also sends the feature sums of --center (the default recipe)
        assert [x["bytes_up_per_client"] for x in r.rows] == [per_round + centring, per_round, per_round]
        assert [x["bytes_up_per_client"] for x in dense.rows] == [C * D1 * 4 + centring] + [C * D1 * 4] * 2
        assert r.summary["mb_per_client"] == pytest.approx((3 * per_round + centring) / 1e6)
        assert r.rows[1]["bytes_total"] == 8 * (per_round + C * D1 * 4)  # up compressed, the head down


# ---------------------------------------------------------------- the simulator

# clients of unequal sizes, batches of 4: a dual block holds clients with different step counts (ordered by them)
UNEQUAL = dict(partition="dirichlet", partition_params={"alpha": 0.5, "min_size": 5}, batch_size=4)


@pytest.mark.parametrize("agg,extra", [("fedavg-int8", {}), ("fedavg-topk", {"topk_fraction": 0.2})])
def test_backends_and_forms_agree(tiny_store, tmp_path, agg, extra):
    """The vectorized engine, the loop backend and the dual form give the same heads (the residuals make every
    round depend on the ones before; half the clients a round, of unequal sizes (the dual form orders a block by
    steps), so a residual given to the wrong client shows)."""
    heads = {}
    for name, kw in (
        ("vectorized", dict(dual="off")),
        ("loop", dict(backend="loop")),
        ("dual", dict(dual="on")),
    ):
        c = cfg(tiny_store, aggregate=agg, rounds=4, participation=0.5, **UNEQUAL, **extra, **kw)
        run_training(c, out=tmp_path / name, progress=False)
        heads[name] = torch.load(tmp_path / name / "head-seed0.pt")
    torch.testing.assert_close(heads["loop"], heads["vectorized"], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(heads["dual"], heads["vectorized"], atol=2e-5, rtol=1e-4)
    no_ef = run_training(
        cfg(tiny_store, aggregate=agg, rounds=4, participation=0.5, error_feedback=False, **UNEQUAL, **extra),
        out=tmp_path / "noef",
        progress=False,
    )
    assert (torch.load(tmp_path / "noef" / "head-seed0.pt") - heads["vectorized"]).abs().max() > 1e-4
    assert no_ef.rows[-1]["bytes_up_per_client"] == create_aggregator(agg, cfg(tiny_store, **extra)).nbytes(
        heads["loop"]
    )


def test_resume_keeps_the_residuals(tiny_store, tmp_path, monkeypatch):
    import fedhead.federation.job as job

    kw = dict(aggregate="fedavg-topk", topk_fraction=0.1, rounds=4, participation=0.5)
    full = run_training(cfg(tiny_store, **kw), out=tmp_path / "full", progress=False)
    restore = crash_at(monkeypatch, job, "evaluate", 3)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg(tiny_store, **kw), out=tmp_path / "cut", progress=False)
    restore()
    saved = read_state(tmp_path / "cut" / CHECKPOINT)
    assert saved["current"]["server"]["residuals"]["e"].abs().max() > 0
    res = run_training(cfg(tiny_store, **kw), out=tmp_path / "cut", resume=True, progress=False)
    assert [r["accuracy"] for r in res.rows] == [r["accuracy"] for r in full.rows]
    assert torch.equal(torch.load(tmp_path / "cut" / "head-seed0.pt"), torch.load(tmp_path / "full" / "head-seed0.pt"))


def test_options_reach_the_rule_through_every_surface(tiny_store, tmp_path):
    from fedhead.core.aggregate import aggregator_of

    rule = aggregator_of(cfg(tiny_store, aggregate="fedavg-topk", topk_fraction=0.3, error_feedback=False).resolved())
    assert isinstance(rule, TopKFedAvg) and rule.fraction == 0.3 and not rule.error_feedback
    assert aggregator_of(cfg(tiny_store, aggregate="fedavg-topk").resolved()).fraction == 0.01
    with pytest.raises(FedheadError, match="'topk_fraction'"):
        import fedhead

        fedhead.run(features=str(tiny_store), aggregate="fedavg-topk", topk_fraction=2.0, out=str(tmp_path / "x"))
    pytest.importorskip("flwr")
    from fedhead.flower.commands import run_config_of
    from fedhead.flower.common import config_from_run_config

    c = cfg(tiny_store, aggregate="fedavg-topk", topk_fraction=0.3, error_feedback=False)
    rc = run_config_of(c, tmp_path / "run", False, 60, 60)
    assert rc["topk-fraction"] == 0.3 and rc["error-feedback"] is False
    assert config_from_run_config(rc).resolved().identity() == c.resolved().identity()


# ---------------------------------------------------------------- Flower


@pytest.mark.parametrize("agg,extra", [("fedavg-int8", {}), ("fedavg-topk", {"topk_fraction": 0.2})])
def test_flower_matches_fedhead_train(tmp_path, agg, extra):
    pytest.importorskip("flwr")
    from test_flower_scaffold_ccvr import assert_same_rows, strategy_run
    from test_flower_sim import sim_nodes

    from fedhead.core.synthetic import write_synthetic
    from fedhead.flower.client_app import make_client_app
    from fedhead.flower.inprocess import InProcessGrid, task_identity
    from fedhead.flower.node import RESIDUALS

    store = write_synthetic(tmp_path / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16)
    c = cfg(store, clients=4, rounds=3, participation=0.75, aggregate=agg, **extra)
    ref = run_training(c, out=tmp_path / "train", progress=False)
    with task_identity():
        # wire=True: every message serialised and parsed as Flower does (the int8 codes, the int32 indices)
        grid = InProcessGrid(make_client_app(str(store)), sim_nodes(c.clients), wire=True)
        strat, res = strategy_run(c, tmp_path / "flower", grid)
    assert_same_rows(res.rows, ref.rows)
    torch.testing.assert_close(
        torch.load(tmp_path / "flower" / "head-seed0.pt"), torch.load(tmp_path / "train" / "head-seed0.pt"), atol=1e-5,
        rtol=1e-5,
    )  # fmt: skip
    # every node keeps its own residual, the one the server names for its next round
    held = [grid.ctx[strat.node_of[p]].state.get(RESIDUALS) for p in range(c.clients)]
    tags = [strat.residual_tags.tag(strat.residual_tags.accepted[p]) for p in range(c.clients)]
    assert all(h is not None and t in h for h, t in zip(held, tags))
    assert np.abs(np.stack([h[t].numpy() for h, t in zip(held, tags)])).max() > 0


def test_flower_resume_finds_the_residuals_in_the_node_state_folder(tmp_path, monkeypatch):
    """A server stopped after round 2 and resumed in a new Flower run (its nodes start with an empty Context.state)
    continues exactly when the nodes keep their residuals in a state folder; nodes without one start again from
    zero residuals (the run completes, and differs)."""
    pytest.importorskip("flwr")
    from flower_hooks import STOP_ENV, ServerStopped  # the tests' hooks, installed by the import
    from test_flower_scaffold_ccvr import assert_same_rows, strategy_run
    from test_flower_sim import LocalGrid, sim_nodes

    from fedhead.core.synthetic import write_synthetic
    from fedhead.flower.client_app import make_client_app
    from fedhead.flower.inprocess import task_identity
    from fedhead.flower.node import RESIDUALS

    store = write_synthetic(tmp_path / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16)
    c = cfg(store, clients=4, rounds=4, participation=0.75, aggregate="fedavg-topk", topk_fraction=0.2)
    ref = run_training(c, out=tmp_path / "train", progress=False)
    heads = {}
    for name, state_dir in (("disk", tmp_path / "node-state"), ("lost", None)):
        nodes = [{**nc, "state-dir": str(state_dir)} if state_dir else nc for nc in sim_nodes(c.clients)]
        with task_identity():
            monkeypatch.setenv(STOP_ENV, "2")
            with pytest.raises(ServerStopped):
                strategy_run(c, tmp_path / name, LocalGrid(make_client_app(str(store)), nodes))
            monkeypatch.delenv(STOP_ENV)
            grid = LocalGrid(make_client_app(str(store)), nodes)
            assert all(RESIDUALS not in ctx.state for ctx in grid.ctx.values())
            _, res = strategy_run(c, tmp_path / name, grid, resume=True)
        assert len(res.rows) == 4
        heads[name] = torch.load(tmp_path / name / "head-seed0.pt")
        if name == "disk":
            assert_same_rows(res.rows, ref.rows)
    ref_head = torch.load(tmp_path / "train" / "head-seed0.pt")
    torch.testing.assert_close(heads["disk"], ref_head, atol=1e-5, rtol=1e-5)
    assert (heads["lost"] - ref_head).abs().max() > 1e-4
    assert len(list((tmp_path / "node-state").glob("residual-p*-*.safetensors"))) == c.clients


def test_flower_lost_reply_trains_from_the_residual_the_server_counted(tmp_path, caplog):
    """Partition 1's reply of round 2 is lost (it trained and kept a new residual): round 3 names its round-1
    residual, which the node still holds (two versions), so nothing is counted twice and nothing is lost."""
    pytest.importorskip("flwr")
    from test_flower_scaffold_ccvr import DropReply, strategy_run
    from test_flower_sim import sim_nodes

    from fedhead.core.synthetic import write_synthetic
    from fedhead.federation.rundir import read_csv
    from fedhead.flower.client_app import make_client_app
    from fedhead.flower.inprocess import task_identity
    from fedhead.flower.node import RESIDUALS

    store = write_synthetic(tmp_path / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16)
    c = cfg(store, clients=4, rounds=4, aggregate="fedavg-int8")
    with task_identity(), caplog.at_level("WARNING"):
        grid = DropReply(make_client_app(str(store)), sim_nodes(c.clients))
        strat, _ = strategy_run(c, tmp_path / "r", grid)
    assert [r["failed_clients"] for r in read_csv(tmp_path / "r" / "rounds.csv")] == ["", "1", "", ""]
    assert strat.residual_tags.accepted.tolist() == [4, 4, 4, 4]
    assert "lost its error-feedback residual" not in caplog.text
    assert len(grid.ctx[1001].state[RESIDUALS]) == 2  # the version it started from and the one it made
