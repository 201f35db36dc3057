"""``fedhead bench fft``: OvA-LP beside federated fine-tuning of the encoder, the OvA-LP paper's comparison with
FFT-MoE and PFPT (its Section 4.3, Fig. 4, Appendix A.2 Tables 5-6), with the paper's numbers beside.

Every cell of the grid is one ``fedhead finetune`` run (:func:`fedhead.scratch.finetune.run_finetune`) of a method
(:data:`METHODS`: a ``--peft`` kind; ``head`` is OvA-LP itself, the ova2 head on the frozen encoder's features) under
a partition (:data:`PARTITIONS`: IID, shard-1, shard-2, Bernoulli-Dirichlet, named and parameterised as in
``fedhead bench ablation``). The runs live under ``<out>/runs/<method>-<partition>-<hash>`` (the hash: the run's
identity, so a run made with other options is never taken for this one); a finished run is reused without loading
anything, an interrupted one resumes from its checkpoint (:func:`fedhead.bench.report.run_cells`).

Every number of the table is read back from the run directories (``summary.json`` and ``rounds.csv``), the same way
for the head path (``fedhead train``'s run directory) and the fine-tuning path: the final round's test accuracy;
the retention (the paper's measure): a non-IID run's final accuracy over the IID run's of the same method and seed,
per partition and the mean over shard-1, shard-2 and Bernoulli-Dirichlet; the Acc@95 round (the run's own, read off
the clients' validation parts against their final round), the bytes (down and up, every client) and the time to it;
the client and server milliseconds per round and the bytes a client uploads per round (means over the trained
rounds); the trainable parameters. The time to Acc@95 is the paper's "Total Time": the rounds up to it, each its
mean client time (clients run in parallel) plus its server time: the paper's own LP-Softmax figures give it
(Appendix A.1: 27 rounds x (23.8 + 3.0) ms = 0.72 s, "about 0.73 s").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer
from safetensors import safe_open

from extract.encoders import load_encoder
from fedhead.bench.grid import begin_report, grid_seeds, parse_names, report_writer
from fedhead.bench.report import (
    STANDARD_NONIID,
    Cell,
    CellResult,
    Stat,
    md_table,
    resolve_partition,
    run_cells,
    run_status,
)
from fedhead.core.peft import FineTuned, create_tuning, tuning_names
from fedhead.federation import plots as P
from fedhead.federation.rundir import identity_hash, write_csv
from fedhead.infra.console import stderr_console, stdout_console
from fedhead.infra.errors import FedheadError, Interval, param_error, unknown_name, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_json, atomic_write_text, check_out
from fedhead.scratch.finetune import FinetuneConfig, identity_fields, resolve_finetune, run_finetune

# ---------------------------------------------------------------- the paper's numbers (OvA-LP, arXiv text)

# CIFAR-100, 100 clients, 50 rounds; OvA-LP on ViT-L/16 features, PFPT on ViT-B/32, FFT-MoE on ViT-B/16
# (Appendix B.2, Table 8). Keys: the rows of METHODS they stand beside.
PAPER_SETTING = "CIFAR-100, 100 clients, 50 rounds; OvA-LP on ViT-L/16, PFPT on ViT-B/32, FFT-MoE on ViT-B/16"
# Section 4.3 (Fig. 4) and Table 1: non-IID final accuracy / IID final accuracy (%), averaged over shard-1, shard-2
# and Bernoulli-Dirichlet. The abstract and the introduction swap PFPT's and FFT-MoE's numbers; Section 4.3's text
# and Table 1 ("FFT-MoE / PFPT: 10.1 / 34.5") agree with each other and are the ones kept here.
PAPER_RETENTION = {"head": 95.9, "pfpt": 34.5, "moe": 10.1}
# Table 6 (Appendix A.2): bytes a client sends per round, and what the server handles per round, in MB. The paper's
# MB is 2**20 bytes: Table 4 gives OvA-LP's 0.3918 MB as 401.20 KB (KB = 1024 bytes), 410,829 bytes, which is
# 100 classes x 1025 float32 weights (410,000 bytes) and a small envelope.
PAPER_MB_UP = {"head": 0.3918, "pfpt": 1.729, "moe": 1.7703}
PAPER_MB_SERVER = {"head": 39.18, "pfpt": 17.29, "moe": 177.03}
MB = 2**20
# Appendix A.1 (Table 4, quoted in its text): OvA-LP (2-stage) per round, client and server ms; Appendix A.2 repeats
# them as "14 ms on clients and 2 ms on the server, versus seconds or tens of seconds for PFPT and FFT-MoE".
PAPER_MS = {"head": (14.9, 1.9)}
# Appendix A.2: "OvA-LP converges within 3 rounds (IID) and 1 round (Non-IID)" (Acc@95).
PAPER_ACC95_ROUNDS = {"head": (3, 1)}
# Table 5's cells (accuracy, Acc@95 rounds, total time, total communication per method) are empty in the paper's
# text; these are the statements of Appendix A.2 about them, quoted.
PAPER_STATEMENTS = (
    "FFT-MoE achieves strong accuracy under IID (96%) but collapses under Non-IID, converging below 10% even after "
    "37 rounds (Appendix A.2, Table 5)",
    "PFPT is more stable across settings but converges slowly: its time-to-95% accuracy exceeds OvA-LP by over three "
    "orders of magnitude, despite using less communication (Appendix A.2, Table 5)",
    "OvA-LP converges within 3 rounds (IID) and 1 round (Non-IID), while its final accuracy remains above 86-90% "
    "(Appendix A.2, Table 5)",
    "OvA-LP requires only 14 ms on clients and 2 ms on the server, versus seconds or tens of seconds for PFPT and "
    "FFT-MoE (Appendix A.2, Table 6)",
)
COMPARABLE = (
    "Comparable with the paper: the shape of the result, i.e. which methods keep their IID accuracy under non-IID "
    "partitions (the retention is a ratio, free of the level of accuracy), whether OvA-LP reaches Acc@95 within a few "
    "rounds while fine-tuning needs many, and the order of the methods in bytes per client per round (it follows "
    "from the trainable tensors and is exact on any machine). Not comparable: absolute accuracies, milliseconds and "
    "byte counts. This table: {encoder} ({weights}) on {dataset} at {size} px, {limit} per split, "
    "{clients} clients, {rounds} rounds, on {device} (the default: a CNN, EfficientNet-Lite0 with ImageNet weights, "
    "on CIFAR-10 at 64 px); the paper: ViT encoders (ViT-L/16 for OvA-LP, ViT-B/32 for PFPT, ViT-B/16 for FFT-MoE) "
    "on CIFAR-100 at 224 px, 100 clients, 50 rounds, on GPUs. Fewer classes than CIFAR-100's 100 (CIFAR-10: 10) "
    "make every head and message smaller and a random guess more accurate, which raises a collapsed method's "
    "retention; a CNN's LoRA, prompt and FFT-MoE adapt convolutions and a pixel border, not attention and tokens."
)

# ---------------------------------------------------------------- methods, partitions, presets


@dataclass(frozen=True)
class Method:
    """A row of the table: its ``--peft`` kind, its name in the table and the paper's row it stands for."""

    peft: str
    label: str
    what: str
    paper: str | None = None  # the paper's name of the row (None: the paper has no such row)


