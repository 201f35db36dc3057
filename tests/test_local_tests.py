"""Sampled local test sets (FedABC's protocol): each client's test samples drawn from the global test split in its
training class proportions, and the per-client accuracy on them (fedhead.core.clientacc)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from fedhead.core.clientacc import (
    LOCAL_FIELDS,
    _keyed,
    class_correct,
    client_accuracy,
    client_summary,
    client_weights,
    local_accuracy,
    local_summary,
    local_test_sets,
    sample_correct,
)


def _problem(seed: int = 0, K: int = 40, C: int = 8, N: int = 300):
    """Skewed training counts [K, C] (a client without samples, one whose only class the test split lacks) and test
    labels [N] without class 5."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6, (K, C)) * (rng.random((K, C)) < 0.5)
    counts[3] = 0
    counts[7] = 0
    counts[7, 5] = 4
    test_y = rng.integers(0, C, N)
    test_y[test_y == 5] = 4
    return counts, test_y


def _sets(tests, K):
    return [tests.of(k).tolist() for k in range(K)]


def test_same_seed_gives_the_same_sets_another_seed_others():
    counts, test_y = _problem()
    a, b = local_test_sets(counts, test_y, seed=1), local_test_sets(counts, test_y, seed=1)
    c = local_test_sets(counts, test_y, seed=2)
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.index, b.index) and np.array_equal(a.valid, b.valid)
    assert np.array_equal(a.indptr, c.indptr)  # the sizes follow the counts alone
    assert not np.array_equal(a.index, c.index)
    differ = sum(a.of(k).tolist() != c.of(k).tolist() for k in range(len(counts)))
    assert differ > len(counts) // 2
    twins = local_test_sets(np.array([[4, 3, 0, 2]] * 6), test_y, seed=1, size=10)  # same counts, own draws
    assert len({tuple(twins.of(k)) for k in range(6)}) == 6


def test_a_clients_set_follows_its_own_counts_alone():
    counts, test_y = _problem()
    k = 11
    full = local_test_sets(counts, test_y, seed=4, size=25)
    alone = np.zeros_like(counts)
    alone[k] = counts[k]
    assert full.of(k).tolist() == local_test_sets(alone, test_y, seed=4, size=25).of(k).tolist()
    assert full.of(k).tolist() == local_test_sets(counts[: k + 1], test_y, seed=4, size=25).of(k).tolist()
    # proportional sizes depend on the others only through n_train: shuffling the other clients' rows keeps it
    prop = local_test_sets(counts, test_y, seed=4)
    others = np.array([i for i in range(len(counts)) if i != k])
    shuffled = counts.copy()
    shuffled[others] = counts[np.random.default_rng(0).permutation(others)]
    assert not np.array_equal(shuffled, counts)
    assert prop.of(k).tolist() == local_test_sets(shuffled, test_y, seed=4).of(k).tolist()


def test_a_set_holds_distinct_test_samples_of_the_clients_classes():
    counts, test_y = _problem()
    tests = local_test_sets(counts, test_y, seed=0, size=40)
    assert tests.indptr.dtype == np.int64 and tests.index.dtype == np.int64
    for k in range(len(counts)):
        idx = tests.of(k)
        assert np.unique(idx).size == idx.size, k
        assert np.all(counts[k, test_y[idx]] > 0), k
    held = counts[:, np.unique(test_y)].sum(1) > 0  # training samples of a class the test split has
    assert tests.valid.tolist() == held.tolist()
    assert not tests.valid[3] and not tests.valid[7]  # no samples; only a class the test split lacks
    assert np.array_equal(tests.valid, tests.sizes > 0)


