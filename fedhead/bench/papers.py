"""``fedhead bench papers fedova|fedabc|dnc``: a seed paper's own table on the scratch path, next to its numbers.

Each paper is a :class:`Paper`: its dataset columns (:class:`Column`: the paper's protocol as
:class:`fedhead.scratch.runner.ScratchConfig` fields, and what ``--scale cpu`` changes), its grid of runs, the
numbers printed in its PDF (``PAPER_*`` below, with table and row) and its report sections. ``--scale paper``
is the protocol as the paper states it (a GPU job); ``--scale cpu`` cuts rounds, clients, samples or width so
that a table fits in about 30 minutes on 2 CPU cores, and the report lists every cut (the fields that differ
from the paper's protocol, computed, not written by hand). Values the paper does not state are fedhead's
choices, listed as such.

The grid machinery is the other bench commands' (:func:`fedhead.bench.report.run_cells`): one run directory
per cell under ``<out>/runs/``, reused when finished, resumed from its checkpoint when interrupted, one writer
per report folder, every run validated before the first one starts.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
import typer

from fedhead.bench.grid import _print_report, begin_report, grid_seeds, parse_rates, report_writer
from fedhead.bench.report import Cell, CellResult, Stat, _flatten, _stack, md_table, run_cells, write_report
from fedhead.federation import plots as P
from fedhead.federation.rundir import read_csv, write_csv
from fedhead.infra.console import stderr_console
from fedhead.infra.devices import resolve_device
from fedhead.infra.errors import FedheadError, OneOf, param_error, unknown_name, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import check_out
from fedhead.scratch.commands import renamed_options
from fedhead.scratch.data import KWS_WORDS
from fedhead.scratch.runner import ScratchConfig, check_config, config_identity, resolve_config, run_scratch

SEEDS = [0, 42, 777]  # the brief's seeds; none of the three papers states its own

# ---------------------------------------------------------------- the papers' numbers (transcribed from the PDFs)

# FedOVA (Zhu et al. 2021), Table I "Accuracy comparison under different non-IID configurations (%)":
# rows FedAvg / FedOVA, columns dataset x non-IID-l.
PAPER_FEDOVA_T1 = {
    ("F-MNIST", 2): {"fedavg": 84.3, "fedova": 89.4},
    ("F-MNIST", 3): {"fedavg": 85.8, "fedova": 90.3},
    ("F-MNIST", 5): {"fedavg": 89.9, "fedova": 91.7},
    ("CIFAR-10", 2): {"fedavg": 63.5, "fedova": 67.8},
    ("CIFAR-10", 3): {"fedavg": 66.3, "fedova": 69.1},
    ("CIFAR-10", 5): {"fedavg": 72.5, "fedova": 73.2},
    ("KWS", 2): {"fedavg": 80.5, "fedova": 84.6},
    ("KWS", 3): {"fedavg": 82.4, "fedova": 86.4},
    ("KWS", 5): {"fedavg": 86.0, "fedova": 89.2},
}
# FedOVA Table II "Compare to the method [8] with different data sharing rate (beta)", non-IID-2, K=100, C=0.2:
# rows "Data sharing (beta = 5%)", "Data sharing (beta = 10%)" (its FedOVA row repeats Table I's non-IID-2).
PAPER_FEDOVA_T2 = {
    "F-MNIST": {0.05: 86.3, 0.10: 88.1},
    "CIFAR-10": {0.05: 65.3, 0.10: 67.5},
    "KWS": {0.05: 82.6, 0.10: 83.5},
}

# FedABC (Wang et al. 2023), Table 1 "PFL accuracy (%)" and Table 2 "Drift degree" (accuracy of the personalised
# models on a class-balanced local test set), rows dataset x Dir(alpha), columns in the paper's order.
FEDABC_METHODS = ("local", "fedavg", "fedprox", "scaffold", "lg-fedavg", "fedper", "fedrep", "fedrod", "fedabc")
FEDABC_NAMES = {
    "local": "Local only",
    "fedavg": "FedAvg",
    "fedprox": "FedProx",
    "scaffold": "Scaffold",
    "lg-fedavg": "LG FedAvg",
    "fedper": "FedPer",
    "fedrep": "FedRep",
    "fedrod": "FedRod",
    "fedabc": "FedABC",
}
PAPER_FEDABC_T1 = {
    ("MNIST", 0.1): (97.1, 99.1, 98.4, 99.3, 99.2, 99.1, 98.9, 99.3, 99.3),
    ("MNIST", 0.3): (93.3, 98.3, 97.1, 98.6, 98.2, 98.2, 97.8, 98.7, 98.7),
    ("MNIST", 0.5): (92.1, 98.1, 96.9, 98.5, 98.1, 98.0, 97.6, 98.6, 98.5),
    ("MNIST", 1.0): (90.6, 98.0, 96.9, 98.4, 98.1, 98.1, 97.4, 98.5, 98.7),
    ("CIFAR-10", 0.1): (86.0, 91.0, 91.1, 91.2, 88.7, 90.2, 90.4, 90.5, 91.0),
    ("CIFAR-10", 0.3): (72.4, 82.1, 82.2, 81.9, 76.6, 81.2, 81.4, 82.2, 83.3),
    ("CIFAR-10", 0.5): (67.8, 79.8, 79.3, 79.5, 72.8, 78.8, 79.1, 79.8, 81.1),
    # Local only 83.7 at Dir(1.0) breaks the column's trend (72.4, 67.8 above it): printed so in the PDF
    ("CIFAR-10", 1.0): (83.7, 74.1, 73.8, 74.0, 63.7, 72.5, 73.4, 74.1, 76.1),
}
PAPER_FEDABC_T2 = {
    ("MNIST", 0.1): (29.2, 43.7, 39.4, 76.8, 43.9, 43.7, 42.9, 66.9, 76.5),
    ("MNIST", 0.3): (44.2, 68.2, 62.2, 90.2, 68.1, 68.2, 66.3, 85.4, 91.1),
    ("MNIST", 0.5): (58.0, 78.7, 74.0, 94.0, 78.7, 78.8, 77.1, 90.8, 95.1),
    ("MNIST", 1.0): (69.5, 87.6, 84.9, 97.0, 87.6, 87.6, 86.4, 95.3, 97.2),
    ("CIFAR-10", 0.1): (16.7, 37.0, 37.8, 39.6, 20.6, 38.6, 23.5, 31.5, 34.5),
    ("CIFAR-10", 0.3): (23.3, 56.4, 56.3, 56.1, 32.1, 42.0, 41.6, 51.4, 54.7),
    ("CIFAR-10", 0.5): (25.6, 60.0, 59.9, 60.0, 35.4, 47.0, 46.5, 55.5, 59.0),
    ("CIFAR-10", 1.0): (14.4, 64.8, 64.2, 65.2, 39.7, 52.7, 53.8, 61.5, 64.0),
}

# Divide-and-Conquer (Kumar et al.), Table 1 "Accuracy for Color Skewed Distribution for 18 communication
# rounds ... for 2 collaborators": rows skew, columns FedAvg, FedProx, FedMA, D&C. fedhead runs the 95-5 row
# (FedMA is not implemented: its number is shown, not compared).
PAPER_DNC_T1 = {
    "95-5": {"fedavg": 53.1, "fedprox": 56.2, "fedma": 81.0, "dnc": 80.1},
    "75-25": {"fedavg": 52.8, "fedprox": 74.6, "fedma": 78.8, "dnc": 79.2},
    "50-50": {"fedavg": 49.1, "fedprox": 67.2, "fedma": 79.9, "dnc": 81.8},
}
PAPER_DNC_SPLIT = 5  # Section 4.2: divergence rises around layer 5, "Divide5" is the best split

# ---------------------------------------------------------------- protocols


@dataclass(frozen=True)
class Column:
    """One dataset column of a paper's table and the protocol that fills it."""

    key: str  # the paper's name of the column, e.g. "F-MNIST"
    datasets: tuple  # fedhead scratch datasets that fill it, preferred first
    paper: dict  # ScratchConfig fields of the paper's protocol
    cpu: dict  # the fields --scale cpu changes
    on_cpu: bool = True  # run at --scale cpu unless --datasets says otherwise
    note: str = ""  # what differs from the paper whatever the scale


