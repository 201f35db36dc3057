"""``fedhead bench speed``: the trainer against the machine's limits and against a per-client loop, in one run.

Every trainer configuration runs in its own subprocess (so its peak RSS is its own) on synthetic features of
the requested size (speed does not depend on the values): ``shard`` partition with 2 shards per client, the
``ova2`` head, AdamW (``paper`` recipe), 3 local epochs, batch 50. Each subprocess first measures the machine
(dense float32 matmul FLOP/s and memory copy bandwidth) with the same thread count, then warms up with round 1
(OvA-LP stage 1) and times rounds ``2..rounds+1`` (stage 2, the common case).

Counts, per round (padding excluded): matmul FLOPs ``4 * C * (D+1) * E * N`` (forward logits and weight
gradient ``G^T X``; the loss and the optimizer are not counted), optimizer bytes ``client_steps * C * (D+1) *
4 * 7`` for AdamW (reads W, G, m, v; writes W, m, v) or ``* 5`` for SGD with momentum. One extra round runs
under torch.profiler to split the time into matmul, optimizer, batch gather and loss/other.

The scratch engine (``fedhead scratch``, CPU): for each of ``cnn``, ``fedabc-mlp``, ``fedabc-convnet``, ``vgg9`` and
``kws-cnn`` a subprocess times local training at the runner's protocol for that model (members per round, batch,
optimizer: :data:`SCRATCH_PROTOCOLS`) with the engine and with its loop backend, interleaved, and reports
training samples/s and useful GFLOP/s (FLOPs of one sample's forward + backward counted by
``torch.utils.flop_counter.FlopCounterMode``: convolutions and matrix products) against the same thread count's
dense float32 matmul, through torch.mm (MKL) and through oneDNN.

The record ``speed.json`` has flat prefixed keys (``trainer_*``, ``machine_*``, ``loop_*``, ``scale_*``,
``extract_*``, ``scratch_<model>_*``); the rich tables on stdout show the same numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from extract.bench import measure_extraction, measure_processes
from extract.encoders import registry_weights
from extract.store import open_store
from fedhead.bench.ceiling import CEILING_METHODS, ceiling_table, measure_ceiling
from fedhead.core.closedform import StatsAccumulator, accumulate, client_stats
from fedhead.core.engine import ClientSet, Engine, LocalConfig, OptimConfig, _fused_available, accuracy_and_loss
from fedhead.core.heads import create_head
from fedhead.core.partitions import class_counts, create_partition
from fedhead.federation.train import PAUSE_ENV  # test hook: pause after the k-th job
from fedhead.infra.console import stderr_console, stdout_console
from fedhead.infra.devices import DENORMALS_ENV, flush_denormals, keep_freed_memory, resolve_device, set_cpu_threads
from fedhead.infra.errors import FedheadError, Interval, OneOf, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_json, atomic_write_text, check_out
from fedhead.infra.signals import pause_hook
from fedhead.scratch import engine as E
from fedhead.scratch.finetune import finetune_speed
from fedhead.scratch.models import create_model
from fedhead.scratch.runner import ALGO_DEFAULTS, FEDABC_LR

PAPER = dict(samples=50_000, dim=1024, classes=100, epochs=3, batch=50)
QUICK = dict(samples=4_000, dim=128, classes=20, epochs=3, batch=50)


# ---------------------------------------------------------------- machine limits


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best_time(fn, dev, repeat: int, min_s: float = 0.2) -> float:
    """Smallest wall time of ``fn`` over ``repeat`` timed calls (after one warm-up); noisy machines favour min."""
    fn()
    _sync(dev)
    best = float("inf")
    t_end = time.perf_counter() + min_s
    n = 0
    while n < repeat or time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t)
        n += 1
        if n >= 4 * repeat:
            break
    return best


def machine_limits(dev, quick: bool = False) -> dict:
    """Dense float32 (and float64) matmul GFLOP/s and memory copy GB/s (bytes read + written) on ``dev``."""
    import torch

    n = 1024 if quick else 2048
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    t_mm = _best_time(lambda: torch.mm(a, b), dev, 3)
    a64, b64 = a.double(), b.double()  # the statistics exchange sums in float64
    t_mm64 = _best_time(lambda: torch.mm(a64, b64), dev, 2)

    m = (8 if quick else 64) * 2**20 // 4  # 64 MB: far beyond the caches
    x = torch.randn(m, device=dev)
    y = torch.empty_like(x)
    t_cp = _best_time(lambda: y.copy_(x), dev, 5)
    return {
        "machine_matmul_gflops": 2 * n**3 / t_mm / 1e9,
        "machine_matmul64_gflops": 2 * n**3 / t_mm64 / 1e9,
        "machine_copy_gb_per_s": 2 * m * 4 / t_cp / 1e9,
        "machine_matmul_size": n,
        "machine_copy_mb": m * 4 / 2**20,
    }


def onednn_matmul_gflops(quick: bool = False) -> float:
    """The same dense float32 product as :func:`machine_limits` through oneDNN (``mkldnn_linear``), the library
    behind PyTorch's CPU convolutions; 0 where it does not run. ``torch.mm`` goes through MKL, which on some CPUs
    (AMD EPYC here) runs far below what oneDNN's kernels reach on the same core."""
    import torch

    n = 1024 if quick else 2048
    try:
        a, b = torch.randn(n, n).to_mkldnn(), torch.randn(n, n).to_mkldnn()
        t = _best_time(lambda: torch._C._nn.mkldnn_linear(a, b, None), torch.device("cpu"), 3)
    except (AttributeError, RuntimeError, NotImplementedError):
        return 0.0
    return 2 * n**3 / t / 1e9


# ---------------------------------------------------------------- one trainer configuration (child process)


def _federation(clients: int, samples: int, dim: int, classes: int, device, seed: int = 0):
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.empty(samples, dim + 1)
    x[:, :dim] = torch.randn(samples, dim, generator=g).abs_()  # non-negative like pooled features
    x[:, dim] = 1.0
    y = np.arange(samples) % classes
    parts = create_partition("shard", y, clients, seed=seed, shards_per_client=2)
    counts = class_counts(parts, y, classes)
    return ClientSet(
        x=x.to(device), y=torch.as_tensor(y, device=device), parts=parts, counts=counts, num_classes=classes
    )


