"""CCVR: exact pooling of client class statistics, wire size, virtual sampling and head calibration."""

import numpy as np
import pytest
import torch

from fedhead.core.ccvr import (
    CCVRConfig,
    ClassStats,
    PooledStats,
    client_class_stats,
    pool_stats,
    retrain_head,
    sample_virtual,
)
from fedhead.core.heads import create_head
from fedhead.infra.errors import FedheadError


def _non_iid_clients(seed=0, n=500, D=6, C=4, K=7):
    """Random features with class-dependent means, split over K clients non-IID (per-client Dirichlet class
    mix), with forced corner cases: a client holding a single sample of a class, classes absent on clients."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, C, n)
    centres = rng.normal(0, 3, (C, D)) + 5.0  # offset: means large against the spread
    x = centres[y] + rng.normal(0, 1, (n, D)) @ rng.normal(0, 1, (D, D))
    props = rng.dirichlet(np.full(K, 0.3), size=C)  # [C, K] class -> client mix
    owner = np.array([rng.choice(K, p=props[c]) for c in y])
    # client 0 holds exactly one sample of class 0 and nothing else of class 0; client 1 holds no class 1
    idx0 = np.flatnonzero(y == 0)
    owner[idx0] = np.where(owner[idx0] == 0, 2, owner[idx0])
    owner[idx0[0]] = 0
    owner[(y == 1) & (owner == 1)] = 3
    parts = [np.flatnonzero(owner == k) for k in range(K)]
    return x, y, parts


def test_pooling_matches_numpy_on_pooled_data_in_any_order():
    x, y, parts = _non_iid_clients()
    C, D = 4, x.shape[1]
    stats = [client_class_stats(x[p], y[p], C) for p in parts]
    assert any(int(n) == 1 for s in stats for n in s.counts)  # a single-sample class
    assert any(len(s.classes) < C for s in stats)  # absent classes
    counts, means, covs = pool_stats(stats, C, D)
    for c in range(C):
        xc = x[y == c]
        assert counts[c] == len(xc)
        np.testing.assert_allclose(means[c], xc.mean(0), rtol=1e-9, atol=0)
        np.testing.assert_allclose(covs[c], np.cov(xc, rowvar=False, ddof=1), rtol=1e-9, atol=1e-12)
    order = np.random.default_rng(1).permutation(len(stats))
    counts2, means2, covs2 = pool_stats([stats[i] for i in order], C, D)
    np.testing.assert_array_equal(counts2, counts)
    np.testing.assert_allclose(means2, means, rtol=1e-9, atol=0)
    np.testing.assert_allclose(covs2, covs, rtol=1e-9, atol=1e-12)


def test_pooling_formula_of_the_spec_on_a_two_client_case():
    # the SPEC's closed form, written out, against the streaming merge
    x, y, parts = _non_iid_clients(seed=3, n=60, D=3, C=2, K=2)
    stats = [client_class_stats(x[p], y[p], 2) for p in parts]
    counts, means, covs = pool_stats(stats, 2, 3)
    for c in range(2):
        terms = [
            (int(s.counts[j]), s.means[j], s.covs[j]) for s in stats for j in range(len(s.classes)) if s.classes[j] == c
        ]
        N = sum(n for n, _, _ in terms)
        mu = sum(n * m for n, m, _ in terms) / N
        sig = sum((n - 1) * S + n * np.outer(m, m) for n, m, S in terms) / (N - 1) - N / (N - 1) * np.outer(mu, mu)
        np.testing.assert_allclose(means[c], mu, rtol=1e-12)
        np.testing.assert_allclose(covs[c], sig, rtol=1e-9, atol=1e-12)


def test_client_stats_accept_torch_and_single_samples_have_zero_covariance():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 8.0]])
    s = client_class_stats(x, np.array([2, 0, 0]), 3)
    np.testing.assert_array_equal(s.classes, [0, 2])
    np.testing.assert_array_equal(s.counts, [2, 1])
    np.testing.assert_allclose(s.means, [[4.0, 6.0], [1.0, 2.0]])
    np.testing.assert_allclose(s.covs[0], [[2.0, 4.0], [4.0, 8.0]])  # ddof = 1
    np.testing.assert_array_equal(s.covs[1], 0.0)
    assert s.means.dtype == np.float64 and s.counts.dtype == np.int64


def test_nbytes_counts_the_upper_triangle_and_matches_the_wire_format():
    D = 3
    s = client_class_stats(np.arange(15.0).reshape(5, D) ** 1.5, np.array([0, 0, 4, 4, 4]), 5)
    # per class: id 4 + count 8 + mean 3 * 8 + upper triangle 6 * 8 = 84 bytes; two classes
    assert s.nbytes() == 2 * (4 + 8 + 24 + 48) == 168
    wire = s.to_bytes()
    assert len(wire) == s.nbytes()
    back = ClassStats.from_bytes(wire, D)
    np.testing.assert_array_equal(back.classes, s.classes)
    np.testing.assert_array_equal(back.counts, s.counts)
    np.testing.assert_array_equal(back.means, s.means)
    np.testing.assert_array_equal(back.covs, s.covs)
    with pytest.raises(FedheadError, match="feature dimension 4"):
        ClassStats.from_bytes(wire, 4)


def test_empty_and_singleton_classes_give_no_nan_and_the_right_samples():
    D, C = 3, 4
    p = PooledStats(C, D)
    p.add(client_class_stats(np.zeros((0, D)), np.zeros(0, dtype=np.int64), C))  # a client with no data
    p.add(client_class_stats(np.array([[1.0, 2.0, 3.0]]), np.array([1]), C))  # class 1: N = 1
    p.add(client_class_stats(np.array([[0.0, 0, 0], [2, 2, 2]]), np.array([3, 3]), C))
    counts, means, covs = p.finish()
    assert not np.isnan(means).any() and not np.isnan(covs).any()
    np.testing.assert_array_equal(counts, [0, 1, 0, 2])
    np.testing.assert_array_equal(means[[0, 2]], 0.0)
    np.testing.assert_array_equal(covs[[0, 1, 2]], 0.0)
    np.testing.assert_allclose(covs[3], np.full((D, D), 2.0))
    with pytest.raises(FedheadError, match="already pooled"):
        p.add(client_class_stats(np.ones((1, D)), np.array([0]), C))
    xv, yv = sample_virtual(counts, means, covs, 5, seed=0)
    assert xv.shape == (10, D) and xv.dtype == np.float32 and yv.dtype == np.int64
    np.testing.assert_array_equal(yv, [1] * 5 + [3] * 5)  # no samples for N_c = 0
    np.testing.assert_array_equal(xv[:5], np.tile([1.0, 2.0, 3.0], (5, 1)))  # N_c = 1: the mean
    assert np.isfinite(xv).all()
    # two clients, one sample each: a finite rank-1 covariance
    q = pool_stats(
        [
            client_class_stats(np.array([[0.0, 0, 0]]), np.array([2]), C),
            client_class_stats(np.array([[2.0, 0, 0]]), np.array([2]), C),
        ],
        C,
        D,
    )
    np.testing.assert_allclose(q[2][2], np.diag([2.0, 0, 0]))


def test_bad_client_stats_are_rejected():
    p = PooledStats(3, 2)
    s = client_class_stats(np.ones((2, 2)), np.array([0, 1]), 3)
    s.classes = np.array([0, 5])
    with pytest.raises(FedheadError, match=r"in \[0, 3\)"):
        p.add(s)
    with pytest.raises(FedheadError, match="labels must lie"):
        client_class_stats(np.ones((2, 2)), np.array([0, 3]), 3)


def test_sample_virtual_is_seeded_and_converges_to_the_given_moments():
    rng = np.random.default_rng(0)
    D, C = 4, 3
    means = rng.normal(0, 2, (C, D))
    A = rng.normal(0, 1, (C, D, D))
    covs = A @ A.transpose(0, 2, 1)
    covs[1] = np.outer(A[1, 0], A[1, 0])  # singular (rank 1): still sampled exactly
    counts = np.array([10, 5, 7])
    x1, y1 = sample_virtual(counts, means, covs, 20000, seed=7)
    x2, y2 = sample_virtual(counts, means, covs, 20000, seed=7)
    x3, _ = sample_virtual(counts, means, covs, 20000, seed=8)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(x1, x3)
    for c in range(C):
        xc = x1[y1 == c].astype(np.float64)
        scale = np.sqrt(np.diag(covs[c]).max())
        np.testing.assert_allclose(xc.mean(0), means[c], atol=0.05 * scale)
        np.testing.assert_allclose(np.cov(xc, rowvar=False), covs[c], atol=0.05 * scale**2)


def _toy_problem(seed=0, C=3, D=2):
    rng = np.random.default_rng(seed)
    centres = np.array([[3.0, 0.0], [-1.5, 2.6], [-1.5, -2.6]])[:C, :D]

    def draw(n):
        y = rng.integers(0, C, n)
        return centres[y] + rng.normal(0, 1.0, (n, D)), y

    return draw


def _with_ones(x):
    x = torch.as_tensor(x, dtype=torch.float32)
    return torch.cat([x, torch.ones(len(x), 1)], 1)


def _accuracy(theta, x, y):
    return float(((_with_ones(x) @ theta.T).argmax(1) == torch.as_tensor(y)).float().mean())


@pytest.mark.parametrize("head_name", ["softmax", "ova"])
def test_retrain_head_recovers_accuracy_of_a_biased_head(head_name):
    draw = _toy_problem()
    C, D = 3, 2
    x_tr, y_tr = draw(600)
    x_te, y_te = draw(600)
    # clients with skewed labels send statistics; the server samples virtual features from the pooled ones
    parts = np.array_split(np.argsort(y_tr, kind="stable"), 5)
    counts, means, covs = pool_stats([client_class_stats(x_tr[p], y_tr[p], C) for p in parts], C, D)
    xv, yv = sample_virtual(counts, means, covs, 200, seed=0)
    # a head whose rows are the class centres, but with a bias column pushing class 0 everywhere
    theta = torch.zeros(C, D + 1)
    theta[:, :D] = torch.as_tensor(means, dtype=torch.float32)
    theta[0, D] = 25.0
    before = _accuracy(theta, x_te, y_te)
    kw = CCVRConfig()  # a bias of 25 needs larger moves than the default (momentum-free) pass: momentum 0.9
    new = retrain_head(
        theta,
        create_head(head_name),
        _with_ones(xv),
        torch.as_tensor(yv),
        epochs=20,
        lr=kw.lr,
        batch_size=kw.batch_size,
        seed=0,
        momentum=0.9,
    )
    after = _accuracy(new, x_te, y_te)
    assert before < 0.5 and after > 0.85, (before, after)  # the true-centre rule scores ~0.99 here
    assert theta[0, D] == 25.0  # input head untouched
    again = retrain_head(
        theta,
        create_head(head_name),
        _with_ones(xv),
        torch.as_tensor(yv),
        epochs=20,
        lr=kw.lr,
        batch_size=kw.batch_size,
        seed=0,
        momentum=0.9,
    )
    assert torch.equal(new, again)  # seeded


def test_retrain_head_runs_every_stage_of_two_stage_heads_in_their_last_stage():
    # ova2 with positive_keep < 1 in the last stage: positive terms are kept at random, not all dropped
    draw = _toy_problem(seed=1)
    x_tr, y_tr = draw(300)
    counts, means, covs = pool_stats([client_class_stats(x_tr, y_tr, 3)], 3, 2)
    xv, yv = sample_virtual(counts, means, covs, 100, seed=1)
    theta = torch.zeros(3, 3)
    new = retrain_head(
        theta, create_head("ova2", positive_keep=0.5), _with_ones(xv), torch.as_tensor(yv), epochs=3, seed=0
    )
    x_te, y_te = draw(300)
    assert torch.isfinite(new).all()
    assert _accuracy(new, x_te, y_te) > 0.9


def test_retrain_head_rejects_features_without_the_ones_column():
    with pytest.raises(FedheadError, match="trailing 1"):
        retrain_head(torch.zeros(3, 3), create_head("softmax"), torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
