"""The scratch round loop, written once for every algorithm, and its resolved configuration.

A run writes its run directory under an exclusive lock (:func:`fedhead.infra.locks.exclusive_writer`). After every
round the whole state of the run is saved atomically in ``checkpoint.safetensors`` together with ``rounds.csv`` (one
critical section: a SIGINT/SIGTERM waits for both): the algorithm's state (every tensor of the global model,
FedOVA's per-class networks included, and the algorithm's own state, e.g. D&C's split and pre-pass
divergences, the personalised algorithms' per-client tensors, SCAFFOLD's control variates), the current seed's
rows, the finished seeds' results, and the random state (``ctx.rng``'s bit generator state and the init
generator's state; the global torch RNG is forked and keyed by (seed, round) inside every round, so nothing else
random carries over). ``resume=True`` rebuilds the seed's deterministic setup, restores that state and
continues: the rows and final models equal an uninterrupted run's bit for bit on CPU, with the recorded
intra-op thread count (``cpu_threads`` in config.json) reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fedhead.core.noise import NOISE_KINDS, apply_noise
from fedhead.core.partitions import create_partition, resolve_partition_params
from fedhead.federation.loop import PAUSE_ENV, Job, run_job, writing
from fedhead.federation.outputs import RunReport
from fedhead.federation.rundir import (
    CHECKPOINT,
    RunDir,
    acc95_round,
    identity_hash,
    mean_std,
    write_clients,
    write_csv,
    write_summary,
)
from fedhead.federation.tracking import check_log
from fedhead.infra.devices import resolve_device, set_cpu_threads
from fedhead.infra.errors import FedheadError, Interval, OneOf, param_error, unknown_name, validate
from fedhead.infra.files import atomic_path, atomic_torch_save, check_out
from fedhead.infra.locks import exclusive_writer
from fedhead.scratch.algorithms import ALGORITHMS, HEAD_SPLIT, create_algorithm
from fedhead.scratch.data import DATASETS, ScratchData, color_skew, grayscale_, load_dataset, subsample
from fedhead.scratch.models import MODELS, check_model_input, create_model, weight_layers


@dataclass
class ScratchConfig:
    algo: str  # fedavg | fedova | fedabc | dnc | local | fedprox | scaffold | fedper |
    # fedrep | fedrod | lg-fedavg
    dataset: str  # registered dataset name
    data_dir: str  # the dataset's folder
    model: str | None = None  # None: the algorithm/dataset default (DEFAULT_MODELS)
    partition: str | None = None  # None: the algorithm default (ALGO_DEFAULTS)
    partition_params: dict = field(default_factory=dict)  # e.g. {"alpha": 0.1}; None values = defaults
    clients: int | None = None  # K
    participation: float | None = None  # fraction of clients per round
    rounds: int | None = None  # T (D&C: rounds after the pre-pass)
    local_epochs: int | None = None  # E
    batch_size: int | None = None  # B
    optimizer: str | None = None  # sgd | adam
    lr: float | None = None
    momentum: float | None = None  # sgd only
    weight_decay: float | None = None
    seeds: list[int] = field(default_factory=lambda: [0])
    subset: int | None = None  # stratified training subset size (None = all)
    test_subset: int | None = None  # stratified test subset size (None = all)
    max_samples_per_client: int | None = None  # cap each client's local set after partitioning
    noise: str = "none"  # label noise kind (fedhead.core.noise)
    noise_rate: float = 0.0
    local_test_size: int | None = None  # PFL/drift local test set per client (0 = off)
    fedabc_margins: tuple | None = None  # (m_p, m_n, m_nn, gamma)
    skew: float = 0.95  # color-skew grayscale fraction of collaborator 1
    prepass_rounds: int = 5  # dnc: full-model FedAvg rounds before splitting
    split_layer: int | None = None  # dnc: layers 1..s learn features; None = from the divergence
    split_threshold: float = 0.5  # dnc: first layer above threshold x max divergence starts the top part
    divergence: str = "local-vs-global"  # dnc: or local-vs-local
    feature_epochs: int = 20  # dnc: local epochs of feature-learning rounds
    finetune_epochs: int = 4  # dnc: local epochs of fine-tuning rounds
    finetune_lr_factor: float = 0.5  # dnc: fine-tuning lr = factor x feature lr
    lr_decay: float = 0.9  # dnc: lr multiplied by this every round after the pre-pass
    share_fraction: float = 0.0  # data sharing (Zhao et al. 2018): |D_s| = round(beta x mean client size); 0 = off
    prox_mu: float | None = None  # fedprox: mu of (mu/2)||w - w_global||^2 (None: 0.01; other algorithms: unused)
    head_layers: int | None = None  # fedper / fedrep / lg-fedavg: the head = the last N weight layers (None: 1)
    body_epochs: int | None = None  # fedrep: the last N local epochs train the body, the others the head (None: 1)
    device: str = "auto"
    backend: str = "vectorized"  # vectorized (fast) | loop (reference, one member at a time); "vmap" = vectorized
    eval_batch: int = 1000
    plots: bool = True  # curves.png and partition.png in the run directory (fedhead.federation.outputs)
    log: str = "none"  # none | tensorboard | mlflow: the rows in a tracker too (fedhead.federation.tracking)
    log_dir: str | None = None  # the tracker's folder (default OUT/tensorboard | OUT/mlruns)


# algorithm defaults (SPEC sections 3-5); dataset-specific lr for FedABC
ALGO_DEFAULTS = {
    "fedavg": dict(
        partition="shard",
        partition_params={"shards_per_client": 2, "distinct_labels": True},
        clients=100,
        participation=0.2,
        rounds=50,
        local_epochs=5,
        batch_size=15,
        optimizer="adam",
        lr=1e-3,
        momentum=0.0,
        weight_decay=0.0,
        local_test_size=0,
    ),
    "fedova": dict(
        partition="shard",
        partition_params={"shards_per_client": 2, "distinct_labels": True},
        clients=100,
        participation=0.2,
        rounds=50,
        local_epochs=5,
        batch_size=15,
        optimizer="adam",
        lr=1e-3,
        momentum=0.0,
        weight_decay=0.0,
        local_test_size=0,
    ),
    "fedabc": dict(
        partition="dirichlet",
        partition_params={"alpha": 0.1},
        clients=20,
        participation=0.5,
        rounds=50,
        local_epochs=5,
        batch_size=64,
        optimizer="sgd",
        lr=None,
        momentum=0.9,
        weight_decay=1e-5,
        local_test_size=200,
    ),
    "dnc": dict(
        partition="color-skew",
        partition_params={},
        clients=2,
        participation=1.0,
        rounds=13,
        local_epochs=5,
        batch_size=64,
        optimizer="sgd",
        lr=1e-3,
        momentum=0.9,
        weight_decay=0.0,
        local_test_size=0,
    ),
}
FEDABC_BASELINES = ("local", "fedprox", "scaffold", "fedper", "fedrep", "fedrod", "lg-fedavg")
for _a in FEDABC_BASELINES:  # FedABC's comparison set runs at FedABC's protocol (SPEC section 3)
    ALGO_DEFAULTS[_a] = ALGO_DEFAULTS["fedabc"]
DEFAULT_MODELS = {  # (algo or "*", dataset) -> model
    ("*", "mnist"): "cnn",
    ("*", "fashion-mnist"): "cnn",
    ("*", "cifar10"): "fedabc-convnet",
    ("*", "speech-commands"): "kws-cnn",
    ("fedabc", "mnist"): "fedabc-mlp",
    ("fedabc", "fashion-mnist"): "fedabc-mlp",
    ("fedova", "cifar10"): "vgg11",
    ("dnc", "cifar10"): "vgg9",
    **{(a, d): "fedabc-mlp" for a in FEDABC_BASELINES for d in ("mnist", "fashion-mnist")},
}
PROX_MU_DEFAULT = 0.01  # FL-bench's FedProx default; the FedProx paper tries 0.001 - 1
FEDABC_MARGINS = {
    "cifar10": (0.85, 0.2, 0.3, 2.0),
    "mnist": (0.75, 0.25, 0.3, 2.0),
    "fashion-mnist": (0.75, 0.25, 0.3, 2.0),
}
FEDABC_LR = {"cifar10": 0.1, "mnist": 0.01, "fashion-mnist": 0.01}


def resolve_config(cfg: ScratchConfig) -> ScratchConfig:
    """Fill algorithm defaults for every None and validate every value (one-line errors)."""
    if cfg.algo not in ALGORITHMS:
        raise unknown_name("ALGO", cfg.algo, ALGORITHMS, "algorithm")

    if cfg.dataset not in DATASETS:
        raise unknown_name("--dataset", cfg.dataset, DATASETS, "dataset")
    c = _with_defaults(cfg)
    _check_training(c)
    _check_algo_options(c)
    _check_noise_seeds_partition(c)
    return c


def _with_defaults(cfg: ScratchConfig) -> ScratchConfig:
    """A copy of ``cfg`` with the algorithm's and dataset's defaults for every None, its model checked."""
    d = ALGO_DEFAULTS[cfg.algo]
    c = dataclasses.replace(cfg)
    for key, val in d.items():
        if key == "partition_params":
            continue
        if getattr(c, key) is None:
            setattr(c, key, val)
    if cfg.partition is None:
        c.partition_params = {
            **d["partition_params"],
            **{k: v for k, v in cfg.partition_params.items() if v is not None},
        }
    if c.lr is None:
        c.lr = FEDABC_LR.get(c.dataset, 0.01)
    if c.fedabc_margins is None:
        c.fedabc_margins = FEDABC_MARGINS.get(c.dataset, (0.8, 0.2, 0.3, 2.0))
    if c.model is None:
        c.model = DEFAULT_MODELS.get((c.algo, c.dataset), DEFAULT_MODELS.get(("*", c.dataset), "cnn"))
    if c.model not in MODELS:
        raise unknown_name("--model", c.model, MODELS, "model")
    return c


def _check_training(c: ScratchConfig) -> None:
    """Validate the training and D&C options shared by every algorithm (``--backend vmap`` renamed in place)."""
    validate("--clients", c.clients, Interval(1, None, integer=True))
    validate("--participation", c.participation, Interval(0, 1, closed="right"))
    validate("--rounds", c.rounds, Interval(1, None, integer=True))
    validate("--local-epochs", c.local_epochs, Interval(1, None, integer=True))
    validate("--batch-size", c.batch_size, Interval(1, None, integer=True))
    validate("--optimizer", c.optimizer, OneOf(("sgd", "adam")))
    validate("--lr", c.lr, Interval(0, None, closed="neither"))
    validate("--momentum", c.momentum, Interval(0, 1, closed="left"))
    validate("--weight-decay", c.weight_decay, Interval(0, None))
    for name, v in (
        ("--subset", c.subset),
        ("--test-subset", c.test_subset),
        ("--max-samples-per-client", c.max_samples_per_client),
    ):
        if v is not None:
            validate(name, v, Interval(1, None, integer=True))
    validate("--local-test-size", c.local_test_size, Interval(0, None, integer=True))
    validate("--prepass-rounds", c.prepass_rounds, Interval(0, None, integer=True))
    validate("--split-threshold", c.split_threshold, Interval(0, 1))
    validate("--divergence", c.divergence, OneOf(("local-vs-global", "local-vs-local")))
    validate("--feature-epochs", c.feature_epochs, Interval(1, None, integer=True))
    validate("--finetune-epochs", c.finetune_epochs, Interval(1, None, integer=True))
    c.backend = "vectorized" if c.backend == "vmap" else c.backend  # its earlier name, still accepted
    validate("--backend", c.backend, OneOf(("vectorized", "loop")))
    validate("--lr-decay", c.lr_decay, Interval(0, None, closed="neither"))
    validate("--finetune-lr-factor", c.finetune_lr_factor, Interval(0, None, closed="neither"))
    validate(
        "--share-fraction",
        c.share_fraction,
        Interval(0, 1),
        "Use a fraction of the mean client size in [0, 1], e.g. 0.05 (0 = no shared data).",
    )


def _check_algo_options(c: ScratchConfig) -> None:
    """Fill and validate the options of some algorithms only (FedProx, FedPer/FedRep/LG-FedAvg, SCAFFOLD, D&C)."""
    _algo_option(
        c,
        "--prox-mu",
        "prox_mu",
        ("fedprox",),
        PROX_MU_DEFAULT,
        Interval(0, None),
        "Use mu >= 0, e.g. 0.01 (0 is FedAvg).",
    )
    _algo_option(
        c,
        "--head-layers",
        "head_layers",
        HEAD_SPLIT,
        1,
        Interval(1, None, integer=True),
        "Use 1 (the last linear layer) or more, below the model's number of weight layers.",
    )
    _algo_option(
        c,
        "--body-epochs",
        "body_epochs",
        ("fedrep",),
        1,
        Interval(1, None, integer=True),
        "Use 1 or more, below --local-epochs.",
    )
    if c.algo == "fedrep" and c.body_epochs >= c.local_epochs:
        raise param_error(
            "--body-epochs",
            c.body_epochs,
            f"must be < --local-epochs ({c.local_epochs}) for fedrep (the other epochs train the head)",
            f"Use --body-epochs {max(1, c.local_epochs - 1)} with --local-epochs >= 2.",
        )
    if c.algo == "scaffold" and c.optimizer != "sgd":
        raise param_error(
            "--optimizer",
            c.optimizer,
            "must be 'sgd' for scaffold (option II divides the drift by steps x lr / (1 - momentum))",
            "Use --optimizer sgd.",
        )
    if c.split_layer is not None:  # the upper bound needs the model: check_data
        validate("--split-layer", c.split_layer, Interval(1, None, integer=True))
    elif c.algo == "dnc" and c.prepass_rounds == 0:
        raise FedheadError(
            "The '--split-layer' parameter is needed when --prepass-rounds is 0 (no divergence to "
            "choose from). Got None instead."
        )


def _check_noise_seeds_partition(c: ScratchConfig) -> None:
    """Validate the label noise and the seeds; resolve the partition's parameters into ``c.partition_params``."""
    if c.noise not in NOISE_KINDS:
        raise unknown_name("--noise", c.noise, NOISE_KINDS, "noise kind")
    validate("--noise-rate", c.noise_rate, Interval(0, 1, closed="left"))
    if c.noise != "none" and c.noise_rate == 0:
        raise FedheadError(f"The '--noise-rate' parameter must be > 0 with --noise {c.noise}. Got 0.0 instead.")
    if not c.seeds:
        raise FedheadError("The '--seed' parameter needs at least one value. Got [] instead.")
    for s in c.seeds:
        validate("--seeds", s, Interval(0, None, integer=True))
    if c.partition == "color-skew":
        validate("--skew", c.skew, Interval(0, 1))
        if c.clients != 2:
            raise param_error(
                "--clients", c.clients, "must be 2 with --partition color-skew", "Use --clients 2 (two collaborators)."
            )
        if c.partition_params and any(v is not None for v in c.partition_params.values()):
            raise FedheadError(
                "The '--partition' parameter color-skew takes only --skew. Got other partition options instead."
            )
        c.partition_params = {"skew": c.skew}
    else:
        c.partition_params = resolve_partition_params(c.partition, **c.partition_params)