def _profile_split(engine, theta, sel, rnd, dev) -> dict:
    """Seconds of one round by kind of work, from torch.profiler's self times."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        engine.run_round(theta, sel, 0, rnd, "fedavg")
        _sync(dev)
    split = {"matmul": 0.0, "optimizer": 0.0, "gather": 0.0, "loss_other": 0.0}
    for ev in prof.key_averages():
        us = ev.self_device_time_total if dev.type == "cuda" else ev.self_cpu_time_total
        name = ev.key
        if name in ("aten::bmm", "aten::mm", "aten::matmul", "aten::addmm") or "gemm" in name.lower():
            split["matmul"] += us
        elif "fused_adam" in name or "fused_sgd" in name:
            split["optimizer"] += us
        elif name in ("aten::index_select", "aten::index"):
            split["gather"] += us
        elif name.startswith("aten::") or dev.type == "cuda":
            split["loss_other"] += us
    total = sum(split.values()) or 1.0
    out = {f"profile_{k}_s": v / 1e6 for k, v in split.items()}
    out.update({f"profile_{k}_fraction": v / total for k, v in split.items()})
    return out


def run_config(cfg: dict) -> dict:
    """Time one trainer configuration in this process; the record keys are unprefixed."""
    import numpy as np
    import torch

    dev = resolve_device(cfg["device"])
    threads = set_cpu_threads(cfg.get("threads"))
    rec = {"threads": threads, "device": str(dev), "denormals_flushed": dev.type == "cpu" and flush_denormals()}
    rec["malloc_keeps_freed"] = dev.type == "cpu" and keep_freed_memory()
    if cfg.get("machine"):
        rec.update(machine_limits(dev, cfg.get("quick", False)))
    K, C, D, E, B = cfg["clients"], cfg["classes"], cfg["dim"], cfg["epochs"], cfg["batch"]
    data = _federation(K, cfg["samples"], D, C, dev)
    head = create_head("ova2")
    optim = OptimConfig(name=cfg.get("optimizer", "adamw"))
    sel = np.arange(K)
    theta0 = torch.zeros(C, D + 1, device=dev)
    sizes = np.array([len(p) for p in data.parts])
    client_steps = int(E * (-(-sizes // B)).sum())
    flops = 4 * C * (D + 1) * E * int(sizes.sum())
    opt_bytes = client_steps * C * (D + 1) * 4 * (7 if optim.name == "adamw" else 5)
    rec.update(
        clients=K,
        classes=C,
        dim=D,
        samples=int(sizes.sum()),
        client_steps=client_steps,
        matmul_gflop_per_round=flops / 1e9,
        optimizer_gb_per_round=opt_bytes / 1e9,
    )

    def timed(engine, rounds):
        theta, _ = engine.run_round(theta0, sel, 0, 1, "fedavg")  # warm-up (stage 1)
        _sync(dev)
        times = []
        for r in range(2, 2 + rounds):
            t = time.perf_counter()
            theta, _ = engine.run_round(theta, sel, 0, r, "fedavg")
            _sync(dev)
            times.append(time.perf_counter() - t)
        return theta, times

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    eng = Engine(data, head, optim, LocalConfig(E, B), backend="vectorized")
    theta, times = timed(eng, cfg["rounds"])
    rec.update(
        s_per_round=float(np.median(times)),
        s_per_round_min=min(times),
        rounds_timed=len(times),
        block_clients=eng.block_clients,
        tile_clients=eng.tile_clients or eng.block_clients,
        fused_optimizer=bool(eng.fused if eng.fused is not None else _fused_available(optim.name, dev)),
        closed_form_loss=eng.closed_form,
    )
    # the validation part's evaluation every round (issue 36): accuracy and loss of the new head on a seeded 10% of
    # the samples (what --val-fraction 0.1 holds out), against the round it follows
    vi = torch.as_tensor(np.random.default_rng(0).permutation(int(sizes.sum()))[: int(sizes.sum()) // 10])
    xv, yv = data.x[vi.to(dev)], data.y[vi.to(dev)]
    val_times = []
    for _ in range(6):  # the first warms up; the median of the others, like the rounds'
        t = time.perf_counter()
        accuracy_and_loss(theta, xv, yv)
        _sync(dev)
        val_times.append(time.perf_counter() - t)
    rec["val_eval_s"] = float(np.median(val_times[1:]))
    rec["val_eval_fraction"] = rec["val_eval_s"] / rec["s_per_round"]
    rec["matmul_gflops"] = flops / rec["s_per_round"] / 1e9
    rec["optimizer_gb_per_s"] = opt_bytes / rec["s_per_round"] / 1e9
    if cfg.get("profile") and eng.closed_form:
        # the head's closed-form loss gradient against autograd on its loss, same rounds
        auto = Engine(data, head, optim, LocalConfig(E, B), backend="vectorized", closed_form=False)
        _, at = timed(auto, cfg["rounds"])
        rec["autograd_loss_s_per_round"] = float(np.median(at))
        del auto
    if cfg.get("profile"):
        split = _profile_split(eng, theta, sel, 2, dev)
        rec.update(split)
        if split["profile_matmul_s"] > 0:
            rec["bmm_gflops"] = flops / split["profile_matmul_s"] / 1e9
        if split["profile_optimizer_s"] > 0:
            rec["optimizer_only_gb_per_s"] = opt_bytes / split["profile_optimizer_s"] / 1e9
    # peak of the vectorized engine alone (the loop backend below stacks all its clients' heads)
    rec["peak_mb"] = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else _peak_rss_mb()
    if cfg.get("loop_rounds"):
        loop = Engine(data, head, optim, LocalConfig(E, B), backend="loop")
        _, lt = timed(loop, cfg["loop_rounds"])
        rec["loop_s_per_round"] = float(np.median(lt))
        rec["loop_rounds_timed"] = len(lt)
    return rec


def closed_form_speed(cfg: dict) -> dict:
    """The server side of the statistics exchange at scale: ``clients`` messages (per-class sums and counts, the
    Gram of ``[x, 1]``) streamed into the accumulator ``block`` clients at a time, then the ridge, LDA and NCM
    solves. The clients' own computation of their messages is timed apart (it runs on the clients)."""
    import numpy as np
    import torch

    threads = set_cpu_threads(cfg.get("threads"))
    D, C, K, n, block = cfg["dim"], cfg["classes"], cfg["clients"], cfg["samples_per_client"], cfg["block"]
    rng = np.random.default_rng(0)
    centers = rng.random((C, D), dtype=np.float32)
    acc = StatsAccumulator(C, D, gram=True)
    client_s = add_s = 0.0
    for b0 in range(0, K, block):
        data = []
        for _ in range(b0, min(K, b0 + block)):
            y = rng.integers(0, C, n)
            data.append((centers[y] + rng.random((n, D), dtype=np.float32), y))
        t0 = time.perf_counter()
        msgs = [client_stats(x, y, C, gram=True) for x, y in data]
        t1 = time.perf_counter()
        for m in msgs:
            acc.add(m)
        add_s += time.perf_counter() - t1
        client_s += t1 - t0
        del msgs
    rec = {
        "closedform_clients": K,
        "closedform_dim": D,
        "closedform_classes": C,
        "closedform_threads": threads,
        "closedform_block": block,
        "closedform_samples_per_client": n,
        "closedform_stream_s": add_s,
        "closedform_client_s": client_s,
        "closedform_mb_up_per_client": acc.bytes_up / K / 1e6,
    }
    for name in ("ridge", "lda", "ncm"):
        t0 = time.perf_counter()
        theta = create_head(name).solve(acc)
        rec[f"closedform_{name}_solve_s"] = time.perf_counter() - t0
        assert torch.isfinite(theta).all()
    rec["closedform_ridge_total_s"] = add_s + rec["closedform_ridge_solve_s"]
    del acc
    rec.update(_simulator_exchange(centers, K, n, rng))
    rec["closedform_peak_mb"] = _peak_rss_mb()
    return rec


def _simulator_exchange(centers, K: int, n: int, rng) -> dict:
    """The same exchange as the simulator runs it (``fedhead train --head ridge``): every client's rows in one
    float32 array, the messages summed block by block (:func:`fedhead.core.closedform.accumulate`), then the ridge
    solve; the data are drawn before the clock starts."""
    import numpy as np
    import torch

    C, D = centers.shape
    y = rng.integers(0, C, K * n)
    x = torch.from_numpy(centers[y] + rng.random((K * n, D), dtype=np.float32))
    parts = np.split(np.arange(K * n), K)
    acc_s, total_s = _ridge_exchange(x, torch.from_numpy(y), parts, C)
    return {"closedform_sim_accumulate_s": acc_s, "closedform_sim_s": total_s}


