"""The grid plumbing the bench commands share (``fedhead bench ablation | partitions | encoders | noise |
participation | geometry`` in :mod:`fedhead.bench.commands`, and ``baselines``, ``privacy``, ``papers``, ``tune``).

- the shared options: ``--features``, ``--seeds``, ``--quick``, ``--out``, ``--recipe``, and every experiment field
  but :data:`GRID_EXCLUDE` (derived from the table like ``fedhead train``'s);
- the parsing of values given repeated or comma-separated: :func:`parse_names`, :func:`parse_rates`,
  :func:`grid_seeds`, :func:`recipes_of`;
- :func:`grid_command`, which makes a typer command of a grid and resolves its shared options as one
  :class:`Common`, the builder of each run's :class:`~fedhead.federation.config.TrainConfig`;
- the report folder's life: :func:`report_writer` (its one writer), :func:`start_report` / :func:`begin_report`
  (validate every run, then bench.json), :func:`publish_report` (results, curves, report.md, stdout);
- each run's IID reference (:func:`pair_with_iid`) and the tables the reports print (:func:`final_table`,
  :func:`ratio_round_table`);
- the heterogeneity grid that ``ablation``, ``partitions`` and ``encoders`` share (:func:`_run_hetero`).

The runs of a grid run in :func:`fedhead.bench.report.run_grid`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.markdown import Markdown

from fedhead.bench.report import (
    STANDARD_NONIID,
    Cell,
    CellResult,
    Stat,
    StoreCache,
    check_head,
    comm_kb_per_client_round,
    command_line,
    md_table,
    mean_curve,
    ratio_curve,
    resolve_partition,
    run_grid,
    validate_cells,
    with_iid,
    write_bench_json,
    write_curves,
    write_report,
    write_results,
)
from fedhead.federation import plots as P
from fedhead.federation.config import PAPER_SEEDS, TrainConfig
from fedhead.federation.experiment import FIELDS, PARTITION_PARAMS, only_applicable, parse_seeds
from fedhead.infra.console import stdout_console
from fedhead.infra.errors import FedheadError, Interval, OneOf, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import check_out
from fedhead.infra.locks import exclusive_writer
from fedhead.infra.signals import Interrupted
from fedhead.interface.options import ExperimentArgs, with_experiment_options

# The paper's numbers printed next to ours (SPEC section 1; CIFAR-100, ViT-L/16, round 50).
PAPER_RATIO = {"softmax": 56.3, "ova": 95.4, "ova2": 95.9}
QUICK_ROUNDS = 10
PAPER_ROUNDS = 50

# ---------------------------------------------------------------- shared options

FEATURES_OPT = typer.Option(..., "--features", help="HDF5 feature store written by 'fedhead extract'.")
SEEDS_TEXT = f"the paper's {','.join(map(str, PAPER_SEEDS))}; --quick: 0"
SEEDS_OPT = typer.Option(
    None, "--seeds", help=f"seeds, repeated or comma-separated \\[default: {SEEDS_TEXT}]", metavar="INT[,INT...]"
)
QUICK_OPT = typer.Option(False, "--quick", help=f"one seed and {QUICK_ROUNDS} rounds (unless given)")
OUT_OPT = typer.Option(
    None,
    "--out",
    help="report folder (default reports/<command>-<timestamp>); re-run with the same "
    "--out to reuse finished runs and resume an interrupted one",
)
RECIPE_HELP = "paper (the OvA-LP paper's AdamW) | default (the trainer's) | both"

# The experiment fields a grid command does not take as shared options: the ones its grid sets per run (the
# store, heads, partitions and their parameters, recipes, noise, participation), the IID reference (the grids run
# their own IID runs), Flower's secure aggregation, and the plots and trackers of a run (a report draws its own
# figures: its runs are written with plots = false). Every other field is an option of every grid command,
# derived from the table like fedhead train's, and reaches every run it applies to.
GRID_EXCLUDE = (
    "features",
    "head",
    "partition",
    *PARTITION_PARAMS,
    "recipe",
    "participation",
    "noise",
    "noise_rate",
    "asym_map",
    "noise_dataset",
    "iid_reference",
    "secure_aggregation",
    "plots",
    "log",
    "log_dir",
)
GRID_PROTOCOL = ("seeds", "rounds", "clients")  # the report's protocol: every run gets them (rounds if iterative)


@dataclass
class Common:
    command: str
    seeds: list
    rounds: int
    clients: int
    out: Path
    train: dict  # TrainConfig fields passed on to every run they apply to
    given: set = field(default_factory=set)  # the shared options given on the command line
    used: set = field(default_factory=set)  # ... that applied to at least one run built so far

    def cfg(self, features, **kw) -> TrainConfig:
        """A run of the grid: its own fields ``kw``, and the shared options that apply to it (a closed-form head
        gets no --rounds or local-training option; a head's parameter reaches that head's runs only)."""
        shared = {"rounds": self.rounds, **self.train}
        base = dict(features=str(features), clients=self.clients, seeds=list(self.seeds), plots=False, **shared)
        base.update(kw)
        keep = only_applicable({k: v for k, v in shared.items() if k not in kw}, TrainConfig(**base).recipe_view())
        for k in shared:
            if k not in kw and k not in keep:
                del base[k]
        self.used.update(k for k in keep if k in self.given)
        return TrainConfig(**base)

    def check_used(self) -> None:
        """Refuse a shared option given on the command line that applies to no run of the grid."""
        for name in sorted(self.given - self.used - set(GRID_PROTOCOL), key=list(FIELDS).index):
            f = FIELDS[name]
            wanted = " or ".join(w.wanted() for w in f.applies)
            raise FedheadError(
                f"The '{f.flag}' option applies to {wanted} only, and no run of this report is one. "
                f"Drop {f.flag}, or choose runs it applies to."
            )

    def describe(self) -> dict:
        return {
            "command": self.command,
            "seeds": self.seeds,
            "rounds": self.rounds,
            "clients": self.clients,
            "out": str(self.out),
            **self.train,
        }


def parse_rates(
    param: str, text: str, low_closed: bool = True, high: float = 1.0, high_closed: bool = False
) -> list[float]:
    closed = {(True, False): "left", (True, True): "both", (False, True): "right", (False, False): "neither"}
    rates = []
    for tok in str(text).replace(",", " ").split():
        try:
            v = float(tok)
        except ValueError:
            raise FedheadError(
                f"The '{param}' parameter must be a comma-separated list of numbers. Got {tok!r} instead."
            ) from None
        validate(param, v, Interval(0, high, closed=closed[(low_closed, high_closed)]))
        if v not in rates:
            rates.append(v)
    if not rates:
        raise FedheadError(f"The '{param}' parameter needs at least one value. Got {text!r} instead.")
    return rates


def parse_names(items: list[str] | str | None, param: str = "") -> list[str]:
    """Names given repeated or comma-separated (``--head ova2,softmax --head ova``), each once, in order; with
    ``param``, a value given empty is an error naming it."""
    if items is None:
        return []
    items = [items] if isinstance(items, str) else items
    if param and any(not str(item).strip(" ,") for item in items):
        raise FedheadError(f"The '{param}' parameter needs a value. Got {[str(i) for i in items]!r} instead.")
    return list(dict.fromkeys(t for item in items for t in str(item).replace(",", " ").split()))


def grid_seeds(seeds: list | None, quick: bool) -> list[int]:
    """``--seeds`` of a bench command: given (repeated or comma-separated), else the paper's (--quick: 0)."""
    return parse_seeds(seeds) if seeds else ([0] if quick else list(PAPER_SEEDS))


