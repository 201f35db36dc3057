"""The entry points of ``fedhead train`` and :func:`fedhead.run`: validate a configuration against its store, then
run it through the one round loop (:func:`fedhead.federation.loop.run_job`) as a
:class:`fedhead.federation.job.HeadJob` over the in-process transport, in a run directory with one writer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from extract.store import Features, StoreInfo, load_store, open_store, store_content_hash
from fedhead.core.aggregate import aggregator_names, create_aggregator
from fedhead.core.closedform import closed_form_names, is_closed_form
from fedhead.core.compress import CompressedFedAvg
from fedhead.core.engine import OptimConfig
from fedhead.core.heads import create_head, resolve_head_params
from fedhead.core.noise import apply_noise
from fedhead.core.partitions import PARTITIONS, create_partition, resolve_partition_params
from fedhead.federation.clients import noise_dataset_name
from fedhead.federation.config import RECIPES, TrainConfig
from fedhead.federation.inprocess import InProcessTransport
from fedhead.federation.job import HeadJob
from fedhead.federation.loop import PAUSE_ENV, run_job, writing
from fedhead.federation.rundir import CHECKPOINT, RunDir, default_run_dir, write_experiment
from fedhead.federation.server import server_opt_config
from fedhead.federation.tracking import require as require_tracker
from fedhead.infra.devices import resolve_device, set_cpu_threads
from fedhead.infra.errors import FedheadError, unknown_name
from fedhead.infra.files import check_out
from fedhead.infra.locks import exclusive_writer

__all__ = ["CHECKPOINT", "PAUSE_ENV", "RunResult", "run_training", "validate_config"]

RANDOMNESS = "numpy default_rng keyed by (seed, round[, client, epoch]); no global seeding"


@dataclass
class RunResult:
    """What :func:`fedhead.run` returns: the run directory, ``summary`` (summary.json) and ``rows`` (rounds.csv, one
    dict per evaluated round)."""

    run_dir: Path
    summary: dict
    rows: list[dict]


def validate_config(cfg: TrainConfig, store: Features) -> TrainConfig:
    """Resolve and validate everything before anything is written."""
    cfg = cfg.resolved()
    resolve_device(cfg.device)  # --device cuda without a GPU: refused before anything is written
    resolve_head_params(cfg.head, **cfg.head_params)
    resolve_partition_params(cfg.partition, **cfg.partition_params)
    validate_method(cfg)
    require_tracker(cfg.log)  # a missing extra stops the run before it starts, not after its last round
    n = len(store.train_y)
    if cfg.clients > n:
        raise FedheadError(
            f"The '--clients' parameter must be <= the number of training samples ({n}). "
            f"Got {cfg.clients} instead. Use fewer clients."
        )
    OptimConfig(name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    if not PARTITIONS[cfg.partition].needs_features:  # cheap: catches shard/dirichlet errors before writing
        create_partition(
            cfg.partition,
            store.train_y,
            cfg.clients,
            seed=cfg.seeds[0],
            client_ids=store.train_clients,
            **cfg.partition_params,
        )
    if cfg.noise != "none":  # catches a missing asymmetric map before the run starts
        apply_noise(
            cfg.noise,
            cfg.noise_rate,
            [store.train_y[:1]],
            store.info.num_classes,
            dataset=noise_dataset_name(store, cfg),
            seed=0,
            asym_rule=cfg.asym_map,
        )
    return cfg


def _validated(cfg: TrainConfig, store: Features | None) -> tuple[TrainConfig, Features]:
    """:func:`validate_config` and the store. Without ``store`` the configuration is validated on the training labels
    alone before the features are read, so a partition that cannot be drawn is refused in a second, not after
    loading a large store."""
    if store is not None:
        return validate_config(cfg, store), store
    info = open_store(cfg.features)
    with h5py.File(info.path, "r") as f:
        y = np.asarray(f["train"]["labels"][()], dtype=np.int64)
        clients = np.asarray(f["train"]["clients"][()], dtype=np.int64) if info.client_names else None
    if y.size and (y.min() < 0 or y.max() >= info.num_classes):  # load_store refuses them, naming the store's rows
        store = load_store(cfg.features)
        return validate_config(cfg, store), store
    cfg = validate_config(cfg, labels_store(y, info.class_names, info.dataset, clients))
    return cfg, load_store(cfg.features)


def labels_store(
    train_y: np.ndarray, class_names: list[str], dataset: str = "", train_clients: np.ndarray | None = None
) -> Features:
    """A stand-in store that holds only training labels (and natural client ids, if any; no features, no test
    split): enough for :func:`validate_config` before the real store exists (``fedhead demo`` and ``fedhead bench
    flower`` validate their runs before the slow or written part)."""
    y = np.asarray(train_y, dtype=np.int64)
    info = StoreInfo(path=Path(""), attrs={"dataset": dataset}, shapes={}, class_names=list(class_names))
    return Features(
        info=info,
        train_x=np.zeros((len(y), 0), np.float32),
        train_y=y,
        test_x=np.zeros((0, 0), np.float32),
        test_y=np.zeros(0, np.int64),
        train_clients=train_clients,
    )


def _secure_statistics(cfg: TrainConfig, name: str) -> None:
    """Secure aggregation's fixed layout carries raw class sums and the Gram only: refuse the rest in one line."""
    head = create_head(name, **cfg.head_params)
    if cfg.secure_aggregation and (head.needs_second or head.stats_map(1) is not None):
        raise FedheadError(
            f"The '--secure-aggregation' option does not carry the statistics of {name!r} yet (per-class second "
            "moments, random features or a --stats-sketch). Drop it, or use ncm, ridge, lda or cof unsketched."
        )


