"""``fedhead bench deploy --async``: synchronous rounds against FedBuff on a real loopback deployment with slow nodes.

The deployment is ``fedhead bench deploy``'s (:class:`fedhead.flower.churn.Churn`, which runs each mode: a SuperLink and one SuperNode per
client, each with its own share of the synthetic store), without churn and without the server's kill: ``--slow`` of
the nodes (drawn with ``--seed``) start with ``fedhead flower supernode --delay SLOW_DELAY``, so their train replies
leave that many seconds later. The same nodes, the same stores and the same slow ones run twice, one mode after the
other, each a fresh SuperLink and fresh node processes:

* ``sync``: ``--rounds`` synchronous rounds of every node (M = nodes): each round waits for the slow ones;
* ``fedbuff``: ``--async-rule fedbuff`` with ``--concurrency`` M and ``--buffer-size`` K (``--buffer``, default
  M / 2), ``ceil(rounds x M / K)`` server updates: the same total client work as the synchronous run (as
  ``fedhead bench async`` gives every rule on the simulated clock, :mod:`fedhead.bench.clocked`). A slow node's
  update arrives stale and is weighted by FedBuff's ``sqrt`` staleness rule.

Reported per mode (``deploy.json``, flat ``<mode>_`` keys, and a table): server updates, client updates (the work),
server updates that applied no client update (``empty_updates``: every reply an error; the bench then fails),
wall seconds from the SuperLink's start to its last server update, seconds to ``--target`` x the best final accuracy
of the two modes (None: never), the final accuracy, and the mean staleness of the applied client updates (0 for
synchronous rounds). Wall seconds include each mode's start (nodes connecting, the query): the same in both.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fedhead.federation.config import TrainConfig

MODES = ("sync", "fedbuff")


def slow_nodes(nodes: int, slow: float, seed: int) -> list[int]:
    """The ``round(slow x nodes)`` nodes that are slow, drawn with ``seed`` (the same for both modes)."""
    k = int(round(slow * nodes))
    return sorted(np.random.default_rng(seed).choice(nodes, size=k, replace=False).tolist()) if k else []


def mode_configs(base: TrainConfig, buffer: int) -> dict[str, TrainConfig]:
    """The two runs' configurations with the same client work: R rounds of M, or ceil(R x M / K) updates of K."""
    m, rounds = base.clients, base.rounds
    fedbuff = dict(async_rule="fedbuff", buffer_size=buffer, concurrency=m, rounds=math.ceil(rounds * m / buffer))
    return {"sync": base, "fedbuff": dataclasses.replace(base, **fedbuff)}


def _staleness(rows: list[dict]) -> float:
    """The mean staleness of the applied client updates (rows weighted by their clients; sync rounds: 0)."""
    pairs = [(float(r.get("staleness_mean") or 0.0), int(r.get("clients_trained") or 0)) for r in rows]
    n = sum(c for _, c in pairs)
    return sum(s * c for s, c in pairs) / n if n else 0.0


def summarize(results: dict[str, dict], target: float) -> dict:
    """Flat ``<mode>_`` records (see the module docstring); ``target_accuracy`` is ``target`` x the best final."""
    finals = {m: float(r["rows"][-1]["accuracy"]) if r["rows"] else float("nan") for m, r in results.items()}
    goal = target * max((v for v in finals.values() if v == v), default=float("nan"))
    rec: dict = {"target_accuracy": goal}
    for mode, r in results.items():
        rows, ends = r["rows"], r["ends"]
        hit = next((int(x["round"]) for x in rows if float(x["accuracy"]) >= goal), None)
        rec.update({
            f"{mode}_exit_code": r["code"],
            f"{mode}_server_updates": len(rows),
            f"{mode}_client_updates": sum(int(x.get("clients_trained") or 0) for x in rows),
            f"{mode}_empty_updates": sum(1 for x in rows if not int(x.get("clients_trained") or 0)),
            f"{mode}_wall_seconds": ends[max(ends)] if ends else None,
            f"{mode}_seconds_to_target": ends.get(hit) if hit is not None else None,
            f"{mode}_final_accuracy": finals[mode],
            f"{mode}_staleness_mean": _staleness(rows),
            f"{mode}_round_seconds": [round(b - a, 1) for a, b in zip([0.0, *ends.values()], ends.values())],
        })  # fmt: skip
    return rec


def async_table(rec: dict, title: str):
    from rich.table import Table

    t = Table(title=title)
    t.add_column("measure")
    for mode in MODES:
        t.add_column(mode, justify="right")
    measures = ("server_updates", "client_updates", "empty_updates", "wall_seconds", "seconds_to_target", "final_accuracy",
                "staleness_mean", "exit_code")  # fmt: skip
    for m in measures:
        vals = [rec.get(f"{mode}_{m}") for mode in MODES]
        t.add_row(m, *("—" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in vals))
    return t
