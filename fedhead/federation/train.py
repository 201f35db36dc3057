"""The entry points of ``fedhead train`` and :func:`fedhead.run`: validate a configuration against its store, then
run it through the one round loop (:func:`fedhead.federation.loop.run_job`) as a
:class:`fedhead.federation.job.HeadJob` over the in-process transport, in a run directory with one writer."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import h5py
import numpy as np

from extract.arrays import keep_store
from extract.store import Features, StoreInfo, load_store, open_store, store_content_hash
from fedhead.core.closedform import check_moments_size, is_closed_form
from fedhead.core.heads import create_head, resolve_head_params
from fedhead.core.noise import apply_noise
from fedhead.core.partitions import create_partition, partition_spec, resolve_partition_params
from fedhead.federation.clients import noise_dataset_name
from fedhead.federation.config import TrainConfig, check_method
from fedhead.federation.experiment import NOT_IDENTITY, flag_of
from fedhead.federation.inprocess import InProcessTransport
from fedhead.federation.job import HeadJob
from fedhead.federation.loop import PAUSE_ENV, run_job, writing
from fedhead.federation.rundir import CHECKPOINT, Opened, RunDir, default_run_dir, write_experiment
from fedhead.federation.tracking import require as require_tracker
from fedhead.federation.transport import Transport
from fedhead.infra.devices import resolve_device, set_cpu_threads
from fedhead.infra.errors import FedheadError, on_cli
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
    """Resolve and validate everything before anything is written: the configuration (:meth:`TrainConfig.resolved`),
    then what depends on this machine and on the store (device, tracker, clients, partitions for every seed,
    the feature dimension, the noise map)."""
    cfg = cfg.resolved()  # every check of the configuration alone (fedhead.federation.config)
    resolve_device(cfg.device)  # --device cuda without a GPU: refused before anything is written
    require_tracker(cfg.log)  # a missing extra stops the run before it starts, not after its last round
    n = len(store.train_y)
    if cfg.clients > n:
        raise FedheadError(
            f"The '--clients' parameter must be <= the number of training samples ({n}). "
            f"Got {cfg.clients} instead. Use fewer clients."
        )
    if not partition_spec(cfg.partition).needs_features:  # cheap: a draw no seed can meet is refused before writing
        for seed in cfg.seeds:
            create_partition(
                cfg.partition,
                store.train_y,
                cfg.clients,
                seed=seed,
                client_ids=store.train_clients,
                **cfg.partition_params,
            )
    check_dimensions(cfg, store.info.num_classes, feature_dim(store))
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


def feature_dim(store: Features) -> int:
    """The store's feature dimension (a stand-in store of :func:`labels_store` records it without features)."""
    return feature_dim_of(store.info) or int(store.train_x.shape[1])


def check_dimensions(cfg: TrainConfig, num_classes: int, dim: int) -> None:
    """What the feature dimension decides before anything runs: a ``--stats-sketch`` must shrink the statistics
    (below ``dim``), and per-class second moments must fit this machine's memory."""
    if not dim:
        return
    for name in {cfg.head, cfg.init} - {None}:
        head = create_head(name, **cfg.head_params)
        r = int(head.params.get("stats_sketch", 0) or 0)
        if r >= dim:
            raise FedheadError(
                f"The '--stats-sketch' parameter must be below the feature dimension ({dim}): a sketch to {r} "
                f"dimensions sends more than the raw statistics and saves nothing. Got {r} instead. Use "
                f"--stats-sketch {max(1, dim // 4)} (or lower), or 0 for no sketch."
            )
        if getattr(head, "needs_second", False):
            check_moments_size(num_classes, r or dim)


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
    cfg = validate_config(cfg, labels_store(y, info.class_names, info.dataset, clients, dim=feature_dim_of(info)))
    return cfg, load_store(cfg.features)


def feature_dim_of(info: StoreInfo) -> int:
    """The feature dimension the store's metadata records (0 when it records none)."""
    shape = info.shapes.get("train/features")
    return int(shape[1]) if shape is not None and len(shape) == 2 else 0


def labels_store(
    train_y: np.ndarray,
    class_names: list[str],
    dataset: str = "",
    train_clients: np.ndarray | None = None,
    dim: int = 0,
) -> Features:
    """A stand-in store that holds only training labels (and natural client ids, if any; no features, no test
    split): enough for :func:`validate_config` before the real store exists (``fedhead demo`` and ``fedhead bench
    flower`` validate their runs before the slow or written part). ``dim``: the features' dimension, if known."""
    y = np.asarray(train_y, dtype=np.int64)
    shapes = {"train/features": (len(y), int(dim))} if dim else {}
    info = StoreInfo(path=Path(""), attrs={"dataset": dataset}, shapes=shapes, class_names=list(class_names))
    return Features(
        info=info,
        train_x=np.zeros((len(y), 0), np.float32),
        train_y=y,
        test_x=np.zeros((0, 0), np.float32),
        test_y=np.zeros(0, np.int64),
        train_clients=train_clients,
    )