METHODS: dict[str, Method] = {
    "head": Method("head", "OvA-LP", "the two-stage one-vs-all head (ova2) on the frozen encoder's features", "OvA-LP"),
    "lora": Method("lora", "LoRA", "LoRA adapters on the encoder (rank 8)"),
    "prompt": Method("prompt", "Prompt", "learnt prompts (ViT: tokens; CNN: a pixel border)"),
    "full": Method("full", "Full FFT", "every parameter of the encoder"),
    "bitfit": Method("bitfit", "BitFit", "the encoder's bias terms"),
    "moe": Method("moe", "FFT-MoE", "a sparse mixture of LoRA experts (FFT-MoE)", "FFT-MoE"),
    "pfpt": Method("pfpt", "PFPT", "probabilistic federated prompt tuning (PFPT)", "PFPT"),
}
DEFAULT_METHODS = ("head", "lora", "prompt", "full", "moe", "pfpt")
PARTITIONS = ("iid", *STANDARD_NONIID)  # the labels of fedhead.bench.report.PARTITION_PRESETS


@dataclass(frozen=True)
class Preset:
    """The defaults of the options the command line leaves out."""

    image_size: int
    limit: int
    clients: int
    rounds: int
    local_epochs: int
    batch_size: int
    methods: tuple
    partitions: tuple


