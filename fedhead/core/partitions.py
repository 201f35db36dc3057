"""Client partitions of a labelled training set (SPEC section 2), kept in a registry.

Every partition is one function ``fn(labels, num_clients, rng, features=None, **params)`` that returns a
list of ``num_clients`` index arrays. It is registered by name with its declared parameters
(:class:`Param`: python name, default, constraint, help text, CLI flag), so the CLI can build its options
and validate values from the same declarations::

    parts = create_partition("dirichlet", labels, 100, seed=0, alpha=0.1)

:func:`create_partition` validates the inputs, builds ``numpy.random.default_rng(seed)`` (partitions own
their RNG; nothing global is seeded) and returns sorted int64 index arrays that are disjoint. Unless a
partition's docstring says otherwise, every training index is used exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fedhead.infra.errors import FedheadError, Interval, OneOf, param_error, unknown_name, validate
from fedhead.infra.params import Param, doc_line  # the declared-parameter record shared with the head registry

__all__ = [
    "PARTITIONS",
    "Param",
    "PartitionSpec",
    "register_partition",
    "partition_names",
    "resolve_partition_params",
    "create_partition",
    "class_counts",
    "describe_partition",
]


@dataclass
class PartitionSpec:
    """A registered partition: its function and declared parameters."""

    name: str
    fn: Callable  # fn(labels, num_clients, rng, features=None, **params) -> list[np.ndarray]
    params: list[Param] = field(default_factory=list)
    needs_features: bool = False  # True if fn needs the cached features (kmeans)
    doc: str = ""  # first line of the function's docstring


PARTITIONS: dict[str, PartitionSpec] = {}


def register_partition(name: str, *params: Param, needs_features: bool = False) -> Callable:
    """Decorator: register ``fn`` as partition ``name`` with its declared parameters."""

    def deco(fn: Callable) -> Callable:
        if name in PARTITIONS:
            raise ValueError(f"partition {name!r} registered twice")
        PARTITIONS[name] = PartitionSpec(
            name=name, fn=fn, params=list(params), needs_features=needs_features, doc=doc_line(fn)
        )
        return fn

    return deco


def partition_names() -> list[str]:
    return sorted(PARTITIONS)


def _spec(name: str) -> PartitionSpec:
    if name not in PARTITIONS:
        raise unknown_name("--partition", name, PARTITIONS, "partition")
    return PARTITIONS[name]


def _all_flags() -> dict[str, str]:
    return {p.name: p.flag for s in PARTITIONS.values() for p in s.params}


def resolve_partition_params(name: str, **params: Any) -> dict:
    """Fill defaults for parameters given as None and validate each against its declaration.

    Parameters declared by other partitions may be passed as None (the CLI passes every option); a
    non-None value for a parameter this partition does not take is an error naming its flag.
    """
    spec = _spec(name)
    declared = {p.name: p for p in spec.params}
    flags = _all_flags()
    for key, value in params.items():
        if key in declared or value is None:
            continue
        flag = flags.get(key, key)
        takes = ", ".join(p.flag for p in spec.params) or "no parameters"
        raise FedheadError(
            f"The '{flag}' parameter does not apply to --partition {name}. Got {value!r} instead. "
            f"Partition {name} takes: {takes}."
        )
    out = {}
    for p in spec.params:
        value = params.get(p.name)
        if value is None:
            value = p.default
        if p.constraint is not None:
            validate(p.flag, value, p.constraint, f"(--partition {name}; default {p.default!r})")
        if isinstance(p.constraint, Interval) and p.constraint.integer:
            value = int(value)
        out[p.name] = value
    return out


def create_partition(
    name: str,
    labels: np.ndarray,
    num_clients: int,
    *,
    seed: int,
    features: np.ndarray | None = None,
    **params: Any,
) -> list[np.ndarray]:
    """Partition the training indices ``0..len(labels)-1`` among ``num_clients`` clients.

    Returns ``num_clients`` int64 arrays, each sorted ascending, pairwise disjoint; identical for the same
    seed and parameters.
    """
    spec = _spec(name)
    kw = resolve_partition_params(name, **params)
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise FedheadError(
            f"Partition labels must be a 1-D integer array; got shape {labels.shape} dtype {labels.dtype}."
        )
    if labels.size and labels.min() < 0:
        raise FedheadError(f"Partition labels must be >= 0; got {int(labels.min())}.")
    validate("--clients", num_clients, Interval(1, None, integer=True))
    num_clients = int(num_clients)
    n = len(labels)
    if num_clients > n:
        raise param_error(
            "--clients",
            num_clients,
            f"must be <= the number of training samples ({n})",
            "Use fewer --clients or a larger training set.",
        )
    validate("--seed", seed, Interval(0, None, integer=True))
    if spec.needs_features:
        if features is None:
            raise FedheadError(
                f"The '--partition' parameter {name} needs the cached features, but none were "
                f"given. Pass the feature store's train features."
            )
        features = np.asarray(features)
        if features.ndim != 2 or features.shape[0] != n:
            raise FedheadError(f"Partition {name} needs features of shape [{n}, d]; got {features.shape}.")
    rng = np.random.default_rng(int(seed))
    parts = spec.fn(labels, num_clients, rng, features=features, **kw)
    parts = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    _check_contract(name, parts, n, num_clients)
    return parts


def _check_contract(name: str, parts: list[np.ndarray], n: int, k: int) -> None:
    if len(parts) != k:
        raise RuntimeError(f"partition {name} returned {len(parts)} clients, expected {k}")
    if not parts:
        return
    allidx = np.concatenate(parts)
    if allidx.size and (allidx.min() < 0 or allidx.max() >= n):
        raise RuntimeError(f"partition {name} returned an index out of range")
    if np.bincount(allidx, minlength=n).max(initial=0) > 1:
        raise RuntimeError(f"partition {name} used an index more than once")


def class_counts(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Per-client class counts, shape [K, C], int64."""
    labels = np.asarray(labels)
    out = np.zeros((len(parts), num_classes), dtype=np.int64)
    for k, p in enumerate(parts):
        out[k] = np.bincount(labels[np.asarray(p, dtype=np.int64)], minlength=num_classes)[:num_classes]
    return out