def validate_method(cfg: TrainConfig) -> None:
    """The method options (closed form, --init, FedProx, SCAFFOLD, server optimiser, CCVR) against the head;
    a closed-form head needs no feature centring (its statistics carry the means), so it is switched off."""
    if is_closed_form(cfg.head) and cfg.init is not None and cfg.init == RECIPES[cfg.recipe].get("init"):
        cfg.init = None  # the recipe's closed-form start does not apply to a closed-form head
    if is_closed_form(cfg.head):
        for flag, given in (
            ("--init", cfg.init),
            ("--prox-mu", cfg.prox_mu),
            ("--scaffold", cfg.scaffold),
            ("--server-opt", cfg.server_opt != "fedavg" and cfg.server_opt),
            ("--calibrate", cfg.calibrate != "none" and cfg.calibrate),
        ):
            if given:
                raise FedheadError(
                    f"The '{flag}' parameter does not apply to the closed-form head {cfg.head!r} "
                    f"(solved once from statistics, no local training). Got {given!r} instead. "
                    "Drop it, or choose an iterative head (softmax, ova, ova2, ...)."
                )
        cfg.center, cfg.scale = False, "none"
        _secure_statistics(cfg, cfg.head)
    if cfg.secure_aggregation and not is_closed_form(cfg.head) and cfg.aggregate in aggregator_names():
        if not create_aggregator(cfg.aggregate).summable:
            raise FedheadError(
                f"The '--aggregate' parameter {cfg.aggregate} cannot be combined with --secure-aggregation: the rule "
                "needs every client's update, and SecAgg+ releases only their sum. Got --aggregate "
                f"{cfg.aggregate} with --secure-aggregation. Drop one of them."
            )
        if isinstance(create_aggregator(cfg.aggregate), CompressedFedAvg):
            raise FedheadError(
                f"The '--aggregate' parameter {cfg.aggregate} cannot be combined with --secure-aggregation: SecAgg+ "
                "sums dense vectors of field elements, so a compressed update would travel dense (no bytes saved). "
                f"Got --aggregate {cfg.aggregate} with --secure-aggregation. Drop one of them."
            )
    if cfg.scaffold and cfg.optimizer != "sgd":
        raise FedheadError(
            f"The '--scaffold' option needs --optimizer sgd: its control variates estimate each "
            f"client's mean gradient from SGD steps. Got --optimizer {cfg.optimizer!r} instead. "
            "Use --optimizer sgd (the default recipe)."
        )
    if cfg.init is not None and not is_closed_form(cfg.init):
        raise unknown_name("--init", cfg.init, closed_form_names(), "closed-form head")
    if cfg.init is not None and not create_head(cfg.init, **cfg.head_params).init_capable:
        able = ", ".join(n for n in closed_form_names() if create_head(n).init_capable)
        raise FedheadError(
            f"The '--init' parameter {cfg.init!r} is no linear head on raw features that an iterative head can start "
            f"from. Use one of {able}."
        )
    if cfg.init is not None:
        resolve_head_params(cfg.init, **cfg.head_params)
        _secure_statistics(cfg, cfg.init)
    if cfg.server_opt != "fedavg" or any(
        v is not None for v in (cfg.server_lr, cfg.server_momentum, cfg.server_betas, cfg.server_tau)
    ):
        server_opt_config(cfg)


