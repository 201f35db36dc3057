"""One-round heads from class moments (issue 25): qda, fedpft and ridge-rf equal their pooled solves under every
partition, AFL's analytic solve equals fedhead's ridge, exact bytes, bad options in one line."""

import numpy as np
import pytest
import torch
from test_closedform import _data

from fedhead.core.closedform import accumulate, check_moments_size, client_stats, message_bytes
from fedhead.core.heads import create_head
from fedhead.core.partitions import create_partition
from fedhead.infra.errors import FedheadError

PARTS = [
    ("iid", {}),
    ("shard", {"shards_per_client": 1}),
    ("dirichlet", {"alpha": 0.1, "min_size": 1}),
    ("bernoulli-dirichlet", {}),
    ("zipf", {}),
    ("kmeans", {}),
]


def _qda_reference(x, y, c, lam, gam):
    """Friedman's RDA written directly from its definition (numpy, float64): the scores of every sample."""
    x, y = x.numpy().astype(np.float64), y.numpy()
    n, d = x.shape
    mu = np.stack([x[y == k].mean(0) for k in range(c)])
    scat = np.stack([(x[y == k] - mu[k]).T @ (x[y == k] - mu[k]) for k in range(c)])
    pooled = scat.sum(0)
    scores = np.zeros((n, c))
    for k in range(c):
        nk = (y == k).sum()
        sig = ((1 - lam) * scat[k] + lam * pooled) / ((1 - lam) * nk + lam * n)
        sig = (1 - gam) * sig + gam * np.trace(sig) / d * np.eye(d)
        dev = x - mu[k]
        maha = np.einsum("nd,de,ne->n", dev, np.linalg.inv(sig), dev)
        scores[:, k] = -0.5 * maha - 0.5 * np.linalg.slogdet(sig)[1] + np.log(nk / n)
    return scores


def _ridge_rf_reference(x, y, c, width, seed, lam):
    """Random ReLU features drawn as documented, then the ridge solve on [phi, 1] (numpy, float64)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(x.shape[1], width, generator=g, dtype=torch.float64) / np.sqrt(x.shape[1])).numpy()
    phi = np.maximum(x.numpy().astype(np.float64) @ w, 0)
    phi = np.concatenate([phi, np.ones((len(phi), 1))], 1)
    return np.linalg.solve(phi.T @ phi + lam * np.eye(width + 1), phi.T @ np.eye(c)[y.numpy()]).T


def _federated(name, x, y, parts, c, per_client, **params):
    head = create_head(name, **params)
    order = parts
    if per_client:  # the Flower server's way, in another order
        order = [parts[i] for i in np.random.default_rng(1).permutation(len(parts))]
    kw = head.message_kwargs(x.shape[1])
    acc = accumulate(x, y, order, c, cof=False, block_rows=100, per_client=per_client, **kw)
    return head, head.solve(acc)


def _z(x):
    return torch.cat([x, torch.ones(len(x), 1)], 1)


@pytest.mark.parametrize("partition,pp", PARTS)
@pytest.mark.parametrize("per_client", [False, True])
def test_qda_federated_equals_pooled_definition(partition, pp, per_client):
    x, y = _data()
    parts = create_partition(partition, y.numpy(), 12, seed=3, features=x.numpy(), **pp)
    head, theta = _federated("qda", x, y, parts, 5, per_client, qda_lambda=0.3, qda_gamma=0.05)
    ref = _qda_reference(x, y, 5, 0.3, 0.05)
    got = head.logits(theta, _z(x)).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
    np.testing.assert_allclose(head.solve_central(x, y, 5).numpy(), theta.numpy(), rtol=1e-9, atol=1e-12)


def test_qda_special_cases_lda_and_plain_qda():
    """lambda = 1, gamma = 0 is LDA with the pooled maximum-likelihood covariance (same argmax as ``lda`` without
    shrinkage and with that covariance); lambda = 0 is each class's own covariance."""
    x, y = _data(n=400, d=4, c=3)
    scores = create_head("qda", qda_lambda=1.0, qda_gamma=0.0)
    theta = scores.solve_central(x, y, 3)
    ref = _qda_reference(x, y, 3, 1.0, 0.0)
    np.testing.assert_allclose(scores.logits(theta, _z(x)).numpy(), ref, rtol=1e-9, atol=1e-9)
    lda = create_head("lda", lda_shrinkage=0.0).solve_central(x, y, 3)
    lin = (_z(x).double() @ lda.T).numpy()
    assert (lin.argmax(1) == ref.argmax(1)).all()
    plain = create_head("qda", qda_lambda=0.0, qda_gamma=0.0)
    np.testing.assert_allclose(
        plain.logits(plain.solve_central(x, y, 3), _z(x)).numpy(), _qda_reference(x, y, 3, 0.0, 0.0), rtol=1e-8
    )