def describe_partition(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> dict:
    """Flat summary: client sizes and classes per client (min/mean/max), samples used."""
    counts = class_counts(parts, labels, num_classes)
    sizes = counts.sum(1)
    ncls = (counts > 0).sum(1)
    return {
        "num_clients": int(len(parts)),
        "samples_used": int(sizes.sum()),
        "samples_total": int(len(labels)),
        "size_min": int(sizes.min()) if len(sizes) else 0,
        "size_mean": float(sizes.mean()) if len(sizes) else 0.0,
        "size_max": int(sizes.max()) if len(sizes) else 0,
        "classes_min": int(ncls.min()) if len(ncls) else 0,
        "classes_mean": float(ncls.mean()) if len(ncls) else 0.0,
        "classes_max": int(ncls.max()) if len(ncls) else 0,
        "empty_clients": int((sizes == 0).sum()),
    }


# ---------------------------------------------------------------- helpers


def _group_by_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Indices grouped by owner (owner[i] = client of sample i, -1 = unassigned)."""
    idx = np.flatnonzero(owner >= 0)
    own = owner[idx]
    order = np.argsort(own, kind="stable")
    counts = np.bincount(own, minlength=num_clients)
    return np.split(idx[order], np.cumsum(counts)[:-1])


def _class_indices(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, list[np.ndarray]]:
    """Present classes and, for each, its sample indices in a seeded random order."""
    classes = np.unique(labels)
    return classes, [rng.permutation(np.flatnonzero(labels == c)) for c in classes]


# ---------------------------------------------------------------- partitions


@register_partition("iid")
def iid(labels, num_clients, rng, features=None):
    """Shuffle, then split into equal parts (sizes differ by at most 1)."""
    return np.array_split(rng.permutation(len(labels)), num_clients)


@register_partition(
    "shard",
    Param(
        "shards_per_client",
        2,
        Interval(1, None, integer=True),
        "Shards (or, with --distinct-labels, labels) per client for --partition shard.",
        "--shards-per-client",
    ),
    Param(
        "distinct_labels",
        False,
        OneOf((True, False)),
        "shard: give each client s different labels (FedOVA non-IID-l).",
        "--distinct-labels",
    ),
)
def shard(labels, num_clients, rng, features=None, *, shards_per_client, distinct_labels):
    """McMahan shards: sort by label, cut into K*s equal shards, each client draws s (or s distinct labels).

    Shards are cut with ``numpy.array_split`` so sizes differ by at most 1 and every index is used.
    With ``distinct_labels`` (FedOVA non-IID-l) client k holds labels perm[(k+j) mod C], j < s, over the
    C classes present; each label's samples are cut into equal parts, one per client holding it. When
    K*s < C some labels are held by nobody and their samples are left out (not assigned).
    """
    s, k, n = shards_per_client, num_clients, len(labels)
    if distinct_labels:
        classes, groups = _class_indices(labels, rng)
        c = len(classes)
        if s > c:
            raise param_error(
                "--shards-per-client",
                s,
                f"must be <= the number of classes ({c}) with --distinct-labels",
                f"Use --shards-per-client {c} or fewer.",
            )
        order = rng.permutation(c)  # position i of the cycle holds class order[i]
        owner = np.full(n, -1, dtype=np.int64)
        for i in range(c):
            holders = [kk for kk in range(k) if (i - kk) % c < s]
            if not holders:
                continue
            idx = groups[order[i]]
            for kk, part in zip(holders, np.array_split(idx, len(holders))):
                owner[part] = kk
        return _group_by_owner(owner, k)
    if k * s > n:
        raise param_error(
            "--shards-per-client",
            s,
            f"does not divide the data: {k} clients x {s} shards = {k * s} shards > {n} samples",
            "Use fewer --clients or a smaller --shards-per-client.",
        )
    perm = rng.permutation(n)
    order = perm[np.argsort(labels[perm], kind="stable")]
    shards = np.array_split(order, k * s)
    pick = rng.permutation(k * s).reshape(k, s)
    return [np.concatenate([shards[j] for j in row]) for row in pick]


@register_partition(
    "dirichlet",
    Param(
        "alpha",
        0.5,
        Interval(0, None, closed="neither"),
        "Dirichlet concentration (dirichlet 0.5, bernoulli-dirichlet 10); smaller is more skewed.",
        "--alpha",
    ),
    Param(
        "min_size",
        10,
        Interval(0, None, integer=True),
        "Smallest allowed client size (dirichlet 10: redraw until met; zipf 1).",
        "--min-size",
    ),
)
def dirichlet(labels, num_clients, rng, features=None, *, alpha, min_size, max_tries=1000):
    """Per class, proportions ~ Dir(alpha*1_K) cut the shuffled class indices; redraw until min_size holds.

    Every index is used exactly once. Gives up after ``max_tries`` draws with a one-line error.
    """
    k, n = num_clients, len(labels)
    if k * min_size > n:
        raise param_error(
            "--min-size",
            min_size,
            f"must be <= samples per client ({n} // {k} = {n // k})",
            "Use a smaller --min-size or fewer --clients.",
        )
    classes = np.unique(labels)
    n_c = np.array([(labels == c).sum() for c in classes])
    for _ in range(max_tries):
        props = rng.dirichlet(np.full(k, float(alpha)), size=len(classes))  # [C, K]
        cum = np.floor(np.cumsum(props, axis=1) * n_c[:, None]).astype(np.int64)
        cum[:, -1] = n_c
        counts = np.diff(cum, axis=1, prepend=0)  # [C, K]
        if counts.sum(0).min() >= min_size:
            break
    else:
        raise param_error(
            "--min-size",
            min_size,
            f"could not be met by any of {max_tries} Dirichlet draws (alpha {alpha:g}, {k} clients)",
            "Use a lower --min-size or a larger --alpha.",
        )
    owner = np.empty(n, dtype=np.int64)
    for ci, c in enumerate(classes):
        idx = rng.permutation(np.flatnonzero(labels == c))
        owner[idx] = np.repeat(np.arange(k), counts[ci])
    return _group_by_owner(owner, k)


@register_partition(
    "bernoulli-dirichlet",
    Param(
        "p",
        0.7,
        Interval(0, 1, closed="right"),
        "bernoulli-dirichlet: probability that a client holds each class (FedCorr).",
        "--p",
    ),
    Param(
        "alpha",
        10.0,
        Interval(0, None, closed="neither"),
        "Dirichlet concentration (dirichlet 0.5, bernoulli-dirichlet 10); smaller is more skewed.",
        "--alpha",
    ),
)
def bernoulli_dirichlet(labels, num_clients, rng, features=None, *, p, alpha, max_tries=10000):
    """FedCorr: Phi_kc ~ Bernoulli(p) (rows with no class redrawn); class c split over its holders by Dir(alpha).

    Each sample of class c goes to one of the clients that picked c, drawn from q_c ~ Dir(alpha*1).
    A class that no client picked gives all its samples to one random client, so every index is used
    exactly once. A client may end up with no samples if it drew none from its classes.
    """
    k, n = num_clients, len(labels)
    classes = np.unique(labels)
    c = len(classes)
    phi = rng.random((k, c)) < p
    for _ in range(max_tries):
        empty = np.flatnonzero(~phi.any(1))
        if empty.size == 0:
            break
        phi[empty] = rng.random((empty.size, c)) < p
    else:
        raise param_error("--p", p, f"left a client with no class after {max_tries} redraws", "Use a larger --p.")
    owner = np.empty(n, dtype=np.int64)
    for ci, cls in enumerate(classes):
        idx = np.flatnonzero(labels == cls)
        holders = np.flatnonzero(phi[:, ci])
        if holders.size == 0:
            owner[idx] = rng.integers(k)
            continue
        q = rng.dirichlet(np.full(holders.size, float(alpha)))
        owner[idx] = holders[rng.choice(holders.size, size=idx.size, p=q)]
    return _group_by_owner(owner, k)


@register_partition(
    "zipf",
    Param("zipf_s", 1.0, Interval(0, None), "zipf: client sizes proportional to k^(-s).", "--zipf-s"),
    Param(
        "min_size",
        1,
        Interval(1, None, integer=True),
        "Smallest allowed client size (dirichlet 10: redraw until met; zipf 1).",
        "--min-size",
    ),
)
def zipf(labels, num_clients, rng, features=None, *, zipf_s, min_size):
    """Client k (k = 1..K) gets n_k ~ k^(-s) samples (>= min_size, summing to N) drawn uniformly.

    Sizes are non-increasing in the client index (largest remainder rounding); labels stay IID.
    """
    k, n = num_clients, len(labels)
    extra = n - k * min_size
    if extra < 0:
        raise param_error(
            "--min-size",
            min_size,
            f"must be <= samples per client ({n} // {k} = {n // k})",
            "Use a smaller --min-size or fewer --clients.",
        )
    w = np.arange(1, k + 1, dtype=np.float64) ** (-float(zipf_s))
    quota = extra * w / w.sum()
    sizes = np.floor(quota).astype(np.int64)
    rem = extra - int(sizes.sum())
    if rem > 0:
        sizes[np.argsort(-(quota - sizes), kind="stable")[:rem]] += 1
    sizes += min_size
    return np.split(rng.permutation(n), np.cumsum(sizes)[:-1])


@register_partition("kmeans", needs_features=True)
def kmeans(labels, num_clients, rng, features=None, *, max_iter=20, pca_dim=64):
    """Per class, k-means on the features into K clusters (fewer if the class is smaller); a random
    permutation per class gives cluster j to client pi(j).

    For speed the features are first reduced once to their top ``pca_dim`` principal components
    (randomized PCA over the whole training set; skipped when d <= pca_dim), then each class is
    clustered with sklearn KMeans (k-means++ init, one init, at most ``max_iter`` Lloyd iterations),
    all seeded from ``rng``. Every index is used exactly once.
    """
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA

    k, n = num_clients, len(labels)
    feats = np.asarray(features).astype(np.float32, copy=False)
    if feats.shape[1] > pca_dim and n > pca_dim:
        feats = PCA(
            n_components=pca_dim, svd_solver="randomized", random_state=int(rng.integers(2**31 - 1))
        ).fit_transform(feats)
    owner = np.empty(n, dtype=np.int64)
    for cls in np.unique(labels):
        idx = np.flatnonzero(labels == cls)
        m = min(k, idx.size)
        pi = rng.permutation(k)[:m]
        if m == 1:
            owner[idx] = pi[0]
            continue
        km = KMeans(
            n_clusters=m, n_init=1, max_iter=max_iter, init="k-means++", random_state=int(rng.integers(2**31 - 1))
        )
        owner[idx] = pi[km.fit_predict(feats[idx])]
    return _group_by_owner(owner, k)
