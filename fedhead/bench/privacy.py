"""``fedhead bench privacy``: accuracy against the privacy budget, and what the protections cost.

For each method (iterative heads under DP-FedAvg, closed-form heads under the Gaussian mechanism on their summed
statistics; fedhead.core.dp) and partition, one run per target epsilon plus one without DP. The noise multiplier of a
run is the smallest z whose final epsilon (the run's own accountant, fedhead.core.dp.epsilon_schedule, at
``--dp-delta``) is at most the target: found by bisection on the accountant, so the runs' epsilons are what their
summaries report, not a table of z values. An iterative head's epsilon is client level (its head updates); a
closed-form head's, sample level (its one release of statistics); an iterative head that centres its features
also releases the feature sums once, at a sample-level epsilon reported beside it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer

from fedhead.bench.baselines import _partition, methods_and_partitions
from fedhead.bench.grid import (
    FEATURES_OPT,
    Common,
    grid_command,
    parse_rates,
    publish_report,
    start_report,
)
from fedhead.bench.report import (
    Cell,
    CellResult,
    Stat,
    StoreCache,
    md_table,
    run_grid,
)
from fedhead.core.closedform import is_closed_form
from fedhead.core.dp import epsilon_schedule
from fedhead.federation import plots as P
from fedhead.federation.rundir import read_csv
from fedhead.flower.common import require_flower
from fedhead.infra.errors import FedheadError, Interval, validate
from fedhead.infra.files import atomic_write_json
from fedhead.interface.options import deprecated_flag

METHODS = ("ova2", "softmax", "ridge", "ncm")
NONE = "none"  # the run without DP
Z_RANGE = (0.05, 500.0)  # noise multipliers the bisection searches


def noise_for_epsilon(cfg, epsilon: float, tol: float = 1e-3) -> float:
    """The smallest noise multiplier z (to ``tol`` relative) whose final epsilon for ``cfg`` (resolved, DP fields
    set; its z is replaced) is at most ``epsilon``."""
    last = 1 if is_closed_form(cfg.head) else cfg.rounds

    def eps(z: float) -> float:
        return float(epsilon_schedule(dataclasses.replace(cfg, dp_noise_multiplier=z), last)[last]["dp_epsilon"])

    lo, hi = Z_RANGE
    if eps(hi) > epsilon:
        raise FedheadError(
            f"The '--epsilons' parameter asks for epsilon {epsilon:g}, which needs a noise multiplier "
            f"above {hi:g} for {cfg.head} over {last} round(s). Use a larger epsilon or fewer "
            "--rounds."
        )
    if eps(lo) <= epsilon:
        return lo
    while hi / lo > 1 + tol:  # eps decreases in z
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if eps(mid) > epsilon else (lo, mid)
    return hi


@grid_command("privacy", defaults={"dp_delta": (1e-5, "1e-05, of every epsilon")})
def privacy_cmd(
    features: Path = FEATURES_OPT,
    methods: str = typer.Option(
        ",".join(METHODS), "--methods", help="comma-separated: ova2, softmax (DP-FedAvg), ridge, ncm (noisy statistics)"
    ),
    partition: List[str] = typer.Option(["iid,shard-2"], "--partition", help="partitions, repeated or comma-separated"),
    partitions: Optional[str] = typer.Option(None, "--partitions", hidden=True),
    epsilons: str = typer.Option(
        "1,3,8", "--epsilons", help="target epsilons (each run: the smallest noise multiplier that meets it)"
    ),
    delta: Optional[float] = typer.Option(None, "--delta", hidden=True),
    update_clip: float = typer.Option(1.0, "--update-clip", help="iterative heads: L2 clip of a client's update"),
    feature_clip: float = typer.Option(
        50.0,
        "--feature-clip",
        help="L2 clip of each feature vector in statistics (closed-form heads, the centring sums)",
    ),
    dp_ridge_lambda: float = typer.Option(
        1e5,
        "--dp-ridge-lambda",
        help="ridge's lambda under DP (at the scale of the Gram's noise; without DP: --ridge-lambda)",
    ),
    secagg_clients: int = typer.Option(
        10,
        "--secagg-clients",
        help="SecAgg+'s cost: clients of the secure and plain Flower runs per method, in process (0: skip)",
    ),
    secagg_rounds: int = typer.Option(3, "--secagg-rounds", help="rounds of those runs (iterative heads)"),
    *,
    common: Common,
):
    """Accuracy against epsilon (DP-FedAvg for iterative heads, noisy statistics for closed-form heads) and the
    time and bytes DP adds, against the same runs without DP."""
    names, plabels, parts = methods_and_partitions(methods, partition, METHODS, old=partitions)
    eps = parse_rates("--epsilons", epsilons, low_closed=False, high=None)
    delta = _delta(common, delta)
    _check_privacy_options(common, update_clip, feature_clip, dp_ridge_lambda, secagg_clients, secagg_rounds)
    cells = _privacy_cells(
        common, features, names, plabels, parts, eps, delta, update_clip, feature_clip, dp_ridge_lambda
    )
    elabels = [f"{e:g}" for e in eps] + [NONE]
    config = {
        **common.describe(),
        "methods": names,
        "partitions": plabels,
        "epsilons": eps,
        "delta": delta,
        "update_clip": update_clip,
        "feature_clip": feature_clip,
        "dp_ridge_lambda": dp_ridge_lambda,
        "features": str(features),
    }
    cache = StoreCache()
    cmd = start_report(common, cells, cache, config)
    results = run_grid(cells, common.out, cache)
    sections = _sections(results, names, plabels, elabels, common, config)
    if secagg_clients:
        sections.append(_secagg_section(features, names, plabels[0], secagg_clients, secagg_rounds, common))
    plots = [_plot(results, names, plabels, eps, common)]
    publish_report(
        common,
        "privacy",
        "fedhead bench privacy: accuracy against epsilon, and the cost of DP",
        cmd,
        config,
        results,
        sections,
        plots,
    )


def _check_privacy_options(
    common: Common,
    update_clip: float,
    feature_clip: float,
    dp_ridge_lambda: float,
    secagg_clients: int,
    secagg_rounds: int,
) -> None:
    """Validate the command's own DP and SecAgg+ options, and refuse the DP options it sets per run."""
    validate("--update-clip", update_clip, Interval(0, None, closed="neither"))
    validate("--feature-clip", feature_clip, Interval(0, None, closed="neither"))
    validate("--dp-ridge-lambda", dp_ridge_lambda, Interval(0, None, closed="neither"))
    validate("--secagg-rounds", secagg_rounds, Interval(1, None, integer=True))
    if secagg_clients:
        validate(
            "--secagg-clients",
            secagg_clients,
            Interval(3, None, integer=True),
            "SecAgg+ needs at least 3 clients; use 0 to skip its measurement.",
        )
        require_flower()
    for k in ("dp_noise_multiplier", "dp_clip", "dp_feature_clip"):
        if common.train.get(k) is not None:
            raise FedheadError(
                f"The '--{k.replace('_', '-')}' option is set per run by 'bench privacy'. Got "
                f"{common.train[k]!r}. Use --epsilons, --dp-delta, --update-clip and --feature-clip."
            )