def test_class_shares_are_the_largest_remainders_of_the_training_proportions():
    counts, test_y = _problem(N=3000)
    totals = np.bincount(test_y, minlength=counts.shape[1])
    present = totals > 0
    n_train, N = counts.sum(), test_y.size
    for size in ("proportional", 17):
        tests = local_test_sets(counts, test_y, seed=3, size=size)
        for k in range(len(counts)):
            got = np.bincount(test_y[tests.of(k)], minlength=counts.shape[1])
            held = counts[k] * present
            if not held.sum():
                assert got.sum() == 0
                continue
            want = max(1, math.floor(counts[k].sum() * N / n_train + 0.5)) if size == "proportional" else size
            assert got.sum() == want, k  # nothing capped: 3000 test samples
            ideal = want * held / held.sum()
            assert np.all((got == np.floor(ideal)) | (got == np.ceil(ideal))), (k, got, ideal)
            assert np.all(got[~present] == 0)


def test_largest_remainder_by_hand():
    test_y = np.repeat(np.arange(4), 50)
    counts = np.array([[3, 2, 2, 0], [1, 1, 1, 0], [0, 0, 0, 9]])
    tests = local_test_sets(counts, test_y, seed=0, size=5)
    # 5 * (3, 2, 2) / 7 = (2.14, 1.43, 1.43): floors (2, 1, 1), the one left to the lower of the tied remainders
    assert np.bincount(test_y[tests.of(0)], minlength=4).tolist() == [2, 2, 1, 0]
    assert np.bincount(test_y[tests.of(1)], minlength=4).tolist() == [2, 2, 1, 0]
    assert np.bincount(test_y[tests.of(2)], minlength=4).tolist() == [0, 0, 0, 5]
    # proportional: round(n_k * N / n_train) = round(7 * 200 / 19) = 74, 32, 95; the last capped at class 3's 50
    prop = local_test_sets(counts, test_y, seed=0)
    assert prop.sizes.tolist() == [74, 32, 50]


def test_a_class_with_too_few_test_samples_gives_all_of_them():
    test_y = np.concatenate([np.zeros(6, int), np.ones(500, int)])
    counts = np.array([[1, 1], [5, 0], [0, 3]])
    tests = local_test_sets(counts, test_y, seed=0, size=100)
    first = tests.of(0)
    assert sorted(first[test_y[first] == 0]) == list(range(6))  # wants 50 of class 0, which has 6
    assert (test_y[first] == 1).sum() == 50 and tests.sizes[0] == 56
    assert tests.of(1).tolist() == list(range(6))  # fewer samples, none twice
    assert tests.sizes[2] == 100
    for k in range(3):
        assert np.unique(tests.of(k)).size == tests.sizes[k]


def test_sparse_and_dense_counts_give_the_same_sets():
    counts, test_y = _problem(K=60)
    dense = local_test_sets(counts, test_y, seed=9)
    for form in (sp.csr_matrix(counts), sp.coo_matrix(counts), sp.csc_matrix(counts.astype(np.float64))):
        got = local_test_sets(form, test_y, seed=9)
        assert np.array_equal(got.indptr, dense.indptr) and np.array_equal(got.index, dense.index)
        assert np.array_equal(got.valid, dense.valid)


def test_the_draws_are_uniform_over_a_class():
    # each test sample of the class is as likely, whichever way the draw is made
    test_y = np.zeros(40, int)
    for size in (3, 9, 30):  # positions with duplicates redrawn (3, 9), uniform keys over the class (30)
        hits = np.zeros(40)
        for seed in range(400):
            hits += np.bincount(local_test_sets(np.array([[1]]), test_y, seed, size=size).index, minlength=40)
        expect = 400 * size / 40
        assert np.all(np.abs(hits - expect) < 5 * math.sqrt(expect)), (size, hits)


def test_keyed_generators_are_philox_keyed_by_seed_and_client():
    gen = _keyed(7)
    a = gen(5, 0).random(10)
    b = gen(3, 2).random(4)
    assert np.array_equal(a, np.random.Generator(np.random.Philox(key=[7, 5])).random(10))
    assert np.array_equal(b, np.random.Generator(np.random.Philox(key=[7, 3], counter=[0, 0, 0, 2])).random(4))
    assert np.array_equal(gen(5, 0).random(10), a)


