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

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fedhead.core.flwr_partitions import (
    FLWR_PREFIX,
    flwr_needs_clients,
    flwr_partition,
    is_flwr,
    resolve_flwr_args,
)
from fedhead.infra.errors import FedheadError, Interval, OneOf, param_error, unknown_name, validate
from fedhead.infra.params import Param, doc_line  # the declared-parameter record shared with the head registry

__all__ = [
    "PARTITIONS",
    "Param",
    "PartitionSpec",
    "partition_spec",
    "register_partition",
    "partition_names",
    "resolve_partition_params",
    "create_partition",
    "class_counts",
    "describe_partition",
    "natural_clients",
]


@dataclass
class PartitionSpec:
    """A registered partition: its function and declared parameters."""

    name: str
    fn: Callable  # fn(labels, num_clients, rng, features=None, **params) -> list[np.ndarray]
    params: list[Param] = field(default_factory=list)
    needs_features: bool = False  # True if fn needs the cached features (kmeans)
    needs_clients: bool = False  # True if fn needs each sample's recorded client id (natural)
    doc: str = ""  # first line of the function's docstring


PARTITIONS: dict[str, PartitionSpec] = {}


def register_partition(
    name: str, *params: Param, needs_features: bool = False, needs_clients: bool = False
) -> Callable:
    """Decorator: register ``fn`` as partition ``name`` with its declared parameters. ``needs_clients``: ``fn`` is
    called with ``client_ids=`` (each sample's recorded client id) instead of drawing clients."""

    def deco(fn: Callable) -> Callable:
        if name in PARTITIONS:
            raise ValueError(f"partition {name!r} registered twice")
        PARTITIONS[name] = PartitionSpec(
            name=name,
            fn=fn,
            params=list(params),
            needs_features=needs_features,
            needs_clients=needs_clients,
            doc=doc_line(fn),
        )
        return fn

    return deco


def partition_names() -> list[str]:
    return sorted(PARTITIONS)


def partition_spec(name: str) -> PartitionSpec:
    """The partition ``name``: a registered one, or flwr-datasets' partitioner ``flwr:<ClassName>``
    (:mod:`fedhead.core.flwr_partitions`; its one parameter, ``partition_arg``, holds the partitioner's keyword
    arguments). An unknown name is one line listing the registered ones."""
    if is_flwr(name):
        return PartitionSpec(name=name, fn=flwr_partition, needs_clients=flwr_needs_clients(name))
    if name not in PARTITIONS:
        raise unknown_name("--partition", name, [*PARTITIONS, FLWR_PREFIX + "<ClassName>"], "partition")
    return PARTITIONS[name]


def _all_flags() -> dict[str, str]:
    return {p.name: p.flag for s in PARTITIONS.values() for p in s.params}


def resolve_partition_params(name: str, **params: Any) -> dict:
    """Fill defaults for parameters given as None and validate each against its declaration.

    Parameters declared by other partitions may be passed as None (the CLI passes every option); a
    non-None value for a parameter this partition does not take is an error naming its flag.
    """
    spec = partition_spec(name)
    if is_flwr(name):
        return _resolve_flwr(name, params)
    declared = {p.name: p for p in spec.params}
    flags = _all_flags()
    for key, value in params.items():
        if key in declared or value is None or (key == FLWR_PARAM and not value):
            continue
        flag = flags.get(key, FLWR_FLAG if key == FLWR_PARAM else key)
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


FLWR_PARAM, FLWR_FLAG = "partition_arg", "--partition-arg"  # the keyword arguments of a flwr: partition


def _resolve_flwr(name: str, params: dict) -> dict:
    """``{"partition_arg": {...}}`` of a ``flwr:`` partition, checked against its class; a registered partition's
    parameter given with it is one line pointing to ``--partition-arg``."""
    flags = _all_flags()
    for key, value in params.items():
        if key != FLWR_PARAM and value is not None:
            flag = flags.get(key, key)
            raise FedheadError(
                f"The '{flag}' parameter does not apply to --partition {name}. Got {value!r} instead. Give "
                f"flwr-datasets' keyword arguments as {FLWR_FLAG} KEY=VALUE (e.g. {FLWR_FLAG} alpha=0.1)."
            )
    return {FLWR_PARAM: resolve_flwr_args(name, params.get(FLWR_PARAM))}


