"""A bench report: a grid of training runs (reused / resumed / run), flat results, markdown tables.

A report folder holds::

    report.md     the tables (mean ± std over seeds), the exact command and the configuration
    results.csv   one flat row per run: bench_* (the grid labels), cfg_* (resolved training config),
                  store_*, res_* (the run's summary.json scalars and the ratios computed against its IID run)
    curves.csv    per run and round: accuracy and ratio to IID, mean and std over seeds
    bench.json    the command line and the grid (names and labels of the runs)
    *.png         plots
    runs/<name>/  one ``fedhead train`` run directory per grid cell (all its seeds)

Re-running the same command with the same ``--out`` reuses every finished run (``run_training`` with
``resume=True`` returns a finished run's summary) and resumes an interrupted one from its checkpoint. A
run directory that holds neither a summary nor a checkpoint (killed before its first round ended, or its
summary deleted) is started again.

Ratios to IID are computed here from a separate IID run of the same head, recipe, store and seeds
(rather than ``iid_reference=True`` inside every non-IID run), so the IID run is trained once per group
instead of once per partition. Per seed and round: ratio = accuracy(non-IID) / accuracy(IID), exactly
what ``iid_reference`` computes.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from extract.store import load_store
from fedhead.core.heads import HEADS
from fedhead.core.partitions import PARTITIONS
from fedhead.federation.config import TrainConfig
from fedhead.federation.rundir import acc95_round, mean_std, read_csv, write_csv
from fedhead.federation.train import CHECKPOINT, run_training, validate_config
from fedhead.infra.console import make_progress
from fedhead.infra.errors import FedheadError, unknown_name
from fedhead.infra.files import atomic_write_json, atomic_write_text

# Partition labels used in the paper's figures -> (registry name, parameters).
PARTITION_PRESETS: dict[str, tuple[str, dict]] = {
    "iid": ("iid", {}),
    "shard-1": ("shard", {"shards_per_client": 1}),
    "shard-2": ("shard", {"shards_per_client": 2}),
    "bernoulli-dirichlet": ("bernoulli-dirichlet", {}),
    "dirichlet": ("dirichlet", {}),
    "zipf": ("zipf", {}),
    "kmeans": ("kmeans", {}),
}
# The paper's three standard non-IID partitions (its "Dirichlet" follows FedCorr = bernoulli-dirichlet).
STANDARD_NONIID = ("shard-1", "shard-2", "bernoulli-dirichlet")


def resolve_partition(label: str) -> tuple[str, dict]:
    """A partition label (preset such as ``shard-1``, or any registered partition name) -> (name, params)."""
    if label in PARTITION_PRESETS:
        return PARTITION_PRESETS[label]
    if label in PARTITIONS:
        return label, {}
    raise unknown_name("--partition", label, set(PARTITION_PRESETS) | set(PARTITIONS), "partition")


def check_head(name: str) -> str:
    if name not in HEADS:
        raise unknown_name("--head", name, HEADS, "head")
    return name


# ---------------------------------------------------------------- the grid


@dataclass
class Cell:
    """One training run of the report: ``runs/<name>/``, grouped in tables by ``labels``."""

    name: str
    labels: dict
    cfg: TrainConfig


@dataclass
class CellResult:
    cell: Cell
    run_dir: Path
    status: str  # ran | resumed | reused
    summary: dict
    rows: list[dict]  # rounds.csv, numbers parsed
    config: dict  # config.json
    derived: dict = field(default_factory=dict)  # ratios against the IID run (filled by the analysis)

    @property
    def seeds(self) -> list[int]:
        return [int(s) for s in self.summary["seeds"]]

    def per_seed(self, key: str) -> list:
        return [r.get(key) for r in self.summary["per_seed"]]

    def curves(self, run: str = "main") -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """seed -> (rounds, accuracy) of the evaluated rounds."""
        out: dict[int, tuple[list, list]] = {}
        for r in self.rows:
            if r.get("run", "main") != run or not _finite(r["accuracy"]):
                continue
            rs, acc = out.setdefault(int(r["seed"]), ([], []))
            rs.append(int(r["round"]))
            acc.append(float(r["accuracy"]))
        return {s: (np.array(a), np.array(b)) for s, (a, b) in out.items()}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))


def _num(v: Any) -> Any:
    if v is None or v == "":
        return float("nan")
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return int(f) if f.is_integer() and "." not in str(v) and "e" not in str(v).lower() else f


def run_status(run_dir: Path) -> str:
    """What re-running ``run_dir`` will do: reused (finished), resumed (checkpoint), stale or new."""
    if (run_dir / CHECKPOINT).exists() or (run_dir / "checkpoint.pt").exists():  # .pt: an older fedhead's (pickled)
        return "resumed"
    if (run_dir / "summary.json").exists() and (run_dir / "config.json").exists():
        return "reused"
    if run_dir.exists() and any(run_dir.iterdir()):
        return "stale"
    return "new"


class StoreCache:
    """Each feature store loaded once for the whole report."""

    def __init__(self):
        self._stores: dict[str, Any] = {}

    def get(self, path: str):
        key = str(path)
        if key not in self._stores:
            self._stores[key] = load_store(key)
        return self._stores[key]


def validate_cells(cells: Sequence[Cell], stores: StoreCache) -> None:
    """Check every run's configuration before the first one starts (one-line errors)."""
    seen = set()
    for c in cells:
        if c.name in seen:
            raise FedheadError(
                f"Two runs of the report are both named {c.name!r}; repeated --head, --partition "
                "or rate values? Give each value once."
            )
        seen.add(c.name)
        validate_config(c.cfg, stores.get(c.cfg.features))


