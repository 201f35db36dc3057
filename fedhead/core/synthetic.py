"""Synthetic feature stores: many classes without downloads, and paper-scale stores for timing.

Features imitate a frozen encoder's pooled output: class prototypes in a latent space, Gaussian
within-class spread, a random linear map to ``dim`` and a ReLU, so features are non-negative and
correlated like real CNN/ViT embeddings. ``spread`` sets how hard the task is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from extract.store import write_store
from fedhead.infra.errors import Interval, validate

LATENT = 64  # latent dimension of the class prototypes (``fedhead synth`` does not expose it)


def make_features(
    num_classes: int,
    train_per_class: int,
    test_per_class: int,
    dim: int,
    *,
    latent: int = 64,
    spread: float = 1.0,
    seed: int = 0,
):
    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(num_classes, latent))
    A = rng.normal(size=(latent, dim)) / np.sqrt(latent)
    bias = rng.normal(scale=0.5, size=dim)

    def draw(per_class):
        y = np.repeat(np.arange(num_classes), per_class)
        z = protos[y] + spread * rng.normal(size=(len(y), latent))
        x = np.maximum(z @ A + bias, 0.0).astype(np.float32)
        perm = rng.permutation(len(y))
        return x[perm], y[perm].astype(np.int64)

    return draw(train_per_class), draw(test_per_class)


def validate_synthetic(
    *, num_classes: int, train_per_class: int, test_per_class: int, dim: int, spread: float, seed: int
) -> None:
    """The options of a synthetic store (``fedhead synth``, ``fedhead bench flower``), checked before writing."""
    validate("--num-classes", num_classes, Interval(2, None, integer=True))
    validate("--train-per-class", train_per_class, Interval(1, None, integer=True))
    validate("--test-per-class", test_per_class, Interval(1, None, integer=True))
    validate("--dim", dim, Interval(1, None, integer=True))
    validate("--spread", spread, Interval(0, None, closed="neither"))
    validate("--seed", seed, Interval(0, None, integer=True))


def synthetic_request(
    *, num_classes: int, train_per_class: int, test_per_class: int, dim: int, latent: int, spread: float, seed: int
) -> dict:
    """What determines a synthetic store's content (its ``request`` attribute)."""
    return {
        "synthetic": True,
        "num_classes": num_classes,
        "train_per_class": train_per_class,
        "test_per_class": test_per_class,
        "dim": dim,
        "latent": latent,
        "spread": spread,
        "seed": seed,
    }


def write_synthetic(
    out: str | Path,
    *,
    num_classes: int = 200,
    train_per_class: int = 50,
    test_per_class: int = 20,
    dim: int = 256,
    latent: int = LATENT,
    spread: float = 2.2,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    (trx, try_), (tex, tey) = make_features(
        num_classes, train_per_class, test_per_class, dim, latent=latent, spread=spread, seed=seed
    )
    attrs = {
        "dataset": f"synthetic-{num_classes}",
        "encoder": "synthetic",
        "weights_source": "none",
        "weights_sha256": "",
        "preprocessing": {"kind": "synthetic", "latent": latent, "spread": spread, "seed": seed},
        "image_size": 0,
    }
    request = synthetic_request(
        num_classes=num_classes,
        train_per_class=train_per_class,
        test_per_class=test_per_class,
        dim=dim,
        latent=latent,
        spread=spread,
        seed=seed,
    )
    return write_store(
        out,
        train=(trx, try_),
        test=(tex, tey),
        class_names=[f"class{c:03d}" for c in range(num_classes)],
        attrs=attrs,
        dtype=dtype,
        request=request,
    )


def probe_accuracy(train_x, train_y, test_x, test_y, max_iter: int = 300) -> float:
    """Centralised (IID) logistic-regression probe on standardised features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    sc = StandardScaler().fit(train_x)
    clf = LogisticRegression(max_iter=max_iter, C=1.0)
    clf.fit(sc.transform(train_x), train_y)
    return float(clf.score(sc.transform(test_x), test_y))
