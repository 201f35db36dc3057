"""Extraction across processes, GPUs and machines, on existing engines (the shards and parts: extract/shards.py).

* **Ranks** (``torchrun``, or ``--processes N`` on one machine): torch's elastic launcher starts the ranks
  (``--processes N`` calls it in-process, as ``torchrun --standalone --nproc-per-node N`` would); each rank loads the
  encoder (``cuda:<local rank>`` on a GPU node; ``--threads`` CPU threads each, by default the cores divided among
  the node's ranks), encodes the missing shards ``rank, rank + world, ...`` and writes their parts; rank 0 merges
  after a barrier (torch.distributed's gloo group). Under an outside ``torchrun`` the same code runs: fedhead reads
  the ranks from torchrun's environment.
* **Ray** (``--engine ray [--ray-address ADDR]``): Ray Data's ``map_batches`` with an actor pool of ``--processes``
  encoders (one GPU each where the cluster has GPUs, else ``--threads`` CPUs); each actor encodes whole shards and
  returns their arrays, which the driver writes as parts as they arrive, then merges. The input files must be
  readable at the same path on every node (a shared filesystem); the parts and the store are written by the driver.

Which shards exist is settled before any rank writes (every rank lists the parts folder between two barriers), so
the missing shards are divided evenly among the ranks on a re-run; the order of the store is the order of the
input, whatever finishes first. No scheduler of fedhead's own: the launcher, the gloo barrier and Ray Data's actor
pool do that work.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from extract.run import Plan, _reusable, extract_features, prepare, store_path
from extract.shards import (
    DEFAULT_SHARD_IMAGES,
    Part,
    Shard,
    done_shards,
    encode_shard,
    merge,
    parts_dir,
    plan_shards,
    request_json,
    write_part,
)
from fedhead.infra.console import make_progress
from fedhead.infra.errors import FedheadError, Interval, OneOf, validate
from fedhead.infra.exits import debug_enabled
from fedhead.infra.locks import exclusive_writer
from fedhead.infra.signals import signals_deferred, signals_raise

ENGINES = ("local", "ray")
RAY_CONNECT_TIMEOUT_S = 10.0  # a --ray-address that does not accept a connection within this is a one-line error
BARRIER_TIMEOUT = datetime.timedelta(hours=24)  # ranks wait this long for the slowest rank's last shard
KILL_ENV = "FEDHEAD_TEST_KILL_AFTER_BATCHES"  # test hook: SIGKILL a rank after k batches ...
KILL_RANK_ENV = "FEDHEAD_TEST_KILL_RANK"  # ... only rank r (default: every rank)


@dataclass(frozen=True)
class Job:
    """One sharded extraction: the request's arguments (``prepare``'s keywords in ``kw``) and how to run it. It
    travels to every rank and actor, so it holds plain values only."""

    dataset: str
    data_dir: Any
    encoder: str
    kw: dict = field(default_factory=dict)
    out: Any = None
    overwrite: bool = False
    skip_corrupt: bool = False
    progress: bool = True
    processes: int = 1
    engine: str = "local"
    ray_address: str | None = None
    shard_images: int = DEFAULT_SHARD_IMAGES


def under_torchrun() -> bool:
    """True in a process started by torchrun (or torch's elastic launcher): its environment names the ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def extract(
    dataset: str,
    data_dir: Any,
    encoder: str,
    *,
    processes: int = 1,
    engine: str = "local",
    ray_address: str | None = None,
    shard_images: int | None = None,
    out: Any = None,
    overwrite: bool = False,
    skip_corrupt: bool = False,
    progress: bool = True,
    **kw: Any,
) -> Path:
    """``fedhead extract``: one process (:func:`extract.run.extract_features`), or sharded over ``processes`` ranks
    on this machine, the ranks of an outside ``torchrun``, or a Ray cluster (``engine="ray"``). ``kw`` are
    :func:`extract.run.prepare`'s keywords. The store equals the single-process one either way."""
    validate("--processes", processes, Interval(1, None, integer=True))
    validate("--engine", engine, OneOf(ENGINES))
    if shard_images is not None:
        validate("--shard-images", shard_images, Interval(1, None, integer=True))
    if ray_address is not None and engine != "ray":
        raise FedheadError(
            f"The '--ray-address' parameter needs --engine ray. Got --engine {engine!r} instead. Add --engine ray."
        )
    job = Job(dataset, data_dir, encoder, kw, out, overwrite, skip_corrupt, progress, processes, engine,
              ray_address, shard_images or DEFAULT_SHARD_IMAGES)  # fmt: skip
    if under_torchrun():
        if processes > 1 or engine == "ray":
            raise FedheadError(
                f"The '--processes' parameter is {processes} (--engine {engine}) in a process started by torchrun, "
                "which already sets the ranks. Leave out --processes and --engine under torchrun."
            )
        env = os.environ
        return run_rank(job, int(env["RANK"]), int(env["WORLD_SIZE"]), _local(env))
    if engine == "ray":
        check_ray_address(ray_address)
        return ray_extract(job)
    if processes == 1 and shard_images is None:
        return extract_features(
            dataset, data_dir, encoder, out=out, overwrite=overwrite, skip_corrupt=skip_corrupt, progress=progress, **kw
        )
    return launch_local(job)


