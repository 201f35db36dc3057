"""``fedhead bench baselines``: every method for federated heads on frozen features, ranked against the
centralised ceiling, in one report.

A method is a name and the :class:`fedhead.federation.config.TrainConfig` fields that make it (:data:`METHODS`): the
closed-form statistics heads, closed-form start + fine-tuning, the iterative heads under FedAvg, FedProx,
SCAFFOLD and server optimisers, FedLC, FedRS, FedABC and CCVR. Every run carries ``--central-reference``, so
the report leads with the ratio to the ceiling of the same head (trained centrally on the pooled data to
convergence); the ratio to the IID run of the same method stays beside it. Plots: accuracy per round, and
accuracy against the cumulative MB each client uploaded (the communication frontier).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import numpy as np
import typer

from fedhead.bench.grid import (
    FEATURES_OPT,
    Common,
    grid_command,
    pair_with_iid,
    parse_names,
    publish_report,
    start_report,
)
from fedhead.bench.report import (
    Cell,
    CellResult,
    Stat,
    StoreCache,
    md_table,
    mean_curve,
    resolve_partition,
    run_grid,
)
from fedhead.bench.sketch import sketch_cells, sketch_lines, sketch_plot, sketch_section
from fedhead.bench.yardstick import tuned_central, yardstick_section
from fedhead.core.plugins import load_plugins
from fedhead.federation import plots as P
from fedhead.federation.methods import METHODS
from fedhead.infra.errors import FedheadError, unknown_name
from fedhead.interface.options import deprecated_flag

DEFAULT_PARTITIONS = ("iid", "shard-1", "shard-2", "dirichlet-0.1", "bernoulli-dirichlet")


def _partition(label: str) -> tuple[str, dict]:
    if label.startswith("dirichlet-"):
        try:
            return "dirichlet", {"alpha": float(label.split("-", 1)[1])}
        except ValueError:
            pass
    try:
        return resolve_partition(label)
    except FedheadError as exc:
        raise FedheadError(str(exc) + " Or dirichlet-ALPHA, e.g. dirichlet-0.1.") from None


def methods_and_partitions(
    methods: str, partitions, known, old: str | None = None
) -> tuple[list[str], list[str], dict]:
    """``--methods`` (each one of ``known``) and ``--partition`` (repeated or comma-separated; ``old``: the value
    of the deprecated ``--partitions``) of a bench command: the method names, the partition labels and label ->
    (partition, parameters)."""
    names = _csv("--methods", methods)
    for m in names:
        if m not in known:
            raise unknown_name("--methods", m, known, "method")
    if old is not None:
        deprecated_flag("--partitions", "--partition", " (repeated or comma-separated)")
        partitions = [old]
    plabels = _csv("--partition", partitions)
    return names, plabels, {p: _partition(p) for p in plabels}


def _csv(param: str, text) -> list[str]:
    items = parse_names(text, param)
    if not items:
        raise FedheadError(f"The '{param}' parameter needs at least one value. Got {text!r} instead.")
    return items


@grid_command("baselines")
def baselines_cmd(
    features: Path = FEATURES_OPT,
    methods: str = typer.Option(
        ",".join(METHODS), "--methods", help="comma-separated methods (see the report's method table)"
    ),
    partition: List[str] = typer.Option(
        [",".join(DEFAULT_PARTITIONS)],
        "--partition",
        help="partitions, repeated or comma-separated (presets, registry names, dirichlet-ALPHA)",
    ),
    partitions: Optional[str] = typer.Option(None, "--partitions", hidden=True),
    recipe: str = typer.Option("default", "--recipe", help="training recipe of the iterative methods"),
    sketch_dims: Optional[str] = typer.Option(
        None,
        "--sketch-dims",
        help="comma-separated r: run ridge, lda, qda and fast (those of --methods) again with --stats-sketch r each, "
        "and draw their bytes/accuracy frontier (baselines-sketch.png)",
    ),
    *,
    common: Common,
):
    """Closed-form heads, closed-form + fine-tuning and the classic FL baselines against the central ceiling."""
    load_plugins()  # methods registered by users' modules
    names, plabels, parts = methods_and_partitions(methods, partition, METHODS, old=partitions)
    cells = []
    for m in names:
        for p in plabels:
            pname, pparams = parts[p]
            kw = {
                **METHODS[m][1],
                "partition": pname,
                "partition_params": pparams,
                "recipe": recipe,
                "central_reference": True,
            }
            cells.append(Cell(f"{m}--{p}", {"method": m, "partition": p}, common.cfg(features, **kw)))
    dims = sketch_cells(cells, sketch_dims, names, plabels, parts, recipe, features, common)
    config = {
        **common.describe(),
        "methods": {m: METHODS[m][0] for m in names},
        "partitions": plabels,
        "recipe": recipe,
        "features": str(features),
        **({"sketch_dims": dims} if dims else {}),
    }
    cache = StoreCache()
    cmd = start_report(common, cells, cache, config)
    results = run_grid(cells, common.out, cache)
    pair_with_iid(results)
    tuned = tuned_central(cache.get(str(features)), list(common.seeds), common.out)  # the stronger yardstick
    config["tuned_central"] = tuned
    sketched = [r for r in results if "sketch" in r.cell.labels]
    results = [r for r in results if "sketch" not in r.cell.labels]
    sections = _sections(results, names, plabels, common, tuned)
    plots = _plots(results, names, plabels, common, sketched)
    if sketched:
        sections.append(sketch_section(results, sketched, plabels))
        plots.append(sketch_plot(common.out / "baselines-sketch.png", results, sketched, plabels))
    results = results + sketched
    publish_report(
        common,
        "baselines",
        "fedhead bench baselines: every method against the centralised ceiling",
        cmd,
        config,
        results,
        sections,
        plots,
    )


def _stat(r: CellResult, key: str) -> Stat:
    return Stat.of(r.per_seed(key))


def _reached(r: CellResult, key: str, digits: int) -> str:
    vals = r.per_seed(key)
    got = [v for v in vals if v is not None]
    if not got:
        return "not reached"
    s = Stat.of(got).fmt(1, digits)
    return s if len(got) == len(vals) else f"{s} ({len(got)}/{len(vals)} seeds)"


def _sections(
    results: list[CellResult], names: list[str], plabels: list[str], common: Common, tuned: dict
) -> list[str]:
    by = {(r.cell.labels["method"], r.cell.labels["partition"]): r for r in results}
    return [
        _central_ratio_table(by, names, plabels, common),
        _best_ceiling_table(by, names, plabels),
        _accuracy_table(by, names, plabels, tuned),
        _client_accuracy_table(by, names, plabels),
        yardstick_section(by, names, plabels, tuned),
        _to_99_table(by, names, plabels),
        _iid_cost_table(by, names, plabels),
        "\n".join(["## Methods", "", md_table(["method", "what"], [[m, METHODS[m][0]] for m in names]), ""]),
    ]


def _central_ratio_table(by: dict[tuple, CellResult], names: list[str], plabels: list[str], common: Common) -> str:
    """The ratio of each method's final accuracy to the run's tuned central ceiling, method x partition."""
    seeds = ", ".join(map(str, common.seeds))
    rows = []
    for m in names:
        rows.append([m] + [_stat(by[(m, p)], "final_ratio_to_central").fmt(100, 1) for p in plabels])
    return _section(
        f"## Ratio to the central ceiling (%), final round ({common.clients} clients, up to {common.rounds} rounds, "
        f"seeds {seeds})",
        "The ceiling is --central-reference's tuned ceiling: of the same head trained centrally to convergence, a "
        "softmax probe with its L2 weight chosen on validation and the central ridge and LDA solves, all on the "
        "pooled training parts, the one most accurate on the clients' pooled validation parts. A closed-form head "
        "runs one round.",
        ["method"] + plabels,
        rows,
    )


def _section(title: str, text: str, header: list[str], rows: list) -> str:
    """One section of the report: its heading, what it shows, its table."""
    return "\n".join([title, "", text, "", md_table(header, rows), ""])


def _best_ceiling_table(by: dict[tuple, CellResult], names: list[str], plabels: list[str]) -> str:
    """The ratio of each method's final accuracy to the best central ceiling of any method here: one yardstick."""
    ceilings = {m: _stat(by[(m, plabels[0])], "central_own_accuracy").mean for m in names}
    best_m = max(ceilings, key=lambda m: ceilings[m] if ceilings[m] == ceilings[m] else -1.0)
    best = ceilings[best_m]
    rows = [
        [m] + [Stat.of([v / best for v in by[(m, p)].per_seed("final_accuracy")]).fmt(100, 1) for p in plabels]
        for m in names
    ]
    return _section(
        f"## Ratio to the best ceiling of any method here (%): {best_m}'s central {100 * best:.2f}%",
        "Each head's own ceiling is the optimum of its own regularised objective; this table puts every method on "
        "one yardstick.",
        ["method"] + plabels,
        rows,
    )