def _ridge_exchange(x, y, parts, num_classes: int) -> tuple[float, float]:
    """Seconds of the simulator's statistics exchange for ridge: the clients' messages summed block by block
    (:func:`fedhead.core.closedform.accumulate`), and that plus the solve."""
    import torch

    t0 = time.perf_counter()
    acc = accumulate(x, y, parts, num_classes, gram=True, cof=False)
    t1 = time.perf_counter()
    theta = create_head("ridge").solve(acc)
    t2 = time.perf_counter()
    assert torch.isfinite(theta).all()
    return t1 - t0, t2 - t0


# ---------------------------------------------------------------- cross-device shape (child process)

# iNaturalist-Users-120k's shape (Fed3R, FedCOF): 1,203 classes x 100 samples, 1,280 dims, 10,000 clients of a
# Dirichlet(0.1) partition (--min-size 0), the default recipe (SGD, 3 epochs, batch 50, fedavg)
CROSS_DEVICE = dict(classes=1203, per_class=100, dim=1280, clients=10_000, alpha=0.1)
CROSS_DEVICE_QUICK = dict(classes=20, per_class=20, dim=64, clients=100, alpha=0.1)


def _cross_device_data(cfg: dict):
    """The cross-device federation: random non-negative features (speed does not depend on their values)."""
    import numpy as np
    import torch

    C, D, K = cfg["classes"], cfg["dim"], cfg["clients"]
    N = C * cfg["per_class"]
    g = torch.Generator().manual_seed(0)
    x = torch.empty(N, D + 1)
    x[:, :D] = torch.randn(N, D, generator=g).abs_()
    x[:, D] = 1.0
    y = np.arange(N) % C
    t0 = time.perf_counter()
    parts = create_partition("dirichlet", y, K, seed=0, alpha=cfg["alpha"], min_size=0)
    part_s = time.perf_counter() - t0
    return ClientSet(x=x, y=torch.as_tensor(y), parts=parts, counts=class_counts(parts, y, C), num_classes=C), part_s


def cross_device_speed(cfg: dict) -> dict:
    """One round of ova2 (stage 1, then stage 2 timed) and of softmax with the default recipe at the cross-device
    shape (``part="iterative"``), or the statistics exchange of ridge at the same shape (``part="closedform"``:
    every client's Gram and class sums streamed and the solve). Keys are prefixed ``crossdevice_``."""
    import numpy as np
    import torch

    threads = set_cpu_threads(cfg.get("threads"))
    flush_denormals()
    keep = keep_freed_memory()
    data, part_s = _cross_device_data(cfg)
    sel = np.arange(cfg["clients"])
    rec = {"crossdevice_threads": threads, "crossdevice_partition_s": part_s}
    rec["crossdevice_malloc_keeps_freed"] = keep
    if cfg["part"] == "closedform":
        rec["crossdevice_closedform_s"] = _ridge_exchange(data.x[:, :-1], data.y, data.parts, data.num_classes)[1]
        rec["crossdevice_closedform_peak_mb"] = _peak_rss_mb()
        return rec
    optim = OptimConfig(name="sgd", lr=0.01, weight_decay=1e-4, momentum=0.9)  # the default recipe
    theta0 = torch.zeros(data.num_classes, data.x.shape[1])
    for head, rounds in (("ova2", (1, 2)), ("softmax", (1,))):
        eng = Engine(data, create_head(head), optim, LocalConfig(3, 50), dual=cfg.get("dual", "auto"))
        theta = theta0
        for r in rounds:
            t0 = time.perf_counter()
            theta, st = eng.run_round(theta, sel, 0, r, "fedavg")
            rec[f"crossdevice_{head}_round{r}_s"] = time.perf_counter() - t0
            assert torch.isfinite(theta).all()
        rec[f"crossdevice_{head}_s_per_round"] = rec[f"crossdevice_{head}_round{rounds[-1]}_s"]
        rec[f"crossdevice_{head}_dual_clients"] = st.dual_clients
    rec["crossdevice_samples"] = int(sum(len(p) for p in data.parts))
    rec["crossdevice_largest_client"] = int(max(len(p) for p in data.parts))
    rec["crossdevice_peak_mb"] = _peak_rss_mb()
    return rec


def measure_cross_device(*, quick: bool, threads: Optional[int], progress=None) -> dict:
    """The cross-device row: the iterative rounds and the statistics exchange, each in its own child (own peak)."""
    shape = CROSS_DEVICE_QUICK if quick else CROSS_DEVICE
    rec = {f"crossdevice_{k}": v for k, v in shape.items()}
    for part in ("iterative", "closedform"):
        if progress:
            progress(
                f"cross-device {part}: {shape['clients']} clients x {shape['classes']} classes x {shape['dim']} dims"
            )
        rec.update(run_child(dict(shape, threads=threads, crossdevice=True, part=part)))
    for head in ("ova2", "softmax"):
        rec[f"crossdevice_{head}_vs_closedform"] = (
            rec[f"crossdevice_{head}_s_per_round"] / rec["crossdevice_closedform_s"]
        )
    rec["crossdevice_load"] = _load()
    return rec


# ---------------------------------------------------------------- the scratch engine (fedhead scratch)

# model -> (algorithm, dataset) whose protocol it is timed at: members per round (clients x participation), batch
# size and optimizer come from the runner's defaults (fedhead.scratch.runner.ALGO_DEFAULTS, FEDABC_LR)
SCRATCH_PROTOCOLS = {
    "cnn": ("fedavg", "mnist"),
    "fedabc-mlp": ("fedabc", "mnist"),
    "fedabc-convnet": ("fedabc", "cifar10"),
    "vgg9": ("dnc", "cifar10"),
    "kws-cnn": ("fedavg", "speech-commands"),
}
SCRATCH_SHAPES = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32), "speech-commands": (1, 50, 16)}  # (C, H, W)
# optimizer steps per member in one timed call (about a second of work per backend on one core)
SCRATCH_STEPS = {"cnn": 10, "fedabc-mlp": 40, "fedabc-convnet": 3, "vgg9": 2, "kws-cnn": 6}
SCRATCH_QUICK = dict(members=2, batch=8, steps=2)


def scratch_protocol(model: str, quick: bool = False) -> dict:
    """The training configuration ``fedhead bench speed`` times ``model`` at (see :data:`SCRATCH_PROTOCOLS`)."""
    algo, dataset = SCRATCH_PROTOCOLS[model]
    d = ALGO_DEFAULTS[algo]
    lr = d["lr"] if d["lr"] is not None else FEDABC_LR[dataset]
    cfg = dict(
        model=model,
        algo=algo,
        dataset=dataset,
        shape=SCRATCH_SHAPES[dataset],
        members=max(1, round(d["clients"] * d["participation"])),
        batch=d["batch_size"],
        steps=SCRATCH_STEPS[model],
        optimizer=d["optimizer"],
        lr=lr,
        momentum=d["momentum"],
        weight_decay=d["weight_decay"],
    )
    if quick:
        cfg.update(SCRATCH_QUICK)
    return cfg


