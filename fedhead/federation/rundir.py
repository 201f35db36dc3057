"""The run directory every training command writes (names fixed: later tools read them).

``config.json``  the full resolved configuration, the store's metadata, the fedhead version
``config.toml``  the resolved experiment as an experiment file: ``fedhead train --config RUN/config.toml`` repeats it
                 (fedhead train and the bench: written when the run finishes; Flower: at its start)
``rounds.csv``   one row per (seed, round): ROUND_FIELDS, then any extra columns
``summary.json`` final/best accuracy, Acc@95, ratio to IID, mean and std over seeds, wall seconds
``clients.csv``  client id, size, number of classes, per-class counts (compact ``class:count`` form)

All files are written atomically (a temporary file renamed over the final name).
"""

from __future__ import annotations

import csv
import io
import math
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from fedhead import __version__
from fedhead.infra.files import atomic_write_json, atomic_write_text

ROUND_FIELDS = [
    "seed",
    "round",
    "stage",
    "accuracy",
    "train_loss",
    "client_ms",
    "server_ms",
    "bytes_up_per_client",
    "bytes_total",
    "ratio_to_iid",
]


def default_run_dir(root: str | Path, *parts: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(root) / "-".join([stamp, *[p for p in parts if p]])


def write_experiment(run_dir: str | Path, cfg) -> Path:
    """``config.toml``: the run's resolved experiment (a :class:`fedhead.federation.config.TrainConfig`) as an
    experiment file, so that ``fedhead train --config RUN_DIR/config.toml`` repeats the run (its feature store path
    as the run was given it, relative to the working directory it ran in)."""
    path = Path(run_dir) / "config.toml"
    atomic_write_text(path, cfg.to_toml())
    return path


def write_csv(path: str | Path, rows: Sequence[dict], fields: Sequence[str] | None = None) -> None:
    """Write dict rows as CSV atomically; the columns are ``fields`` then any other keys in order."""
    cols = list(fields or [])
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _fmt(r.get(k)) for k in cols})
    atomic_write_text(path, buf.getvalue())


def read_csv(path: str | Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _fmt(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    if isinstance(v, np.floating):
        return _fmt(float(v))
    return v


def write_rounds(run_dir: str | Path, rows: Sequence[dict]) -> None:
    write_csv(Path(run_dir) / "rounds.csv", rows, ROUND_FIELDS)


def write_config(run_dir: str | Path, config: dict) -> None:
    atomic_write_json(Path(run_dir) / "config.json", {"fedhead_version": __version__, **config})


def write_summary(run_dir: str | Path, summary: dict) -> None:
    atomic_write_json(Path(run_dir) / "summary.json", summary)


def _client_rows(sizes, class_counts, extra: dict[str, Sequence] | None = None, **fixed) -> list[dict]:
    """One row per client; the compact form lists only non-zero classes as ``c:n`` pairs."""
    rows = []
    for k, (n, counts) in enumerate(zip(sizes, class_counts)):
        counts = np.asarray(counts)
        nz = np.flatnonzero(counts)
        row = {
            **fixed,
            "client": k,
            "size": int(n),
            "num_classes": int(len(nz)),
            "class_counts": " ".join(f"{c}:{int(counts[c])}" for c in nz),
        }
        for key, vals in (extra or {}).items():
            row[key] = vals[k]
        rows.append(row)
    return rows


def write_clients(
    run_dir: str | Path, sizes: np.ndarray, class_counts: np.ndarray, extra: dict[str, Sequence] | None = None
) -> None:
    """``class_counts`` is [K, C]: one row per client."""
    write_csv(
        Path(run_dir) / "clients.csv",
        _client_rows(sizes, class_counts, extra),
        ["client", "size", "num_classes", "class_counts"],
    )


def write_clients_per_seed(run_dir: str | Path, groups: Sequence[dict]) -> None:
    """``groups``: ``{"seed", "sizes", "counts"}`` per seed; a ``seed`` column appears when there are several."""
    if len(groups) == 1:
        write_clients(run_dir, groups[0]["sizes"], groups[0]["counts"])
        return
    rows = [r for g in groups for r in _client_rows(g["sizes"], g["counts"], seed=g["seed"])]
    write_csv(Path(run_dir) / "clients.csv", rows, ["seed", "client", "size", "num_classes", "class_counts"])


# ---------------------------------------------------------------- metrics (SPEC section 7)


def acc95_round(accuracies: Sequence[float], reference: float | None = None) -> int | None:
    """First round (1-based) whose accuracy reaches 0.95 x ``reference`` (default: the final accuracy)."""
    acc = list(accuracies)
    if not acc:
        return None
    target = 0.95 * (acc[-1] if reference is None else reference)
    for i, a in enumerate(acc):
        if a >= target:
            return i + 1
    return None


def mean_std(values: Iterable[float | None]) -> tuple[float, float]:
    v = np.array([x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0
