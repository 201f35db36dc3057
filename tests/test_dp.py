"""Differential privacy (fedhead.core.dp, the ``dp-fedavg`` rule): clipping by hand, the noise (reproducible, the right
std), DP-FedAvg without noise = unweighted FedAvg, the accountant against dp-accounting's (and Flower's) own
computation, the statistics' sensitivity checked empirically, and a DP run on Flower equal to ``fedhead train``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import fedhead
from fedhead.core.aggregate import Accumulator, DPFedAvg, Totals, create_aggregator
from fedhead.core.closedform import accumulate
from fedhead.core.dp import (
    gaussian,
    noisy_feature_sums,
    privatize_statistics,
    statistics_sensitivity,
    statistics_vector,
)
from fedhead.core.linalg import clip_rows
from fedhead.federation.config import TrainConfig, applicable
from fedhead.federation.rundir import read_csv

pytest.importorskip("dp_accounting", reason="the accountant needs dp-accounting (pip install 'fedhead[dp]')")
from dp_accounting import dp_event, rdp  # noqa: E402

DP = dict(dp_noise_multiplier=1.1, dp_clip=0.5, dp_delta=1e-5)


def _dp_cfg(store, **kw) -> TrainConfig:
    base = dict(
        features=str(store),
        head="softmax",
        partition="iid",
        clients=10,
        rounds=5,
        participation=0.3,
        center=False,
        **DP,
    )
    # the base's --rounds etc. only where they apply (a closed-form head takes none); the case's own options as given
    return TrainConfig(**{**applicable({**base, **kw}), **kw}).resolved()


# ---------------------------------------------------------------- clipping


def test_update_clipping_by_hand():
    # theta = 0; client 1 moved by [3, 4] (norm 5) -> clipped to norm 1: [0.6, 0.8]; client 2 by [0.3, 0.4]
    # (norm 0.5 < 1) -> unchanged; client 3 by [0, 0] -> 0
    theta = torch.zeros(1, 2)
    trained = torch.tensor([[[3.0, 4.0]], [[0.3, 0.4]], [[0.0, 0.0]]])
    msg = DPFedAvg(clip=1.0, noise_multiplier=0.0).message(
        theta, trained, torch.tensor([5, 1, 2]), torch.ones(3, 1, dtype=torch.bool)
    )
    torch.testing.assert_close(msg["clipped"], torch.tensor([[[0.6, 0.8]], [[0.3, 0.4]], [[0.0, 0.0]]]))
    # the update is measured from theta, over the whole head (all rows and the bias together)
    theta = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    trained = torch.tensor([[[2.0, 1.0], [1.0, 1.0 + math.sqrt(3.0)]]])  # update [1, 0, 0, sqrt 3]: norm 2
    msg = DPFedAvg(clip=1.0, noise_multiplier=0.0).message(
        theta, trained, torch.tensor([1]), torch.ones(1, 2, dtype=torch.bool)
    )
    torch.testing.assert_close(msg["clipped"], torch.tensor([[[0.5, 0.0], [0.0, math.sqrt(3.0) / 2]]]))


def test_feature_clipping_by_hand():
    x = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [-6.0, 8.0]], dtype=np.float32)
    want = np.array([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0], [-0.6, 0.8]])
    np.testing.assert_allclose(clip_rows(x, 1.0), want, rtol=1e-7)
    torch.testing.assert_close(clip_rows(torch.as_tensor(x), 1.0), torch.as_tensor(want), rtol=1e-7, atol=1e-7)
    assert clip_rows(x, 1.0).dtype == np.float64


# ---------------------------------------------------------------- the noise


def test_noise_is_reproducible_and_has_the_right_std():
    z, S, m = 2.0, 0.5, 4
    theta = torch.zeros(100, 201)  # 20,100 coordinates

    def one(seed, rnd, sampled=m):
        acc = Accumulator(DPFedAvg(S, z), theta, seed=seed, rnd=rnd, sampled=sampled)
        acc.add(theta[None].repeat(3, 1, 1), torch.ones(3), torch.ones(3, 100, dtype=torch.bool))  # zero updates
        return acc.finish()

    a = one(0, 1)
    torch.testing.assert_close(a, one(0, 1), rtol=0, atol=0)  # keyed by (seed, round): the same draw
    assert not torch.equal(a, one(0, 2)) and not torch.equal(a, one(1, 1))
    # server adds N(0, (z S)^2) to the sum and divides by the m sampled clients: std z S / m = 0.25 per coordinate
    # (the sample std of 20,100 draws is within 1.5% of the truth with probability 1 - 1e-5; the seed is fixed)
    sd = float(a.double().std())
    assert abs(sd / (z * S / m) - 1) < 0.015, sd
    assert abs(float(a.double().mean())) < 4 * (z * S / m) / math.sqrt(a.numel())
    # the denominator is the number sampled, not the number that sent something (3 here)
    assert abs(float(one(0, 1, sampled=8).double().std()) / (z * S / 8) - 1) < 0.015
    # the same stream is what fedhead.core.dp.gaussian gives
    torch.testing.assert_close(a.double(), (gaussian((100, 201), z * S, 0, 1, "dp-fedavg") / m), rtol=0, atol=1e-7)


def test_a_rule_without_seed_or_round_refuses():
    from fedhead.infra.errors import FedheadError

    t = Totals({"clipped": torch.zeros(1, 2, dtype=torch.float64)}, torch.ones(()), torch.ones(1), 1)
    with pytest.raises(FedheadError, match="seed"):
        DPFedAvg(1.0, 1.0).update(torch.zeros(1, 2), t)
    with pytest.raises(FedheadError, match="--dp-clip"):
        create_aggregator("dp-fedavg").message(
            torch.zeros(1, 2), torch.zeros(1, 1, 2), torch.ones(1), torch.ones(1, 1, dtype=torch.bool)
        )


def test_no_noise_and_a_huge_clip_is_unweighted_fedavg():
    g = torch.Generator().manual_seed(0)
    stacked, prev = torch.randn(5, 3, 4, generator=g), torch.randn(3, 4, generator=g)
    sizes = torch.tensor([1, 7, 2, 30, 4])  # unequal: the weighted mean differs
    acc = Accumulator(DPFedAvg(1e9, 0.0), prev, seed=0, rnd=1, sampled=5)
    acc.add(stacked, sizes, torch.ones(5, 3, dtype=torch.bool))
    out = acc.finish()
    torch.testing.assert_close(out, stacked.mean(0), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out, fedhead.core.aggregate.fedavg(stacked, sizes), atol=1e-3)


def test_no_noise_run_equals_plain_fedavg_on_equal_clients(tiny_store, tmp_path):
    """A whole run: with z = 0 and a clip nothing reaches, DP-FedAvg is FedAvg (IID, equal client sizes)."""
    base = dict(features=str(tiny_store), head="softmax", clients=4, rounds=3, center=False)
    plain = fedhead.run(TrainConfig(**base), out=tmp_path / "plain")
    dp = fedhead.run(TrainConfig(**base, dp_noise_multiplier=0.0, dp_clip=1e9, dp_delta=1e-5), out=tmp_path / "dp")
    assert json.loads((tmp_path / "dp" / "config.json").read_text())["config"]["aggregate"] == "dp-fedavg"
    sizes = [int(r["size"]) for r in read_csv(tmp_path / "plain" / "clients.csv")]
    assert len(set(sizes)) == 1, sizes
    torch.testing.assert_close(
        torch.load(tmp_path / "dp" / "head-seed0.pt"),
        torch.load(tmp_path / "plain" / "head-seed0.pt"),
        atol=1e-5,
        rtol=1e-5,
    )
    assert [r["accuracy"] for r in dp.rows] == [r["accuracy"] for r in plain.rows]
    assert dp.summary["dp_epsilon"] == math.inf  # no noise: no privacy
    assert [r["bytes_total"] for r in dp.rows] == [r["bytes_total"] for r in plain.rows]


# ---------------------------------------------------------------- the accountant


def _library_epsilon(events: list[tuple], delta: float) -> float:
    acc = rdp.RdpAccountant()
    for ev, count in events:
        acc.compose(ev, count)
    return acc.get_epsilon(delta)


def test_epsilon_equals_the_library_computation(tiny_store, tmp_path):
    """Reference setting: 10 clients, 3 sampled a round (q = 0.3), z = 1.1, delta 1e-5, 5 rounds."""
    res = fedhead.run(_dp_cfg(tiny_store), out=tmp_path / "run")
    ev = dp_event.PoissonSampledDpEvent(0.3, dp_event.GaussianDpEvent(1.1))
    want = [_library_epsilon([(ev, t)], 1e-5) for t in range(1, 6)]
    np.testing.assert_allclose([r["dp_epsilon"] for r in res.rows], want, rtol=1e-12)
    got = [float(r["dp_epsilon"]) for r in read_csv(tmp_path / "run" / "rounds.csv")]
    np.testing.assert_allclose(got, want, rtol=5e-6)  # the csv keeps 6 significant digits
    assert res.summary["dp_epsilon"] == pytest.approx(want[-1], rel=1e-12)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["dp_delta"] == 1e-5 and summary["dp_level"] == "client"
    assert summary["dp_epsilon"] == pytest.approx(want[-1], rel=1e-12)
    assert 1.0 < want[-1] < 20.0 and want == sorted(want)  # a sane, growing epsilon
    # Flower 1.41's own accountant (its wrapper of the same library) agrees
    fpa = pytest.importorskip("flwr.supercore.privacy_accounting")
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant as FlowerRdp

    facc = FlowerRdp(
        fpa.PrivacyConfig(
            target_delta=1e-5,
            population_size=10,
            neighboring_relation=fpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=fpa.SamplingMethod.POISSON,
        )
    )
    facc.compose(fpa.GaussianPrivacyEvent(noise_multiplier=1.1, sample_size=3, population_size=10), 5)
    assert summary["dp_epsilon"] == pytest.approx(facc.get_epsilon(1e-5), rel=1e-9)


def test_statistics_epsilon_equals_the_library_computation(tiny_store, tmp_path):
    """A closed-form head: one sampled release (q = 0.3); an --init run with --center: the feature sums of all
    clients (q = 1) composed with the --init exchange, and client-level rounds after the exchange."""
    res = fedhead.run(_dp_cfg(tiny_store, head="ncm", dp_clip=3.0), out=tmp_path / "ncm")
    one = dp_event.PoissonSampledDpEvent(0.3, dp_event.GaussianDpEvent(1.1))
    assert res.summary["dp_epsilon"] == pytest.approx(_library_epsilon([(one, 1)], 1e-5), rel=1e-12)
    assert res.summary["dp_level"] == "sample" and res.summary["rounds"] == 1
    res = fedhead.run(_dp_cfg(tiny_store, init="ridge", center=True, dp_feature_clip=3.0), out=tmp_path / "init")
    stats = _library_epsilon([(dp_event.GaussianDpEvent(1.1), 1), (one, 1)], 1e-5)
    assert res.summary["dp_epsilon_statistics"] == pytest.approx(stats, rel=1e-12)
    assert res.summary["dp_epsilon"] == pytest.approx(_library_epsilon([(one, 4)], 1e-5), rel=1e-12)
    rows = read_csv(tmp_path / "init" / "rounds.csv")
    assert rows[0]["stage"] == "statistics" and float(rows[0]["dp_epsilon"]) == 0.0  # no head update yet


# ---------------------------------------------------------------- the statistics: sensitivity and noise


@pytest.mark.parametrize("gram", [False, True])
def test_statistics_sensitivity_holds_and_is_tight(gram):
    """max over random neighbouring datasets (one sample added, any norm: clipped to S by the client) of the change
    in the released statistics vector <= the derived bound, and equal to it for a sample on an axis."""
    rng = np.random.default_rng(0)
    C, D, S = 3, 6, 2.0
    bound = statistics_sensitivity(gram)

    def vec(x, y):
        acc = accumulate(torch.as_tensor(x), torch.as_tensor(y), [np.arange(len(y))], C, gram=gram, cof=False, clip=S)
        return statistics_vector(acc, S)

    worst = 0.0
    for trial in range(300):
        n = int(rng.integers(1, 30))
        x = rng.normal(size=(n, D)) * rng.uniform(0.1, 3.0)
        y = rng.integers(0, C, n)
        new = rng.normal(size=(1, D)) * rng.uniform(0.0, 4.0)  # inside and outside the clip
        both_x, both_y = np.concatenate([x, new]), np.concatenate([y, rng.integers(0, C, 1)])
        change = float((vec(both_x, both_y) - vec(x, y)).norm())
        assert change <= bound + 1e-9, (trial, change, bound)
        worst = max(worst, change)
    assert worst > 0.6 * bound  # random samples come near it
    x, y = rng.normal(size=(10, D)), rng.integers(0, C, 10)
    extreme = np.zeros((1, D))
    extreme[0, 2] = 7.0 * S  # on an axis, clipped to norm S
    change = float((vec(np.concatenate([x, extreme]), np.concatenate([y, [1]])) - vec(x, y)).norm())
    assert change == pytest.approx(bound, rel=1e-12)


def test_statistics_noise_has_the_calibrated_std(tiny_store):
    """ncm: class sums get N(0, (z sqrt2 S)^2), counts N(0, (z sqrt2)^2); ridge's Gram stays symmetric PSD."""
    cfg = _dp_cfg(tiny_store, head="ncm", dp_clip=3.0, dp_noise_multiplier=2.0)
    C, D = 40, 500
    acc = accumulate(torch.zeros(0, D), torch.zeros(0, dtype=torch.int64), [], C, gram=False, cof=False)
    privatize_statistics(acc, cfg, seed=0)
    sd = 2.0 * math.sqrt(2.0)
    assert abs(float(acc.sums.std()) / (sd * 3.0) - 1) < 0.02  # 20,000 draws: within 2% (seed fixed)
    assert abs(float(acc.counts.std()) / sd - 1) < 0.35  # 40 draws
    again = accumulate(torch.zeros(0, D), torch.zeros(0, dtype=torch.int64), [], C, gram=False, cof=False)
    torch.testing.assert_close(privatize_statistics(again, cfg, seed=0).sums, acc.sums, rtol=0, atol=0)
    cfg = _dp_cfg(tiny_store, head="ridge", dp_clip=3.0)
    x = torch.rand(50, 8)
    acc = accumulate(x, torch.randint(0, 4, (50,)), [np.arange(50)], 4, gram=True, cof=False, clip=3.0)
    privatize_statistics(acc, cfg, seed=0)
    torch.testing.assert_close(acc.gram, acc.gram.T, rtol=0, atol=1e-12)
    assert float(torch.linalg.eigvalsh(acc.gram).min()) > -1e-9