def test_sizes_other_than_proportional_or_positive_are_refused():
    counts, test_y = _problem()
    for bad in ("equal", 0, -3, 2.5):
        with pytest.raises(ValueError, match="size"):
            local_test_sets(counts, test_y, seed=0, size=bad)


def test_local_accuracy_is_each_clients_mean_correctness_over_its_set():
    counts, test_y = _problem()
    counts[0] = 0
    counts[0, 1] = 1  # one test sample
    tests = local_test_sets(counts, test_y, seed=2)
    assert tests.sizes[0] == 1 and len(set(tests.sizes[tests.valid].tolist())) > 3
    correct = np.random.default_rng(1).random(test_y.size) < 0.6
    correct[tests.of(0)] = True
    want = [correct[tests.of(k)].mean() for k in range(len(counts)) if tests.of(k).size]
    got = local_accuracy(tests, correct)
    assert got.dtype == np.float64 and got.size == tests.valid.sum() == len(counts) - 2
    assert got == pytest.approx(want, abs=1e-15)


def test_local_summary_by_hand():
    acc = np.array([0.5, 0.1, 0.9, 0.3, 0.7, 0.2, 0.4, 0.6, 0.8, 1.0, 0.0])  # 11 clients: 2 in each tail
    got = local_summary(acc)
    assert tuple(got) == LOCAL_FIELDS
    assert got["local_accuracy_mean"] == pytest.approx(0.5)
    assert got["local_accuracy_worst10"] == pytest.approx(0.05)
    assert got["local_accuracy_best10"] == pytest.approx(0.95)
    assert got["local_accuracy_std"] == pytest.approx(math.sqrt(0.1))
    assert list(got.values()) == list(client_summary(acc).values())
    assert all(math.isnan(v) for v in local_summary(np.array([])).values())


def test_the_sampled_accuracy_approaches_the_reweighted_one_over_seeds():
    C = 4
    rng = np.random.default_rng(0)
    test_y = rng.permutation(np.repeat(np.arange(C), 400))
    acc_c = np.array([0.9, 0.5, 0.2, 0.7])
    correct = np.zeros(test_y.size, dtype=bool)
    for c in range(C):  # the correct ones are the first of their class: a draw that is not uniform shows
        members = np.flatnonzero(test_y == c)
        correct[members[: int(acc_c[c] * members.size)]] = True
    counts = np.array([[3, 1, 0, 0], [1, 1, 1, 1], [0, 0, 5, 2], [1, 0, 0, 6]])
    totals = np.bincount(test_y, minlength=C)
    want = client_accuracy(client_weights(counts, totals), np.bincount(test_y[correct], minlength=C), totals)
    runs = np.array([local_accuracy(local_test_sets(counts, test_y, seed, size=200), correct) for seed in range(200)])
    assert runs.mean(0) == pytest.approx(want, abs=0.01)
    assert runs.std(0).min() > 0.005  # sampled: each seed's accuracy differs


def test_class_correct_is_unchanged_and_sample_correct_is_per_sample():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(1000, 6, generator=g), torch.ones(1000, 1)], 1)
    y = torch.randint(0, 5, (1000,), generator=g)
    y[y == 3] = 2  # a class without test samples
    theta = torch.randn(5, 7, generator=g)
    pred = (x @ theta.T).argmax(1)
    want_ok = (pred == y).numpy()
    ok = sample_correct(theta, x, y, chunk=128)
    assert ok.dtype == np.bool_ and np.array_equal(ok, want_ok)
    correct, total = class_correct(theta, x, y, 5, chunk=128)
    assert correct.dtype == np.int64 and total.dtype == np.int64
    assert correct.tolist() == [int(((y == c) & (pred == y)).sum()) for c in range(5)]
    assert total.tolist() == [int((y == c).sum()) for c in range(5)]
    assert np.array_equal(np.bincount(y.numpy()[ok], minlength=5), correct)
    assert class_correct(theta, x, y, 5, chunk=4096)[0].tolist() == correct.tolist()
    assert sample_correct(theta, x[:0], y[:0]).shape == (0,)
