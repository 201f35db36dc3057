"""``fedhead bench extract``: throughput of the whole extraction pipeline against the bare encoder forward.

Both are measured in one run on the same batches: the pipeline (data loading/decoding, resize, normalise,
forward, device->host copy, fp16 conversion and the HDF5 write through StoreWriter into a temporary store)
and the forward alone on the prepared input tensors of that same pipeline. Forward and pipeline timings
alternate (``repeats`` rounds, forward also last) and the best of each is reported (timm benchmark
style: the least-disturbed run), so drifting machine load affects both sides alike. The record has
flat prefixed keys (timm ``benchmark.py`` style); an out-of-memory error retries with half the batch.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

from extract.engines import extract
from extract.run import encode, forward, iter_batches, prepare, to_input
from extract.store import StoreWriter, open_store
from fedhead.infra.console import stdout_console
from fedhead.infra.errors import Interval, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_json, check_out
from fedhead.infra.signals import ROUNDS_PAUSE_ENV, pause_hook


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_once(
    dataset,
    data_dir,
    encoder,
    *,
    weights,
    pretrained,
    image_size,
    batch_size,
    device,
    precision,
    num_images,
    num_workers,
    dtype,
    split,
    repeats,
) -> dict:
    import torch

    plan = prepare(
        dataset,
        data_dir,
        encoder,
        weights=weights,
        pretrained=pretrained,
        image_size=image_size,
        batch_size=batch_size,
        device=device,
        precision=precision,
        limit=num_images,
        dtype=dtype,
        num_workers=num_workers,
        splits=(split,),
    )
    data = plan.splits[split]
    n = len(data)
    # prepared inputs of the same batches (the forward-only side), and one warm-up forward
    inputs = [to_input(plan, b.x) for b in iter_batches(plan, split) if b.x is not None]
    forward(plan, inputs[0])
    _sync(plan.device)

    def time_forward() -> float:
        t = time.perf_counter()
        for x in inputs:
            forward(plan, x)
        _sync(plan.device)
        return time.perf_counter() - t

    def time_pipeline() -> float:
        with tempfile.TemporaryDirectory(prefix="fedhead-bench-") as tmp:
            t = time.perf_counter()
            with StoreWriter(
                Path(tmp) / "bench.h5",
                request={"bench": True},
                sizes={split: n},
                feature_dim=plan.encoder.feature_dim,
                class_names=data.class_names,
                attrs={},
                dtype=dtype,
            ) as w:
                for b in iter_batches(plan, split):
                    w.append(split, encode(plan, b), b.labels, [u.index for u in b.skipped])
                w.finish()
            _sync(plan.device)
            return time.perf_counter() - t

    fwd_t, ext_t = [], []

    for _ in range(repeats):  # alternate, so that drifting machine load hits both sides alike
        fwd_t.append(time_forward())
        ext_t.append(time_pipeline())
        pause_hook(ROUNDS_PAUSE_ENV, len(ext_t))  # test hook: after the k-th repeat
    fwd_t.append(time_forward())
    fwd, ext = min(fwd_t), min(ext_t)
    return {
        "bench_dataset": plan.request["dataset"],
        "bench_split": split,
        "bench_encoder": encoder,
        "bench_image_size": plan.encoder.preprocessing.image_size,
        "bench_batch_size": batch_size,
        "bench_num_images": n,
        "bench_device": str(plan.device),
        "bench_precision": precision,
        "bench_dtype": dtype,
        "bench_num_workers": plan.num_workers,
        "bench_in_memory": data.in_memory,
        "bench_torch_threads": torch.get_num_threads(),
        "bench_feature_dim": plan.encoder.feature_dim,
        "extract_seconds": round(ext, 4),
        "extract_images_per_sec": round(n / ext, 2),
        "forward_seconds": round(fwd, 4),
        "forward_images_per_sec": round(n / fwd, 2),
        "bench_repeats": repeats,
        "extract_images_per_sec_all": [round(n / t, 2) for t in ext_t],
        "forward_images_per_sec_all": [round(n / t, 2) for t in fwd_t],
        "extract_fraction_of_forward": round(fwd / ext, 4),
    }


def measure_extraction(
    dataset: str = "digits",
    data_dir=None,
    encoder: str = "tf_efficientnet_lite0",
    *,
    weights=None,
    pretrained: bool = False,
    image_size: Optional[int] = 96,
    batch_size: int = 64,
    device: str = "auto",
    precision: str = "fp32",
    num_images: int = 512,
    num_workers: Optional[int] = None,
    dtype: str = "float16",
    split: str = "train",
    repeats: int = 2,
) -> dict:
    """Images/s of the extraction pipeline and of the bare forward on the same batches (flat dict).

    Retries with half the batch size after an out-of-memory error (``bench_batch_size`` is the size used).
    """
    import torch

    validate("--num-images", num_images, Interval(1, None, integer=True))
    validate("--repeats", repeats, Interval(1, None, integer=True))
    bs = batch_size
    while True:
        try:
            return _measure_once(
                dataset,
                data_dir,
                encoder,
                weights=weights,
                pretrained=pretrained,
                image_size=image_size,
                batch_size=bs,
                device=device,
                precision=precision,
                num_images=num_images,
                num_workers=num_workers,
                dtype=dtype,
                split=split,
                repeats=repeats,
            )
        except (torch.cuda.OutOfMemoryError, MemoryError):
            if bs <= 1:
                raise
            bs //= 2
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def measure_processes(
    dataset: str = "digits",
    data_dir=None,
    encoder: str = "tf_efficientnet_lite0",
    *,
    weights=None,
    pretrained: bool = False,
    image_size: Optional[int] = 96,
    batch_size: int = 64,
    num_images: int = 512,
    processes: int = 2,
    threads: int = 1,
    repeats: int = 2,
) -> dict:
    """One extraction process of ``threads`` CPU threads against ``processes`` such processes (``--processes``), on the
    same ``num_images`` images per split, both through the same launcher and shards (``num_images / processes`` per
    shard, so each rank gets one shard of each split) and each decoding its images inline. Two numbers each: the
    steady state (all images over the busiest rank's encoding seconds, from the store's ``extraction`` attribute)
    and end to end (wall seconds with start-up, model loading and the merge). The runs alternate ``repeats`` times
    and the best of each is kept (the machine's speed drifts); the stores must be equal (same content hash)."""
    validate("--num-images", num_images, Interval(1, None, integer=True))
    validate("--processes", processes, Interval(2, None, integer=True))
    runs: dict = {1: [], processes: []}
    hashes = set()
    for _ in range(repeats):
        for n in runs:
            with tempfile.TemporaryDirectory(prefix="fedhead-bench-") as tmp:
                t = time.perf_counter()
                out = extract(dataset, data_dir, encoder, processes=n, shard_images=max(1, num_images // processes),
                              out=Path(tmp) / "p.h5", progress=False, weights=weights, pretrained=pretrained,
                              image_size=image_size, batch_size=batch_size, limit=num_images, threads=threads,
                              num_workers=0)  # fmt: skip
                wall = time.perf_counter() - t
                info = open_store(out)
                images = sum(info.attrs["request"]["sizes"].values())
                runs[n].append((info.attrs["extraction"]["images_per_sec"], wall))
                hashes.add(info.attrs["content_sha256"])
    rec: dict = {}
    for n, got in runs.items():
        rec.update({f"procs{n}_images_per_sec": max(r[0] for r in got), f"procs{n}_wall_s": round(min(r[1] for r in got), 2),
                    f"procs{n}_end_to_end_images_per_sec": round(images / min(r[1] for r in got), 2),
                    f"procs{n}_images_per_sec_all": [r[0] for r in got]})  # fmt: skip
    rec.update(
        procs_num_images=images,
        procs_threads=threads,
        procs_processes=processes,
        procs_repeats=repeats,
        procs_speedup=round(rec[f"procs{processes}_images_per_sec"] / rec["procs1_images_per_sec"], 3),
        procs_end_to_end_speedup=round(rec["procs1_wall_s"] / rec[f"procs{processes}_wall_s"], 3),
        procs_same_store=len(hashes) == 1,
    )
    return rec


@cli_errors
def bench_extract_cmd(
    dataset: str = typer.Option("digits", "--dataset"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir"),
    encoder: str = typer.Option("tf_efficientnet_lite0", "--encoder"),
    weights: Optional[str] = typer.Option(
        None,
        "--weights",
        help="Checkpoint file or 'registry' (speed does not depend on the weights; default random init).",
    ),
    pretrained: bool = typer.Option(False, "--pretrained/--no-pretrained"),
    image_size: Optional[int] = typer.Option(96, "--image-size"),
    batch_size: int = typer.Option(64, "--batch-size"),
    device: str = typer.Option("auto", "--device"),
    precision: str = typer.Option("fp32", "--precision"),
    num_images: int = typer.Option(512, "--num-images", help="Images of the split to time (seeded selection)."),
    num_workers: Optional[int] = typer.Option(None, "--num-workers"),
    repeats: int = typer.Option(2, "--repeats", help="Alternating forward/pipeline timings; best of each."),
    out: Optional[Path] = typer.Option(None, "--out", help="JSON file for the record (default: stdout only)."),
) -> None:
    """Extraction throughput vs the bare encoder forward on the same batches (images/s)."""
    from rich.table import Table

    if out is not None:
        check_out(out)  # a folder there, or below a file: refused before the measurement
    rec = measure_extraction(
        dataset,
        data_dir,
        encoder,
        weights=weights,
        pretrained=pretrained,
        image_size=image_size,
        batch_size=batch_size,
        device=device,
        precision=precision,
        num_images=num_images,
        num_workers=num_workers,
        repeats=repeats,
    )
    t = Table(
        title=f"extraction vs forward: {rec['bench_encoder']} @ {rec['bench_image_size']}px, "
        f"{rec['bench_dataset']}, {rec['bench_device']}, {rec['bench_num_images']} images"
    )
    t.add_column("measure")
    t.add_column("images/s", justify="right")
    t.add_row("forward only (same batches)", f"{rec['forward_images_per_sec']:.1f}")
    t.add_row("full extraction pipeline", f"{rec['extract_images_per_sec']:.1f}")
    t.add_row("extraction / forward", f"{rec['extract_fraction_of_forward']:.3f}")
    stdout_console().print(t)
    if out is not None:
        atomic_write_json(out, rec)
        stdout_console().print(str(out))
    else:
        stdout_console().print(json.dumps(rec), soft_wrap=True)
