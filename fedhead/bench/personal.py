"""``fedhead bench personal``: the personalisation methods (``--personalize``) on the head path, in the shape of
FedABC's Table 1 (PFL accuracy) and Table 2 (drift), the paper's numbers beside.

Every cell of the grid is one ``fedhead train`` run with ``--personalize METHOD``: the federation trains a global
head, then every client gets its own head and is scored on its own local test set (FedABC's protocol,
:mod:`fedhead.core.personal`). A method (:data:`METHODS`) is its ``--personalize`` name, the global head it needs
(``fedrod`` a balanced-softmax one, ``closed-form`` the statistics of a closed-form head) and any federation option
it adds (``finetune+fedprox``: FedProx's proximal term). A preset (:data:`PRESETS`) is the federation's shape and
its columns (partitions). The runs, their reuse and resumption, the report folder and its one writer are the grid
machinery of the other bench commands (:mod:`fedhead.bench.grid`, :func:`fedhead.bench.report.run_grid`); besides
report.md, results.csv and curves.csv the folder holds table.csv and table.json: one row per method and column with
the runs' summary.json numbers the tables print.

The paper's numbers (:data:`fedhead.bench.papers.PAPER_FEDABC_T1`, ``..._T2``) were measured on CNNs trained from
raw images (``fedhead bench papers fedabc`` runs that protocol); these runs train linear heads on frozen features,
so the two are comparable in shape (the order of the methods, the trend over alpha), not in level.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer

from fedhead.bench.grid import (
    FEATURES_OPT,
    GRID_EXCLUDE,
    GRID_PROTOCOL,
    OUT_OPT,
    QUICK_OPT,
    Common,
    make_common,
    parse_names,
    parse_rates,
    publish_report,
    report_writer,
    start_report,
)
from fedhead.bench.papers import FEDABC_METHODS, FEDABC_NAMES, PAPER_FEDABC_T1, PAPER_FEDABC_T2
from fedhead.bench.report import (
    PARTITION_PRESETS,
    Cell,
    CellResult,
    Stat,
    StoreCache,
    check_head,
    md_table,
    run_grid,
)
from fedhead.core.closedform import is_closed_form
from fedhead.core.personal import PERSONAL_FIELDS
from fedhead.federation import plots as P
from fedhead.federation.rundir import write_csv
from fedhead.infra.errors import FedheadError, Interval, unknown_name, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_json
from fedhead.interface.options import ExperimentArgs, with_experiment_options

SEEDS = (0, 1, 2)
PAPER_DATASET = "CIFAR-10"  # the rows of FedABC's tables printed beside the table1 preset
NOT_COMPARABLE = (
    "The paper's columns were measured on CNNs trained from scratch on raw CIFAR-10 images; fedhead's rows train "
    "linear heads on frozen encoder features. The two are not comparable in level, only in shape (the order of the "
    "methods, the trend over alpha)."
)
HIDDEN = "n/a (needs a hidden layer)"


# ---------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    """A row of the table: its ``--personalize`` method, the global head it needs (None: ``--head``; "closed-form":
    ``--head`` when it is a closed-form head, else ridge), the federation options it adds, and FedABC's column it
    stands for (a key of :data:`fedhead.bench.papers.FEDABC_METHODS`)."""

    personalize: str
    what: str
    head: str | None = None
    fields: tuple = ()  # (TrainConfig field, value), ...: the federation's options
    paper: str | None = None


METHODS: dict[str, Method] = {
    "none": Method("none", "the global head itself on each local test set (the reference of every gain)"),
    "local": Method("local", "local-only training from a zero head (the federation is not used)", paper="local"),
    "finetune": Method("finetune", "FedAvg, then local epochs from the global head", paper="fedavg"),
    "finetune+fedprox": Method(
        "finetune", "FedProx (mu 0.01), then local epochs", fields=(("prox_mu", 0.01),), paper="fedprox"
    ),
    "finetune+scaffold": Method(
        "finetune", "SCAFFOLD, then local epochs", fields=(("scaffold", True),), paper="scaffold"
    ),
    "ditto": Method("ditto", "local epochs with Ditto's proximal pull towards the global head"),
    "apfl": Method("apfl", "APFL: a personal head mixed with the global one, the mixing weight learnt"),
    "fedrod": Method(
        "fedrod", "FedRoD: a balanced-softmax generic head plus a personal head", head="bsm", paper="fedrod"
    ),
    "fedabc": Method("fedabc", "local epochs of FedABC's binary one-vs-all loss from the global head", paper="fedabc"),
    "prior": Method("prior", "the global head's scores shifted by the client's log label prior (no training)"),
    "closed-form": Method(
        "closed-form", "the client's statistics plus beta times the global ones, solved on the client", head="closed"
    ),
}
DEFAULT_METHODS = ("none", "local", "finetune", "ditto", "apfl", "fedrod", "fedabc", "prior", "closed-form")
HIDDEN_METHODS = {"fedper": "FedPer", "fedrep": "FedRep", "lg": "LG-FedAvg"}  # FedABC's columns without a row here


def global_head(method: Method, head: str) -> str:
    """The federation's head of ``method``'s runs given ``--head``."""
    if method.head == "closed":
        return head if is_closed_form(head) else "ridge"
    return method.head or head


def parse_methods(items) -> list[str]:
    names = parse_names(items, "--methods")
    if not names:
        raise FedheadError(f"The '--methods' parameter needs at least one value. Got {items!r} instead.")
    for m in names:
        if m in HIDDEN_METHODS:
            raise FedheadError(
                f"The '--methods' parameter {m} needs a head with a hidden layer (a shared layer and a personal one), "
                f"and fedhead's heads are linear on frozen features: the table prints {HIDDEN} for "
                f"{HIDDEN_METHODS[m]}. Drop it."
            )
        if m not in METHODS:
            raise unknown_name("--methods", m, METHODS, "method")
    return names


# ---------------------------------------------------------------- presets


@dataclass(frozen=True)
class Column:
    """A column of the table: a partition of the clients."""

    label: str  # Dir(0.1), shard-1
    key: str  # its part of the run names
    partition: str
    params: dict = field(default_factory=dict, hash=False)
    alpha: float | None = None  # a Dirichlet column's alpha (the paper's row)


@dataclass(frozen=True)
class Preset:
    name: str
    what: str
    clients: int
    participation: float
    columns: tuple  # Column, ...
    clients_per_round: int | None = None
    dirichlet: dict = field(default_factory=dict, hash=False)  # the Dirichlet columns' other parameters
    paper: bool = False  # FedABC's CIFAR-10 rows beside it


def dirichlet_column(alpha: float, params: dict | None = None) -> Column:
    return Column(f"Dir({alpha:g})", f"dir{alpha:g}", "dirichlet", {"alpha": alpha, **(params or {})}, alpha)


def shard_column(label: str) -> Column:
    name, params = PARTITION_PRESETS[label]
    return Column(label, label, name, dict(params))


CROSS_DEVICE_PARAMS = {"min_size": 0}  # docs/scale.md's shape: a client may hold no sample
PRESETS: dict[str, Preset] = {
    "table1": Preset(
        "table1",
        "FedABC's Table 1: 20 clients, half of them each round, Dirichlet 0.1 / 0.3 / 0.5 / 1.0",
        20,
        0.5,
        tuple(dirichlet_column(a) for a in (0.1, 0.3, 0.5, 1.0)),
        paper=True,
    ),
    "cross-silo": Preset(
        "cross-silo",
        "100 clients, all in every round (the OvA-LP paper's federation): shard-1, shard-2, Dirichlet 0.1",
        100,
        1.0,
        (shard_column("shard-1"), shard_column("shard-2"), dirichlet_column(0.1)),
    ),
    "cross-device": Preset(
        "cross-device",
        "1000 clients, 10 sampled a round (--clients-per-round), Dirichlet 0.1 / 1.0 with --min-size 0",
        1000,
        1.0,
        tuple(dirichlet_column(a, CROSS_DEVICE_PARAMS) for a in (0.1, 1.0)),
        clients_per_round=10,
        dirichlet=CROSS_DEVICE_PARAMS,
    ),
}


def resolve_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise unknown_name("--preset", name, PRESETS, "preset")
    return PRESETS[name]


def columns_of(preset: Preset, alphas: str | None, quick: bool) -> list[Column]:
    """The preset's columns; ``--alphas`` replaces its Dirichlet ones; ``--quick`` without ``--alphas`` keeps the
    first."""
    cols = list(preset.columns)
    if alphas is not None:
        given = parse_rates("--alphas", alphas, low_closed=False, high=None)
        cols = [c for c in cols if c.alpha is None] + [dirichlet_column(a, preset.dirichlet) for a in given]
    elif quick:
        cols = cols[:1]
    return cols


# ---------------------------------------------------------------- the command's options


def personal_command(fn):
    """Like :func:`fedhead.bench.grid.grid_command`, with the preset's federation as the defaults of ``--clients``
    and ``--seeds`` (0, 1, 2) and without ``--personalize`` (the rows set it): ``fn(<own options>, quick,
    common)``."""
    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name not in ("quick", "common")]
    kw_only = inspect.Parameter.KEYWORD_ONLY
    params = own + [
        inspect.Parameter("quick", kw_only, default=QUICK_OPT, annotation=bool),
        inspect.Parameter("experiment", kw_only, annotation=ExperimentArgs),
        inspect.Parameter("out", kw_only, default=OUT_OPT, annotation=Optional[Path]),
    ]
    clients_text = ", ".join(f"{p.name} {p.clients}" for p in PRESETS.values())
    defaults = {
        "seeds": (None, f"{','.join(map(str, SEEDS))}; --quick: 0"),
        "rounds": (None, "50 (the recipe's); --quick: 10"),
        "clients": (None, f"the preset's: {clients_text}"),
    }

    @functools.wraps(fn)
    def run(**kw):
        experiment, quick = kw.pop("experiment"), kw.pop("quick")
        preset = resolve_preset(kw["preset"])
        values = experiment.values
        if not values.get("seeds"):
            values["seeds"] = [0] if quick else list(SEEDS)
        if values.get("clients") is None:
            values["clients"] = preset.clients
        common = make_common("personal", experiment, quick, kw.pop("out"))
        with report_writer(common.out):
            return fn(**kw, quick=quick, common=common)

    run.__signature__ = inspect.Signature(params)
    del run.__wrapped__
    exclude = (*GRID_EXCLUDE, "personalize")
    return cli_errors(with_experiment_options(run, exclude=exclude, defaults=defaults, lead=GRID_PROTOCOL))


@personal_command
def personal_cmd(
    features: Path = FEATURES_OPT,
    preset: str = typer.Option(
        "table1", "--preset", help="table1 (FedABC's Table 1) | cross-silo (100 clients) | cross-device (1000 clients)"
    ),
    methods: List[str] = typer.Option(
        [",".join(DEFAULT_METHODS)],
        "--methods",
        help=f"rows, repeated or comma-separated: {', '.join(METHODS)} (finetune+fedprox and finetune+scaffold: "
        "optional, FedABC's FedProx and Scaffold columns)",
    ),
    head: str = typer.Option("ova2", "--head", help="the global head of every row but fedrod (bsm) and closed-form"),
    alphas: Optional[str] = typer.Option(
        None, "--alphas", help="comma-separated Dirichlet alphas replacing the preset's (default: the preset's)"
    ),
    participation: Optional[float] = typer.Option(
        None, "--participation", help="fraction of clients a round (default: the preset's: table1 0.5, others 1)"
    ),
    *,
    quick: bool = False,
    common: Common,
):
    """Personalisation methods on the head path in the shape of FedABC's Tables 1-2: PFL accuracy, gain over the
    global head and drift per method and partition, the paper's numbers beside.

    --quick: one seed, 10 rounds, the preset's first column.
    """
    chosen = resolve_preset(preset)
    names = parse_methods(methods)
    check_head(head)
    if participation is not None:
        validate("--participation", participation, Interval(0, 1, closed="right"))
    cols = columns_of(chosen, alphas, quick)
    cells, fed = personal_cells(common, features, chosen, cols, names, head, participation)
    config = {
        **common.describe(),
        "preset": chosen.name,
        "preset_what": chosen.what,
        **fed,
        "methods": {m: METHODS[m].what for m in names},
        "global_heads": {m: global_head(METHODS[m], head) for m in names},
        "columns": {c.label: {"partition": c.partition, **c.params} for c in cols},
        "features": str(features),
    }
    cache = StoreCache()
    cmd = start_report(common, cells, cache, config)
    results = run_grid(cells, common.out, cache)
    by = {(r.cell.labels["method"], r.cell.labels["column"]): r for r in results}
    rows = table_rows(by, names, cols, head, chosen)
    write_table(common.out, rows, config)
    sections = personal_sections(by, names, cols, head, chosen, common, fed)
    plots = personal_plots(common.out, by, names, cols)
    title = f"fedhead bench personal: personalised heads, preset {chosen.name} (FedABC Tables 1-2 shape)"
    publish_report(common, "personal", title, cmd, config, results, sections, plots)


def personal_cells(
    common: Common, features: Path, preset: Preset, cols: list[Column], names: list[str], head: str,
    participation: float | None,
) -> tuple[list[Cell], dict]:  # fmt: skip
    """One run per column and method; and the federation's shape they share (clients, participation, clients per
    round). An option given on the command line wins over the one a row or the preset sets."""
    fed: dict = {"clients": common.clients}
    given = "clients_per_round" in common.given  # reaches the runs as a shared option
    if given:
        fed["participation"] = 1.0 if participation is None else participation
        fed["clients_per_round"] = common.train["clients_per_round"]
    elif preset.clients_per_round is not None and participation is None:
        fed["participation"] = 1.0
        fed["clients_per_round"] = min(preset.clients_per_round, common.clients)
    else:
        fed["participation"] = preset.participation if participation is None else participation
    cells = []
    for col in cols:
        for m in names:
            method = METHODS[m]
            ghead = global_head(method, head)
            extra = {k: v for k, v in method.fields if k not in common.given}
            kw = {
                "head": ghead,
                "partition": col.partition,
                "partition_params": dict(col.params),
                "personalize": method.personalize,
                "participation": fed["participation"],
                **({"clients_per_round": fed["clients_per_round"]} if "clients_per_round" in fed and not given else {}),
                **extra,
            }
            labels = {"method": m, "column": col.label, "head": ghead}
            cells.append(Cell(f"{m}--{col.key}", labels, common.cfg(features, **kw)))
    return cells, fed


# ---------------------------------------------------------------- the numbers


def _stat(r: CellResult, key: str) -> Stat:
    """Mean ± std over the run's seeds: the summary.json's ``key`` and ``key_std``."""
    return Stat.of(r.per_seed(key))


def _pct(s: Stat, signed: bool = False) -> str:
    if not s.values:
        return "–"
    return f"{100 * s.mean:+.1f}" if signed else f"{100 * s.mean:.1f}"


def paper_numbers(method: str, col: Column, preset: Preset) -> tuple[float | None, float | None]:
    """FedABC's CIFAR-10 PFL accuracy and drift (%) of the column ``method`` stands for (table1 only)."""
    key = METHODS[method].paper
    if not preset.paper or key is None or col.alpha is None:
        return None, None
    t1, t2 = PAPER_FEDABC_T1.get((PAPER_DATASET, col.alpha)), PAPER_FEDABC_T2.get((PAPER_DATASET, col.alpha))
    i = FEDABC_METHODS.index(key)
    return (t1[i] if t1 else None), (t2[i] if t2 else None)