@pytest.mark.parametrize("partition,pp", PARTS)
def test_ridge_rf_federated_equals_pooled_definition(partition, pp):
    x, y = _data()
    parts = create_partition(partition, y.numpy(), 12, seed=3, features=x.numpy(), **pp)
    for per_client in (False, True):
        head, theta = _federated("ridge-rf", x, y, parts, 5, per_client, rf_width=64, rf_seed=7)
        ref = _ridge_rf_reference(x, y, 5, 64, 7, 0.01)
        np.testing.assert_allclose(theta.numpy(), ref, rtol=1e-6, atol=1e-9 * np.abs(ref).max())
    # scores through the head's own map (what evaluation and a saved model use)
    phi_scores = head.logits(theta, _z(x)).numpy()
    g = torch.Generator().manual_seed(7)
    w = torch.randn(7, 64, generator=g, dtype=torch.float64) / np.sqrt(7)
    want = np.concatenate([np.maximum(x.numpy() @ w.numpy(), 0), np.ones((len(x), 1))], 1) @ ref.T
    np.testing.assert_allclose(phi_scores, want, rtol=1e-5, atol=1e-6)
    # another seed is another projection
    _, other = _federated("ridge-rf", x, y, parts, 5, False, rf_width=64, rf_seed=8)
    assert not np.allclose(other.numpy(), ref)


@pytest.mark.parametrize("partition,pp", PARTS)
def test_fedpft_federated_equals_its_pooled_solve(partition, pp):
    x, y = _data(n=200, d=5, c=4)
    parts = create_partition(partition, y.numpy(), 8, seed=3, features=x.numpy(), **pp)
    head, theta = _federated("fedpft", x, y, parts, 4, True, fedpft_samples=50, fedpft_weight_decay=1e-2)
    central = head.solve_central(x, y, 4)
    # the same moments to float64 rounding give the same draws and the same L-BFGS fit (float32)
    np.testing.assert_allclose(theta.numpy(), central.numpy(), rtol=1e-4, atol=1e-4 * float(central.abs().max()))
    xv, yv = head.sample(accumulate(x, y, [np.arange(len(y))], 4, cof=False, **head.message_kwargs(5)))
    assert np.bincount(yv).tolist() == [50] * 4 and xv.shape == (200, 5)


def test_fedpft_draws_follow_the_class_gaussians():
    """Default: as many draws per class as real samples; their mean and covariance approach the class's."""
    x, y = _data(n=4000, d=3, c=2)
    head = create_head("fedpft", fedpft_weight_decay=1e-2)
    acc = accumulate(x, y, [np.arange(len(y))], 2, cof=False, **head.message_kwargs(3))
    xv, yv = head.sample(acc)
    assert np.bincount(yv).tolist() == np.bincount(y.numpy()).tolist()
    for k in range(2):
        real = x.numpy()[y.numpy() == k].astype(np.float64)
        fake = xv[yv == k].astype(np.float64)
        np.testing.assert_allclose(fake.mean(0), real.mean(0), atol=0.1)
        np.testing.assert_allclose(np.cov(fake.T), np.cov(real.T), atol=0.15)
    theta = head.solve(acc)
    acc_train = float((((_z(x).double() @ theta.T).argmax(1)) == y).double().mean())
    assert acc_train > 0.9


