"""Feature extraction: dataset -> frozen encoder -> HDF5 feature store (see extract/store.py).

``extract_features(...)`` is the Python API behind ``fedhead extract``. The pipeline, shared with the
benchmark (extract/bench.py):

* in-memory datasets (CIFAR pickles, MNIST idx, digits) are sliced as uint8 [B,H,W,C] batches and
  resized/cropped/normalised as whole batches (no per-image Python work);
* file datasets (imagefolder, tinyimagenet) are decoded in DataLoader workers (CPU: one, and only when a
  core is left over by the forward's threads, else inline; GPU: up to 8); same-size images are stacked as
  uint8 and resized as a batch on the device, mixed sizes are finished per image in the worker;
* the resize + crop of small images is two GEMMs (encoders.preprocess_batch), a few ms per batch of
  64: on the CPU the forward is the bottleneck and in-memory datasets need no worker at all;
* GPU: pinned memory, non-blocking copies, channels_last, autocast bf16/fp16 (``--precision``);
  CPU: the same code with torch's intra-op threads set to the core count.

Features are written batch by batch through :class:`extract.store.StoreWriter` (``<out>.partial``,
renamed when complete); re-running the same request resumes at the first missing row and gives the
same file as an uninterrupted run. ``--limit N`` keeps N images per split chosen by
:func:`extract.datasets.select_limit` (seeded class-stratified round-robin, kept in dataset order).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from fedhead.errors import FedheadError, Interval, OneOf, unknown_name, validate

from . import datasets as D
from .encoders import Encoder, load_encoder, preprocess_batch
from .store import StoreWriter, open_store, partial_path

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = ("float16", "float32")
KILL_ENV = "FEDHEAD_TEST_KILL_AFTER_BATCHES"  # test hook: SIGKILL this process after k written batches


def sanitize(name: str) -> str:
    return name.replace(":", "_").replace("/", "_")


def dataset_label(dataset: str, data_dir) -> str:
    """The dataset's identity in paths and metadata: the folder name for ``imagefolder``."""
    if dataset == "imagefolder" and data_dir is not None:
        return Path(data_dir).resolve().name or dataset
    return dataset


def default_out(dataset: str, data_dir, encoder: str, image_size: int, default_size: int) -> Path:
    stem = sanitize(encoder) + (f"-{image_size}" if image_size != default_size else "")
    return Path("cache") / dataset_label(dataset, data_dir) / f"{stem}.h5"


@dataclass
class Plan:
    """Everything an extraction run needs, resolved once."""

    dataset: str
    encoder: Encoder
    splits: dict            # split -> ImageSplit (already limited)
    device: object          # torch.device
    precision: str
    dtype: str
    batch_size: int
    num_workers: int
    channels_last: bool
    request: dict
    attrs: dict