def table_rows(by: dict, names: list[str], cols: list[Column], head: str, preset: Preset) -> list[dict]:
    """table.csv / table.json: per method and column, the run's summary numbers (fractions, mean and std over
    seeds), its wall seconds, and the paper's numbers it stands beside (%)."""
    rows = []
    for m in names:
        for col in cols:
            r = by[(m, col.label)]
            row = {
                "method": m,
                "personalize": METHODS[m].personalize,
                "global_head": r.cell.labels["head"],
                "column": col.label,
                "partition": col.partition,
                **{f"partition_{k}": v for k, v in col.params.items()},
                "run_name": r.cell.name,
                "run_dir": str(r.run_dir),
                "seeds": " ".join(map(str, r.seeds)),
                "rounds": r.summary.get("rounds"),
            }
            for k in ("final_accuracy", *PERSONAL_FIELDS):
                st = _stat(r, k)
                row[k], row[f"{k}_std"] = (st.mean, st.std) if st.values else (None, None)
            row["wall_seconds"] = r.summary.get("wall_seconds")
            row["paper_pfl_accuracy"], row["paper_drift_accuracy"] = paper_numbers(m, col, preset)
            rows.append(row)
    return rows


def write_table(out: Path, rows: list[dict], config: dict) -> None:
    write_csv(out / "table.csv", rows)
    atomic_write_json(out / "table.json", {"config": config, "rows": rows})


