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
from fedhead import __version__
from fedhead.core.aggregate import aggregator_of
from fedhead.core.central import central_reference, first_reach
from fedhead.core.closedform import accumulate, is_closed_form, to_prepared
from fedhead.core.dp import epsilon_schedule, feature_clip, summary_fields
from fedhead.core.engine import ClientSet, Engine, LocalConfig, OptimConfig, evaluate
from fedhead.core.heads import create_head, resolve_head_params
from fedhead.core.noise import apply_noise
from fedhead.core.partitions import PARTITIONS, class_counts, create_partition, resolve_partition_params
from fedhead.federation.config import TrainConfig
from fedhead.federation.rundir import (
    acc95_round,
    default_run_dir,
    mean_std,
    write_clients_per_seed,
    write_config,
    write_rounds,
    write_summary,
)
from fedhead.infra.console import make_progress
from fedhead.infra.devices import resolve_device, set_cpu_threads
from fedhead.infra.errors import FedheadError, unknown_name
from fedhead.infra.files import atomic_torch_save, check_out, space_error
from fedhead.infra.locks import exclusive_writer
from fedhead.infra.signals import Interrupted, pause_hook, signals_deferred

CHECKPOINT = "checkpoint.pt"
PAUSE_ENV = "FEDHEAD_TEST_PAUSE_AFTER_ROUNDS"  # test hook "k:FILE": after the k-th round row, pid -> FILE, sleep


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
    bytes_up_per_client: int  # what each client sends for the statistics (once)
    bytes_down_per_client: int


def federated_feature_stats(
    x: np.ndarray, parts: list[np.ndarray], center: bool, scale: str, cfg: TrainConfig | None = None, seed: int = 0
) -> FeatureStats:
    """Each client sends its feature sum, squared-norm sum and count; the server adds them up.

    Costs one extra exchange of ``D + 2`` floats per client (counted in round 1's bytes). With differential
    privacy (``cfg``), each client clips its features to --dp-feature-clip first and the server adds noise to the
    sums (:func:`fedhead.core.dp.noisy_feature_sums`, keyed by ``seed``)."""
    from fedhead.core.dp import feature_clip, noisy_feature_sums
    from fedhead.core.linalg import clip_rows

    if not center and scale == "none":
        return FeatureStats(None, 1.0, 0, 0)
    d = x.shape[1]
    total = np.zeros(d, dtype=np.float64)
    sq, n = 0.0, 0
    clip = feature_clip(cfg) if cfg is not None else None
    for p in parts:
        xp = x[p].astype(np.float64) if clip is None else clip_rows(x[p], clip)
        total += xp.sum(0)
        sq += float((xp * xp).sum())
        n += len(p)
    if cfg is not None:
        total, sq, n = noisy_feature_sums(total, sq, n, cfg, seed)
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
    if name == "imagefolder":  # the shared CIFAR-10 copy is an image folder: recognise it by its classes
        names = [c.lower() for c in store.info.class_names]
        if names == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]:
            return "cifar10"
    return name


@dataclass
class Federation:
    parts: list[np.ndarray]
    labels: np.ndarray  # noisy training labels (per client; test labels stay clean)
    counts: np.ndarray  # [K, C] after noise
    realised_noise: float
    stats: FeatureStats


def build_federation(store: Features, cfg: TrainConfig, seed: int, partition: str, pparams: dict) -> Federation:
    C = store.info.num_classes
    parts = create_partition(
        partition,
        store.train_y,
        cfg.clients,
        seed=seed,
        features=store.train_x if PARTITIONS[partition].needs_features else None,
        **pparams,
    )
    client_labels = [store.train_y[p] for p in parts]
    noisy, realised = apply_noise(
        cfg.noise,
        cfg.noise_rate,
        client_labels,
        C,
        dataset=noise_dataset_name(store, cfg),
        seed=seed,
        asym_rule=cfg.asym_map,
    )
    labels = store.train_y.copy()
    for p, yl in zip(parts, noisy):
        labels[p] = yl
    counts = class_counts(parts, labels, C)
    stats = federated_feature_stats(store.train_x, parts, cfg.center, cfg.scale, cfg, seed)
    return Federation(parts, labels, counts, realised, stats)


# ---------------------------------------------------------------- the run


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    rows: list[dict]


