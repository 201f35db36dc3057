"""The round loop of ``fedhead train``: written once, over any head, partition, noise and aggregator.

For every seed (and, with ``iid_reference``, for the IID partition with everything else equal) it
partitions the training set, applies label noise per client, computes the federated feature statistics,
and runs the rounds: sample clients by (seed, round), train them in the engine, aggregate, evaluate the
global head on the clean test set, write the round's row and a checkpoint. ``resume`` continues from the
checkpoint and ends with the same results as an uninterrupted run (everything random is keyed by seed,
round and client, so nothing but the head and the finished rows needs saving).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from extract.store import Features, load_store
from . import __version__
from .config import TrainConfig
from .engine import ClientSet, Engine, LocalConfig, OptimConfig, evaluate
from .errors import FedheadError
from .heads import create_head, resolve_head_params
from .noise import apply_noise
from .partitions import PARTITIONS, class_counts, create_partition, resolve_partition_params
from .rundir import (acc95_round, default_run_dir, mean_std, write_clients_per_seed, write_config,
                     write_rounds, write_summary)
from .util import atomic_torch_save, make_progress, resolve_device, set_cpu_threads

CHECKPOINT = "checkpoint.pt"


# ---------------------------------------------------------------- pieces of a run


def sample_clients(num_clients: int, participation: float, seed: int, rnd: int) -> np.ndarray:
    """Clients of round ``rnd``: the same for every head and backend given (seed, round)."""
    m = max(1, int(round(participation * num_clients)))
    if m >= num_clients:
        return np.arange(num_clients)
    rng = np.random.default_rng([seed, rnd, 0x5EED])
    return np.sort(rng.choice(num_clients, size=m, replace=False))


@dataclass
class FeatureStats:
    mean: np.ndarray | None
    scale: float
    bytes_up_per_client: int        # what each client sends for the statistics (once)
    bytes_down_per_client: int


def federated_feature_stats(x: np.ndarray, parts: list[np.ndarray], center: bool, scale: str) -> FeatureStats:
    """Each client sends its feature sum, squared-norm sum and count; the server adds them up.

    Costs one extra exchange of ``D + 2`` floats per client (counted in round 1's bytes)."""
    if not center and scale == "none":
        return FeatureStats(None, 1.0, 0, 0)
    d = x.shape[1]
    total = np.zeros(d, dtype=np.float64)
    sq, n = 0.0, 0
    for p in parts:
        xp = x[p].astype(np.float64)
        total += xp.sum(0)
        sq += float((xp * xp).sum())
        n += len(p)
    mean = total / max(1, n)
    s = 1.0
    if scale == "rms":
        var = sq / max(1, n) - (float(mean @ mean) if center else 0.0)
        s = float(np.sqrt(max(var, 1e-12)))
    up = (d + 2) * 4
    down = (d + 1) * 4
    return FeatureStats(mean if center else None, s, up, down)


def prepare(x: np.ndarray, stats: FeatureStats, device, dtype=torch.float32) -> torch.Tensor:
    """Apply the federated statistics and append the bias column of ones."""
    t = torch.as_tensor(x, dtype=torch.float32)
    if stats.mean is not None:
        t = t - torch.as_tensor(stats.mean, dtype=torch.float32)
    if stats.scale != 1.0:
        t = t / stats.scale
    t = torch.cat([t, torch.ones(len(t), 1)], 1)
    return t.to(device=device, dtype=dtype).contiguous()


def noise_dataset_name(store: Features, cfg: TrainConfig) -> str:
    if cfg.noise_dataset:
        return cfg.noise_dataset
    name = store.info.dataset
    if name == "imagefolder":   # the shared CIFAR-10 copy is an image folder: recognise it by its classes
        names = [c.lower() for c in store.info.class_names]
        if names == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]:
            return "cifar10"
    return name


@dataclass
class Federation:
    parts: list[np.ndarray]
    labels: np.ndarray            # noisy training labels (per client; test labels stay clean)
    counts: np.ndarray            # [K, C] after noise
    realised_noise: float
    stats: FeatureStats


