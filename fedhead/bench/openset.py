"""``fedhead bench openset`` (issue 40, part 4): open-set rejection per head and partition.

The store's first half of the classes (by class index; ``--known-fraction``) is *known*: a derived store holds their
training samples only (and their test samples as its test split, so a run's own accuracy is the closed-set accuracy
on the known classes). Every head is trained on it by ``fedhead train`` (one run per head and partition, all seeds),
and each seed's model file is loaded with :func:`fedhead.load_model`, as ``fedhead predict`` loads it; its open-set
scores (:mod:`fedhead.core.openset`) on the *whole* test split of the original store (the other half of the classes:
unknown) give

- AUROC of the score separating unknown (positive) from known test inputs (scikit-learn's ``roc_auc_score``);
- FPR at 95% TPR: the share of unknown inputs accepted when the threshold accepts 95% of the known ones
  (``roc_curve`` with the known inputs positive, as Hendrycks and Gimpel and the energy paper report it);
- the closed-set accuracy: the model's argmax on the known classes' test inputs.

Mean ± standard deviation over the seeds, per head, score and partition; every figure from the test split at the
final round; nothing is chosen on the test split (the thresholds of ``--reject-rate`` come from the run's own
validation part, the AUROC needs none).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer

from extract.store import Features, load_store, write_store
from fedhead.bench.grid import FEATURES_OPT, OUT_OPT, _print_report, parse_names
from fedhead.bench.report import command_line, md_table
from fedhead.core.heads import HEADS
from fedhead.core.openset import applicable
from fedhead.core.partitions import PARTITIONS
from fedhead.federation.config import TrainConfig
from fedhead.federation.config import applicable as applicable_fields
from fedhead.federation.experiment import parse_seeds
from fedhead.federation.model import STORE_KEYS, load_model
from fedhead.federation.rundir import write_csv
from fedhead.federation.train import run_training
from fedhead.infra.console import stderr_console
from fedhead.infra.errors import Interval, param_error, unknown_name, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_text, check_out

DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_HEADS = "softmax,ova,ova2,lda,qda,ncm,ridge"
PARTITION_PRESETS = {"iid": ("iid", {}), "dirichlet": ("dirichlet", {"alpha": 0.1}), "shard": ("shard", {})}
EXTRA_SCORES = ("msp", "energy")  # scored for every head beside its own default (they need only the logits)
FIELDS = ["dataset", "head", "partition", "score", "default", "seed", "auroc", "fpr95", "closed_accuracy",
          "known_classes", "unknown_classes", "test_known", "test_unknown"]  # fmt: skip


def known_store(store: Features, known: int, path: Path) -> Path:
    """Write (or reuse) the derived store of the first ``known`` classes: their training and test samples only."""
    if path.is_file():
        return path
    tr, te = store.train_y < known, store.test_y < known
    attrs = {k: v for k, v in store.info.attrs.items() if k in (*STORE_KEYS, "default_image_size")}
    attrs["dataset"] = f"{store.info.dataset}-known{known}"
    return write_store(path, train=(store.train_x[tr], store.train_y[tr]), test=(store.test_x[te], store.test_y[te]),
                       class_names=list(store.info.class_names[:known]), attrs=attrs,
                       dtype=str(store.info.attrs.get("dtype", "float32")))  # fmt: skip


def fpr_at_tpr(known_scores: np.ndarray, unknown_scores: np.ndarray, tpr: float = 0.95) -> float:
    """The share of unknown inputs accepted (score at or below the threshold) when the threshold accepts at least
    ``tpr`` of the known ones (``roc_curve`` with the known inputs positive, scored by ``-score``)."""
    from sklearn.metrics import roc_curve

    y = np.r_[np.ones(len(known_scores)), np.zeros(len(unknown_scores))]
    fpr, tp, _ = roc_curve(y, -np.r_[known_scores, unknown_scores], drop_intermediate=False)
    return float(fpr[np.searchsorted(tp, tpr, side="left")])


def open_set_metrics(model, x: np.ndarray, y: np.ndarray, known: int, kind: str) -> dict:
    """AUROC, FPR at 95% TPR of the score ``kind`` and the closed-set accuracy of ``model`` on features ``x`` with
    labels ``y`` (classes ``>= known`` unknown)."""
    from sklearn.metrics import roc_auc_score

    logits, score = model.scores(x, kind)
    s = score.numpy()
    unk = y >= known
    acc = float((logits.argmax(1).numpy()[~unk] == y[~unk]).mean())
    return {"auroc": float(roc_auc_score(unk, s)), "fpr95": fpr_at_tpr(s[~unk], s[unk]), "closed_accuracy": acc}


def _train(head: str, part: str, params: dict, seeds: list[int], opts: dict, store: Path, sub: Features, out: Path):
    """The run of ``head`` on ``part`` (reused when finished)."""
    if (out / "summary.json").is_file():
        return out
    kw = dict(features=str(store), head=head, partition=part, partition_params=dict(params), seeds=seeds,
              iid_reference=False, plots=False, device="cpu", **opts)  # fmt: skip
    cfg = TrainConfig(**applicable_fields(kw))
    return run_training(cfg, out=out, progress=False, store=sub, overwrite=True).run_dir


def _rows_of(run: Path, seeds: list[int], full: Features, known: int, tags: dict) -> list[dict]:
    out = []
    for seed in seeds:
        m = load_model(run, seed=seed)  # the model file the run wrote, as fedhead predict loads it
        kinds = [m.default_score] + [k for k in EXTRA_SCORES if k != m.default_score]
        for kind in [k for k in kinds if k in applicable(m.openset_tensors)]:
            res = open_set_metrics(m, full.test_x, full.test_y, known, kind)
            out.append({**tags, "score": kind, "default": kind == m.default_score, "seed": seed, **res})
    return out


def _fmt(vals: list[float], scale: float = 100.0) -> str:
    a = np.asarray(vals, dtype=np.float64) * scale
    return f"{a.mean():.1f} ± {a.std(ddof=1) if len(a) > 1 else 0.0:.1f}"


def report_table(rows: list[dict]) -> str:
    """Mean ± std over the seeds per head, score and partition (AUROC %, FPR at 95% TPR %, closed-set accuracy %)."""
    keys = list(dict.fromkeys((r["head"], r["score"], r["partition"]) for r in rows))
    table = []
    for head, score, part in keys:
        sel = [r for r in rows if (r["head"], r["score"], r["partition"]) == (head, score, part)]
        name = score + (" (default)" if sel[0]["default"] else "")
        table.append([head, name, part, _fmt([r["auroc"] for r in sel]), _fmt([r["fpr95"] for r in sel]),
                      _fmt([r["closed_accuracy"] for r in sel])])  # fmt: skip
    return md_table(["head", "score", "partition", "AUROC %", "FPR at 95% TPR %", "closed-set accuracy %"], table)


def _check(heads: list[str], parts: list[str]) -> None:
    for h in heads:
        if h not in HEADS:
            raise unknown_name("--heads", h, list(HEADS), "head")
    for p in parts:
        if p not in PARTITION_PRESETS or p not in PARTITIONS:
            raise unknown_name("--partitions", p, list(PARTITION_PRESETS), "partition preset")


@cli_errors
def openset_cmd(
    features: Path = FEATURES_OPT,
    heads: Optional[List[str]] = typer.Option(None, "--heads", help=f"heads, comma-separated \\[{DEFAULT_HEADS}]"),
    partitions: Optional[List[str]] = typer.Option(
        None, "--partitions", help="iid | dirichlet (alpha 0.1) | shard (2 shards per client), comma-separated \\[all]"
    ),
    seeds: Optional[List[str]] = typer.Option(
        None, "--seeds", help="seeds, repeated or comma-separated \\[0,1,2]", metavar="INT[,INT...]"
    ),
    clients: int = typer.Option(20, "--clients", help="clients of every run"),
    rounds: int = typer.Option(10, "--rounds", help="rounds of an iterative head (a closed-form head has one)"),
    known_fraction: float = typer.Option(0.5, "--known-fraction", help="share of the classes (the first) known"),
    out: Optional[Path] = OUT_OPT,
):
    """Open-set rejection: train on the first half of the classes, test on all; AUROC and FPR at 95% TPR of each
    head's unknown score (from the model file each run wrote) and the closed-set accuracy, per head and partition."""
    heads_l = parse_names(heads or DEFAULT_HEADS, "--heads")
    parts_l = parse_names(partitions or ",".join(PARTITION_PRESETS), "--partitions")
    _check(heads_l, parts_l)
    validate("--clients", clients, Interval(1, None, integer=True))
    validate("--rounds", rounds, Interval(1, None, integer=True))
    validate("--known-fraction", known_fraction, Interval(0, 1, closed="neither"))
    seeds_l = parse_seeds(seeds) if seeds else list(DEFAULT_SEEDS)
    out = Path(out) if out else Path("reports") / f"openset-{time.strftime('%Y%m%d-%H%M%S')}"
    check_out(out, kind="dir")
    full = load_store(features)
    known = int(round(full.info.num_classes * known_fraction))
    if not 1 <= known < full.info.num_classes:
        raise param_error("--known-fraction", known_fraction, f"must leave at least one known and one unknown class "
                          f"of the store's {full.info.num_classes}", "E.g. --known-fraction 0.5.")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    sub_path = known_store(full, known, out / "known-classes.h5")
    sub = load_store(sub_path)
    con, rows, t0 = stderr_console(), [], time.perf_counter()
    for head in heads_l:
        for label in parts_l:
            part, params = PARTITION_PRESETS[label]
            opts = {"clients": clients, "rounds": rounds}
            run = _train(head, part, params, seeds_l, opts, sub_path, sub, out / "runs" / f"{head}-{label}")
            tags = {"dataset": full.info.dataset, "head": head, "partition": label, "known_classes": known,
                    "unknown_classes": full.info.num_classes - known, "test_known": int((full.test_y < known).sum()),
                    "test_unknown": int((full.test_y >= known).sum())}  # fmt: skip
            rows += _rows_of(run, seeds_l, full, known, tags)
            con.print(f"{head} {label}: done ({time.perf_counter() - t0:.0f} s)", markup=False, highlight=False)
    write_csv(out / "results.csv", rows, FIELDS)
    text = "\n".join([
        f"# Open-set rejection: {full.info.dataset}, {known} known / {full.info.num_classes - known} unknown classes",
        "",
        f"{len(seeds_l)} seeds ({', '.join(map(str, seeds_l))}), {clients} clients, {rounds} rounds (iterative "
        f"heads); test split, final round; mean ± std over seeds. Command: `{command_line()}`",
        "",
        report_table(rows),
        "",
    ])  # fmt: skip
    atomic_write_text(out / "report.md", text)
    _print_report(out / "report.md", [text])