def scratch_flops_per_sample(model, params: dict, x, loss_fn) -> float:
    """Useful FLOPs of one sample's training step, counted by ``torch.utils.flop_counter.FlopCounterMode``: the
    convolutions and matrix products of one member's forward and backward at the timed batch size (gradients of the
    parameters only, as the engine takes them), divided by the batch. Elementwise work, pooling, the loss and the
    optimizer are not counted."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    p = {n: v[0].detach().clone().requires_grad_(True) for n, v in params.items()}
    y = torch.zeros(x.shape[0], dtype=torch.long)
    with FlopCounterMode(display=False) as fc:
        out = torch.func.functional_call(model, p, (x,)).unsqueeze(0)
        loss = loss_fn(out, y.unsqueeze(0), torch.ones_like(y, dtype=torch.bool).unsqueeze(0), {})
        torch.autograd.grad(loss.sum(), list(p.values()))
    return fc.get_total_flops() / x.shape[0]


def scratch_speed(cfg: dict) -> dict:
    """Time local training of one scratch model: the engine (``train_members``, default formulation, and any in
    ``cfg['nets']``) against the loop backend, interleaved, ``repeat`` calls each (after a warm-up call each).

    Members get equal-sized synthetic data (uint8 images, or float MFCCs; the values do not change the speed) of
    ``steps x batch`` samples: one epoch of ``steps`` full batches each. The record keys are unprefixed."""
    import inspect

    import numpy as np
    import torch

    threads = set_cpu_threads(cfg.get("threads"))
    dev = torch.device("cpu")
    rec = {"threads": threads, "load_before": _load()}
    rec.update(machine_limits(dev, cfg.get("quick", False)))
    rec["machine_onednn_matmul_gflops"] = onednn_matmul_gflops(cfg.get("quick", False))
    peak = max(rec["machine_matmul_gflops"], rec["machine_onednn_matmul_gflops"])
    M, B, S, shape = cfg["members"], cfg["batch"], cfg["steps"], tuple(cfg["shape"])
    model = create_model(cfg["model"], shape, 10)
    params = E.init_params(model, torch.Generator().manual_seed(0), count=M)
    g = torch.Generator().manual_seed(1)
    n = M * S * B
    if cfg["dataset"] == "speech-commands":  # float MFCCs
        x_all, to_float = torch.randn(n, *shape, generator=g), (lambda b: b)
    else:  # uint8 pixels
        x_all = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
        to_float = lambda b: b.float() / 255  # noqa: E731
    y_all = torch.randint(0, 10, (n,), generator=g)
    idx = [np.arange(m * S * B, (m + 1) * S * B) for m in range(M)]
    optim = E.OptimSpec(cfg["optimizer"], cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
    flops = scratch_flops_per_sample(model, params, to_float(x_all[:B]), E.softmax_ce)
    has_net = "net" in inspect.signature(E.train_members).parameters

    def runner(backend, net=None, short=False):
        kw = {"net": net} if net and has_net else {}
        ix = [i[:B] for i in idx] if short else idx

        def run():
            E.train_members(
                model,
                params,
                ix,
                {},
                E.softmax_ce,
                x_all=x_all,
                y_all=y_all,
                to_float=to_float,
                epochs=1,
                batch_size=B,
                optim=optim,
                rng=np.random.default_rng(0),
                backend=backend,
                **kw,
            )

        return run

    kinds = {"engine": ("vectorized", None), "loop": ("loop", None)}
    kinds.update({f"net_{net}": ("vectorized", net) for net in (cfg.get("nets") or ()) if has_net})
    variants = {k: runner(*v) for k, v in kinds.items()}
    for v in kinds.values():  # warm-up: one step per member
        runner(*v, short=True)()
    wall = {k: [] for k in variants}
    cpu = {k: [] for k in variants}
    for _ in range(cfg.get("repeat", 3)):
        for k, fn in variants.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    samples = M * S * B
    rec.update(
        model=cfg["model"],
        algo=cfg["algo"],
        dataset=cfg["dataset"],
        members=M,
        batch=B,
        steps=S,
        optimizer=cfg["optimizer"],
        samples_per_call=samples,
        gflop_per_sample=flops / 1e9,
        flop_count="FlopCounterMode: convolutions and matmuls of one member's forward + backward",
        engine_formulation=_engine_formulation(model),
        repeat=len(wall["engine"]),
    )
    for k in variants:
        med = float(np.median(wall[k]))
        rec[f"{k}_s"] = med
        rec[f"{k}_s_min"] = min(wall[k])
        rec[f"{k}_cpu_s"] = float(np.median(cpu[k]))
        rec[f"{k}_samples_per_s"] = samples / med
        rec[f"{k}_gflops"] = samples * flops / med / 1e9
        rec[f"{k}_matmul_fraction"] = rec[f"{k}_gflops"] / peak  # of the faster of MKL's and oneDNN's products
    rec["speedup_vs_loop"] = rec["loop_s"] / rec["engine_s"]
    rec["speedup_vs_loop_min"] = rec["loop_s_min"] / rec["engine_s_min"]
    rec["load_after"] = _load()
    return rec


def _engine_formulation(model) -> str:
    net = getattr(E, "StackedNet", None)
    if net is None:
        return "vmap"
    return "StackedNet (per-member channels-last convolutions)" if net.build(model) is not None else "vmap"


def measure_scratch_speed(
    *, quick: bool = False, threads: Optional[int] = None, models=None, repeat: int = 3, nets=(), progress=None
) -> dict:
    """The scratch engine against its loop backend for every model of :data:`SCRATCH_PROTOCOLS` (or ``models``);
    one subprocess per model. Keys ``scratch_<model>_*``."""
    rec: dict = {}
    for model in models or SCRATCH_PROTOCOLS:
        cfg = dict(
            scratch_protocol(model, quick), threads=threads, quick=quick, repeat=repeat, nets=list(nets), scratch=True
        )
        if progress:
            progress(
                f"scratch {model}: {cfg['members']} members x {cfg['steps']} steps x batch {cfg['batch']} "
                f"({cfg['algo']} on {cfg['dataset']})"
            )
        r = run_child(cfg)
        for k, v in r.items():
            rec[f"scratch_{model}_{k}"] = v
    return rec


def _peak_rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def run_child(cfg: dict, timeout: float = 900) -> dict:
    """Run :func:`run_config` in a fresh interpreter (own peak memory); errors become one line."""
    env = dict(os.environ, FEDHEAD_NO_PROGRESS="1")
    env.pop(DENORMALS_ENV, None)
    if cfg.get("keep_denormals"):
        env[DENORMALS_ENV] = "keep"  # subnormal arithmetic left on: what flushing saves
    p = subprocess.run(
        [sys.executable, "-m", "fedhead.bench.speed", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        what = f"model {cfg['model']}" if cfg.get("scratch") else f"{cfg.get('clients')} clients"
        what += f" ({cfg['part']})" if cfg.get("crossdevice") else ""
        raise FedheadError(f"speed benchmark child for {what} failed: {tail}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------- the command


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def measure_speed(
    *,
    quick: bool = False,
    rounds: int = 3,
    device: str = "cpu",
    threads: Optional[int] = None,
    loop_rounds: int = 1,
    extraction: bool = True,
    heads: bool = True,
    scratch: bool = True,
    scratch_models=None,
    scratch_repeat: int = 3,
    scratch_nets=(),
    cross_device: bool = True,
    progress=None,
    extract_data_dir=None,
    extract_processes: int = 2,
) -> dict:
    """All measurements; returns the flat record written to ``speed.json``. ``heads``: the head trainer and the
    closed-form statistics; ``cross_device``: with ``heads``, one round at iNaturalist-Users-120k's shape
    (:data:`CROSS_DEVICE`); ``scratch``: the scratch engine against its loop (CPU), one row per model."""
    rec: dict = {"bench_quick": quick, "bench_device": device, "bench_load_before": _load()}
    if heads:
        rec.update(
            _measure_heads(
                quick=quick,
                rounds=rounds,
                device=device,
                threads=threads,
                loop_rounds=loop_rounds,
                extraction=(extract_data_dir, extract_processes) if extraction else None,
                progress=progress,
            )
        )
        if cross_device:
            rec.update(measure_cross_device(quick=quick, threads=threads, progress=progress))
    elif extraction:
        if progress:
            progress("extraction")
        rec.update(_extraction(quick, device, extract_data_dir, extract_processes))
    if scratch:
        rec.update(
            measure_scratch_speed(
                quick=quick,
                threads=threads,
                models=scratch_models,
                repeat=scratch_repeat,
                nets=scratch_nets,
                progress=progress,
            )
        )
    rec["bench_load_after"] = _load()
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}


def _measure_heads(*, quick, rounds, device, threads, loop_rounds, extraction, progress) -> dict:
    """The head trainer against the machine, a per-client loop and 100..1000 clients; extraction; closed form."""
    size = QUICK if quick else PAPER
    counts = (10, 30, 100) if quick else (100, 300, 1000)
    big = dict(size, classes=40, dim=256) if quick else dict(size, classes=200, dim=1280)
    base = dict(size, device=device, threads=threads, rounds=rounds, quick=quick)
    rec: dict = {
        "bench_rounds": rounds,
        "bench_head": "ova2",
        "bench_optimizer": "adamw",
        "bench_partition": "shard(2)",
        "bench_epochs": size["epochs"],
        "bench_batch": size["batch"],
        "bench_samples": size["samples"],
        "bench_dim": size["dim"],
        "bench_classes": size["classes"],
    }
    jobs = [("trainer", dict(base, clients=counts[0], machine=True, profile=True, loop_rounds=loop_rounds))]
    jobs += [
        (f"scale_{k}", dict(base, clients=k, loop_rounds=loop_rounds if k == counts[-1] else 0)) for k in counts[1:]
    ]
    jobs += [(f"scale_{counts[-1]}x{big['classes']}x{big['dim']}", dict(base, **big, clients=counts[-1], rounds=1))]
    if device != "cuda":  # the trainer again with subnormal arithmetic left on (CPU only: GPUs don't slow)
        jobs += [("denormals_kept", dict(base, clients=counts[0], keep_denormals=True))]
    t0 = time.perf_counter()
    for name, cfg in jobs:
        if progress:
            progress(f"{name}: {cfg['clients']} clients x {cfg['classes']} classes x {cfg['dim']} dims")
        r = run_child(cfg)
        rec[f"{name}_load"] = _load()
        pause_hook(PAUSE_ENV, len([k for k in rec if k.endswith("_load") and not k.startswith("bench_")]))
        if name == "trainer":
            for k in ("machine_matmul_gflops", "machine_copy_gb_per_s", "machine_matmul_size", "machine_copy_mb"):
                rec[k] = r.pop(k)
            rec["machine_threads"] = r["threads"]
            loop = r.pop("loop_s_per_round", None)
            r.pop("loop_rounds_timed", None)
            for k, v in r.items():
                rec[f"trainer_{k}"] = v
            rec[f"scale_{counts[0]}_s_per_round"] = r["s_per_round"]
            rec[f"scale_{counts[0]}_peak_mb"] = r["peak_mb"]
            rec["trainer_matmul_fraction"] = r["matmul_gflops"] / rec["machine_matmul_gflops"]
            rec["trainer_optimizer_fraction_of_copy"] = r["optimizer_gb_per_s"] / rec["machine_copy_gb_per_s"]
            rec["trainer_est_50_rounds_s"] = 50 * r["s_per_round"]
            if loop is not None:
                rec["loop_s_per_round"] = loop
                rec[f"speedup_vs_loop_{counts[0]}"] = loop / r["s_per_round"]
        elif name == "denormals_kept":
            rec["trainer_denormals_kept_s_per_round"] = r["s_per_round"]
            rec["trainer_denormal_slowdown"] = r["s_per_round"] / rec["trainer_s_per_round"]
        else:
            for k in ("s_per_round", "peak_mb", "block_clients", "tile_clients", "matmul_gflops"):
                rec[f"{name}_{k}"] = r[k]
            if "loop_s_per_round" in r:
                rec[f"loop_{cfg['clients']}_s_per_round"] = r["loop_s_per_round"]
                rec[f"speedup_vs_loop_{cfg['clients']}"] = r["loop_s_per_round"] / r["s_per_round"]
    rec[f"scale_{counts[-1]}_vs_{counts[0]}"] = (
        rec[f"scale_{counts[-1]}_s_per_round"] / rec[f"scale_{counts[0]}_s_per_round"]
    )
    rec["trainer_bench_seconds"] = time.perf_counter() - t0
    if extraction:
        if progress:
            progress("extraction")
        rec.update(_extraction(quick, device, *extraction))
    if progress:
        progress(
            "closed-form statistics: 1000 clients x 200 classes x 1280 dims"
            if not quick
            else "closed-form statistics (quick)"
        )
    cf = (
        dict(dim=1280, classes=200, clients=1000, samples_per_client=50, block=50)
        if not quick
        else dict(dim=64, classes=10, clients=50, samples_per_client=20, block=10)
    )
    rec.update(run_child(dict(cf, threads=threads, closedform=True)))
    rec.update(closed_form_bound(rec))
    return rec


def closed_form_bound(rec: dict) -> dict:
    """The statistics exchange against its FLOP bound at the machine's measured matmul rate: every client's Gram of
    ``[x, 1]`` (``2 n (D+1)^2``) and class sums (``n D``), the server's sum of the Grams (``K (D+1)^2``) and the
    ridge solve (Cholesky ``(D+1)^3 / 3`` and ``2 (D+1)^2 C`` for the right-hand sides). The time counted is the
    clients' messages, the server's stream and the solve, as if one machine did all of it. The simulator's exchange
    (``closedform_sim_*``: the same statistics as one blocked product, no per-client matrices to add) is held against
    the same count without the server's additions, at the float32 and at the float64 matmul rate. Both count the
    whole product ``2 n (D+1)^2``; fedhead computes three of its four column blocks (a Gram is symmetric)."""
    if "machine_matmul_gflops" not in rec or "closedform_client_s" not in rec:
        return {}
    K, n = rec["closedform_clients"], rec.get("closedform_samples_per_client", 0)
    D1, C = rec["closedform_dim"] + 1, rec["closedform_classes"]
    flops = K * (2 * n * D1 * D1 + n * (D1 - 1) + D1 * D1) + D1**3 / 3 + 2 * D1 * D1 * C
    bound = flops / (rec["machine_matmul_gflops"] * 1e9)
    took = rec["closedform_client_s"] + rec["closedform_stream_s"] + rec["closedform_ridge_solve_s"]
    out = {"closedform_gflop": flops / 1e9, "closedform_bound_s": bound, "closedform_vs_bound": took / bound}
    if "closedform_sim_s" in rec:
        # on one machine the clients' Grams are one product over all rows; the server adds no per-client matrices
        sim = K * (2 * n * D1 * D1 + n * (D1 - 1)) + D1**3 / 3 + 2 * D1 * D1 * C
        t32 = sim / (rec["machine_matmul_gflops"] * 1e9)
        out.update(closedform_sim_bound_s=t32, closedform_sim_vs_bound=rec["closedform_sim_s"] / t32)
        if rec.get("machine_matmul64_gflops"):  # the sums are float64: the same count at the float64 rate
            t64 = sim / (rec["machine_matmul64_gflops"] * 1e9)
            out.update(closedform_sim_bound64_s=t64, closedform_sim_vs_bound64=rec["closedform_sim_s"] / t64)
    return out


def _extraction(quick: bool, device: str, data_dir=None, processes: int = 2) -> dict:
    """`fedhead extract` against the bare forward (the digits in memory, or the image folder ``data_dir``: 4,000
    training images decoded as the command decodes them); then, with ``processes`` >= 2 on the CPU, one 1-thread
    process against ``processes`` of them on half as many images per split (:func:`extract.bench.measure_processes`)."""
    dataset = "imagefolder" if data_dir is not None else "digits"
    n = 64 if quick else (4000 if data_dir is not None else 256)
    try:
        r = measure_extraction(dataset, data_dir, num_images=n, device=device)
        if processes >= 2 and device == "cpu":
            r.update(measure_processes(dataset, data_dir, num_images=n // 2, processes=processes))
    except Exception as exc:  # a broken extraction must not lose the trainer's numbers
        return {"extract_status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    out = {"extract_status": "ok"}
    for k, v in r.items():
        out[k if k.startswith("extract_") else f"extract_{k}"] = v
    return out


def speed_table(rec: dict):
    from rich.table import Table

    t = Table(
        title=f"fedhead bench speed ({'quick' if rec['bench_quick'] else 'paper scale'}, "
        f"{rec['bench_device']}, {rec.get('machine_threads')} threads, load {rec['bench_load_before']})"
    )
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("note")

    def row(label, key, fmt="{:.3f}", note=""):
        if key in rec:
            v = rec[key]
            t.add_row(label, fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v), note)

    row(
        "trainer s/round",
        "trainer_s_per_round",
        note=f"{rec.get('trainer_clients')} clients, "
        f"tile {rec.get('trainer_tile_clients')}, block {rec.get('trainer_block_clients')}, "
        f"closed-form loss {rec.get('trainer_closed_form_loss')}, fused opt {rec.get('trainer_fused_optimizer')}",
    )
    row("est. 50 rounds (s)", "trainer_est_50_rounds_s", "{:.1f}", "goal < 90")
    row(
        "validation evaluation s/round",
        "trainer_val_eval_s",
        note=f"{rec.get('trainer_val_eval_fraction', float('nan')):.1%} of a round (--val-fraction 0.1; goal <= 10%)",
    )
    row(
        "trainer s/round, subnormals kept",
        "trainer_denormals_kept_s_per_round",
        note=f"flushed in the run above: {rec.get('trainer_denormals_flushed')}; "
        f"{rec.get('trainer_denormal_slowdown', float('nan')):.2f}x slower kept",
    )
    row(
        "trainer matmul GFLOP/s",
        "trainer_matmul_gflops",
        "{:.1f}",
        f"{rec.get('trainer_matmul_gflop_per_round', 0):.1f} GFLOP/round over the whole round",
    )
    row("bmm kernels GFLOP/s", "trainer_bmm_gflops", "{:.1f}", "FLOPs / profiled matmul time")
    row("machine matmul GFLOP/s", "machine_matmul_gflops", "{:.1f}", "dense fp32, same threads")
    row("matmul fraction", "trainer_matmul_fraction", "{:.1%}", "goal >= 60%")
    row(
        "optimizer GB/s (round)",
        "trainer_optimizer_gb_per_s",
        "{:.1f}",
        f"{rec.get('trainer_optimizer_gb_per_round', 0):.1f} GB/round",
    )
    row("optimizer GB/s (kernel)", "trainer_optimizer_only_gb_per_s", "{:.1f}", "bytes / profiled optimizer time")
    row("machine copy GB/s", "machine_copy_gb_per_s", "{:.1f}", "read + write")
    for part in ("matmul", "optimizer", "gather", "loss_other"):
        row(
            f"profile: {part}",
            f"trainer_profile_{part}_fraction",
            "{:.1%}",
            f"{rec.get(f'trainer_profile_{part}_s', 0):.2f} s",
        )
    row(
        "trainer with autograd loss s/round",
        "trainer_autograd_loss_s_per_round",
        note="the head's closed-form loss_and_grad switched off",
    )
    row("loop s/round", "loop_s_per_round", note="per-client torch.optim loop")
    for key in sorted(k for k in rec if k.startswith("speedup_vs_loop_")):
        n = key.rsplit("_", 1)[1]
        row(f"speed-up vs loop ({n} clients)", key, "{:.1f}x", "goal >= 3x (100), >= 10x (1000)")
    for key in sorted(
        (k for k in rec if k.startswith("scale_") and k.endswith("_s_per_round")), key=lambda k: (len(k), k)
    ):
        name = key[len("scale_") : -len("_s_per_round")]
        row(f"scale {name}: s/round", key, note=f"peak {rec.get(f'scale_{name}_peak_mb', 0):.0f} MB")
    for key in (k for k in rec if k.startswith("scale_") and "_vs_" in k):
        row(key.replace("_", " "), key, "{:.2f}x", "goal <= 1.0x: more clients, same data, no costlier")
    _closed_form_rows(row, rec)
    _cross_device_rows(row, rec)
    row("extraction images/s", "extract_images_per_sec", "{:.1f}")
    row("forward images/s", "extract_forward_images_per_sec", "{:.1f}")
    row("extraction / forward", "extract_fraction_of_forward", "{:.3f}", "goal >= 0.9 (CPU)")
    n = rec.get("extract_procs_processes")
    if n:
        row("extraction, 1 process x 1 thread: images/s", "extract_procs1_images_per_sec", "{:.1f}")
        row(f"extraction, {n} processes x 1 thread: images/s", f"extract_procs{n}_images_per_sec", "{:.1f}")
        row(f"{n} processes / 1 process", "extract_procs_speedup", "{:.2f}x", f"goal >= 1.7x at 2; same store: "
            f"{rec.get('extract_procs_same_store')}")  # fmt: skip
        row(f"{n} processes / 1 process, end to end", "extract_procs_end_to_end_speedup", "{:.2f}x",
            "with start-up and merge")  # fmt: skip
    if rec.get("extract_status", "ok") != "ok":
        t.add_row("extraction", "-", rec["extract_status"])
    t.add_row("load (1/5/15 min)", rec.get("bench_load_after", ""), "after; before " + rec["bench_load_before"])
    return t


def _closed_form_rows(row, rec: dict) -> None:
    """The statistics exchange's rows of :func:`speed_table` (``row(label, key, fmt, note)`` adds one)."""
    row(
        "closed form: stream 1000 messages (s)",
        "closedform_stream_s",
        note=f"{rec.get('closedform_clients')} "
        f"clients x {rec.get('closedform_classes')} classes x {rec.get('closedform_dim')} dims, blocks of "
        f"{rec.get('closedform_block')}; {rec.get('closedform_mb_up_per_client', 0):.1f} MB per client",
    )
    row("closed form: ridge solve (s)", "closedform_ridge_solve_s")
    row("closed form: stream + ridge solve (s)", "closedform_ridge_total_s", note="goal < 5 s")
    row(
        "closed form: LDA / NCM solve (s)",
        "closedform_lda_solve_s",
        note=f"NCM {rec.get('closedform_ncm_solve_s', 0):.3f} s",
    )
    row("closed form: peak MB", "closedform_peak_mb", "{:.0f}", "goal < 2048")
    row("closed form: clients computing their messages (s)", "closedform_client_s", note="runs on the clients")
    row(
        "closed form: clients + stream + solve vs FLOP bound",
        "closedform_vs_bound",
        "{:.2f}x",
        f"goal <= 2x; bound {rec.get('closedform_bound_s', 0):.2f} s at the measured matmul rate",
    )
    row(
        "closed form: the simulator's exchange vs FLOP bound",
        "closedform_sim_vs_bound",
        "{:.2f}x",
        f"goal <= 2x; {rec.get('closedform_sim_s', 0):.2f} s against {rec.get('closedform_sim_bound_s', 0):.2f} s "
        "at the float32 matmul rate",
    )
    row(
        "closed form: the simulator's exchange vs float64 FLOP bound",
        "closedform_sim_vs_bound64",
        "{:.2f}x",
        f"{rec.get('closedform_sim_bound64_s', 0):.2f} s at the float64 rate (the sums are float64)",
    )