# The full table: 6 methods x 4 partitions, about an hour on 2 CPU cores (docs/bench-fft.md: the estimate).
DEFAULT = Preset(64, 1000, 20, 10, 1, 32, DEFAULT_METHODS, PARTITIONS)
# --quick: OvA-LP and LoRA, IID and shard-1, tiny: about a minute on 2 CPU cores.
QUICK = Preset(32, 200, 5, 3, 1, 32, ("head", "lora"), ("iid", "shard-1"))


def parse_methods(items: list[str] | None, preset: Preset) -> tuple[list[str], list[str]]:
    """The rows to run, and those of the preset left out because this install does not register their ``--peft``
    kind. A method named on the command line that is unknown or not registered is a one-line error."""
    names = parse_names(items, "--methods") if items is not None else list(preset.methods)
    if not names:
        raise FedheadError(f"The '--methods' parameter needs at least one value. Got {items!r} instead.")
    for m in names:
        if m not in METHODS:
            raise unknown_name("--methods", m, METHODS, "method")
    kinds = set(tuning_names())
    missing = [m for m in names if METHODS[m].peft not in kinds]
    if missing and items is not None:
        raise param_error("--methods", missing[0], f"needs --peft {METHODS[missing[0]].peft}, which this install "
                          "does not register", "Leave it out, or install the fedhead that has it.")  # fmt: skip
    return [m for m in names if m not in missing], missing


def parse_partitions(items: list[str] | None, preset: Preset) -> list[str]:
    """The partitions (IID first, always: the retention's reference)."""
    names = parse_names(items, "--partitions") if items is not None else list(preset.partitions)
    for p in names:
        if p not in PARTITIONS:
            raise unknown_name("--partitions", p, PARTITIONS, "partition")
    return ["iid", *[p for p in names if p != "iid"]]


# ---------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Options:
    """The experiment every cell shares (the resolved command line)."""

    dataset: str
    data_dir: str | None
    encoder: str
    weights: str | None
    pretrained: bool
    image_size: int
    limit: int | None  # None: every image
    clients: int
    rounds: int
    local_epochs: int
    batch_size: int
    seeds: tuple
    device: str


def build_cells(opts: Options, methods: list[str], partitions: list[str]) -> list[Cell]:
    """One ``fedhead finetune`` run per method and partition, each validated (one-line errors before anything is
    written); a run's name ends with the hash of its identity."""
    cells = []
    for m in methods:
        for label in partitions:
            name, params = resolve_partition(label)
            cfg = FinetuneConfig(dataset=opts.dataset, data_dir=opts.data_dir, encoder=opts.encoder,
                                 weights=opts.weights, pretrained=opts.pretrained, image_size=opts.image_size,
                                 peft=METHODS[m].peft, head="ova2", partition=name, partition_params=dict(params),
                                 clients=opts.clients, rounds=opts.rounds, local_epochs=opts.local_epochs,
                                 batch_size=opts.batch_size, seeds=list(opts.seeds), limit=opts.limit,
                                 device=opts.device, plots=False)  # fmt: skip
            cfg = resolve_finetune(cfg)
            tag = identity_hash(identity_fields(cfg))[:8]
            cells.append(Cell(f"{m}-{label}-{tag}", {"method": m, "partition": label}, cfg))
    return cells


def unfit_methods(cells: list[Cell], out: Path, opts: Options) -> dict[str, str]:
    """The fine-tuning methods that do not fit ``--encoder`` (PFPT needs a ViT), each with the kind's one-line reason.
    The encoder is loaded (once) only when a fine-tuning run is still to be made: a finished grid is reused as is."""
    todo = {
        c.labels["method"]: c.cfg
        for c in cells
        if c.cfg.peft != "head" and run_status(out / "runs" / c.name) != "reused"
    }
    if not todo:
        return {}
    enc = load_encoder(opts.encoder, weights=opts.weights, pretrained=opts.pretrained, image_size=opts.image_size)
    unfit = {}
    for m, cfg in todo.items():
        model = FineTuned(enc.model, enc.feature_dim, 2, enc.preprocessing.image_size)
        try:
            create_tuning(cfg.peft).check(model, cfg.spec())
        except FedheadError as exc:
            unfit[m] = str(exc)
    return unfit


