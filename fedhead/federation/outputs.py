"""What a run leaves besides its CSV and JSON files, written by the round loop when the run ends (and again, whole,
when a resumed or extended run ends): ``curves.png`` and ``partition.png`` (``--plots``, on by default), and the
rows in TensorBoard or MLflow (``--log``; each row also goes there as it comes:
:class:`fedhead.federation.tracking.Live`, which the loop owns; this end-of-run rewrite is the final truth).

``curves.png``: accuracy and training loss per round; with several seeds the mean with a ±std band; the IID
reference run (``--iid-reference``) dashed, the central ceiling (``--central-reference``) as a horizontal line,
stage boundaries (OvA-LP's stage 1 / 2, the statistics round of a closed-form start) as dotted marks; the loss
breaks at each stage boundary (one line per stage: the stages' losses differ in scale).
``partition.png``: the first seed's label counts per client (:class:`~fedhead.federation.plots.LabelCounts`); with
secure aggregation the server never sees a client's counts, and the figure says so instead.
``personal.png`` (``--personalize`` runs only): the histogram of the per-client gain, each client's personal head's
accuracy minus the global head's on the client's local test set (personal.csv's ``gain``), one histogram per seed
on shared bins with a legend (:class:`~fedhead.federation.plots.Histogram`).

The data of every figure is built and checked on every run; drawing costs about half a second a run (matplotlib),
so the test suite sets :data:`DRAW_ENV` to ``data``: every run still builds and checks its figures' data, and the
tests of the plots draw them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from fedhead.federation import tracking
from fedhead.federation.plots import (
    Histogram,
    LabelCounts,
    Line,
    Panel,
    write_curves,
    write_histogram,
    write_label_counts,
)

DRAW_ENV = "FEDHEAD_TEST_PLOTS"  # test hook: "data" builds and checks every figure's data but draws no PNG
CURVES, PARTITION, PERSONAL = "curves.png", "partition.png", "personal.png"
SECURE_NOTE = (
    "Secure aggregation: the server only ever sees sums over each round's clients, never a client's label "
    "counts, so there is no per-client partition to draw."
)


@dataclass
class RunReport:
    """What a job tells the loop about its finished run for the plots and the trackers."""

    plots: bool = True  # write curves.png and partition.png
    log: str = "none"  # none | tensorboard | mlflow
    log_dir: str | None = None  # the trackers' folder (default inside the run directory)
    title: str = ""  # the figures' title, e.g. "ova2 on dirichlet, 100 clients"
    central: dict = field(default_factory=dict)  # seed (str) -> {"accuracy": ...}: the central ceiling
    counts: np.ndarray | None = None  # [K, C] label counts per client (the first seed's), None if unknown
    labels: Sequence[str] = ()  # the label names
    note: str = ""  # why there are no counts (secure aggregation)
    seed: int | None = None  # the seed whose counts these are (named when the run has several)
    params: dict = field(default_factory=dict)  # the configuration, as the trackers' hyper-parameters
    gains: list = field(default_factory=list)  # (seed, per-client gains [K']) of --personalize; [] without it
    personalize: str = ""  # the --personalize method the gains are of


def _finite(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rounds, mean and std over seeds of ``key`` (rounds where no seed has a finite value are left out)."""
    by_round: dict[int, list[float]] = {}
    for r in rows:
        v = r.get(key)
        if _finite(v):
            by_round.setdefault(int(r["round"]), []).append(float(v))
    xs = sorted(by_round)
    mean = np.array([np.mean(by_round[x]) for x in xs])
    std = np.array([np.std(by_round[x]) for x in xs])
    return np.array(xs, float), mean, std


def stage_marks(rows: list[dict]) -> list[tuple[float, str]]:
    """Where the stage changes along the first seed's main rows: ``(x, new stage)`` between two rounds."""
    main = [r for r in rows if r.get("run", "main") == "main"]
    first = [r for r in main if r["seed"] == main[0]["seed"]] if main else []
    marks, before = [], None
    for r in first:
        stage = str(r.get("stage", ""))
        if before is not None and stage != before:
            marks.append((int(r["round"]) - 0.5, stage))
        before = stage
    return marks