def _autocast(device, precision: str):
    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def prepare(dataset: str, data_dir, encoder: str, *, weights=None, pretrained: bool = True, image_size=None,
            batch_size: int = 64, device: str = "auto", precision: str = "fp32", limit=None,
            dtype: str = "float16", download: bool = False, num_workers=None, splits=D.SPLITS,
            state_dict=None) -> Plan:
    """Validate every input, load the data and the encoder, and build the store request."""
    import torch

    from fedhead.util import resolve_device, set_cpu_threads

    validate("--batch-size", batch_size, Interval(1, None, integer=True))
    validate("--precision", precision, OneOf(PRECISIONS))
    validate("--dtype", dtype, OneOf(DTYPES))
    if limit is not None:
        validate("--limit", limit, Interval(1, None, integer=True), "Leave it out to extract every image.")
    if num_workers is not None:
        validate("--num-workers", num_workers, Interval(0, None, integer=True))
    if dataset not in D.DATASETS:
        raise unknown_name("--dataset", dataset, D.DATASETS, "dataset")
    dev = resolve_device(device)
    threads = set_cpu_threads() if dev.type == "cpu" else 0
    data = {s: D.load_dataset(dataset, data_dir, s, download=download) for s in splits}
    for s in splits:
        if limit is not None:
            data[s] = data[s].subset(D.select_limit(data[s].labels, limit))
    enc = load_encoder(encoder, weights=weights, pretrained=pretrained, image_size=image_size,
                       state_dict=state_dict)
    enc.model.to(dev)
    channels_last = dev.type == "cuda"
    if channels_last:
        enc.model.to(memory_format=torch.channels_last)
    if num_workers is None:
        paths = any(not data[s].in_memory for s in splits)
        if dev.type == "cuda":  # decode in workers, resize on the GPU; in-memory data needs no workers
            num_workers = min(8, os.cpu_count() or 1) if paths else 0
        else:
            # One worker decodes the next images only on a core the forward's threads leave free: a worker
            # sharing a core with an OpenMP thread stalls the whole forward at its barriers (measured on
            # 2 cores, 2 threads: extraction/forward 0.79-0.86 with a worker, 0.91-0.95 decoding inline).
            num_workers = 1 if paths and (os.cpu_count() or 1) > threads else 0
    label = dataset_label(dataset, data_dir)
    class_names = data[splits[0]].class_names
    pre = enc.preprocessing.as_dict()
    request = {
        "dataset": label, "loader": dataset, "encoder": encoder, "weights_sha256": enc.weights_sha256,
        "preprocessing": pre, "image_size": enc.preprocessing.image_size, "dtype": dtype, "precision": precision,
        "limit": limit, "limit_seed": D.LIMIT_SEED if limit is not None else None,
        "sizes": {s: len(data[s]) for s in splits},
        "labels_sha256": {s: hashlib.sha256(np.ascontiguousarray(data[s].labels).tobytes()).hexdigest()
                          for s in splits},
        "class_names": class_names,
        "batch_size": batch_size,  # batch composition can change the last bits of the features
    }
    attrs = {
        "dataset": label, "dataset_loader": dataset,
        "data_dir": str(Path(data_dir).resolve()) if data_dir is not None else "",
        "encoder": encoder, "encoder_family": enc.cfg.family, "weights_source": enc.weights_source,
        "weights_sha256": enc.weights_sha256, "preprocessing": pre, "image_size": enc.preprocessing.image_size,
        "default_image_size": enc.default_image_size, "precision": precision, "batch_size": batch_size,
        "limit": -1 if limit is None else int(limit),
        "limit_selection": "seeded class-stratified round-robin (seed 0), dataset order" if limit else "all",
        "device": str(dev), "torch_version": str(torch.__version__),
        # the CPU thread count changes the last bits of the features: a resumed store reuses this one
        "cpu_threads": int(threads),
    }
    return Plan(dataset=dataset, encoder=enc, splits=data, device=dev, precision=precision, dtype=dtype,
                batch_size=batch_size, num_workers=num_workers, channels_last=channels_last, request=request,
                attrs=attrs)


# ---------------------------------------------------------------- batches


class _FileImages:
    """torch Dataset over image files: uint8 [H,W,3] tensors (decoded in DataLoader workers)."""

    def __init__(self, split, start: int):
        self.split, self.start = split, start

    def __len__(self):
        return len(self.split) - self.start

    def __getitem__(self, i):
        import torch

        return torch.from_numpy(self.split.image(self.start + i))


class _Collate:
    """Worker-side batching: same-size images stay uint8 [B,H,W,C] (finished in the main process, on the
    device: 48x smaller to pass between processes than finished float inputs at 32 -> 96 px); mixed
    sizes are finished here, one image at a time."""

    def __init__(self, pre):
        self.pre = pre

    def __call__(self, items):
        import torch

        if all(t.shape == items[0].shape for t in items):
            return torch.stack(items)
        return torch.cat([preprocess_batch(t[None], self.pre) for t in items])


class _MemoryBatches:
    """torch Dataset whose item b is batch b of an in-memory split (a uint8 slice)."""

    def __init__(self, split, start: int, batch_size: int):
        self.split, self.start, self.bs = split, start, batch_size

    def __len__(self):
        return -(-(len(self.split) - self.start) // self.bs)

    def __getitem__(self, b):
        import torch

        i = self.start + b * self.bs
        return torch.from_numpy(self.split.images[i:i + self.bs])


def iter_batches(plan: Plan, split: str, start: int = 0) -> Iterator[tuple[object, np.ndarray]]:
    """Yield (batch tensor, labels) for ``split`` from row ``start`` on, in dataset order.

    A batch is uint8 [B,H,W,C] (finished on the device by :func:`to_input`) or, for a batch of mixed
    image sizes, float [B,3,S,S] encoder inputs finished in the worker."""
    import torch

    data = plan.splits[split]
    bs = plan.batch_size
    pin = plan.device.type == "cuda"
    workers = plan.num_workers
    pre = plan.encoder.preprocessing
    if data.in_memory:
        if workers == 0:
            for i in range(start, len(data), bs):
                x = torch.from_numpy(data.images[i:i + bs])
                yield (x.pin_memory() if pin else x), data.labels[i:i + bs]
            return
        ds = _MemoryBatches(data, start, bs)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=workers,
                                             pin_memory=pin, prefetch_factor=4)
    else:
        loader = torch.utils.data.DataLoader(
            _FileImages(data, start), batch_size=bs, shuffle=False, num_workers=workers,
            collate_fn=_Collate(pre), pin_memory=pin,
            prefetch_factor=4 if workers > 0 else None, persistent_workers=False)
    i = start
    for x in loader:
        yield x, data.labels[i:i + len(x)]
        i += len(x)


