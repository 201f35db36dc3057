"""What the clients of a federation hold and send, the same for every transport: the sample of a round
(:mod:`fedhead.core.sampling`), the partition and label noise of a seed, the feature statistics of
``--center``/``--scale rms``, the prepared features, and CCVR's class statistics. A Flower node runs these on its own data; the in-process transport on all of them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from extract.store import Features
from fedhead.core.ccvr import client_class_stats
from fedhead.core.dp import feature_clip, noisy_feature_sums
from fedhead.core.linalg import clip_rows
from fedhead.core.noise import apply_noise
from fedhead.core.partitions import class_counts, create_partition, partition_spec
from fedhead.core.sampling import round_clients, sample_clients  # noqa: F401  (here before fedhead.core.sampling)
from fedhead.federation.config import TrainConfig
from fedhead.federation.experiment import parse_client_ids
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")


@dataclass
class FeatureStats:
    mean: np.ndarray | None
    scale: float
    bytes_up_per_client: int  # what each client sends for the statistics (once)
    bytes_down_per_client: int


def federated_feature_stats(
    x: np.ndarray, parts: list[np.ndarray], center: bool, scale: str, cfg: TrainConfig | None = None, seed: int = 0
) -> FeatureStats:
    """Each client sends its feature sum, squared-norm sum and count; the server adds them up.

    Costs one extra exchange of ``D + 2`` floats per client (counted in round 1's bytes). With differential
    privacy (``cfg``), each client clips its features to --dp-feature-clip first and the server adds noise to the
    sums (:func:`fedhead.core.dp.noisy_feature_sums`, keyed by ``seed``)."""
    if not center and scale == "none":
        return FeatureStats(None, 1.0, 0, 0)
    d = x.shape[1]
    total = np.zeros(d, dtype=np.float64)
    sq, n = 0.0, 0
    clip = feature_clip(cfg) if cfg is not None else None
    for p in parts:
        xp = x[p].astype(np.float64) if clip is None else clip_rows(x[p], clip)
        total += xp.sum(0)
        sq += float((xp * xp).sum())
        n += len(p)
    if cfg is not None:
        total, sq, n = noisy_feature_sums(total, sq, n, cfg, seed)
    mean = total / max(1, n)
    s = 1.0
    if scale == "rms":
        var = sq / max(1, n) - (float(mean @ mean) if center else 0.0)
        s = float(np.sqrt(max(var, 1e-12)))
    up = (d + 2) * 4
    down = (d + 1) * 4
    return FeatureStats(mean if center else None, s, up, down)


def prepare(x: np.ndarray, stats: FeatureStats, device, dtype=None) -> torch.Tensor:
    """Apply the federated statistics and append the bias column of ones; in ``dtype`` (None: float32)."""
    dtype = torch.float32 if dtype is None else dtype
    t = torch.as_tensor(x, dtype=torch.float32)
    if stats.mean is not None:
        t = t - torch.as_tensor(stats.mean, dtype=torch.float32)
    if stats.scale != 1.0:
        t = t / stats.scale
    t = torch.cat([t, torch.ones(len(t), 1)], 1)
    return t.to(device=device, dtype=dtype).contiguous()


def noise_dataset_name(store: Features, cfg: TrainConfig) -> str:
    if cfg.noise_dataset:
        return cfg.noise_dataset
    name = store.info.dataset
    if name == "imagefolder":  # the shared CIFAR-10 copy is an image folder: recognise it by its classes
        names = [c.lower() for c in store.info.class_names]
        if names == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]:
            return "cifar10"
    return name


@dataclass
class Federation:
    parts: list[np.ndarray]  # each client's training part (its validation part held out)
    labels: np.ndarray  # noisy training labels (per client; test labels stay clean)
    counts: np.ndarray  # [K, C] of the training parts, after noise
    realised_noise: float
    stats: FeatureStats
    val_parts: list[np.ndarray] | None = None  # each client's validation part (None: --val-fraction 0)


HOLDOUT_KEY = 0x7A11  # keys the validation draw apart from the partition's and the noise's draws of a seed


def holdout(
    parts: list[np.ndarray], labels: np.ndarray, fraction: float, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Each client's validation part: ``floor(fraction * n_k + u_k)`` of its ``n_k`` samples (``u_k`` uniform in
    [0, 1): fraction x n_k in expectation, so that small clients of a cross-device federation hold out their share
    too; never all of them: a client keeps at least one training sample), stratified by (noisy) label within the
    client (systematic sampling over its samples shuffled and then grouped by label, so each class gives the floor
    or the ceiling of its share), seeded by ``seed``. Returns (training parts, validation parts), in the order of
    ``parts``; the validation parts are None when no client could spare a sample (the run then selects nothing and
    its summary says so)."""
    rng = np.random.default_rng([int(seed), HOLDOUT_KEY])
    train, val = [], []
    for p in parts:
        p = np.asarray(p, dtype=np.int64)
        n = len(p)
        m = min(n - 1, int(np.floor(fraction * n + rng.random()))) if n else 0
        if m <= 0:
            train.append(p)
            val.append(p[:0])
            continue
        order = rng.permutation(n)
        order = order[np.argsort(labels[p[order]], kind="stable")]
        picked = order[((np.arange(m) + rng.random()) * n / m).astype(np.int64)]
        keep = np.ones(n, dtype=bool)
        keep[picked] = False
        train.append(p[keep])
        val.append(np.sort(p[picked]))
    if fraction > 0 and not any(len(v) for v in val):  # no client could spare a sample: no validation part
        return [np.asarray(p, dtype=np.int64) for p in parts], None
    return train, val


def build_federation(store: Features, cfg: TrainConfig, seed: int, partition: str, pparams: dict) -> Federation:
    C = store.info.num_classes
    parts = create_partition(
        partition,
        store.train_y,
        cfg.clients,
        seed=seed,
        features=store.train_x if partition_spec(partition).needs_features else None,
        client_ids=store.train_clients,
        **pparams,
    )
    client_labels = [store.train_y[p] for p in parts]
    noisy, realised = apply_noise(
        cfg.noise,
        cfg.noise_rate,
        client_labels,
        C,
        dataset=noise_dataset_name(store, cfg),
        seed=seed,
        asym_rule=cfg.asym_map,
    )
    labels = store.train_y.copy()
    for p, yl in zip(parts, noisy):
        labels[p] = yl
    val_parts = None
    if cfg.val_fraction:
        parts, val_parts = holdout(parts, labels, cfg.val_fraction, seed)
        if val_parts is not None:  # the noise rate of what the clients train on (a Flower node counts the same)
            train = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            realised = float((labels[train] != store.train_y[train]).mean()) if len(train) else 0.0
    parts, val_parts = withdraw(parts, val_parts, cfg)
    counts = class_counts(parts, labels, C)
    stats = federated_feature_stats(store.train_x, parts, cfg.center, cfg.scale, cfg, seed)
    return Federation(parts, labels, counts, realised, stats, val_parts)


def withdraw(parts: list, val_parts: list | None, cfg: TrainConfig) -> tuple[list, list | None]:
    """``--withdrawn-clients``: those clients' training and validation parts emptied, after every draw (partition,
    label noise, validation split), so that each other client holds the same samples as in the run with them."""
    ids = parse_client_ids(cfg.withdrawn_clients) if cfg.withdrawn_clients else []
    if not ids:
        return parts, val_parts
    parts = list(parts)
    for k in ids:
        parts[k] = parts[k][:0]
        if val_parts is not None:
            val_parts = list(val_parts)
            val_parts[k] = val_parts[k][:0]
    return parts, val_parts


def ccvr_client_stats(x: torch.Tensor, labels: np.ndarray, part: np.ndarray, num_classes: int):
    """CCVR's client half: the :class:`fedhead.core.ccvr.ClassStats` one client sends, of its samples ``part`` of the
    prepared features ``x [N, D+1]`` (the trailing 1 dropped) with their (possibly noisy) ``labels [N]``."""
    idx = torch.as_tensor(np.asarray(part, dtype=np.int64), device=x.device)
    return client_class_stats(x.index_select(0, idx)[:, :-1], np.asarray(labels)[part], num_classes)


def with_ones(x: torch.Tensor, device) -> torch.Tensor:
    return torch.cat([x, torch.ones(len(x), 1)], 1).to(device)
