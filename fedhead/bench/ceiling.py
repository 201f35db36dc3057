"""Time to the ceiling (``fedhead bench speed``'s last part): how long a user waits for a head as good as it gets.

For each store (the paper-scale synthetic one, 100 classes x 50k x 1024, and any ``--ceiling-store``) and each
method of :data:`CEILING_METHODS`:

1. **Where the ceiling is.** One in-process run of up to ``rounds`` rounds with ``--central-reference`` gives the
   accuracy per round and the method's own central ceiling (the same head trained on the pooled features to
   convergence, :mod:`fedhead.core.central`). Two targets: 99% of the method's own ceiling, and 99% of the best
   ceiling among the methods (one yardstick for all of them). The first round at or above each target is
   ``r*`` (none when the run never gets there).
2. **How long that takes.** The whole command a user would type, ``fedhead train --config exp.toml`` with ``--rounds
   r*`` (and no central reference), timed from its start to its exit in a fresh process: imports, loading the store,
   the partition, the statistics exchange, r* rounds and the final files. A run of r* rounds computes the first r*
   rounds of the longer run (the rounds of a run do not depend on how many follow: ``--resume --rounds N`` relies on
   it), so its last accuracy is the one the first step found. The same experiment file then runs through ``fedhead
   flower simulate`` (Flower's simulation engine, Ray) for the same rounds, also timed whole.

The record's keys are ``ceiling_<store>_<method>_*`` (flat, as the rest of ``speed.json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from fedhead.core.closedform import is_closed_form
from fedhead.core.synthetic import write_synthetic
from fedhead.federation.config import TrainConfig
from fedhead.federation.methods import METHODS
from fedhead.federation.train import run_training
from fedhead.infra.errors import FedheadError
from fedhead.interface.options import resolved_toml

CEILING_METHODS = ("ridge", "fast", "softmax", "ova2")  # the fastest closed form, the fast recipe, the two heads
PAPER_STORE = dict(num_classes=100, train_per_class=500, test_per_class=100, dim=1024)  # 50k x 1024, 100 classes
QUICK_STORE = dict(num_classes=10, train_per_class=40, test_per_class=10, dim=32)


def _config(store: Path, method: str, clients: int, rounds: int, central: bool) -> TrainConfig:
    fields = dict(METHODS[method][1])
    closed = is_closed_form(fields["head"])  # one exchange: no rounds to give
    return TrainConfig(
        features=str(store), clients=clients, partition="shard", seeds=[0], central_reference=central,
        **({} if closed else {"rounds": rounds}), **fields,
    )  # fmt: skip


def _first_at(rows: list[dict], target: float) -> int | None:
    for r in rows:
        if r.get("run", "main") == "main" and r["accuracy"] >= target:
            return int(r["round"])
    return None


def _timed(argv: list[str], cwd: Path, timeout: float) -> tuple[float, dict]:
    """Wall seconds of ``fedhead ARGV`` in a fresh interpreter, and the run's summary.json."""
    env = dict(os.environ, FEDHEAD_NO_PROGRESS="1")
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "cli", *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise FedheadError(f"time to the ceiling: 'fedhead {' '.join(argv[:2])}' failed: {tail}")
    out = Path(argv[argv.index("--out") + 1])
    return wall, json.loads((out / "summary.json").read_text())


def _store_label(path: Path) -> str:
    return "".join(c if c.isalnum() else "_" for c in path.stem).strip("_").lower() or "store"