TIMES = "times.json"  # <out>/times.json: the wall seconds the bench measured for each run (loading included)


def run_all(cells: list[Cell], out: Path) -> tuple[list[CellResult], dict[str, float]]:
    """Run, resume or reuse every cell; a finished run is reused without loading its encoder or images. Returns the
    results and each run's wall seconds as the bench measured them (encoder, images, features and training)."""
    times = json.loads((out / TIMES).read_text()) if (out / TIMES).exists() else {}
    err = stderr_console()

    def run_one(c: Cell, d: Path, resume: bool, prog) -> None:
        if run_status(d) == "reused":
            return
        t0 = time.perf_counter()
        run_finetune(c.cfg, d, log=lambda m: err.print(f"{c.name}: {m}", markup=False, highlight=False),
                     progress=prog, resume=resume)  # fmt: skip
        times[c.name] = time.perf_counter() - t0  # resumed: this invocation's part
        atomic_write_json(out / TIMES, times)

    return run_cells(cells, out, run_one), times


# ---------------------------------------------------------------- the numbers, read back from the runs


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and np.isfinite(v)


def seed_rows(r: CellResult, seed: int) -> list[dict]:
    """The seed's rows of the run (the main run only: fedhead train may hold others), in round order."""
    rows = [x for x in r.rows if int(x["seed"]) == seed and x.get("run", "main") == "main"]
    return sorted(rows, key=lambda x: int(x["round"]))


def trainable_parameters(r: CellResult) -> int | None:
    """The run's trainable parameters: fine-tuning's summary; the head's weights and bias (its model file)."""
    if r.summary.get("trainable_parameters") is not None:
        return int(r.summary["trainable_parameters"])
    path = r.run_dir / f"model-seed{r.seeds[0]}.safetensors"
    if not path.exists():
        return None
    with safe_open(str(path), "np") as f:
        return int(sum(np.prod(f.get_slice(k).get_shape()) for k in ("weight", "bias") if k in f.keys()))


def cell_numbers(r: CellResult) -> dict:
    """Per seed, then mean and std: final accuracy, Acc@95 round, the bytes and times to it, per-round costs."""
    per: dict[str, list] = {k: [] for k in ("final_accuracy", "acc95_round", "bytes_to_acc95", "client_s_to_acc95",
                                           "time_s_to_acc95", "client_ms", "server_ms", "bytes_up_per_client")}  # fmt: skip
    for s in r.summary["per_seed"]:
        rows = seed_rows(r, int(s["seed"]))
        trained = [x for x in rows if x.get("stage") != "skipped"] or rows
        a95 = s.get("acc95_round")
        a95 = int(a95) if _finite(a95) else None
        upto = [x for x in rows if a95 is not None and int(x["round"]) <= a95]
        per["final_accuracy"].append(s["final_accuracy"])
        per["acc95_round"].append(a95)
        per["bytes_to_acc95"].append(sum(x["bytes_total"] for x in upto) if a95 else None)
        per["client_s_to_acc95"].append(sum(x["client_ms"] for x in upto) / 1000 if a95 else None)
        per["time_s_to_acc95"].append(sum(x["client_ms"] + x["server_ms"] for x in upto) / 1000 if a95 else None)
        for k in ("client_ms", "server_ms", "bytes_up_per_client"):
            per[k].append(float(np.mean([x[k] for x in trained])))
    out = {"seeds": r.seeds, "per_seed": per}
    for k, v in per.items():
        st = Stat.of(v)
        out[k], out[f"{k}_std"] = st.mean, st.std
    out["trainable_parameters"] = trainable_parameters(r)
    out["acc95_on"] = r.summary["per_seed"][0].get("acc95_on", "val_accuracy")
    return out


