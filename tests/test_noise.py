"""Label noise (SPEC section 6): exact flip counts, maps, realised rate, errors, determinism."""

import numpy as np
import pytest

from fedhead.core.noise import NOISE_KINDS, apply_noise, asymmetric_map
from fedhead.infra.errors import FedheadError


def clients(c=10, sizes=(1000, 757, 333, 1, 0), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, c, n).astype(np.int64) for n in sizes]


def test_kinds():
    assert NOISE_KINDS == ("none", "symmetric", "asymmetric")


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.3, 0.75, 0.99])
def test_symmetric_exact_count_never_same(rate):
    ys = clients()
    noisy, realised = apply_noise("symmetric", rate, ys, 10, dataset="whatever", seed=3)
    changed = 0
    for y, z in zip(ys, noisy):
        diff = int((y != z).sum())
        assert diff == int(np.floor(rate * len(y)))  # every picked sample changes (never to itself)
        assert z.min(initial=0) >= 0 and z.max(initial=0) < 10
        changed += diff
    assert realised == pytest.approx(changed / sum(len(y) for y in ys))


def test_symmetric_near_uniform_over_other_classes():
    c = 10
    y = np.zeros(50000, dtype=np.int64)
    (z,), _ = apply_noise("symmetric", 0.9, [y], c, dataset="x", seed=0)
    flipped = z[z != y]
    counts = np.bincount(flipped, minlength=c)
    assert counts[0] == 0
    expected = len(flipped) / (c - 1)
    assert np.abs(counts[1:] - expected).max() < 0.05 * expected


def test_inputs_untouched_and_none_copies():
    ys = clients()
    before = [y.copy() for y in ys]
    noisy, _ = apply_noise("symmetric", 0.5, ys, 10, dataset="x", seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(ys, before))
    same, r = apply_noise("none", 0.0, ys, 10, dataset="x", seed=0)
    assert r == 0.0 and all(np.array_equal(a, b) and a is not b for a, b in zip(same, ys))


def test_cifar10_map():
    m = asymmetric_map("cifar10", 10)
    expect = np.arange(10)
    expect[[9, 2, 4, 3, 5]] = [1, 0, 7, 5, 3]
    assert m.tolist() == expect.tolist()
    assert asymmetric_map("CIFAR-10", 10).tolist() == m.tolist()


def test_cifar100_map():
    m = asymmetric_map("cifar100", 100)
    for k in range(20):
        assert m[5 * k : 5 * k + 5].tolist() == [5 * k + 1, 5 * k + 2, 5 * k + 3, 5 * k + 4, 5 * k]


@pytest.mark.parametrize("name", ["mnist", "MNIST", "fashion-mnist", "fmnist", "FashionMNIST"])
def test_mnist_map(name):
    assert asymmetric_map(name, 10).tolist() == [0, 1, 7, 8, 4, 6, 5, 7, 8, 9]


def test_cyclic_map_any_dataset():
    assert asymmetric_map("speech_commands", 4, rule="cyclic").tolist() == [1, 2, 3, 0]


def test_unknown_dataset_auto_errors():
    with pytest.raises(FedheadError, match="--noise") as exc:
        asymmetric_map("svhn", 10)
    msg = str(exc.value)
    assert "cifar10" in msg and "--asym-map cyclic" in msg and "(y+1) mod C" in msg
    with pytest.raises(FedheadError, match="--noise"):
        apply_noise("asymmetric", 0.2, clients(), 10, dataset="svhn", seed=0)


def test_map_class_count_mismatch():
    with pytest.raises(FedheadError, match="10 classes"):
        asymmetric_map("cifar10", 100)
    with pytest.raises(FedheadError, match="--asym-map"):
        asymmetric_map("cifar10", 10, rule="bogus")


@pytest.mark.parametrize("rate", [0.2, 0.4])
def test_asymmetric_follows_map_and_realised_rate(rate):
    ys = clients(sizes=(5000, 5000, 4000))
    m = asymmetric_map("cifar10", 10)
    noisy, realised = apply_noise("asymmetric", rate, ys, 10, dataset="cifar10", seed=1)
    for y, z in zip(ys, noisy):
        ch = y != z
        assert np.array_equal(z[ch], m[y[ch]])  # every change is the mapped class
        # floor(r n) samples went through the map; the ones in mapped classes changed
        assert ch.sum() <= int(np.floor(rate * len(y)))
        assert not np.any(ch & (m[y] == y))
    assert realised == pytest.approx(rate / 2, abs=0.02)  # 5 of 10 classes are moved


def test_asymmetric_cifar100_every_pick_changes():
    ys = clients(c=100, sizes=(900, 400))
    noisy, realised = apply_noise("asymmetric", 0.3, ys, 100, dataset="cifar100", seed=0)
    assert realised == pytest.approx((270 + 120) / 1300)


def test_determinism_and_per_client_independence():
    ys = clients()
    a, ra = apply_noise("symmetric", 0.4, ys, 10, dataset="x", seed=5)
    b, rb = apply_noise("symmetric", 0.4, ys, 10, dataset="x", seed=5)
    assert ra == rb and all(np.array_equal(x, y) for x, y in zip(a, b))
    c, _ = apply_noise("symmetric", 0.4, ys, 10, dataset="x", seed=6)
    assert not np.array_equal(a[0], c[0])
    # client 0's noise does not depend on the other clients
    d, _ = apply_noise("symmetric", 0.4, ys[:1], 10, dataset="x", seed=5)
    assert np.array_equal(a[0], d[0])


@pytest.mark.parametrize("rate", [1.0, -0.1, 1.5, float("nan")])
def test_bad_rate(rate):
    with pytest.raises(FedheadError, match="--noise-rate"):
        apply_noise("symmetric", rate, clients(), 10, dataset="x", seed=0)


def test_unknown_kind():
    with pytest.raises(FedheadError, match="--noise.*symmetric"):
        apply_noise("symetric", 0.2, clients(), 10, dataset="x", seed=0)


def test_label_out_of_range():
    with pytest.raises(FedheadError, match="--num-classes"):
        apply_noise("symmetric", 0.2, [np.array([0, 12])], 10, dataset="x", seed=0)