def run_grid(
    cells: Sequence[Cell], out: Path, stores: StoreCache, progress: bool = True, runner=None
) -> list[CellResult]:
    """Run (or reuse, or resume) every cell into ``out/runs/<name>``; one outer progress bar over runs."""
    import functools

    # one centralised ceiling per head, preparation and labels for the whole report
    runner = runner or functools.partial(run_training, central_cache={})
    validate_cells(cells, stores)

    def run_one(c: Cell, d: Path, resume: bool, prog) -> None:
        runner(c.cfg, out=d, resume=resume, progress=progress, store=stores.get(c.cfg.features))

    return run_cells(cells, out, run_one, progress)


def run_cells(cells: Sequence[Cell], out: Path, run_one, progress: bool = True) -> list[CellResult]:
    """The grid loop, written once for every kind of run: each cell into ``out/runs/<name>``, reused when
    finished, resumed from its checkpoint when interrupted, started again when it holds nothing finished.
    ``run_one(cell, run_dir, resume, progress)`` writes a run directory with ``summary.json``, ``config.json``
    and ``rounds.csv`` (``progress``: the outer rich progress, or None)."""
    results = []
    with make_progress() as prog:
        task = prog.add_task("bench runs", total=len(cells), info="") if progress else None
        for c in cells:
            d = out / "runs" / c.name
            status = run_status(d)
            if status == "stale":  # nothing finished in it: start again
                shutil.rmtree(d)
            if task is not None:
                prog.update(task, info=f"{c.name} ({'ran' if status in ('new', 'stale') else status})")
            run_one(c, d, status in ("reused", "resumed"), prog if progress else None)
            results.append(load_result(c, d, "ran" if status in ("new", "stale") else status))
            if task is not None:
                prog.advance(task)
    return results


def load_result(cell: Cell, run_dir: Path, status: str) -> CellResult:
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    rows = [
        {k: _num(v) if k not in ("stage", "run", "partition") else v for k, v in r.items()}
        for r in read_csv(run_dir / "rounds.csv")
    ]
    return CellResult(cell, run_dir, status, summary, rows, config)


# ---------------------------------------------------------------- statistics over seeds