def retention(r: CellResult, iid: CellResult) -> Stat:
    """Per seed, the run's final test accuracy over the IID run's (same method, same seed); their mean."""
    ref = {int(s["seed"]): s["final_accuracy"] for s in iid.summary["per_seed"]}
    return Stat.of(s["final_accuracy"] / ref[int(s["seed"])] for s in r.summary["per_seed"]
                   if ref.get(int(s["seed"])))  # fmt: skip


def table_rows(by: dict, methods: list[str], partitions: list[str], times: dict) -> list[dict]:
    """One flat record per method and partition (fft.csv, fft.json)."""
    rows = []
    for m in methods:
        iid = by[(m, "iid")]
        for p in partitions:
            r = by[(m, p)]
            nums = cell_numbers(r)
            ret = retention(r, iid)
            rows.append({"method": m, "label": METHODS[m].label, "peft": METHODS[m].peft, "partition": p,
                         "retention": ret.mean, "retention_std": ret.std,
                         **{k: v for k, v in nums.items() if k not in ("per_seed", "seeds")},
                         "mb_up_per_client": nums["bytes_up_per_client"] / MB, "rounds": int(r.cell.cfg.rounds),
                         "seeds": ",".join(map(str, nums["seeds"])), "wall_s": times.get(r.cell.name),
                         "run_wall_s": r.summary.get("wall_seconds"), "status": r.status, "run_name": r.cell.name,
                         "run_dir": str(r.run_dir)})  # fmt: skip
    return rows


def method_rows(rows: list[dict], methods: list[str]) -> list[dict]:
    """Per method: the retention averaged over the non-IID partitions run (the paper's measure: shard-1, shard-2,
    Bernoulli-Dirichlet), the per-round costs averaged over every partition, the wall seconds of all its runs."""
    out = []
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        non = [r["retention"] for r in mine if r["partition"] in STANDARD_NONIID and _finite(r["retention"])]
        iid = next(r for r in mine if r["partition"] == "iid")
        walls = [r["wall_s"] for r in mine if r["wall_s"] is not None]
        out.append({"method": m, "label": METHODS[m].label,
                    "retention_noniid_mean": float(np.mean(non)) if non else float("nan"),
                    "noniid_partitions": [r["partition"] for r in mine if r["partition"] in STANDARD_NONIID],
                    "iid_final_accuracy": iid["final_accuracy"], "iid_acc95_round": iid["acc95_round"],
                    "noniid_acc95_round": _mean([r["acc95_round"] for r in mine if r["partition"] != "iid"]),
                    "client_ms": _mean([r["client_ms"] for r in mine]),
                    "server_ms": _mean([r["server_ms"] for r in mine]),
                    "mb_up_per_client": _mean([r["mb_up_per_client"] for r in mine]),
                    "trainable_parameters": iid["trainable_parameters"],
                    "wall_s": float(sum(walls)) if len(walls) == len(mine) else None,
                    "run_wall_s": float(sum(r["run_wall_s"] or 0.0 for r in mine))})  # fmt: skip
    return out


def _mean(values) -> float:
    v = [x for x in values if _finite(x)]
    return float(np.mean(v)) if v else float("nan")


# ---------------------------------------------------------------- the markdown


def _f(v, fmt: str, scale: float = 1.0) -> str:
    return format(v * scale, fmt) if _finite(v) else "–"


def _mb(v) -> str:
    return _f(v, ".4f") if _finite(v) and v >= 1e-3 else _f(v, ".2e")


def main_table(rows: list[dict]) -> str:
    hdr = ["method", "partition", "final acc %", "retention %", "Acc@95 round", "MB to Acc@95", "s to Acc@95",
           "client ms/round", "server ms/round", "MB up/client/round", "trainable params"]  # fmt: skip
    body = [[r["label"], r["partition"], _f(r["final_accuracy"], ".1f", 100), _f(r["retention"], ".1f", 100),
             _f(r["acc95_round"], ".3g"), _mb(_div(r["bytes_to_acc95"], MB)), _f(r["time_s_to_acc95"], ".3g"),
             _f(r["client_ms"], ".1f"), _f(r["server_ms"], ".2f"), _mb(r["mb_up_per_client"]),
             f"{r['trainable_parameters']:,}" if r["trainable_parameters"] is not None else "–"]
            for r in rows]  # fmt: skip
    return md_table(hdr, body)


