"""Statistics heads: federated statistics == the centralised computation, exact bytes, solvers by hand."""

import numpy as np
import pytest
import torch

from fedhead.core.closedform import (
    accumulate,
    client_stats,
    closed_form_names,
    message_bytes,
    pack_upper,
    to_prepared,
    unpack_upper,
)
from fedhead.core.heads import create_head
from fedhead.core.partitions import create_partition


def _data(n=600, d=7, c=5, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, c, n)
    centers = rng.normal(0, 2, (c, d))
    x = (centers[y] + rng.normal(0, 1, (n, d))).astype(np.float32)
    return torch.as_tensor(x), torch.as_tensor(y)


def _pooled_reference(name, x, y, c, **params):
    """The centralised computation written directly from the definitions (numpy, float64)."""
    x, y = x.numpy().astype(np.float64), y.numpy()
    n, d = x.shape
    cnt = np.bincount(y, minlength=c).astype(np.float64)
    mu = np.stack([x[y == k].mean(0) for k in range(c)])
    if name == "ncm":
        w = mu / np.linalg.norm(mu, axis=1, keepdims=True)
        return np.concatenate([w, np.zeros((c, 1))], 1)
    if name == "ridge":
        phi = np.concatenate([x, np.ones((n, 1))], 1)
        Y = np.eye(c)[y]
        w = np.linalg.solve(phi.T @ phi + params.get("lam", 0.01) * np.eye(d + 1), phi.T @ Y).T
        return w
    if name == "lda":
        xc = x - mu[y]
        sigma = xc.T @ xc / (n - c)
        sigma += 1e-4 * np.trace(sigma) / d * np.eye(d)
        w = np.linalg.solve(sigma, mu.T).T
        b = -0.5 * np.sum(w * mu, 1) + np.log(cnt / n)
        return np.concatenate([w, b[:, None]], 1)
    raise KeyError(name)


def _cof_reference(x, y, parts, c, gamma):
    """FedCOF's estimator as its reference code states it: per class, the clients' means and counts."""
    x, y = x.numpy().astype(np.float64), y.numpy()
    d = x.shape[1]
    means = {k: [] for k in range(c)}
    ns = {k: [] for k in range(c)}
    for p in parts:
        for k in np.unique(y[p]):
            sel = p[y[p] == k]
            means[k].append(x[sel].mean(0))
            ns[k].append(len(sel))
    G = np.zeros((d, d))
    sums = np.zeros((c, d))
    total, gsum = 0, np.zeros(d)
    for k in range(c):
        m, nn = np.array(means[k]), np.array(ns[k], dtype=np.float64)
        N = nn.sum()
        mu = (m * nn[:, None]).sum(0) / N
        sums[k] = mu * N
        dev = (m - mu) * np.sqrt(nn)[:, None]
        delta = dev.T @ dev / (len(m) - 1 if len(m) > 1 else 1)
        G += (N - 1) * (delta + gamma * np.eye(d))
        total += N
        gsum += mu * N
    g = gsum / total
    G += total * np.outer(g, g)
    w = np.linalg.pinv(G) @ sums.T
    w = (w / np.linalg.norm(w, axis=0, keepdims=True)).T
    return np.concatenate([w, np.zeros((c, 1))], 1)


PARTS = [("iid", {}), ("shard", {"shards_per_client": 1}), ("dirichlet", {"alpha": 0.1, "min_size": 1}), ("kmeans", {})]


@pytest.mark.parametrize("partition,pp", PARTS)
@pytest.mark.parametrize("name", ["ncm", "ridge", "lda", "cof"])
def test_federated_equals_centralised_in_any_order(name, partition, pp):
    x, y = _data()
    C = 5
    parts = create_partition(
        partition, y.numpy(), 12, seed=3, features=x.numpy() if partition == "kmeans" else None, **pp
    )
    head = create_head(name)
    fed = accumulate(x, y, parts, C, gram=head.needs_gram, cof=head.needs_client_means, block_rows=100)
    theta = head.solve(fed)
    rng = np.random.default_rng(1)
    shuffled = [parts[i] for i in rng.permutation(len(parts))]
    per_client = accumulate(x, y, shuffled, C, gram=head.needs_gram, cof=head.needs_client_means, per_client=True)
    theta2 = head.solve(per_client)
    ref = _cof_reference(x, y, parts, C, 1.0) if name == "cof" else _pooled_reference(name, x, y, C)
    for t in (theta, theta2):
        np.testing.assert_allclose(t.numpy(), ref, rtol=1e-6, atol=1e-9 * np.abs(ref).max())
    if name != "cof":  # the pooled solve is the head's central reference
        np.testing.assert_allclose(head.solve_central(x, y, C).numpy(), ref, rtol=1e-6, atol=1e-9 * np.abs(ref).max())