def to_input(plan: Plan, x):
    """Batch from :func:`iter_batches` -> normalised encoder input on the device."""
    import torch

    if x.dtype == torch.uint8:
        return preprocess_batch(x, plan.encoder.preprocessing, device=plan.device,
                                channels_last=plan.channels_last)
    x = x.to(plan.device, non_blocking=True)
    return x.contiguous(memory_format=torch.channels_last) if plan.channels_last else x


def forward(plan: Plan, x):
    """Encoder forward of a prepared input batch -> float32 numpy [B, D] on the host."""
    import torch

    with torch.inference_mode(), _autocast(plan.device, plan.precision):
        f = plan.encoder.model(x)
    return f.float().cpu().numpy()


# ---------------------------------------------------------------- the command's API


def _drop_broken_partial(out: Path, splits: list[str]) -> None:
    """A .partial killed while it was being created lacks its split groups: start it afresh."""
    import h5py

    tmp = partial_path(out)
    if not tmp.exists():
        return
    try:
        with h5py.File(tmp, "r") as f:
            ok = all(s in f and "features" in f[s] and "labels" in f[s] for s in splits) and "class_names" in f
    except OSError:
        ok = False
    if not ok:
        tmp.unlink()


def _reuse_threads(plan: Plan, w: StoreWriter) -> None:
    """A resumed store continues with the CPU thread count it was started with (recorded in its attributes):
    the reduction order of the forward, and so the last bits of the features, follow the thread count."""
    import torch

    recorded = int(w.f.attrs.get("cpu_threads", 0))
    if plan.device.type == "cpu" and recorded > 0 and recorded != torch.get_num_threads():
        torch.set_num_threads(recorded)
        plan.attrs["cpu_threads"] = recorded


def extract_features(dataset: str, data_dir, encoder: str, *, weights=None, pretrained: bool = True,
                     image_size=None, batch_size: int = 64, device: str = "auto", precision: str = "fp32",
                     limit=None, out=None, dtype: str = "float16", overwrite: bool = False, download: bool = False,
                     num_workers=None, progress: bool = True, state_dict=None) -> Path:
    """Encode the train and test splits of ``dataset`` with ``encoder`` into an HDF5 store; return its path.

    An existing complete store with the same request is reused; a different one is an error unless
    ``overwrite``. A ``.partial`` store of the same request is resumed.
    """

    from fedhead.util import make_progress, stderr_console

    plan = prepare(dataset, data_dir, encoder, weights=weights, pretrained=pretrained, image_size=image_size,
                   batch_size=batch_size, device=device, precision=precision, limit=limit, dtype=dtype,
                   download=download, num_workers=num_workers, state_dict=state_dict)
    enc = plan.encoder
    if out is None:
        out = default_out(dataset, data_dir, encoder, enc.preprocessing.image_size, enc.default_image_size)
    out = Path(out)
    if out.exists():
        try:
            info = open_store(out, "--out")
            old = info.attrs.get("request")
            same = isinstance(old, dict) and old == json.loads(json.dumps(plan.request, sort_keys=True))
        except FedheadError:
            if not overwrite:
                raise
            same = False
            info = None
        if same:
            if progress:
                stderr_console().print(f"reusing {out} (same request)")
            return out
        if not overwrite:
            diff = sorted(k for k in set(old or {}) | set(plan.request)
                          if (old or {}).get(k) != json.loads(json.dumps(plan.request)).get(k))
            raise FedheadError(f"The '--out' parameter names {str(out)!r}, a store made by a different request "
                               f"(differs in: {', '.join(diff) or 'format'}). Pass --overwrite to replace it "
                               "or choose another --out.")
    _drop_broken_partial(out, list(plan.splits))
    kill_after = int(os.environ.get(KILL_ENV, "0") or 0)
    written = 0
    sizes = {s: len(v) for s, v in plan.splits.items()}
    with StoreWriter(out, request=plan.request, sizes=sizes, feature_dim=enc.feature_dim,
                     class_names=plan.request["class_names"], attrs=plan.attrs, dtype=dtype) as w:
        _reuse_threads(plan, w)
        prog = make_progress() if progress else contextlib.nullcontext()
        with prog:
            for split in plan.splits:
                start, total = w.n_done(split), w.size(split)
                if start >= total:
                    continue
                task = prog.add_task(f"{split}", total=total, completed=start, info="") if progress else None
                t0, n = time.perf_counter(), 0
                for x, y in iter_batches(plan, split, start):
                    feats = forward(plan, to_input(plan, x))
                    w.append(split, feats, y)
                    n += len(y)
                    written += 1
                    if progress:
                        ips = n / max(time.perf_counter() - t0, 1e-9)
                        prog.update(task, advance=len(y), info=f"{ips:,.0f} img/s")
                    if kill_after and written >= kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)
        return w.finish()
