"""``fedhead compare RUN_DIR...``: several run directories side by side (``train``, ``flower simulate``, ``scratch``).

Each run is read from its files (rounds.csv, and summary.json / config.json when there): one table row per run
(head or algorithm, partition, rounds, final and best value of the metric, ratios to IID / the central ceiling when
the run has them, bytes, wall time, and the settings that differ between the runs), and one curve per run in
``compare.png`` (the metric per round, the mean over the run's seeds; an IID reference run's rows are left out).
The table is also written beside it as ``compare.csv`` and ``compare.json`` (the columns of :func:`table_rows`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedhead.federation.plots import Line, Panel, write_curves
from fedhead.federation.rundir import read_csv, write_csv
from fedhead.infra.errors import FedheadError
from fedhead.infra.files import atomic_write_json

COMPARE_PNG = "compare.png"
COMPARE_CSV, COMPARE_JSON = "compare.csv", "compare.json"  # the table, beside compare.png
# settings that never explain a difference in results (where a run ran, how it was written)
IGNORED = {"out", "features", "device", "block_clients", "memory_budget_mb", "dual", "plots", "log", "log_dir",
           "data_dir", "device_resolved", "cpu_threads", "torch_version", "identity", "fedhead_version"}  # fmt: skip


@dataclass
class RunFiles:
    """One run directory as compare reads it."""

    path: Path
    rows: list[dict]  # rounds.csv, numbers as floats
    summary: dict  # summary.json ({} for an unfinished run)
    settings: dict  # the flat configuration (config.json)

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)


def _number(v: str):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif not isinstance(v, list) or len(v) <= 12:
            out[f"{prefix}{k}"] = v
    return out


def load_run(path: str | Path) -> RunFiles:
    """A run directory's rows, summary and settings; a path that is not one is a one-line error."""
    path = Path(path)
    rounds = path / "rounds.csv"
    if not path.is_dir() or not rounds.is_file():
        what = "does not exist" if not path.exists() else "is not a run directory (no rounds.csv)"
        raise FedheadError(
            f"The 'RUN_DIR' argument names {str(path)!r}, which {what}. Give folders written by fedhead train, "
            "fedhead flower simulate or fedhead scratch (--out)."
        )
    try:
        rows = [{k: _number(v) for k, v in r.items()} for r in read_csv(rounds)]
        summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else {}
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise FedheadError(f"The 'RUN_DIR' argument names {str(path)!r}, whose files cannot be read ({exc}).") from None
    if not rows:
        raise FedheadError(
            f"The 'RUN_DIR' argument names {str(path)!r}, an empty run (rounds.csv has no rows yet). Let it run a "
            "round, or leave it out."
        )
    settings = config.get("config", config) if isinstance(config, dict) else {}
    settings = {k: v for k, v in _flat(settings).items() if k not in IGNORED}
    return RunFiles(path, rows, summary, settings)


def main_rows(run: RunFiles) -> list[dict]:
    return [r for r in run.rows if r.get("run", "main") in ("main", "")]


def metric_names(runs: list[RunFiles]) -> list[str]:
    """The numeric columns every run has (what --metric may name)."""
    names = None
    for run in runs:
        cols = {k for r in run.rows for k, v in r.items() if isinstance(v, float) and k not in ("seed", "round")}
        names = cols if names is None else names & cols
    return sorted(names or [])


def check_metric(runs: list[RunFiles], metric: str) -> None:
    names = metric_names(runs)
    if metric not in names:
        raise FedheadError(
            f"The '--metric' parameter must be a numeric column of every run's rounds.csv. Got {metric!r} instead. "
            f"Use one of: {', '.join(names)}."
        )


def curve(run: RunFiles, metric: str, x: str = "round") -> tuple[np.ndarray, np.ndarray]:
    """Rounds (``x = "sim_time_s"``: the mean over seeds of each round's simulated seconds) and the mean over seeds
    of ``metric`` (rounds without a finite value left out)."""
    by: dict[float, list[float]] = {}
    at: dict[float, list[float]] = {}
    for r in main_rows(run):
        v, t = r.get(metric), r.get(x)
        if isinstance(v, float) and math.isfinite(v) and isinstance(t, (int, float)):
            by.setdefault(r["round"], []).append(v)
            at.setdefault(r["round"], []).append(float(t))
    xs = sorted(by)
    return np.array([np.mean(at[k]) for k in xs], float), np.array([np.mean(by[k]) for k in xs], float)


def differing(runs: list[RunFiles]) -> list[str]:
    """The settings whose values differ between the runs (in the first run's order, then the others')."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.settings if k not in keys]
    return [k for k in keys if len({json.dumps(r.settings.get(k), sort_keys=True) for r in runs}) > 1]


def _show(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def table_rows(runs: list[RunFiles], metric: str) -> list[dict]:
    """One row per run for the table (``--metric`` at the final round and at the round the run's validation selected
    (never the best of the curve: that would choose on what it reports), summary's ratios, bytes and wall time)."""
    diff = differing(runs)
    out = []
    for run in runs:
        s, cfg = run.summary, run.settings
        x, y = curve(run, metric)
        sel = s.get("selected_round")
        sel = int(round(sel)) if isinstance(sel, (int, float)) and sel == sel else None
        out.append(
            {
                "run": run.name,
                "head": s.get("head") or cfg.get("head") or s.get("algo") or cfg.get("algo"),
                "partition": s.get("partition") or cfg.get("partition"),
                "rounds": int(x.max()) if x.size else None,
                "final": float(y[-1]) if y.size else None,
                "selected_round": sel,
                "at_selected": s.get("test_accuracy_at_selected")
                if metric == "accuracy"
                else (float(y[x == sel][-1]) if sel is not None and (x == sel).any() else None),
                "ratio_to_iid": s.get("final_ratio_to_iid"),
                "ratio_to_central": s.get("final_ratio_to_central"),
                "mb_total": s["bytes_total"] / 1e6 if isinstance(s.get("bytes_total"), (int, float)) else None,
                "wall_seconds": s.get("wall_seconds"),
                "differs": "; ".join(f"{k}={_show(cfg.get(k))}" for k in diff),
            }
        )
    return out


def write_compare_plot(runs: list[RunFiles], metric: str, out: Path, x: str = "round") -> Path:
    """compare.png in ``out``: ``metric`` per round (``x = "sim_time_s"``: against simulated seconds), one line per
    run."""
    panel = Panel(metric)
    for run in runs:
        xs, y = curve(run, metric, x)
        panel.lines.append(Line(run.name, xs, y))
    label = "round" if x == "round" else "simulated seconds (sim_time_s)"
    return write_curves(Path(out) / COMPARE_PNG, [panel], label, metric, integer_x=x == "round")


def _json_value(v):
    """A table cell for JSON: a number that is not finite (NaN, inf) as null (JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def write_compare_table(rows: list[dict], metric: str, out: Path) -> tuple[Path, Path]:
    """compare.csv and compare.json in ``out`` (atomically): the table's rows (:func:`table_rows`), one per run;
    the JSON also names ``metric`` (what ``final`` and ``at_selected`` are)."""
    out = Path(out)
    csv_path, json_path = out / COMPARE_CSV, out / COMPARE_JSON
    write_csv(csv_path, rows, list(rows[0]) if rows else [])
    table = [{k: _json_value(v) for k, v in r.items()} for r in rows]
    atomic_write_json(json_path, {"metric": metric, "rows": table})
    return csv_path, json_path
