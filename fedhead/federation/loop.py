"""The one round loop: every federated run of fedhead (``train``, each bench grid, ``flower``, ``scratch``) is a
:class:`Job` that this loop drives through its units (seeds, and the IID reference of a seed) and rounds.

The loop owns what every run shares: the order of units and rounds, one checkpoint after every round written
together with ``rounds.csv`` (a SIGINT/SIGTERM waits for both), resume from that checkpoint, extension of a
finished run by more rounds, progress on stderr, each row to the tracker (``--log``) as it comes, and the final files (the plots and trackers of :mod:`fedhead.federation.outputs` included). A job owns what its rounds compute: the
head federation over a transport (:class:`fedhead.federation.job.HeadJob`) or a scratch network
(:class:`fedhead.scratch.runner.ScratchJob`).

The checkpoint (``checkpoint.safetensors``, :data:`fedhead.federation.rundir.CHECKPOINT_FORMAT`): ``index`` and ``unit``
(the unit being trained) and ``seed``; ``current``: its ``round``, its ``rows`` and the job's
:meth:`Job.unit_state`; ``done``: each finished unit's ``rows``, its ``final`` state and what
:meth:`Job.finish_unit` returned; ``pending``: units of an extended run still to continue; ``run``: the job's
:meth:`Job.run_state`; ``wall_s``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from fedhead.federation import outputs, rundir, tracking
from fedhead.federation.outputs import RunReport
from fedhead.federation.rundir import Opened, RunDir
from fedhead.infra.console import make_progress
from fedhead.infra.errors import SPACE_ERRNOS, FedheadError
from fedhead.infra.signals import ROUNDS_PAUSE_ENV, pause_hook, signals_deferred

PAUSE_ENV = ROUNDS_PAUSE_ENV  # test hook "k:FILE": after the k-th round row, pid -> FILE, sleep (pause_hook)


class Job:
    """What a run computes (override every method but the optional ones)."""

    fields: list = rundir.ROUND_FIELDS  # the leading columns of rounds.csv
    extendable = False  # whether a finished run may continue with more rounds (its final states are kept)

    def units(self) -> list[tuple]:
        raise NotImplementedError

    def label(self, unit: tuple) -> str:
        return " ".join(str(u) for u in unit)

    def last_round(self, unit: tuple) -> int:
        raise NotImplementedError

    def start(self, unit: tuple, saved: dict | None) -> tuple[int, list]:
        """Set ``unit`` up (``saved``: its checkpointed state); returns its first round to run and its rows so far."""
        raise NotImplementedError

    def round(self, unit: tuple, rnd: int) -> dict:
        raise NotImplementedError

    def unit_state(self) -> dict:
        raise NotImplementedError

    def progress_info(self, row: dict) -> str:
        return f"acc {row['accuracy']:.4f}"

    def after_checkpoint(self, unit: tuple, rnd: int, row: dict) -> None:
        """Optional: after a round's checkpoint (Flower: log it, honour a stop request)."""

    def live_log(self) -> tuple[str, str | None]:
        """Optional: the tracker each row goes to as it comes, after its round's checkpoint (``--log``,
        ``--log-dir``; :class:`fedhead.federation.tracking.Live`): by default the job's ``cfg.log`` and
        ``cfg.log_dir`` (none without them). The run's end rewrites the tracker whole, from :meth:`report`."""
        cfg = getattr(self, "cfg", None)
        return getattr(cfg, "log", None) or "none", getattr(cfg, "log_dir", None)

    def annotate(self, unit: tuple, rows: list) -> None:
        """Optional: mark the unit's last row before it is saved (a diverged round)."""

    def stop_after(self, unit: tuple, rows: list) -> bool:
        """Optional: whether the unit ends after its rows so far, before its last round (early stopping; read off
        the rows, so a resumed run stops where it would have); may raise a FedheadError (a diverged round)."""
        return False

    def finish_unit(self, unit: tuple, rows: list) -> tuple[list, dict]:
        """After the unit's last round: extra rows and what to keep of the unit (in ``done``)."""
        return [], {}

    def run_state(self) -> dict:
        return {}

    def load_run_state(self, state: dict) -> None:
        pass

    def table(self, rows: list) -> list:
        """The rows as rounds.csv shows them."""
        return rows

    def finish(self, run: RunDir, done: list, rows: list, wall_s: float) -> dict:
        """Write the final files (rounds.csv is written by the loop; wrap writes in :func:`writing`) and return
        the summary."""
        raise NotImplementedError

    def report(self, done: list, summary: dict) -> RunReport | None:
        """Optional: what the plots and trackers of the finished run need (:mod:`fedhead.federation.outputs`);
        None writes neither."""
        return None


