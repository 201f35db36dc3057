"""``fedhead bench baselines --sketch-dims r1,r2,...``: the bytes/accuracy frontier of compressed statistics.

Each of ridge, lda, qda and the fast recipe (those named in ``--methods``) runs again with ``--stats-sketch r``:
the clients send the statistics of their features projected by a shared seeded random matrix ``[D, r]`` (the Gram
and per-class second moments shrink from ``D^2`` to ``r^2`` numbers), the server solves there and maps the head back
(:meth:`fedhead.core.closedform.ClosedFormHead.unsketch`). The report gives final accuracy and MB uploaded per client
(exact message bytes) for every r beside the unsketched run, and ``baselines-sketch.png`` draws accuracy against MB
per client, one line per method and panel per partition.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedhead.bench.report import Cell, CellResult, Stat, md_table
from fedhead.federation import plots as P
from fedhead.federation.methods import METHODS
from fedhead.infra.errors import FedheadError

SKETCHED = ("ridge", "lda", "qda", "fast")  # the methods whose statistics a sketch compresses


def parse_dims(text: str | None) -> list[int]:
    """``--sketch-dims``: positive integers, comma-separated."""
    if not text:
        return []
    try:
        dims = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        dims = []
    if not dims or any(d < 1 for d in dims):
        raise FedheadError(
            f"The '--sketch-dims' parameter must be positive integers, comma-separated. Got {text!r} instead. "
            "Use e.g. --sketch-dims 16,32,64."
        )
    return sorted(set(dims))


def sketch_cells(cells: list, text, names, plabels, parts, recipe, features, common) -> list[int]:
    """Add a run per sketched method, r and partition to ``cells``; returns the dimensions."""
    dims = parse_dims(text)
    chosen = [m for m in names if m in SKETCHED]
    if dims and not chosen:
        raise FedheadError(
            f"The '--sketch-dims' parameter compresses the statistics of {', '.join(SKETCHED)}, and --methods names "
            f"none of them. Got --methods {','.join(names)}. Add one, e.g. --methods ridge,lda."
        )
    for m in chosen:
        for r in dims:
            for p in plabels:
                pname, pparams = parts[p]
                kw = {**METHODS[m][1], "partition": pname, "partition_params": pparams, "recipe": recipe,
                      "central_reference": True, "stats_sketch": r}  # fmt: skip
                labels = {"method": f"{m}@r{r}", "partition": p, "sketch": r, "base": m}
                cells.append(Cell(f"{m}-r{r}--{p}", labels, common.cfg(features, **kw)))
    return dims


def _point(r: CellResult) -> tuple[float, float]:
    """(MB uploaded per client over the run, final accuracy), means over seeds."""
    return Stat.of(r.per_seed("mb_per_client")).mean, Stat.of(r.per_seed("final_accuracy")).mean


def _frontier(full: list[CellResult], sketched: list[CellResult], p: str) -> dict[str, list[tuple]]:
    """method -> [(r or 'full', MB, accuracy)] on partition ``p``, r ascending, the unsketched run last."""
    out: dict[str, list[tuple]] = {}
    for r in sorted(sketched, key=lambda r: r.cell.labels["sketch"]):
        if r.cell.labels["partition"] == p:
            out.setdefault(r.cell.labels["base"], []).append((r.cell.labels["sketch"], *_point(r)))
    for r in full:
        m = r.cell.labels["method"]
        if r.cell.labels["partition"] == p and m in out:
            out[m].append(("full", *_point(r)))
    return out


def sketch_section(full: list[CellResult], sketched: list[CellResult], plabels: list[str]) -> str:
    rows = []
    for p in plabels:
        for m, pts in _frontier(full, sketched, p).items():
            for r, mb, acc in pts:
                rows.append([p, m, str(r), f"{mb:.4f}", f"{100 * acc:.2f}"])
    return "\n".join(
        [
            "## Compressed statistics: accuracy against MB uploaded per client (--stats-sketch r)",
            "",
            "The clients send the statistics of a shared seeded random projection of their features to r dimensions; "
            "'full' is the unsketched run. MB: exact message bytes per client over the run; accuracy: final, mean "
            "over seeds.",
            "",
            md_table(["partition", "method", "r", "MB up/client", "accuracy %"], rows),
            "",
        ]
    )


def sketch_lines(full: list[CellResult], sketched: list[CellResult], p: str) -> list:
    """The compressed-statistics points of partition ``p`` (final accuracy against MB per client, r ascending, the
    unsketched run last) as dotted lines with markers, for the communication frontier of the iterative methods."""
    return [
        P.Line(
            f"{m} --stats-sketch", np.array([x[1] for x in pts]), np.array([x[2] for x in pts]), style=":", marker="x"
        )  # fmt: skip
        for m, pts in _frontier(full, sketched, p).items()
    ]


def sketch_plot(path: Path, full: list[CellResult], sketched: list[CellResult], plabels: list[str]) -> Path:
    panels = []
    for p in plabels:
        panel = P.Panel(p)
        for m, pts in _frontier(full, sketched, p).items():
            panel.lines.append(P.Line(m, np.array([x[1] for x in pts]), np.array([x[2] for x in pts]), marker="o"))
        panels.append(panel)
    return P.write_curves(path, panels, "MB uploaded per client", "test accuracy",
                          "compressed statistics: the bytes/accuracy frontier", xscale="log")  # fmt: skip