def _privacy_cells(
    common: Common,
    features: Path,
    names: list[str],
    plabels: list[str],
    parts: dict,
    eps: list[float],
    delta: float,
    update_clip: float,
    feature_clip: float,
    dp_ridge_lambda: float,
) -> list[Cell]:
    """For each method and partition: the run without DP and one run per target epsilon, each with the smallest
    noise multiplier that meets it."""
    cells, zs = [], {}
    for m in names:
        closed = is_closed_form(m)
        for p in plabels:
            pname, pparams = parts[p]
            base = {"head": m, "partition": pname, "partition_params": pparams}
            cells.append(
                Cell(f"{m}--{p}--{NONE}", {"method": m, "partition": p, "epsilon": NONE}, common.cfg(features, **base))
            )
            for e in eps:
                dp = {"dp_delta": delta, "dp_clip": feature_clip if closed else update_clip}
                if not closed:
                    dp["dp_feature_clip"] = feature_clip
                kw = dict(base, **dp, dp_noise_multiplier=1.0)
                if m == "ridge":
                    kw["ridge_lambda"] = dp_ridge_lambda
                cfg = common.cfg(features, **kw)
                z = zs.setdefault((m, p, e), noise_for_epsilon(cfg.resolved(), e))
                cells.append(
                    Cell(
                        f"{m}--{p}--eps{e:g}",
                        {"method": m, "partition": p, "epsilon": f"{e:g}"},
                        dataclasses.replace(cfg, dp_noise_multiplier=z),
                    )
                )
    return cells


