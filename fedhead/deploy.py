"""Typer commands that use a run's model: ``fedhead predict`` (classify images or a store's features, a CSV of the
top-k classes, accuracy and confusion matrix when labels are known) and ``fedhead export`` (one ONNX or TorchScript
file that classifies raw images without fedhead). The model is :mod:`fedhead.federation.model`'s; docs/model.md."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from extract.store import load_store, open_store
from fedhead.core.openset import SCORES, score_kind, unknown_scores
from fedhead.federation.export import FORMATS, export_model, parse_size
from fedhead.federation.finetuned import FinetunedModel
from fedhead.federation.model import (
    Model,
    check_store,
    image_labels,
    list_images,
    load_model,
    predict_images,
    probabilities,
)
from fedhead.infra.console import stdout_console
from fedhead.infra.devices import resolve_device
from fedhead.infra.errors import FedheadError, Interval, OneOf, param_error, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_text, check_out

MODEL_HELP = "a run directory, a model card (model-seed<S>.json) or its .safetensors"
SEED_HELP = "the seed whose model to use, in a run directory \\[the run's lowest seed]"
CLIENT_HELP = (
    "use client K's personal head (model-seed<S>-client<K>.json, written by fedhead train --personalize METHOD "
    "--personal-models K) instead of the global model \\[the global model]"
)
FULL_MATRIX_MAX = 20  # classes up to which the whole confusion matrix is printed; beyond, the largest confusions
UNKNOWN = "unknown"  # the top-1 class of a rejected input (--reject, --reject-rate)
REJECT_HELP = (
    "reject inputs whose open-set score (--score; higher: more unknown) is above this threshold: their top-1 class "
    "becomes 'unknown' (a value in the score's range, docs/model.md)"
)
REJECT_RATE_HELP = (
    "reject with the threshold above which this fraction of the run's validation part (known classes) lies, from the "
    "model card's validation quantiles (in [0, 1))"
)
SCORE_HELP = f"the open-set score: {' | '.join(SCORES)} \\[the model's default: its head's]"


def _rows(model: Model | FinetunedModel, sources: list, labels: np.ndarray | None, logits, top_k: int,
          score: np.ndarray | None = None, rejected: np.ndarray | None = None):  # fmt: skip
    """The CSV's header and rows and the predictions (class indices), from the model's ``logits [N, C]``; with
    ``score`` an ``unknown_score`` column, and the rows ``rejected`` (bool [N]) get ``unknown`` as their top-1
    class (the probability columns stay those of the classes by logit)."""
    probs = probabilities(logits, model.probabilities).numpy()
    order = np.argsort(-logits.numpy(), axis=1, kind="stable")[:, :top_k]  # by logit: top 1 = the prediction
    header = ["source"] + (["label"] if labels is not None else [])
    for i in range(1, top_k + 1):
        header += [f"class_{i}", f"probability_{i}"]
    header += ["unknown_score"] if score is not None else []
    rows = []
    for n, src in enumerate(sources):
        row = [src] + ([model.classes_[labels[n]]] if labels is not None else [])
        for c in order[n]:
            row += [model.classes_[c], f"{probs[n, c]:.6g}"]
        if rejected is not None and rejected[n]:
            row[len(row) - 2 * len(order[n])] = UNKNOWN
        rows.append(row + ([f"{score[n]:.6g}"] if score is not None else []))
    return header, rows, order[:, 0] if len(order) else np.zeros(0, np.int64)


def _threshold(m: Model | FinetunedModel, kind: str, reject: float | None, rate: float | None) -> float | None:
    """The rejection threshold of ``--reject`` (checked against the score's range) or ``--reject-rate`` (from the
    card's validation quantiles); None without either."""
    if reject is not None:
        return score_kind(kind).check(reject, "--reject")
    if rate is None:
        return None
    if isinstance(m, FinetunedModel):
        raise param_error("--reject-rate", rate, "needs a model card with validation quantiles; a fine-tuned model "
                          "keeps none", "Give a threshold with --reject instead.")  # fmt: skip
    return m.reject_threshold(rate, kind)


def _report_rejection(con, labels: np.ndarray | None, pred: np.ndarray, rejected: np.ndarray, t: float, kind: str):
    n, r = len(rejected), int(rejected.sum())
    con.print(f"rejected {r} of {n} ({r / max(1, n):.1%}) as unknown: {kind} score > {t:.6g}", markup=False)
    if labels is not None and n:
        ok = (pred == labels) & ~rejected
        kept = n - r
        con.print(f"accuracy with rejection {int(ok.sum()) / n:.4f} ({int(ok.sum())} of {n}: a rejected input counts as "
                  f"wrong); on the accepted inputs {int(ok.sum()) / max(1, kept):.4f} ({int(ok.sum())} of {kept})",
                  markup=False)  # fmt: skip


def _confusion(labels: np.ndarray, pred: np.ndarray, classes) -> "object":
    from rich.table import Table

    c = len(classes)
    m = np.zeros((c, c), dtype=np.int64)
    np.add.at(m, (labels, pred), 1)
    if c <= FULL_MATRIX_MAX:
        t = Table(title="confusion matrix (rows: true class, columns: predicted)")
        t.add_column("true \\ predicted", justify="left")
        for name in classes:
            t.add_column(str(name), justify="right")
        for i, name in enumerate(classes):
            t.add_row(str(name), *[str(v) if v else "." for v in m[i]])
        return t
    off = m.copy()
    np.fill_diagonal(off, 0)
    pairs = [(int(off[i, j]), i, j) for i, j in zip(*np.nonzero(off))]
    pairs.sort(key=lambda p: (-p[0], p[1], p[2]))
    t = Table(title=f"the largest confusions of {c} classes (true -> predicted)")
    for h in ("true", "predicted", "count", "share of the true class"):
        t.add_column(h, justify="right" if h in ("count", "share of the true class") else "left")
    for n, i, j in pairs[:15]:
        t.add_row(str(classes[i]), str(classes[j]), str(n), f"{n / max(1, m[i].sum()):.3f}")
    return t


def personal_text(m: Model | FinetunedModel) -> str:
    """For a personal model (``--client``): "client K's personal head (METHOD[, beta B])"; else ""."""
    if m.client is None:
        return ""
    beta = (m.card.get("personal") or {}).get("beta")
    method = str(m.card.get("personalize")) + (f", beta {beta:g}" if isinstance(beta, (int, float)) else "")
    return f"client {m.client}'s personal head ({method})"


def model_text(m: Model | FinetunedModel) -> str:
    """What a command says of the model it used: its head and encoder, and which client's personal head it is (a
    fine-tuned model: its --peft kind and encoder)."""
    if isinstance(m, FinetunedModel):
        return f"{m.card['encoder']} fine-tuned with --peft {m.card['tuning']['peft']}"
    text = f"{m.card['head']['kind']}, {m.card['store'].get('encoder')}"
    return text + (f"; {personal_text(m)}" if m.client is not None else "")


def _from_store(model: Model, store: Path, split: str):
    info = open_store(store, "--features")
    check_store(model, info)
    if list(info.class_names) != list(model.classes_):
        raise param_error("--features", str(store), "must have the model's classes",
                          f"Its classes: {', '.join(info.class_names[:5])}...; the model's: "
                          f"{', '.join(model.classes_[:5])}...")  # fmt: skip
    s = load_store(store, "--features")
    x, y = (s.test_x, s.test_y) if split == "test" else (s.train_x, s.train_y)
    return list(range(len(y))), y, x


@cli_errors
def predict_cmd(
    model: Path = typer.Option(..., "--model", help=MODEL_HELP),
    seed: Optional[int] = typer.Option(None, help=SEED_HELP),
    client: Optional[int] = typer.Option(None, "--client", help=CLIENT_HELP),
    images: Optional[list[Path]] = typer.Option(
        None, "--images", help="image files or folders (DIR/<class>/<file> gives labels); repeat for more"
    ),
    features: Optional[Path] = typer.Option(None, "--features", help="a feature store made with the model's encoder"),
    split: str = typer.Option("test", help="--features: the split to classify (train | test)"),
    out: Path = typer.Option(Path("predictions.csv"), help="CSV of the predictions"),
    top_k: int = typer.Option(3, help="classes (with their probabilities) per row of the CSV"),
    device: str = typer.Option("auto", help="auto | cpu | cuda (the encoder's forward)"),
    batch_size: Optional[int] = typer.Option(None, help="images per forward \\[the store's extraction batch size]"),
    reject: Optional[float] = typer.Option(None, "--reject", help=REJECT_HELP),
    reject_rate: Optional[float] = typer.Option(None, "--reject-rate", help=REJECT_RATE_HELP),
    score: Optional[str] = typer.Option(None, "--score", help=SCORE_HELP),
):
    """Classify images (encoded with the model's own encoder) or a store's features with a run's model: a CSV of
    the top-k classes and probabilities; accuracy and a confusion matrix when the labels are known; --reject or
    --reject-rate labels open-set inputs 'unknown'."""
    if (images is None) == (features is None):
        raise FedheadError(
            "Give exactly one of --images (image files or folders) and --features (a store). Got "
            f"{'both' if images else 'neither'}."
        )
    validate("--top-k", top_k, Interval(1, None, integer=True))
    validate("--split", split, OneOf(("train", "test")))
    if batch_size is not None:
        validate("--batch-size", batch_size, Interval(1, None, integer=True))
    if reject is not None and reject_rate is not None:
        raise FedheadError(
            f"Give at most one of --reject (a threshold; got {reject!r}) and --reject-rate (a fraction of the "
            f"validation part; got {reject_rate!r}), not both."
        )
    if reject_rate is not None:
        validate("--reject-rate", reject_rate, Interval(0, 1, closed="left"))
    if score is not None:
        score_kind(score)
    check_out(out)
    m = load_model(model, seed, client=client)
    kind = score or m.default_score
    threshold = _threshold(m, kind, reject, reject_rate)
    if isinstance(m, FinetunedModel):
        if features is not None:
            raise param_error("--features", str(features), "applies to a head's model (a store of frozen features)",
                              f"{str(m.path)!r} is a fine-tuned encoder: classify images with --images.")  # fmt: skip
        sources = list_images(images)
        labels = image_labels(sources, list(m.classes_))
        logits = m.to(resolve_device(device)).logits(sources, batch_size=batch_size, progress=True)
        unknown = unknown_scores(kind, logits, None, {}).numpy()
    else:
        if images:
            sources, labels, x = predict_images(m, images, device=resolve_device(device), batch_size=batch_size)
        else:
            sources, labels, x = _from_store(m, features, split)
        logits, unknown = m.scores(x, kind)
        unknown = unknown.numpy()
    asked = score is not None or threshold is not None
    rejected = unknown > threshold if threshold is not None else None
    header, rows, pred = _rows(m, sources, labels, logits, min(top_k, len(m.classes_)), unknown if asked else None,
                               rejected)  # fmt: skip
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    atomic_write_text(out, buf.getvalue())
    con = stdout_console()
    what = f"{len(rows)} {'images' if images else f'{split} features'}"
    con.print(f"classified {what} with {m.path} ({model_text(m)})", markup=False, highlight=False)
    if labels is not None and len(rows):
        correct = int((pred == labels).sum())
        con.print(f"accuracy {correct / len(rows):.4f} ({correct} of {len(rows)})")
        con.print(_confusion(labels, pred, list(m.classes_)))
    if rejected is not None:
        _report_rejection(con, labels, pred, rejected, threshold, kind)
    con.print(f"predictions in {out}")


@cli_errors
def export_cmd(
    model: Path = typer.Option(..., "--model", help=MODEL_HELP),
    seed: Optional[int] = typer.Option(None, help=SEED_HELP),
    client: Optional[int] = typer.Option(None, "--client", help=CLIENT_HELP),
    format: str = typer.Option("onnx", "--format", help="onnx | torchscript"),
    out: Path = typer.Option(..., "--out", help="the file to write"),
    input_size: Optional[str] = typer.Option(
        None, help="HxW of the uint8 images the file takes \\[the store's source size, e.g. 8x8 for digits]"
    ),
):
    """Write a run's model as one file that classifies raw uint8 images [N, H, W, 3] without fedhead (encoder,
    preprocessing, feature preparation and head), checked against fedhead's own forward before it is kept."""
    validate("--format", format, OneOf(FORMATS))
    check_out(out)
    m = load_model(model, seed, client=client)
    size = parse_size(input_size, m)
    res = export_model(m, format, out, size)
    check = "onnx.checker and onnxruntime" if format == "onnx" else "torch.jit.load"
    typer.echo(
        f"wrote {out} ({format}: images uint8 [N, {size[0]}, {size[1]}, 3] -> logits, probabilities "
        f"[N, {len(m.classes_)}]; checked with {check}, largest relative difference "
        f"{res['max_relative_error']:.2g})" + (f"; {personal_text(m)}" if m.client is not None else "")
    )