def recipes_of(recipe: str) -> list[str]:
    validate("--recipe", recipe, OneOf(("paper", "default", "both")))
    return ["paper", "default"] if recipe == "both" else [recipe]


def make_common(command: str, experiment: ExperimentArgs, quick: bool, out: Path | None) -> Common:
    """The grid's shared options: its protocol (seeds, rounds, clients; --quick: one seed and fewer rounds),
    the report folder, and the experiment options passed on to every run they apply to."""
    values = dict(experiment.values)
    seeds_l = values.pop("seeds") or ([0] if quick else list(PAPER_SEEDS))
    rounds = values.pop("rounds")
    if rounds is None:
        rounds = QUICK_ROUNDS if quick else PAPER_ROUNDS
    clients = values.pop("clients")
    validate("--rounds", rounds, Interval(1, None, integer=True))
    validate("--clients", clients, Interval(1, None, integer=True))
    out = Path(out) if out else Path("reports") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_out(out, kind="dir")  # a file there, or below a file: refused before any work
    return Common(command, seeds_l, int(rounds), int(clients), out, values, set(experiment.given))


def grid_command(command: str, clients: int = 100, clients_help: str = "", defaults: dict | None = None):
    """Decorate a grid command ``fn(<own options>, common)``: typer sees its own options, ``--quick``, ``--out``
    and the shared experiment options (every field but :data:`GRID_EXCLUDE`, with the grid's defaults for seeds,
    rounds and clients, and ``defaults``); they reach ``fn`` resolved as one :class:`Common`."""
    own_defaults = {
        "seeds": (None, SEEDS_TEXT),
        "rounds": (None, f"{PAPER_ROUNDS}; --quick: {QUICK_ROUNDS}"),
        "clients": (clients, clients_help or str(clients)),
        **(defaults or {}),
    }

    def deco(fn):
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "common"]
        kw_only = inspect.Parameter.KEYWORD_ONLY
        params = own + [  # the shared options go where "experiment" stands: after --quick, before --out
            inspect.Parameter("quick", kw_only, default=QUICK_OPT, annotation=bool),
            inspect.Parameter("experiment", kw_only, annotation=ExperimentArgs),
            inspect.Parameter("out", kw_only, default=OUT_OPT, annotation=Optional[Path]),
        ]

        @functools.wraps(fn)
        def run(**kw):
            common = make_common(command, kw.pop("experiment"), kw.pop("quick"), kw.pop("out"))
            with report_writer(common.out):
                return fn(**kw, common=common)

        run.__signature__ = inspect.Signature(params)
        del run.__wrapped__
        return cli_errors(with_experiment_options(run, exclude=GRID_EXCLUDE, defaults=own_defaults, lead=GRID_PROTOCOL))

    return deco