def _div(v, d: float):
    return v / d if _finite(v) else None


def paper_table(mrows: list[dict]) -> str:
    hdr = ["method", "retention % (ours)", "(paper)", "Acc@95 IID / non-IID (ours)", "(paper)", "MB up/client/round "
           "(ours)", "(paper)", "client / server ms (ours)", "(paper)", "trainable params", "wall s, all its runs"]  # fmt: skip
    body = []
    for r in mrows:
        m = r["method"]
        pr = PAPER_ACC95_ROUNDS.get(m)
        pms = PAPER_MS.get(m)
        body.append([r["label"], _f(r["retention_noniid_mean"], ".1f", 100), _f(PAPER_RETENTION.get(m), ".1f"),
                     f"{_f(r['iid_acc95_round'], '.3g')} / {_f(r['noniid_acc95_round'], '.3g')}",
                     f"{pr[0]} / {pr[1]}" if pr else "–", _mb(r["mb_up_per_client"]), _f(PAPER_MB_UP.get(m), "g"),
                     f"{_f(r['client_ms'], '.1f')} / {_f(r['server_ms'], '.2f')}",
                     f"{pms[0]} / {pms[1]}" if pms else "–",
                     f"{r['trainable_parameters']:,}" if r["trainable_parameters"] is not None else "–",
                     _f(r["wall_s"], ".0f")])  # fmt: skip
    return md_table(hdr, body)


def markdown(rows: list[dict], mrows: list[dict], opts: Options, left_out: dict[str, str], device: str) -> str:
    weights = "random init" if not opts.pretrained else (opts.weights or "hub weights")
    comparable = COMPARABLE.format(encoder=opts.encoder, weights=weights, dataset=opts.dataset, size=opts.image_size,
                                   limit=_images(opts.limit), clients=opts.clients, rounds=opts.rounds,
                                   device=device)  # fmt: skip
    seeds = ", ".join(map(str, opts.seeds))
    lines = [
        f"## OvA-LP beside federated fine-tuning: {opts.encoder} on {opts.dataset}, {opts.image_size} px, "
        f"{_images(opts.limit)} per split, {opts.clients} clients, {opts.rounds} rounds, seeds {seeds}",
        "",
        "final acc: test accuracy at the final round (mean over seeds); retention: final accuracy / the same "
        "method's IID final accuracy (per seed, then the mean); Acc@95 round: the first round whose validation "
        "accuracy reaches 95% of the final one; MB to Acc@95: every client's download and upload up to it; s to "
        "Acc@95: the rounds up to it, each its mean client time plus its server time (the paper's 'Total Time'); "
        "ms and MB per round: means over the trained rounds; MB = 2^20 bytes (the paper's unit).",
        "",
        main_table(rows),
        "",
        f"## Beside the paper ({PAPER_SETTING})",
        "",
        "retention: the mean over the non-IID partitions run (the paper's: shard-1, shard-2, Bernoulli-Dirichlet; "
        "Section 4.3, Table 1); Acc@95 non-IID: the mean over them; MB up/client/round: Table 6; ms: Appendix A.1 "
        "(Table 4). wall s: every run of the method, as this bench measured it (the encoder, images or features "
        "loaded, and training).",
        "",
        paper_table(mrows),
        "",
        "The paper's Table 5 (accuracy, Acc@95 rounds, total time and communication per method) has no numbers in "
        "its text; what the text says of it:",
        "",
        *[f"- {s}." for s in PAPER_STATEMENTS],
        "",
        "## What is comparable",
        "",
        comparable,
        "",
    ]
    if left_out:
        lines += ["## Not run", "", *[f"- {METHODS[m].label} (--methods {m}): {why}" for m, why in left_out.items()],
                  ""]  # fmt: skip
    return "\n".join(lines)


def _images(limit: int | None) -> str:
    return "every image" if limit is None else f"{limit} images"


