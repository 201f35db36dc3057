"""``--log tensorboard | mlflow``: a run's rows in TensorBoard event files or a local MLflow store (optional extras
``fedhead[tensorboard]``: tensorboardX; ``fedhead[mlflow]``: mlflow-skinny).

Every numeric column of every row is a scalar / metric named as the column, at step = the row's round; each unit
of the run (a seed, and its IID reference) is a run of its own, named ``seed<S>`` or ``seed<S>-iid``; the
configuration is recorded as hyper-parameters (TensorBoard's HParams plugin, MLflow's params).

Each round's row is written as it comes (:class:`Live`, which the round loop owns: TensorBoard event files flushed
after every row, MLflow metrics at step = round), so that a run is watched while it trains and a killed run keeps the
rows of its checkpointed rounds; a unit's first row in a process rewrites that unit from all its rows so far (a
resumed run continues it, never doubles it). When the run ends the trackers are rewritten whole from its rows
(:func:`write`; that is the final truth): a resumed or extended run, when it ends, replaces what it wrote before
(TensorBoard: its folder is swapped for the new one; MLflow: its earlier runs, found by the tag ``fedhead.run_dir``,
are deleted), so a tracker never holds a row twice. Columns computed from other units (``ratio_to_iid``,
``ratio_to_central``) and the hyper-parameters arrive with that final rewrite.

Layout: TensorBoard ``LOG_DIR/<unit>/events.out.tfevents.*`` with the default LOG_DIR ``OUT/tensorboard``, and
``LOG_DIR/<run name>/<unit>`` with a ``--log-dir`` of one's own (several runs side by side); MLflow: the file
store ``LOG_DIR`` (default ``OUT/mlruns``), experiment ``fedhead``, runs ``<run name>/<unit>``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

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


@contextlib.contextmanager
def _one_line(log: str, where: Path) -> Iterator[None]:
    """A failed write to the tracker ``log`` at ``where`` as one line (an OSError; MLflow's own errors)."""
    try:
        yield
    except OSError as exc:
        why = exc.strerror or exc
    except Exception as exc:
        mlflow_errors = sys.modules.get("mlflow.exceptions")
        if mlflow_errors is None or not isinstance(exc, mlflow_errors.MlflowException):
            raise
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    else:
        return
    raise FedheadError(
        f"Writing the {log} log to {str(where)!r} failed ({why}); fix the cause (or choose another --log-dir) and "
        "re-run the same command with --resume to write it."
    )


def write(log: str, run_dir: Path, log_dir: str | None, rows: list[dict], params: dict) -> Path:
    """Write ``rows`` to the tracker ``log``; returns its folder. Errors are one line."""
    require(log)
    where = tracker_dir(log, run_dir, log_dir)
    with _one_line(log, where):
        if log == "tensorboard":
            write_tensorboard(where, rows, params)
        else:
            write_mlflow(where, Path(run_dir), rows, params)
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


def _mlflow_client(store: Path):
    """The MLflow client of the file store ``store`` and the id of its experiment :data:`EXPERIMENT`."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    store = Path(store).resolve()
    store.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=store.as_uri())
    exp = client.get_experiment_by_name(EXPERIMENT)
    return client, exp.experiment_id if exp is not None else client.create_experiment(EXPERIMENT)


def _delete_mlflow_runs(client, eid: str, here: str, unit: str | None = None) -> None:
    """Delete the runs tagged with the run directory ``here`` (only those of ``unit`` when given)."""
    query = f"tags.`{RUN_TAG}` = {json.dumps(here)}"
    if unit is not None:
        query += f" and tags.`fedhead.unit` = {json.dumps(unit)}"
    for old in client.search_runs([eid], filter_string=query, max_results=1000):
        client.delete_run(old.info.run_id)


def _create_mlflow_run(client, eid: str, here: str, unit: str) -> str:
    run = client.create_run(eid, run_name=f"{Path(here).name}/{unit}", tags={RUN_TAG: here, "fedhead.unit": unit})
    return run.info.run_id


def _log_mlflow_rows(client, rid: str, rows: list[dict], stamp: int = 0) -> None:
    """Every numeric column of ``rows`` as a metric at step = round (``stamp``: their time, ms since the epoch)."""
    from mlflow.entities import Metric

    metrics = [Metric(k, v, stamp, int(r["round"])) for r in rows for k, v in numeric(r).items()]
    for i in range(0, len(metrics), 1000):
        client.log_batch(rid, metrics=metrics[i : i + 1000])


def _write_mlflow(store: Path, run_dir: Path, rows: list[dict], params: dict) -> None:
    from mlflow.entities import Param, RunTag

    client, eid = _mlflow_client(store)
    here = str(Path(run_dir).resolve())
    _delete_mlflow_runs(client, eid, here)
    flat = [Param(k, str(v)[:6000]) for k, v in flat_params(params).items()]
    for unit, part in by_unit(rows).items():
        rid = _create_mlflow_run(client, eid, here, unit)
        for i in range(0, max(len(flat), 1), 100):
            client.log_batch(
                rid, params=flat[i : i + 100], tags=[RunTag("fedhead.rows", str(len(part)))] if i == 0 else []
            )
        _log_mlflow_rows(client, rid, part)
        client.set_terminated(rid)


# ---------------------------------------------------------------- each round's row as it comes


class Live:
    """The tracker ``log`` written row by row while the run trains (the round loop's, from its start to its end; a
    no-op for ``log`` none). :meth:`add` after each round's checkpoint: the first row of a unit in this process
    rewrites the unit from all its rows so far (TensorBoard: the unit's folder swapped for a new one; MLflow: the
    unit's runs of this run directory deleted and one written), so that a resumed run holds each round once; later
    rows are appended (TensorBoard: one event per row appended to that event file, flushed at once; MLflow: a batch
    of metrics at step = round). ``table``: the job's :meth:`~fedhead.federation.loop.Job.table` (rows as rounds.csv
    shows them). The run's end rewrites the tracker whole (:func:`write`) after :meth:`close`."""

    def __init__(self, log: str, run_dir: Path, log_dir: str | None = None, table: Callable | None = None):
        self.log, self.run_dir = log, Path(run_dir)
        self.on = log in EXTRAS
        if self.on:
            require(log)
        self.where = tracker_dir(log, run_dir, log_dir) if self.on else None
        self.table = table or (lambda rows: rows)
        self.units: dict[str, object] = {}  # unit name -> its open event file (TensorBoard) or run id (MLflow)
        self.client = None  # MLflow: (client, experiment id)

    def begin(self, rows: list[dict]) -> None:
        """A unit of the loop starts (or continues) with ``rows`` so far: its tracker unit is written afresh from
        them (a resumed unit's rounds once each, whatever the interrupted run had written)."""
        if self.on and rows:
            with _one_line(self.log, self.where):
                self._open_new({unit_name(r) for r in rows}, rows)

    def add(self, new: list[dict], so_far: list[dict]) -> None:
        """Write the rows ``new``, the last of ``so_far`` (all the rows of the loop's unit so far, ``new``
        included); a unit not yet written in this process is written afresh from its rows in ``so_far``."""
        if not self.on or not new:
            return
        with _one_line(self.log, self.where):
            fresh = self._open_new({unit_name(r) for r in new}, so_far)
            for r in self.table([r for r in new if unit_name(r) not in fresh]):
                self._append(unit_name(r), [r])

    def _open_new(self, units: set, so_far: list[dict]) -> set:
        """Write each of ``units`` not open yet afresh from its rows in ``so_far``; returns those."""
        fresh = units - self.units.keys()
        for unit in sorted(fresh):
            self._open(unit, self.table([r for r in so_far if unit_name(r) == unit]))
        return fresh

    def _open(self, unit: str, rows: list[dict]) -> None:
        if self.log == "tensorboard":
            self.where.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{self.where.name}-{unit}.", suffix=".partial", dir=self.where.parent))
            try:
                with contextlib.closing(_EventFile(tmp)) as events:
                    events.write(rows)
                _swap(tmp, self.where / unit)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self.units[unit] = _EventFile(self.where / unit / events.path.name, append=True)
        else:
            if self.client is None:
                self.client = _mlflow_client(self.where)
            client, eid = self.client
            here = str(self.run_dir.resolve())
            _delete_mlflow_runs(client, eid, here, unit)
            self.units[unit] = _create_mlflow_run(client, eid, here, unit)
            _log_mlflow_rows(client, self.units[unit], rows, int(time.time() * 1000))

    def _append(self, unit: str, rows: list[dict]) -> None:
        if self.log == "tensorboard":
            self.units[unit].write(rows)
        else:
            _log_mlflow_rows(self.client[0], self.units[unit], rows, int(time.time() * 1000))

    def close(self, ok: bool = True) -> None:
        """Close the event files (TensorBoard) or end the runs (MLflow: ``FINISHED``, ``KILLED`` when not ``ok``)."""
        units, self.units = self.units, {}
        if not self.on or not units:
            return
        with _one_line(self.log, self.where):
            for handle in units.values():
                if self.log == "tensorboard":
                    handle.close()
                else:
                    self.client[0].set_terminated(handle, status="FINISHED" if ok else "KILLED")


class _EventFile:
    """A TensorBoard event file (TFRecords of ``Event`` protos, as tensorboardX's ``RecordWriter`` writes them) that
    takes rows as they come: each :meth:`write` is flushed to the operating system, so that a reader sees it and a
    killed process keeps it, without an fsync per row (tensorboardX's own flush syncs the disk; SummaryWriter queues
    events for a thread)."""

    def __init__(self, folder_or_file: Path, append: bool = False):
        from tensorboardX.proto.event_pb2 import Event

        if append:
            self.path, self.f = Path(folder_or_file), open(folder_or_file, "ab")
            return
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
        self.path = Path(folder_or_file) / name
        self.f = open(self.path, "xb")
        self._record(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.f.flush()

    def _record(self, event) -> None:
        from tensorboardX.record_writer import masked_crc32c

        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self.f.write(header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data)))

    def write(self, rows: list[dict]) -> None:
        """One event per row: every numeric column a scalar named as the column, at step = the row's round."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        for r in rows:
            values = [Summary.Value(tag=k, simple_value=v) for k, v in numeric(r).items()]
            self._record(Event(wall_time=time.time(), step=int(r["round"]), summary=Summary(value=values)))
        self.f.flush()

    def close(self) -> None:
        self.f.close()


@contextlib.contextmanager
def live(log: str, run_dir: Path, log_dir: str | None = None, table: Callable | None = None) -> Iterator[Live]:
    """A :class:`Live` tracker closed at the block's end (an error or interrupt in the block ends the MLflow runs
    as ``KILLED``; a failure to close then is dropped, the block's own exception goes on)."""
    tracker = Live(log, run_dir, log_dir, table)
    try:
        yield tracker
    except BaseException:
        with contextlib.suppress(Exception):
            tracker.close(ok=False)
        raise
    tracker.close()