@contextlib.contextmanager
def report_writer(
    out: Path, what: str = "the report folder", kept: str = "finished runs are reused, the interrupted one resumes"
):
    """This process is the folder's one writer (``what`` names it); an interrupt ends with how to continue and what
    is ``kept``."""
    with exclusive_writer(out, f"{what} {str(out)!r}"):
        try:
            yield
        except Interrupted as exc:
            raise Interrupted(
                exc.signum, f"interrupted; re-run the same command with --out {out} to continue ({kept})"
            ) from None


def start_report(common: Common, cells: list[Cell], cache: StoreCache, config: dict) -> str:
    """Validate every run first (nothing is written on bad input), then create the folder and bench.json."""
    common.check_used()
    validate_cells(cells, cache)
    return begin_report(common.out, cells, config)


def begin_report(out: Path, cells: list[Cell], config: dict) -> str:
    """After every run was validated: create the folder and bench.json; returns the command line."""
    import sys

    out.mkdir(parents=True, exist_ok=True)
    cmd = command_line()
    write_bench_json(out, cmd, cells, config)
    print(f"report folder: {out} (re-run with --out {out} to reuse finished runs and resume)", file=sys.stderr)
    return cmd


def _pct(stat: Stat, digits: int = 2) -> str:
    return stat.fmt(100, digits)


def _print_report(path: Path, sections: list[str]) -> None:
    con = stdout_console()
    con.print(Markdown("\n\n".join(sections)))
    con.print(f"report: {path}")


def publish_report(
    common: Common, command: str, title: str, cmd: str, config: dict, results: list, sections: list[str],
    plots: list, iid_of: dict | None = None, notes: tuple = (),
) -> Path:  # fmt: skip
    """A grid command's end: results.csv, curves.csv, report.md (its sections, then ``notes``), and the sections
    on stdout."""
    write_results(common.out, results, command)
    write_curves(common.out, results, iid_of or {})
    path = write_report(common.out, title, cmd, config, [*sections, *notes], results, plots)
    _print_report(path, sections)
    return path


# ---------------------------------------------------------------- heterogeneity (ablation, partitions, encoders)


def _store_tags(paths: list[Path]) -> list[str]:
    tags = []
    for p in paths:
        t = Path(p).name
        for suf in (".h5", ".hdf5"):
            t = t[: -len(suf)] if t.endswith(suf) else t
        base, i = t, 2
        while t in tags:
            t, i = f"{base}-{i}", i + 1
        tags.append(t)
    return tags