def plot(out: Path, by: dict, methods: list[str], partitions: list[str]) -> Path:
    """fft.png: test accuracy per round, one line per method (mean over seeds), one panel per partition."""
    panels = []
    for p in partitions:
        lines = []
        for m in methods:
            r = by[(m, p)]
            curves = [seed_rows(r, s) for s in r.seeds]
            n = min(len(c) for c in curves)
            acc = np.array([[x["accuracy"] for x in c[:n]] for c in curves], float)
            rounds = [int(x["round"]) for x in curves[0][:n]]
            lines.append(P.Line(METHODS[m].label, rounds, acc.mean(0), acc.std(0) if len(curves) > 1 else None))
        panels.append(P.Panel(p, lines))
    return P.write_curves(out / "fft.png", panels, "round", "test accuracy", "accuracy per round per method",
                          ylim=(0, 1), integer_x=True)  # fmt: skip


# ---------------------------------------------------------------- the command


def _opt(value, default):
    return default if value is None else value


def resolve_options(kw: dict, quick: bool) -> Options:
    """The command line's values, the preset's where one is left out (``--quick``: :data:`QUICK`)."""
    pre = QUICK if quick else DEFAULT
    opts = Options(dataset=kw["dataset"], data_dir=None if kw["data_dir"] is None else str(kw["data_dir"]),
                   encoder=kw["encoder"], weights=kw["weights"], pretrained=kw["pretrained"],
                   image_size=_opt(kw["image_size"], pre.image_size), limit=_opt(kw["limit"], pre.limit) or None,
                   clients=_opt(kw["clients"], pre.clients), rounds=_opt(kw["rounds"], pre.rounds),
                   local_epochs=_opt(kw["local_epochs"], pre.local_epochs),
                   batch_size=_opt(kw["batch_size"], pre.batch_size),
                   seeds=tuple(grid_seeds(kw["seeds"], True)), device=kw["device"])  # fmt: skip
    validate("--image-size", opts.image_size, Interval(1, None, integer=True))
    return opts


HELP_DEFAULTS = (f"default {DEFAULT.image_size} px, --limit {DEFAULT.limit}, {DEFAULT.clients} clients, "
                 f"{DEFAULT.rounds} rounds; --quick: {QUICK.image_size} px, --limit {QUICK.limit}, {QUICK.clients} "
                 f"clients, {QUICK.rounds} rounds")  # fmt: skip