@contextlib.contextmanager
def writing(run: RunDir, what: Path):
    """A failed write in the run directory as one line: what, why, and how to continue."""
    try:
        yield
    except OSError as exc:
        why = (exc.strerror or str(exc)).replace("\n", " ")
        if exc.errno in SPACE_ERRNOS:
            raise FedheadError(
                f"No space left while writing {str(what)!r} ({why}); free space (or raise the file size limit) and "
                f"{run.resume_hint()}."
            ) from None
        raise FedheadError(f"Writing {str(what)!r} failed ({why}); fix the cause and {run.resume_hint()}.") from None


def _save(job: Job, run: RunDir, state: dict, rows: list) -> None:
    """The checkpoint and rounds.csv, together (a signal waits for both)."""
    with signals_deferred():
        with writing(run, run.checkpoint_path):
            run.save_checkpoint(state)
        with writing(run, run.path / "rounds.csv"):
            rundir.write_rounds(run.path, job.table(rows), job.fields)


def run_job(job: Job, run: RunDir, opened: Opened, *, progress: bool = True) -> tuple[dict, list]:
    """Drive ``job`` in ``run`` (opened as ``opened``) to its end; returns the summary and the rows."""
    ckpt = opened.checkpoint if opened.kind in ("resume", "extend") else None
    if opened.kind == "extend":  # a finished run given more rounds: each unit continues from its final state
        done, pending, ckpt = [], [dict(d["final"], rows=d["rows"]) for d in ckpt["done"]], dict(ckpt, index=-1)
    else:
        done, pending = (list(ckpt["done"]), list(ckpt.get("pending", []))) if ckpt else ([], [])
    if ckpt:
        job.load_run_state(ckpt["run"])
    wall0 = time.perf_counter() - (float(ckpt["wall_s"]) if ckpt else 0.0)
    units = job.units()
    log, log_dir = job.live_log()
    with make_progress() as prog, tracking.live(log, run.path, log_dir, job.table) as live:  # closed before the end
        outer = prog.add_task("runs", total=len(units), info="") if progress and len(units) > 1 else None
        for i, unit in enumerate(units):
            if i < len(done):
                if outer is not None:
                    prog.advance(outer)
                continue
            saved = ckpt["current"] if ckpt is not None and ckpt["index"] == i else None
            saved = saved or (pending[i] if i < len(pending) else None)
            first, rows = job.start(unit, saved)
            live.begin(rows)  # a continued unit's tracker rows afresh from its rows so far
            last = job.last_round(unit)
            task = prog.add_task(job.label(unit), total=last, completed=first - 1, info="") if progress else None
            before = [r for d in done for r in d["rows"]]
            stopped = bool(rows) and job.stop_after(unit, rows)
            for rnd in range(first, last + 1):
                if stopped:
                    break
                row = job.round(unit, rnd)
                rows.append(row)
                job.annotate(unit, rows)
                state = {"index": i, "unit": list(unit), "seed": unit[0], "done": done, "pending": pending,
                         "current": {"round": rnd, "rows": rows, **job.unit_state()}, "run": job.run_state(),
                         "wall_s": time.perf_counter() - wall0}  # fmt: skip
                _save(job, run, state, before + rows)
                live.add([row], rows)  # the round's row to the tracker (--log) as it comes
                pause_hook(PAUSE_ENV, len(before) + len(rows))
                job.after_checkpoint(unit, rnd, row)
                if task is not None:
                    prog.update(task, advance=1, info=job.progress_info(row))
                stopped = job.stop_after(unit, rows)
            final = {"round": int(rows[-1]["round"]) if rows else last, **job.unit_state()} if job.extendable else None
            extra, kept = job.finish_unit(unit, rows)
            live.add(extra, rows + extra)
            done.append({"unit": list(unit), "seed": unit[0], "rows": rows + extra, "final": final, **kept})
            if task is not None:
                prog.remove_task(task)
            if outer is not None:
                prog.advance(outer)
    rows = [r for d in done for r in d["rows"]]
    wall = time.perf_counter() - wall0
    with writing(run, run.path / "rounds.csv"):
        rundir.write_rounds(run.path, job.table(rows), job.fields)
    summary = job.finish(run, done, rows, wall)
    report = job.report(done, summary)
    if report is not None:  # before the checkpoint goes: a failed plot or tracker is written again by --resume
        with writing(run, run.path / outputs.CURVES):
            outputs.write_outputs(run.path, job.table(rows), report)
    with writing(run, run.path / rundir.FINAL_STATE):
        run.finish({"done": done, "run": job.run_state(), "wall_s": wall} if job.extendable else None)
    return summary, job.table(rows)