def validate_method(cfg: TrainConfig) -> None:
    """Kept for callers of earlier versions: :meth:`TrainConfig.resolved` checks the method options now (one
    validation, at the boundary); this checks them again on an already resolved configuration."""
    check_method(cfg)


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


def setting_flag(name: str) -> str:
    """How a resume refusal names a differing setting of a head run: its flag on the command line (``--min-size``),
    its field in Python (``min_size``)."""
    if name == "store_sha256":
        return "the feature store's content (sha256)"
    return flag_of(name) if on_cli() else name


def head_run_dir(cfg: TrainConfig, store: Features, path: Path, resume: bool, **kw) -> RunDir:
    """The run directory of a head run (train, bench, Flower): its identity, and how an earlier fedhead named it."""
    return RunDir(path, identity_fields(cfg, store), resume=resume, legacy=(cfg.identity(),),
                  identity_of=recorded_identity, setting_name=setting_flag, **kw)  # fmt: skip


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
    overwrite: bool = False,
    store_file: str | None = None,
) -> RunResult:
    """Run, resume or extend ``cfg`` into ``out`` (``overwrite``: replace the run there). ``central_cache``: a dict
    shared by several runs (a bench report) that keeps each centralised ceiling, computed once per head, feature
    preparation and training labels. ``store_file``: ``store`` exists only in memory (``fedhead.run(features=
    arrays)``) and is written into the run directory under this name (float32, its content hash unchanged), which
    config.toml and config.json then name, so that the run can be resumed and its model reloaded."""
    cfg, store = _validated(cfg, store)
    if Path(cfg.features).is_file():  # config.toml and config.json name the store wherever the run is resumed from
        cfg.features = str(Path(cfg.features).resolve())
    if out is not None:
        check_out(Path(out), kind="dir")  # a file there, or below a file: one line, nothing written
    run_dir = Path(out) if out else default_run_dir(runs_root, cfg.head, cfg.partition)
    held = None
    if store_file is not None:
        held = store
        cfg.features = str((run_dir / store_file).resolve())
        store = dataclasses.replace(store, info=dataclasses.replace(store.info, path=Path(cfg.features)))
    device = resolve_device(cfg.device)
    run = head_run_dir(cfg, store, run_dir, resume, extendable=None if is_closed_form(cfg.head) else "rounds",
                       overwrite=overwrite, overwrite_param="--overwrite")  # fmt: skip

    def record(opened: Opened) -> dict:
        threads = None
        if device.type == "cpu":  # the bits of a round follow the thread count: a continued run keeps its own
            threads = set_cpu_threads(opened.previous.get("cpu_threads") if opened.kind != "fresh" else None)
        return {**run_record(cfg, store, device), "cpu_threads": threads}

    with exclusive_writer(run_dir, f"the run directory {str(run_dir)!r}"), run.interrupted(), run.failed():
        transport = InProcessTransport(cfg, store, device, central_cache)
        saved = None if held is None else (lambda: keep_store(held, Path(cfg.features)))
        summary, rows = run_head(cfg, store, transport, run, record, progress=progress, prepared=saved)
    return RunResult(run_dir, summary, rows)


def run_head(
    cfg: TrainConfig,
    store: Features,
    transport: Transport,
    run: RunDir,
    record: Callable[[Opened], dict],
    *,
    progress: bool = True,
    prepared: Callable[[], None] | None = None,
) -> tuple[dict, list[dict]]:
    """The one entry of a head run over any transport (``fedhead train`` and the bench grids in process, the Flower
    server over its grid): open the run directory (a finished run is reported again), write config.json with
    ``record(opened)`` and config.toml, and run :class:`HeadJob` through the round loop. Returns the summary and
    the rows. ``prepared``: called once the directory is prepared, before config.toml (what the run directory must
    hold besides, e.g. the store of in-memory features)."""
    opened = run.open()
    if opened.kind == "finished":
        return opened.summary, opened.rows
    with writing(run, run.path / "config.json"):
        run.prepare(record(opened), opened)
    if prepared is not None:
        with writing(run, run.path):
            prepared()
    with writing(run, run.path / "config.toml"):
        write_experiment(run.path, cfg)  # config.toml: fedhead train --config RUN/config.toml repeats the run
    return run_job(HeadJob(cfg, store, transport), run, opened, progress=progress)