def _cross_device_rows(row, rec: dict) -> None:
    """The cross-device rows of :func:`speed_table` (``row(label, key, fmt, note)`` adds one)."""
    for head in ("ova2", "softmax"):
        row(
            f"cross-device: {head} s/round",
            f"crossdevice_{head}_s_per_round",
            "{:.2f}",
            f"{rec.get('crossdevice_clients')} clients x {rec.get('crossdevice_classes')} classes x "
            f"{rec.get('crossdevice_dim')} dims, Dirichlet {rec.get('crossdevice_alpha')}; "
            f"{rec.get(f'crossdevice_{head}_dual_clients')} clients in the dual form; "
            f"{rec.get(f'crossdevice_{head}_vs_closedform', float('nan')):.1f}x the statistics exchange; goal <= 15 s",
        )
    row("cross-device: ova2 round 1 (stage 1) s", "crossdevice_ova2_round1_s", "{:.2f}")
    row("cross-device: peak MB", "crossdevice_peak_mb", "{:.0f}", "both heads' rounds; goal < 6144")
    row(
        "cross-device: ridge statistics exchange (s)",
        "crossdevice_closedform_s",
        "{:.2f}",
        f"every client's Gram streamed + solve; peak {rec.get('crossdevice_closedform_peak_mb', 0):.0f} MB; "
        f"load {rec.get('crossdevice_load')}",
    )