def _local(env) -> tuple[int, int]:
    return int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1)))


# ---------------------------------------------------------------- one rank


SOURCE_OPTIONS = ("train_shards", "test_shards", "image_column", "label_column")  # extract_features -> prepare


def prepare_kw(kw: dict) -> dict:
    """:func:`extract.run.extract_features`' keywords as :func:`extract.run.prepare` takes them (the formats'
    options in one ``source_options`` dict)."""
    kw = dict(kw)
    options = {k: kw.pop(k, None) for k in SOURCE_OPTIONS}
    if any(v is not None for v in options.values()):
        kw["source_options"] = options
    return kw


def rank_kw(kw: dict, local_rank: int, local_world: int) -> dict:
    """``prepare``'s keywords for one of ``local_world`` ranks on a node: its own GPU (``cuda:<local rank>``), or a
    share of the cores (``--threads`` default) with the images decoded inline (no core is left for a worker)."""
    import torch

    kw = prepare_kw(kw)
    device = kw.get("device", "auto")
    if device in ("auto", "cuda") and torch.cuda.is_available():
        kw["device"] = f"cuda:{local_rank % torch.cuda.device_count()}"
    elif device == "auto" or device == "cpu":
        share = max(1, (os.cpu_count() or 1) // max(1, local_world))
        if kw.get("threads") is None:
            kw["threads"] = share
        if kw.get("num_workers") is None:
            kw["num_workers"] = 0 if kw["threads"] >= share else 1
    return kw


class _Group:
    """The ranks' barrier: torch.distributed's gloo group (set up from torchrun's environment), or nothing for one
    rank."""

    def __init__(self, world: int):
        import torch.distributed as dist

        self.dist, self.own = dist, False
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
            self.own = True
        self.on = world > 1

    def barrier(self) -> None:
        if self.on:
            self.dist.barrier()

    def close(self) -> None:
        if self.own:
            self.dist.destroy_process_group()


def _kill_hook(rank: int):
    """Test hook: SIGKILL this rank after ``FEDHEAD_TEST_KILL_AFTER_BATCHES`` batches (``FEDHEAD_TEST_KILL_RANK``:
    only that rank)."""
    k = int(os.environ.get(KILL_ENV, "0") or 0)
    only = os.environ.get(KILL_RANK_ENV)
    if not k or (only not in (None, "") and int(only) != rank):
        return None
    seen = [0]

    def hook(_batch) -> None:
        seen[0] += 1
        if seen[0] >= k:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _attrs(plan: Plan, engine: str, workers: int, rows: int) -> dict:
    return {**plan.attrs, "extraction": {"engine": engine, "workers": workers, "shard_images": rows}}


def run_rank(job: Job, rank: int, world: int, local: tuple[int, int] = (0, 1)) -> Path:
    """One rank of a sharded extraction: encode this rank's share of the missing shards into parts; rank 0 merges
    them once every rank is done. Every rank returns the store's path."""
    plan = prepare(job.dataset, job.data_dir, job.encoder, **rank_kw(job.kw, *local))
    out = store_path(plan, job.data_dir, job.encoder, job.out)
    folder = parts_dir(out)
    group = _Group(world)
    try:
        if _reusable(out, plan, job.overwrite, job.skip_corrupt, job.progress and rank == 0):
            return out
        shards = plan_shards({s: len(v) for s, v in plan.splits.items()}, plan.batch_size, job.shard_images)
        req = request_json(plan)
        if rank == 0 and job.overwrite:
            done_shards(folder, shards, req, drop_foreign=True)
        group.barrier()
        done = done_shards(folder, shards, req)
        group.barrier()  # every rank has listed the parts before any rank writes one
        missing = [s for s in shards if s not in done]
        _encode_shards(plan, job, folder, missing[rank::world], (len(shards), len(done)), rank)
        group.barrier()
        if rank == 0:
            with exclusive_writer(out, repr(str(out))):
                merge(plan, shards, folder, out, job.skip_corrupt, _attrs(plan, job.engine, world, shards[0].stop))
        group.barrier()
        return out
    finally:
        group.close()


def _encode_shards(plan: Plan, job: Job, folder: Path, mine: list[Shard], counts: tuple[int, int], rank: int) -> None:
    """Encode ``mine`` into parts; rank 0 shows a bar of every rank's finished parts."""
    req = request_json(plan)
    hook = _kill_hook(rank)
    total, done = counts
    show = job.progress and rank == 0
    with make_progress(enabled=show) as prog:
        task = prog.add_task("shards", total=total, completed=done, info="")
        for shard in mine:
            t0 = time.perf_counter()
            part = encode_shard(plan, shard, job.skip_corrupt, hook)
            with signals_deferred():
                write_part(folder, shard, part, req, time.perf_counter() - t0, f"rank{rank}")
            if show:
                prog.update(task, completed=done + sum(1 for _ in folder.glob("*.h5")))


# ---------------------------------------------------------------- ranks on this machine


def _rank_entry(job: Job, errors: str) -> str:
    """A rank started by :func:`launch_local`: its one-line error goes to ``errors/rank<r>.txt`` for the launcher."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        with signals_raise():
            return str(run_rank(job, rank, world, _local(os.environ)))
    except FedheadError as exc:
        Path(errors, f"rank{rank}.txt").write_text(str(exc))
        raise SystemExit(getattr(exc, "exit_code", 1)) from None
    except Exception as exc:  # noqa: BLE001 - a rank's failure becomes the launcher's one line
        if debug_enabled():
            raise
        Path(errors, f"crash{rank}.txt").write_text(
            f"Extraction process {rank} of {world} failed: {type(exc).__name__}: {exc} (FEDHEAD_DEBUG=1 shows where)."
        )
        raise SystemExit(1) from None


def launch_local(job: Job) -> Path:
    """``--processes N``: start N ranks on this machine with torch's elastic launcher (``torchrun --standalone``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=job.processes, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", run_id=str(uuid.uuid4()), max_restarts=0,
                          monitor_interval=0.2, start_method="spawn")  # fmt: skip
    errors = tempfile.mkdtemp(prefix="fedhead-extract-")
    try:
        with _quiet_launcher():
            got = elastic_launch(config, _rank_entry)(job, errors)
        return Path(got[0])
    except ChildFailedError as exc:
        raise _rank_failure(exc, Path(errors), job) from None
    finally:
        shutil.rmtree(errors, ignore_errors=True)