def _delta(common: Common, old: float | None) -> float:
    """Every run's delta: --dp-delta (default 1e-5), or the deprecated --delta (the option's name before it joined
    the other DP options); set per run, so taken out of the options passed on to the runs."""
    if old is not None:
        deprecated_flag("--delta", "--dp-delta")
        common.train["dp_delta"] = old
    common.given.discard("dp_delta")
    delta = common.train.pop("dp_delta")
    return validate("--dp-delta", delta, Interval(0, 1, closed="neither"), "Use e.g. --dp-delta 1e-5 (below 1/N).")


def _key(r: CellResult) -> tuple:
    return r.cell.labels["method"], r.cell.labels["partition"], r.cell.labels["epsilon"]


def _sections(results, names, plabels, elabels, common: Common, config: dict) -> list[str]:
    by = {_key(r): r for r in results}
    seeds = ", ".join(map(str, common.seeds))
    out = []
    heads = ["method", "partition"] + [f"eps {e}" if e != NONE else "no DP" for e in elabels]
    rows = [
        [m, p] + [Stat.of(by[(m, p, e)].per_seed("final_accuracy")).fmt(100, 2) for e in elabels]
        for m in names
        for p in plabels
    ]
    out.append(
        "\n".join(
            [
                f"## Final test accuracy (%) against epsilon (delta {config['delta']:g}; {common.clients} clients, "
                f"{common.rounds} rounds for iterative heads, seeds {seeds})",
                "",
                "Iterative heads (ova2, softmax): DP-FedAvg, client-level epsilon of the head updates (update clip "
                f"{config['update_clip']:g}; their feature centring sums add the sample-level epsilon in the next table). "
                "Closed-form heads (ridge, ncm): one release of noisy statistics, sample-level epsilon (feature clip "
                f"{config['feature_clip']:g}; ridge's lambda {config['dp_ridge_lambda']:g} under DP, its default without).",
                "",
                md_table(heads, rows),
                "",
            ]
        )
    )
    rows = []
    for m in names:
        for e in elabels:
            if e == NONE:
                continue
            rs = [by[(m, p, e)] for p in plabels]
            z = rs[0].cell.cfg.dp_noise_multiplier
            rows.append(
                [
                    m,
                    e,
                    f"{z:.4g}",
                    Stat.of([r.summary.get("dp_epsilon") for r in rs]).fmt(1, 3),
                    Stat.of([r.summary.get("dp_epsilon_statistics") for r in rs]).fmt(1, 3),
                ]
            )
    out.append(
        "\n".join(
            [
                "## Noise multipliers and the epsilons the runs report",
                "",
                "z: the smallest noise multiplier meeting the target (bisection on the run's own RDP accountant); "
                "epsilon: summary.json's dp_epsilon; statistics: the sample-level epsilon of the feature sums or the "
                "closed-form statistics.",
                "",
                md_table(["method", "target", "z", "epsilon (reported)", "statistics epsilon"], rows),
                "",
            ]
        )
    )
    rows = []
    for m in names:
        dp = [by[(m, p, e)] for p in plabels for e in elabels if e != NONE]
        plain = [by[(m, p, NONE)] for p in plabels]

        def mean(rs, key):
            return float(np.nanmean([Stat.of(r.per_seed(key)).mean for r in rs]))

        rows.append(
            [m]
            + [f"{mean(rs, 'client_ms'):.2f}" for rs in (plain, dp)]
            + [f"{mean(rs, 'server_ms'):.2f}" for rs in (plain, dp)]
            + [f"{mean(rs, 'mb_per_client'):.3f}" for rs in (plain, dp)]
        )
    out.append(
        "\n".join(
            [
                "## What DP costs in time and bytes (mean over partitions and epsilons)",
                "",
                "client ms: per client and round; server ms: per round (DP: clipping on the client, noise on the server); "
                "MB: uploaded per client over the run (a DP message is the clipped update, the size of a head).",
                "",
                md_table(
                    [
                        "method",
                        "client ms",
                        "client ms (DP)",
                        "server ms",
                        "server ms (DP)",
                        "MB up/client",
                        "MB up/client (DP)",
                    ],
                    rows,
                ),
                "",
            ]
        )
    )
    return out


