"""``fedhead.run``: one training run from Python, described the way every other surface describes it (a
:class:`~fedhead.federation.config.TrainConfig`, its fields as keywords, or an experiment file)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from extract.arrays import FeatureStore
from extract.store import Features
from fedhead.federation.config import TrainConfig, load_experiment
from fedhead.federation.experiment import check_transport, python_api
from fedhead.federation.train import RunResult, run_training
from fedhead.infra.errors import FedheadError


@python_api
def run(
    cfg: TrainConfig | None = None,
    out: str | Path | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = False,
    store: Features | None = None,
    config: str | Path | None = None,
    **fields,
) -> RunResult:
    """Run one experiment into ``out`` (default ``runs/<stamp>-<head>-<partition>``) and return its
    :class:`~fedhead.federation.train.RunResult` (``summary``: summary.json; ``rows``: rounds.csv).

    The experiment is ``cfg``, or the TrainConfig fields given as keywords (``run(features="s.h5", head="ova2",
    partition="dirichlet", alpha=0.1, rounds=20)``: the names of ``fedhead train``'s flags with ``_`` for ``-``),
    or the experiment file ``config`` with those keywords on top (as flags override ``--config``). Bad input raises
    :class:`~fedhead.infra.errors.FedheadError`, one line naming the field (``The 'lr' parameter must be ...``).

    ``features`` may also be features in memory: ``(X, y, X_test, y_test)`` (checked and held as
    :meth:`FeatureStore.from_arrays <extract.arrays.FeatureStore.from_arrays>` does) or a
    :class:`~extract.arrays.FeatureStore`. Such a run is the run on the store written from the same arrays (the
    same results), and it writes that store into its run directory as ``features.h5`` (:data:`RUN_STORE`), which
    its config.toml names: ``run(out=DIR, resume=True)`` continues it and ``load_model(DIR)`` reads it like any other.

    ``run(out=DIR, resume=True)`` alone continues the run in ``DIR`` from its own config.toml; ``overwrite=True``
    replaces the run in ``out`` (a finished one, or what a failed run left) instead of refusing the folder."""
    store_file = None
    if fields.get("features") is not None and not isinstance(fields["features"], (str, os.PathLike)):
        if store is not None:
            raise TypeError("fedhead.run() takes features in memory (features=...) or store=..., not both")
        store, fields["features"] = in_memory_features(fields["features"])
        store_file = RUN_STORE if isinstance(store, FeatureStore) and store.in_memory else None
    if cfg is None and not fields and config is None and resume and out is not None:
        config = run_experiment_file(out, "out")
    if cfg is None:
        cfg = TrainConfig(**{**(load_experiment(config) if config is not None else {}), **fields})
    elif fields or config is not None:
        raise TypeError("fedhead.run() takes a TrainConfig or its fields (or config=FILE), not both")
    check_transport(cfg, "in-process")
    return run_training(cfg, out=out, resume=resume, overwrite=overwrite, progress=progress, store=store,
                        store_file=store_file)  # fmt: skip


RUN_STORE = "features.h5"  # the store a run on in-memory features writes into its run directory


def in_memory_features(value: Any) -> tuple[Features, str]:
    """``run(features=value)`` for a value that is not a path: the store and what the configuration's ``features``
    names. A store read from a file keeps its path; arrays ``(X, y, X_test, y_test)`` and stores made in memory are
    checked (:meth:`FeatureStore.from_arrays <extract.arrays.FeatureStore.from_arrays>`) and named by the file
    the run will write (:data:`RUN_STORE`)."""
    if isinstance(value, Features):
        path = Path(str(value.info.path))
        if str(value.info.path) and path.is_file():
            return value, str(path)
        if not isinstance(value, FeatureStore):  # a Features made by hand: checked as arrays are
            clients = value.train_clients
            value = FeatureStore.from_arrays(
                value.train_x, value.train_y, value.test_x, value.test_y, class_names=value.info.class_names,
                clients=clients, client_names=value.info.client_names if clients is not None else None,
                name=value.info.dataset or "arrays",
            )  # fmt: skip
        return value, RUN_STORE
    if isinstance(value, (tuple, list)) and len(value) == 4:
        return FeatureStore.from_arrays(*value), RUN_STORE
    raise FedheadError(
        f"The 'features' parameter must be a store file, a FeatureStore or the arrays (X, y, X_test, y_test). Got "
        f"{type(value).__name__}{f' of {len(value)}' if isinstance(value, (tuple, list)) else ''} instead. Pass "
        "fedhead.FeatureStore.from_arrays(X, y, X_test, y_test), or the four arrays as a tuple."
    )


def run_experiment_file(out: str | Path, param: str = "--out") -> Path:
    """The experiment file (config.toml) of the run in ``out``: what ``--resume --out DIR`` alone runs again."""
    path = Path(out) / "config.toml"
    if not path.is_file():
        raise FedheadError(
            f"The '--resume' option continues the run in {str(out)!r} from its config.toml, but there is none. Name "
            f"the run's directory with {param}, or give the run's options (--features ...) as well."
        )
    return path


def resolved_run(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` as the trainer runs it (and records it in config.json): the recipe filled in, validated, a
    closed-form head's switches set; no store needed."""
    return cfg.resolved()
