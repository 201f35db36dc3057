"""``fedhead finetune --dataset NAME --encoder NAME --peft KIND ...``: federated fine-tuning of a pretrained encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fedhead.federation.experiment import FIELDS
from fedhead.federation.rundir import default_run_dir
from fedhead.infra.console import make_progress, stderr_console, stdout_console
from fedhead.infra.exits import cli_errors
from fedhead.interface.options import option
from fedhead.scratch.commands import partition_options, renamed_options, scratch_run_dir
from fedhead.scratch.finetune import FinetuneConfig, run_finetune

PEFT_OPT = typer.Option(
    "lora",
    "--peft",
    help="What trains: lora | prompt | bitfit | full | head (the frozen encoder's features once, then fedhead "
    "train's head: OvA-LP) | moe (FFT-MoE's sparse mixture of LoRA experts) | pfpt (probabilistic federated "
    "prompt tuning).",
)
WEIGHTS_OPT = typer.Option(
    None,
    "--weights",
    help="The encoder's weights: a checkpoint file, or 'registry' (the installed EfficientNet-Lite0/Lite1 "
    "packages); default the library's hub weights (online).",
)
LORA_TARGETS_OPT = typer.Option(
    "auto",
    "--lora-targets",
    help="auto (ViT: attention and MLP projections; CNN: pointwise 1x1 convolutions) | attention | mlp | "
    "pointwise | linear | a regular expression over module names.",
)
PROMPT_MODE_OPT = typer.Option(
    "auto", "--prompt-mode", help="auto (ViT: shallow, CNN: pixel) | shallow | deep (VPT) | pixel (a learnt border)."
)
LR_OPT = typer.Option(
    None, "--lr", help="Local learning rate (default 1e-3 with adamw/adam, 0.01 with sgd; head: the train recipe's)."
)
PLOTS_OPT, LOG_OPT, LOG_DIR_OPT = (option(FIELDS[n], panel=None)[1] for n in ("plots", "log", "log_dir"))


@cli_errors
def finetune_cmd(
    dataset: str = typer.Option(..., "--dataset", help="A dataset fedhead extract reads (cifar10, digits, ...)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Folder holding the dataset."),
    encoder: str = typer.Option(..., "--encoder", help="A timm model name or clip:MODEL/PRETRAINED."),
    weights: Optional[str] = WEIGHTS_OPT,
    pretrained: bool = typer.Option(True, "--pretrained/--no-pretrained", help="--no-pretrained: random init."),
    image_size: Optional[int] = typer.Option(None, "--image-size", help="Input side (default: the encoder's)."),
    peft: str = PEFT_OPT,
    lora_rank: int = typer.Option(8, "--lora-rank", help="lora / moe: adapter rank r."),
    lora_alpha: float = typer.Option(16.0, "--lora-alpha", help="lora / moe: scale alpha (update x alpha / r)."),
    lora_dropout: float = typer.Option(0.0, "--lora-dropout", help="lora: dropout on the adapter's input."),
    lora_targets: str = LORA_TARGETS_OPT,
    prompt_mode: str = PROMPT_MODE_OPT,
    prompt_tokens: int = typer.Option(10, "--prompt-tokens", help="prompt (VPT) / pfpt: learnt tokens per layer."),
    prompt_width: int = typer.Option(4, "--prompt-width", help="prompt pixel: border width in pixels."),
    experts: int = typer.Option(4, "--experts", help="moe: LoRA experts per adapted layer."),
    top_k: int = typer.Option(2, "--top-k", help="moe: experts each token is routed to."),
    pfpt_pool: int = typer.Option(20, "--pfpt-pool", help="pfpt: prompts in the server's pool."),
    head: str = typer.Option("ova2", "--head", help="--peft head: the head fedhead train fits on the features."),
    partition: str = typer.Option(
        "dirichlet", "--partition", help="iid | shard | dirichlet | bernoulli-dirichlet | zipf ..."
    ),
    shards_per_client: Optional[int] = typer.Option(None, "--shards-per-client", help="shard: labels per client."),
    distinct_labels: Optional[bool] = typer.Option(None, "--distinct-labels/--no-distinct-labels", help="shard."),
    alpha: Optional[float] = typer.Option(None, "--alpha", help="dirichlet / bernoulli-dirichlet concentration."),
    min_size: Optional[int] = typer.Option(None, "--min-size", help="dirichlet / zipf smallest client size."),
    p: Optional[float] = typer.Option(None, "--p", help="bernoulli-dirichlet class probability."),
    zipf_s: Optional[float] = typer.Option(None, "--zipf-s", help="zipf exponent."),
    clients: int = typer.Option(10, "--clients", help="Number of clients K."),
    participation: float = typer.Option(1.0, "--participation", help="Fraction of clients per round."),
    rounds: int = typer.Option(10, "--rounds", help="Rounds."),
    local_epochs: int = typer.Option(1, "--local-epochs", help="Local epochs E."),
    batch_size: int = typer.Option(32, "--batch-size", help="Local batch size B."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw | adam | sgd (fresh state every round)."),
    lr: Optional[float] = LR_OPT,
    momentum: float = typer.Option(0.9, "--momentum", help="sgd momentum."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="Weight decay (adamw: decoupled)."),
    prox_mu: float = typer.Option(0.0, "--prox-mu", help="FedProx mu on the trainable tensors (0 = off)."),
    aggregate: str = typer.Option("fedavg", "--aggregate", help="The aggregation rule (fedhead train's rules)."),
    server_opt: str = typer.Option("fedavg", "--server-opt", help="fedavg | fedavgm | fedadam | fedyogi | fedadagrad."),
    server_lr: Optional[float] = typer.Option(
        None, "--server-lr", help="Server learning rate (default per optimiser)."
    ),
    seeds: Optional[list[str]] = typer.Option(None, "--seeds", metavar="INT[,INT...]", help="Seeds. \\[default: 0]"),
    limit: Optional[int] = typer.Option(None, "--limit", help="A stratified subset of N images per split."),
    val_fraction: float = typer.Option(0.1, "--val-fraction", help="Each client's share held out for validation."),
    noise: str = typer.Option("none", "--noise", help="Label noise: none | symmetric | asymmetric."),
    noise_rate: float = typer.Option(0.0, "--noise-rate", help="Label noise rate."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    precision: str = typer.Option("auto", "--precision", help="auto (bf16 autocast on CUDA) | fp32 | bf16."),
    cache: Path = typer.Option(Path("cache"), "--cache", help="--peft head: where the feature store is kept (reused)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (default runs/<time>-finetune-...)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the interrupted run in --out."),
    plots: bool = PLOTS_OPT,
    log: str = LOG_OPT,
    log_dir: Optional[str] = LOG_DIR_OPT,
):
    """Fine-tune a pretrained encoder federatedly on raw images (LoRA, prompts, BitFit, full, FFT-MoE, PFPT), or a
    head on its frozen features, with fedhead train's partitions, rounds and run directory."""
    given = dict(locals())
    parts = partition_options(shards_per_client, distinct_labels, alpha, min_size, p, zipf_s)
    for key in (*parts, "out", "resume"):
        given.pop(key)
    given.update(data_dir=None if data_dir is None else str(data_dir), cache=str(cache), partition_params=parts,
                 seeds=renamed_options(seeds, None, "vectorized")[0])  # fmt: skip
    cfg = FinetuneConfig(**given)
    out_dir = (
        scratch_run_dir(out, resume, "finetune", dataset)
        if out or resume
        else default_run_dir("runs", "finetune", peft, dataset)
    )
    err = stderr_console()
    with make_progress(transient=True) as progress:
        summary = run_finetune(
            cfg, out_dir, log=lambda m: err.print(m, markup=False, highlight=False), progress=progress, resume=resume
        )
    con = stdout_console()
    keys = ("final_accuracy", "final_val_accuracy", "acc95_round", "bytes_up_per_client", "client_ms", "server_ms")
    con.print(" ".join(f"{k}={summary[k]:.4g}" for k in keys if isinstance(summary.get(k), (int, float))))
    con.print(f"run directory: {out_dir}")