def create_partition(
    name: str,
    labels: np.ndarray,
    num_clients: int,
    *,
    seed: int,
    features: np.ndarray | None = None,
    client_ids: np.ndarray | None = None,
    **params: Any,
) -> list[np.ndarray]:
    """Partition the training indices ``0..len(labels)-1`` among ``num_clients`` clients.

    Returns ``num_clients`` int64 arrays, each sorted ascending, pairwise disjoint; identical for the same
    seed and parameters. ``client_ids`` (int [N]: each sample's client recorded in the store) is what a partition
    registered with ``needs_clients`` (``natural``) reads; the others ignore it. A ``flwr:<ClassName>`` partition
    (flwr-datasets' partitioner, :mod:`fedhead.core.flwr_partitions`) takes its keyword arguments as
    ``partition_arg={...}``; it may leave samples out where the partitioner does (a shard partitioner's remainder).
    """
    spec = partition_spec(name)
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
    if is_flwr(name):  # flwr-datasets' partitioner, seeded by the run's seed (it draws its own numbers)
        parts = flwr_partition(name, labels, num_clients, seed=int(seed), args=kw[FLWR_PARAM], client_ids=client_ids)
    else:
        extra = {"client_ids": check_client_ids(name, client_ids, n, num_clients)} if spec.needs_clients else {}
        rng = np.random.default_rng(int(seed))
        parts = spec.fn(labels, num_clients, rng, features=features, **kw, **extra)
    parts = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    _check_contract(name, parts, n, num_clients)
    return parts


def natural_clients(client_ids: np.ndarray | None) -> int:
    """The number of natural clients of a store's ``train/clients`` ids (0 if none are recorded)."""
    return 0 if client_ids is None or not len(client_ids) else int(np.asarray(client_ids).max()) + 1


def check_client_ids(name: str, client_ids: np.ndarray | None, n: int, num_clients: int) -> np.ndarray:
    """The recorded client ids a ``needs_clients`` partition reads: refused in one line when the store has none, or
    when ``--clients`` is not their number."""
    if client_ids is None:
        raise FedheadError(
            f"The '--partition' parameter {name} needs the client of each training sample, which this store does "
            "not record. Re-extract it with --client-folders, --clients-csv or --client-pattern (fedhead extract), "
            "or choose another --partition."
        )
    ids = np.asarray(client_ids)
    if ids.shape != (n,) or not np.issubdtype(ids.dtype, np.integer) or (n and ids.min() < 0):
        raise FedheadError(
            f"Partition {name} needs one client id >= 0 per sample ([{n}]); got {ids.shape} {ids.dtype}."
        )
    k = natural_clients(ids)
    if num_clients != k:
        raise param_error(
            "--clients",
            num_clients,
            f"must be the number of clients the store records ({k}) with --partition {name}",
            f"Use --clients {k}.",
        )
    return ids.astype(np.int64, copy=False)


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
    k = len(parts)
    if k == 0:
        return np.zeros((0, num_classes), dtype=np.int64)
    idx = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    owner = np.repeat(np.arange(k), [len(p) for p in parts])
    y = labels[idx].astype(np.int64)
    keep = y < num_classes
    flat = np.bincount(owner[keep] * num_classes + y[keep], minlength=k * num_classes)  # one pass, not one a client
    return flat.reshape(k, num_classes)


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