def test_afl_analytic_solve_equals_fedhead_ridge_with_clients_smaller_than_dims():
    """AFL (He et al., 2024): each client sends its regularised auto-correlation ``C_k + gamma I`` and local ridge
    weight; the server's absolute aggregation and the removal of the K - 1 extra regularisers give the ridge of the
    pooled data. Clients hold 3 samples in 8 dimensions (their C_k are singular)."""
    x, y = _data(n=60, d=7, c=4)
    parts = [np.arange(i, i + 3) for i in range(0, 60, 3)]  # 20 clients, 3 samples, D + 1 = 8
    gamma = 0.5
    phi = np.concatenate([x.numpy().astype(np.float64), np.ones((60, 1))], 1)
    Y = np.eye(4)[y.numpy()]
    creg, wk = [], []
    for p in parts:
        ck = phi[p].T @ phi[p]
        assert np.linalg.matrix_rank(ck) < 8
        creg.append(ck + gamma * np.eye(8))
        wk.append(np.linalg.solve(creg[-1], phi[p].T @ Y[p]))
    total = sum(creg)
    w_aa = np.linalg.solve(total, sum(c @ w for c, w in zip(creg, wk)))  # absolute aggregation
    w_afl = np.linalg.solve(total - (len(parts) - 1) * gamma * np.eye(8), total @ w_aa)  # regularisation removed
    head = create_head("ridge", ridge_lambda=gamma)
    fed = head.solve(accumulate(x, y, parts, 4, gram=True, cof=False, per_client=True))
    np.testing.assert_allclose(fed.numpy(), w_afl.T, rtol=1e-8, atol=1e-10)