def test_feature_sums_noise_is_keyed_and_scaled(tiny_store):
    cfg = _dp_cfg(tiny_store, center=True, dp_feature_clip=2.0, dp_noise_multiplier=3.0)
    D = 20000
    total, sq, n = noisy_feature_sums(np.zeros(D), 0.0, 0, cfg, seed=5)
    assert abs(float(total.std()) / (3.0 * math.sqrt(2.0) * 2.0) - 1) < 0.02
    assert sq == 0.0  # --scale none: the squared norms stay out
    t2, _, n2 = noisy_feature_sums(np.zeros(D), 0.0, 0, cfg, seed=5)
    np.testing.assert_array_equal(total, t2)
    assert n == n2 != 0


def test_dp_statistics_runs_end_to_end(tiny_store, tmp_path):
    """Every DP-capable closed-form head solves from noisy statistics (lda's covariance projected to PSD)."""
    for head in ("ncm", "ridge", "lda"):
        res = fedhead.run(_dp_cfg(tiny_store, head=head, dp_clip=4.0, participation=1.0), out=tmp_path / head)
        assert 0.0 <= res.rows[0]["accuracy"] <= 1.0 and res.summary["dp_level"] == "sample"


# ---------------------------------------------------------------- Flower: the same rule, the same noise


def test_dp_run_on_flower_equals_train(tmp_path):
    """DP-FedAvg with participation 0.75, centred features (noisy sums) and a two-stage head; then a ridge head
    from noisy statistics: Flower's ClientApp and strategy give train's numbers and epsilon."""
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity
    from test_flower_sim import accs, cfg_of, local_run

    from fedhead.core.synthetic import write_synthetic
    from fedhead.federation.train import run_training

    store = write_synthetic(tmp_path / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16)
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = 1, 1, 1  # as a SuperLink sets it
    try:
        for name, kw in (
            (
                "ova2",
                dict(participation=0.75, dp_noise_multiplier=0.8, dp_clip=0.3, dp_delta=1e-4, dp_feature_clip=2.0),
            ),
            ("ridge", dict(head="ridge", dp_noise_multiplier=0.8, dp_clip=2.0, dp_delta=1e-4)),
        ):
            cfg = cfg_of(store, **kw)
            ref = run_training(cfg, out=tmp_path / f"train-{name}", progress=False)
            res = local_run(cfg, tmp_path / f"flower-{name}")
            np.testing.assert_allclose(accs(res.rows), accs(ref.rows), atol=1e-9)
            torch.testing.assert_close(
                torch.load(tmp_path / f"flower-{name}" / "head-seed0.pt"),
                torch.load(tmp_path / f"train-{name}" / "head-seed0.pt"),
                atol=1e-5,
                rtol=1e-5,
            )
            assert [r["dp_epsilon"] for r in res.rows] == [r["dp_epsilon"] for r in ref.rows]
            assert res.summary["dp_epsilon"] == ref.summary["dp_epsilon"]
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
    run_training(cfg_of(store, participation=0.75), out=tmp_path / "plain", progress=False)
    dp_head = torch.load(tmp_path / "train-ova2" / "head-seed0.pt")  # the noise did change the head
    assert not torch.allclose(dp_head, torch.load(tmp_path / "plain" / "head-seed0.pt"), atol=1e-3)