def run(
    cfg: TrainConfig,
    out: str | Path | None = None,
    *,
    resume: bool = False,
    progress: bool = False,
    store: Features | None = None,
) -> RunResult:
    """The Python entry point of ``fedhead train``: run ``cfg`` (every option of the command is a field of
    :class:`TrainConfig`) into ``out`` (default ``runs/<stamp>-<head>-<partition>``) and return the
    :class:`RunResult`: ``summary`` (what summary.json holds) and ``rows`` (rounds.csv, one dict per round)."""
    return run_training(cfg, out=out, resume=resume, progress=progress, store=store)


def validate_config(cfg: TrainConfig, store: Features) -> TrainConfig:
    """Resolve and validate everything before anything is written."""
    cfg = cfg.resolved()
    resolve_device(cfg.device)  # --device cuda without a GPU: refused before anything is written
    resolve_head_params(cfg.head, **cfg.head_params)
    resolve_partition_params(cfg.partition, **cfg.partition_params)
    validate_method(cfg)
    n = len(store.train_y)
    if cfg.clients > n:
        raise FedheadError(
            f"The '--clients' parameter must be <= the number of training samples ({n}). "
            f"Got {cfg.clients} instead. Use fewer clients."
        )
    OptimConfig(name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    if not PARTITIONS[cfg.partition].needs_features:  # cheap: catches shard/dirichlet errors before writing
        create_partition(cfg.partition, store.train_y, cfg.clients, seed=cfg.seeds[0], **cfg.partition_params)
    if cfg.noise != "none":  # catches a missing asymmetric map before the run starts
        apply_noise(
            cfg.noise,
            cfg.noise_rate,
            [store.train_y[:1]],
            store.info.num_classes,
            dataset=noise_dataset_name(store, cfg),
            seed=0,
            asym_rule=cfg.asym_map,
        )
    return cfg


def labels_store(train_y: np.ndarray, class_names: list[str], dataset: str = "") -> Features:
    """A stand-in store that holds only training labels (no features, no test split): enough for
    :func:`validate_config` before the real store exists (``fedhead demo`` and ``fedhead bench flower``
    validate their runs before the slow or written part)."""
    from extract.store import StoreInfo

    y = np.asarray(train_y, dtype=np.int64)
    info = StoreInfo(path=Path(""), attrs={"dataset": dataset}, shapes={}, class_names=list(class_names))
    return Features(
        info=info,
        train_x=np.zeros((len(y), 0), np.float32),
        train_y=y,
        test_x=np.zeros((0, 0), np.float32),
        test_y=np.zeros(0, np.int64),
    )


def validate_method(cfg: TrainConfig) -> None:
    """The method options (closed form, --init, FedProx, SCAFFOLD, server optimiser, CCVR) against the head;
    a closed-form head needs no feature centring (its statistics carry the means), so it is switched off."""
    from fedhead.federation.config import RECIPES

    if is_closed_form(cfg.head) and cfg.init is not None and cfg.init == RECIPES[cfg.recipe].get("init"):
        cfg.init = None  # the recipe's closed-form start does not apply to a closed-form head
    if is_closed_form(cfg.head):
        for flag, given in (
            ("--init", cfg.init),
            ("--prox-mu", cfg.prox_mu),
            ("--scaffold", cfg.scaffold),
            ("--server-opt", cfg.server_opt != "fedavg" and cfg.server_opt),
            ("--calibrate", cfg.calibrate != "none" and cfg.calibrate),
        ):
            if given:
                raise FedheadError(
                    f"The '{flag}' parameter does not apply to the closed-form head {cfg.head!r} "
                    f"(solved once from statistics, no local training). Got {given!r} instead. "
                    "Drop it, or choose an iterative head (softmax, ova, ova2, ...)."
                )
        cfg.center, cfg.scale = False, "none"
    if cfg.scaffold and cfg.optimizer != "sgd":
        raise FedheadError(
            f"The '--scaffold' option needs --optimizer sgd: its control variates estimate each "
            f"client's mean gradient from SGD steps. Got --optimizer {cfg.optimizer!r} instead. "
            "Use --optimizer sgd (the default recipe)."
        )
    if cfg.init is not None and not is_closed_form(cfg.init):
        from fedhead.core.closedform import closed_form_names

        raise unknown_name("--init", cfg.init, closed_form_names(), "closed-form head")
    if cfg.init is not None:
        resolve_head_params(cfg.init, **cfg.head_params)
    if cfg.server_opt != "fedavg" or any(
        v is not None for v in (cfg.server_lr, cfg.server_momentum, cfg.server_betas, cfg.server_tau)
    ):
        from fedhead.core.serveropt import ServerOptConfig

        ServerOptConfig(
            name=cfg.server_opt,
            lr=cfg.server_lr,
            momentum=cfg.server_momentum,
            betas=cfg.server_betas,
            tau=cfg.server_tau,
        ).resolved()


def run_training(
    cfg: TrainConfig,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    store: Features | None = None,
    runs_root: str = "runs",
    central_cache: dict | None = None,
) -> RunResult:
    """Run (or resume) ``cfg`` into ``out``. ``central_cache``: a dict shared by several runs (a bench report)
    that keeps each centralised ceiling, computed once per head, feature preparation and training labels."""
    store = store or load_store(cfg.features)
    cfg = validate_config(cfg, store)
    run_dir = Path(out) if out else default_run_dir(runs_root, cfg.head, cfg.partition)
    check_out(run_dir, kind="dir")  # a file there, or below a file: one line, nothing written
    with exclusive_writer(run_dir, f"the run directory {str(run_dir)!r}"):
        try:
            return _run_locked(cfg, run_dir, resume, progress, store, central_cache)
        except Interrupted as exc:
            raise Interrupted(
                exc.signum,
                f"interrupted; the checkpoint in {str(run_dir)!r} is consistent: re-run "
                f"the same command with --resume --out {run_dir} to continue",
            ) from None
        except OSError as exc:
            err = space_error(exc, f"in {str(run_dir)!r}", f"re-run the same command with --resume --out {run_dir}")
            if err is None:
                raise
            raise err from None


def _run_locked(
    cfg: TrainConfig, run_dir: Path, resume: bool, progress: bool, store: Features, central_cache: dict | None
) -> RunResult:
    device = resolve_device(cfg.device)
    threads = set_cpu_threads() if device.type == "cpu" else None
    ckpt_path = run_dir / CHECKPOINT
    ckpt = None
    # stopped before its first round was saved (only config.json there): --resume starts it afresh
    unstarted = resume and run_dir.exists() and {p.name for p in run_dir.iterdir()} == {"config.json"}
    if unstarted:
        prev = json.loads((run_dir / "config.json").read_text())
        if prev.get("identity") != cfg.identity():
            raise FedheadError(
                f"The '--resume' option found a run in {str(run_dir)!r} with a different "
                "configuration. Use the same options as the interrupted run, or a new --out."
            )
    elif resume:
        if not ckpt_path.exists():
            if (run_dir / "summary.json").exists() and (run_dir / "config.json").exists():
                ckpt = None  # finished run: re-check the configuration below and report it again
            else:
                raise FedheadError(
                    f"The '--resume' option needs a checkpoint in {str(run_dir)!r}, but none "
                    "exists. Run without --resume (or name the run with --out)."
                )
        prev = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
        if prev.get("identity") != cfg.identity():
            raise FedheadError(
                f"The '--resume' option found a run in {str(run_dir)!r} with a different "
                "configuration. Use the same options as the interrupted run, or a new --out."
            )
        if ckpt_path.exists():
            ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
            if threads is not None and prev.get("cpu_threads"):
                threads = set_cpu_threads(int(prev["cpu_threads"]))  # the bits of a round follow the count
        else:
            summary = json.loads((run_dir / "summary.json").read_text())
            from fedhead.federation.rundir import read_csv

            return RunResult(run_dir, summary, read_csv(run_dir / "rounds.csv"))
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise FedheadError(
            f"The '--out' parameter names {str(run_dir)!r}, which already holds files. "
            "Use --resume to continue that run, or choose another --out."
        )
    run_dir.mkdir(parents=True, exist_ok=True)

    config_record = {
        "identity": cfg.identity(),
        "config": cfg.to_dict(),
        "head_params": resolve_head_params(cfg.head, **cfg.head_params),
        "partition_params": resolve_partition_params(cfg.partition, **cfg.partition_params),
        "store": {
            "path": str(store.info.path),
            **store.info.attrs,
            "shapes": {k: list(v) for k, v in store.info.shapes.items()},
        },
        "device": str(device),
        "cpu_threads": threads,
        "torch_version": torch.__version__,
        "randomness": "numpy default_rng keyed by (seed, round[, client, epoch]); no global seeding",
    }
    write_config(run_dir, config_record)

    variants = [("main", cfg.partition, cfg.partition_params)]
    if cfg.iid_reference and cfg.partition != "iid":
        variants.append(("iid", "iid", {}))
    elif cfg.iid_reference:
        variants = [("main", "iid", {})]  # the run is its own IID reference

    rows: list[dict] = list(ckpt["rows"]) if ckpt else []
    done_runs: set = set(map(tuple, ckpt["done_runs"])) if ckpt else set()
    realised: dict = dict(ckpt.get("realised", {})) if ckpt else {}
    client_rows: list = list(ckpt.get("client_rows", [])) if ckpt else []
    central: dict = dict(ckpt.get("central", {})) if ckpt else {}
    wall0 = time.perf_counter() - (ckpt["wall_s"] if ckpt else 0.0)
    head = create_head(cfg.head, **cfg.head_params)
    solver = (
        create_head(cfg.head if is_closed_form(cfg.head) else cfg.init, **cfg.head_params)
        if (is_closed_form(cfg.head) or cfg.init)
        else None
    )
    last_round = 1 if is_closed_form(cfg.head) else cfg.rounds
    privacy = epsilon_schedule(cfg, last_round)  # DP: epsilon per round ({} without DP)
    optim = OptimConfig(name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    local = LocalConfig(epochs=cfg.local_epochs, batch_size=cfg.batch_size, steps=cfg.local_steps)
    C, D = store.info.num_classes, store.train_x.shape[1]
    x_test_raw = store.test_x
    y_test = torch.as_tensor(store.test_y, device=device)
    raw_train = torch.as_tensor(store.train_x, dtype=torch.float32)
    raw_test = torch.as_tensor(store.test_x, dtype=torch.float32)

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
                    client_rows.append(
                        {"seed": seed, "sizes": [len(p) for p in fed.parts], "counts": fed.counts.tolist()}
                    )
                x = prepare(store.train_x, fed.stats, device)
                xt = prepare(x_test_raw, fed.stats, device)
                labels = torch.as_tensor(fed.labels, device=device)
                if cfg.central_reference and vname == "main" and str(seed) not in central:
                    ckey = _central_key(store, cfg, fed)
                    if central_cache is None or ckey not in central_cache:
                        ref = central_reference(
                            head,
                            x_prepared=x,
                            x_raw=raw_train,
                            y=labels,
                            x_test_prepared=xt,
                            x_test_raw=raw_test,
                            y_test=y_test.cpu(),
                            num_classes=C,
                            weight_decay=cfg.weight_decay,
                        )
                        found = {"accuracy": ref.accuracy, "iterations": ref.iterations}
                        if central_cache is not None:
                            central_cache[ckey] = found
                    central[str(seed)] = dict(central_cache[ckey]) if central_cache is not None else found
                data = ClientSet(x=x, y=labels, parts=fed.parts, counts=fed.counts, num_classes=C)
                engine = (
                    None
                    if is_closed_form(cfg.head)
                    else Engine(
                        data,
                        head,
                        optim,
                        local,
                        backend=cfg.backend,
                        block_clients=cfg.block_clients,
                        memory_budget_mb=cfg.memory_budget_mb,
                    )
                )
                server = ServerUpdate(cfg, (C, D + 1), device)
                theta = torch.zeros(C, D + 1, device=device)
                start = 1
                if ckpt is not None and tuple(ckpt["current"]) == key:
                    theta = ckpt["theta"].to(device)
                    start = int(ckpt["round"]) + 1
                    server.load_state_dict(ckpt.get("server", {}), device)
                head_bytes = theta.numel() * theta.element_size()
                msg_bytes = aggregator_of(cfg).nbytes(theta)
                rtask = (
                    prog.add_task(f"seed {seed} {vname} {part}", total=last_round, completed=start - 1, info="")
                    if progress
                    else None
                )
                for rnd in range(start, last_round + 1):
                    sel = sample_clients(cfg.clients, cfg.participation, seed, rnd)
                    nsel = len(sel)
                    extra_up = fed.stats.bytes_up_per_client if rnd == 1 else 0
                    extra_down = fed.stats.bytes_down_per_client if rnd == 1 else 0
                    stats_bytes = len(fed.parts) * (extra_up + extra_down) if rnd == 1 else 0
                    if solver is not None and rnd == 1:
                        # the statistics exchange: clients send sufficient statistics once, the server solves
                        t0 = time.perf_counter()
                        sacc = accumulate(
                            raw_train,
                            torch.as_tensor(fed.labels),
                            [fed.parts[k] for k in sel],
                            C,
                            gram=solver.needs_gram,
                            cof=solver.needs_client_means,
                            per_client=cfg.backend == "loop",
                            clip=feature_clip(cfg),
                        )
                        t1 = time.perf_counter()
                        theta = solve_statistics(solver, sacc, cfg, fed.stats, device, seed=seed)
                        row = statistics_row(
                            sacc, t1 - t0, time.perf_counter() - t1, cfg, nsel, head_bytes, extra_up, stats_bytes
                        )
                    else:
                        prev = theta
                        theta, st = engine.run_round(
                            theta, sel, seed, rnd, aggregator_of(cfg), **server.engine_kwargs()
                        )
                        t0 = time.perf_counter()
                        theta = server.step(prev, theta)
                        server_s = st.server_s + time.perf_counter() - t0
                        down = server.transfer_multiplier() * head_bytes  # SCAFFOLD's c travels too
                        up = down - head_bytes + msg_bytes  # the rule's message (+ c_k delta)
                        row = {
                            "stage": head.stage(rnd),
                            "train_loss": st.loss_sum / max(1, st.clients),
                            "client_ms": 1000 * st.compute_s / max(1, st.clients),
                            "server_ms": 1000 * server_s,
                            "bytes_up_per_client": up + extra_up,
                            "bytes_total": nsel * (up + down) + stats_bytes,
                            "clients_trained": st.clients,
                        }
                    evaluate_now = rnd % cfg.eval_every == 0 or rnd == last_round
                    acc = (
                        evaluate(theta, xt if not is_closed_form(cfg.head) else _with_ones(raw_test, device), y_test)
                        if evaluate_now
                        else float("nan")
                    )
                    rows.append(
                        {
                            "seed": seed,
                            "round": rnd,
                            "accuracy": acc,
                            **row,
                            "ratio_to_iid": None,
                            "run": vname,
                            "partition": part,
                            **privacy.get(rnd, {}),
                        }
                    )
                    if rtask is not None:
                        prog.update(rtask, advance=1, info=f"acc {acc:.4f}")
                    with signals_deferred():  # the checkpoint and rounds.csv move together
                        atomic_torch_save(
                            {
                                "identity": cfg.identity(),
                                "current": list(key),
                                "round": rnd,
                                "theta": theta.cpu(),
                                "rows": rows,
                                "done_runs": [list(k) for k in done_runs],
                                "realised": realised,
                                "client_rows": client_rows,
                                "central": central,
                                "server": server.state_dict(),
                                "wall_s": time.perf_counter() - wall0,
                                "rng": "keyed by (seed, round, client, epoch)",
                            },
                            ckpt_path,
                        )
                        write_rounds(run_dir, _with_ratios(rows, central))
                    pause_hook(PAUSE_ENV, len(rows))
                if cfg.calibrate == "ccvr":
                    theta, crow = ccvr_round(
                        head, theta, x, fed.labels, fed.parts, C, cfg, seed, xt, y_test, last_round + 1
                    )
                    rows.append({"seed": seed, **crow, "run": vname, "partition": part})
                    write_rounds(run_dir, _with_ratios(rows, central))
                done_runs.add(key)
                torch.save(
                    theta.cpu(), run_dir / (f"head-seed{seed}.pt" if vname == "main" else f"head-seed{seed}-iid.pt")
                )
                if runs_task is not None:
                    prog.advance(runs_task)
                if rtask is not None:
                    prog.remove_task(rtask)

    rows = _with_ratios(rows, central)
    write_rounds(run_dir, rows)
    write_clients_per_seed(run_dir, client_rows)
    summary = summarize(rows, cfg, realised, time.perf_counter() - wall0, central)
    write_summary(run_dir, summary)
    if ckpt_path.exists():
        ckpt_path.unlink()
    return RunResult(run_dir, summary, rows)


def _central_key(store: Features, cfg: TrainConfig, fed: Federation) -> str:
    """What the centralised ceiling depends on: store, head and its parameters, feature preparation,
    regularisation and the (possibly noisy) training labels."""
    import hashlib

    h = hashlib.sha256(np.ascontiguousarray(fed.labels).tobytes())
    h.update(
        json.dumps(
            [
                str(store.info.path),
                cfg.head,
                resolve_head_params(cfg.head, **cfg.head_params),
                cfg.center,
                cfg.scale,
                cfg.weight_decay,
            ],
            sort_keys=True,
            default=str,
        ).encode()
    )
    return h.hexdigest()


def _with_ones(x: torch.Tensor, device) -> torch.Tensor:
    return torch.cat([x, torch.ones(len(x), 1)], 1).to(device)


# ---------------------------------------------------------------- the statistics exchange, server updates, CCVR


INIT_SCALE = {"ncm": 1.0, "ridge": 10.0, "cof": 1.0, "lda": 1.0}  # measured, see README "Baselines"


def solve_statistics(
    solver, acc, cfg: TrainConfig, stats: FeatureStats, device, seed: int | None = None
) -> torch.Tensor:
    """The server's solve after the statistics exchange: a closed-form head on raw features, or an ``--init``
    head mapped to the run's prepared features and multiplied by the init scale. With differential privacy the
    summed statistics get their noise here first (:func:`fedhead.core.dp.privatize_statistics`, keyed by ``seed``)."""
    from fedhead.core.dp import enabled, privatize_statistics

    if enabled(cfg):
        if seed is None:
            raise FedheadError("solve_statistics needs the run's seed to draw the DP noise of the statistics.")
        privatize_statistics(acc, cfg, seed)
    theta = solver.solve(acc)
    if not is_closed_form(cfg.head):
        scale = cfg.init_scale if cfg.init_scale is not None else INIT_SCALE[solver.name]
        theta = to_prepared(theta, stats.mean, stats.scale) * scale
    return theta.to(device=device, dtype=torch.float32)


def statistics_row(
    acc, client_s: float, server_s: float, cfg: TrainConfig, nsel: int, head_bytes: int, extra_up: int, stats_bytes: int
) -> dict:
    """The round-1 row of a statistics exchange (the simulator's and the Flower server's)."""
    # a closed-form head is sent back once; an --init head goes down with round 2
    down = nsel * head_bytes if is_closed_form(cfg.head) else 0
    return {
        "stage": "statistics",
        "train_loss": float("nan"),
        "client_ms": 1000 * client_s / max(1, acc.clients),
        "server_ms": 1000 * server_s,
        "bytes_up_per_client": acc.bytes_up / max(1, acc.clients) + extra_up,
        "bytes_total": acc.bytes_up + down + stats_bytes,
        "clients_trained": acc.clients,
    }


class ServerUpdate:
    """What the server does with a round's aggregate beyond FedAvg: a server optimiser (FedAvgM, FedAdam, ...)
    and SCAFFOLD's control variates; plus what the engine needs from it (FedProx's mu, the variates)."""

    def __init__(self, cfg: TrainConfig, shape: tuple, device):
        self.cfg = cfg
        self.opt = None
        if cfg.server_opt != "fedavg":
            from fedhead.core.serveropt import ServerOptConfig, ServerOptimizer

            scfg = ServerOptConfig(
                name=cfg.server_opt,
                lr=cfg.server_lr,
                momentum=cfg.server_momentum,
                betas=cfg.server_betas,
                tau=cfg.server_tau,
            ).resolved()
            self.opt = ServerOptimizer(scfg, shape, device)
        self.scaffold = None
        if cfg.scaffold:
            from fedhead.core.engine import ScaffoldState

            self.scaffold = ScaffoldState.zeros(cfg.clients, shape[0], shape[1], device)

    def engine_kwargs(self) -> dict:
        kw = {}
        if self.cfg.prox_mu:
            kw["prox_mu"] = self.cfg.prox_mu
        if self.scaffold is not None:
            kw["scaffold"] = self.scaffold
        return kw

    def step(self, previous: torch.Tensor, aggregated: torch.Tensor) -> torch.Tensor:
        return aggregated if self.opt is None else self.opt.step(previous, aggregated)

    def transfer_multiplier(self) -> int:
        """Heads' worth of numbers each way per client and round (SCAFFOLD's variates travel with the head)."""
        return 2 if self.scaffold is not None else 1

    def state_dict(self) -> dict:
        return {
            "opt": self.opt.state_dict() if self.opt is not None else None,
            "scaffold": self.scaffold.state_dict() if self.scaffold is not None else None,
        }

    def load_state_dict(self, d: dict, device) -> None:
        if self.opt is not None and d.get("opt") is not None:
            self.opt.load_state_dict(d["opt"])
        if self.scaffold is not None and d.get("scaffold") is not None:
            self.scaffold.load_state_dict(d["scaffold"])


def ccvr_round(
    head,
    theta: torch.Tensor,
    x: torch.Tensor,
    labels: np.ndarray,
    parts: list[np.ndarray],
    num_classes: int,
    cfg: TrainConfig,
    seed: int,
    xt: torch.Tensor,
    y_test: torch.Tensor,
    rnd: int,
):
    """CCVR after the last round: every client sends per-class means, covariances and counts of its (prepared)
    features once (:func:`ccvr_client_stats`); the server pools them in client order, samples virtual features
    and retrains the head on them (:func:`ccvr_calibrate`). The Flower strategy runs the same two halves."""
    from fedhead.core.ccvr import PooledStats

    t0 = time.perf_counter()
    pooled = PooledStats(num_classes, x.shape[1] - 1)
    up = 0
    for p in parts:
        if len(p):
            cs = ccvr_client_stats(x, labels, p, num_classes)
            up += cs.nbytes()
            pooled.add(cs)
    return ccvr_calibrate(head, theta, pooled, cfg, seed, xt, y_test, rnd, len(parts), up, time.perf_counter() - t0)


def ccvr_client_stats(x: torch.Tensor, labels: np.ndarray, part: np.ndarray, num_classes: int):
    """CCVR's client half: the :class:`fedhead.core.ccvr.ClassStats` one client sends, of its samples ``part`` of the
    prepared features ``x [N, D+1]`` (the trailing 1 dropped) with their (possibly noisy) ``labels [N]``."""
    from fedhead.core.ccvr import client_class_stats

    idx = torch.as_tensor(np.asarray(part, dtype=np.int64), device=x.device)
    return client_class_stats(x.index_select(0, idx)[:, :-1], np.asarray(labels)[part], num_classes)


def ccvr_calibrate(
    head,
    theta: torch.Tensor,
    pooled,
    cfg: TrainConfig,
    seed: int,
    xt: torch.Tensor,
    y_test: torch.Tensor,
    rnd: int,
    num_clients: int,
    bytes_up: int,
    client_s: float,
):
    """CCVR's server half: ``pooled`` (a :class:`fedhead.core.ccvr.PooledStats` holding the statistics of all
    ``num_clients`` clients, ``bytes_up`` bytes in all, ``client_s`` seconds to compute them) gives the virtual
    features the head is retrained on; returns the new head and the ``ccvr`` row of rounds.csv (round ``rnd``)."""
    from fedhead.core.ccvr import retrain_head, sample_virtual

    t1 = time.perf_counter()
    counts, means, covs = pooled.finish()
    xv, yv = sample_virtual(counts, means, covs, cfg.ccvr_samples, seed)
    xv_t = torch.cat([torch.as_tensor(xv), torch.ones(len(xv), 1)], 1).to(theta.device)
    new = retrain_head(theta, head, xv_t, torch.as_tensor(yv, device=theta.device), seed=seed)
    t2 = time.perf_counter()
    acc = evaluate(new, xt, y_test)
    k = num_clients
    return new, {
        "round": rnd,
        "stage": "ccvr",
        "accuracy": acc,
        "train_loss": float("nan"),
        "client_ms": 1000 * client_s / max(1, k),
        "server_ms": 1000 * (t2 - t1),
        "bytes_up_per_client": bytes_up / max(1, k),
        "bytes_total": bytes_up + k * theta.numel() * theta.element_size(),
        "ratio_to_iid": None,
        "clients_trained": 0,
    }


def _with_ratios(rows: list[dict], central: dict | None = None) -> list[dict]:
    iid = {(r["seed"], r["round"]): r["accuracy"] for r in rows if r.get("run") == "iid"}
    out = []
    for r in rows:
        r = dict(r)
        ref = iid.get((r["seed"], r["round"]))
        if r.get("run") == "main" and ref:
            r["ratio_to_iid"] = r["accuracy"] / ref
        c = (central or {}).get(str(r["seed"]))
        if c and r.get("run") == "main" and c["accuracy"]:
            r["ratio_to_central"] = r["accuracy"] / c["accuracy"]
        out.append(r)
    return out


def summarize(rows: list[dict], cfg: TrainConfig, realised: dict, wall_s: float, central: dict | None = None) -> dict:
    per_seed = []
    for seed in cfg.seeds:
        main = [r for r in rows if r["seed"] == seed and r["run"] == "main"]
        iid = [r for r in rows if r["seed"] == seed and r["run"] == "iid"]
        accs = [r["accuracy"] for r in main if r["accuracy"] == r["accuracy"]]
        rec = {
            "seed": seed,
            "final_accuracy": main[-1]["accuracy"],
            "best_accuracy": max(accs),
            "acc95_round": acc95_round(accs),
            "realised_noise_rate": realised.get(f"{seed}:main", 0.0),
            "client_ms": float(np.mean([r["client_ms"] for r in main])),
            "server_ms": float(np.mean([r["server_ms"] for r in main])),
            "bytes_total": int(sum(r["bytes_total"] for r in main)),
        }
        if iid:
            iid_final = iid[-1]["accuracy"]
            rec["iid_final_accuracy"] = iid_final
            rec["final_ratio_to_iid"] = rec["final_accuracy"] / iid_final if iid_final else None
            rec["acc95_round_vs_iid"] = acc95_round(accs, reference=iid_final)
        elif cfg.iid_reference:  # an IID run is its own reference
            rec["iid_final_accuracy"] = rec["final_accuracy"]
            rec["final_ratio_to_iid"] = 1.0
            rec["acc95_round_vs_iid"] = rec["acc95_round"]
        c = (central or {}).get(str(seed))
        if c:
            rec["central_accuracy"] = c["accuracy"]
            rec["final_ratio_to_central"] = rec["final_accuracy"] / c["accuracy"] if c["accuracy"] else None
            rec["rounds_to_99_central"], rec["mb_per_client_to_99_central"] = first_reach(main, 0.99 * c["accuracy"])
        if main[-1].get("stage") == "ccvr" and len(main) > 1:
            rec["uncalibrated_accuracy"] = main[-2]["accuracy"]
        rec["mb_per_client"] = float(sum(r["bytes_up_per_client"] for r in main)) / 1e6
        per_seed.append(rec)
    summary = {
        "head": cfg.head,
        "partition": cfg.partition,
        "recipe": cfg.recipe,
        "seeds": cfg.seeds,
        "rounds": 1 if is_closed_form(cfg.head) else cfg.rounds,
        "clients": cfg.clients,
    }
    keys = [
        "final_accuracy",
        "best_accuracy",
        "acc95_round",
        "final_ratio_to_iid",
        "acc95_round_vs_iid",
        "iid_final_accuracy",
        "realised_noise_rate",
        "client_ms",
        "server_ms",
        "bytes_total",
        "central_accuracy",
        "final_ratio_to_central",
        "rounds_to_99_central",
        "mb_per_client_to_99_central",
        "uncalibrated_accuracy",
        "mb_per_client",
    ]
    for k in keys:
        vals = [r.get(k) for r in per_seed]
        if all(v is None for v in vals):
            continue
        m, s = mean_std(vals)
        summary[k] = m
        summary[k + "_std"] = s
    summary.update(summary_fields(cfg, epsilon_schedule(cfg, summary["rounds"])))  # DP: final epsilon, delta
    summary["wall_seconds"] = wall_s
    summary["per_seed"] = per_seed
    summary["fedhead_version"] = __version__
    return summary