def test_second_moment_message_bytes_and_memory_bound(monkeypatch):
    x, y = _data(n=40, d=3, c=4)
    m = client_stats(x[:10], y[:10], 4, gram=False, second=True)
    held = len(np.unique(y[:10].numpy()))
    assert m.second.shape == (held, 3, 3)
    assert m.nbytes() == held * (4 + 8 + 8 * 3) + held * 8 * 6 == message_bytes(held, 3, False, True)
    parts = [np.arange(0, 10), np.arange(10, 25), np.arange(25, 40)]
    a1 = accumulate(x, y, parts, 4, gram=False, cof=False, second=True)
    a2 = accumulate(x, y, parts, 4, gram=False, cof=False, second=True, per_client=True)
    assert a1.bytes_up == a2.bytes_up
    torch.testing.assert_close(a1.second, a2.second, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("FEDHEAD_MEMORY_BUDGET", "3G")  # the bound is the memory there is (issue 37), here 3 GiB
    check_moments_size(100, 1280)  # 1.3 GB of sums, 2.6 GB with the solve: fits
    with pytest.raises(FedheadError) as e:
        check_moments_size(200, 1280)
    msg = str(e.value)
    assert "\n" not in msg and "'--head'" in msg and "200 classes" in msg and "5,242.9 MB" in msg
    assert "FEDHEAD_MEMORY_BUDGET=3G" in msg


@pytest.mark.parametrize(
    "name,params,flag",
    [
        ("qda", {"qda_lambda": 1.5}, "'--qda-lambda'"),
        ("qda", {"qda_gamma": -0.1}, "'--qda-gamma'"),
        ("ridge-rf", {"rf_width": 0}, "'--rf-width'"),
        ("ridge-rf", {"rf_lambda": 0}, "'--rf-lambda'"),
        ("fedpft", {"fedpft_samples": -1}, "'--fedpft-samples'"),
        ("fedpft", {"fedpft_weight_decay": -1.0}, "'--fedpft-weight-decay'"),
    ],
)
def test_bad_options_are_one_line(name, params, flag):
    with pytest.raises(FedheadError) as e:
        create_head(name, **params)
    assert "\n" not in str(e.value) and flag in str(e.value)


def test_qda_singular_covariance_is_one_line():
    x, y = _data(n=30, d=6, c=5)
    head = create_head("qda", qda_lambda=0.0, qda_gamma=0.0)
    acc = accumulate(x[:8], y[:8], [np.arange(8)], 5, cof=False, **head.message_kwargs(6))  # classes of 1-3 samples
    with pytest.raises(FedheadError) as e:
        head.solve(acc)
    assert "\n" not in str(e.value) and "'--qda-gamma'" in str(e.value)


@pytest.mark.parametrize("head", ["qda", "fedpft", "ridge-rf"])
def test_secure_aggregation_is_refused_in_one_line(head, tiny_store):
    from fedhead.federation.config import TrainConfig
    from fedhead.federation.train import validate_method

    cfg = TrainConfig(features=str(tiny_store), head=head, clients=10, secure_aggregation=True)
    with pytest.raises(FedheadError) as e:
        validate_method(cfg)
    assert "\n" not in str(e.value) and f"does not carry the statistics of {head!r}" in str(e.value)


def test_tuned_probe_chooses_its_weight_on_held_out_training_data_only():
    from fedhead.core.central import central_head, tuned_probe
    from fedhead.core.engine import evaluate

    x, y = _data(n=300, d=6, c=4)
    xt, yt = _data(n=100, d=6, c=4, seed=1)
    z, zt = _z(x), _z(xt)
    grid = (1e-3, 1e-1, 10.0)
    p = tuned_probe(z, y, zt, yt, 4, seed=0, grid=grid)
    assert set(p.holdout) == set(grid)
    assert p.weight_decay == max(sorted(grid, reverse=True), key=lambda w: p.holdout[w])
    theta, _ = central_head(create_head("softmax"), z, y, 4, p.weight_decay)
    assert p.accuracy == evaluate(theta, zt, yt)
    shuffled = tuned_probe(z, y, zt, yt[torch.randperm(100, generator=torch.Generator().manual_seed(0))], 4, 0, grid)
    assert shuffled.weight_decay == p.weight_decay and shuffled.holdout == p.holdout  # the test split never counts


def test_tuned_probe_grows_its_grid_past_an_edge_it_chooses():
    from fedhead.core.central import tuned_probe

    x, y = _data(n=300, d=6, c=4)
    xt, yt = _data(n=100, d=6, c=4, seed=1)
    z, zt = _z(x), _z(xt)
    fixed = tuned_probe(z, y, zt, yt, 4, 0, grid=(1e-3, 1e-1, 10.0), bounds=(1e-3, 10.0))
    assert set(fixed.holdout) == {1e-3, 1e-1, 10.0}  # bounds at the grid's edges: nothing grows
    lo, hi = 1e-6, 100.0
    for grid in [(1e-3,), (10.0,), (1e-2, 1e-1)]:
        p = tuned_probe(z, y, zt, yt, 4, 0, grid=grid, bounds=(lo, hi))
        tried = sorted(p.holdout)
        assert set(grid) <= set(tried) and lo <= tried[0] and tried[-1] <= hi
        assert p.weight_decay == max(sorted(tried, reverse=True), key=lambda w: p.holdout[w])
        # the choice has a tried neighbour on each side, unless a bound stops the grid there
        assert p.weight_decay != tried[0] or np.isclose(tried[0], lo)
        assert p.weight_decay != tried[-1] or np.isclose(tried[-1], hi)
        grown = [w for w in tried if w < min(grid) or w > max(grid)]
        for w in grown:  # each grown weight is one decade past the previous edge
            assert any(np.isclose(w * 10, v) or np.isclose(w / 10, v) for v in tried if v != w)
    assert len(tuned_probe(z, y, zt, yt, 4, 0, grid=(1e-3,), bounds=(lo, hi)).holdout) >= 3  # grown both ways


def test_bench_baselines_ranks_the_new_heads_beside_the_tuned_probe(tiny_store, tmp_path):
    import csv

    from typer.testing import CliRunner

    import cli

    out = tmp_path / "bl"
    args = ["bench", "baselines", "--features", str(tiny_store), "--quick", "--rounds", "3", "--clients", "6",
            "--methods", "qda,ridge-rf", "--partition", "iid,shard-1", "--sketch-dims", "4", "--out", str(out)]  # fmt: skip
    r = CliRunner().invoke(cli.app, args)
    assert r.exit_code == 0, r.output
    rep = (out / "report.md").read_text()
    assert "tuned central" in rep and "Stronger yardstick" in rep
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert (out / "baselines-sketch.png").read_bytes()[:4] == b"\x89PNG"
    sketch = [c for c in (ln.split("|") for ln in rep.splitlines() if ln.startswith("| iid | qda |")) if len(c) == 7]
    mb = {cells[3].strip(): float(cells[4]) for cells in sketch}
    assert set(mb) == {"4", "full"} and mb["4"] < mb["full"]  # the sketch's bytes against the full statistics
    rows = [x for x in rows if x["bench_method"] in ("qda", "ridge-rf")]  # the sketched runs are rows too
    assert {x["bench_method"] for x in rows} == {"qda", "ridge-rf"}
    for x in rows:  # every new head's federated solve equals its own central one (any partition)
        own, fed = float(x["res_central_own_accuracy"]), float(x["res_final_accuracy"])
        assert own == pytest.approx(fed, abs=1e-6), x["bench_method"]
    import json

    tuned = json.loads((out / "tuned-central.json").read_text())["seeds"]
    probe = np.mean([t["accuracy"] for t in tuned.values()])
    for part in ("iid", "shard-1"):
        accs = {x["bench_method"]: float(x["res_final_accuracy"]) for x in rows if x["bench_partition"] == part}
        best = max(accs, key=accs.get)
        line = next(ln for ln in rep.splitlines() if ln.startswith(f"| {part} |") and best in ln)
        assert f"{100 * (probe - accs[best]):+.2f}" in line


@pytest.mark.parametrize("partition,pp", PARTS[:3])
@pytest.mark.parametrize("name", ["ridge", "lda", "qda", "ncm"])
def test_sketched_statistics_solve_the_projected_problem_and_map_back_exactly(name, partition, pp):
    """--stats-sketch r: the federated solve on projected statistics equals the head solved on the pooled projected
    features (x P), mapped back to raw features; the bytes are the message of dimension r."""
    x, y = _data(n=400, d=12, c=4)
    r = 5
    parts = create_partition(partition, y.numpy(), 8, seed=3, **pp)
    head = create_head(name, stats_sketch=r, stats_sketch_seed=4)
    acc = accumulate(x, y, parts, 4, cof=False, per_client=True, **head.message_kwargs(12))
    theta = head.solve_statistics(acc)
    g = torch.Generator().manual_seed(4)
    p = torch.randn(12, r, generator=g, dtype=torch.float64) / np.sqrt(r)
    xp = (x.double() @ p).float()
    plain = create_head(name)
    ref = plain.solve_central(xp, y, 4)  # the head of the projected features
    z = _z(x).double()
    got = head.logits(theta, z) if theta.ndim == 3 else z @ theta.T
    want = plain.logits(ref, _z(xp).double()) if ref.ndim == 3 else _z(xp).double() @ ref.T
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert theta.shape[-1] == 13  # a head on the raw features
    held = [len(np.unique(y.numpy()[q])) for q in parts]
    assert acc.bytes_up == sum(message_bytes(h, r, head.needs_gram, head.needs_second) for h in held)


def test_tuned_probe_is_kept_per_seed_and_reused_for_the_same_store(tiny_store, tmp_path):
    import json

    from extract.store import load_store
    from fedhead.bench.yardstick import tuned_central

    s = load_store(tiny_store)
    first = tuned_central(s, [0], tmp_path)
    saved = json.loads((tmp_path / "tuned-central.json").read_text())
    assert saved["seeds"]["0"]["accuracy"] == first[0]["accuracy"]
    saved["seeds"]["0"]["accuracy"] = 0.123  # a kept probe is read back, not fitted again
    (tmp_path / "tuned-central.json").write_text(json.dumps(saved))
    assert tuned_central(s, [0], tmp_path)[0]["accuracy"] == 0.123
    saved["key"]["grid"] = [1.0]  # another grid: fitted again
    (tmp_path / "tuned-central.json").write_text(json.dumps(saved))
    assert tuned_central(s, [0], tmp_path)[0]["accuracy"] == first[0]["accuracy"]