def hetero_cells(
    common: Common,
    stores: list[tuple[str, Path]],
    heads: list[str],
    partitions: list[str],
    recipes: list[str],
    participation: float = 1.0,
) -> list[Cell]:
    """For each store, recipe and head: the IID run and one run per non-IID partition."""
    cells = []
    parts = ["iid"] + [p for p in partitions if p != "iid"]
    for tag, path in stores:
        for recipe in recipes:
            for head in heads:
                for label in parts:
                    name, params = resolve_partition(label)
                    run = f"{head}-{label}-{recipe}"
                    labels = {"head": head, "partition": label, "recipe": recipe}
                    if len(stores) > 1:
                        run = f"{tag}--{run}"
                        labels = {"store": tag, **labels}
                    cells.append(
                        Cell(
                            run,
                            labels,
                            common.cfg(
                                path,
                                head=head,
                                partition=name,
                                partition_params=params,
                                recipe=recipe,
                                participation=participation,
                            ),
                        )
                    )
    return cells


def _group_key(r: CellResult, drop=("partition",)) -> tuple:
    return tuple((k, v) for k, v in r.cell.labels.items() if k not in drop)


def pair_with_iid(results: list[CellResult], drop=("partition",), iid_test=None) -> dict[str, CellResult | None]:
    """Each run's IID reference: the IID run of its group (same labels except ``drop``)."""
    iid_test = iid_test or (lambda r: r.cell.labels.get("partition") == "iid")
    iids = {_group_key(r, drop): r for r in results if iid_test(r)}
    out = {}
    for r in results:
        ref = iids.get(_group_key(r, drop))
        out[r.cell.name] = ref
        if ref is not None:
            with_iid(r, ref)
    return out


def _sel_rounds(rounds: int) -> list[int]:
    return sorted({r for r in (1, 2, 3, 5, 10, 20, 30, 40, 50, rounds) if r <= rounds})


def final_table(results: list[CellResult], lead: list[str]) -> str:
    hdr = lead + [
        "final acc (%)",
        "ratio to IID (%)",
        "Acc@95 (rounds)",
        "Acc@95 vs IID",
        "client ms",
        "server ms",
        "KB up/client/round",
        "total MB",
    ]
    rows = []
    for r in results:
        d = r.derived
        rows.append(
            [r.cell.labels.get(k, "") for k in lead]
            + [
                _pct(Stat.of(r.per_seed("final_accuracy"))),
                _pct(d["final_ratio_to_iid"], 1) if "final_ratio_to_iid" in d else "–",
                Stat.of(r.per_seed("acc95_round")).fmt(1, 1),
                d["acc95_round_vs_iid"].fmt(1, 1) if "acc95_round_vs_iid" in d else "–",
                Stat.of(r.per_seed("client_ms")).fmt(1, 2),
                Stat.of(r.per_seed("server_ms")).fmt(1, 2),
                f"{comm_kb_per_client_round(r):.1f}",
                Stat.of(r.per_seed("bytes_total")).fmt(1 / 2**20, 2),
            ]
        )
    return md_table(hdr, rows)


def mean_noniid(results: list[CellResult], partitions: list[str]) -> tuple[list[str], Stat | None]:
    """Mean final ratio over the standard non-IID partitions present (else all non-IID): per seed the mean
    over partitions, then mean ± std over seeds."""
    present = [p for p in STANDARD_NONIID if any(r.cell.labels.get("partition") == p for r in results)]
    if not present:
        present = [p for p in partitions if p != "iid"]
    per_seed: dict[int, list] = {}
    for r in results:
        if r.cell.labels.get("partition") not in present or "final_ratio_to_iid" not in r.derived:
            continue
        for s, v in zip(r.seeds, r.derived["final_ratio_to_iid"].values):
            per_seed.setdefault(s, []).append(v)
    vals = [float(np.mean(v)) for v in per_seed.values() if len(v) == len(present)]
    return present, (Stat.of(vals) if vals else None)


def ratio_round_table(results: list[CellResult], iid_of: dict, lead: list[str], rounds: int) -> str:
    sel = _sel_rounds(rounds)
    rows = []
    for r in results:
        iid = iid_of.get(r.cell.name)
        if iid is None or r.cell.labels.get("partition") == "iid":
            continue
        rr, m, s = ratio_curve(r, iid)
        at = dict(zip(rr.tolist(), zip(m.tolist(), s.tolist())))
        cells = []
        for k in sel:
            if k in at:
                mm, ss = at[k]
                cells.append(f"{100 * mm:.1f}" + (f" ± {100 * ss:.1f}" if len(r.seeds) > 1 else ""))
            else:
                cells.append("–")
        rows.append([r.cell.labels.get(k, "") for k in lead] + cells)
    return md_table(lead + [f"r{k}" for k in sel], rows)


