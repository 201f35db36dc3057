"""``fedhead.run``: one training run from Python, described the way every other surface describes it (a
:class:`~fedhead.federation.config.TrainConfig`, its fields as keywords, or an experiment file)."""

from __future__ import annotations

from pathlib import Path

from extract.store import Features
from fedhead.federation.config import TrainConfig, load_experiment
from fedhead.federation.experiment import check_transport, python_api
from fedhead.federation.train import RunResult, run_training, validate_method


@python_api
def run(
    cfg: TrainConfig | None = None,
    out: str | Path | None = None,
    *,
    resume: bool = False,
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
    :class:`~fedhead.infra.errors.FedheadError`, one line naming the field (``The 'lr' parameter must be ...``)."""
    if cfg is None:
        cfg = TrainConfig(**{**(load_experiment(config) if config is not None else {}), **fields})
    elif fields or config is not None:
        raise TypeError("fedhead.run() takes a TrainConfig or its fields (or config=FILE), not both")
    check_transport(cfg, "in-process")
    return run_training(cfg, out=out, resume=resume, progress=progress, store=store)


def resolved_run(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` as the trainer runs it (and records it in config.json): the recipe filled in, validated, a
    closed-form head's switches set (``validate_method``); no store needed."""
    out = cfg.resolved()
    validate_method(out)
    return out
