"""``fedhead scratch ALGO --dataset NAME --data-dir PATH ...``: scratch-CNN federated training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from fedhead.federation.experiment import FIELDS, parse_seeds
from fedhead.federation.rundir import default_run_dir
from fedhead.infra.console import make_progress, stderr_console, stdout_console
from fedhead.infra.errors import FedheadError
from fedhead.infra.exits import cli_errors
from fedhead.interface.options import deprecated_flag, option
from fedhead.scratch.runner import ScratchConfig, run_scratch


def renamed_options(seeds: list | None, seed: list | None, backend: str) -> tuple[list[int], str]:
    """``--seeds`` with the deprecated ``--seed`` (the flag's name before it matched fedhead train's and the
    bench's), and ``--backend`` with the deprecated ``vmap`` (the vectorized backend's name before it matched
    fedhead train's); each old name prints one deprecation line."""
    if seed:
        deprecated_flag("--seed", "--seeds", " (repeated or comma-separated)")
    if backend == "vmap":
        deprecated_flag("--backend vmap", "--backend vectorized")
        backend = "vectorized"
    return (parse_seeds([*(seeds or []), *(seed or [])]) if (seeds or seed) else [0]), backend


# The options declared over several lines (the command's signature lists them by these names).
ALGO_ARG = typer.Argument(
    ..., help="fedavg | fedova | fedabc | dnc | local | fedprox | scaffold | fedper | fedrep | fedrod | lg-fedavg"
)
DATASET_OPT = typer.Option(
    ...,
    "--dataset",
    help="mnist | fashion-mnist | cifar10 | cifar100 | tinyimagenet | imagefolder | digits | speech-commands",
)
MODEL_OPT = typer.Option(
    None,
    "--model",
    help="cnn | fedabc-mlp | fedabc-convnet | vgg11 | vgg9 | kws-cnn (default depends on algorithm and dataset).",
)
PARTITION_OPT = typer.Option(
    None,
    "--partition",
    help="iid | shard | dirichlet | bernoulli-dirichlet | zipf | color-skew | natural (speech-commands: one client "
    "per training speaker) (default per algorithm).",
)
SHARDS_PER_CLIENT_OPT = typer.Option(
    None, "--shards-per-client", help="shard: s (labels per client with --distinct-labels, i.e. non-IID-l)."
)
DISTINCT_LABELS_OPT = typer.Option(
    None, "--distinct-labels/--no-distinct-labels", help="shard: s different labels per client (FedOVA)."
)
OPTIMIZER_OPT = typer.Option(
    None,
    "--optimizer",
    help="sgd | adam (fresh state every round). This adam is Adam with L2 weight decay (torch.optim.Adam), "
    "not the head trainer's decoupled adamw.",
)
SEEDS_OPT = typer.Option(
    None, "--seeds", metavar="INT[,INT...]", help="Seeds, repeated or comma-separated. \\[default: 0]"
)
MAX_SAMPLES_PER_CLIENT_OPT = typer.Option(None, "--max-samples-per-client", help="Cap each client's local set.")
LOCAL_TEST_SIZE_OPT = typer.Option(
    None,
    "--local-test-size",
    help="Per-client local test set for PFL accuracy and drift (0 = off; fedabc default 200).",
)
SPLIT_LAYER_OPT = typer.Option(
    None, "--split-layer", help="dnc: layers 1..s learn features (default: chosen from the pre-pass divergence)."
)
SPLIT_THRESHOLD_OPT = typer.Option(
    0.5,
    "--split-threshold",
    help="dnc: split before the first layer whose divergence exceeds this fraction of the largest.",
)
SHARE_FRACTION_OPT = typer.Option(
    0.0,
    "--share-fraction",
    help="Data sharing (Zhao et al. 2018, as FedOVA "
    "uses it), any algorithm: a random global subset D_s of round(beta x "
    "mean client size) training samples, drawn once per seed, sent once to "
    "every client (bytes counted in round 1) and added to its local data; "
    "beta in [0, 1], 0 = off.",
)
PROX_MU_OPT = typer.Option(
    None, "--prox-mu", help="fedprox: mu of (mu/2)||w - w_global||^2 (default 0.01; 0 = FedAvg)."
)
HEAD_LAYERS_OPT = typer.Option(
    None, "--head-layers", help="fedper / fedrep / lg-fedavg: the head is the last N weight layers (default 1)."
)
BODY_EPOCHS_OPT = typer.Option(
    None,
    "--body-epochs",
    help="fedrep: the last N of --local-epochs train the body, the others the head (default 1).",
)
BACKEND_OPT = typer.Option(
    "vectorized", "--backend", help="vectorized (all members at once, fast) | loop (reference, one at a time)."
)
# where the rows go besides rounds.csv: the experiment table's declarations (fedhead train's options of the same name)
PLOTS_OPT, LOG_OPT, LOG_DIR_OPT = (option(FIELDS[n], panel=None)[1] for n in ("plots", "log", "log_dir"))
RESUME_OPT = typer.Option(
    False,
    "--resume",
    help="Continue the interrupted run in --out from its checkpoint (same options; a finished run is reported again).",
)


@cli_errors
def scratch_cmd(
    algo: str = ALGO_ARG,
    dataset: str = DATASET_OPT,
    data_dir: Path = typer.Option(..., "--data-dir", help="Folder holding the dataset."),
    model: Optional[str] = MODEL_OPT,
    partition: Optional[str] = PARTITION_OPT,
    shards_per_client: Optional[int] = SHARDS_PER_CLIENT_OPT,
    distinct_labels: Optional[bool] = DISTINCT_LABELS_OPT,
    alpha: Optional[float] = typer.Option(None, "--alpha", help="dirichlet / bernoulli-dirichlet concentration."),
    min_size: Optional[int] = typer.Option(None, "--min-size", help="dirichlet / zipf smallest client size."),
    p: Optional[float] = typer.Option(None, "--p", help="bernoulli-dirichlet class probability."),
    zipf_s: Optional[float] = typer.Option(None, "--zipf-s", help="zipf exponent."),
    skew: float = typer.Option(0.95, "--skew", help="color-skew: grayscale fraction of collaborator 1."),
    clients: Optional[int] = typer.Option(None, "--clients", help="Number of clients K."),
    participation: Optional[float] = typer.Option(None, "--participation", help="Fraction of clients per round."),
    rounds: Optional[int] = typer.Option(None, "--rounds", help="Rounds (dnc: rounds after the pre-pass)."),
    local_epochs: Optional[int] = typer.Option(None, "--local-epochs", help="Local epochs E."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Local batch size B."),
    optimizer: Optional[str] = OPTIMIZER_OPT,
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate."),
    momentum: Optional[float] = typer.Option(None, "--momentum", help="SGD momentum."),
    weight_decay: Optional[float] = typer.Option(None, "--weight-decay", help="L2 weight decay."),
    seeds: Optional[list[str]] = SEEDS_OPT,
    seed: Optional[list[str]] = typer.Option(None, "--seed", hidden=True),
    subset: Optional[int] = typer.Option(None, "--subset", help="Use a stratified training subset of this size."),
    test_subset: Optional[int] = typer.Option(None, "--test-subset", help="Stratified test subset size."),
    max_samples_per_client: Optional[int] = MAX_SAMPLES_PER_CLIENT_OPT,
    noise: str = typer.Option("none", "--noise", help="Label noise: none | symmetric | asymmetric."),
    noise_rate: float = typer.Option(0.0, "--noise-rate", help="Label noise rate."),
    local_test_size: Optional[int] = LOCAL_TEST_SIZE_OPT,
    prepass_rounds: int = typer.Option(5, "--prepass-rounds", help="dnc: full-model FedAvg pre-pass rounds."),
    split_layer: Optional[int] = SPLIT_LAYER_OPT,
    split_threshold: float = SPLIT_THRESHOLD_OPT,
    divergence: str = typer.Option("local-vs-global", "--divergence", help="dnc: local-vs-global | local-vs-local."),
    feature_epochs: int = typer.Option(20, "--feature-epochs", help="dnc: local epochs of feature rounds."),
    finetune_epochs: int = typer.Option(4, "--finetune-epochs", help="dnc: local epochs of fine-tuning rounds."),
    finetune_lr_factor: float = typer.Option(0.5, "--finetune-lr-factor", help="dnc: fine-tuning lr factor."),
    lr_decay: float = typer.Option(0.9, "--lr-decay", help="dnc: lr factor per round after the pre-pass."),
    share_fraction: float = SHARE_FRACTION_OPT,
    prox_mu: Optional[float] = PROX_MU_OPT,
    head_layers: Optional[int] = HEAD_LAYERS_OPT,
    body_epochs: Optional[int] = BODY_EPOCHS_OPT,
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda (cuda uses autocast)."),
    backend: str = BACKEND_OPT,
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (default runs/<time>-scratch-...)."),
    resume: bool = RESUME_OPT,
    plots: bool = PLOTS_OPT,
    log: str = LOG_OPT,
    log_dir: Optional[str] = LOG_DIR_OPT,
):
    """Train a model from scratch with FedAvg, FedOVA, FedABC, Divide-and-Conquer or FedABC's baselines (local,
    FedProx, SCAFFOLD, FedPer, FedRep, FedRoD, LG-FedAvg)."""
    seeds_l, backend = renamed_options(seeds, seed, backend)
    cfg = ScratchConfig(
        algo=algo,
        dataset=dataset,
        data_dir=str(data_dir),
        model=model,
        partition=partition,
        partition_params=partition_options(shards_per_client, distinct_labels, alpha, min_size, p, zipf_s),
        clients=clients,
        participation=participation,
        rounds=rounds,
        local_epochs=local_epochs,
        batch_size=batch_size,
        optimizer=optimizer,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        seeds=seeds_l,
        subset=subset,
        test_subset=test_subset,
        max_samples_per_client=max_samples_per_client,
        noise=noise,
        noise_rate=noise_rate,
        local_test_size=local_test_size,
        skew=skew,
        prepass_rounds=prepass_rounds,
        split_layer=split_layer,
        split_threshold=split_threshold,
        divergence=divergence,
        feature_epochs=feature_epochs,
        finetune_epochs=finetune_epochs,
        finetune_lr_factor=finetune_lr_factor,
        lr_decay=lr_decay,
        share_fraction=share_fraction,
        prox_mu=prox_mu,
        head_layers=head_layers,
        body_epochs=body_epochs,
        device=device,
        backend=backend,
        plots=plots,
        log=log,
        log_dir=log_dir,
    )
    out_dir = scratch_run_dir(out, resume, algo, dataset)
    summary = run_with_progress(cfg, out_dir, resume)
    print_summary(algo, summary, out_dir)


def partition_options(
    shards_per_client: int | None,
    distinct_labels: bool | None,
    alpha: float | None,
    min_size: int | None,
    p: float | None,
    zipf_s: float | None,
) -> dict:
    """The partition options as given (None: not given), the config's ``partition_params``."""
    return {
        "shards_per_client": shards_per_client,
        "distinct_labels": distinct_labels,
        "alpha": alpha,
        "min_size": min_size,
        "p": p,
        "zipf_s": zipf_s,
    }


def scratch_run_dir(out: Path | None, resume: bool, algo: str, dataset: str) -> Path:
    """The run directory: ``--out``, which ``--resume`` needs, else a new one under ``runs/``."""
    if resume and out is None:
        raise FedheadError(
            "The '--resume' option needs the run directory to continue. Got no --out instead. "
            "Name the interrupted run with --out."
        )
    return out or default_run_dir("runs", "scratch", algo, dataset)


def run_with_progress(cfg: ScratchConfig, out_dir: Path, resume: bool) -> dict:
    """Run (or resume) the scratch run, its log lines on stderr and a transient progress bar; returns its summary."""
    err = stderr_console()
    with make_progress(transient=True) as progress:
        return run_scratch(
            cfg, out_dir, log=lambda m: err.print(m, markup=False, highlight=False), progress=progress, resume=resume
        )


def print_summary(algo: str, summary: dict, out_dir: Path) -> None:
    """Print the run's summary on stdout: D&C's divergence table and split, the final metrics, the run directory."""
    con = stdout_console()
    if algo == "dnc" and summary.get("divergence_last_prepass"):
        cfgj = json.loads((Path(out_dir) / "config.json").read_text())
        t = Table(title="Layer-wise weight divergence after the pre-pass (1 - cos)")
        t.add_column("layer")
        t.add_column("name")
        t.add_column("divergence", justify="right")
        for i, (name, d) in enumerate(zip(cfgj["weight_layers"], summary["divergence_last_prepass"]), 1):
            mark = "  <- split" if i == summary["split_layer"] else ""
            t.add_row(f"L{i}", name, f"{d:.4f}{mark}")
        con.print(t)
    if algo == "dnc":
        con.print(f"split layer: {summary['split_layer']} (layers 1..{summary['split_layer']} feature learning)")
    keys = [
        "final_accuracy",
        "last5_accuracy",
        "last5_pfl_accuracy",
        "last5_drift_accuracy",
        "last5_generic_accuracy",
        "bytes_total",
    ]
    con.print(
        " ".join(
            f"{k}={summary[k]:.4f}" if isinstance(summary[k], float) and k != "bytes_total" else f"{k}={summary[k]:.0f}"
            for k in keys
            if k in summary
        )
    )
    if algo == "dnc":
        s = summary["per_seed"][0]
        con.print(f"bytes_prepass={s['bytes_prepass']} bytes_after_prepass={s['bytes_after_prepass']}")
    con.print(f"run directory: {out_dir}")
