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


def natural_client_ids(labels: np.ndarray, num_clients: int, seed: int, alpha: float = 0.5) -> np.ndarray:
    """Synthetic natural clients (``fedhead synth --natural-clients K``): each training row's client drawn from its
    class's own Dirichlet(``alpha``) mix over the K clients (so the clients' label mixes differ), with one row of a
    seeded permutation given to each client first so that none is empty. Seeded by ``seed`` alone."""
    rng = np.random.default_rng([seed, 1])
    labels = np.asarray(labels)
    mix = rng.dirichlet(np.full(num_clients, alpha), size=int(labels.max()) + 1)  # [C, K]
    cum = np.cumsum(mix, axis=1)
    ids = (rng.random(len(labels))[:, None] > cum[labels]).sum(1).clip(0, num_clients - 1)
    ids[rng.permutation(len(labels))[:num_clients]] = np.arange(num_clients)
    return ids.astype(np.int64)


def validate_synthetic(
    *,
    num_classes: int,
    train_per_class: int,
    test_per_class: int,
    dim: int,
    spread: float,
    seed: int,
    natural_clients: int = 0,
) -> None:
    """The options of a synthetic store (``fedhead synth``, ``fedhead bench flower``), checked before writing."""
    validate(
        "--natural-clients",
        natural_clients,
        Interval(0, num_classes * train_per_class, integer=True),
        "Use 0 (no client ids) up to the training samples (--num-classes x --train-per-class).",
    )
    validate("--num-classes", num_classes, Interval(2, None, integer=True))
    validate("--train-per-class", train_per_class, Interval(1, None, integer=True))
    validate("--test-per-class", test_per_class, Interval(1, None, integer=True))
    validate("--dim", dim, Interval(1, None, integer=True))
    validate("--spread", spread, Interval(0, None, closed="neither"))
    validate("--seed", seed, Interval(0, None, integer=True))


def synthetic_request(
    *,
    num_classes: int,
    train_per_class: int,
    test_per_class: int,
    dim: int,
    latent: int,
    spread: float,
    seed: int,
    natural_clients: int = 0,
) -> dict:
    """What determines a synthetic store's content (its ``request`` attribute; ``natural_clients`` only when > 0, so
    the stores without client ids keep their request)."""
    return {
        **({"natural_clients": natural_clients} if natural_clients else {}),
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
    natural_clients: int = 0,
) -> Path:
    """Write a synthetic store (:func:`make_features`); ``natural_clients`` > 0 records that many natural clients
    (:func:`natural_client_ids`) for ``--partition natural``."""
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
        natural_clients=natural_clients,
    )
    return write_store(
        out,
        train=(trx, try_),
        test=(tex, tey),
        class_names=[f"class{c:03d}" for c in range(num_classes)],
        attrs=attrs,
        dtype=dtype,
        request=request,
        train_clients=natural_client_ids(try_, natural_clients, seed) if natural_clients else None,
    )


def probe_accuracy(train_x, train_y, test_x, test_y, max_iter: int = 300) -> float:
    """Centralised (IID) logistic-regression probe on standardised features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    sc = StandardScaler().fit(train_x)
    clf = LogisticRegression(max_iter=max_iter, C=1.0)
    clf.fit(sc.transform(train_x), train_y)
    return float(clf.score(sc.transform(test_x), test_y))