def build_federation(store: Features, cfg: TrainConfig, seed: int, partition: str, pparams: dict) -> Federation:
    C = store.info.num_classes
    parts = create_partition(partition, store.train_y, cfg.clients, seed=seed,
                             features=store.train_x if PARTITIONS[partition].needs_features else None, **pparams)
    client_labels = [store.train_y[p] for p in parts]
    noisy, realised = apply_noise(cfg.noise, cfg.noise_rate, client_labels, C,
                                  dataset=noise_dataset_name(store, cfg), seed=seed, asym_rule=cfg.asym_rule)
    labels = store.train_y.copy()
    for p, yl in zip(parts, noisy):
        labels[p] = yl
    counts = class_counts(parts, labels, C)
    stats = federated_feature_stats(store.train_x, parts, cfg.center, cfg.scale)
    return Federation(parts, labels, counts, realised, stats)


# ---------------------------------------------------------------- the run


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    rows: list[dict]


def validate_config(cfg: TrainConfig, store: Features) -> TrainConfig:
    """Resolve and validate everything before anything is written."""
    cfg = cfg.resolved()
    resolve_head_params(cfg.head, **cfg.head_params)
    resolve_partition_params(cfg.partition, **cfg.partition_params)
    n = len(store.train_y)
    if cfg.clients > n:
        raise FedheadError(f"The '--clients' parameter must be <= the number of training samples ({n}). "
                           f"Got {cfg.clients} instead. Use fewer clients.")
    OptimConfig(name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    if not PARTITIONS[cfg.partition].needs_features:   # cheap: catches shard/dirichlet errors before writing
        create_partition(cfg.partition, store.train_y, cfg.clients, seed=cfg.seeds[0], **cfg.partition_params)
    if cfg.noise != "none":   # catches a missing asymmetric map before the run starts
        apply_noise(cfg.noise, cfg.noise_rate, [store.train_y[:1]], store.info.num_classes,
                    dataset=noise_dataset_name(store, cfg), seed=0, asym_rule=cfg.asym_rule)
    return cfg


def run_training(cfg: TrainConfig, out: str | Path | None = None, resume: bool = False,
                 progress: bool = True, store: Features | None = None, runs_root: str = "runs") -> RunResult:
    store = store or load_store(cfg.features)
    cfg = validate_config(cfg, store)
    device = resolve_device(cfg.device)
    threads = set_cpu_threads() if device.type == "cpu" else None

    run_dir = Path(out) if out else default_run_dir(runs_root, cfg.head, cfg.partition)
    ckpt_path = run_dir / CHECKPOINT
    ckpt = None
    if resume:
        if not ckpt_path.exists():
            if (run_dir / "summary.json").exists() and (run_dir / "config.json").exists():
                ckpt = None   # finished run: re-check the configuration below and report it again
            else:
                raise FedheadError(f"The '--resume' option needs a checkpoint in {str(run_dir)!r}, but none "
                                   "exists. Run without --resume (or name the run with --out).")
        prev = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
        if prev.get("identity") != cfg.identity():
            raise FedheadError(f"The '--resume' option found a run in {str(run_dir)!r} with a different "
                               "configuration. Use the same options as the interrupted run, or a new --out.")
        if ckpt_path.exists():
            ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
            if threads is not None and prev.get("cpu_threads"):
                threads = set_cpu_threads(int(prev["cpu_threads"]))   # the bits of a round follow the count
        else:
            summary = json.loads((run_dir / "summary.json").read_text())
            from .rundir import read_csv
            return RunResult(run_dir, summary, read_csv(run_dir / "rounds.csv"))
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise FedheadError(f"The '--out' parameter names {str(run_dir)!r}, which already holds files. "
                           "Use --resume to continue that run, or choose another --out.")
    run_dir.mkdir(parents=True, exist_ok=True)

    config_record = {"identity": cfg.identity(), "config": cfg.to_dict(),
                     "head_params": resolve_head_params(cfg.head, **cfg.head_params),
                     "partition_params": resolve_partition_params(cfg.partition, **cfg.partition_params),
                     "store": {"path": str(store.info.path), **store.info.attrs,
                               "shapes": {k: list(v) for k, v in store.info.shapes.items()}},
                     "device": str(device), "cpu_threads": threads, "torch_version": torch.__version__,
                     "randomness": "numpy default_rng keyed by (seed, round[, client, epoch]); no global seeding"}
    write_config(run_dir, config_record)

    variants = [("main", cfg.partition, cfg.partition_params)]
    if cfg.iid_reference and cfg.partition != "iid":
        variants.append(("iid", "iid", {}))
    elif cfg.iid_reference:
        variants = [("main", "iid", {})]   # the run is its own IID reference

    rows: list[dict] = list(ckpt["rows"]) if ckpt else []
    done_runs: set = set(map(tuple, ckpt["done_runs"])) if ckpt else set()
    realised: dict = dict(ckpt.get("realised", {})) if ckpt else {}
    client_rows: list = list(ckpt.get("client_rows", [])) if ckpt else []
    wall0 = time.perf_counter() - (ckpt["wall_s"] if ckpt else 0.0)
    head = create_head(cfg.head, **cfg.head_params)
    optim = OptimConfig(name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    local = LocalConfig(epochs=cfg.local_epochs, batch_size=cfg.batch_size)
    C, D = store.info.num_classes, store.train_x.shape[1]
    x_test_raw = store.test_x
    y_test = torch.as_tensor(store.test_y, device=device)

    with make_progress() as prog:
        total_runs = len(cfg.seeds) * len(variants)
        runs_task = prog.add_task("runs", total=total_runs, info="") if total_runs > 1 and progress else None
        for seed in cfg.seeds:
            for vname, part, pparams in variants:
                key = (seed, vname)
                if key in done_runs:
                    if runs_task is not None:
                        prog.advance(runs_task)
                    continue
                fed = build_federation(store, cfg, seed, part, pparams)
                realised[f"{seed}:{vname}"] = fed.realised_noise
                if vname == "main" and not any(r["seed"] == seed for r in client_rows):
                    client_rows.append({"seed": seed, "sizes": [len(p) for p in fed.parts],
                                        "counts": fed.counts.tolist()})
                x = prepare(store.train_x, fed.stats, device)
                xt = prepare(x_test_raw, fed.stats, device)
                data = ClientSet(x=x, y=torch.as_tensor(fed.labels, device=device), parts=fed.parts,
                                 counts=fed.counts, num_classes=C)
                engine = Engine(data, head, optim, local, backend=cfg.backend, block_clients=cfg.block_clients,
                                memory_budget_mb=cfg.memory_budget_mb)
                theta = torch.zeros(C, D + 1, device=device)
                start = 1
                if ckpt is not None and tuple(ckpt["current"]) == key:
                    theta = ckpt["theta"].to(device)
                    start = int(ckpt["round"]) + 1
                head_bytes = theta.numel() * theta.element_size()
                rtask = prog.add_task(f"seed {seed} {vname} {part}", total=cfg.rounds, completed=start - 1,
                                      info="") if progress else None
                for rnd in range(start, cfg.rounds + 1):
                    sel = sample_clients(cfg.clients, cfg.participation, seed, rnd)
                    theta, st = engine.run_round(theta, sel, seed, rnd, cfg.aggregate)
                    evaluate_now = rnd % cfg.eval_every == 0 or rnd == cfg.rounds
                    acc = evaluate(theta, xt, y_test) if evaluate_now else float("nan")
                    extra_up = fed.stats.bytes_up_per_client if rnd == 1 else 0
                    extra_down = fed.stats.bytes_down_per_client if rnd == 1 else 0
                    nsel = len(sel)
                    stats_clients = len(fed.parts) if rnd == 1 else 0
                    rows.append({
                        "seed": seed, "round": rnd, "stage": head.stage(rnd), "accuracy": acc,
                        "train_loss": st.loss_sum / max(1, st.clients),
                        "client_ms": 1000 * st.compute_s / max(1, st.clients),
                        "server_ms": 1000 * st.server_s,
                        "bytes_up_per_client": head_bytes + extra_up,
                        "bytes_total": nsel * 2 * head_bytes + stats_clients * (extra_up + extra_down),
                        "ratio_to_iid": None, "run": vname, "partition": part, "clients_trained": st.clients,
                    })
                    if rtask is not None:
                        prog.update(rtask, advance=1, info=f"acc {acc:.4f}")
                    atomic_torch_save({"identity": cfg.identity(), "current": list(key), "round": rnd,
                                       "theta": theta.cpu(), "rows": rows, "done_runs": [list(k) for k in done_runs],
                                       "realised": realised, "client_rows": client_rows,
                                       "wall_s": time.perf_counter() - wall0,
                                       "rng": "keyed by (seed, round, client, epoch)"}, ckpt_path)
                    write_rounds(run_dir, _with_ratios(rows))
                done_runs.add(key)
                torch.save(theta.cpu(), run_dir / (f"head-seed{seed}.pt" if vname == "main" else f"head-seed{seed}-iid.pt"))
                if runs_task is not None:
                    prog.advance(runs_task)
                if rtask is not None:
                    prog.remove_task(rtask)

    rows = _with_ratios(rows)
    write_rounds(run_dir, rows)
    write_clients_per_seed(run_dir, client_rows)
    summary = summarize(rows, cfg, realised, time.perf_counter() - wall0)
    write_summary(run_dir, summary)
    if ckpt_path.exists():
        ckpt_path.unlink()
    return RunResult(run_dir, summary, rows)


def _with_ratios(rows: list[dict]) -> list[dict]:
    iid = {(r["seed"], r["round"]): r["accuracy"] for r in rows if r.get("run") == "iid"}
    out = []
    for r in rows:
        r = dict(r)
        ref = iid.get((r["seed"], r["round"]))
        if r.get("run") == "main" and ref:
            r["ratio_to_iid"] = r["accuracy"] / ref
        out.append(r)
    return out


def summarize(rows: list[dict], cfg: TrainConfig, realised: dict, wall_s: float) -> dict:
    per_seed = []
    for seed in cfg.seeds:
        main = [r for r in rows if r["seed"] == seed and r["run"] == "main"]
        iid = [r for r in rows if r["seed"] == seed and r["run"] == "iid"]
        accs = [r["accuracy"] for r in main if r["accuracy"] == r["accuracy"]]
        rec = {"seed": seed, "final_accuracy": main[-1]["accuracy"], "best_accuracy": max(accs),
               "acc95_round": acc95_round(accs), "realised_noise_rate": realised.get(f"{seed}:main", 0.0),
               "client_ms": float(np.mean([r["client_ms"] for r in main])),
               "server_ms": float(np.mean([r["server_ms"] for r in main])),
               "bytes_total": int(sum(r["bytes_total"] for r in main))}
        if iid:
            iid_final = iid[-1]["accuracy"]
            rec["iid_final_accuracy"] = iid_final
            rec["final_ratio_to_iid"] = rec["final_accuracy"] / iid_final if iid_final else None
            rec["acc95_round_vs_iid"] = acc95_round(accs, reference=iid_final)
        elif cfg.iid_reference:   # an IID run is its own reference
            rec["iid_final_accuracy"] = rec["final_accuracy"]
            rec["final_ratio_to_iid"] = 1.0
            rec["acc95_round_vs_iid"] = rec["acc95_round"]
        per_seed.append(rec)
    summary = {"head": cfg.head, "partition": cfg.partition, "recipe": cfg.recipe, "seeds": cfg.seeds,
               "rounds": cfg.rounds, "clients": cfg.clients}
    keys = ["final_accuracy", "best_accuracy", "acc95_round", "final_ratio_to_iid", "acc95_round_vs_iid",
            "iid_final_accuracy", "realised_noise_rate", "client_ms", "server_ms", "bytes_total"]
    for k in keys:
        vals = [r.get(k) for r in per_seed]
        if all(v is None for v in vals):
            continue
        m, s = mean_std(vals)
        summary[k] = m
        summary[k + "_std"] = s
    summary["wall_seconds"] = wall_s
    summary["per_seed"] = per_seed
    summary["fedhead_version"] = __version__
    return summary