SCRATCH_COLUMNS = (
    "model",
    "protocol: members x batch",
    "GFLOP/sample",
    "engine samples/s",
    "loop samples/s",
    "engine/loop",
    "engine GFLOP/s",
    "loop GFLOP/s",
    "engine/matmul",
    "load",
    "other nets",
)


def scratch_rows(rec: dict) -> list[list[str]]:
    """One row per model measured, as printed; the engine's other formulations (``--scratch-net``) in the last
    column."""
    rows = []
    for model in dict.fromkeys(k.split("_")[1] for k in rec if k.startswith("scratch_") and k.endswith("_model")):
        r = {k[len(f"scratch_{model}_") :]: v for k, v in rec.items() if k.startswith(f"scratch_{model}_")}
        rows.append(
            [
                model,
                f"{r['algo']} {r['dataset']}: {r['members']} x {r['batch']} {r['optimizer']}",
                f"{r['gflop_per_sample']:.4f}",
                f"{r['engine_samples_per_s']:.0f}",
                f"{r['loop_samples_per_s']:.0f}",
                f"{r['speedup_vs_loop']:.2f}x",
                f"{r['engine_gflops']:.1f}",
                f"{r['loop_gflops']:.1f}",
                f"{r['engine_matmul_fraction']:.1%}",
                f"{r['load_before'].split()[0]}-{r['load_after'].split()[0]}",
                " ".join(
                    f"{k[4 : -len('_samples_per_s')]} {v:.0f}/s"
                    for k, v in r.items()
                    if k.startswith("net_") and k.endswith("_samples_per_s")
                ),
            ]
        )
    return rows