def _accuracy_table(by: dict[tuple, CellResult], names: list[str], plabels: list[str], tuned: dict) -> str:
    """Each method's final accuracy per partition, its central ceiling and the tuned central probe (one number)."""
    probe = Stat.of([t["accuracy"] for t in tuned.values()]).fmt(100, 2)
    rows = [
        [m]
        + [_stat(by[(m, p)], "final_accuracy").fmt(100, 2) for p in plabels]
        + [_stat(by[(m, plabels[0])], "central_own_accuracy").fmt(100, 2), probe]
        for m in names
    ]
    return "\n".join(
        [
            "## Final test accuracy (%), the method's central ceiling and the tuned central probe",
            "",
            md_table(["method"] + plabels + ["central", "tuned central"], rows),
            "",
        ]
    )


def _client_accuracy_table(by: dict[tuple, CellResult], names: list[str], plabels: list[str]) -> str:
    """Per-client accuracy of each method's final head: the mean over clients, and the worst and best 10%."""
    keys = ("client_accuracy_mean", "client_accuracy_worst10", "client_accuracy_best10")

    def cell(r: CellResult) -> str:
        stats = [Stat.of([v for v in r.per_seed(k) if v is not None]) for k in keys]
        return " / ".join(s.fmt(100, 1) for s in stats)

    return _section(
        "## Per-client accuracy (%): mean / worst 10% / best 10% of clients, final round",
        "Each client's accuracy on test samples in its own training label proportions (FedABC's personalised "
        "protocol, applied to the global head: sum_c p_k(c) acc_c; docs/heads-methods-partitions.md).",
        ["method"] + plabels,
        [[m] + [cell(by[(m, p)]) for p in plabels] for m in names],
    )


