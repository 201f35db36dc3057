"""Typer commands ``fedhead bench ablation|partitions|encoders|noise|participation|geometry``.

Each builds a grid of ``fedhead train`` runs (same engine, same run directories), runs it with reuse and
resume (:func:`fedhead.bench.report.run_grid`), and writes one report folder (see
:mod:`fedhead.bench.report`). ``geometry`` trains nothing. The plumbing they share with the other bench commands
(options, parsing, the grid of runs, the report folder) is :mod:`fedhead.bench.grid`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer

from extract.store import load_store, open_store
from fedhead.bench.geometry import COLUMNS, METRICS, store_geometry
from fedhead.bench.geometry import __doc__ as gdoc
from fedhead.bench.grid import (
    FEATURES_OPT,
    OUT_OPT,
    QUICK_OPT,
    RECIPE_HELP,
    SEEDS_OPT,
    Common,
    _pct,
    _print_report,
    _run_hetero,
    _store_tags,
    final_table,
    grid_command,
    grid_seeds,
    pair_with_iid,
    parse_names,
    parse_rates,
    publish_report,
    ratio_round_table,
    recipes_of,
    start_report,
)
from fedhead.bench.report import (
    STANDARD_NONIID,
    Cell,
    CellResult,
    Stat,
    StoreCache,
    check_head,
    command_line,
    md_table,
    mean_curve,
    ratio_curve,
    resolve_partition,
    run_grid,
    write_report,
)
from fedhead.federation import plots as P
from fedhead.federation.experiment import FIELDS
from fedhead.federation.rundir import write_csv
from fedhead.federation.train import PAUSE_ENV
from fedhead.infra.errors import FedheadError, Interval, OneOf, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import check_out
from fedhead.infra.locks import exclusive_writer
from fedhead.infra.signals import pause_hook
from fedhead.interface.options import option

# The paper's numbers printed next to ours (SPEC section 1; CIFAR-100, ViT-L/16, round 50).
PAPER_NOISE = {
    "symmetric": (0.3, 88.78, {0.4: 0.76, 0.5: 2.35, 0.6: 4.52, 0.7: 10.35}),
    "asymmetric": (0.2, 89.28, {0.3: 0.63, 0.4: 1.53}),
}
PAPER_GEOMETRY = {
    "pretrained": {
        "alignment": (1.366, 0.006),
        "intra": (0.818, 0.002),
        "inter": (0.840, 0.004),
        "ratio": (0.974, 0.007),
    },
    "random-init": {
        "alignment": (1.761, 0.008),
        "intra": (0.917, 0.004),
        "inter": (0.487, 0.008),
        "ratio": (1.885, 0.038),
    },
}


# ---------------------------------------------------------------- commands: heterogeneity


@grid_command("ablation")
def ablation_cmd(
    features: Path = FEATURES_OPT,
    head: List[str] = typer.Option(["softmax", "ova", "ova2"], "--head", help="heads, repeated or comma-separated"),
    partition: List[str] = typer.Option(
        list(STANDARD_NONIID), "--partition", help="non-IID partitions, repeated or comma-separated; IID is always run"
    ),
    recipe: str = typer.Option("both", "--recipe", help=RECIPE_HELP),
    *,
    common: Common,
):
    """Heads x partitions x recipes (the paper's Table 1 / Fig. 3): ratio to IID, Acc@95, cost."""
    path, sections = _run_hetero(
        common,
        "ablation",
        "fedhead bench ablation (OvA-LP Table 1 / Fig. 3)",
        [features],
        parse_names(head, "--head"),
        parse_names(partition, "--partition"),
        recipes_of(recipe),
        {},
    )
    _print_report(path, sections)


@grid_command("partitions")
def partitions_cmd(
    features: Path = FEATURES_OPT,
    head: List[str] = typer.Option(["ova2"], "--head", help="heads, repeated or comma-separated"),
    partition: List[str] = typer.Option(
        ["shard-1", "shard-2", "bernoulli-dirichlet", "zipf", "kmeans"],
        "--partition",
        help="non-IID partitions, repeated or comma-separated; IID is always run",
    ),
    recipe: str = typer.Option("default", "--recipe", help=RECIPE_HELP),
    *,
    common: Common,
):
    """Five heterogeneity patterns against IID (the paper's Fig. 5)."""
    path, sections = _run_hetero(
        common,
        "partitions",
        "fedhead bench partitions (OvA-LP Fig. 5)",
        [features],
        parse_names(head, "--head"),
        parse_names(partition, "--partition"),
        recipes_of(recipe),
        {},
    )
    _print_report(path, sections)


def check_same_dataset(stores: list[Path]) -> None:
    """Stores compared by ``encoders`` must hold the same dataset (name and class names)."""
    infos = [open_store(p) for p in stores]
    first = infos[0]
    for info in infos[1:]:
        if info.dataset != first.dataset:
            raise FedheadError(
                f"The '--features' stores must hold the same dataset: {str(first.path)!r} is "
                f"{first.dataset!r} but {str(info.path)!r} is {info.dataset!r}. Compare encoders "
                "on stores extracted from one dataset."
            )
        if info.class_names != first.class_names:
            raise FedheadError(
                f"The '--features' stores must hold the same dataset: {str(first.path)!r} and "
                f"{str(info.path)!r} are both {info.dataset!r} but their class names differ "
                f"({first.num_classes} vs {info.num_classes} classes). Compare encoders on stores "
                "extracted from one dataset."
            )


@grid_command("encoders")
def encoders_cmd(
    features: List[Path] = typer.Option(
        ..., "--features", help="stores of one dataset made by different encoders (repeat)"
    ),
    head: List[str] = typer.Option(["ova2"], "--head", help="heads, repeated or comma-separated"),
    partition: List[str] = typer.Option(
        list(STANDARD_NONIID), "--partition", help="non-IID partitions, repeated or comma-separated; IID is always run"
    ),
    recipe: str = typer.Option("default", "--recipe", help=RECIPE_HELP),
    *,
    common: Common,
):
    """The same protocol over stores made by different encoders (the paper's Fig. 6)."""
    stores = list(features)
    check_same_dataset(stores)
    path, sections = _run_hetero(
        common,
        "encoders",
        "fedhead bench encoders (OvA-LP Fig. 6)",
        stores,
        parse_names(head, "--head"),
        parse_names(partition, "--partition"),
        recipes_of(recipe),
        {},
    )
    _print_report(path, sections)


# ---------------------------------------------------------------- noise


def noise_name(head: str, kind: str, rate: float, recipe: str) -> str:
    if rate == 0:
        return f"{head}-clean-{recipe}"
    return f"{head}-{'sym' if kind == 'symmetric' else 'asym'}{rate:g}-{recipe}"


def _final_by_seed(r: CellResult) -> dict[int, float]:
    return dict(zip(r.seeds, r.per_seed("final_accuracy")))


def _verdict(what: str, by_seed: dict[str, dict[float, dict]], rates: list[float]) -> list[str]:
    """'ova2 retains a higher share than softmax at every rate' from per-head, per-rate, per-seed shares,
    with the paired gap (ova2 - softmax, points of share, mean ± std over shared seeds) and the seed count."""
    if "ova2" not in by_seed or "softmax" not in by_seed or not rates:
        return []
    o, m = by_seed["ova2"], by_seed["softmax"]
    mean = lambda d: float(np.mean(list(d.values())))  # noqa: E731
    worse = [r for r in rates if not mean(o[r]) > mean(m[r])]
    gaps = []
    for r in rates:
        seeds = [k for k in o[r] if k in m[r]]
        d = [100 * (o[r][k] - m[r][k]) for k in seeds]
        gaps.append(f"{r:g}: {Stat.of(d).fmt(1, 2)} ({sum(x > 0 for x in d)}/{len(d)} seeds)")
    return [
        f"ova2 retains a higher share than softmax at every rate ({what}): **{'yes' if not worse else 'no'}**"
        + (f" (not at {', '.join(f'{r:g}' for r in worse)})" if worse else ""),
        "",
        f"Paired gap ova2 - softmax in points of share (mean ± std over seeds; seeds where ova2 is higher): "
        f"{'; '.join(gaps)}.",
        "",
    ]


def noise_sections(
    results: dict[tuple, CellResult],
    heads,
    kinds: dict[str, list[float]],
    recipe: str,
    common: Common,
    clean: dict[str, CellResult] | None = None,
) -> tuple[list[str], dict]:
    """Table 2 layout: accuracy at the lowest rate, declines (points and %), share retained; per kind. With
    ``clean`` (head -> its noise-free run) also the share of the clean accuracy kept at every rate."""
    clean = clean or {}
    sections, curves = [], {}
    for kind, rates in kinds.items():
        rates = sorted(r for r in rates if r > 0)
        tables = ([], [], [], [], [], [])  # rows: accuracy, declines (points, %), share, realised, share of clean
        share_seeds: dict[str, dict[float, dict]] = {}
        kept_seeds: dict[str, dict[float, dict]] = {}
        for head in heads:
            _noise_head_rows(results, head, kind, rates, clean, curves, tables, share_seeds, kept_seeds)
        _noise_paper_rows(kind, rates, tables)
        sections.append(_noise_kind_text(kind, rates, recipe, common, clean, tables, share_seeds, kept_seeds))
    return sections, curves


def _noise_head_rows(
    results: dict[tuple, CellResult],
    head: str,
    kind: str,
    rates: list[float],
    clean: dict[str, CellResult],
    curves: dict,
    tables: tuple[list, ...],
    share_seeds: dict[str, dict[float, dict]],
    kept_seeds: dict[str, dict[float, dict]],
) -> None:
    """One head's rows of a noise kind's tables (appended to ``tables``), its per-seed shares and its curves."""
    base, higher = rates[0], rates[1:]
    acc_rows, pts_rows, rel_rows, share_rows, realised_rows, kept_rows = tables
    per = {r: _final_by_seed(results[(head, kind, r)]) for r in rates}
    seeds = [s for s in per[base] if all(s in per[r] for r in rates)]
    c_acc = None
    if head in clean:
        c = _final_by_seed(clean[head])
        c_seeds = [s for s in seeds if s in c]
        c_acc = Stat.of(c[s] for s in c_seeds)
        kept_seeds[head] = {r: {k: per[r][k] / c[k] for k in c_seeds} for r in rates}
        kept = {r: Stat.of(kept_seeds[head][r].values()) for r in rates}
        curves[(kind, head, "clean")] = (
            [0.0] + rates,
            [1.0] + [kept[r].mean for r in rates],
            [0.0] + [kept[r].std for r in rates],
            c_acc,
        )
        kept_rows.append([head, _pct(c_acc)] + [_pct(kept[r], 1) for r in rates])
    a0 = Stat.of(per[base][s] for s in seeds)
    accs = {r: Stat.of(per[r][s] for s in seeds) for r in rates}
    pts = {r: Stat.of(100 * (per[base][s] - per[r][s]) for s in seeds) for r in higher}
    rel = {r: Stat.of(100 * (per[base][s] - per[r][s]) / per[base][s] for s in seeds) for r in higher}
    share_seeds[head] = {r: {k: per[r][k] / per[base][k] for k in seeds} for r in higher}
    share = {r: Stat.of(share_seeds[head][r].values()) for r in higher}
    curves[(kind, head)] = (
        [r for r in rates],
        [accs[r].mean for r in rates],
        [accs[r].std for r in rates],
        [1.0] + [share[r].mean for r in higher],
        [0.0] + [share[r].std for r in higher],
    )
    acc_rows.append([head] + ([_pct(c_acc) if c_acc else "–"] if clean else []) + [_pct(accs[r]) for r in rates])
    pts_rows.append([head, _pct(a0)] + [pts[r].fmt(1, 2) for r in higher])
    rel_rows.append([head, _pct(a0)] + [rel[r].fmt(1, 2) for r in higher])
    share_rows.append([head] + [_pct(share[r], 1) for r in higher])
    realised_rows.append(
        [head] + [Stat.of(results[(head, kind, r)].per_seed("realised_noise_rate")).fmt(1, 3) for r in rates]
    )


def _noise_paper_rows(kind: str, rates: list[float], tables: tuple[list, ...]) -> None:
    """The paper's OvA-LP rows of a noise kind's decline and share tables, at the rates it reports."""
    base, higher = rates[0], rates[1:]
    pbase, pacc, pdec = PAPER_NOISE[kind]
    _, pts_rows, rel_rows, share_rows, _, _ = tables

    # the paper's OvA-LP row, only at the rates it reports
    def paper_cell(r, how, base=base, pbase=pbase, pdec=pdec, pacc=pacc):
        if base != pbase or r not in pdec:
            return "–"
        d = pdec[r]
        return {"pts": f"{d:.2f}", "rel": f"{100 * d / pacc:.2f}", "share": f"{100 * (1 - d / pacc):.1f}"}[how]

    prow_base = f"{pacc:.2f}" if base == pbase else "–"
    pts_rows.append(["OvA-LP (paper, CIFAR-100)", prow_base] + [paper_cell(r, "pts") for r in higher])
    rel_rows.append(["OvA-LP (paper, CIFAR-100)", prow_base] + [paper_cell(r, "rel") for r in higher])
    share_rows.append(["OvA-LP (paper, from its declines)"] + [paper_cell(r, "share") for r in higher])


def _noise_kind_text(
    kind: str,
    rates: list[float],
    recipe: str,
    common: Common,
    clean: dict[str, CellResult],
    tables: tuple[list, ...],
    share_seeds: dict[str, dict[float, dict]],
    kept_seeds: dict[str, dict[float, dict]],
) -> str:
    """A noise kind's report section: its tables, the verdicts, the realised flip fractions."""
    base, higher = rates[0], rates[1:]
    pbase = PAPER_NOISE[kind][0]
    acc_rows, pts_rows, rel_rows, share_rows, realised_rows, kept_rows = tables
    hdr = ["head", f"acc @ {base:g} (%)"] + [f"decline @ {r:g}" for r in higher]
    s = [
        f"## {kind} noise, recipe {recipe}: {common.clients} clients IID, round {common.rounds}, "
        f"seeds {', '.join(map(str, common.seeds))}",
        "",
        "### Accuracy (%)",
        "",
        md_table(["head"] + (["no noise"] if clean else []) + [f"{r:g}" for r in rates], acc_rows),
        "",
        "### Decline from the lowest rate, absolute (percentage points)",
        "",
        md_table(hdr, pts_rows),
        "",
        "### Decline from the lowest rate, relative (% of the lowest-rate accuracy)",
        "",
        md_table(hdr, rel_rows),
        "",
        f"### Share of accuracy retained relative to rate {base:g} (%)",
        "",
        md_table(["head"] + [f"{r:g}" for r in higher], share_rows),
        "",
    ]
    s += _verdict(f"relative to rate {base:g}", share_seeds, higher)
    if kept_rows:
        s += [
            "### Share of the noise-free accuracy retained (%)",
            "",
            "Per seed: accuracy at the rate / accuracy of the same head trained on clean labels.",
            "",
            md_table(["head", "no-noise acc (%)"] + [f"{r:g}" for r in rates], kept_rows),
            "",
        ]
        s += _verdict("relative to no noise", kept_seeds, rates)
    s += [
        "Realised flip fraction (measured over all clients):",
        "",
        md_table(["head"] + [f"{r:g}" for r in rates], realised_rows),
        "",
    ]
    if base != pbase:
        s += [f"(The paper's row is printed only when the lowest rate is {pbase:g}, as in its table.)", ""]
    return "\n".join(s)


@grid_command("noise", clients=20, clients_help="20 (the FedLTF protocol)")
def noise_cmd(
    features: Path = FEATURES_OPT,
    head: List[str] = typer.Option(["softmax", "ova", "ova2"], "--head", help="heads, repeated or comma-separated"),
    sym_rates: str = typer.Option(
        "0.3,0.4,0.5,0.6,0.7", "--sym-rates", help="symmetric flip rates in [0, 1) ('' for none)"
    ),
    asym_rates: str = typer.Option("0.2,0.3,0.4", "--asym-rates", help="asymmetric flip rates in [0, 1) ('' for none)"),
    asym_map: str = option(FIELDS["asym_map"], panel=None)[1],
    partition: str = typer.Option("iid", "--partition", help="partition (FedLTF protocol: iid)"),
    clean: bool = typer.Option(
        True,
        "--clean/--no-clean",
        help="also train each head on clean labels and report the share of that accuracy kept at every rate",
    ),
    recipe: str = typer.Option("default", "--recipe", help=RECIPE_HELP),
    *,
    common: Common,
):
    """Label-noise robustness, FedLTF protocol (the paper's Table 2): declines from the lowest rate."""
    heads = [check_head(h) for h in parse_names(head, "--head")]
    kinds, clean = _noise_kinds(sym_rates, asym_rates, clean)
    pname, pparams = resolve_partition(partition)
    recipes = recipes_of(recipe)
    cells, key_of = _noise_cells(common, features, heads, kinds, clean, recipes, pname, pparams, asym_map)
    config = {
        **common.describe(),
        "heads": heads,
        "rates": kinds,
        "clean": clean,
        "asym_map": asym_map,
        "partition": partition,
        "recipes": recipes,
        "features": str(features),
    }
    cache = StoreCache()
    cmd = start_report(common, list(cells.values()), cache, config)
    results = run_grid(list(cells.values()), common.out, cache)
    by_name = {r.cell.name: r for r in results}
    sections, plots = [], []
    for rec in recipes:
        res = {(h, k, r): by_name[key_of[(rec, h, k, r)]] for h in heads for k, rs in kinds.items() for r in rs}
        clean_of = {h: by_name[key_of[(rec, h, "none", 0.0)]] for h in heads} if clean else {}
        secs, curves = noise_sections(res, heads, kinds, rec, common, clean_of)
        sections += secs
        plots += _noise_plots(common.out, rec, heads, kinds, curves, clean)
    note = (
        "Declines are per seed (accuracy at the lowest rate minus accuracy at the rate; relative = that over "
        "the lowest-rate accuracy), then mean ± std over seeds. The paper's row is OvA-LP on (probably) "
        "CIFAR-100 with ViT-L/16, declines as printed (read as percentage points; relative and share derived "
        "from them)."
    )
    publish_report(
        common, "noise", "fedhead bench noise (OvA-LP Table 2, FedLTF protocol)", cmd, config, results, sections,
        plots, notes=(note,),
    )  # fmt: skip


def _noise_kinds(sym_rates: str, asym_rates: str, clean: bool) -> tuple[dict[str, list[float]], bool]:
    """The noise kinds asked for and their rates > 0; ``clean`` is also on when a rate of 0 is given."""
    kinds = {}
    for kind, param, text in (("symmetric", "--sym-rates", sym_rates), ("asymmetric", "--asym-rates", asym_rates)):
        if text.strip():
            rates = parse_rates(param, text)
            clean = clean or 0.0 in rates  # a rate of 0 is the noise-free run
            kinds[kind] = [r for r in rates if r > 0]
            if not kinds[kind]:
                raise FedheadError(
                    f"The '{param}' parameter needs a rate > 0. Got {text!r} instead. Give e.g. 0.3 "
                    "(the noise-free run is --clean)."
                )
    if not kinds:
        raise FedheadError(
            "The '--sym-rates' and '--asym-rates' parameters are both empty. Got '' instead. Give at least one rate."
        )
    return kinds, clean


def _noise_cells(
    common: Common,
    features: Path,
    heads: list[str],
    kinds: dict[str, list[float]],
    clean: bool,
    recipes: list[str],
    pname: str,
    pparams: dict,
    asym_map: str,
) -> tuple[dict[str, Cell], dict[tuple, str]]:
    """The noise grid's runs by name, and each run's name by (recipe, head, kind, rate)."""
    cells: dict[str, Cell] = {}
    key_of: dict[tuple, str] = {}
    for rec in recipes:
        for h in heads:
            points = [(kind, r) for kind, rates in kinds.items() for r in rates]
            for kind, r in points + ([("none", 0.0)] if clean else []):
                name = noise_name(h, kind, r, rec)
                key_of[(rec, h, kind, r)] = name
                cells[name] = Cell(
                    name,
                    {"head": h, "noise": kind, "rate": r, "recipe": rec},
                    common.cfg(
                        features,
                        head=h,
                        partition=pname,
                        partition_params=pparams,
                        recipe=rec,
                        noise=kind,
                        noise_rate=r,
                        **({"asym_map": asym_map} if kind == "asymmetric" else {}),  # where it applies
                    ),
                )
    return cells, key_of


def _noise_plots(
    out: Path, rec: str, heads: list[str], kinds: dict[str, list[float]], curves: dict, clean: bool
) -> list[Path]:
    """One recipe's noise plots: accuracy and share retained against the flip rate (and the share of the clean
    accuracy kept), a panel per kind, with the paper's OvA-LP."""
    plots = []
    acc_panels, share_panels, kept_panels = [], [], []
    for kind in kinds:
        ap, sp = P.Panel(kind), P.Panel(kind, hline=(1.0, "lowest rate"))
        kp = P.Panel(kind, hline=(1.0, "no noise"))
        for h in heads:
            x, m, s, sh, shs = curves[(kind, h)]
            sp.lines.append(P.Line(h, x, sh, shs, marker="o"))
            if clean:  # the noise-free accuracy drawn at rate 0
                kx, km, ks, c = curves[(kind, h, "clean")]
                x, m, s = [0.0] + x, [c.mean] + m, [c.std] + s
                kp.lines.append(P.Line(h, kx, km, ks, marker="o"))
            ap.lines.append(P.Line(h, x, m, s, marker="o"))
        pbase, pacc, pdec = PAPER_NOISE[kind]
        px = [pbase] + sorted(pdec)
        ap.lines.append(
            P.Line(
                "OvA-LP (paper, CIFAR-100)",
                px,
                [pacc / 100] + [(pacc - pdec[r]) / 100 for r in sorted(pdec)],
                style=":",
                color="gray",
                marker="x",
            )
        )
        sp.lines.append(
            P.Line(
                "OvA-LP (paper)",
                px,
                [1.0] + [1 - pdec[r] / pacc for r in sorted(pdec)],
                style=":",
                color="gray",
                marker="x",
            )
        )
        acc_panels.append(ap)
        share_panels.append(sp)
        kept_panels.append(kp)
    plots.append(
        P.write_curves(
            out / f"noise-accuracy-{rec}.png",
            acc_panels,
            "flip rate",
            "final test accuracy",
            f"accuracy under label noise ({rec})",
        )
    )
    plots.append(
        P.write_curves(
            out / f"noise-retained-{rec}.png",
            share_panels,
            "flip rate",
            "accuracy / accuracy at the lowest rate",
            f"share retained ({rec})",
        )
    )
    if clean:
        plots.append(
            P.write_curves(
                out / f"noise-retained-vs-clean-{rec}.png",
                kept_panels,
                "flip rate",
                "accuracy / noise-free accuracy",
                f"share of clean accuracy kept ({rec})",
            )
        )
    return plots


# ---------------------------------------------------------------- participation


@grid_command("participation")
def participation_cmd(
    features: Path = FEATURES_OPT,
    head: List[str] = typer.Option(["ova2"], "--head", help="heads, repeated or comma-separated"),
    rates: str = typer.Option("0.1,0.4,0.7,1.0", "--rates", help="participation fractions in (0, 1]"),
    partition: str = typer.Option(
        "bernoulli-dirichlet",
        "--partition",
        help="non-IID partition (the paper's 'Dirichlet' is FedCorr's = bernoulli-dirichlet)",
    ),
    recipe: str = typer.Option("default", "--recipe", help=RECIPE_HELP),
    *,
    common: Common,
):
    """Client participation sweep under Dirichlet (the paper's Fig. 9); IID at full participation as reference."""
    heads = [check_head(h) for h in parse_names(head, "--head")]
    fracs = sorted(parse_rates("--rates", rates, low_closed=False, high_closed=True), reverse=True)
    pname, pparams = resolve_partition(partition)
    recipes = recipes_of(recipe)
    cells = _participation_cells(common, features, heads, fracs, partition, pname, pparams, recipes)
    config = {
        **common.describe(),
        "heads": heads,
        "participation": fracs,
        "partition": partition,
        "recipes": recipes,
        "features": str(features),
    }
    cache = StoreCache()
    cmd = start_report(common, cells, cache, config)
    results = run_grid(cells, common.out, cache)
    iid_of = pair_with_iid(results, drop=("partition", "participation"))
    sections, plots = [], []
    for rec in recipes:
        rs = [r for r in results if r.cell.labels["recipe"] == rec]
        sections.append(_participation_text(rs, iid_of, partition, rec, common))
        plots += _participation_plots(common.out, rs, iid_of, heads, partition, rec)
    publish_report(
        common, "participation", "fedhead bench participation (OvA-LP Fig. 9)", cmd, config, results, sections, plots,
        iid_of,
    )  # fmt: skip


def _participation_cells(
    common: Common,
    features: Path,
    heads: list[str],
    fracs: list[float],
    partition: str,
    pname: str,
    pparams: dict,
    recipes: list[str],
) -> list[Cell]:
    """For each recipe and head: the IID run at full participation and one non-IID run per fraction."""
    cells = []
    for rec in recipes:
        for h in heads:
            cells.append(
                Cell(
                    f"{h}-iid-p1-{rec}",
                    {"head": h, "partition": "iid", "participation": 1.0, "recipe": rec},
                    common.cfg(features, head=h, partition="iid", recipe=rec),
                )
            )
            for f in fracs:
                cells.append(
                    Cell(
                        f"{h}-{partition}-p{f:g}-{rec}",
                        {"head": h, "partition": partition, "participation": f, "recipe": rec},
                        common.cfg(
                            features, head=h, partition=pname, partition_params=pparams, recipe=rec, participation=f
                        ),
                    )
                )
    return cells


def _participation_text(rs: list[CellResult], iid_of: dict, partition: str, rec: str, common: Common) -> str:
    """One recipe's participation section: the final table and the ratio to IID per round."""
    lead = ["head", "partition", "participation"]
    s = [
        f"## recipe {rec}: {partition}, {common.clients} clients, round {common.rounds}, "
        f"seeds {', '.join(map(str, common.seeds))}",
        "",
        "Ratio and Acc@95 vs IID refer to the IID run at full participation.",
        "",
        final_table(rs, lead),
        "",
        "### Ratio to IID (full participation) per round (%)",
        "",
        ratio_round_table(rs, iid_of, lead, common.rounds),
        "",
    ]
    return "\n".join(s)


def _participation_plots(
    out: Path, rs: list[CellResult], iid_of: dict, heads: list[str], partition: str, rec: str
) -> list[Path]:
    """One recipe's participation plots: accuracy and ratio to IID per round, a panel per head."""
    plots = []
    acc_panels, ratio_panels = [], []
    for h in heads:
        ap, rp = P.Panel(h), P.Panel(h, hline=(1.0, "IID (p=1)"))
        for r in [x for x in rs if x.cell.labels["head"] == h]:
            x, m, sd = mean_curve(r)
            iid = r.cell.labels["partition"] == "iid"
            ap.lines.append(
                P.Line(
                    "IID, p=1" if iid else f"p={r.cell.labels['participation']:g}",
                    x,
                    m,
                    sd,
                    style="--" if iid else "-",
                    color="black" if iid else None,
                )
            )
            if not iid and iid_of.get(r.cell.name) is not None:
                x, m, sd = ratio_curve(r, iid_of[r.cell.name])
                rp.lines.append(P.Line(f"p={r.cell.labels['participation']:g}", x, m, sd))
        acc_panels.append(ap)
        ratio_panels.append(rp)
    plots.append(
        P.write_curves(
            out / f"participation-accuracy-{rec}.png",
            acc_panels,
            "round",
            "test accuracy",
            f"participation sweep, {partition} ({rec})",
        )
    )
    plots.append(
        P.write_curves(
            out / f"participation-ratio-{rec}.png",
            ratio_panels,
            "round",
            "accuracy / IID accuracy",
            f"ratio to IID ({rec})",
        )
    )
    return plots


# ---------------------------------------------------------------- geometry


def _weights_kind(info) -> str:
    """extract records ``random-init:seed=0`` for --no-pretrained, ``file:``/``hub:``/``state_dict`` else."""
    src = str(info.attrs.get("weights_source", "")).lower()
    if src.startswith("random-init"):
        return "random-init"
    if src.startswith(("file:", "hub:", "state_dict")):
        return "pretrained"
    return "n/a"


@cli_errors
def geometry_cmd(
    features: List[Path] = typer.Option(
        ..., "--features", help="stores to compare, e.g. pretrained and --no-pretrained extractions (repeat)"
    ),
    split: str = typer.Option("train", "--split", help="train | test"),
    samples_per_class: int = typer.Option(
        500, "--samples-per-class", help="samples drawn per class and seed (0 = all)"
    ),
    seeds: Optional[List[str]] = SEEDS_OPT,
    quick: bool = QUICK_OPT,
    out: Optional[Path] = OUT_OPT,
):
    """Feature geometry (the paper's Fig. 2): alignment, intra, inter and intra/inter ratio. No training."""
    validate("--split", split, OneOf(("train", "test")))
    validate("--samples-per-class", samples_per_class, Interval(0, None, integer=True))
    seeds_l = grid_seeds(seeds, quick)
    out = Path(out) if out else Path("reports") / f"geometry-{time.strftime('%Y%m%d-%H%M%S')}"
    check_out(out, kind="dir")  # a file there, or below a file: refused before any work
    infos = [open_store(p) for p in features]
    tags = _store_tags(list(features))
    per_class = samples_per_class or None
    rows, table, series, stats_of, max_class = _geometry_stores(
        tags, infos, split, samples_per_class, per_class, seeds_l
    )
    for kind, vals in PAPER_GEOMETRY.items():
        table.append(
            [f"paper ({kind})", "ViT (paper)", kind, "not stated"]
            + [f"{vals[m][0]:.3f} ± {vals[m][1]:.3f}" if m in vals else "–" for m in COLUMNS]
        )
    datasets = sorted({i.dataset for i in infos})
    s = [
        f"## Feature geometry ({split} split, up to {samples_per_class or 'all'} samples per class, seeds "
        f"{', '.join(map(str, seeds_l))})",
        "",
        md_table(["store", "encoder", "weights", "dataset"] + list(COLUMNS), table),
        "",
    ]
    s += _geometry_comparisons(stats_of)
    if per_class is None or max(max_class) <= per_class:
        s.append(
            f"\nNote: every class has at most {samples_per_class or 'all'} samples, so every seed uses the "
            "same samples and the ± over seeds is 0; lower --samples-per-class to see sampling variation."
        )
    if len(datasets) > 1:
        s.append(
            f"\nNote: the stores hold different datasets ({', '.join(datasets)}); geometry is comparable only "
            "on the same images."
        )

    s += ["", "Definitions (features L2-normalised):", "", "```", gdoc.strip(), "```"]
    sections = ["\n".join(s)]
    path = _write_geometry(out, features, split, samples_per_class, seeds_l, sections, series, rows)
    _print_report(path, sections[:1])


def _geometry_stores(
    tags: list[str], infos: list, split: str, samples_per_class: int, per_class: int | None, seeds_l: list[int]
) -> tuple[list[dict], list[list], dict, dict, list[int]]:
    """Each store's geometry over the seeds: its results.csv row, its table row, its bars, its stats by tag and its
    largest class size."""
    rows, table, series = [], [], {}
    stats_of, max_class = {}, []
    for tag, info in zip(tags, infos):
        f = load_store(info.path)
        x, y = (f.train_x, f.train_y) if split == "train" else (f.test_x, f.test_y)
        per_seed = store_geometry(x, y, seeds_l, per_class)
        max_class.append(int(np.bincount(y).max()))
        stats = {m: Stat.of(p[m] for p in per_seed) for m in COLUMNS}
        stats_of[tag] = (info, stats)
        pause_hook(PAUSE_ENV, len(stats_of))
        kind = _weights_kind(info)
        table.append([tag, info.encoder, kind, info.dataset] + [stats[m].fmt(1, 3) for m in COLUMNS])
        series[tag] = ([stats[m].mean for m in METRICS], [stats[m].std for m in METRICS])
        row = {
            "bench_command": "geometry",
            "bench_store": tag,
            "store_path": str(info.path),
            "store_dataset": info.dataset,
            "store_encoder": info.encoder,
            "store_weights_source": info.attrs.get("weights_source", ""),
            "store_weights_kind": kind,
            "cfg_split": split,
            "cfg_samples_per_class": samples_per_class,
            "cfg_seeds": " ".join(map(str, seeds_l)),
            "res_num_samples": per_seed[0]["n"],
        }
        for m in COLUMNS:
            row[f"res_{m}"], row[f"res_{m}_std"] = stats[m].mean, stats[m].std
        rows.append(row)
    return rows, table, series, stats_of, max_class


def _geometry_comparisons(stats_of: dict) -> list[str]:
    """Every pretrained store against every random-init one: the ratio, and the paper's directions."""
    lines = []
    pre = [t for t, (i, _) in stats_of.items() if _weights_kind(i) == "pretrained"]
    rnd = [t for t, (i, _) in stats_of.items() if _weights_kind(i) == "random-init"]
    for a in pre:
        for b in rnd:
            sa, sb = stats_of[a][1], stats_of[b][1]
            ra, rb = sa["ratio"].mean, sb["ratio"].mean
            same = stats_of[a][0].dataset == stats_of[b][0].dataset and stats_of[a][0].encoder == stats_of[b][0].encoder
            lines.append(
                f"- {a} (pretrained) vs {b} (random-init){'' if same else ' [different encoder or dataset]'}: "
                f"intra/inter {ra:.3f} vs {rb:.3f} → pretrained lower: **{'yes' if ra < rb else 'no'}**"
            )
            as_paper = [
                f"{m} {'yes' if (sa[m].mean > sb[m].mean if m == 'inter' else sa[m].mean < sb[m].mean) else 'no'}"
                f" ({sa[m].mean:.3f} vs {sb[m].mean:.3f})"
                for m in ("alignment", "intra", "inter")
            ]
            lines.append(
                f"  - the paper's direction (pretrained smaller alignment and intra, larger inter): "
                f"{'; '.join(as_paper)}; spread {sa['spread'].mean:.3f} vs {sb['spread'].mean:.3f}"
                + (
                    " (the random-init features fan out less, so their absolute distances are all smaller; "
                    "the ratio is the comparison that does not depend on spread)"
                    if sb["spread"].mean < 0.8 * sa["spread"].mean
                    else ""
                )
            )
    return lines


def _write_geometry(
    out: Path,
    features: list[Path],
    split: str,
    samples_per_class: int,
    seeds_l: list[int],
    sections: list[str],
    series: dict,
    rows: list[dict],
) -> Path:
    """Write the geometry report folder (its one writer): the bars, results.csv and the report; returns its path."""
    with exclusive_writer(out, f"the report folder {str(out)!r}"):
        out.mkdir(parents=True, exist_ok=True)
        plots = [
            P.write_bars(
                out / "geometry.png",
                list(METRICS),
                series,
                "value",
                "feature geometry (lower alignment/intra/ratio, higher inter = better)",
            )
        ]
        write_csv(out / "results.csv", rows)
        cmd = command_line()
        config = {
            "command": "geometry",
            "features": [str(p) for p in features],
            "split": split,
            "samples_per_class": samples_per_class,
            "seeds": seeds_l,
            "out": str(out),
        }
        path = write_report(out, "fedhead bench geometry (OvA-LP Fig. 2)", cmd, config, sections, (), plots)
    return path
