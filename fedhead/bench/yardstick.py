"""The stronger yardstick of ``fedhead bench baselines`` (issue 25): the best centralised linear probe.

Each method's own ceiling (:mod:`fedhead.core.central`) uses that method's weak regularisation; this one is a softmax
probe on the pooled training features (centred and scaled to unit RMS, the store's clean labels) whose L2 weight is
chosen from :data:`fedhead.core.central.TUNED_GRID` (grown by a decade past an edge while the choice sits there)
by accuracy on a seeded 10% of the training split (:func:`fedhead.core.central.tuned_probe`), one probe per seed of
the report. The report then gives, per partition, the best method within 3 rounds (its accuracy at the last evaluated
round <= 3, mean over seeds) and its gap to the probe in points.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from extract.store import store_content_hash
from fedhead.bench.report import CellResult, Stat, md_table
from fedhead.core.central import TUNED_BOUNDS, TUNED_GRID, TUNED_HOLDOUT, tuned_probe
from fedhead.federation.clients import FeatureStats, prepare
from fedhead.infra.files import atomic_write_json

WITHIN_ROUNDS = 3
TUNED_FILE = "tuned-central.json"


def tuned_central(store, seeds: list[int], out: Path | None = None) -> dict[int, dict]:
    """seed -> the tuned probe's test accuracy, chosen L2 weight and held-out accuracies. With ``out``, each seed's
    probe is kept in ``out/tuned-central.json`` as soon as it is fitted and reused by a report on the same store,
    grid and held-out share (as finished runs are)."""
    x = store.train_x.astype(np.float64)
    mean = x.mean(0)
    scale = float(np.sqrt(max(((x - mean) ** 2).sum(1).mean(), 1e-12)))
    stats = FeatureStats(mean, scale, 0, 0)
    xt, xs = prepare(store.train_x, stats, "cpu"), prepare(store.test_x, stats, "cpu")
    y, ys = torch.as_tensor(store.train_y), torch.as_tensor(store.test_y)
    path = Path(out) / TUNED_FILE if out is not None else None
    key = {
        "store_sha256": store_content_hash(store),
        "grid": list(TUNED_GRID),
        "bounds": list(TUNED_BOUNDS),
        "holdout": TUNED_HOLDOUT,
    }
    kept = {}
    if path is not None and path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            kept = {int(s): t for s, t in saved.get("seeds", {}).items()}
    found = {}
    for s in seeds:
        if int(s) not in kept:
            p = tuned_probe(xt, y, xs, ys, store.info.num_classes, int(s))
            hold = {f"{w:g}": a for w, a in p.holdout.items()}
            kept[int(s)] = {"accuracy": p.accuracy, "weight_decay": p.weight_decay, "holdout": hold}
            if path is not None:
                atomic_write_json(path, {"key": key, "seeds": {str(k): v for k, v in sorted(kept.items())}})
        found[int(s)] = kept[int(s)]
    return found


def _within(r: CellResult, rounds: int) -> float:
    """Accuracy at the last evaluated round <= ``rounds``, mean over seeds (nan: none evaluated)."""
    vals = []
    for rs, acc in r.curves().values():
        keep = rs <= rounds
        if keep.any():
            vals.append(float(acc[keep][-1]))
    return float(np.mean(vals)) if vals else float("nan")


def yardstick_section(by: dict[tuple, CellResult], names: list[str], plabels: list[str], tuned: dict) -> str:
    """The tuned probe per seed, and per partition the best method within 3 rounds and its gap to the probe."""
    accs = [t["accuracy"] for t in tuned.values()]
    probe = Stat.of(accs)
    wds = ", ".join(f"seed {s}: {t['weight_decay']:g}" for s, t in tuned.items())
    rows = []
    for p in plabels:
        within = {m: _within(by[(m, p)], WITHIN_ROUNDS) for m in names}
        ok = [m for m in names if within[m] == within[m]]
        if not ok:
            rows.append([p, "none evaluated", "", ""])
            continue
        best = max(ok, key=lambda m: within[m])
        rows.append([p, best, f"{100 * within[best]:.2f}", f"{100 * (probe.mean - within[best]):+.2f}"])
    grid = ", ".join(f"{w:g}" for w in TUNED_GRID)
    return "\n".join(
        [
            f"## Stronger yardstick: the tuned central linear probe {probe.fmt(100, 2)}%",
            "",
            f"A softmax probe on the pooled training features (centred, unit RMS; the store's clean labels), its L2 "
            f"weight chosen from {{{grid}}} (grown by a decade past an edge while the choice sits there, within "
            f"[{TUNED_BOUNDS[0]:g}, {TUNED_BOUNDS[1]:g}]) on a seeded {TUNED_HOLDOUT:.0%} of the training split, "
            f"refit on all of it (chosen: {wds}). Per partition: the best method within {WITHIN_ROUNDS} rounds "
            "(accuracy at its last evaluated round up to 3, mean over seeds) and its gap to the probe (points; "
            "positive: below it).",
            "",
            md_table(["partition", f"best within {WITHIN_ROUNDS} rounds", "accuracy %", "gap to probe (points)"], rows),
            "",
        ]
    )