def measure_store(
    store: Path,
    label: str,
    *,
    clients: int,
    rounds: int,
    flower: bool,
    methods=CEILING_METHODS,
    progress=None,
    timeout: float = 3600,
) -> dict:
    """The ``ceiling_<label>_*`` keys of one store (see the module docstring)."""
    rec: dict = {}
    found: dict = {}
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="fedhead-ceiling-") as tmp:
        for m in methods:
            if progress:
                progress(f"ceiling {label}: {m}, where is 99% of the central ceiling")
            cfg = replace(_config(store, m, clients, rounds, central=True), plots=False)  # only the timed runs draw
            res = run_training(cfg, out=Path(tmp, f"find-{m}"), progress=False)
            found[m] = (res.rows, float(res.summary.get("central_own_accuracy", res.summary["central_accuracy"])))
        best = max(c for _, c in found.values())
        rec[f"ceiling_{label}_best_central"] = best
        for m in methods:
            rows, own = found[m]
            key = f"ceiling_{label}_{m}"
            rec[f"{key}_central"] = own
            rec[f"{key}_final_accuracy"] = float(rows[-1]["accuracy"])
            r_own, r_best = _first_at(rows, 0.99 * own), _first_at(rows, 0.99 * best)
            rec[f"{key}_rounds_to_99_own"], rec[f"{key}_rounds_to_99_best"] = r_own, r_best
            for target, r in (("own", r_own), ("best", r_best)):
                if r is None or (target == "best" and r == r_own):
                    continue
                if progress:
                    progress(f"ceiling {label}: {m}, {r} round(s) timed as a user runs them")
                cfg = _config(store, m, clients, r, central=False)
                exp = Path(tmp, f"{m}-{r}.toml")
                exp.write_text(resolved_toml(cfg))
                wall, summary = _timed(
                    ["train", "--config", str(exp), "--out", str(Path(tmp, f"t-{m}-{r}"))], repo, timeout
                )
                if abs(summary["final_accuracy"] - float(rows[r - 1]["accuracy"])) > 1e-12:
                    raise FedheadError(f"time to the ceiling: {m} with {r} rounds did not repeat the first run's round")
                rec[f"{key}_seconds_to_99_{target}"] = wall
                rec[f"{key}_accuracy_at_99_{target}"] = float(rows[r - 1]["accuracy"])
                rec[f"{key}_run_seconds_to_99_{target}"] = float(summary["wall_seconds"])
                if flower and target == "own":
                    if progress:
                        progress(f"ceiling {label}: {m}, the same {r} round(s) on flower simulate")
                    fwall, fsum = _timed(
                        ["flower", "simulate", "--config", str(exp), "--out", str(Path(tmp, f"f-{m}-{r}"))],
                        repo,
                        timeout,
                    )
                    rec[f"{key}_flower_seconds_to_99_own"] = fwall
                    rec[f"{key}_flower_accuracy"] = float(fsum["final_accuracy"])
                    rec[f"{key}_flower_vs_train"] = fwall / wall
            if r_best is not None and r_best == r_own:
                for k in ("seconds", "run_seconds"):
                    rec[f"{key}_{k}_to_99_best"] = rec[f"{key}_{k}_to_99_own"]
    return rec


def measure_ceiling(
    *,
    quick: bool,
    stores: list[Path],
    clients: int | None = None,
    rounds: int | None = None,
    flower: bool = True,
    methods=CEILING_METHODS,
    progress=None,
) -> dict:
    """Time to the ceiling on the paper-scale synthetic store (written to a temporary file) and on ``stores``."""
    clients = clients or (10 if quick else 100)
    rounds = rounds or (5 if quick else 30)
    rec: dict = {"ceiling_clients": clients, "ceiling_max_rounds": rounds, "ceiling_partition": "shard(2)"}
    with tempfile.TemporaryDirectory(prefix="fedhead-ceiling-store-") as tmp:
        if progress:
            progress("ceiling: writing the paper-scale synthetic store" if not quick else "ceiling: a small store")
        synth = write_synthetic(Path(tmp, "paper.h5"), **(QUICK_STORE if quick else PAPER_STORE), seed=0)
        labels = ["quick" if quick else "paper"] + [_store_label(Path(s)) for s in stores]
        rec["ceiling_stores"] = labels
        for path, label in zip([synth, *map(Path, stores)], labels):
            rec.update(
                measure_store(
                    path, label, clients=clients, rounds=rounds, flower=flower, methods=methods, progress=progress
                )
            )
    return rec


def ceiling_table(rec: dict):
    """The rich table of the ``ceiling_*`` keys: a row per store and method."""
    from rich.table import Table

    t = Table(title="time to 99% of the central ceiling (a user's whole command, fresh process)")
    for col in (
        "store",
        "method",
        "own ceiling",
        "rounds",
        "seconds",
        "flower simulate s",
        "x faster",
        "best ceiling",
        "rounds",
        "seconds",
    ):
        t.add_column(col, justify="left" if col in ("store", "method") else "right")

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for label in rec.get("ceiling_stores", []):
        best = rec.get(f"ceiling_{label}_best_central")
        for m in CEILING_METHODS:
            k = f"ceiling_{label}_{m}"
            if f"{k}_central" not in rec:
                continue
            t.add_row(
                label,
                m,
                f(100 * rec[f"{k}_central"], ".2f"),
                f(rec.get(f"{k}_rounds_to_99_own"), "d"),
                f(rec.get(f"{k}_seconds_to_99_own"), ".1f"),
                f(rec.get(f"{k}_flower_seconds_to_99_own"), ".1f"),
                f(rec.get(f"{k}_flower_vs_train"), ".1f"),
                f(100 * best, ".2f"),
                f(rec.get(f"{k}_rounds_to_99_best"), "d"),
                f(rec.get(f"{k}_seconds_to_99_best"), ".1f"),
            )
    return t