@dataclass
class Stat:
    mean: float
    std: float
    values: list

    @classmethod
    def of(cls, values: Iterable) -> "Stat":
        vals = [v for v in values if v is not None and _finite(v)]
        m, s = mean_std(vals)
        return cls(m, s, vals)

    def fmt(self, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
        if not self.values:
            return "–"
        if len(self.values) == 1:
            return f"{self.mean * scale:.{digits}f}{unit}"
        return f"{self.mean * scale:.{digits}f} ± {self.std * scale:.{digits}f}{unit}"


def with_iid(res: CellResult, iid: CellResult | None) -> dict:
    """Per-seed final ratio to IID and Acc@95 against the IID run's final accuracy (stored in res.derived)."""
    d: dict = {}
    if iid is None:
        return d
    iid_final = {int(r["seed"]): r["final_accuracy"] for r in iid.summary["per_seed"]}
    ratios, a95 = [], []
    curves = res.curves()
    for r in res.summary["per_seed"]:
        s = int(r["seed"])
        ref = iid_final.get(s)
        if not ref:
            continue
        ratios.append(r["final_accuracy"] / ref)
        a95.append(acc95_round(list(curves[s][1]), reference=ref))
    d["final_ratio_to_iid"] = Stat.of(ratios)
    d["acc95_round_vs_iid"] = Stat.of(a95)
    d["iid_run"] = iid.cell.name
    d["iid_final_accuracy"] = Stat.of(iid_final[s] for s in res.seeds if s in iid_final)
    res.derived.update(d)
    return d


def mean_curve(res: CellResult, run: str = "main") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rounds, mean accuracy, std) over seeds, on the rounds every seed evaluated."""
    curves = res.curves(run)
    return _stack(list(curves.values()))


def ratio_curve(res: CellResult, iid: CellResult) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rounds, mean ratio to IID, std) over seeds: per seed and round accuracy / IID accuracy."""
    a, b = res.curves(), iid.curves()
    per_seed = []
    for s, (rs, acc) in a.items():
        if s not in b:
            continue
        ref = dict(zip(b[s][0].tolist(), b[s][1].tolist()))
        keep = [(r, x / ref[r]) for r, x in zip(rs.tolist(), acc.tolist()) if ref.get(r)]
        if keep:
            per_seed.append((np.array([k[0] for k in keep]), np.array([k[1] for k in keep])))
    return _stack(per_seed)


def _stack(curves: list[tuple[np.ndarray, np.ndarray]]):
    if not curves:
        return np.array([]), np.array([]), np.array([])
    common = sorted(set.intersection(*[set(rs.tolist()) for rs, _ in curves]))
    mat = np.array([[dict(zip(rs.tolist(), ys.tolist()))[r] for r in common] for rs, ys in curves])
    std = mat.std(0, ddof=1) if len(mat) > 1 else np.zeros(len(common))
    return np.array(common), mat.mean(0), std


def comm_kb_per_client_round(res: CellResult) -> float:
    """Bytes a client sends per round (the head; round 1 may add the feature statistics): rounds >= 2."""
    vals = [
        r["bytes_up_per_client"]
        for r in res.rows
        if r.get("run", "main") == "main" and int(r["round"]) >= 2 and _finite(r["bytes_up_per_client"])
    ]
    if not vals:
        vals = [r["bytes_up_per_client"] for r in res.rows if _finite(r.get("bytes_up_per_client"))]
    return float(np.median(vals)) / 1024 if vals else float("nan")


# ---------------------------------------------------------------- files


def _flatten(prefix: str, obj: Any, out: dict) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}_{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (list, tuple)):
        out[prefix] = " ".join(str(v) for v in obj)
    else:
        out[prefix] = obj


def results_rows(results: Sequence[CellResult], command: str) -> list[dict]:
    """One flat row per run: bench_*, run_*, cfg_*, store_*, res_*."""
    rows = []
    for r in results:
        row: dict = {"bench_command": command}
        _flatten("bench", r.cell.labels, row)
        row["run_name"] = r.cell.name
        row["run_dir"] = str(r.run_dir)
        row["run_status"] = r.status
        _flatten("cfg", r.config.get("config", {}), row)
        _flatten("cfg_head_params", r.config.get("head_params", {}), row)
        _flatten("cfg_partition_params", r.config.get("partition_params", {}), row)
        store = r.config.get("store", {})
        for k in ("path", "dataset", "encoder", "weights_source", "feature_dim", "num_classes", "image_size"):
            if k in store:
                row[f"store_{k}"] = store[k]
        _flatten(
            "res", {k: v for k, v in r.summary.items() if k not in ("per_seed",) and not isinstance(v, (dict,))}, row
        )
        row["res_comm_kb_up_per_client_round"] = comm_kb_per_client_round(r)
        for k, v in r.derived.items():
            if isinstance(v, Stat):
                row[f"res_{k}"] = v.mean
                row[f"res_{k}_std"] = v.std
            else:
                row[f"res_{k}"] = v
        rows.append(row)
    return rows