def _to_99_table(by: dict[tuple, CellResult], names: list[str], plabels: list[str]) -> str:
    """The rounds and MB uploaded per client each method needs to reach 99% of its central ceiling."""
    rows = [
        [m]
        + [
            f"{_reached(by[(m, p)], 'rounds_to_99_central', 1)} / "
            f"{_reached(by[(m, p)], 'mb_per_client_to_99_central', 2)}"
            for p in plabels
        ]
        for m in names
    ]
    return "\n".join(
        [
            "## Rounds / MB uploaded per client to reach 99% of the central ceiling",
            "",
            md_table(["method"] + plabels, rows),
            "",
        ]
    )


def _iid_cost_table(by: dict[tuple, CellResult], names: list[str], plabels: list[str]) -> str:
    """Each method's ratio to its IID run per partition, and its cost in time and bytes."""
    rows = []
    for m in names:
        cells = [by[(m, p)] for p in plabels]
        rows.append(
            [m]
            + [r.derived.get("final_ratio_to_iid", Stat.of([])).fmt(100, 1) for r in cells]
            + [
                f"{np.nanmean([_stat(r, 'client_ms').mean for r in cells]):.2f}",
                f"{np.nanmean([_stat(r, 'server_ms').mean for r in cells]):.2f}",
                f"{np.nanmean([_stat(r, 'mb_per_client').mean for r in cells]):.3f}",
            ]
        )
    return _section(
        "## Ratio to the IID run of the same method (%), and cost",
        "client ms: per client and round (closed form: computing the statistics); server ms: per "
        "round; MB: uploaded per client over the whole run (mean over partitions).",
        ["method"] + plabels + ["client ms", "server ms", "MB up/client"],
        rows,
    )


def _plots(
    results: list[CellResult], names: list[str], plabels: list[str], common: Common, sketched: list[CellResult] = ()
) -> list[Path]:
    """The accuracy curves and the communication frontier: every method's accuracy against the cumulative MB each
    client uploaded (compressed updates included), with the compressed statistics' points (``--sketch-dims``)."""
    by = {(r.cell.labels["method"], r.cell.labels["partition"]): r for r in results}
    acc_panels, mb_panels = [], []
    for p in plabels:
        ap, mp = P.Panel(p), P.Panel(p)
        for m in names:
            r = by[(m, p)]
            x, y, sd = mean_curve(r)
            if x.size == 0:
                continue
            mb = _mb_curve(r)
            mp.lines.append(P.Line(m, mb[: len(y)], y[: len(mb)], marker="o" if len(mb) == 1 else None))
            one = x.size == 1
            if one:  # one exchange: a flat line over the rounds for comparison
                x, y, sd = np.array([1, common.rounds]), np.repeat(y, 2), np.repeat(sd, 2)
            ap.lines.append(P.Line(m, x, y, sd, style="--" if one else "-"))
        mp.lines.extend(sketch_lines(results, list(sketched), p) if sketched else [])
        acc_panels.append(ap)
        mb_panels.append(mp)
    return [
        P.write_curves(
            common.out / "baselines-accuracy.png",
            acc_panels,
            "round",
            "test accuracy",
            "accuracy per round (closed form: one exchange, dashed)",
        ),
        P.write_curves(
            common.out / "baselines-frontier.png",
            mb_panels,
            "MB uploaded per client (cumulative)",
            "test accuracy",
            "communication frontier",
            xscale="log",
        ),
    ]


def _mb_curve(r: CellResult) -> np.ndarray:
    """Cumulative MB uploaded per client at each evaluated round, mean over seeds."""
    per_seed: dict[int, list[float]] = {}
    for row in r.rows:
        if row.get("run", "main") != "main":
            continue
        per_seed.setdefault(int(row["seed"]), []).append(float(row["bytes_up_per_client"]) / 1e6)
    mats = [np.cumsum(v) for v in per_seed.values()]
    n = min(len(v) for v in mats) if mats else 0
    return np.mean([v[:n] for v in mats], 0) if mats else np.array([])