@contextlib.contextmanager
def _quiet_launcher():
    """The elastic launcher logs every start and failure; fedhead says what matters in one line instead."""
    loggers = [
        logging.getLogger(n)
        for n in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    ]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, old):
            lg.setLevel(level)


def _rank_failure(exc, errors: Path, job: Job) -> FedheadError:
    """One line for a failed launch, the root cause first: a rank's own one-line error (bad input), else a rank
    killed by a signal (the others then fail at the barrier or are stopped), else a rank's unexpected error."""
    for path in sorted(errors.glob("rank*.txt")):
        text = path.read_text()
        if not text.startswith("interrupted"):
            return FedheadError(text)
    for rank, failure in sorted(exc.failures.items()):
        if failure.exitcode < 0 and not (errors / f"rank{rank}.txt").exists():
            return FedheadError(
                f"Extraction process {rank} of {job.processes} was killed by {failure.signal_name()}. The shards "
                "finished so far are kept: re-run the same command to encode only the missing ones."
            )
    for path in sorted(errors.glob("crash*.txt")):
        return FedheadError(path.read_text())
    rank, failure = exc.get_first_failure()
    return FedheadError(
        f"Extraction process {rank} of {job.processes} exited with code {failure.exitcode}. The shards finished so far "
        "are kept: re-run the same command to encode only the missing ones."
    )