@dataclass(frozen=True)
class Paper:
    """A paper's table: its columns, its grid of runs, its report sections and plots (hooks, no if-chains)."""

    name: str
    title: str
    columns: tuple  # Column, ...
    unstated: tuple  # (what, fedhead's choice) the paper leaves open
    quick: dict  # ScratchConfig fields --quick changes (on top of the scale's)
    level: str  # the row label beside the method: noniid | alpha | skew
    grid: Callable  # (column, alphas) -> [(run name suffix, labels, ScratchConfig fields of the row)]
    sections: Callable  # (by, columns, window, seeds, alphas) -> (report sections, ordering sentences)
    plots: Callable  # (by, columns, out, alphas) -> [png paths]
    finish: Callable = dict  # the row's merged fields -> final fields (D&C: equal rounds); default: as they are
    cpu_note: str = ""  # why the cpu scale runs what it runs
    window: dict = field(default_factory=dict)  # scale -> rounds averaged into the final number


FEDOVA_LEVELS = (2, 3, 5)
FEDOVA_SHARE = (0.05, 0.10)
FEDABC_ALPHAS = {"paper": (0.1, 0.3, 0.5, 1.0), "cpu": (0.1, 0.3, 0.5, 1.0), "quick": (0.1, 1.0)}


# ---------------------------------------------------------------- datasets below --data-dir

# dataset -> folder names tried below --data-dir (then --data-dir itself)
DATASET_DIRS = {
    "fashion-mnist": ("fashion-mnist", "fashion_mnist", "fmnist"),
    "mnist": ("mnist",),
    "cifar10": ("cifar10", "cifar-10", "CIFAR10"),
    "speech-commands": ("speech_commands", "speech-commands"),
}


def _holds(name: str, d: Path) -> bool:
    def idx(inner):
        return any((d / inner / "raw" / f"train-images-idx3-ubyte{s}").is_file() for s in ("", ".gz"))

    if name == "mnist":
        return idx("MNIST")
    if name == "fashion-mnist":
        return idx("FashionMNIST")
    if name == "cifar10":
        return ((d / "train").is_dir() and (d / "test").is_dir()) or (d / "cifar-10-batches-py").is_dir()
    if name == "speech-commands":
        return all((d / w).is_dir() for w in KWS_WORDS)
    return False


def find_dataset(root: Path, name: str) -> Path | None:
    """The folder below ``root`` (or ``root`` itself) that holds dataset ``name`` in its loader's layout."""
    for d in [root / s for s in DATASET_DIRS[name]] + [root]:
        if d.is_dir() and _holds(name, d):
            return d
    return None


def resolve_columns(paper: Paper, root: Path, scale: str, datasets: list[str] | None) -> tuple[list, list[str]]:
    """(column, dataset, folder) to run, and notes on the columns left out."""
    allowed = {d: c for c in paper.columns for d in c.datasets}
    if datasets:
        for d in datasets:
            if d not in allowed:
                raise unknown_name("--datasets", d, allowed, f"dataset of {paper.name}")
        cols = [c for c in paper.columns if any(d in datasets for d in c.datasets)]
        if len({allowed[d].key for d in datasets}) < len(datasets):
            raise FedheadError(
                f"The '--datasets' parameter names two datasets for one column of {paper.name}. Got "
                f"{','.join(datasets)!r} instead. Give one per column."
            )
    else:
        cols = [c for c in paper.columns if scale != "cpu" or c.on_cpu]
    chosen, notes = [], []
    for c in paper.columns:
        if c not in cols:
            notes.append(
                f"{c.key}: not run at --scale cpu unless named in --datasets"
                if scale == "cpu" and not datasets
                else f"{c.key}: not run (not in --datasets)"
            )
            continue
        wanted = [d for d in c.datasets if not datasets or d in datasets]
        found = [(d, find_dataset(root, d)) for d in wanted]
        found = [(d, p) for d, p in found if p is not None]
        if not found:
            if datasets:
                raise param_error(
                    "--data-dir",
                    str(root),
                    f"holds no {wanted[0]} copy (looked in {', '.join(DATASET_DIRS[wanted[0]])} and the folder itself)",
                    f"Point it at the folder holding {wanted[0]}, or drop it from --datasets.",
                )
            notes.append(f"{c.key}: not run (no {' or '.join(c.datasets)} found in --data-dir)")
            continue
        d, p = found[0]
        if c.key == "F-MNIST" and d == "mnist":
            notes.append(
                "F-MNIST: Fashion-MNIST is not in --data-dir; MNIST stands in for it (same size and "
                "shape, an easier task: its accuracies are not comparable to the paper's F-MNIST ones)"
            )
        chosen.append((c, d, p))
    if not chosen:
        other = [d for c in paper.columns if c not in cols for d in c.datasets if find_dataset(root, d)]
        if other:
            raise param_error(
                "--data-dir",
                str(root),
                f"holds none of the datasets --scale {scale} runs for {paper.name} by default",
                f"Name the ones it holds: --datasets {','.join(other)}.",
            )
        names = sorted({d for c in paper.columns for d in c.datasets})
        raise param_error(
            "--data-dir",
            str(root),
            f"holds none of {paper.name}'s datasets ({', '.join(names)}) to run",
            "Point it at the folder holding them, e.g. ../shared/datasets.",
        )
    return chosen, notes


# ---------------------------------------------------------------- the grid


def _fedova_grid(col: Column, alphas) -> list[tuple[str, dict, dict]]:
    rows = []
    for lv in FEDOVA_LEVELS:
        pp = {"shards_per_client": lv, "distinct_labels": True}
        for m in ("fedavg", "fedova"):
            rows.append((f"noniid{lv}-{m}", {"method": m, "noniid": lv}, {"algo": m, "partition_params": pp}))
        if lv == 2:  # Table II: data sharing at non-IID-2
            for b in FEDOVA_SHARE:
                rows.append(
                    (
                        f"noniid2-share{round(b * 100)}",
                        {"method": f"share{round(b * 100)}", "noniid": 2},
                        {"algo": "fedavg", "partition_params": pp, "share_fraction": b},
                    )
                )
    return rows


