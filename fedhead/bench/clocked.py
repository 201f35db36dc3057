"""``fedhead bench async``: synchronous rounds, synchronous rounds with a deadline and over-selection, FedBuff and
FedAsync on the same store and the same simulated clients (:mod:`fedhead.core.clock`, stragglers by default), on one
axis of simulated time: time-to-accuracy curves (``time-to-accuracy.png``) and a table (``async.csv``, the report).

Every rule gets the same client work: the synchronous runs ``--rounds`` rounds of ``m`` clients, FedBuff
``rounds x m / K`` server updates of ``K`` updates, FedAsync ``rounds x m`` updates of one. The deadline is, unless
given, the ``--deadline-quantile`` quantile of the clients' dispatch times of the first seed (the stragglers miss it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from fedhead.bench.grid import FEATURES_OPT, Common, grid_command, publish_report, start_report
from fedhead.bench.report import Cell, StoreCache, resolve_partition, run_grid
from fedhead.core.clock import TimingModel
from fedhead.core.sampling import per_round
from fedhead.federation import plots as P
from fedhead.federation.rundir import write_csv
from fedhead.infra.errors import Interval, validate

RULES = ("sync", "sync-deadline", "fedbuff", "fedasync")
QUICK = {"rounds": 20, "clients": 50, "clients_per_round": 10, "stragglers": 0.2}
TABLE = "async.csv"
PNG = "time-to-accuracy.png"


@grid_command("async", clients=50, defaults={"stragglers": (0.2, "0.2 (the bench's)")})
def async_cmd(
    features: Path = FEATURES_OPT,
    partition: str = typer.Option("dirichlet", "--partition", help="the partition of every run (e.g. iid, shard-2)"),
    buffer: Optional[int] = typer.Option(None, "--buffer", help="FedBuff's K (default: half the clients per round)"),
    deadline_s: Optional[float] = typer.Option(None, "--deadline-s", help="the deadline of sync-deadline, seconds"),
    deadline_quantile: float = typer.Option(
        0.8, "--deadline-quantile", help="without --deadline-s: this quantile of the clients' dispatch times"
    ),
    over: float = typer.Option(0.3, "--over", help="sync-deadline's over-selection F (Bonawitz et al. 2019: 0.3)"),
    target: float = typer.Option(0.95, "--target", help="time to this fraction of the best final accuracy"),
    *,
    common: Common,
):
    """Synchronous rounds, a deadline with over-selection, FedBuff and FedAsync with stragglers on one axis of
    simulated time: time-to-accuracy curves and a table."""
    validate("--deadline-quantile", deadline_quantile, Interval(0, 1, closed="right"))
    validate("--over", over, Interval(0, None))
    validate("--target", target, Interval(0, 1, closed="right"))
    cache = StoreCache()
    cells = async_cells(common, features, cache, resolve_partition(partition), buffer, deadline_s, deadline_quantile,
                        over)  # fmt: skip
    config = {**common.describe(), "features": str(features), "partition": partition, "buffer": buffer, "over": over, "target": target,
              "deadline_s": cells[1].cfg.deadline}  # fmt: skip
    cmd = start_report(common, cells, cache, config)
    results = run_grid(cells, common.out, cache)
    table = time_to_accuracy([(r.cell.name, r.rows) for r in results], target)
    write_csv(common.out / TABLE, table, list(table[0]))
    plot = write_time_curves(common.out / PNG, [(r.cell.name, r.rows) for r in results])
    publish_report(common, "async", "fedhead bench async (issue 40)", cmd, config, results,
                   [section(table, target, cells)], [plot])  # fmt: skip


def async_cells(
    common: Common,
    features: Path,
    cache: StoreCache,
    partition: tuple,
    buffer: int | None,
    deadline_s: float | None,
    quantile: float,
    over: float,
) -> list[Cell]:
    """The four runs (see the module docstring), each with the same client work."""
    given = common.given
    rounds = common.rounds if "rounds" in given else QUICK["rounds"]
    seeds = common.seeds if "seeds" in given else [0]
    kw = {k: v for k, v in QUICK.items() if k not in ("rounds", "clients") and k not in given}
    kw.update(partition=partition[0], partition_params=partition[1])
    base = common.cfg(features, seeds=seeds, rounds=rounds, **kw)
    resolved = base.resolved()
    m = per_round(resolved)
    k = buffer or max(1, m // 2)
    deadline = deadline_s or default_deadline(resolved, cache.get(resolved.features), quantile)
    runs = {
        "sync": {},
        "sync-deadline": dict(deadline=deadline, over_selection=over),
        "fedbuff": dict(async_rule="fedbuff", buffer_size=k, rounds=math.ceil(rounds * m / k)),
        "fedasync": dict(async_rule="fedasync", rounds=rounds * m),
    }
    return [Cell(name, {"rule": name}, common.cfg(features, seeds=seeds, **{"rounds": rounds, **kw, **extra}))
            for name, extra in runs.items()]  # fmt: skip


def default_deadline(cfg, store, quantile: float) -> float:
    """The ``quantile`` of the clients' dispatch seconds of the first seed (mean client size; the head both ways)."""
    n = len(store.train_y) / cfg.clients
    work = cfg.local_steps * cfg.batch_size if cfg.local_steps else cfg.local_epochs * n
    head_bytes = 4 * store.info.num_classes * (store.train_x.shape[1] + 1)
    t = TimingModel.from_config(cfg).durations(cfg.seeds[0], np.full(cfg.clients, work), head_bytes, head_bytes)
    return float(np.quantile(t, quantile))


