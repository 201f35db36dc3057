"""Typer commands that change a finished model: ``fedhead update`` (take new clients in) and ``fedhead forget``
(take withdrawn clients out), exactly for a closed-form model that kept its statistics, by retraining without them
for an iterative head (:mod:`fedhead.federation.versions`; docs/lifecycle.md)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Optional

import typer

from fedhead.core.partitions import PARTITIONS
from fedhead.federation.config import TrainConfig
from fedhead.federation.experiment import parse_client_ids
from fedhead.federation.model import model_card_path, portable_card, read_card
from fedhead.federation.train import run_training
from fedhead.federation.versions import (
    Change,
    card_members,
    check_members,
    forget_model,
    ids_text,
    update_model,
    version_entry,
)
from fedhead.infra.console import stdout_console
from fedhead.infra.errors import param_error
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_json, check_out
from fedhead.interface.options import ExperimentArgs, with_experiment_options

MODEL_HELP = "the model to change: a run directory, a model card (model-seed<S>.json) or its .safetensors"
SEED_HELP = "the seed whose model to change, in a run directory \\[the run's lowest seed]"
PARTITION_FIELDS = ["partition", "clients", *sorted({p.name for spec in PARTITIONS.values() for p in spec.params}),
                    "partition_arg"]  # fmt: skip


def retrain_without(model: str | os.PathLike, clients, out: str | os.PathLike, *, seed: int | None = None,
                    features: str | os.PathLike | None = None, progress: bool = True) -> Change:  # fmt: skip
    """The honest removal for an iterative head, whose head is no sum of the clients' messages: the run again from
    its config.toml without ``clients`` (``--withdrawn-clients``; with ``--init``, from the remaining clients'
    closed-form start), into ``out``; the new model's card carries the old history and this removal with its cost
    (seconds, bytes). The old run directory is left as it was: delete it to complete the removal."""
    card_path = model_card_path(model, seed)
    card = read_card(card_path)
    ids = check_members(clients, card_members(card))
    toml = card_path.parent / "config.toml"
    if not toml.is_file():
        raise param_error("--model", str(card_path), "must sit in its run directory with the run's config.toml",
                          "Name the run directory.")  # fmt: skip
    cfg = TrainConfig.from_toml(toml)
    before = parse_client_ids(cfg.withdrawn_clients) if cfg.withdrawn_clients else []
    run_seed = int(card.get("run", {}).get("seed", cfg.seeds[0])) if isinstance(card.get("run"), dict) else cfg.seeds[0]
    cfg = dataclasses.replace(cfg, seeds=[run_seed], withdrawn_clients=ids_text(sorted(set(before) | set(ids))))
    if features is not None:
        cfg.features = str(features)
    t0 = time.perf_counter()
    result = run_training(cfg, out=out, progress=progress)
    seconds = time.perf_counter() - t0
    new_path = model_card_path(out, run_seed)
    new = read_card(new_path)
    versions = list(card.get("versions") or [])
    entry = version_entry("forget", len(versions) + 1, None, run_seed, ids, 0, method="retrain", seconds=seconds,
                          rounds=int(result.summary.get("rounds", cfg.rounds)),
                          bytes_total=result.summary.get("bytes_total"),
                          test_accuracy=new.get("metrics", {}).get("test_accuracy"),
                          weights_sha256=new.get("weights_file_sha256", ""))  # fmt: skip
    new["versions"] = versions + [entry]
    atomic_write_json(new_path, portable_card(new))
    return Change(new_path, entry["version"], entry["clients"], seconds, entry["test_accuracy"])


def _report(what: str, ch: Change) -> None:
    con = stdout_console()
    acc = f", test accuracy {ch.test_accuracy:.4f}" if ch.test_accuracy is not None else ""
    ids = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ch.clients[:8]) + (
        " ..." if len(ch.clients) > 8 else ""
    )
    con.print(f"{what} clients {ids}: version {ch.version} of {ch.card} in {ch.seconds:.3f} s{acc}", markup=False,
              highlight=False)  # fmt: skip


@cli_errors
@with_experiment_options(names=PARTITION_FIELDS)
def update_cmd(
    model: Path = typer.Option(..., "--model", help=MODEL_HELP),
    features: Path = typer.Option(..., "--features", help="the new clients' feature store (the model's encoder)"),
    seed: Optional[int] = typer.Option(None, help=SEED_HELP),
    *,
    experiment: ExperimentArgs,
):
    """Take new clients into a closed-form model that kept its statistics (--keep-statistics): their statistics
    summed into the kept ones and the head solved again, equal to a run over the union of the data; the card
    records the new version."""
    ch = update_model(model, features, seed=seed, **experiment.given_values())
    _report("took in", ch)


@cli_errors
def forget_cmd(
    model: Path = typer.Option(..., "--model", help=MODEL_HELP),
    clients: str = typer.Option(..., "--clients", help="ids of the clients that withdraw, e.g. 3,7"),
    features: Optional[Path] = typer.Option(
        None,
        "--features",
        help="the store their data came from (their statistics are recomputed from it; an "
        "iterative head: the store to retrain on) \\[a closed-form model: required unless --client-statistics]",
    ),
    client_statistics: Optional[list[Path]] = typer.Option(
        None,
        "--client-statistics",
        help="the statistics the withdrawing clients sent again (files written by "
        "fedhead.client_statistics_file), instead of recomputing them; repeat for more",
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="an iterative head: the run directory of the retraining without them \\[required there]"
    ),
    seed: Optional[int] = typer.Option(None, help=SEED_HELP),
):
    """Take withdrawn clients out of a model: a closed-form model that kept its statistics subtracts theirs and
    solves again (equal to a run that never had them); an iterative head's run is retrained without them into
    --out. The card records the new version."""
    card = read_card(model_card_path(model, seed))
    if "statistics" in card:
        ch = forget_model(model, clients, features, seed=seed, statistics_files=client_statistics)
        _report("forgot", ch)
        return
    if out is None:
        raise param_error("--out", None, f"must name a new run directory: head {card['head'].get('kind')!r} kept no "
                          "statistics, so forgetting retrains its run without the clients", "Give --out DIR.")  # fmt: skip
    check_out(out, kind="dir")
    ch = retrain_without(model, clients, out, seed=seed, features=features)
    _report("forgot (retrained)", ch)
    stdout_console().print(f"the old run {str(model_card_path(model, seed).parent)!r} still holds their data: "
                           "delete it to complete the removal", markup=False, highlight=False)  # fmt: skip