def _plot(results, names, plabels, eps, common: Common) -> Path:
    by = {_key(r): r for r in results}
    panels = []
    for p in plabels:
        panel = P.Panel(p)
        for m in names:
            accs = [Stat.of(by[(m, p, f"{e:g}")].per_seed("final_accuracy")) for e in eps]
            panel.lines.append(P.Line(m, eps, [a.mean for a in accs], [a.std for a in accs]))
            plain = Stat.of(by[(m, p, NONE)].per_seed("final_accuracy")).mean
            panel.lines.append(P.Line(f"{m} (no DP)", [min(eps), max(eps)], [plain, plain], style=":"))
        panels.append(panel)
    return P.write_curves(
        common.out / "privacy-accuracy.png",
        panels,
        "epsilon (delta fixed)",
        "final test accuracy",
        "accuracy against the privacy budget (dotted: without DP)",
        xscale="log",
    )


def _secagg_run(cfg, out: Path) -> tuple[dict, list[dict], float]:
    """(summary, rows, wall seconds) of one in-process Flower run; a finished run in ``out`` is reused."""
    import json
    import shutil
    import time

    from fedhead.flower.inprocess import run_in_process

    done = out / "summary.json"
    if done.exists() and (out / "wall.json").exists():
        return json.loads(done.read_text()), read_csv(out / "rounds.csv"), json.loads((out / "wall.json").read_text())
    if out.exists():
        shutil.rmtree(out)  # an interrupted run: these runs are short, run it again
    t0 = time.perf_counter()
    res = run_in_process(cfg, out)
    wall = time.perf_counter() - t0

    atomic_write_json(out / "wall.json", wall)
    return res.summary, res.rows, wall


def _secagg_section(features, names, partition: str, clients: int, rounds: int, common: Common) -> str:
    """SecAgg+'s bytes and seconds against the same Flower run without it (fedhead.flower.secure), per method."""
    pname, pparams = _partition(partition)
    rows = []
    for m in names:
        res = {}
        for secure in (False, True):
            cfg = common.cfg(
                features,
                head=m,
                partition=pname,
                partition_params=pparams,
                secure_aggregation=secure,
                val_fraction=0.0,  # SecAgg+ holds no validation part: the plain run trains on the same data
                clients=clients,
                seeds=[common.seeds[0]],
                **({} if is_closed_form(m) else {"rounds": rounds}),
            )
            res[secure] = _secagg_run(cfg, common.out / "secagg" / f"{m}-{'secure' if secure else 'plain'}")
        (_, rp, wp), (_, rs, ws) = res[False], res[True]
        n = len(rp)
        up_p = float(np.mean([float(r["bytes_up_per_client"]) for r in rp])) / 1e6
        up_s = float(np.mean([float(r["bytes_up_per_client"]) for r in rs])) / 1e6
        same = len(rp) == len(rs) and all(
            abs(float(a["accuracy"]) - float(b["accuracy"])) < 1e-9 for a, b in zip(rp, rs)
        )
        kind = "statistics, once" if is_closed_form(m) else f"{n} rounds"
        rows.append(
            [
                m,
                kind,
                f"{up_p:.3f}",
                f"{up_s:.3f}",
                f"{up_s / up_p:.2f}x" if up_p else "–",
                f"{wp / n:.2f}",
                f"{ws / n:.2f}",
                "yes" if same else "no",
            ]
        )
    return "\n".join(
        [
            f"## What SecAgg+ costs ({clients} clients, {partition}, seed {common.seeds[0]}; Flower in process)",
            "",
            "The same Flower run with and without --secure-aggregation (Flower's SecAggPlusWorkflow and secaggplus_mod; "
            "fedhead.flower.secure), every message serialised as on the wire but no network: seconds are compute and "
            "serialisation only (each secure exchange adds three round trips on a real network). MB: uploaded per client "
            "per round (secure: all of SecAgg+'s messages); s: wall seconds per round of the whole run.",
            "",
            md_table(
                [
                    "method",
                    "exchanges",
                    "MB up/client (plain)",
                    "MB up/client (SecAgg+)",
                    "bytes",
                    "s/round (plain)",
                    "s/round (SecAgg+)",
                    "same accuracy",
                ],
                rows,
            ),
            "",
        ]
    )