def _curve(rows: list) -> tuple[np.ndarray, np.ndarray]:
    """The first seed's (simulated seconds, accuracy) on its evaluated rounds."""
    rows = [r for r in rows if r.get("seed") == rows[0].get("seed") and r.get("stage") != "ccvr"]
    pts = [(float(r["sim_time_s"]), float(r["accuracy"])) for r in rows if float(r["accuracy"]) == float(r["accuracy"])]
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts])


def time_to_accuracy(runs: list[tuple[str, list]], target: float) -> list[dict]:
    """Per run (first seed): the final accuracy, the simulated seconds at its end, and the first simulated time at
    which it reached ``target`` x the best final accuracy of all runs (empty: never)."""
    curves = {name: _curve(rows) for name, rows in runs}
    best = max(float(y[-1]) for _, y in curves.values() if len(y))
    goal = target * best
    table = []
    for name, rows in runs:
        x, y = curves[name]
        hit = np.flatnonzero(y >= goal)
        table.append({"rule": name, "updates": len([r for r in rows if r.get("seed") == rows[0].get("seed")]),
                      "final_accuracy": float(y[-1]), "sim_time_end_s": float(x[-1]), "target_accuracy": goal,
                      "time_to_target_s": float(x[hit[0]]) if len(hit) else None})  # fmt: skip
    return table


def write_time_curves(path: Path, runs: list[tuple[str, list]]) -> Path:
    panel = P.Panel("test accuracy against simulated time")
    for name, rows in runs:
        x, y = _curve(rows)
        panel.lines.append(P.Line(name, x, y, marker=""))
    return P.write_curves(path, [panel], "simulated seconds (sim_time_s, log scale)", "test accuracy", xscale="log")


def section(table: list[dict], target: float, cells: list[Cell]) -> str:
    c = cells[1].cfg
    lines = [
        f"## Time to {target:.0%} of the best final accuracy ({table[0]['target_accuracy']:.4f})",
        "",
        f"Clients: {c.clients}, {per_round(c.resolved())} per round; speeds log-normal (sigma {c.timing_sigma:g}) "
        f"around {c.client_speed:g} samples/s and {c.client_bandwidth:g} bytes/s, {c.stragglers:g} of them "
        f"{c.straggler_slowdown:g}x slower, dropout {c.dropout:g}; sync-deadline: --deadline {c.deadline:.3g} s, "
        f"--over-selection {c.over_selection:g}.",
        "",
        "| rule | server updates | final accuracy | simulated s at the end | s to target |",
        "|---|---|---|---|---|",
    ]
    for r in table:
        hit = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        lines.append(
            f"| {r['rule']} | {r['updates']} | {r['final_accuracy']:.4f} | {r['sim_time_end_s']:.1f} | {hit} |"
        )
    return "\n".join(lines)