# where a run runs and where its rows go besides rounds.csv, not what it finds
NOT_IDENTITY = ("features", "device", "block_clients", "memory_budget_mb", "dual", "plots", "log", "log_dir")
# fields added after runs were written: left out of the identity while unset, so those runs keep theirs
UNSET_NOT_IDENTITY = ("topk_fraction", "error_feedback", "trim_fraction", "norm_bound")


def identity_fields(cfg: TrainConfig, store: Features) -> dict:
    """The settings that determine a run's results (a resume compares them and names each difference): the
    resolved configuration without where it runs (device, block size, memory budget) and with the feature store
    named by its content, so that the same file under another path is the same run."""
    d = {k: v for k, v in cfg.to_dict().items() if k not in NOT_IDENTITY}
    d = {k: v for k, v in d.items() if not (k in UNSET_NOT_IDENTITY and v is None)}
    d["store_sha256"] = store_content_hash(store)
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def recorded_identity(record: dict) -> dict:
    """:func:`identity_fields` of the run a config.json (written by :func:`run_record`) describes."""
    d = {k: v for k, v in record["config"].items() if k not in NOT_IDENTITY}
    d = {k: v for k, v in d.items() if not (k in UNSET_NOT_IDENTITY and v is None)}
    d["store_sha256"] = record["store"]["content_sha256"]
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def head_run_dir(cfg: TrainConfig, store: Features, path: Path, resume: bool, **kw) -> RunDir:
    """The run directory of a head run (train, bench, Flower): its identity, and how an earlier fedhead named it."""
    return RunDir(path, identity_fields(cfg, store), resume=resume, legacy=(cfg.identity(),),
                  identity_of=recorded_identity, **kw)  # fmt: skip


def run_record(cfg: TrainConfig, store: Features, device, runtime: str = "simulation") -> dict:
    """config.json's content besides the identity: the resolved configuration, the parameters the head and the
    partition resolved to, the store's metadata, where it runs."""
    import torch

    return {
        "config": cfg.to_dict(),
        "head_params": resolve_head_params(cfg.head, **cfg.head_params),
        "partition_params": resolve_partition_params(cfg.partition, **cfg.partition_params),
        "store": {
            "path": str(store.info.path),
            **store.info.attrs,
            "content_sha256": store_content_hash(store),
            "shapes": {k: list(v) for k, v in store.info.shapes.items()},
        },  # fmt: skip
        "device": str(device),
        "runtime": runtime,
        "torch_version": torch.__version__,
        "randomness": RANDOMNESS,
    }


def run_training(
    cfg: TrainConfig,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    store: Features | None = None,
    runs_root: str = "runs",
    central_cache: dict | None = None,
) -> RunResult:
    """Run, resume or extend ``cfg`` into ``out``. ``central_cache``: a dict shared by several runs (a bench report)
    that keeps each centralised ceiling, computed once per head, feature preparation and training labels."""
    cfg, store = _validated(cfg, store)
    run_dir = Path(out) if out else default_run_dir(runs_root, cfg.head, cfg.partition)
    check_out(run_dir, kind="dir")  # a file there, or below a file: one line, nothing written
    device = resolve_device(cfg.device)
    run = head_run_dir(cfg, store, run_dir, resume, extendable=None if is_closed_form(cfg.head) else "rounds")
    with exclusive_writer(run_dir, f"the run directory {str(run_dir)!r}"), run.interrupted():
        opened = run.open()
        if opened.kind == "finished":  # reported again
            return RunResult(run_dir, opened.summary, opened.rows)
        threads = None
        if device.type == "cpu":  # the bits of a round follow the thread count: a continued run keeps its own
            threads = set_cpu_threads(opened.previous.get("cpu_threads") if opened.kind != "fresh" else None)
        with writing(run, run_dir / "config.json"):
            run.prepare({**run_record(cfg, store, device), "cpu_threads": threads}, opened)
            write_experiment(run_dir, cfg)  # config.toml: fedhead train --config RUN/config.toml repeats the run
        job = HeadJob(cfg, store, InProcessTransport(cfg, store, device, central_cache))
        summary, rows = run_job(job, run, opened, progress=progress)
    return RunResult(run_dir, summary, rows)