def _fedabc_grid(col: Column, alphas) -> list[tuple[str, dict, dict]]:
    return [
        (
            f"a{a:g}-{m}",
            {"method": m, "alpha": a},
            {"algo": m, "partition_params": {"alpha": a}, **({"prox_mu": 0.01} if m == "fedprox" else {})},
        )
        for a in alphas
        for m in FEDABC_METHODS
    ]


def _dnc_grid(col: Column, alphas) -> list[tuple[str, dict, dict]]:
    return [
        (f"skew95-{m}", {"method": m, "skew": "95-5"}, {"algo": m, **({"prox_mu": 0.01} if m == "fedprox" else {})})
        for m in ("fedavg", "fedprox", "dnc")
    ]


def _dnc_equal_rounds(f: dict) -> dict:
    """FedAvg and FedProx run as many rounds as D&C's pre-pass and alternating rounds together."""
    return {**f, "rounds": f["prepass_rounds"] + f["rounds"]} if f["algo"] != "dnc" else f


def _fields(paper: Paper, col: Column, scale: str, quick: bool, row: dict) -> dict:
    """The ScratchConfig fields of one row at a scale: the paper's protocol, the scale's cuts, --quick."""
    return paper.finish({**col.paper, **(col.cpu if scale == "cpu" else {}), **(paper.quick if quick else {}), **row})


FIELD_WORDS = {
    "rounds": "rounds",
    "clients": "clients K",
    "participation": "participation",
    "subset": "training samples (stratified subset)",
    "test_subset": "test samples (stratified subset)",
    "model": "model",
    "local_epochs": "local epochs",
    "feature_epochs": "D&C feature-learning epochs",
    "finetune_epochs": "D&C fine-tuning epochs",
    "prepass_rounds": "D&C pre-pass rounds",
    "local_test_size": "local test samples per client",
    "batch_size": "batch size",
    "lr": "learning rate",
}


def _cuts(paper: Paper, col: Column, scale: str, quick: bool, alphas) -> list[str]:
    """What this scale changes in the paper's protocol, field by field (computed from the configurations); a
    change that differs between methods is listed per method."""
    changes: dict[str, dict[tuple, list[str]]] = {}
    for _, _, row in paper.grid(col, alphas):
        ref, got = _fields(paper, col, "paper", False, row), _fields(paper, col, scale, quick, row)
        for k in sorted(set(ref) | set(got)):
            if ref.get(k) != got.get(k):
                algos = changes.setdefault(k, {}).setdefault((ref.get(k), got.get(k)), [])
                if row["algo"] not in algos:
                    algos.append(row["algo"])
    out = []
    for k, ways in changes.items():
        for (a, b), algos in ways.items():
            out.append(
                f"{FIELD_WORDS.get(k, k)}: {'all' if a is None else a} → {b}"
                + (f" ({', '.join(algos)})" if len(ways) > 1 else "")
            )
    return out


def build_cells(
    paper: Paper, columns, scale: str, quick: bool, seeds: list[int], alphas, device: str, backend: str
) -> list[Cell]:
    cells = []
    for col, ds, folder in columns:
        for suffix, labels, row in paper.grid(col, alphas):
            f = _fields(paper, col, scale, quick, row)
            cfg = ScratchConfig(
                dataset=ds, data_dir=str(folder), seeds=list(seeds), device=device, backend=backend, **f
            )
            cells.append(
                Cell(f"{ds}--{suffix}", {"paper": paper.name, "column": col.key, "dataset": ds, **labels}, cfg)
            )
    return cells


def check_cells(cells: list[Cell], out: Path, dry: bool) -> list:
    """Resolve and check every run before the first starts (nothing written on bad input); an existing run
    directory of another configuration is refused here too."""
    resolved = []
    for c in cells:
        try:
            cfg = resolve_config(c.cfg) if dry else check_config(c.cfg)[0]
        except FedheadError as exc:
            raise FedheadError(f"run {c.name}: {exc}") from None
        resolved.append(cfg)
        prev = out / "runs" / c.name / "config.json"
        if not dry and prev.exists():
            try:
                same = json.loads(prev.read_text()).get("identity") == config_identity(cfg)
            except (OSError, ValueError):
                same = False
            if not same:
                raise param_error(
                    "--out",
                    str(out),
                    f"holds run {c.name} of another configuration (other --scale, --seeds, --quick, --backend or data)",
                    "Re-run with the options that made it, or choose another --out.",
                )
    return resolved


# ---------------------------------------------------------------- per-run numbers