def _by_class(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Present classes and, for each, its sample indices ascending (one sort, not a pass over the labels per
    class)."""
    classes, sizes = np.unique(labels, return_counts=True)
    return classes, np.split(np.argsort(labels, kind="stable"), np.cumsum(sizes)[:-1])


def _class_indices(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, list[np.ndarray]]:
    """Present classes and, for each, its sample indices in a seeded random order."""
    classes, groups = _by_class(labels)
    return classes, [rng.permutation(g) for g in groups]


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
        # client kk holds positions (kk + j) mod c, j < s: the holders of each position, ascending
        pos = (np.arange(k)[:, None] + np.arange(s)[None]).reshape(-1) % c
        held = np.repeat(np.arange(k), s)[np.argsort(pos, kind="stable")]
        for i, holders in enumerate(np.split(held, np.cumsum(np.bincount(pos, minlength=c))[:-1])):
            if len(holders):
                idx = groups[order[i]]
                big, h = divmod(len(idx), len(holders))  # np.array_split's sizes: h parts of big + 1, then big
                owner[idx] = np.repeat(holders, np.r_[np.full(h, big + 1), np.full(len(holders) - h, big)])
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

    Every index is used exactly once. A draw is made a block of classes at a time (the same random stream as
    one ``rng.dirichlet`` call over all classes, in bounded memory). A floor that the draws would meet less than
    once in a million tries is refused in one line with the numbers that make it so: before drawing, from client
    0's exact chance (:func:`_first_client_chance`), and after each draw that misses it, from the rate of clients
    under it so far (:func:`_dirichlet_hopeless`). Gives up after ``max_tries`` draws otherwise.
    """
    k, n = num_clients, len(labels)
    if k * min_size > n:
        raise param_error(
            "--min-size",
            min_size,
            f"must be <= samples per client ({n} // {k} = {n // k})",
            "Use a smaller --min-size or fewer --clients.",
        )
    classes, n_c = np.unique(labels, return_counts=True)
    chance = _first_client_chance(float(alpha), n_c, k, min_size)
    if chance * max_tries < _HOPELESS:
        raise FedheadError(
            f"The '--min-size' parameter ({min_size}) cannot be met with --alpha {alpha:g} and {k} clients ({n} "
            f"samples, {n / k:.1f} per client): client 0 gets floor(n_c p) of each class's n_c samples, p ~ "
            f"Beta({alpha:g}, {(k - 1) * alpha:g}), so it reaches {min_size} samples with probability below "
            f"{_power_of_ten(chance)} a draw, {_power_of_ten(chance * max_tries)} in all {max_tries} draws. Use a "
            "smaller --min-size (0: no floor), a larger --alpha or fewer --clients."
        )
    under, best = 0, -1  # clients under min_size summed over the failed draws; the largest smallest client
    for t in range(1, max_tries + 1):
        sizes, cuts = _dirichlet_draw(rng, float(alpha), n_c, k)
        if sizes.min() >= min_size:
            break
        under += int((sizes < min_size).sum())
        best = max(best, int(sizes.min()))
        why = _dirichlet_hopeless(under, t, k, min_size, max_tries)
        if why:
            raise FedheadError(
                f"The '--min-size' parameter ({min_size}) cannot be met with --alpha {alpha:g} and {k} clients ({n} "
                f"samples, {n / k:.1f} per client): {why}. Use --min-size {best}"
                f"{' (no floor)' if best == 0 else ' or lower (met by this seed: same draws)'}, a larger --alpha or "
                "fewer --clients."
            )
    else:
        raise FedheadError(
            f"The '--min-size' parameter ({min_size}) was not met by any of {max_tries} Dirichlet draws (alpha "
            f"{alpha:g}, {k} clients): the smallest client of the best draw had {best} samples. Use --min-size "
            f"{best} or lower, a larger --alpha or fewer --clients."
        )
    owner = np.empty(n, dtype=np.int64)
    for idx, (clients, counts) in zip(_by_class(labels)[1], cuts):
        owner[rng.permutation(idx)] = np.repeat(clients, counts)
    return _group_by_owner(owner, k)


_DRAW_BYTES = 32 * 2**20  # float64 proportions of one block of classes in a Dirichlet draw


def _dirichlet_draw(rng, alpha: float, n_c: np.ndarray, k: int) -> tuple[np.ndarray, list]:
    """One draw of :func:`dirichlet`: per class ``c`` proportions ~ Dir(alpha*1_k), the class's ``n_c[c]`` samples
    cut at the floored cumulative proportions. Returns the client sizes ``[k]`` and, per class, the clients that
    get samples and how many (``(clients, counts)``, clients ascending). Drawn a block of classes at a time: the
    values equal one ``rng.dirichlet(alpha*1_k, size=C)`` call's, class after class."""
    sizes = np.zeros(k, dtype=np.int64)
    cuts: list = []
    rows = max(1, _DRAW_BYTES // (8 * k))
    for a in range(0, len(n_c), rows):
        nc = n_c[a : a + rows]
        props = rng.dirichlet(np.full(k, alpha), size=len(nc))  # [rows, k]
        cum = np.floor(np.cumsum(props, axis=1, out=props) * nc[:, None]).astype(np.int64)
        cum[:, -1] = nc
        counts = np.diff(cum, axis=1, prepend=0)
        sizes += counts.sum(0)
        r, c = np.nonzero(counts)
        ends = np.cumsum(np.bincount(r, minlength=len(nc)))
        cuts += zip(np.split(c, ends[:-1]), np.split(counts[r, c], ends[:-1]))
    return sizes, cuts


def _first_client_chance(alpha: float, n_c: np.ndarray, k: int, min_size: int) -> float:
    """The chance that client 0 meets ``min_size`` in a draw of :func:`dirichlet`, which bounds the draw's chance of
    success from above (1 when not computed: one client, no floor, or too large a computation).

    Client 0's share of class ``c`` is ``floor(n_c p)`` with ``p ~ Beta(alpha, (k-1) alpha)`` (the first proportion
    is never rounded up by the cumulative cut), independently over classes. Its size is their sum, whose
    distribution below ``min_size`` is a truncated convolution; the mass at or above ``min_size`` is summed from
    upper tails (no ``1 - sum`` that would round a tiny chance to 0)."""
    m = int(min_size)
    sizes, times = np.unique(n_c, return_counts=True)
    if k == 1 or m == 0 or len(sizes) * m * m > 1e7:
        return 1.0
    from scipy.special import betainc  # imported here: scipy.special costs every command half a second to start

    a, b = alpha, (k - 1) * alpha
    dist, tail = np.eye(1, m)[0], 0.0  # P(size = j) for j < m, P(size >= m), over the classes so far
    for nc, r in zip(sizes, times):
        upper = betainc(b, a, 1.0 - np.arange(min(m, int(nc)) + 1) / nc)  # P(p >= j / nc), j = 0 .. min(m, nc)
        upper[0] = 1.0
        pmf = np.zeros(m)
        pmf[: len(upper) - 1] = upper[:-1] - upper[1:]  # P(floor(nc p) = j), j < m
        one = (pmf, float(upper[-1]) if nc >= m else 0.0)
        while r:  # (dist, tail) combined with r classes of this size, by repeated squaring
            if r & 1:
                dist, tail = _add_sizes((dist, tail), one, m)
            r >>= 1
            if r:
                one = _add_sizes(one, one, m)
    return min(1.0, tail)


def _add_sizes(x: tuple, y: tuple, m: int) -> tuple:
    """The distribution of the sum of two independent sizes, each ``(P(size = j) for j < m, P(size >= m))``."""
    (dx, tx), (dy, ty) = x, y
    full = np.convolve(dx, dy)
    return full[:m], tx + float(dx.sum()) * ty + float(full[m:].sum())


def _power_of_ten(p: float) -> str:
    return f"1e{math.floor(math.log10(p)) + 1:.0f}" if p > 1e-300 else "1e-300"


_HOPELESS = 1e-6  # refuse when the remaining draws are expected to meet --min-size fewer times than this
_CONFIDENCE = 1e-9  # chance that the rate of clients under --min-size is overestimated by more than the margin


def _dirichlet_hopeless(under: int, draws: int, k: int, min_size: int, max_tries: int) -> str:
    """Why the remaining draws are hopeless ("" if they are not): ``under`` clients got fewer than ``min_size``
    samples in ``draws`` failed draws of ``k`` clients.

    A draw succeeds only if every client meets the floor. The mean rate ``q`` of clients under it is bounded from
    below by the multiplicative Chernoff bound (the smallest ``q`` under which ``under`` or more happen with
    probability above 1e-9; it holds for negatively associated client sizes, as a Dirichlet split's are up to the
    rounding of the cut), and
    ``(1 - q)^k`` bounds a draw's chance of success from above (negative association and the AM-GM inequality:
    the clients meet the floor together at most as often as independent clients at their mean rate)."""
    obs = draws * k
    q_hat = under / obs
    ln = math.log(1 / _CONFIDENCE)  # P(X >= under) <= exp(-(under - mu)^2 / (under + mu)) = 1e-9 at mu = mu_lo
    q_lo = (under + ln / 2 - math.sqrt(2 * ln * under + ln * ln / 4)) / obs
    if q_lo <= 0:
        return ""
    log10_p = k * math.log1p(-q_lo) / math.log(10) if q_lo < 1 else -math.inf
    left = max_tries - draws
    if left <= 0 or log10_p + math.log10(left) >= math.log10(_HOPELESS):
        return ""  # not hopeless, or the last draw (the caller's message says so)
    first = "the first draw" if draws == 1 else f"the first {draws} draws"
    bound = _power_of_ten(10**log10_p) if log10_p > -300 else "1e-300"
    return (
        f"in {first}, {under / draws:.0f} of {k} clients a draw ({100 * q_hat:.0f}%) got fewer than {min_size} samples, so "
        f"each of the {max_tries} draws meets it with probability below {bound}"
    )


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
    classes, by_class = _by_class(labels)
    c = len(classes)
    phi = np.empty((k, c), dtype=bool)
    rows = max(1, _DRAW_BYTES // (8 * c))
    for a in range(0, k, rows):  # in blocks of clients: the stream of one rng.random((k, c)), in bounded memory
        phi[a : a + rows] = rng.random((min(rows, k - a), c)) < p
    for _ in range(max_tries):
        empty = np.flatnonzero(~phi.any(1))
        if empty.size == 0:
            break
        phi[empty] = rng.random((empty.size, c)) < p
    else:
        raise param_error("--p", p, f"left a client with no class after {max_tries} redraws", "Use a larger --p.")
    owner = np.empty(n, dtype=np.int64)
    phi_t = np.ascontiguousarray(phi.T)  # [C, K]: a class's holders in one contiguous row
    for ci, idx in enumerate(by_class):
        holders = np.flatnonzero(phi_t[ci])
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


@register_partition("natural", needs_clients=True)
def natural(labels, num_clients, rng, features=None, *, client_ids):
    """One client per client id recorded in the store at extraction (folders, a CSV or a file-name pattern):
    client k holds the samples of id k (--clients must equal the number of ids). Every index is used exactly once;
    the seed plays no part."""
    return _group_by_owner(np.asarray(client_ids, dtype=np.int64), num_clients)


@register_partition("kmeans", needs_features=True)
def kmeans(labels, num_clients, rng, features=None, *, max_iter=20, pca_dim=64):
    """Per class, k-means on the features into K clusters (fewer if the class is smaller); a random
    permutation per class gives cluster j to client pi(j).

    For speed the features are first reduced once to their top ``pca_dim`` principal components
    (randomized PCA over the whole training set; skipped when d <= pca_dim), then each class is
    clustered with sklearn KMeans (k-means++ init, one init, at most ``max_iter`` Lloyd iterations),
    all seeded from ``rng``. A class with no more samples than clients is not clustered: each sample is its own
    cluster (what k-means gives), so sample j goes to client pi(j); with every class that small (10,000 clients of
    iNaturalist-Users-120k's shape) no projection is computed either. Every index is used exactly once.
    """
    k, n = num_clients, len(labels)
    _, groups = _by_class(labels)
    feats = np.asarray(features).astype(np.float32, copy=False)
    if feats.shape[1] > pca_dim and n > pca_dim:
        state = int(rng.integers(2**31 - 1))
        if any(idx.size > k for idx in groups):  # else no class is clustered: the projection would go unused
            from sklearn.decomposition import PCA  # (scikit-learn takes seconds to import: only when used)

            feats = PCA(n_components=pca_dim, svd_solver="randomized", random_state=state).fit_transform(feats)
    owner = np.empty(n, dtype=np.int64)
    for idx in groups:
        m = min(k, idx.size)
        pi = rng.permutation(k)[:m]
        if m == 1:
            owner[idx] = pi[0]
            continue
        state = int(rng.integers(2**31 - 1))
        if m == idx.size:  # as many clusters as samples: each sample is its own cluster, sample j to client pi(j)
            owner[idx] = pi
            continue
        from sklearn.cluster import KMeans

        km = KMeans(n_clusters=m, n_init=1, max_iter=max_iter, init="k-means++", random_state=state)
        owner[idx] = pi[km.fit_predict(feats[idx])]
    return _group_by_owner(owner, k)