def test_cof_central_uses_the_true_class_covariances():
    x, y = _data(n=300, d=4, c=3)
    head = create_head("cof", cof_gamma=0.5)
    # every sample its own client: the client-mean spread is the sample covariance
    parts = [np.array([i]) for i in range(len(y))]
    ref = _cof_reference(x, y, parts, 3, 0.5)
    np.testing.assert_allclose(head.solve_central(x, y, 3).numpy(), ref, rtol=1e-6, atol=1e-12)


def test_message_bytes_and_upper_triangle():
    x, y = _data(n=40, d=3, c=4)
    m = client_stats(x[:10], y[:10], 4, gram=True)
    held = len(np.unique(y[:10].numpy()))
    assert m.nbytes() == held * (4 + 8 + 8 * 3) + 8 * (4 * 5 // 2)
    assert message_bytes(2, 3, False) == 2 * (4 + 8 + 24)
    a = m.gram
    v = pack_upper(a)
    assert v.shape == (10,)
    np.testing.assert_array_equal(unpack_upper(v, 4), a)
    # the block path counts the same bytes as client-by-client messages
    parts = [np.arange(0, 10), np.arange(10, 25), np.arange(25, 40)]
    a1 = accumulate(x, y, parts, 4, gram=True, cof=False)
    a2 = accumulate(x, y, parts, 4, gram=True, cof=False, per_client=True)
    assert a1.bytes_up == a2.bytes_up and a1.clients == a2.clients == 3


def test_to_prepared_maps_scores_exactly():
    x, y = _data(n=50, d=6, c=3)
    theta = create_head("lda").solve_central(x, y, 3)
    mean, scale = x.numpy().mean(0), 1.7
    t2 = to_prepared(theta, mean, scale)
    raw = torch.cat([x.double(), torch.ones(50, 1, dtype=torch.float64)], 1) @ theta.T
    xp = (x.double() - torch.as_tensor(mean, dtype=torch.float64)) / scale
    prep = torch.cat([xp, torch.ones(50, 1, dtype=torch.float64)], 1) @ t2.T
    np.testing.assert_allclose(prep.numpy(), raw.numpy(), rtol=1e-9, atol=1e-9)


def test_absent_class_gets_zero_row_and_ill_conditioned_is_one_line():
    x, y = _data(n=60, d=3, c=3)
    y = torch.where(y == 2, torch.zeros_like(y), y)  # class 2 absent
    for name in closed_form_names():
        head = create_head(name)
        t = head.solve_central(x, y, 3)
        assert torch.isfinite(t).all()
        if t.ndim == 3:  # a quadratic head (qda): the absent class scores -1e30, never the argmax
            assert (head.logits(t, torch.cat([x, torch.ones(60, 1)], 1))[:, 2] <= -1e29).all()
            continue
        assert torch.count_nonzero(t[2]) == 0
    # fewer samples than dimensions and no shrinkage: a singular covariance is a one-line error
    from fedhead.infra.errors import FedheadError

    xs, ys = _data(n=6, d=10, c=2)
    with pytest.raises(FedheadError, match="--lda-shrinkage"):
        create_head("lda", lda_shrinkage=0.0).solve_central(xs, ys, 2)


@pytest.mark.parametrize("d", [7, 301])
def test_gram_from_upper_blocks_equals_the_full_product(d):
    """add_gram computes x^T x from the upper triangle of column blocks (wide features, d >= 256) or in one
    product: the same matrix to float64 rounding, added to what the accumulator holds."""
    from fedhead.core.closedform import add_gram

    x = torch.randn(53, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64) + 3.0
    out = torch.ones(d, d, dtype=torch.float64)
    add_gram(out, x)
    torch.testing.assert_close(out, 1.0 + x.T @ x, rtol=1e-13, atol=0)