def _algo_option(c: ScratchConfig, flag: str, field: str, algos: tuple, default, constraint, fix: str) -> None:
    """An option of some algorithms only: filled with ``default`` for them, validated; an error for the others."""
    value = getattr(c, field)
    if c.algo not in algos:
        if value is not None:
            raise param_error(
                flag, value, f"does not apply to {c.algo}", f"Drop {flag}, or use it with {' / '.join(algos)}."
            )
        return
    if value is None:
        setattr(c, field, default)
    validate(flag, getattr(c, field), constraint, fix)


def share_size(beta: float, sizes) -> int:
    """|D_s| = round(beta x |D_k|), |D_k| = the mean client size (after --max-samples-per-client)."""
    return int(round(beta * float(np.mean(sizes)))) if len(sizes) else 0


def _natural_per_seed(cfg: ScratchConfig, data: ScratchData) -> None:
    """--partition natural with --subset: every seed's subset must hold --clients natural clients (the subset is
    drawn per seed)."""
    if data.train_clients is None or cfg.partition != "natural" or not cfg.subset:
        return
    for seed in cfg.seeds[1:]:
        ids = data.clients_of(subsample(data.train_y, cfg.subset, np.random.default_rng(seed)))
        if int(ids.max()) + 1 != cfg.clients:
            raise param_error(
                "--subset",
                cfg.subset,
                f"holds {int(ids.max()) + 1} natural clients for seed {seed}, {cfg.clients} for seed {cfg.seeds[0]} "
                "(the subset is drawn per seed)",
                "Use one seed, or leave --subset out with --partition natural.",
            )