def stage_segments(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """``rows`` (one run's, any seeds) cut where the stage changes along the rounds: ``(stage, rows)`` per stretch of
    consecutive rounds in one stage (a round's stage is its first row's); one stretch when the rows have no
    ``stage``."""
    stage_of: dict[int, str] = {}
    for r in rows:
        stage_of.setdefault(int(r["round"]), str(r.get("stage", "")))
    segments: list[tuple[str, set]] = []
    for rnd in sorted(stage_of):
        if not segments or segments[-1][0] != stage_of[rnd]:
            segments.append((stage_of[rnd], set()))
        segments[-1][1].add(rnd)
    return [(stage, [r for r in rows if int(r["round"]) in rounds]) for stage, rounds in segments]


def curve_panels(rows: list[dict], central: dict | None = None) -> list[Panel]:
    """The panels of curves.png: accuracy and training loss per round (the run's lines, the IID reference's
    dashed, the central ceiling as a horizontal line, stage boundaries as marks). The loss is one line per stage
    (OvA-LP's stage 1 and 2 losses differ about tenfold in scale; a line through the boundary would join them), in
    the run's colour, labelled with the stage; the accuracy one line."""
    seeds = {r["seed"] for r in rows}
    acc, loss = Panel("accuracy", ylabel="test accuracy"), Panel("training loss", ylabel="mean local loss")
    for run, style, color in (("main", "-", "C0"), ("iid", "--", "C1")):
        part = [r for r in rows if r.get("run", "main") == run]
        if not part:
            continue
        name = "run" if run == "main" else "IID reference"
        label = f"{name} (mean ± std, {len(seeds)} seeds)" if len(seeds) > 1 else name
        x, m, s = _series(part, "accuracy")
        acc.lines.append(Line(label, x, m, err=s if len(seeds) > 1 else None, style=style, color=color))
        segments = stage_segments(part)
        for stage, seg in segments:
            x, m, s = _series(seg, "train_loss")
            if len(segments) > 1 and not len(x):  # a stage without a loss (a statistics round): no empty line
                continue
            seg_label = f"{label}, {stage}" if len(segments) > 1 else label
            loss.lines.append(Line(seg_label, x, m, err=s if len(seeds) > 1 else None, style=style, color=color))
    ceilings = [c["accuracy"] for c in (central or {}).values() if c and _finite(c.get("accuracy"))]
    if ceilings:
        acc.hlines.append((float(np.mean(ceilings)), "central ceiling"))
    marks = stage_marks(rows)
    acc.vlines, loss.vlines = marks, list(marks)
    for p in (acc, loss):
        for ln in p.lines:
            if len(ln.x) != len(ln.y) or not np.isfinite(np.asarray(ln.y, float)).all():
                raise ValueError(f"curve {ln.label!r} of {p.title!r} has {len(ln.x)} rounds, {len(ln.y)} values")
    return [acc, loss]


def label_counts(report: RunReport) -> LabelCounts:
    """partition.png's data (the counts, or the note saying why there are none)."""
    title = f"Label counts per client{' — ' + report.title if report.title else ''}"
    if report.seed is not None:
        title += f" (seed {report.seed})"
    if report.counts is None:
        spec = LabelCounts(None, title=title, note=report.note or "The run recorded no per-client label counts.")
    else:
        spec = LabelCounts(np.asarray(report.counts, dtype=np.int64), report.labels, title=title)
    spec.check()
    return spec


def personal_histogram(report: RunReport) -> Histogram | None:
    """personal.png's data: each seed's per-client gains (None when the run did not personalise)."""
    if not report.gains:
        return None
    title = f"Per-client gain of --personalize {report.personalize}" if report.personalize else "Per-client gain"
    if report.title:
        title += f" — {report.title}"
    spec = Histogram(
        [
            (f"seed {seed}" if len(report.gains) > 1 else "clients", np.asarray(g, dtype=float))
            for seed, g in report.gains
        ],
        title=title,
        xlabel="personal minus global accuracy on the client's local test set",
        ylabel="clients",
        zero="no gain",
    )
    spec.check()
    return spec


def drawing() -> bool:
    """Whether figures are drawn (the test hook :data:`DRAW_ENV` = ``data`` builds their data only)."""
    return os.environ.get(DRAW_ENV, "") != "data"


def write_plots(run_dir: Path, rows: list[dict], report: RunReport) -> list[Path]:
    """curves.png, partition.png and (--personalize) personal.png in ``run_dir`` (atomically); returns what was
    written."""
    panels = curve_panels(rows, report.central)
    counts = label_counts(report)
    gains = personal_histogram(report)
    if not drawing():
        return []
    title = report.title
    curves = write_curves(Path(run_dir) / CURVES, panels, "round", "", title=title, sharey=False, integer_x=True)
    written = [curves, write_label_counts(Path(run_dir) / PARTITION, counts)]
    if gains is not None:
        written.append(write_histogram(Path(run_dir) / PERSONAL, gains))
    return written


def write_outputs(run_dir: Path, rows: list[dict], report: RunReport) -> list[Path]:
    """The plots (when asked) and the trackers (``report.log``) of a finished run."""
    written = write_plots(run_dir, rows, report) if report.plots else []
    if report.log != "none":
        written.append(tracking.write(report.log, run_dir, report.log_dir, rows, report.params))
    return written