@cli_errors
def fft_cmd(
    dataset: str = typer.Option("imagefolder", "--dataset", help="a dataset fedhead extract reads (imagefolder: "
                                "train/<class>/ and test/<class>/ under --data-dir, e.g. the CIFAR-10 images)"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="folder holding the dataset"),
    encoder: str = typer.Option("tf_efficientnet_lite0", "--encoder", help="a timm model name or clip:MODEL/PRETRAINED"),
    weights: Optional[str] = typer.Option("registry", "--weights", help="a checkpoint file, 'registry' (the "
                                          "installed EfficientNet-Lite0/Lite1 weights) or 'hub' (the library's, online)"),
    pretrained: bool = typer.Option(True, "--pretrained/--no-pretrained", help="--no-pretrained: random init"),
    image_size: Optional[int] = typer.Option(None, "--image-size", help=f"input side ({HELP_DEFAULTS})"),
    limit: Optional[int] = typer.Option(None, "--limit", help="a stratified subset of N images per split (0: every image)"),
    clients: Optional[int] = typer.Option(None, "--clients", help="clients, all of them in every round"),
    rounds: Optional[int] = typer.Option(None, "--rounds", help="rounds"),
    local_epochs: Optional[int] = typer.Option(None, "--local-epochs", help=f"local epochs (default {DEFAULT.local_epochs})"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help=f"local batch size (default {DEFAULT.batch_size})"),
    methods: Optional[List[str]] = typer.Option(None, "--methods", help="rows, repeated or comma-separated: "
                                                f"{', '.join(METHODS)} (default {','.join(DEFAULT_METHODS)}; "
                                                f"--quick: {','.join(QUICK.methods)})"),
    partitions: Optional[List[str]] = typer.Option(None, "--partitions", help="repeated or comma-separated: "
                                                   f"{', '.join(PARTITIONS)} (default all; --quick: iid,shard-1); "
                                                   "iid is always run"),
    seeds: Optional[List[str]] = typer.Option(None, "--seeds", metavar="INT[,INT...]", help="seeds \\[default: 0]"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    quick: bool = typer.Option(False, "--quick", help="a smoke run of about a minute on 2 CPU cores: "
                               f"{','.join(QUICK.methods)} on iid,shard-1, tiny (unless given)"),
    out: Optional[Path] = typer.Option(None, "--out", help="bench folder (default reports/fft-<time>); re-run with "
                                       "the same --out to reuse finished runs and resume an interrupted one"),
):  # fmt: skip
    """OvA-LP beside federated fine-tuning of the encoder (LoRA, prompts, full, FFT-MoE, PFPT) under IID, shard-1,
    shard-2 and Bernoulli-Dirichlet: final accuracy, retention of the IID accuracy, Acc@95 with its time and bytes,
    per-round costs, the paper's numbers beside.

    Writes fft.md (printed on stdout), fft.csv, fft.json and fft.png into --out, each run under --out/runs/.
    """
    kw = dict(locals())
    pre = QUICK if quick else DEFAULT
    opts = resolve_options(kw, quick)
    names, missing = parse_methods(methods, pre)
    parts = parse_partitions(partitions, pre)
    if opts.weights == "hub":
        opts = Options(**{**opts.__dict__, "weights": None})
    cells = build_cells(opts, names, parts)
    out = Path(out) if out else Path("reports") / f"fft-{time.strftime('%Y%m%d-%H%M%S')}"
    check_out(out, kind="dir")
    config = {"options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts.__dict__.items()},
              "methods": {m: METHODS[m].what for m in names}, "not_registered": missing, "partitions": parts,
              "quick": quick}  # fmt: skip
    for m in missing:
        note(f"left out {m}: this install does not register --peft {METHODS[m].peft}")
    unfit = unfit_methods(cells, out, opts)
    for m, why in unfit.items():
        if methods is not None:
            raise FedheadError(f"The '--methods' parameter {m} does not fit --encoder {opts.encoder}: {why}")
        note(f"left out {m}: it does not fit --encoder {opts.encoder} ({why})")
    names = [m for m in names if m not in unfit]
    cells = [c for c in cells if c.labels["method"] in names]
    config["methods"] = {m: METHODS[m].what for m in names}
    config["not_fitting"] = unfit
    with report_writer(out):
        begin_report(out, cells, config)
        results, times = run_all(cells, out)
        write_outputs(out, results, names, parts, times, opts, {**{m: "this install does not register --peft "
                      + METHODS[m].peft for m in missing}, **unfit})  # fmt: skip


def note(text: str) -> None:
    stderr_console().print(f"note: {text}", markup=False, highlight=False)


def write_outputs(out: Path, results: list[CellResult], names, parts, times, opts: Options, left_out: dict) -> None:
    """fft.csv, fft.json, fft.md and fft.png; the markdown on stdout."""
    by = {(r.cell.labels["method"], r.cell.labels["partition"]): r for r in results}
    rows = table_rows(by, names, parts, times)
    mrows = method_rows(rows, names)
    device = str(results[0].config.get("device_resolved") or results[0].config.get("device") or opts.device)
    md = markdown(rows, mrows, opts, left_out, "CPU" if device.startswith("cpu") else device)
    write_csv(out / "fft.csv", rows)
    atomic_write_json(out / "fft.json", {"rows": rows, "methods": mrows, "not_run": left_out,
                                         "paper": {"setting": PAPER_SETTING, "retention": PAPER_RETENTION,
                                                   "mb_up_per_client": PAPER_MB_UP, "mb_server": PAPER_MB_SERVER,
                                                   "client_server_ms": PAPER_MS,
                                                   "acc95_rounds_iid_noniid": PAPER_ACC95_ROUNDS,
                                                   "statements": list(PAPER_STATEMENTS)}})  # fmt: skip
    png = plot(out, by, names, parts)
    atomic_write_text(out / "fft.md", f"# fedhead bench fft\n\n{md}\n![accuracy per round]({png.name})\n")
    con = stdout_console()
    con.print(md, markup=False, highlight=False, soft_wrap=True)
    con.print(f"bench folder: {out}", markup=False, highlight=False)