def hetero_plots(
    out: Path, results: list[CellResult], iid_of: dict, heads: list[str], group_by: list[str], suffix: str
) -> list[Path]:
    """accuracy and ratio-to-IID curves (a panel per head, IID drawn for reference) and final-ratio bars."""
    made = []
    acc_panels, ratio_panels = [], []
    for head in heads:
        rs = [r for r in results if r.cell.labels["head"] == head]
        if not rs:
            continue
        ap, rp = P.Panel(head), P.Panel(head, hline=(1.0, "IID"))
        for r in rs:
            x, m, s = mean_curve(r)
            iid = r.cell.labels["partition"] == "iid"
            ap.lines.append(
                P.Line(
                    "IID" if iid else r.cell.labels["partition"],
                    x,
                    m,
                    s,
                    style="--" if iid else "-",
                    color="black" if iid else None,
                )
            )
            if not iid and iid_of.get(r.cell.name) is not None:
                x, m, s = ratio_curve(r, iid_of[r.cell.name])
                rp.lines.append(P.Line(r.cell.labels["partition"], x, m, s))
        acc_panels.append(ap)
        ratio_panels.append(rp)
    made.append(
        P.write_curves(
            out / f"accuracy{suffix}.png",
            acc_panels,
            "round",
            "test accuracy",
            f"accuracy per round {suffix.strip('-')}",
        )
    )
    made.append(
        P.write_curves(
            out / f"ratio-to-iid{suffix}.png",
            ratio_panels,
            "round",
            "accuracy / IID accuracy",
            f"ratio to IID per round {suffix.strip('-')}",
        )
    )
    parts = list(dict.fromkeys(r.cell.labels["partition"] for r in results if r.cell.labels["partition"] != "iid"))
    series = {}
    for head in heads:
        ms, ss = [], []
        for p in parts:
            rr = [
                r
                for r in results
                if r.cell.labels["head"] == head
                and r.cell.labels["partition"] == p
                and "final_ratio_to_iid" in r.derived
            ]
            ms.append(rr[0].derived["final_ratio_to_iid"].mean if rr else float("nan"))
            ss.append(rr[0].derived["final_ratio_to_iid"].std if rr else float("nan"))
        series[head] = (ms, ss)
    if parts:
        made.append(
            P.write_bars(
                out / f"final-ratio{suffix}.png",
                parts,
                series,
                "final accuracy / IID",
                f"final ratio to IID per partition {suffix.strip('-')}",
                hline=(1.0, "IID"),
            )
        )
    return made


def hetero_sections(
    results: list[CellResult],
    iid_of: dict,
    heads: list[str],
    partitions: list[str],
    common: Common,
    split_by: list[str],
    paper: bool = True,
) -> list[str]:
    """Per group (recipe, and store when several): the final table, the non-IID mean, the per-round ratios."""
    sections = []
    groups: dict[tuple, list[CellResult]] = {}
    for r in results:
        groups.setdefault(tuple(r.cell.labels.get(k) for k in split_by), []).append(r)
    for key, rs in groups.items():
        what = ", ".join(f"{k} {v}" for k, v in zip(split_by, key))
        lead = ["head", "partition"]
        s = [
            f"## {what}: round {common.rounds}, {common.clients} clients, seeds {', '.join(map(str, common.seeds))}",
            "",
            final_table(rs, lead),
            "",
        ]
        mrows = []
        present = []
        for head in heads:
            present, st = mean_noniid([r for r in rs if r.cell.labels["head"] == head], partitions)
            mrows.append(
                [head, _pct(st, 1) if st else "–"]
                + ([f"{PAPER_RATIO[head]:.1f}" if head in PAPER_RATIO else "–"] if paper else [])
            )
        s += [
            f"### Mean final ratio to IID over {', '.join(present)} (%)",
            "",
            md_table(["head", "ours"] + (["paper (CIFAR-100, ViT-L/16)"] if paper else []), mrows),
            "",
        ]
        s += [
            "### Ratio to IID per round (%; all rounds in curves.csv)",
            "",
            ratio_round_table(rs, iid_of, lead, common.rounds),
            "",
        ]
        sections.append("\n".join(s))
    return sections