def write_results(out: Path, results: Sequence[CellResult], command: str) -> Path:
    path = out / "results.csv"
    write_csv(path, results_rows(results, command))
    return path


def write_curves(out: Path, results: Sequence[CellResult], iid_of: dict[str, CellResult | None]) -> Path:
    """Per run and round: accuracy (and ratio to IID) mean and std over seeds."""
    rows = []
    for r in results:
        rs, m, s = mean_curve(r)
        ratio = {}
        iid = iid_of.get(r.cell.name)
        if iid is not None:
            rr, rm, rsd = ratio_curve(r, iid)
            ratio = {int(a): (b, c) for a, b, c in zip(rr, rm, rsd)}
        for a, b, c in zip(rs, m, s):
            row = {
                "run_name": r.cell.name,
                **{f"bench_{k}": v for k, v in r.cell.labels.items()},
                "round": int(a),
                "accuracy_mean": float(b),
                "accuracy_std": float(c),
            }
            if int(a) in ratio:
                row["ratio_to_iid_mean"], row["ratio_to_iid_std"] = map(float, ratio[int(a)])
            rows.append(row)
    path = out / "curves.csv"
    write_csv(path, rows)
    return path


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v):
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def command_line() -> str:
    """The command being run, rebuilt from the parsed options (non-default values), so it can be re-run."""
    import shlex

    import click

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return " ".join(shlex.quote(a) for a in ["fedhead", *sys.argv[1:]])
    words = ["fedhead", *ctx.command_path.split()[1:]]
    words += [
        str(ctx.params[p.name])
        for p in ctx.command.params
        if isinstance(p, click.Argument) and ctx.params.get(p.name) is not None
    ]
    for p in ctx.command.params:
        if not isinstance(p, click.Option) or p.name not in ctx.params:
            continue
        v, d = ctx.params[p.name], p.default

        def norm(x):
            return [str(i) for i in x] if isinstance(x, (list, tuple)) else x

        if v is None or norm(v) == norm(d):
            continue
        if p.is_flag:
            if p.secondary_opts and not v:
                words.append(p.secondary_opts[0])
            elif v:
                words.append(p.opts[0])
            continue
        for item in v if isinstance(v, (list, tuple)) else [v]:
            words += [p.opts[0], str(item)]
    return " ".join(shlex.quote(w) for w in words)


def write_report(
    out: Path,
    title: str,
    command: str,
    config: dict,
    sections: Sequence[str],
    results: Sequence[CellResult] = (),
    plots: Sequence[Path] = (),
) -> Path:
    """report.md: title, the command, the tables, the plots, the configuration, the runs."""
    parts = [f"# {title}", "", "Command:", "", "```", command, "```", ""]
    parts += [s.rstrip() + "\n" for s in sections]
    if plots:
        parts.append("## Plots\n")
        parts += [f"![{p.stem}]({p.name})" for p in plots]
        parts.append("")
    parts += ["## Configuration", "", "```json", json.dumps(config, indent=2, default=str), "```", ""]
    if results:
        counts = {s: sum(r.status == s for r in results) for s in ("ran", "resumed", "reused")}
        parts += [
            "## Runs",
            "",
            f"{len(results)} runs: {counts['ran']} ran, {counts['resumed']} resumed, "
            f"{counts['reused']} reused from an earlier invocation.",
            "",
            md_table(
                ["run", "status", "seeds", "rounds", "wall s"],
                [
                    [
                        f"runs/{r.cell.name}",
                        r.status,
                        " ".join(map(str, r.seeds)),
                        r.summary.get("rounds"),
                        f"{r.summary.get('wall_seconds', float('nan')):.1f}",
                    ]
                    for r in results
                ],
            ),
            "",
        ]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(parts) + "\n")
    return path


def write_bench_json(out: Path, command: str, cells: Sequence[Cell], config: dict) -> None:
    atomic_write_json(
        out / "bench.json",
        {"command": command, "config": config, "runs": [{"name": c.name, "labels": c.labels} for c in cells]},
    )