def scratch_table(rec: dict):
    from rich.table import Table

    first = next((k[: -len("_threads")] for k in rec if k.startswith("scratch_") and k.endswith("_threads")), None)
    t = Table(
        title=f"fedhead bench speed: scratch engine vs loop backend (cpu, {rec.get(f'{first}_threads')} "
        f"threads; float32 matmul {rec.get(f'{first}_machine_matmul_gflops', 0):.0f} GFLOP/s by "
        f"torch.mm/MKL, {rec.get(f'{first}_machine_onednn_matmul_gflops', 0):.0f} by oneDNN)",
        caption="FLOPs: FlopCounterMode, convolutions + matmuls of forward and backward. samples/s: median of "
        "the timed calls. engine/matmul: of the faster matmul. load: 1-min load average before-after",
    )
    rows = scratch_rows(rec)
    cols = SCRATCH_COLUMNS if any(r[-1] for r in rows) else SCRATCH_COLUMNS[:-1]
    for c in cols:
        t.add_column(c, justify="left" if c.startswith(("model", "protocol")) else "right")
    for row in rows:
        t.add_row(*row[: len(cols)])
    return t


def scratch_markdown(rec: dict) -> str:
    """The scratch table as Markdown (written next to the JSON record as ``<out>.md``)."""
    rows = scratch_rows(rec)
    cols = SCRATCH_COLUMNS if any(r[-1] for r in rows) else SCRATCH_COLUMNS[:-1]
    first = next((k[: -len("_threads")] for k in rec if k.startswith("scratch_") and k.endswith("_threads")), None)
    lines = [
        "# fedhead bench speed: scratch engine vs loop backend",
        "",
        f"CPU, {rec.get(f'{first}_threads')} threads; dense float32 matmul at that thread count: "
        f"{rec.get(f'{first}_machine_matmul_gflops', 0):.0f} GFLOP/s through torch.mm (MKL), "
        f"{rec.get(f'{first}_machine_onednn_matmul_gflops', 0):.0f} GFLOP/s through oneDNN. FLOPs per sample: "
        "torch.utils.flop_counter.FlopCounterMode on one member's forward + backward (convolutions and matrix "
        "products). samples/s: median of the timed calls. engine/matmul: engine GFLOP/s over the faster "
        "matmul. load: 1-minute load average before-after each model.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(r[: len(cols)]) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _check_ceiling(rounds: int, methods, stores) -> None:
    validate("--ceiling-rounds", rounds, Interval(1, None, integer=True))
    for m in methods or ():
        validate("--ceiling-method", m, OneOf(CEILING_METHODS))
    for s in stores or ():
        open_store(s, param="--ceiling-store")  # a bad store is refused before the measurement


def _ceiling(quick: bool, stores, rounds: int, flower: bool, methods, err) -> dict:
    return measure_ceiling(
        quick=quick,
        stores=list(stores or ()),
        rounds=None if quick and rounds == 30 else rounds,
        flower=flower,
        methods=tuple(methods or CEILING_METHODS),
        progress=lambda s: err.print(f"[bold]bench speed[/]: {s}"),
    )


FINETUNE_OPT = typer.Option(
    None,
    "--finetune",
    help="Also time fedhead finetune's local epoch against the bare encoder's forward+backward with this encoder "
    "(lora, full, bitfit, prompt; the registry weights where installed, else the hub's; test_* models at random init).",
)
FINETUNE_ROW = ("finetune {encoder} {peft} {precision} {device}: local epoch {local_images_per_s:.0f} images/s, bare "
                "forward+backward {bare_images_per_s:.0f}, ratio {ratio:.3f}")  # fmt: skip


def _finetune_rows(encoder: str, device: str, quick: bool, err) -> dict:
    """``--finetune``: :func:`fedhead.scratch.finetune.finetune_speed` per trainable kind (``--quick``: 32 px), each
    row printed on stdout."""
    err.print(f"[bold]bench speed[/]: finetune {encoder}")
    weights = "registry" if registry_weights(encoder) is not None else None
    rows = finetune_speed(encoder, weights=weights, pretrained=not encoder.startswith("test_"),
                          image_size=32 if quick else None, pefts=("lora", "full", "bitfit", "prompt"), device=device,
                          batch_size=8 if quick else 64, batches=2 if quick else 10)  # fmt: skip
    con = stdout_console()
    for r in rows:
        con.print(FINETUNE_ROW.format(**r))
    return {"finetune": rows}


EXTRACT_DIR_OPT = typer.Option(
    None,
    "--extract-data-dir",
    help="Time the extraction on this image folder (4,000 training images, e.g. CIFAR-10's JPEGs; the process "
    "comparison 2,000 per split) instead of the digits in memory.",
)
EXTRACT_PROCS_OPT = typer.Option(
    2, "--extract-processes", help="Also time N extraction processes of 1 thread against one (0: skip)."
)


def _check_speed_args(rounds, loop_rounds, threads, scratch_repeat, extract_processes, scratch_model, scratch_net):
    validate("--rounds", rounds, Interval(1, None, integer=True))
    validate("--loop-rounds", loop_rounds, Interval(0, None, integer=True))
    if threads is not None:
        validate("--threads", threads, Interval(1, None, integer=True))
    validate("--scratch-repeat", scratch_repeat, Interval(1, None, integer=True))
    validate("--extract-processes", extract_processes, Interval(0, None, integer=True), "0 skips it; 2 or more.")
    for m in scratch_model or ():
        validate("--scratch-model", m, OneOf(tuple(SCRATCH_PROTOCOLS)))
    for n in scratch_net or ():
        validate("--scratch-net", n, OneOf(("member", "grouped", "vmap")))


@cli_errors
def speed_cmd(
    out: Path = typer.Option(
        Path("speed.json"),
        "--out",
        help="JSON file for the flat record (the scratch table also goes to the same name with .md).",
    ),
    quick: bool = typer.Option(False, "--quick", help="Small sizes (smoke test, seconds)."),
    rounds: int = typer.Option(3, "--rounds", help="Timed rounds per configuration (after one warm-up round)."),
    loop_rounds: int = typer.Option(1, "--loop-rounds", help="Timed rounds of the loop backend."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | auto"),
    threads: Optional[int] = typer.Option(
        None, "--threads", help="CPU threads (default: all cores, or FEDHEAD_THREADS)."
    ),
    extraction: bool = typer.Option(True, "--extraction/--no-extraction", help="Also time `fedhead extract`."),
    heads: bool = typer.Option(
        True, "--heads/--no-heads", help="Time the head trainer and the closed-form statistics."
    ),
    scratch: bool = typer.Option(
        True,
        "--scratch/--no-scratch",
        help="Time the scratch engine against its loop backend (cpu) for every scratch model.",
    ),
    scratch_model: Optional[list[str]] = typer.Option(
        None, "--scratch-model", help="Only this scratch model (repeat for several)."
    ),
    scratch_repeat: int = typer.Option(3, "--scratch-repeat", help="Timed calls per scratch backend (median)."),
    scratch_net: Optional[list[str]] = typer.Option(
        None,
        "--scratch-net",
        help="Also time the engine with this formulation: member | grouped | vmap (repeat for several).",
    ),
    cross_device: bool = typer.Option(
        True,
        "--cross-device/--no-cross-device",
        help="With the head trainer, one round of ova2 and softmax (default recipe) at iNaturalist-Users-120k's shape "
        "(10,000 clients, 1,203 classes, 1,280 dims) against ridge's statistics exchange at that shape.",
    ),
    ceiling: bool = typer.Option(
        True,
        "--ceiling/--no-ceiling",
        help="Time to 99% of the central ceiling for ridge, fast, softmax and ova2 (paper-scale synthetic store).",
    ),
    ceiling_store: Optional[list[Path]] = typer.Option(
        None, "--ceiling-store", help="Also measure the time to the ceiling on this feature store (repeat for several)."
    ),
    ceiling_flower: bool = typer.Option(
        True, "--ceiling-flower/--no-ceiling-flower", help="Also time the same runs on `fedhead flower simulate`."
    ),
    ceiling_rounds: int = typer.Option(30, "--ceiling-rounds", help="Rounds searched for the ceiling (quick: 5)."),
    ceiling_method: Optional[list[str]] = typer.Option(
        None, "--ceiling-method", help="Only this method for the time to the ceiling (repeat for several)."
    ),
    finetune: Optional[str] = FINETUNE_OPT,
    extract_data_dir: Optional[Path] = EXTRACT_DIR_OPT,
    extract_processes: int = EXTRACT_PROCS_OPT,
) -> None:
    """Trainer speed vs the machine's matmul/memory limits, vs a per-client loop, and in 100..1000 clients; the
    scratch engine's samples/s and GFLOP/s per model vs its loop backend."""
    check_out(out)  # a folder there, or below a file: refused before the measurement
    _check_speed_args(rounds, loop_rounds, threads, scratch_repeat, extract_processes, scratch_model, scratch_net)
    _check_ceiling(ceiling_rounds, ceiling_method, ceiling_store)
    resolve_device(device)
    err = stderr_console()
    rec = measure_speed(
        quick=quick,
        rounds=rounds,
        device=device,
        threads=threads,
        loop_rounds=loop_rounds,
        extraction=extraction,
        heads=heads,
        scratch=scratch,
        scratch_models=scratch_model or None,
        scratch_repeat=scratch_repeat,
        scratch_nets=tuple(scratch_net or ()),
        cross_device=cross_device,
        progress=lambda s: err.print(f"[bold]bench speed[/]: {s}"),
        extract_data_dir=extract_data_dir,
        extract_processes=extract_processes,
    )
    if ceiling:
        rec.update(_ceiling(quick, ceiling_store, ceiling_rounds, ceiling_flower, ceiling_method, err))
    rec.update(_finetune_rows(finetune, device, quick, err) if finetune else {})
    if scratch:
        md = out.with_suffix(".md") if out.suffix != ".md" else out.with_name(out.name + ".table.md")
        atomic_write_text(md, scratch_markdown(rec))
    atomic_write_json(out, rec)
    con = stdout_console()
    if heads:
        con.print(speed_table(rec))
    if scratch:
        con.print(scratch_table(rec))
    if ceiling:
        con.print(ceiling_table(rec))
    con.print(str(out))


if __name__ == "__main__":
    _cfg = json.loads(sys.argv[1])
    _fn = (
        closed_form_speed
        if _cfg.get("closedform")
        else cross_device_speed
        if _cfg.get("crossdevice")
        else scratch_speed
        if _cfg.get("scratch")
        else run_config
    )
    print(json.dumps(_fn(_cfg)), flush=True)