# ---------------------------------------------------------------- Ray


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS frame


def check_ray_address(address: str | None, timeout: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """A ``--ray-address`` HOST:PORT (or ray://HOST:PORT) must answer as a gRPC server (a Ray head's GCS, or the Ray
    Client server) within ``timeout`` seconds: it must accept the connection and reply to HTTP/2's connection
    preface with a SETTINGS frame. A port that accepts and stays silent (a firewall, a proxy, another program) is
    a one-line error too, where ``ray.init`` would wait. ``auto``, ``local`` and no address are left to Ray."""
    if address in (None, "", "auto", "local"):
        return
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise FedheadError(
            f"The '--ray-address' parameter must be HOST:PORT, ray://HOST:PORT, auto or local. Got {address!r} "
            "instead. Give the address 'ray start --head' printed."
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as conn:
            conn.settimeout(timeout)
            conn.sendall(H2_PREFACE)
            reply = conn.recv(9)
    except OSError as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__).lower()
        raise FedheadError(
            f"The '--ray-address' parameter is {address!r}, but nothing answered there within {timeout:g} s ({why}). "
            "Start the cluster's head with 'ray start --head', or check the address and port."
        ) from None
    if len(reply) < 9 or reply[3] != 4:  # an HTTP/2 frame header: length (3 bytes), type 4 = SETTINGS
        raise FedheadError(
            f"The '--ray-address' parameter is {address!r}, but what answered there is not a Ray cluster (no gRPC "
            "reply). Give the address 'ray start --head' printed (the GCS port, 6379 by default)."
        )


class RayShardEncoder:
    """A Ray Data actor: loads the encoder once, then encodes whole shards (one per call) into arrays."""

    def __init__(self, job: Job, threads: int):
        kw = rank_kw({**job.kw, "threads": job.kw.get("threads") or threads}, 0, 1)
        self.job, self.error = job, ""
        try:
            self.plan = prepare(job.dataset, job.data_dir, job.encoder, **kw)
        except FedheadError as exc:
            self.plan, self.error = None, str(exc)

    def __call__(self, batch: dict) -> dict:
        shard = Shard(str(batch["split"][0]), int(batch["start"][0]), int(batch["stop"][0]))
        row: dict[str, Any] = {"split": [shard.split], "start": [shard.start], "stop": [shard.stop]}
        try:
            if self.plan is None:
                raise FedheadError(self.error)
            t0 = time.perf_counter()
            part = encode_shard(self.plan, shard, self.job.skip_corrupt)
            row.update(seconds=[time.perf_counter() - t0], worker=[f"ray:{socket.gethostname()}:{os.getpid()}"])
            clients = part.clients if part.clients is not None else np.zeros(0, np.int64)
            row.update(features=[part.features], labels=[part.labels], skipped=[part.skipped], clients=[clients],
                       has_clients=[part.clients is not None], names=[json.dumps(list(part.skipped_names))],
                       request=[request_json(self.plan)], error=[""])  # fmt: skip
        except FedheadError as exc:
            row.update(features=[np.zeros((0, 1), np.float32)], labels=[np.zeros(0, np.int64)],
                       skipped=[np.zeros(0, np.int64)], clients=[np.zeros(0, np.int64)], has_clients=[False],
                       names=["[]"], request=[""], error=[str(exc)], seconds=[0.0], worker=[""])  # fmt: skip
        return {k: np.array(v, dtype=object) if k in ("features", "labels", "skipped", "clients") else np.array(v)
                for k, v in row.items()}  # fmt: skip


RAY_DATA_ENV = {  # Ray Data's resource coordinator answers within 5 s by default; a loaded head node misses that
    "RAY_DATA_AUTOSCALING_COORDINATOR_REQUEST_GET_TIMEOUT_S": "30",  # 10 times over and the whole job stops
}


def _ray_init(job: Job, threads: int):
    for key, value in RAY_DATA_ENV.items():  # read when ray.data is imported: set before it
        os.environ.setdefault(key, value)
    import ray

    if ray.is_initialized():
        return ray, False
    local = job.ray_address in (None, "", "local")
    # one CPU beside the actors' for Ray Data's read tasks (without it they wait for an actor's CPU)
    kwargs = {"num_cpus": job.processes * threads + 1} if local else {"address": job.ray_address}
    # the actors import fedhead as this process does (a source checkout on sys.path, not only an installed package)
    path = os.pathsep.join(
        [p for p in sys.path if p] + ([os.environ["PYTHONPATH"]] if "PYTHONPATH" in os.environ else [])
    )
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": path}}, **kwargs)  # fmt: skip
    return ray, True


def ray_extract(job: Job) -> Path:
    """``--engine ray``: an actor pool of ``--processes`` encoders over the missing shards (Ray Data), the parts
    written here as they arrive, then the merge."""
    plan = prepare(job.dataset, job.data_dir, job.encoder, **{**prepare_kw(job.kw), "device": "cpu", "threads": 1})
    out = store_path(plan, job.data_dir, job.encoder, job.out)
    if _reusable(out, plan, job.overwrite, job.skip_corrupt, job.progress):
        return out
    folder = parts_dir(out)
    shards = plan_shards({s: len(v) for s, v in plan.splits.items()}, plan.batch_size, job.shard_images)
    req = request_json(plan)
    done = done_shards(folder, shards, req, drop_foreign=job.overwrite)
    missing = [s for s in shards if s not in done]
    threads = job.kw.get("threads") or max(1, (os.cpu_count() or 1) // job.processes)
    with exclusive_writer(out, repr(str(out))):
        if missing:
            _ray_encode(job, plan, folder, missing, (len(shards), len(done)), threads)
        merge(plan, shards, folder, out, job.skip_corrupt, _attrs(plan, "ray", job.processes, shards[0].stop))
    return out


def _ray_encode(job: Job, plan: Plan, folder: Path, missing: list[Shard], counts: tuple[int, int], threads: int):
    ray, started = _ray_init(job, threads)
    quiet = logging.getLogger("ray"), logging.getLogger("ray.data")
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)  # Ray Data's progress and autoscaling notes: the bar below says what matters
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        gpus = _ray_gpus(ray, job.kw.get("device", "auto"))
        items = [{"split": s.split, "start": s.start, "stop": s.stop} for s in missing]
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            RayShardEncoder, fn_constructor_kwargs={"job": job, "threads": threads}, batch_size=1,
            concurrency=job.processes, num_cpus=0 if gpus else threads, num_gpus=gpus, batch_format="numpy",
        )  # fmt: skip
        req = request_json(plan)
        with make_progress(enabled=job.progress) as prog:
            task = prog.add_task("shards", total=counts[0], completed=counts[1], info="")
            for row in ds.iter_rows():
                _write_ray_part(folder, row, req)
                prog.advance(task)
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
        if started:
            ray.shutdown()


def _ray_gpus(ray, device: str) -> int:
    """One GPU per actor for ``--device cuda``, and for ``auto`` where the cluster has GPUs; else none."""
    if device == "auto":
        return 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    return 1 if device.startswith("cuda") else 0


def _write_ray_part(folder: Path, row: dict, req: str) -> None:
    if row["error"]:
        raise FedheadError(str(row["error"]))
    shard = Shard(str(row["split"]), int(row["start"]), int(row["stop"]))
    if row["request"] != req:
        raise FedheadError(
            f"The '--engine' parameter is 'ray', but a worker encoded {shard.name} for a different request than this "
            "machine's (another encoder, weights or image list on that node). Make every node see the same files."
        )
    part = Part(
        features=np.asarray(row["features"], dtype=np.float32),
        labels=np.asarray(row["labels"], dtype=np.int64),
        skipped=np.asarray(row["skipped"], dtype=np.int64),
        clients=np.asarray(row["clients"], dtype=np.int64) if row["has_clients"] else None,
        skipped_names=tuple(json.loads(row["names"])),
    )
    with signals_deferred():
        write_part(folder, shard, part, req, float(row["seconds"]), str(row["worker"]))
