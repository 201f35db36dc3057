"""``--log tensorboard | mlflow``: a run's rows in TensorBoard event files or a local MLflow store (optional extras
``fedhead[tensorboard]``: tensorboardX; ``fedhead[mlflow]``: mlflow-skinny).

Every numeric column of every row is a scalar / metric named as the column, at step = the row's round; each unit
of the run (a seed, and its IID reference) is a run of its own, named ``seed<S>`` or ``seed<S>-iid``; the
configuration is recorded as hyper-parameters (TensorBoard's HParams plugin, MLflow's params).

The trackers are written when the run ends, from its whole rounds.csv: a resumed or extended run, when it ends,
replaces what it wrote before (TensorBoard: its folder is swapped for the new one; MLflow: its earlier runs,
found by the tag ``fedhead.run_dir``, are deleted), so a tracker never holds a row twice.

Layout: TensorBoard ``LOG_DIR/<unit>/events.out.tfevents.*`` with the default LOG_DIR ``OUT/tensorboard``, and
``LOG_DIR/<run name>/<unit>`` with a ``--log-dir`` of one's own (several runs side by side); MLflow: the file
store ``LOG_DIR`` (default ``OUT/mlruns``), experiment ``fedhead``, runs ``<run name>/<unit>``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from fedhead.infra.errors import FedheadError, OneOf, validate

TRACKERS = ("none", "tensorboard", "mlflow")
EXTRAS = {"tensorboard": ("tensorboardX", "tensorboard"), "mlflow": ("mlflow", "mlflow")}  # module, extra
DEFAULT_DIRS = {"tensorboard": "tensorboard", "mlflow": "mlruns"}
EXPERIMENT = "fedhead"  # the MLflow experiment every run is logged under
RUN_TAG = "fedhead.run_dir"  # MLflow: the run directory a run was logged from (a rewrite replaces its runs)


def require(log: str) -> None:
    """Refuse ``--log`` when its extra is not installed (before the run starts), in one line."""
    if log in EXTRAS:
        module, extra = EXTRAS[log]
        try:
            __import__(module)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] == module:
                raise FedheadError(
                    f"The '--log' option {log} needs the {module} package, which is not installed. Install the "
                    f"extra: pip install 'fedhead[{extra}]'"
                ) from None
            raise


def check_log(log: str, log_dir: str | None) -> None:
    """``--log`` and ``--log-dir`` of a command that does not derive them from the experiment table (scratch)."""
    validate("--log", log, OneOf(TRACKERS))
    if log == "none" and log_dir is not None:
        raise FedheadError(
            "The '--log-dir' option does not apply to --log none: it applies to --log tensorboard | mlflow only. "
            "Drop --log-dir or use --log tensorboard | mlflow."
        )
    require(log)


def unit_name(row: dict) -> str:
    """The tracker run a row belongs to: ``seed<S>``, or ``seed<S>-iid`` for the IID reference."""
    run = row.get("run", "main")
    return f"seed{row['seed']}" + ("" if run in ("main", "", None) else f"-{run}")


def numeric(row: dict) -> dict[str, float]:
    """The row's numeric columns (finite numbers; not the seed and the round, which name the run and the step)."""
    out = {}
    for k, v in row.items():
        if k in ("seed", "round") or isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


def by_unit(rows: list[dict]) -> dict[str, list[dict]]:
    units: dict[str, list[dict]] = {}
    for r in rows:
        units.setdefault(unit_name(r), []).append(r)
    return units


def flat_params(params: dict, prefix: str = "") -> dict:
    """The configuration as flat hyper-parameters: nested dicts as ``outer.inner``; lists as text; None left out."""
    out = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_params(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = ",".join(str(x) for x in v)
        elif v is not None:
            out[key] = v if isinstance(v, (bool, int, float, str)) else str(v)
    return out


def tracker_dir(log: str, run_dir: Path, log_dir: str | None) -> Path:
    """Where ``log`` writes this run: its own folder (TensorBoard) or the store (MLflow)."""
    if log_dir is None:
        return Path(run_dir) / DEFAULT_DIRS[log]
    return Path(log_dir) / Path(run_dir).resolve().name if log == "tensorboard" else Path(log_dir)


def write(log: str, run_dir: Path, log_dir: str | None, rows: list[dict], params: dict) -> Path:
    """Write ``rows`` to the tracker ``log``; returns its folder. Errors are one line."""
    require(log)
    where = tracker_dir(log, run_dir, log_dir)
    try:
        if log == "tensorboard":
            write_tensorboard(where, rows, params)
        else:
            write_mlflow(where, Path(run_dir), rows, params)
    except OSError as exc:
        raise FedheadError(
            f"Writing the {log} log to {str(where)!r} failed ({exc.strerror or exc}); fix the cause (or choose "
            "another --log-dir) and re-run the same command with --resume to write it."
        ) from None
    return where


def write_tensorboard(folder: Path, rows: list[dict], params: dict) -> None:
    """One event-file folder per unit under ``folder``, written beside it and swapped in whole."""
    from tensorboardX import SummaryWriter
    from tensorboardX.summary import hparams

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    try:
        hp = flat_params(params)
        for unit, part in by_unit(rows).items():
            with SummaryWriter(logdir=str(tmp / unit), flush_secs=3600, max_queue=1 << 16) as w:
                last = {}
                for r in part:
                    for k, v in numeric(r).items():
                        w.add_scalar(k, v, int(r["round"]))
                        last[k] = v
                final = {f"final/{k}": v for k, v in last.items() if k == "accuracy"}
                for summary in hparams(hp, final or {"final/accuracy": float("nan")}):
                    w.file_writer.add_summary(summary)
        _swap(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap(new: Path, folder: Path) -> None:
    """Replace ``folder`` by ``new`` (the old one renamed away first, then removed)."""
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.replace(folder, old)
    os.replace(new, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_mlflow(store: Path, run_dir: Path, rows: list[dict], params: dict) -> None:
    """The MLflow file store ``store``: this run directory's earlier runs deleted, one run per unit written."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    from mlflow.exceptions import MlflowException

    try:
        _write_mlflow(store, run_dir, rows, params)
    except MlflowException as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FedheadError(
            f"Writing the mlflow log to {str(store)!r} failed ({why}); fix the cause (or choose another --log-dir) "
            "and re-run the same command with --resume to write it."
        ) from None


def _write_mlflow(store: Path, run_dir: Path, rows: list[dict], params: dict) -> None:
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    store = Path(store).resolve()
    store.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=store.as_uri())
    exp = client.get_experiment_by_name(EXPERIMENT)
    eid = exp.experiment_id if exp is not None else client.create_experiment(EXPERIMENT)
    here = str(Path(run_dir).resolve())
    for old in client.search_runs([eid], filter_string=f"tags.`{RUN_TAG}` = {json.dumps(here)}", max_results=1000):
        client.delete_run(old.info.run_id)
    flat = [Param(k, str(v)[:6000]) for k, v in flat_params(params).items()]
    for unit, part in by_unit(rows).items():
        run = client.create_run(eid, run_name=f"{Path(here).name}/{unit}", tags={RUN_TAG: here, "fedhead.unit": unit})
        rid = run.info.run_id
        metrics = [Metric(k, v, 0, int(r["round"])) for r in part for k, v in numeric(r).items()]
        for i in range(0, max(len(flat), 1), 100):
            client.log_batch(
                rid, params=flat[i : i + 100], tags=[RunTag("fedhead.rows", str(len(part)))] if i == 0 else []
            )
        for i in range(0, len(metrics), 1000):
            client.log_batch(rid, metrics=metrics[i : i + 1000])
        client.set_terminated(rid)