# ---------------------------------------------------------------- the report


def personal_sections(
    by: dict, names: list[str], cols: list[Column], head: str, preset: Preset, common: Common, fed: dict
) -> list[str]:  # fmt: skip
    sections = [main_table(by, names, cols, common, preset, fed)]
    if preset.paper and any(c.alpha is not None for c in cols):
        sections += paper_tables(by, names, cols, preset)
    else:
        sections.append(
            f"FedABC's numbers (Tables 1-2, {PAPER_DATASET}) stand beside the table1 preset only: the paper's "
            "federation is 20 clients, half of them a round, on Dirichlet partitions."
        )
    sections.append(methods_table(names, head))
    return sections


def main_table(by: dict, names: list[str], cols: list[Column], common: Common, preset: Preset, fed: dict) -> str:
    hdr = ["method", "global head"]
    for c in cols:
        hdr += [f"{c.label} PFL", f"{c.label} global", f"{c.label} gain", f"{c.label} drift"]
    hdr += ["personal s", "wall s"]
    rows = []
    for m in names:
        rs = [by[(m, c.label)] for c in cols]
        row = [m, rs[0].cell.labels["head"]]
        for r in rs:
            row += [
                _stat(r, "pfl_accuracy").fmt(100, 1),
                _pct(_stat(r, "pfl_accuracy_global")),
                _pct(_stat(r, "pfl_gain"), signed=True),
                _pct(_stat(r, "drift_accuracy")),
            ]
        row += [
            f"{np.mean([_stat(r, 'personal_s').mean for r in rs]):.2f}",
            f"{np.mean([r.summary.get('wall_seconds', float('nan')) for r in rs]):.1f}",
        ]
        rows.append(row)
    shape = f"{fed['clients']} clients, " + (
        f"{fed['clients_per_round']} a round"
        if "clients_per_round" in fed
        else f"participation {fed['participation']:g}"
    )
    return "\n".join(
        [
            f"## Personalised heads (%), preset {preset.name}: {shape}, {common.rounds} rounds, seeds "
            f"{', '.join(map(str, common.seeds))}",
            "",
            "PFL: the personal heads' pooled accuracy on the clients' own local test sets (FedABC's Table 1), mean ± "
            "std over seeds; global: the global head on the same sets; gain: PFL − global (points); drift: the "
            "personal heads on a class-balanced test set (FedABC's Table 2; higher = less drift). personal s: the "
            "seconds personalising every client took, per seed; wall s: a run's wall seconds (federation, "
            "evaluation and personalisation, all its seeds); both the mean over the columns.",
            "",
            md_table(hdr, rows),
            "",
        ]
    )