def _series(r: CellResult, key: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    out: dict[int, tuple[list, list]] = {}
    for row in r.rows:
        v = row.get(key)
        if not isinstance(v, (int, float)) or v != v:
            continue
        rs, ys = out.setdefault(int(row["seed"]), ([], []))
        rs.append(int(row["round"]))
        ys.append(float(v))
    return {s: (np.array(a), np.array(b)) for s, (a, b) in out.items()}


def final(r: CellResult, key: str, window: int) -> Stat:
    """Per seed the mean of ``key`` over the last ``window`` rounds that have it; mean ± std over seeds."""
    return Stat.of(float(np.mean(ys[-window:])) for _, ys in _series(r, key).values() if len(ys))


def curve(r: CellResult, key: str = "accuracy"):
    return _stack(list(_series(r, key).values()))


def _mb(r: CellResult, key: str = "bytes_total") -> Stat:
    return Stat.of(v / 1e6 for v in r.per_seed(key))


def _pct(s: Stat, digits: int = 1) -> str:
    return s.fmt(100, digits)


def _delta(s: Stat, paper: float | None) -> str:
    if paper is None or not s.values:
        return "–"
    return f"{100 * s.mean - paper:+.1f}"


def _wins(a: CellResult, b: CellResult, key: str, window: int) -> str:
    """In how many seeds ``a`` is above ``b`` (paired by seed)."""
    fa = {s: float(np.mean(y[-window:])) for s, (_, y) in _series(a, key).items() if len(y)}
    fb = {s: float(np.mean(y[-window:])) for s, (_, y) in _series(b, key).items() if len(y)}
    common = sorted(set(fa) & set(fb))
    return f"{sum(fa[s] > fb[s] for s in common)}/{len(common)} seeds"


# ---------------------------------------------------------------- report sections


def _fedova_sections(by, columns, window, seeds, alphas) -> tuple[list[str], list[str]]:
    secs, verdicts = [], []
    for col, ds, _ in columns:
        rows = []
        for lv in FEDOVA_LEVELS:
            for m, name, paper in (
                [("fedavg", "FedAvg", PAPER_FEDOVA_T1[(col.key, lv)]["fedavg"])]
                + (
                    [
                        (
                            f"share{round(b * 100)}",
                            f"FedAvg + data sharing (beta = {round(b * 100)}%)",
                            PAPER_FEDOVA_T2[col.key][b],
                        )
                        for b in FEDOVA_SHARE
                    ]
                    if lv == 2
                    else []
                )
                + [("fedova", "FedOVA", PAPER_FEDOVA_T1[(col.key, lv)]["fedova"])]
            ):
                r = by[(ds, lv, m)]
                acc = final(r, "accuracy", window)
                table = "Table II" if m.startswith("share") else "Table I"
                rows.append(
                    [f"non-IID-{lv}", name, f"{paper:.1f}", _pct(acc), _delta(acc, paper), table, _mb(r).fmt(1, 1)]
                )
        label = col.key if ds != "mnist" else f"{col.key} (MNIST here)"
        secs.append(
            "\n".join(
                [
                    f"## FedOVA Tables I and II: {label}, accuracy (%)",
                    "",
                    f"Ours: mean ± std over seeds {', '.join(map(str, seeds))} of each seed's mean test accuracy over the "
                    f"last {window} rounds. MB: bytes sent over the run (both directions, all clients; data sharing's "
                    "D_s included once per client).",
                    "",
                    md_table(["non-IID", "method", "paper", "ours", "ours − paper", "paper table", "MB total"], rows),
                    "",
                ]
            )
        )
        ova, avg = by[(ds, 2, "fedova")], by[(ds, 2, "fedavg")]
        s5, s10 = by[(ds, 2, "share5")], by[(ds, 2, "share10")]
        m = {
            k: final(v, "accuracy", window).mean
            for k, v in (("FedOVA", ova), ("sharing 10%", s10), ("sharing 5%", s5), ("FedAvg", avg))
        }
        order = " > ".join(f"{k} {100 * v:.1f}" for k, v in sorted(m.items(), key=lambda kv: -kv[1]))
        holds = (
            m["FedOVA"] > max(m["sharing 10%"], m["sharing 5%"])
            and min(m["sharing 10%"], m["sharing 5%"]) > m["FedAvg"]
        )
        verdicts.append(
            f"- {label}, non-IID-2: the paper's order FedOVA > data sharing > FedAvg "
            f"{'holds' if holds else 'does not hold'} in the means here ({order}); paired by seed, "
            f"FedOVA is above FedAvg in {_wins(ova, avg, 'accuracy', window)} and above sharing 10% in "
            f"{_wins(ova, s10, 'accuracy', window)}, sharing 10% above FedAvg in "
            f"{_wins(s10, avg, 'accuracy', window)}, sharing 5% above FedAvg in "
            f"{_wins(s5, avg, 'accuracy', window)}."
        )
        for lv in (3, 5):
            o, a = by[(ds, lv, "fedova")], by[(ds, lv, "fedavg")]
            verdicts.append(
                f"- {label}, non-IID-{lv}: FedOVA {_pct(final(o, 'accuracy', window))} vs FedAvg "
                f"{_pct(final(a, 'accuracy', window))} (FedOVA above in "
                f"{_wins(o, a, 'accuracy', window)})."
            )
    return secs, verdicts


def _fedabc_sections(by, columns, window, seeds, alphas) -> tuple[list[str], list[str]]:
    secs, verdicts = [], []
    for col, ds, _ in columns:
        for key, tname, tab, what in (
            (
                "pfl_accuracy",
                "Table 1: PFL accuracy",
                PAPER_FEDABC_T1,
                "personalised models on their own non-IID local test sets",
            ),
            (
                "drift_accuracy",
                "Table 2: drift degree",
                PAPER_FEDABC_T2,
                "personalised models on class-balanced local test sets; higher = less drift",
            ),
        ):
            rows = []
            for a in alphas:
                paper = tab.get((col.key, a))
                for i, m in enumerate(FEDABC_METHODS):
                    st = final(by[(ds, a, m)], key, window)
                    p = paper[i] if paper else None
                    rows.append(
                        [f"Dir({a:g})", FEDABC_NAMES[m], "–" if p is None else f"{p:.1f}", _pct(st), _delta(st, p)]
                    )
            secs.append(
                "\n".join(
                    [
                        f"## FedABC {tname} (%), {col.key}",
                        "",
                        f"Ours: {what}; per seed the mean over the last {window} rounds of the pooled accuracy of that "
                        f"round's participating clients after local training, then mean ± std over seeds "
                        f"{', '.join(map(str, seeds))}.",
                        "",
                        md_table(["Dir(α)", "method", "paper", "ours", "ours − paper"], rows),
                        "",
                    ]
                )
            )
        rows = []
        for a in alphas:
            rows.append([f"Dir({a:g})"] + [_pct(final(by[(ds, a, m)], "accuracy", window)) for m in FEDABC_METHODS])
        secs.append(
            "\n".join(
                [
                    f"## Global test accuracy (%), {col.key} (not in the paper)",
                    "",
                    "The global model on the global test set; for local / FedPer / FedRep / LG-FedAvg / FedRoD the personal "
                    "models (test sample i scored by client i mod K).",
                    "",
                    md_table(["Dir(α)"] + [FEDABC_NAMES[m] for m in FEDABC_METHODS], rows),
                    "",
                ]
            )
        )
        for a in alphas:
            pfl = {m: final(by[(ds, a, m)], "pfl_accuracy", window).mean for m in FEDABC_METHODS}
            drift = {m: final(by[(ds, a, m)], "drift_accuracy", window).mean for m in FEDABC_METHODS}
            above = [FEDABC_NAMES[m] for m in FEDABC_METHODS if m != "fedabc" and pfl[m] > pfl["fedabc"]]
            best = max((m for m in FEDABC_METHODS if m != "fedabc"), key=lambda m: pfl[m])
            abc, avg = by[(ds, a, "fedabc")], by[(ds, a, "fedavg")]
            pfl_txt = "at least every baseline's" if not above else f"below {', '.join(above)}'s"
            drift_txt = "above" if drift["fedabc"] > drift["fedavg"] else "not above"
            verdicts.append(
                f"- {col.key}, Dir({a:g}): FedABC's PFL accuracy {100 * pfl['fedabc']:.1f} is {pfl_txt} (best "
                f"baseline {FEDABC_NAMES[best]} {100 * pfl[best]:.1f}; FedABC above it in "
                f"{_wins(abc, by[(ds, a, best)], 'pfl_accuracy', window)}); its drift metric "
                f"{100 * drift['fedabc']:.1f} is {drift_txt} FedAvg's {100 * drift['fedavg']:.1f} (above in "
                f"{_wins(abc, avg, 'drift_accuracy', window)})."
            )
    return secs, verdicts


def _divergence(r: CellResult) -> tuple[list[str], np.ndarray, np.ndarray, dict[int, int]]:
    """Layer names, mean and std over seeds of the last pre-pass round's divergence; split per seed."""
    rows = read_csv(r.run_dir / "divergence.csv") if (r.run_dir / "divergence.csv").exists() else []
    per_seed: dict[int, dict[int, float]] = {}
    names: dict[int, str] = {}
    last = {}
    for row in rows:
        s, rnd = int(row["seed"]), int(row["round"])
        last[s] = max(last.get(s, 0), rnd)
    for row in rows:
        s = int(row["seed"])
        if int(row["round"]) == last[s]:
            per_seed.setdefault(s, {})[int(row["layer"])] = float(row["divergence"])
            names[int(row["layer"])] = row["name"]
    layers = sorted(names)
    mat = np.array([[per_seed[s][lyr] for lyr in layers] for s in sorted(per_seed)]) if per_seed else np.zeros((0, 0))
    splits = {int(x["seed"]): x.get("split_layer") for x in r.summary["per_seed"]}
    std = mat.std(0, ddof=1) if len(mat) > 1 else np.zeros(len(layers))
    return [names[lyr] for lyr in layers], (mat.mean(0) if len(mat) else np.zeros(0)), std, splits


def _dnc_sections(by, columns, window, seeds, alphas) -> tuple[list[str], list[str]]:
    secs, verdicts = [], []
    for col, ds, _ in columns:
        runs = {m: by[(ds, "95-5", m)] for m in ("fedavg", "fedprox", "dnc")}
        fa_rounds = max(int(r["round"]) for r in runs["fedavg"].rows)
        secs.append(_dnc_accuracy_table(runs, window, seeds))
        section, ratio_all, ratio_pairs = _dnc_bytes_table(runs, seeds, fa_rounds)
        secs.append(section)
        section = _dnc_divergence_table(runs["dnc"], seeds)
        if section is not None:
            secs.append(section)
        acc = {m: final(runs[m], "accuracy", window) for m in runs}
        verdicts.append(
            f"- {col.key} 95-5: D&C's bytes are {ratio_pairs.fmt(1, 3)} of FedAvg's over the whole feature + fine-tuning "
            f"pairs after the pre-pass ({ratio_all.fmt(1, 3)} over all {fa_rounds} rounds, pre-pass included); its "
            f"accuracy {_pct(acc['dnc'])} vs FedAvg {_pct(acc['fedavg'])} (D&C above in "
            f"{_wins(runs['dnc'], runs['fedavg'], 'accuracy', window)}) and FedProx {_pct(acc['fedprox'])} (above in "
            f"{_wins(runs['dnc'], runs['fedprox'], 'accuracy', window)}); chance is 10.0."
        )
    return secs, verdicts


def _dnc_accuracy_table(runs: dict[str, CellResult], window: int, seeds: list[int]) -> str:
    """D&C Table 1: each method's accuracy next to the paper's, and its bytes."""
    rows = []
    for m, name in (("fedavg", "FedAvg"), ("fedprox", "FedProx"), ("fedma", "FedMA"), ("dnc", "D&C")):
        p = PAPER_DNC_T1["95-5"][m]
        if m == "fedma":
            rows.append(["95-5", name, f"{p:.1f}", "not implemented", "–", "–", "–", "–"])
            continue
        r = runs[m]
        acc = final(r, "accuracy", window)
        rounds = max(int(x["round"]) for x in r.rows)
        rows.append(
            [
                "95-5",
                name,
                f"{p:.1f}",
                _pct(acc),
                _delta(acc, p),
                _pct(final(r, "accuracy", 2)),
                str(rounds),
                _mb(r).fmt(1, 2),
            ]
        )
    return "\n".join(
        [
            "## D&C Table 1, colour skew 95-5, 2 collaborators: accuracy (%) and bytes",
            "",
            f"Ours: test accuracy after the last round (50% grayscale test set), mean ± std over seeds "
            f"{', '.join(map(str, seeds))}; last 2 rounds: each seed's mean over the last two rounds (D&C "
            "alternates feature and fine-tuning rounds); MB: bytes sent over the run (both directions). The "
            "paper's FedMA number is shown for reference (FedMA is not implemented here).",
            "",
            md_table(
                [
                    "skew",
                    "method",
                    "paper",
                    "ours",
                    "ours − paper",
                    "ours, last 2 rounds",
                    "rounds",
                    "MB total",
                ],
                rows,
            ),
            "",
        ]
    )


def _dnc_bytes_table(runs: dict[str, CellResult], seeds: list[int], fa_rounds: int) -> tuple[str, Stat, Stat]:
    """D&C's bytes against FedAvg's at equal rounds; also the ratios over all rounds and over the whole pairs."""
    # bytes at equal rounds: D&C's rounds after the pre-pass against FedAvg's rounds with the same numbers
    dnc, fa = runs["dnc"], runs["fedavg"]
    prepass = int(dnc.config.get("prepass_rounds", 0))
    after, fa_after, pairs, fa_pairs = [], [], [], []
    for s in seeds:
        fr = {int(x["round"]): x["bytes_total"] for x in fa.rows if int(x["seed"]) == s}
        dr = {int(x["round"]): x["bytes_total"] for x in dnc.rows if int(x["seed"]) == s}
        rest = sorted(r for r in dr if r > prepass)
        whole = rest[: len(rest) // 2 * 2]  # whole (feature, fine-tuning) pairs
        after.append(sum(dr[r] for r in rest))
        fa_after.append(sum(fr.get(r, 0) for r in rest))
        pairs.append(sum(dr[r] for r in whole))
        fa_pairs.append(sum(fr.get(r, 0) for r in whole))
    n_pairs = (max(int(x["round"]) for x in dnc.rows) - prepass) // 2

    def ratio(a, b):
        return Stat.of(x / y for x, y in zip(a, b) if y)

    ratio_all = ratio(dnc.per_seed("bytes_total"), fa.per_seed("bytes_total"))
    ratio_pairs = ratio(pairs, fa_pairs)
    section = "\n".join(
        [
            "### Bytes at equal rounds",
            "",
            md_table(
                ["rounds", "D&C MB", "FedAvg MB", "D&C / FedAvg"],
                [
                    [
                        f"all {fa_rounds} (D&C: its {prepass} full-model pre-pass rounds included)",
                        _mb(dnc).fmt(1, 2),
                        _mb(fa).fmt(1, 2),
                        ratio_all.fmt(1, 3),
                    ],
                    [
                        f"{prepass + 1}-{fa_rounds} (after the pre-pass)",
                        Stat.of(after).fmt(1e-6, 2),
                        Stat.of(fa_after).fmt(1e-6, 2),
                        ratio(after, fa_after).fmt(1, 3),
                    ],
                    [
                        f"{prepass + 1}-{prepass + 2 * n_pairs} ({n_pairs} feature + fine-tuning pairs)",
                        Stat.of(pairs).fmt(1e-6, 2),
                        Stat.of(fa_pairs).fmt(1e-6, 2),
                        ratio_pairs.fmt(1, 3),
                    ],
                ],
            ),
            "",
            "The paper: D&C sends half of FedAvg's bytes (the full model once every two rounds).",
            "",
        ]
    )
    return section, ratio_all, ratio_pairs


def _dnc_divergence_table(dnc: CellResult, seeds: list[int]) -> str | None:
    """The layer-wise divergence after D&C's pre-pass and the split chosen (None without divergence.csv rows)."""
    names, mean, std, splits = _divergence(dnc)
    if not names:
        return None
    rows = [
        [f"L{i + 1}", n, f"{m:.3g}" + (f" ± {s:.2g}" if len(seeds) > 1 else "")]
        for i, (n, m, s) in enumerate(zip(names, mean, std))
    ]
    split_txt = ", ".join(f"seed {s}: L{v}" for s, v in sorted(splits.items()))
    return "\n".join(
        [
            "### Layer-wise weight divergence after the pre-pass, and the split",
            "",
            "1 − cos(local, global) per weight layer at the last pre-pass round, averaged over the two "
            "collaborators, mean ± std over seeds; the paper (Fig. 5): low for the first layers, rising around "
            f"layer {PAPER_DNC_SPLIT}, split after layer {PAPER_DNC_SPLIT} (Divide5).",
            "",
            md_table(["layer", "name", "divergence"], rows),
            "",
            f"Split chosen (layers 1..s learn features): {split_txt}; the paper: {PAPER_DNC_SPLIT}.",
            "",
        ]
    )


# ---------------------------------------------------------------- plots


def _fedova_plots(by, columns, out: Path, alphas) -> list[Path]:
    paths = []
    for col, ds, _ in columns:
        panels = []
        for lv in FEDOVA_LEVELS:
            p = P.Panel(f"{col.key} ({ds}), non-IID-{lv}")
            for m, label in (
                ("fedavg", "FedAvg"),
                ("share5", "sharing 5%"),
                ("share10", "sharing 10%"),
                ("fedova", "FedOVA"),
            ):
                if (ds, lv, m) in by:
                    x, y, sd = curve(by[(ds, lv, m)])
                    p.lines.append(P.Line(label, x, y, sd))
            panels.append(p)
        paths.append(
            P.write_curves(
                out / f"fedova-{ds}-accuracy.png",
                panels,
                "round",
                "test accuracy",
                f"FedOVA Table I/II runs: accuracy per round ({ds})",
            )
        )
    return paths


def _fedabc_plots(by, columns, out: Path, alphas) -> list[Path]:
    paths = []
    for col, ds, _ in columns:
        for key, what in (("pfl_accuracy", "PFL accuracy"), ("drift_accuracy", "drift (balanced accuracy)")):
            panels = []
            for a in alphas:
                p = P.Panel(f"{col.key}, Dir({a:g})")
                for m in FEDABC_METHODS:
                    x, y, sd = curve(by[(ds, a, m)], key)
                    style = "-" if m == "fedabc" else "--" if m in ("local", "fedavg") else "-."
                    p.lines.append(P.Line(FEDABC_NAMES[m], x, y, sd, style=style))
                panels.append(p)
            paths.append(
                P.write_curves(
                    out / f"fedabc-{ds}-{key.split('_')[0]}.png",
                    panels,
                    "round",
                    what,
                    f"FedABC Table {1 if key == 'pfl_accuracy' else 2} runs: {what} per round ({ds})",
                )
            )
    return paths


def _dnc_plots(by, columns, out: Path, alphas) -> list[Path]:
    paths = []
    for col, ds, _ in columns:
        acc, mb = P.Panel(f"{col.key}, colour skew 95-5: accuracy", hline=(0.1, "chance")), P.Panel("cumulative MB")
        for m, label in (("fedavg", "FedAvg"), ("fedprox", "FedProx"), ("dnc", "D&C")):
            r = by[(ds, "95-5", m)]
            x, y, sd = curve(r)
            acc.lines.append(P.Line(label, x, y, sd))
            xb, yb, _ = curve(r, "bytes_total")
            mb.lines.append(P.Line(label, xb, np.cumsum(yb) / 1e6))
        paths.append(
            P.write_curves(
                out / f"dnc-{ds}-accuracy.png", [acc], "round", "test accuracy", "D&C Table 1 runs: accuracy per round"
            )
        )
        paths.append(
            P.write_curves(out / f"dnc-{ds}-bytes.png", [mb], "round", "MB", "bytes sent (both directions, cumulative)")
        )
        names, mean, std, splits = _divergence(by[(ds, "95-5", "dnc")])
        if names:
            p = P.Panel("last pre-pass round")
            p.lines.append(P.Line("1 - cos(local, global)", list(range(1, len(names) + 1)), mean, std, marker="o"))
            paths.append(
                P.write_curves(
                    out / f"dnc-{ds}-divergence.png",
                    [p],
                    "weight layer",
                    "divergence",
                    f"D&C pre-pass divergence (split: {sorted(set(splits.values()))})",
                )
            )
    return paths


# ---------------------------------------------------------------- the three papers

_FEDOVA_BASE = dict(
    clients=100,
    participation=0.2,
    local_epochs=5,
    batch_size=15,
    optimizer="adam",
    lr=1e-3,
    momentum=0.0,
    weight_decay=0.0,
    rounds=100,
    partition="shard",
    local_test_size=0,
)
FEDOVA = Paper(
    "fedova",
    "FedOVA (Zhu et al. 2021) Tables I and II: FedAvg, FedAvg + data sharing and FedOVA under non-IID-l",
    (
        Column(
            "F-MNIST",
            ("fashion-mnist", "mnist"),
            {**_FEDOVA_BASE, "model": "cnn"},
            {"subset": 2000, "test_subset": 500, "clients": 50, "rounds": 20},
        ),
        Column(
            "CIFAR-10",
            ("cifar10",),
            {**_FEDOVA_BASE, "model": "vgg11"},
            {"model": "vgg11-w8", "subset": 2000, "test_subset": 500, "clients": 50, "rounds": 20},
            on_cpu=False,
        ),
        Column(
            "KWS",
            ("speech-commands",),
            {**_FEDOVA_BASE, "model": "kws-cnn"},
            {"clients": 50, "rounds": 20},
            on_cpu=False,
            note="KWS here is the offline Speech Commands copy: the 10 command words yes/no/up/down/left/right/"
            "on/off/stop/go of the official test set (2,004 train / 496 test clips by speaker), not the "
            "paper's one..five/down/left/right/stop/go with 20,000 training clips",
        ),
    ),
    (
        ("rounds", "not stated (Table III averages the last 20 rounds); fedhead runs 100 at --scale paper"),
        ("Adam's learning rate", "not stated; 1e-3 (Adam's default)"),
        ("final accuracy", "mean test accuracy of the last 20 rounds (Table III's rule; last 5 at --scale cpu)"),
        (
            "data sharing",
            "Zhao et al. 2018 as FedOVA describes it: |D_s| = beta x mean client size, drawn uniformly "
            "from the training set once, added to every client's data, bytes counted once",
        ),
    ),
    dict(subset=400, test_subset=200, clients=10, rounds=3, local_epochs=1),
    level="noniid",
    grid=_fedova_grid,
    sections=_fedova_sections,
    plots=_fedova_plots,
    cpu_note="--scale cpu runs the F-MNIST column only, to stay within about 30 minutes; the CIFAR-10 (VGG11 at "
    "1/8 width) and KWS columns run with --datasets cifar10,speech-commands",
    window={"paper": 20, "cpu": 5},
)

_FEDABC_BASE = dict(
    clients=20,
    participation=0.5,
    local_epochs=5,
    batch_size=64,
    optimizer="sgd",
    momentum=0.9,
    weight_decay=1e-5,
    partition="dirichlet",
    local_test_size=200,
)
FEDABC = Paper(
    "fedabc",
    "FedABC (Wang et al. 2023) Tables 1 and 2: PFL accuracy and drift of FedABC and its comparison set",
    (
        Column(
            "MNIST",
            ("mnist",),
            {
                **_FEDABC_BASE,
                "model": "fedabc-mlp",
                "lr": 0.01,
                "rounds": 100,
                "fedabc_margins": (0.75, 0.25, 0.3, 2.0),
            },
            {"subset": 3000, "test_subset": 2000, "rounds": 25},
        ),
        Column(
            "CIFAR-10",
            ("cifar10",),
            {
                **_FEDABC_BASE,
                "model": "fedabc-convnet",
                "lr": 0.1,
                "rounds": 200,
                "fedabc_margins": (0.85, 0.2, 0.3, 2.0),
            },
            {"subset": 2000, "test_subset": 2000, "rounds": 10},
            on_cpu=False,
        ),
    ),
    (
        (
            "local test set size",
            "not stated; 200 samples per client, drawn from the test set in the client's "
            "training class proportions (PFL) and class-balanced (drift)",
        ),
        (
            "which rounds are scored",
            "not stated; the mean over the last 5 rounds of the participating clients' models after local training",
        ),
        ("FedProx mu", "not stated; 0.01"),
        (
            "FedPer / FedRep / LG-FedAvg head",
            "not stated; the last linear layer (FedRep: 4 head epochs, then 1 body epoch)",
        ),
        ("baselines' output", "softmax (FedABC: sigmoid outputs with its binary loss), as the paper says"),
    ),
    dict(subset=400, test_subset=200, clients=6, rounds=2, local_epochs=2, local_test_size=20),  # FedRep: 2 epochs
    level="alpha",
    grid=_fedabc_grid,
    sections=_fedabc_sections,
    plots=_fedabc_plots,
    cpu_note="--scale cpu runs the MNIST rows only, to stay within about 30 minutes (FedABC's CIFAR-10 ConvNet "
    "has about 55 times the MLP's multiply-adds per image); the CIFAR-10 rows run with --datasets cifar10",
    window={"paper": 5, "cpu": 5},
)

DNC = Paper(
    "dnc",
    "Divide-and-Conquer (Kumar et al.) Table 1: colour skew 95-5, FedAvg / FedProx / D&C, with bytes",
    (
        Column(
            "CIFAR-10",
            ("cifar10",),
            dict(
                model="vgg9",
                partition="color-skew",
                skew=0.95,
                clients=2,
                participation=1.0,
                local_epochs=5,
                batch_size=64,
                optimizer="adam",
                lr=1e-3,
                momentum=0.0,
                weight_decay=0.0,
                local_test_size=0,
                prepass_rounds=5,
                rounds=13,
                feature_epochs=20,
                finetune_epochs=4,
                finetune_lr_factor=0.5,
                lr_decay=0.9,
                split_threshold=0.5,
                divergence="local-vs-global",
            ),
            {"model": "vgg9-w4", "subset": 2000, "test_subset": 1000},
        ),
    ),
    (
        ("FedAvg / FedProx local epochs", "not stated; 5 (the pre-pass's)"),
        ("batch size", "not stated; 64"),
        (
            "optimizer",
            "not stated; Adam (fresh state every round) at the paper's lr 0.001 for every method; D&C "
            "decays it by 10% a round after the pre-pass, fine-tuning rounds at half of it. With SGD "
            "(momentum 0.9) FedAvg stayed at chance in the CPU-sized runs tried (lr 0.001 and 0.02 on 2,000 "
            "images with 2 local epochs, lr 0.05 on 1,000 images with 5)",
        ),
        ("FedProx mu", "not stated; 0.01"),
        ("rounds", "18 for every method (Table 1); D&C's 5 pre-pass rounds count among them"),
        (
            "split",
            "the first layer whose pre-pass divergence (1 - cos(local, global), averaged over both "
            "collaborators, last pre-pass round) exceeds 0.5 x the largest starts the fine-tuning group",
        ),
    ),
    dict(
        subset=200,
        test_subset=200,
        prepass_rounds=1,
        rounds=2,
        feature_epochs=1,
        finetune_epochs=1,
        local_epochs=1,
        model="vgg9-w8",
    ),
    level="skew",
    grid=_dnc_grid,
    sections=_dnc_sections,
    plots=_dnc_plots,
    finish=_dnc_equal_rounds,
    cpu_note="--scale cpu keeps the protocol's shape (2 collaborators, 18 rounds, the paper's epochs, the split "
    "from the pre-pass) on 2,000 training images and a 1/4-width VGG-9",
    window={"paper": 1, "cpu": 1},
)

PAPERS = {p.name: p for p in (FEDOVA, FEDABC, DNC)}


# ---------------------------------------------------------------- files


def _key(paper: Paper, r: CellResult):
    lb = r.cell.labels
    return lb["dataset"], lb[paper.level], lb["method"]


def _result_rows(results: list[CellResult], window: int) -> list[dict]:
    fields = {f.name for f in dataclasses.fields(ScratchConfig)}
    rows = []
    for r in results:
        row: dict = {"bench_command": "papers"}
        _flatten("bench", r.cell.labels, row)
        row.update(run_name=r.cell.name, run_dir=str(r.run_dir), run_status=r.status)
        _flatten("cfg", {k: v for k, v in r.config.items() if k in fields}, row)
        _flatten("res", {k: v for k, v in r.summary.items() if not isinstance(v, (dict, list))}, row)
        for key in ("accuracy", "pfl_accuracy", "drift_accuracy"):
            st = final(r, key, window)
            if st.values:
                row[f"res_table_{key}"], row[f"res_table_{key}_std"] = st.mean, st.std  # the report's number
        row["res_table_window"] = window
        rows.append(row)
    return rows


def _curve_rows(results: list[CellResult]) -> list[dict]:
    rows = []
    for r in results:
        cols = {k: curve(r, k) for k in ("accuracy", "pfl_accuracy", "drift_accuracy", "bytes_total")}
        x = cols["accuracy"][0]
        for rnd in x:
            row = {"run_name": r.cell.name, **{f"bench_{k}": v for k, v in r.cell.labels.items()}, "round": int(rnd)}
            for k, (xs, m, s) in cols.items():
                at = {int(a): (b, c) for a, b, c in zip(xs, m, s)}
                if int(rnd) in at:
                    row[f"{k}_mean"], row[f"{k}_std"] = map(float, at[int(rnd)])
            rows.append(row)
    return rows


# ---------------------------------------------------------------- the command


def _csv_list(param: str, text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = list(dict.fromkeys(t for t in str(text).replace(",", " ").split() if t))
    if not items:
        raise FedheadError(f"The '{param}' parameter needs at least one value. Got {text!r} instead.")
    return items


def _alphas(paper: Paper, text: str | None, scale: str, quick: bool) -> tuple:
    if text is None:
        return FEDABC_ALPHAS["quick" if quick else scale] if paper.level == "alpha" else ()
    if paper.level != "alpha":
        raise param_error("--alphas", text, f"does not apply to {paper.name}", "Drop --alphas, or use it with fedabc.")

    return tuple(parse_rates("--alphas", text, low_closed=False, high=1e6))


# The command's options declared over several lines (its signature lists them by these names).
DATA_DIR_OPT = typer.Option(
    ...,
    "--data-dir",
    help="Folder holding the paper's datasets, one folder each "
    "(mnist/, fashion-mnist/, cifar10/, speech_commands/; the layout of "
    "../shared/datasets).",
)
SCALE_OPT = typer.Option(
    "cpu",
    "--scale",
    help="paper (the paper's protocol, a GPU job) | cpu (cut to about "
    "30 minutes per table on 2 CPU cores; every cut listed in the report)",
)
DATASETS_OPT = typer.Option(
    None,
    "--datasets",
    help="comma-separated datasets to run (default: every column found; --scale cpu: the columns that fit on CPU)",
)
ALPHAS_OPT = typer.Option(
    None,
    "--alphas",
    help="fedabc: Dirichlet alphas, comma-separated (default: the paper's 0.1,0.3,0.5,1; --quick 0.1,1)",
)
DRY_RUN_OPT = typer.Option(
    False,
    "--dry-run",
    help="print every run's resolved configuration (JSON lines) and stop: no data loaded, nothing written",
)
BACKEND_OPT = typer.Option(
    "vectorized",
    "--backend",
    help="the scratch engine: vectorized | loop (same results; which is faster depends on the model)",
)


@cli_errors
def papers_cmd(
    paper: str = typer.Argument(..., help="fedova | fedabc | dnc"),
    data_dir: Path = DATA_DIR_OPT,
    scale: str = SCALE_OPT,
    datasets: Optional[str] = DATASETS_OPT,
    alphas: Optional[str] = ALPHAS_OPT,
    seeds: Optional[List[str]] = typer.Option(
        None, "--seeds", help="seeds, repeated or comma-separated \\[default: 0,42,777; --quick: 0]"
    ),
    quick: bool = typer.Option(False, "--quick", help="a smoke run: tiny subsets, a few rounds and epochs, one seed"),
    dry_run: bool = DRY_RUN_OPT,
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    backend: str = BACKEND_OPT,
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        help="report folder (default reports/papers-<paper>-<time>); "
        "re-run with the same --out to reuse finished runs and resume",
    ),
):
    """A seed paper's table on the scratch path (FedOVA Tables I-II, FedABC Tables 1-2, D&C Table 1), next to the
    paper's numbers."""
    if paper not in PAPERS:
        raise unknown_name("PAPER", paper, PAPERS, "paper")
    spec = PAPERS[paper]
    validate("--scale", scale, OneOf(("cpu", "paper")))
    _, backend = renamed_options(None, None, backend)
    validate("--backend", backend, OneOf(("vectorized", "loop")))
    resolve_device(device)
    if not data_dir.is_dir():
        raise param_error(
            "--data-dir",
            str(data_dir),
            "must be an existing folder",
            "Point it at the folder holding the datasets, e.g. ../shared/datasets.",
        )
    seeds_l = grid_seeds(seeds, quick) if seeds or quick else list(SEEDS)
    alpha_l = _alphas(spec, alphas, scale, quick)
    chosen, notes = resolve_columns(spec, data_dir, scale, _csv_list("--datasets", datasets))
    cells = build_cells(spec, chosen, scale, quick, seeds_l, alpha_l, device, backend)
    out = Path(out) if out else Path("reports") / f"papers-{paper}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_out(out, kind="dir")
    if dry_run:
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        for c, cfg in zip(cells, check_cells(cells, out, dry=True)):
            print(json.dumps({"run": c.name, "labels": c.labels, "config": dataclasses.asdict(cfg)}, default=str))
        return
    window = spec.window["cpu" if quick else scale]
    with report_writer(out):
        check_cells(cells, out, dry=False)
        cuts = {col.key: _cuts(spec, col, scale, quick, alpha_l) for col, _, _ in chosen}
        config = {
            "paper": paper,
            "scale": scale,
            "quick": quick,
            "seeds": seeds_l,
            "alphas": list(alpha_l),
            "datasets": {col.key: {"dataset": ds, "folder": str(p)} for col, ds, p in chosen},
            "device": device,
            "backend": backend,
            "final_window": window,
            "out": str(out),
            "cuts": cuts,
        }
        cmd = begin_report(out, cells, config)
        t0, c0 = time.perf_counter(), time.process_time()
        results = run_cells(cells, out, _run_cell)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        _write(
            spec, out, cmd, config, results, chosen, notes, cuts, seeds_l, alpha_l, window, scale, quick, (wall, cpu)
        )


def _run_cell(c: Cell, d: Path, resume: bool, prog) -> None:
    """Run (or resume) one cell of the grid in its run directory ``d``, its log lines on stderr named by the cell."""
    err = stderr_console()
    run_scratch(
        c.cfg,
        d,
        log=lambda m: err.print(f"{c.name}: {m}", markup=False, highlight=False),
        progress=prog,
        resume=resume,
    )


def _write(
    spec: Paper,
    out: Path,
    cmd: str,
    config: dict,
    results: list[CellResult],
    chosen,
    notes,
    cuts,
    seeds,
    alphas,
    window: int,
    scale: str,
    quick: bool,
    times: tuple[float, float],
) -> None:
    by = {_key(spec, r): r for r in results}
    secs, verdicts = spec.sections(by, chosen, window, seeds, alphas)
    run_s = sum(float(r.summary.get("wall_seconds", 0.0)) for r in results)
    proto = [f"## Protocol: --scale {scale}{' --quick' if quick else ''}", ""]
    for col, ds, folder in chosen:
        c = cuts[col.key]
        proto.append(
            f"- {col.key} ({ds}, {folder}): "
            + ("the paper's protocol" if not c else "cut from the paper's protocol: " + "; ".join(c))
            + "."
        )
        if col.note:
            proto.append(f"  {col.note}.")
    proto += [f"- {n}." for n in notes]
    if scale == "cpu" and spec.cpu_note:
        proto.append(f"- {spec.cpu_note}.")
    proto += ["", "Not stated in the paper (fedhead's choice, the same at every scale):", ""]
    proto += [f"- {what}: {how}." for what, how in spec.unstated]
    wall, cpu = times
    ran = sum(r.status != "reused" for r in results)
    now = (
        f"This invocation ran or resumed {ran} of them in {wall / 60:.1f} min of wall time and {cpu / 60:.1f} "
        "min of CPU time (all threads of this process; other processes on the machine stretch wall time, not "
        "CPU time)."
        if ran
        else "This invocation reused all of them."
    )
    proto += [
        "",
        f"Time: the {len(results)} runs took {run_s / 60:.1f} min of wall time (the sum of their wall_seconds). {now}",
        "",
    ]
    sections = ["\n".join(proto)] + secs + ["\n".join(["## Does the paper's ordering hold here?", "", *verdicts, ""])]
    plots = spec.plots(by, chosen, out, alphas)
    write_csv(out / "results.csv", _result_rows(results, window))
    write_csv(out / "curves.csv", _curve_rows(results))
    path = write_report(out, f"fedhead bench papers {spec.name}: {spec.title}", cmd, config, sections, results, plots)
    _print_report(path, sections[1:])
