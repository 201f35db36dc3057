"""``fedhead.run``: one training run from Python, described the way every other surface describes it (a
:class:`~fedhead.federation.config.TrainConfig`, its fields as keywords, or an experiment file)."""

from __future__ import annotations

from pathlib import Path

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

    ``run(out=DIR, resume=True)`` alone continues the run in ``DIR`` from its own config.toml; ``overwrite=True``
    replaces the run in ``out`` (a finished one, or what a failed run left) instead of refusing the folder."""
    if cfg is None and not fields and config is None and resume and out is not None:
        config = run_experiment_file(out, "out")
    if cfg is None:
        cfg = TrainConfig(**{**(load_experiment(config) if config is not None else {}), **fields})
    elif fields or config is not None:
        raise TypeError("fedhead.run() takes a TrainConfig or its fields (or config=FILE), not both")
    check_transport(cfg, "in-process")
    return run_training(cfg, out=out, resume=resume, overwrite=overwrite, progress=progress, store=store)


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