def paper_tables(by: dict, names: list[str], cols: list[Column], preset: Preset) -> list[str]:
    """FedABC's columns beside the rows that stand for them, for PFL accuracy and drift; and the order lines."""
    pcols = [c for c in cols if c.alpha is not None and (PAPER_DATASET, c.alpha) in PAPER_FEDABC_T1]
    row_of = {METHODS[m].paper: m for m in names if METHODS[m].paper}
    out = []
    for key, tname, tab in (
        ("pfl_accuracy", "Table 1: PFL accuracy", PAPER_FEDABC_T1),
        ("drift_accuracy", "Table 2: drift degree", PAPER_FEDABC_T2),
    ):
        rows = []
        for i, pk in enumerate(FEDABC_METHODS):
            m = row_of.get(pk)
            if pk in ("lg-fedavg", "fedper", "fedrep"):
                ours, row_name = [HIDDEN] * len(pcols), "–"
            elif m is None:
                alt = next(n for n, x in METHODS.items() if x.paper == pk)
                ours, row_name = [f"not run (--methods {alt})"] * len(pcols), "–"
            else:
                ours, row_name = [_stat(by[(m, c.label)], key).fmt(100, 1) for c in pcols], m
            cells = []
            for c, o in zip(pcols, ours):
                cells += [f"{tab[(PAPER_DATASET, c.alpha)][i]:.1f}", o]
            rows.append([FEDABC_NAMES[pk], row_name] + cells)
        hdr = ["paper column", "fedhead row"] + [x for c in pcols for x in (f"{c.label} paper", f"{c.label} ours")]
        out.append(
            "\n".join(
                [
                    f"## Beside FedABC {tname} (%, {PAPER_DATASET})",
                    "",
                    NOT_COMPARABLE,
                    "",
                    md_table(hdr, rows),
                    "",
                ]
            )
        )
    out.append(order_lines(by, pcols, row_of))
    return out


