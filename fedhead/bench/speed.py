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

The record ``speed.json`` has flat prefixed keys (``trainer_*``, ``machine_*``, ``loop_*``, ``scale_*``,
``extract_*``); the rich table on stdout shows the same numbers.
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

from fedhead.errors import FedheadError, Interval, cli_errors, validate
from fedhead.train import PAUSE_ENV  # test hook: pause after the k-th job
from fedhead.util import pause_hook

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
    """Dense float32 matmul GFLOP/s and memory copy GB/s (bytes read + written) on ``dev``."""
    import torch

    n = 1024 if quick else 2048
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    t_mm = _best_time(lambda: torch.mm(a, b), dev, 3)
    m = (8 if quick else 64) * 2**20 // 4                  # 64 MB: far beyond the caches
    x = torch.randn(m, device=dev)
    y = torch.empty_like(x)
    t_cp = _best_time(lambda: y.copy_(x), dev, 5)
    return {"machine_matmul_gflops": 2 * n**3 / t_mm / 1e9, "machine_copy_gb_per_s": 2 * m * 4 / t_cp / 1e9,
            "machine_matmul_size": n, "machine_copy_mb": m * 4 / 2**20}


# ---------------------------------------------------------------- one trainer configuration (child process)


def _federation(clients: int, samples: int, dim: int, classes: int, device, seed: int = 0):
    import numpy as np
    import torch

    from fedhead.engine import ClientSet
    from fedhead.partitions import class_counts, create_partition

    g = torch.Generator().manual_seed(seed)
    x = torch.empty(samples, dim + 1)
    x[:, :dim] = torch.randn(samples, dim, generator=g).abs_()     # non-negative like pooled features
    x[:, dim] = 1.0
    y = np.arange(samples) % classes
    parts = create_partition("shard", y, clients, seed=seed, shards_per_client=2)
    counts = class_counts(parts, y, classes)
    return ClientSet(x=x.to(device), y=torch.as_tensor(y, device=device), parts=parts, counts=counts,
                     num_classes=classes)


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

    from fedhead.engine import Engine, LocalConfig, OptimConfig, _fused_available
    from fedhead.heads import create_head
    from fedhead.util import resolve_device, set_cpu_threads

    dev = resolve_device(cfg["device"])
    threads = set_cpu_threads(cfg.get("threads"))
    rec = {"threads": threads, "device": str(dev)}
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
    rec.update(clients=K, classes=C, dim=D, samples=int(sizes.sum()), client_steps=client_steps,
               matmul_gflop_per_round=flops / 1e9, optimizer_gb_per_round=opt_bytes / 1e9)

    def timed(engine, rounds):
        theta, _ = engine.run_round(theta0, sel, 0, 1, "fedavg")         # warm-up (stage 1)
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
    rec.update(s_per_round=float(np.median(times)), s_per_round_min=min(times), rounds_timed=len(times),
               block_clients=eng.block_clients, tile_clients=eng.tile_clients or eng.block_clients,
               fused_optimizer=bool(eng.fused if eng.fused is not None else _fused_available(optim.name, dev)),
               closed_form_loss=eng.closed_form)
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

    from fedhead.closedform import StatsAccumulator, client_stats
    from fedhead.heads import create_head
    from fedhead.util import set_cpu_threads

    threads = set_cpu_threads(cfg.get("threads"))
    D, C, K, n, block = cfg["dim"], cfg["classes"], cfg["clients"], cfg["samples_per_client"], cfg["block"]
    rng = np.random.default_rng(0)
    centers = rng.random((C, D), dtype=np.float32)
    acc = StatsAccumulator(C, D, gram=True)
    client_s = add_s = 0.0
    for b0 in range(0, K, block):
        t0 = time.perf_counter()
        msgs = []
        for _ in range(b0, min(K, b0 + block)):
            y = rng.integers(0, C, n)
            x = centers[y] + rng.random((n, D), dtype=np.float32)
            msgs.append(client_stats(x, y, C, gram=True))
        t1 = time.perf_counter()
        for m in msgs:
            acc.add(m)
        add_s += time.perf_counter() - t1
        client_s += t1 - t0
        del msgs
    rec = {"closedform_clients": K, "closedform_dim": D, "closedform_classes": C, "closedform_threads": threads,
           "closedform_block": block, "closedform_stream_s": add_s, "closedform_client_s": client_s,
           "closedform_mb_up_per_client": acc.bytes_up / K / 1e6}
    for name in ("ridge", "lda", "ncm"):
        t0 = time.perf_counter()
        theta = create_head(name).solve(acc)
        rec[f"closedform_{name}_solve_s"] = time.perf_counter() - t0
        assert torch.isfinite(theta).all()
    rec["closedform_ridge_total_s"] = add_s + rec["closedform_ridge_solve_s"]
    rec["closedform_peak_mb"] = _peak_rss_mb()
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
    p = subprocess.run([sys.executable, "-m", "fedhead.bench.speed", json.dumps(cfg)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise FedheadError(f"speed benchmark child for {cfg['clients']} clients failed: {tail}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------- the command


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def measure_speed(*, quick: bool = False, rounds: int = 3, device: str = "cpu", threads: Optional[int] = None,
                  loop_rounds: int = 1, extraction: bool = True, progress=None) -> dict:
    """All four measurements; returns the flat record written to ``speed.json``."""
    size = QUICK if quick else PAPER
    counts = (10, 30, 100) if quick else (100, 300, 1000)
    big = dict(size, classes=40, dim=256) if quick else dict(size, classes=200, dim=1280)
    base = dict(size, device=device, threads=threads, rounds=rounds, quick=quick)
    rec: dict = {"bench_quick": quick, "bench_device": device, "bench_rounds": rounds,
                 "bench_load_before": _load(), "bench_head": "ova2", "bench_optimizer": "adamw",
                 "bench_partition": "shard(2)", "bench_epochs": size["epochs"], "bench_batch": size["batch"],
                 "bench_samples": size["samples"], "bench_dim": size["dim"], "bench_classes": size["classes"]}
    jobs = [("trainer", dict(base, clients=counts[0], machine=True, profile=True, loop_rounds=loop_rounds))]
    jobs += [(f"scale_{k}", dict(base, clients=k, loop_rounds=loop_rounds if k == counts[-1] else 0))
             for k in counts[1:]]
    jobs += [(f"scale_{counts[-1]}x{big['classes']}x{big['dim']}", dict(base, **big, clients=counts[-1], rounds=1))]
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
        else:
            for k in ("s_per_round", "peak_mb", "block_clients", "tile_clients", "matmul_gflops"):
                rec[f"{name}_{k}"] = r[k]
            if "loop_s_per_round" in r:
                rec[f"loop_{cfg['clients']}_s_per_round"] = r["loop_s_per_round"]
                rec[f"speedup_vs_loop_{cfg['clients']}"] = r["loop_s_per_round"] / r["s_per_round"]
    rec[f"scale_{counts[-1]}_vs_{counts[0]}"] = (rec[f"scale_{counts[-1]}_s_per_round"]
                                                 / rec[f"scale_{counts[0]}_s_per_round"])
    rec["trainer_bench_seconds"] = time.perf_counter() - t0
    if extraction:
        if progress:
            progress("extraction")
        rec.update(_extraction(quick, device))
    if progress:
        progress("closed-form statistics: 1000 clients x 200 classes x 1280 dims" if not quick else
                 "closed-form statistics (quick)")
    cf = dict(dim=1280, classes=200, clients=1000, samples_per_client=50, block=50) if not quick else \
        dict(dim=64, classes=10, clients=50, samples_per_client=20, block=10)
    rec.update(run_child(dict(cf, threads=threads, closedform=True)))
    rec["bench_load_after"] = _load()
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}


def _extraction(quick: bool, device: str) -> dict:
    try:
        from extract.bench import measure_extraction
    except ImportError:
        return {"extract_status": "missing: extract.bench.measure_extraction"}
    try:
        r = measure_extraction(num_images=64 if quick else 256, device=device)
    except Exception as exc:  # a broken extraction must not lose the trainer's numbers
        return {"extract_status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    out = {"extract_status": "ok"}
    for k, v in r.items():
        out[k if k.startswith("extract_") else f"extract_{k}"] = v
    return out


def speed_table(rec: dict):
    from rich.table import Table

    t = Table(title=f"fedhead bench speed ({'quick' if rec['bench_quick'] else 'paper scale'}, "
                    f"{rec['bench_device']}, {rec.get('machine_threads')} threads, load {rec['bench_load_before']})")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("note")

    def row(label, key, fmt="{:.3f}", note=""):
        if key in rec:
            v = rec[key]
            t.add_row(label, fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v),
                      note)

    row("trainer s/round", "trainer_s_per_round", note=f"{rec.get('trainer_clients')} clients, "
        f"tile {rec.get('trainer_tile_clients')}, block {rec.get('trainer_block_clients')}, "
        f"closed-form loss {rec.get('trainer_closed_form_loss')}, fused opt {rec.get('trainer_fused_optimizer')}")
    row("est. 50 rounds (s)", "trainer_est_50_rounds_s", "{:.1f}", "goal < 90")
    row("trainer matmul GFLOP/s", "trainer_matmul_gflops", "{:.1f}",
        f"{rec.get('trainer_matmul_gflop_per_round', 0):.1f} GFLOP/round over the whole round")
    row("bmm kernels GFLOP/s", "trainer_bmm_gflops", "{:.1f}", "FLOPs / profiled matmul time")
    row("machine matmul GFLOP/s", "machine_matmul_gflops", "{:.1f}", "dense fp32, same threads")
    row("matmul fraction", "trainer_matmul_fraction", "{:.1%}", "goal >= 40%")
    row("optimizer GB/s (round)", "trainer_optimizer_gb_per_s", "{:.1f}",
        f"{rec.get('trainer_optimizer_gb_per_round', 0):.1f} GB/round")
    row("optimizer GB/s (kernel)", "trainer_optimizer_only_gb_per_s", "{:.1f}", "bytes / profiled optimizer time")
    row("machine copy GB/s", "machine_copy_gb_per_s", "{:.1f}", "read + write")
    for part in ("matmul", "optimizer", "gather", "loss_other"):
        row(f"profile: {part}", f"trainer_profile_{part}_fraction", "{:.1%}",
            f"{rec.get(f'trainer_profile_{part}_s', 0):.2f} s")
    row("trainer with autograd loss s/round", "trainer_autograd_loss_s_per_round",
        note="the head's closed-form loss_and_grad switched off")
    row("loop s/round", "loop_s_per_round", note="per-client torch.optim loop")
    for key in sorted(k for k in rec if k.startswith("speedup_vs_loop_")):
        n = key.rsplit("_", 1)[1]
        row(f"speed-up vs loop ({n} clients)", key, "{:.1f}x", "goal >= 3x (100), >= 10x (1000)")
    for key in sorted((k for k in rec if k.startswith("scale_") and k.endswith("_s_per_round")),
                      key=lambda k: (len(k), k)):
        name = key[len("scale_"):-len("_s_per_round")]
        row(f"scale {name}: s/round", key, note=f"peak {rec.get(f'scale_{name}_peak_mb', 0):.0f} MB")
    for key in (k for k in rec if k.startswith("scale_") and "_vs_" in k):
        row(key.replace("_", " "), key, "{:.2f}x", "goal <= 1.5x")
    row("closed form: stream 1000 messages (s)", "closedform_stream_s", note=f"{rec.get('closedform_clients')} "
        f"clients x {rec.get('closedform_classes')} classes x {rec.get('closedform_dim')} dims, blocks of "
        f"{rec.get('closedform_block')}; {rec.get('closedform_mb_up_per_client', 0):.1f} MB per client")
    row("closed form: ridge solve (s)", "closedform_ridge_solve_s")
    row("closed form: stream + ridge solve (s)", "closedform_ridge_total_s", note="goal < 5 s")
    row("closed form: LDA / NCM solve (s)", "closedform_lda_solve_s",
        note=f"NCM {rec.get('closedform_ncm_solve_s', 0):.3f} s")
    row("closed form: peak MB", "closedform_peak_mb", "{:.0f}", "goal < 2048")
    row("closed form: clients computing their messages (s)", "closedform_client_s", note="runs on the clients")
    row("extraction images/s", "extract_images_per_sec", "{:.1f}")
    row("forward images/s", "extract_forward_images_per_sec", "{:.1f}")
    row("extraction / forward", "extract_fraction_of_forward", "{:.3f}")
    if rec.get("extract_status", "ok") != "ok":
        t.add_row("extraction", "-", rec["extract_status"])
    t.add_row("load (1/5/15 min)", rec.get("bench_load_after", ""), "after; before " + rec["bench_load_before"])
    return t


@cli_errors
def speed_cmd(
    out: Path = typer.Option(Path("speed.json"), "--out", help="JSON file for the flat record."),
    quick: bool = typer.Option(False, "--quick", help="Small sizes (smoke test, seconds)."),
    rounds: int = typer.Option(3, "--rounds", help="Timed rounds per configuration (after one warm-up round)."),
    loop_rounds: int = typer.Option(1, "--loop-rounds", help="Timed rounds of the loop backend."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | auto"),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads (default: all cores, or "
                                          "FEDHEAD_THREADS)."),
    extraction: bool = typer.Option(True, "--extraction/--no-extraction", help="Also time `fedhead extract`."),
) -> None:
    """Trainer speed vs the machine's matmul/memory limits, vs a per-client loop, and in 100..1000 clients."""
    from fedhead.util import atomic_write_json, check_out, resolve_device, stderr_console, stdout_console

    check_out(out)                      # a folder there, or below a file: refused before the measurement
    validate("--rounds", rounds, Interval(1, None, integer=True))
    validate("--loop-rounds", loop_rounds, Interval(0, None, integer=True))
    if threads is not None:
        validate("--threads", threads, Interval(1, None, integer=True))
    resolve_device(device)
    err = stderr_console()
    rec = measure_speed(quick=quick, rounds=rounds, device=device, threads=threads, loop_rounds=loop_rounds,
                        extraction=extraction, progress=lambda s: err.print(f"[bold]bench speed[/]: {s}"))
    atomic_write_json(out, rec)
    stdout_console().print(speed_table(rec))
    stdout_console().print(str(out))


if __name__ == "__main__":
    _cfg = json.loads(sys.argv[1])
    print(json.dumps(closed_form_speed(_cfg) if _cfg.get("closedform") else run_config(_cfg)), flush=True)