def check_data(cfg: ScratchConfig, data: ScratchData) -> None:
    """The checks of a resolved ``cfg`` that need the dataset, run before anything is written (the same steps
    as :func:`_setup` on the labels only, for the first seed): the clients against the training samples, the
    partition (e.g. --shards-per-client with --distinct-labels), the label-noise map, and --split-layer against
    the model's weight layers."""
    rng = np.random.default_rng(cfg.seeds[0])
    kept = subsample(data.train_y, cfg.subset, rng)
    y = data.train_y[kept]
    if cfg.clients > len(y):
        raise param_error(
            "--clients",
            cfg.clients,
            f"must be <= the number of training samples ({len(y)})",
            "Use fewer --clients" + (" or a larger --subset." if cfg.subset else "."),
        )
    if cfg.partition == "color-skew":
        if data.input_kind != "image" or data.in_shape[0] != 3:
            raise FedheadError(
                f"The '--partition' parameter color-skew needs an RGB image dataset. Got {cfg.dataset!r} instead."
            )
        sizes = [len(y) // 2, len(y) - len(y) // 2]
    else:
        parts = create_partition(
            cfg.partition, y, cfg.clients, seed=cfg.seeds[0], client_ids=data.clients_of(kept), **cfg.partition_params
        )
        sizes = [len(p) for p in parts]
        _natural_per_seed(cfg, data)
    if cfg.max_samples_per_client:
        sizes = [min(n, cfg.max_samples_per_client) for n in sizes]
    if cfg.share_fraction and share_size(cfg.share_fraction, sizes) < 1:
        raise param_error(
            "--share-fraction",
            cfg.share_fraction,
            f"gives an empty shared set (mean client size {np.mean(sizes):.1f} samples)",
            "Use a larger --share-fraction, or 0 for no sharing.",
        )
    if cfg.noise != "none":  # a dataset without an asymmetric map
        apply_noise(cfg.noise, cfg.noise_rate, [y[:1]], data.num_classes, dataset=cfg.dataset, seed=0)
    if (cfg.algo == "dnc" and cfg.split_layer is not None) or cfg.head_layers is not None:
        n_out = 1 if ALGORITHMS[cfg.algo].out_per_class else data.num_classes
        with torch.device("meta"):
            layers = len(weight_layers(create_model(cfg.model, data.in_shape, n_out)))
        if cfg.algo == "dnc" and not 1 <= cfg.split_layer < layers:
            raise FedheadError(
                f"The '--split-layer' parameter must be an integer in [1, {layers - 1}] for model "
                f"{cfg.model} ({layers} weight layers). Got {cfg.split_layer} instead."
            )
        if cfg.head_layers is not None and not 1 <= cfg.head_layers < layers:
            raise FedheadError(
                f"The '--head-layers' parameter must be an integer in [1, {layers - 1}] for model "
                f"{cfg.model} ({layers} weight layers; the body needs one). Got {cfg.head_layers} "
                f"instead."
            )


@dataclass
class Context:
    """Everything one seed's round loop needs (built once per seed by :func:`_setup`)."""

    cfg: ScratchConfig
    seed: int
    data: ScratchData
    model: torch.nn.Module
    layers: list[list[str]]
    parts: list[np.ndarray]  # per client: indices into x_train / y_train (device tensors)
    client_counts: np.ndarray  # [K, C]
    x_train: torch.Tensor
    y_train: torch.Tensor
    test_x: torch.Tensor
    test_y_cpu: torch.Tensor
    device: torch.device
    gen: torch.Generator
    rng: np.random.Generator
    log: Callable[[str], None]
    local_test: tuple | None = None  # (own-proportion sets [K, n], balanced sets [K, n]) test indices
    client_extra: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    share_bytes: int = 0  # bytes of the shared set D_s sent to one client (0 = no sharing)


def _local_test_sets(test_y: np.ndarray, counts: np.ndarray, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Per client, ``n`` test indices in the client's training class proportions, and ``n`` class-balanced."""
    c = counts.shape[1]
    by_class = [np.flatnonzero(test_y == j) for j in range(c)]

    def draw(props):
        want = np.floor(props * n).astype(int)
        want[np.argsort(-(props * n - want))[: n - want.sum()]] += 1
        out = []
        for j, w in enumerate(want):
            if w:
                pool = by_class[j]
                out.append(rng.choice(pool, size=w, replace=w > len(pool)))
        return np.concatenate(out)

    own = np.stack([draw(row / max(row.sum(), 1)) for row in counts])
    present = np.array([np.size(p) > 0 for p in by_class], dtype=float)
    bal = np.stack([draw(present / present.sum()) for _ in counts])
    return own, bal


def _setup(cfg: ScratchConfig, data: ScratchData, seed: int, device, log) -> Context:
    rng = np.random.default_rng(seed)
    tr = subsample(data.train_y, cfg.subset, rng)
    te = subsample(data.test_y, cfg.test_subset, rng)
    x_train = data.train_x[torch.from_numpy(tr)].clone()
    y_train = data.train_y[tr].copy()
    x_test = data.test_x[torch.from_numpy(te)].clone()
    y_test = data.test_y[te].copy()
    info = {"train_size": int(len(tr)), "test_size": int(len(te))}
    if cfg.partition == "color-skew":
        if data.input_kind != "image" or x_train.shape[1] != 3:
            raise FedheadError(
                f"The '--partition' parameter color-skew needs an RGB image dataset. Got {cfg.dataset!r} instead."
            )
        parts, gray_tr, gray_te = color_skew(y_train, cfg.clients, seed=seed, skew=cfg.skew, num_test=len(y_test))
        grayscale_(x_train, gray_tr)
        grayscale_(x_test, gray_te)
        info["gray_fraction_per_client"] = [float(np.isin(p, gray_tr).mean()) for p in parts]
        info["gray_fraction_test"] = float(len(gray_te) / max(len(y_test), 1))
    else:
        parts = create_partition(
            cfg.partition, y_train, cfg.clients, seed=seed, client_ids=data.clients_of(tr), **cfg.partition_params
        )
    if cfg.max_samples_per_client:
        parts = [
            np.sort(rng.choice(p, size=cfg.max_samples_per_client, replace=False))
            if len(p) > cfg.max_samples_per_client
            else p
            for p in parts
        ]
    shared = None
    if cfg.share_fraction:
        shared = draw_shared(len(y_train), [len(p) for p in parts], cfg.share_fraction, seed)
        shared_y = y_train[shared].copy()  # the server's labels: before any client's label noise
    if cfg.noise != "none":
        noisy, frac = apply_noise(
            cfg.noise, cfg.noise_rate, [y_train[p] for p in parts], data.num_classes, dataset=cfg.dataset, seed=seed
        )
        for p, yn in zip(parts, noisy):
            y_train[p] = yn
        info["noise_realised_fraction"] = frac
    counts = np.stack([np.bincount(y_train[p], minlength=data.num_classes) for p in parts])
    private_counts = counts
    share_bytes = 0
    if shared is not None:
        # D_s becomes rows N..N+S-1 of the training tensors (a copy with clean labels) and every client's local set
        # is its own samples followed by D_s
        first = len(y_train)
        x_train = torch.cat([x_train, x_train[torch.from_numpy(shared)]])
        y_train = np.concatenate([y_train, shared_y])
        rows = np.arange(first, first + len(shared))
        parts = [np.concatenate([p, rows]) for p in parts]
        counts = np.stack([np.bincount(y_train[p], minlength=data.num_classes) for p in parts])
        share_bytes = int(len(shared) * (x_train[0].numel() * x_train.element_size() + 8))
        info.update(
            share_size=int(len(shared)),
            share_bytes_per_client=share_bytes,
            share_class_counts=np.bincount(shared_y, minlength=data.num_classes).tolist(),
        )
    empty = [k for k, p in enumerate(parts) if len(p) == 0]
    if empty:
        log(
            f"warning: {len(empty)} client(s) have no training samples (e.g. client {empty[0]}); they train "
            f"nothing when selected."
        )
    algo_cls = ALGORITHMS[cfg.algo]
    n_out = 1 if algo_cls.out_per_class else data.num_classes
    model = algo_cls.wrap_model(create_model(cfg.model, data.in_shape, n_out)).to(device)
    if device.type == "cpu":
        pass  # buffer-free models; vmap'd convs run as grouped convs in the default layout
    gen = torch.Generator().manual_seed(seed)
    ctx = Context(
        cfg,
        seed,
        data,
        model,
        weight_layers(model),
        parts,
        counts,
        x_train.to(device),
        torch.from_numpy(y_train).to(device),
        x_test.to(device),
        torch.from_numpy(y_test),
        device,
        gen,
        rng,
        log,
        info=info,
        share_bytes=share_bytes,
    )
    if shared is not None:
        ctx.client_extra["private_size"] = [int(n) for n in private_counts.sum(1)]
    if cfg.local_test_size:  # FedABC's local test sets follow the client's own (private) class proportions
        ctx.local_test = _local_test_sets(y_test, private_counts, cfg.local_test_size, rng)
    return ctx


SHARE_KEY = 0x5AE7D5  # the shared set's generator: (seed, SHARE_KEY), apart from the run's other draws


def draw_shared(num_train: int, sizes, beta: float, seed: int) -> np.ndarray:
    """Zhao et al. 2018's shared set as FedOVA uses it: ``round(beta x mean client size)`` training indices drawn
    uniformly without replacement from the whole training set, once per seed with its own generator keyed by the
    seed (so turning sharing on leaves the partition, the client selection and the local test sets unchanged)."""
    n = share_size(beta, sizes)
    rng = np.random.default_rng([seed, SHARE_KEY])
    return np.sort(rng.choice(num_train, size=min(n, num_train), replace=False))


__all__ = ["CHECKPOINT", "PAUSE_ENV", "ScratchConfig", "ScratchJob", "resolve_config", "run_scratch"]


def identity_fields(cfg: ScratchConfig) -> dict:
    """Everything in the resolved configuration that determines the results (compared on --resume, each difference
    named); the device is left out (as ``fedhead train`` does) and the data folder is compared as an absolute
    path."""
    d = dataclasses.asdict(cfg)
    for key in ("device", "plots", "log", "log_dir"):  # where it runs and where its rows go besides rounds.csv
        d.pop(key, None)
    d["backend"] = "vmap" if d["backend"] == "vectorized" else d["backend"]  # its earlier name: runs keep identity
    for key, unset in (("share_fraction", 0.0), ("prox_mu", None), ("head_layers", None), ("body_epochs", None)):
        if d.get(key) == unset:  # options added later: at their defaults, a run keeps its earlier identity
            d.pop(key)
    d["data_dir"] = str(Path(cfg.data_dir).resolve())
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def _recorded_identity(record: dict) -> dict:
    """:func:`identity_fields` of the run a config.json describes (its data folder as recorded)."""
    names = {f.name for f in dataclasses.fields(ScratchConfig)}
    return identity_fields(ScratchConfig(**{k: v for k, v in record.items() if k in names}))


def config_identity(cfg: ScratchConfig) -> str:
    """The short hash of :func:`identity_fields` (config.json's ``identity``)."""
    return identity_hash(identity_fields(cfg))


@contextlib.contextmanager
def _keyed_torch_rng(seed: int, rnd: int, device: torch.device):
    """The global torch RNG inside a round: forked (restored afterwards) and seeded by (seed, round), so any
    random op of a model (dropout under ``vmap(randomness="different")``) is the same in a resumed run. The
    registered models have none; this keeps it so for new ones."""
    devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        key = int(np.random.SeedSequence([seed, rnd, 0x5C2A7C4]).generate_state(1, np.uint64)[0] >> 1)
        torch.manual_seed(key)
        yield


def _round(ctx: Context, algo, state, rnd: int, per_round: int):
    """One round: select, train, aggregate, evaluate; returns the new global state and the round's row."""
    cfg, device, seed = ctx.cfg, ctx.device, ctx.seed
    selected = np.sort(ctx.rng.choice(cfg.clients, size=per_round, replace=False))
    selected = np.array([k for k in selected if len(ctx.parts[k]) > 0], dtype=int)
    plan = algo.configure(ctx, state, rnd, selected) if len(selected) else None
    row = {"seed": seed, "round": rnd}
    if plan is None:
        row.update(
            stage="skipped", train_loss=float("nan"), client_ms=0.0, server_ms=0.0, bytes_up_per_client=0, bytes_total=0
        )
    else:
        t0 = time.perf_counter()
        trained = algo.train(ctx, plan)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        state = algo.aggregate(ctx, state, plan, trained)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        clients = np.unique(plan.owner)
        # bytes actually carried: what each member sends up, the same down (the algorithm's member_bytes)
        member_bytes = algo.member_bytes(ctx, plan, trained)
        up = {k: member_bytes * int((plan.owner == k).sum()) for k in clients}
        row.update(
            stage=plan.stage,
            train_loss=float(trained.loss.mean()),
            client_ms=(t1 - t0) * 1000 / len(clients),
            server_ms=(t2 - t1) * 1000,
            bytes_up_per_client=float(np.mean(list(up.values()))),
            bytes_total=2 * sum(up.values()),
            clients=len(clients),
            members=len(plan.owner),
            lr=plan.optim.lr,
            epochs=plan.epochs,
        )
        row.update(algo.after_round(ctx, state, plan, trained))
    if ctx.share_bytes:  # D_s goes to every client once, before round 1: counted once, in round 1
        row["bytes_shared_data"] = ctx.share_bytes * cfg.clients if rnd == 1 else 0
        row["bytes_total"] += row["bytes_shared_data"]
    pred = algo.predict(ctx, state, ctx.test_x).argmax(1).cpu()
    row["accuracy"] = float((pred == ctx.test_y_cpu).float().mean())
    return state, row


def _last_mean(values, n=5):
    v = [x for x in values if x is not None and not np.isnan(x)]
    return float(np.mean(v[-n:])) if v else float("nan")


# ---------------------------------------------------------------- the run: the one round loop over a ScratchJob


def save_torch(obj, path: Path) -> None:
    """``torch.save`` atomically; a failed write raises its OSError and leaves nothing behind."""

    atomic_torch_save(obj, path)


def check_config(cfg: ScratchConfig) -> tuple[ScratchConfig, ScratchData]:
    """Every check of a run that needs no output: the resolved configuration and its loaded dataset."""
    cfg = resolve_config(cfg)
    check_log(cfg.log, cfg.log_dir)
    data = load_dataset(cfg.dataset, cfg.data_dir)
    check_model_input(cfg.model, data.input_kind, cfg.dataset)
    check_data(cfg, data)
    return cfg, data


def run_scratch(
    cfg: ScratchConfig,
    out_dir: str | Path,
    log: Callable[[str], None] = lambda s: None,
    progress=None,
    resume: bool = False,
) -> dict:
    """Resolve, load, run (or, with ``resume``, continue) every seed through the one round loop
    (:func:`fedhead.federation.loop.run_job`), write the run directory; returns the summary. Everything is validated
    before anything is written; the run directory has one writer. ``progress``: show progress bars (any truthy
    value; the loop draws them on stderr)."""
    cfg, data = check_config(cfg)
    device = resolve_device(cfg.device)
    out_dir = check_out(out_dir, kind="dir")
    run = RunDir(out_dir, identity_fields(cfg), resume=resume, identity_of=_recorded_identity)
    with exclusive_writer(out_dir, f"the run directory {str(out_dir)!r}"), run.interrupted():
        opened = run.open()
        if opened.kind == "finished":
            return opened.summary  # a finished run: reported again
        threads = None
        if device.type == "cpu":  # the bits of a round follow the thread count: a continued run keeps its own
            threads = set_cpu_threads(opened.previous.get("cpu_threads") if opened.kind != "fresh" else None)
        job = ScratchJob(cfg, data, device, log, run, threads)
        with writing(run, out_dir / "config.json"):
            run.prepare({**job.base_config, "data_info": dict(data.info)}, opened)
        summary, _ = run_job(job, run, opened, progress=bool(progress))
    return summary


class ScratchJob(Job):
    """A scratch network trained by one of the registered algorithms (:mod:`fedhead.scratch.algorithms`), one unit
    per seed: the loop checkpoints the global model, the algorithm's own state (D&C's split, personal tensors,
    SCAFFOLD's variates) and the random state after every round."""

    def __init__(self, cfg: ScratchConfig, data: ScratchData, device, log, run: RunDir, threads: int | None):
        self.cfg, self.data, self.device, self.log, self.run = cfg, data, device, log, run
        self.rounds = cfg.rounds + (cfg.prepass_rounds if cfg.algo == "dnc" else 0)
        self.per_round = max(1, int(round(cfg.participation * cfg.clients)))
        self.base_config = {
            "command": "scratch",
            **dataclasses.asdict(cfg),
            "device_resolved": str(device),
            "cpu_threads": threads,
            "torch_version": torch.__version__,
            "num_classes": data.num_classes,
            "classes": data.classes,
            "in_shape": list(data.in_shape),
            "randomness": "numpy default_rng(seed) per seed, its state checkpointed after every round; "
            "init from torch.Generator(seed); global torch RNG keyed by (seed, round)",
            "bytes_accounting": "per round, each participating client downloads and uploads exactly the "
            "tensors it sends (fp32: the trained tensors; personalised algorithms only "
            "the shared ones, local none; SCAFFOLD also one control variate each way); "
            "bytes_total = down + up over clients; with --share-fraction, the shared "
            "set (uint8 pixels or float32 MFCCs, int64 labels) sent to every client "
            "once, counted in round 1 (bytes_shared_data)",
            "accuracy_of": ALGORITHMS[cfg.algo].accuracy_of,
        }

    def units(self) -> list[tuple]:
        return [(seed,) for seed in self.cfg.seeds]

    def label(self, unit: tuple) -> str:
        return f"{self.cfg.algo} seed {unit[0]}"

    def last_round(self, unit: tuple) -> int:
        return self.rounds

    def start(self, unit: tuple, saved: dict | None) -> tuple[int, list]:
        """The seed's deterministic setup, then its state: fresh, or the checkpoint's (the run continues after its
        round exactly as it would have)."""
        seed, device = unit[0], self.device
        self.ctx = _setup(self.cfg, self.data, seed, device, self.log)
        self.algo = create_algorithm(self.cfg.algo)
        self.algo.setup(self.ctx)
        if saved is None:
            self.state = {n: p.to(device) for n, p in self.algo.init(self.ctx).items()}
            return 1, []
        self.state = {n: p.to(device) for n, p in saved["state"].items()}
        self.algo.load_state_dict(saved["algo"])
        self.ctx.rng.bit_generator.state = saved["rng"]
        self.ctx.gen.set_state(saved["gen"])
        return int(saved["round"]) + 1, [dict(r) for r in saved["rows"]]

    def round(self, unit: tuple, rnd: int) -> dict:
        with _keyed_torch_rng(unit[0], rnd, self.device):
            self.state, row = _round(self.ctx, self.algo, self.state, rnd, self.per_round)
        return row

    def unit_state(self) -> dict:
        """The global model (CPU tensors), the algorithm's own state and the random state."""
        return {
            "state": {n: p.detach().cpu() for n, p in self.state.items()},
            "algo": self.algo.state_dict(),
            "rng": self.ctx.rng.bit_generator.state,
            "gen": self.ctx.gen.get_state(),
        }

    def progress_info(self, row: dict) -> str:
        extra = "".join(f" {k.split('_')[0]} {row[k]:.3f}" for k in ("pfl_accuracy", "drift_accuracy") if k in row)
        return f"acc {row['accuracy']:.3f}{extra} [{row['stage']}]"

    def finish_unit(self, unit: tuple, rows: list) -> tuple[list, dict]:
        """The seed's final global model into ``model-seed<S>.pt``; its client table and extras are kept."""
        ctx, seed = self.ctx, unit[0]
        path = self.run.path / f"model-seed{seed}.pt"
        with writing(self.run, path):
            save_torch({n: p.detach().cpu() for n, p in self.algo.export(self.state).items()}, path)
        kept = {"counts": ctx.client_counts, "sizes": np.array([len(p) for p in ctx.parts]),
                "client_extra": ctx.client_extra, "info": ctx.info, "layers": ctx.layers}  # fmt: skip
        if self.cfg.algo == "dnc":
            kept["divergence"] = self.algo.div_rows
            kept["split_layer"] = self.algo.split
        return [], kept

    def finish(self, run: RunDir, done: list, rows: list, wall_s: float) -> dict:
        return _finish(self.cfg, self.data, run, self.base_config, done, wall_s)

    def report(self, done: list, summary: dict) -> RunReport:
        """The plots' and trackers' data: the first seed's label counts per client, the configuration."""
        cfg = self.cfg
        return RunReport(
            plots=cfg.plots,
            log=cfg.log,
            log_dir=cfg.log_dir,
            title=f"{cfg.algo} on {cfg.dataset}, {cfg.partition}, {cfg.clients} clients",
            counts=np.asarray(done[0]["counts"]),
            labels=list(self.data.classes),
            seed=cfg.seeds[0] if len(cfg.seeds) > 1 else None,
            params=identity_fields(cfg),
        )


def _finish(
    cfg: ScratchConfig, data: ScratchData, run: RunDir, base_config: dict, results: list[dict], wall: float
) -> dict:
    """The final files: config.json (with what the runs found), clients.csv, summary.json and, for D&C,
    divergence.csv/png (rounds.csv is the loop's)."""
    out_dir = run.path
    first = results[0]
    config = {
        **base_config,
        "data_info": {**data.info, **first["info"]},
        "weight_layers": [names[0].rsplit(".", 1)[0] for names in first["layers"]],
    }
    if cfg.algo == "dnc":
        config["split_layer_used"] = [r["split_layer"] for r in results]
    with writing(run, out_dir / "config.json"):
        run.rewrite_config(config)
    with writing(run, out_dir / "clients.csv"):
        write_clients(out_dir, first["sizes"], first["counts"], first["client_extra"] or None)
    summary = {"algo": cfg.algo, "dataset": cfg.dataset, "model": cfg.model, "wall_seconds": wall, "seeds": cfg.seeds}
    per_seed = [_seed_summary(cfg, seed, res) for seed, res in zip(cfg.seeds, results)]
    summary["per_seed"] = per_seed
    for key in ("final_accuracy", "last5_accuracy", "last5_pfl_accuracy", "last5_drift_accuracy",
                "last5_generic_accuracy"):  # fmt: skip
        if key in per_seed[0]:
            m, sd = mean_std([s[key] for s in per_seed])
            summary[key] = m
            summary[f"{key}_std"] = sd
    summary["bytes_total"] = float(np.mean([s["bytes_total"] for s in per_seed]))
    if cfg.algo == "dnc":
        summary.update(_divergence_files(cfg, run, results, per_seed))
    with writing(run, out_dir / "summary.json"):
        write_summary(out_dir, summary)
    return summary


def _seed_summary(cfg: ScratchConfig, seed: int, res: dict) -> dict:
    acc = [r["accuracy"] for r in res["rows"]]
    s = {
        "seed": seed,
        "final_accuracy": acc[-1],
        "last5_accuracy": _last_mean(acc),
        "acc95_round": acc95_round(acc),
        "bytes_total": int(sum(r["bytes_total"] for r in res["rows"])),
    }
    if cfg.share_fraction:
        s["bytes_shared_data"] = int(sum(r.get("bytes_shared_data", 0) for r in res["rows"]))
    for key in ("pfl_accuracy", "drift_accuracy", "generic_accuracy"):
        vals = [r.get(key) for r in res["rows"] if key in r]
        if vals:
            s[f"last5_{key}"] = _last_mean(vals)
    if cfg.algo == "dnc":
        s["split_layer"] = res["split_layer"]
        s["bytes_prepass"] = int(sum(r["bytes_total"] for r in res["rows"] if r["stage"] == "prepass"))
        s["bytes_after_prepass"] = s["bytes_total"] - s["bytes_prepass"]
    return s


def _divergence_files(cfg: ScratchConfig, run: RunDir, results: list[dict], per_seed: list[dict]) -> dict:
    """D&C's pre-pass divergences: divergence.csv and its plot; the summary's split and last divergences."""
    out_dir = run.path
    div = [r for res in results for r in res["divergence"]]
    with writing(run, out_dir / "divergence.csv"):
        write_csv(out_dir / "divergence.csv", div, ["seed", "round", "layer", "name", "divergence"])
    if div:
        with writing(run, out_dir / "divergence.png"):
            _plot_divergence(div, out_dir / "divergence.png", [r["split_layer"] for r in results][0])
    last = max((x["round"] for x in div), default=None)
    return {
        "split_layer": per_seed[0]["split_layer"],
        "divergence_last_prepass": [r["divergence"] for r in div if r["seed"] == cfg.seeds[0] and r["round"] == last],
    }


def _plot_divergence(rows: list[dict], path: Path, split: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = rows[0]["seed"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for rnd in sorted({r["round"] for r in rows if r["seed"] == seed}):
        pts = [(r["layer"], r["divergence"]) for r in rows if r["seed"] == seed and r["round"] == rnd]
        ax.plot(*zip(*pts), marker="o", label=f"pre-pass round {rnd}")
    if split:
        ax.axvline(split + 0.5, color="k", ls="--", lw=1, label=f"split after L{split}")
    ax.set_xlabel("weight layer")
    ax.set_ylabel("1 - cos(local, global)")
    ax.set_title("Layer-wise weight divergence (D&C pre-pass)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