def order_lines(by: dict, pcols: list[Column], row_of: dict) -> str:
    """Per column: the paper's order of the methods that have a row here, and ours; the pairs in the same order."""
    lines = ["## Shape: the order of the methods by PFL accuracy", ""]
    keys = [k for k in FEDABC_METHODS if k in row_of]
    if len(keys) < 2:
        return "\n".join(lines + ["Fewer than two of FedABC's columns have a row here: no order to compare.", ""])
    for c in pcols:
        paper = {k: PAPER_FEDABC_T1[(PAPER_DATASET, c.alpha)][FEDABC_METHODS.index(k)] for k in keys}
        ours = {k: 100 * _stat(by[(row_of[k], c.label)], "pfl_accuracy").mean for k in keys}
        pairs = [(a, b) for i, a in enumerate(keys) for b in keys[i + 1 :] if paper[a] != paper[b]]
        same = sum((paper[a] - paper[b]) * (ours[a] - ours[b]) > 0 for a, b in pairs)

        def order(d):
            return " > ".join(f"{FEDABC_NAMES[k]} {d[k]:.1f}" for k in sorted(d, key=lambda k: -d[k]))

        lines.append(
            f"- {c.label}: paper {order(paper)}; ours {order(ours)}; {same} of {len(pairs)} pairs in the paper's "
            "order (pairs the paper ties left out)."
        )
    return "\n".join(lines + [""])