def _run_hetero(
    common: Common,
    command: str,
    title: str,
    stores: list[Path],
    heads: list[str],
    partitions: list[str],
    recipes: list[str],
    extra_config: dict,
) -> tuple[Path, list[str]]:
    for h in heads:
        check_head(h)
    for p in partitions:
        resolve_partition(p)
    heads = list(dict.fromkeys(heads))
    partitions = list(dict.fromkeys(partitions))
    tags = _store_tags(stores)
    cells = hetero_cells(common, list(zip(tags, stores)), heads, partitions, recipes)
    cache = StoreCache()
    config = {
        **common.describe(),
        "heads": heads,
        "partitions": partitions,
        "recipes": recipes,
        "features": [str(s) for s in stores],
        **extra_config,
    }
    cmd = start_report(common, cells, cache, config)
    results = run_grid(cells, common.out, cache)
    iid_of = pair_with_iid(results)
    split_by = (["store"] if len(stores) > 1 else []) + ["recipe"]
    sections = hetero_sections(results, iid_of, heads, partitions, common, split_by)
    plots = []
    for key in dict.fromkeys(tuple(r.cell.labels.get(k) for k in split_by) for r in results):
        rs = [r for r in results if tuple(r.cell.labels.get(k) for k in split_by) == key]
        plots += hetero_plots(common.out, rs, iid_of, heads, split_by, "-" + "-".join(map(str, key)))
    extra_sections = []
    if len(stores) > 1:
        extra_sections, more = encoder_comparison(common.out, results, tags, heads, partitions, recipes)
        plots += more
    write_results(common.out, results, command)
    write_curves(common.out, results, iid_of)
    note = (
        "Ratios to IID are computed against the IID run of the same head, recipe and store with the same "
        "seeds (per seed and round: accuracy / IID accuracy; then mean ± std over seeds). Acc@95 = first "
        "round reaching 95% of the run's own final accuracy; 'vs IID' = of the IID run's final accuracy. "
        "client ms = mean local compute per client per round; server ms = aggregation per round; "
        "total MB = bytes up and down over all rounds and clients (measured by the trainer)."
    )
    path = write_report(common.out, title, cmd, config, extra_sections + sections + [note], results, plots)
    return path, extra_sections + sections


def encoder_comparison(out: Path, results, tags, heads, partitions, recipes) -> tuple[list[str], list[Path]]:
    """Absolute accuracy and ratio to IID side by side per store (Fig. 6)."""
    sections, plots = [], []
    parts = ["iid"] + [p for p in partitions if p != "iid"]
    for recipe in recipes:
        for head in heads:
            hdr = ["partition"] + [x for t in tags for x in (f"{t} acc (%)", f"{t} ratio (%)")]
            rows, acc_series, ratio_series = [], {t: ([], []) for t in tags}, {t: ([], []) for t in tags}
            for p in parts:
                row = [p]
                for t in tags:
                    rr = [
                        r
                        for r in results
                        if r.cell.labels == {"store": t, "head": head, "partition": p, "recipe": recipe}
                    ]
                    if not rr:
                        row += ["–", "–"]
                        continue
                    r = rr[0]
                    acc = Stat.of(r.per_seed("final_accuracy"))
                    rat = r.derived.get("final_ratio_to_iid")
                    row += [_pct(acc), _pct(rat, 1) if rat else "–"]
                    acc_series[t][0].append(acc.mean)
                    acc_series[t][1].append(acc.std)
                    if p != "iid":
                        ratio_series[t][0].append(rat.mean if rat else float("nan"))
                        ratio_series[t][1].append(rat.std if rat else float("nan"))
                rows.append(row)
            sections.append(f"## Encoders side by side: head {head}, recipe {recipe}\n\n" + md_table(hdr, rows))
            plots.append(
                P.write_bars(
                    out / f"encoders-accuracy-{head}-{recipe}.png",
                    parts,
                    acc_series,
                    "final test accuracy",
                    f"absolute accuracy, {head}, {recipe}",
                )
            )
            plots.append(
                P.write_bars(
                    out / f"encoders-ratio-{head}-{recipe}.png",
                    parts[1:],
                    ratio_series,
                    "final accuracy / IID",
                    f"ratio to IID, {head}, {recipe}",
                    hline=(1.0, "IID"),
                )
            )
    return sections, plots