def methods_table(names: list[str], head: str) -> str:
    rows = [
        [
            m,
            METHODS[m].personalize,
            global_head(METHODS[m], head),
            ", ".join(f"{k}={v}" for k, v in METHODS[m].fields) or "–",
            FEDABC_NAMES[METHODS[m].paper] if METHODS[m].paper else "–",
            METHODS[m].what,
        ]
        for m in names
    ]
    return "\n".join(
        [
            "## Rows",
            "",
            md_table(["row", "--personalize", "global head", "federation adds", "FedABC column", "what"], rows),
            "",
            "FedABC's LG FedAvg, FedPer and FedRep columns need a head with a hidden layer (a shared layer and a "
            f"personal one); fedhead's heads are linear on frozen features: {HIDDEN}.",
            "",
        ]
    )


def personal_plots(out: Path, by: dict, names: list[str], cols: list[Column]) -> list[Path]:
    groups = [c.label for c in cols]
    made = []
    for key, what in (("pfl_accuracy", "PFL accuracy"), ("drift_accuracy", "drift (balanced test set)")):
        series = {}
        for m in names:
            stats = [_stat(by[(m, g)], key) for g in groups]
            series[m] = ([s.mean for s in stats], [s.std for s in stats])
        made.append(P.write_bars(out / f"personal-{key.split('_')[0]}.png", groups, series, what, f"{what} per method"))
    return made
