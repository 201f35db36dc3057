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

Hardening (see :func:`extract_features`): unreadable image files stop the run with a one-line error naming
the file, or are left out and listed in the store with ``--skip-corrupt``; one process writes a store at a
time (:func:`fedhead.infra.locks.exclusive_writer` on ``<out>.lock``); SIGINT/SIGTERM leave a consistent
``.partial`` and exit 130/143 with one line saying how to resume; a full disk is found before encoding
starts (see extract/store.py) and is a one-line error too.

Test hooks (environment variables, for the tests of these paths; never set them otherwise):
``FEDHEAD_TEST_KILL_AFTER_BATCHES=k`` SIGKILLs the process after k batches written by this run;
``FEDHEAD_TEST_PAUSE_AFTER_BATCHES=k:FILE`` after k batches writes the pid into FILE and sleeps (up to
10 minutes) until a signal arrives, so that a test can signal an extraction that is surely mid-way.
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
from typing import Iterator, NamedTuple

import numpy as np

from extract import clients as K
from extract import datasets as D
from extract import formats as F
from extract.encoders import Encoder, load_encoder, preprocess_batch
from extract.store import StoreWriter, open_store, partial_path, write_error
from fedhead.infra.console import make_progress, stderr_console
from fedhead.infra.devices import resolve_device, set_cpu_threads, transfers
from fedhead.infra.errors import FedheadError, Interval, OneOf, unknown_name, validate
from fedhead.infra.locks import exclusive_writer
from fedhead.infra.signals import Interrupted, pause_hook, signals_deferred, signals_raise, worker_signals

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = ("float16", "float32")
KILL_ENV = "FEDHEAD_TEST_KILL_AFTER_BATCHES"  # test hook: SIGKILL this process after k written batches
PAUSE_ENV = "FEDHEAD_TEST_PAUSE_AFTER_BATCHES"  # test hook "k:FILE": after k batches write pid to FILE, sleep
FLOAT16_MAX = 65504.0


def sanitize(name: str) -> str:
    return name.replace(":", "_").replace("/", "_")


def dataset_label(dataset: str, data_dir) -> str:
    """The dataset's identity in paths and metadata: the folder (or list) name for ``imagefolder`` and the formats
    of :mod:`extract.formats`."""
    if (dataset == "imagefolder" or dataset in F.FORMATS) and data_dir is not None:
        return Path(data_dir).resolve().name or dataset
    return dataset


def default_out(dataset: str, data_dir, encoder: str, image_size: int, default_size: int) -> Path:
    stem = sanitize(encoder) + (f"-{image_size}" if image_size != default_size else "")
    return Path("cache") / dataset_label(dataset, data_dir) / f"{stem}.h5"


def store_path(plan: "Plan", data_dir, encoder: str, out) -> Path:
    """``--out``, or :func:`default_out` for the plan's dataset, encoder and image size."""
    enc = plan.encoder
    if out is not None:
        return Path(out)
    return default_out(plan.dataset, data_dir, encoder, enc.preprocessing.image_size, enc.default_image_size)


@dataclass
class Plan:
    """Everything an extraction run needs, resolved once."""

    dataset: str
    encoder: Encoder
    splits: dict  # split -> ImageSplit (already limited)
    device: object  # torch.device
    precision: str
    dtype: str
    batch_size: int
    num_workers: int
    channels_last: bool
    request: dict
    attrs: dict
    clients: np.ndarray | None = None  # int64 [N train]: each training image's client id (natural clients)
    client_names: list | None = None  # the names of the client ids


def _load_splits(dataset, data_dir, splits, limit, download, sources: tuple, options=None) -> tuple[dict, tuple | None]:
    """The (limited) splits and, with a client source (``sources`` = client folders, CSV, pattern, column), the
    training images' client ids and names (:mod:`extract.clients`). ``options``: the format options of
    :mod:`extract.formats` (``train_shards``, ``image_column``, ...)."""
    source = K.check_sources(*sources)
    if source == "--client-folders" and dataset != "imagefolder":
        raise FedheadError(
            f"The '--client-folders' parameter needs --dataset imagefolder (train/<client>/<class>/ folders). "
            f"Got --dataset {dataset} instead. Use --dataset imagefolder, or --clients-csv / --client-pattern."
        )
    if source == "--client-folders":
        data = {s: K.client_folders(data_dir, s) for s in splits}
    else:
        opts = {**(options or {}), "client_column": sources[3]}
        data = {s: D.load_dataset(dataset, data_dir, s, download=download, options=opts) for s in splits}
    for s in splits:
        if limit is not None:
            data[s] = data[s].subset(D.select_limit(data[s].labels, limit))
    if source is None or "train" not in data:
        return data, None
    return data, K.assign(data["train"], source, data_dir, sources[1], sources[2])


def _autocast(device, precision: str):
    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def prepare(
    dataset: str,
    data_dir,
    encoder: str,
    *,
    weights=None,
    pretrained: bool = True,
    image_size=None,
    batch_size: int = 64,
    device: str = "auto",
    precision: str = "fp32",
    limit=None,
    dtype: str = "float16",
    download: bool = False,
    num_workers=None,
    splits=D.SPLITS,
    state_dict=None,
    client_folders: bool = False,
    clients_csv=None,
    client_pattern: str | None = None,
    client_column: str | None = None,
    source_options: dict | None = None,
    threads: int | None = None,
) -> Plan:
    """Validate every input, load the data and the encoder, and build the store request. With one of
    ``client_folders``, ``clients_csv``, ``client_pattern``, ``client_column`` the training images' clients are
    recorded too (:mod:`extract.clients`). ``source_options``: ``train_shards``, ``test_shards``, ``image_column``,
    ``label_column`` for the formats of :mod:`extract.formats`."""
    import torch

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
    if threads is not None:
        validate("--threads", threads, Interval(1, None, integer=True), "Leave it out to use the idle cores.")
    threads = set_cpu_threads(threads) if dev.type == "cpu" else 0
    client_sources = (client_folders, clients_csv, client_pattern, client_column)
    data, clients = _load_splits(dataset, data_dir, splits, limit, download, client_sources, source_options)
    enc = load_encoder(encoder, weights=weights, pretrained=pretrained, image_size=image_size, state_dict=state_dict)
    enc.model.to(dev)
    _, channels_last = transfers(dev)
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
        "dataset": label,
        "loader": dataset,
        "encoder": encoder,
        "weights_sha256": enc.weights_sha256,
        "preprocessing": pre,
        "image_size": enc.preprocessing.image_size,
        "dtype": dtype,
        "precision": precision,
        "limit": limit,
        "limit_seed": D.LIMIT_SEED if limit is not None else None,
        "sizes": {s: len(data[s]) for s in splits},
        "labels_sha256": {
            s: hashlib.sha256(np.ascontiguousarray(data[s].labels).tobytes()).hexdigest() for s in splits
        },
        "class_names": class_names,
        "batch_size": batch_size,  # batch composition can change the last bits of the features
    }
    records = {s: D.records_sha256(data[s]) for s in splits}
    if any(records.values()):  # the formats' record names (only then: other requests are unchanged)
        request["records_sha256"] = records
    if clients is not None:  # only then: the requests (and so the reuse) of stores without clients are unchanged
        request["clients_sha256"] = K.identity(*clients)
    attrs = {
        "dataset": label,
        "dataset_loader": dataset,
        "data_dir": str(Path(data_dir).resolve()) if data_dir is not None else "",
        "encoder": encoder,
        "encoder_family": enc.cfg.family,
        "weights_source": enc.weights_source,
        "weights_sha256": enc.weights_sha256,
        "preprocessing": pre,
        "image_size": enc.preprocessing.image_size,
        "default_image_size": enc.default_image_size,
        "precision": precision,
        "batch_size": batch_size,
        "limit": -1 if limit is None else int(limit),
        "limit_selection": "seeded class-stratified round-robin (seed 0), dataset order" if limit else "all",
        "device": str(dev),
        "torch_version": str(torch.__version__),
        # the CPU thread count changes the last bits of the features: a resumed store reuses this one
        "cpu_threads": int(threads),
    }
    return Plan(
        dataset=dataset,
        encoder=enc,
        splits=data,
        device=dev,
        precision=precision,
        dtype=dtype,
        batch_size=batch_size,
        num_workers=num_workers,
        channels_last=channels_last,
        request=request,
        attrs={**attrs, "client_source": K.check_sources(*client_sources) or "none"} if clients is not None else attrs,
        clients=None if clients is None else clients[0],
        client_names=None if clients is None else clients[1],
    )


# ---------------------------------------------------------------- batches


class _FileImages:
    """torch Dataset over image files: uint8 [H,W,3] tensors (decoded in DataLoader workers), or an
    :class:`extract.datasets.Unreadable` record for a file that cannot be decoded."""

    def __init__(self, split, start: int):
        self.split, self.start = split, start

    def __len__(self):
        return len(self.split) - self.start

    def __getitem__(self, i):
        import torch

        img = D.try_image(self.split, self.start + i)
        return img if isinstance(img, D.Unreadable) else torch.from_numpy(img)


class _Collate:
    """Worker-side batching: same-size images stay uint8 [B,H,W,C] (finished in the main process, on the
    device: 48x smaller to pass between processes than finished float inputs at 32 -> 96 px); mixed
    sizes are finished here, one image at a time. Returns (batch or None, unreadable records)."""

    def __init__(self, pre):
        self.pre = pre

    def __call__(self, items):
        import torch

        bad = tuple(t for t in items if isinstance(t, D.Unreadable))
        items = [t for t in items if not isinstance(t, D.Unreadable)]
        if not items:
            return None, bad
        if all(t.shape == items[0].shape for t in items):
            return torch.stack(items), bad
        return torch.cat([preprocess_batch(t[None], self.pre) for t in items]), bad


class _MemoryBatches:
    """torch Dataset whose item b is batch b of an in-memory split (a uint8 slice)."""

    def __init__(self, split, start: int, batch_size: int):
        self.split, self.start, self.bs = split, start, batch_size

    def __len__(self):
        return -(-(len(self.split) - self.start) // self.bs)

    def __getitem__(self, b):
        import torch

        i = self.start + b * self.bs
        return torch.from_numpy(self.split.images[i : i + self.bs])


class Batch(NamedTuple):
    """One batch of :func:`iter_batches`: source images ``start .. start + read - 1`` of the split; ``x``
    holds the readable ones (None if there is none), ``labels`` their labels, ``skipped`` the others."""

    x: object
    labels: np.ndarray
    start: int
    read: int
    skipped: tuple = ()


def iter_batches(plan: Plan, split: str, start: int = 0) -> Iterator[Batch]:
    """Yield the :class:`Batch` es of ``split`` from source image ``start`` on, in dataset order.

    ``x`` is uint8 [B,H,W,C] (finished on the device by :func:`to_input`) or, for a batch of mixed image
    sizes, float [B,3,S,S] encoder inputs finished in the worker. Batches always cover ``batch_size``
    source images (the last one fewer), readable or not, so a resumed run forms the same batches."""
    import torch

    data = plan.splits[split]
    bs = plan.batch_size
    pin, _ = transfers(plan.device)
    workers = plan.num_workers
    pre = plan.encoder.preprocessing
    if data.in_memory:
        if workers == 0:
            for i in range(start, len(data), bs):
                x = torch.from_numpy(data.images[i : i + bs])
                yield Batch(x.pin_memory() if pin else x, data.labels[i : i + bs], i, len(x))
            return
        ds = _MemoryBatches(data, start, bs)
        loader = torch.utils.data.DataLoader(
            ds,
            batch_size=None,
            shuffle=False,
            num_workers=workers,
            pin_memory=pin,
            prefetch_factor=4,
            worker_init_fn=worker_signals,
        )
        i = start
        for x in loader:
            yield Batch(x, data.labels[i : i + len(x)], i, len(x))
            i += len(x)
        return
    loader = torch.utils.data.DataLoader(
        _FileImages(data, start),
        batch_size=bs,
        shuffle=False,
        num_workers=workers,
        collate_fn=_Collate(pre),
        pin_memory=pin,
        worker_init_fn=worker_signals if workers > 0 else None,
        prefetch_factor=4 if workers > 0 else None,
        persistent_workers=False,
    )
    i = start
    for x, bad in loader:
        n = (0 if x is None else len(x)) + len(bad)
        keep = np.setdiff1d(np.arange(i, i + n), [u.index for u in bad]) if bad else slice(i, i + n)
        yield Batch(x, data.labels[keep], i, n, tuple(bad))
        i += n


def to_input(plan: Plan, x):
    """Batch from :func:`iter_batches` -> normalised encoder input on the device."""
    import torch

    if x.dtype == torch.uint8:
        return preprocess_batch(x, plan.encoder.preprocessing, device=plan.device, channels_last=plan.channels_last)
    x = x.to(plan.device, non_blocking=True)
    return x.contiguous(memory_format=torch.channels_last) if plan.channels_last else x


def forward(plan: Plan, x):
    """Encoder forward of a prepared input batch -> float32 numpy [B, D] on the host."""
    import torch

    with torch.inference_mode(), _autocast(plan.device, plan.precision):
        f = plan.encoder.model(x)
    return f.float().cpu().numpy()


def encode(plan: Plan, batch: Batch) -> np.ndarray:
    """Features [B, D] of a batch's readable images ([0, D] if it has none)."""
    if batch.x is None:
        return np.zeros((0, plan.encoder.feature_dim), dtype=np.float32)
    return forward(plan, to_input(plan, batch.x))


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


def _reusable(out: Path, plan: Plan, overwrite: bool, skip_corrupt: bool, progress: bool) -> bool:
    """True if ``out`` is a finished store of this request to return as is; raises if it is another
    request's (unless ``overwrite``), or if it lacks unreadable images and ``skip_corrupt`` is off."""
    if not out.exists():
        return False
    req = json.loads(json.dumps(plan.request, sort_keys=True))
    try:
        info = open_store(out, "--out")
    except FedheadError:
        if not overwrite:
            raise
        return False
    old = info.attrs.get("request")
    if isinstance(old, dict) and old == req:
        if info.n_skipped and not skip_corrupt:
            if overwrite:
                return False
            first = next(iter(v[0] for v in info.skipped.values()))
            raise FedheadError(
                f"The '--out' parameter names {str(out)!r}, a store of this request that lacks "
                f"{_images(info.n_skipped)} (first: {first!r}), left out by --skip-corrupt. "
                "Pass --skip-corrupt to use it as it is, or --overwrite to extract again."
            )
        if progress:
            lacks = (
                (f"; it lacks {_images(info.n_skipped)}, listed under skipped/; --overwrite extracts again")
                if info.n_skipped
                else ""
            )
            stderr_console().print(f"reusing {out} (same request{lacks})", soft_wrap=True)
        return True
    if not overwrite:
        diff = sorted(k for k in set(old or {}) | set(req) if (old or {}).get(k) != req.get(k))
        raise FedheadError(
            f"The '--out' parameter names {str(out)!r}, a store made by a different request "
            f"(differs in: {', '.join(diff) or 'format'}). Pass --overwrite to replace it "
            "or choose another --out."
        )
    return False


def _images(n: int) -> str:
    return f"{n} unreadable image{'' if n == 1 else 's'}"


def _unreadable_error(u: D.Unreadable) -> FedheadError:
    return FedheadError(
        f"The '--data-dir' parameter holds an unreadable image: {u.path!r} is {u.reason}. "
        "Replace or delete it, or pass --skip-corrupt to leave unreadable images out (the store "
        "then lists them)."
    )


def _check_finite(plan: Plan, split: str, b: Batch, feats: np.ndarray) -> None:
    """Refuse features that the store could not hold: NaN/inf, or beyond float16's range in a float16 store."""
    if not len(feats):
        return
    where = f"{split} images {b.start}..{b.start + b.read - 1}"
    if not np.isfinite(feats).all():
        fix = "Use --precision fp32." if plan.precision != "fp32" else "Check the encoder's weights."
        raise FedheadError(f"The encoder produced NaN or inf features for {where}. {fix}")
    if plan.dtype == "float16" and float(np.abs(feats).max()) > FLOAT16_MAX:
        raise FedheadError(
            f"The '--dtype' parameter is 'float16', but the encoder's features for {where} reach "
            f"{float(np.abs(feats).max()):.4g}, beyond float16's {FLOAT16_MAX:g}. Use --dtype float32."
        )


def _pause_hook(written: int) -> None:
    """Test hook (PAUSE_ENV = "k:FILE"): after ``k`` batches, write the pid into FILE and wait for a signal."""
    pause_hook(PAUSE_ENV, written)


@contextlib.contextmanager
def _writing(tmp: Path):
    """Turn a failed write of the store (``OSError``: no space, file size limit, I/O) into one line."""
    try:
        yield
    except OSError as exc:
        raise write_error(tmp, exc) from None


def _clients(plan: Plan, split: str, b: Batch) -> np.ndarray | None:
    """The client ids of a batch's readable images (train split of a store with natural clients), else None."""
    if plan.clients is None or split != "train":
        return None
    keep = np.setdiff1d(np.arange(b.start, b.start + b.read), [u.index for u in b.skipped])
    return plan.clients[keep]


class _Tally:
    """Source images consumed so far and in all (for the interrupt message)."""

    read = 0
    total: int | None = None


def extract_features(
    dataset: str,
    data_dir,
    encoder: str,
    *,
    weights=None,
    pretrained: bool = True,
    image_size=None,
    batch_size: int = 64,
    device: str = "auto",
    precision: str = "fp32",
    limit=None,
    out=None,
    dtype: str = "float16",
    overwrite: bool = False,
    download: bool = False,
    num_workers=None,
    progress: bool = True,
    state_dict=None,
    skip_corrupt: bool = False,
    client_folders: bool = False,
    clients_csv=None,
    client_pattern: str | None = None,
    client_column: str | None = None,
    train_shards: str | None = None,
    test_shards: str | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
    threads: int | None = None,
) -> Path:
    """Encode the train and test splits of ``dataset`` with ``encoder`` into an HDF5 store; return its path.

    An existing complete store with the same request is reused; a different one is an error unless
    ``overwrite``. A ``.partial`` store of the same request is resumed. The whole write (``.partial`` and
    rename) holds :func:`fedhead.infra.locks.exclusive_writer` on ``<out>.lock``: a second process writing the
    same ``out`` stops at once with the first one's pid.

    Unreadable images (truncated, not an image, unreadable file; only file datasets have them) are found
    while decoding, in the DataLoader workers, at no extra cost: a worker returns a record instead of the
    image. Without ``skip_corrupt`` the first one stops the run with a one-line error naming the file (the
    batches before it stay in the ``.partial``; fix the file and re-run to resume). With ``skip_corrupt``
    it is left out:

    * rows: the store pre-allocates one row per source image; the readable images of a batch are written
      as the next rows, so rows stay in dataset order without gaps, and the arrays are cut to the rows
      written when the store is finished. Labels are those of the readable images, taken from the
      dataset's label list by source index, so rows and labels cannot drift apart.
    * resume: each split records ``n_done`` (rows) and ``n_read`` (source images consumed) together after
      every batch, and a ``skipped_mask`` over the source images; a resumed run continues at source image
      ``n_read`` and row ``n_done``. Batches always span ``batch_size`` source images, readable or not,
      so a resumed run forms the same batches as an uninterrupted one and gives the same features.
    * the finished store lists the paths of the images it lacks in ``skipped/<split>`` and their count in
      the ``n_skipped`` attribute; the count is printed on stderr.
    * reuse: the request describes the source (the image list and labels), not what was readable, so a
      store that lacks images is reused only with ``skip_corrupt`` (else a one-line error says so), and
      ``overwrite`` extracts it again (after the files were repaired); a ``.partial`` that has left images
      out is continued only with ``skip_corrupt``.

    Checking every file before encoding would need a second full decode (``Image.verify()`` misses a JPEG
    cut short near its end): about 100 us per CIFAR-10 JPEG here, 6 s for 60,000 images (small next to
    3 minutes of encoding at 96 px, but a second pass over every file on every run and resume, and far
    more for large photos), so decoding-time detection was chosen.

    SIGINT/SIGTERM (:func:`fedhead.infra.signals.signals_raise`) stop at a batch boundary (a batch's rows and
    counters are written as one critical section) and raise :class:`fedhead.infra.signals.Interrupted` (exit code
    130/143 under ``cli_errors``) whose one-line message says where the same command resumes.
    """
    tally = _Tally()
    with signals_raise():
        try:
            return _extract(
                dataset,
                data_dir,
                encoder,
                tally,
                weights=weights,
                pretrained=pretrained,
                image_size=image_size,
                batch_size=batch_size,
                device=device,
                precision=precision,
                limit=limit,
                out=out,
                dtype=dtype,
                overwrite=overwrite,
                download=download,
                num_workers=num_workers,
                progress=progress,
                state_dict=state_dict,
                skip_corrupt=skip_corrupt,
                clients=(client_folders, clients_csv, client_pattern, client_column),
                source_options={
                    "train_shards": train_shards,
                    "test_shards": test_shards,
                    "image_column": image_column,
                    "label_column": label_column,
                },
                threads=threads,
            )
        except Interrupted as exc:
            if tally.total is None:
                msg = "interrupted before encoding began; re-run the same command to start"
            else:
                msg = f"interrupted; re-run the same command to resume from {tally.read:,} of {tally.total:,} images"
            raise Interrupted(exc.signum, msg) from None


def _extract(
    dataset,
    data_dir,
    encoder,
    tally: _Tally,
    *,
    weights,
    pretrained,
    image_size,
    batch_size,
    device,
    precision,
    limit,
    out,
    dtype,
    overwrite,
    download,
    num_workers,
    progress,
    state_dict,
    skip_corrupt,
    clients=(False, None, None, None),
    source_options=None,
    threads=None,
) -> Path:
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
        limit=limit,
        dtype=dtype,
        download=download,
        num_workers=num_workers,
        state_dict=state_dict,
        client_folders=clients[0],
        clients_csv=clients[1],
        client_pattern=clients[2],
        client_column=clients[3],
        source_options=source_options,
        threads=threads,
    )
    enc = plan.encoder
    out = store_path(plan, data_dir, encoder, out)
    if _reusable(out, plan, overwrite, skip_corrupt, progress):
        return out
    tmp = partial_path(out)
    with exclusive_writer(out, repr(str(out))):
        if _reusable(out, plan, overwrite, skip_corrupt, False):  # finished by another process meanwhile
            return out
        _drop_broken_partial(out, list(plan.splits))
        kill_after = int(os.environ.get(KILL_ENV, "0") or 0)
        written = 0
        sizes = {s: len(v) for s, v in plan.splits.items()}
        with _writing(tmp):
            w = StoreWriter(
                out,
                request=plan.request,
                sizes=sizes,
                feature_dim=enc.feature_dim,
                class_names=plan.request["class_names"],
                attrs=plan.attrs,
                dtype=dtype,
                client_names=plan.client_names,
            )
        with w:
            _reuse_threads(plan, w)
            left = {s: w.n_skipped(s) for s in plan.splits}
            if any(left.values()) and not skip_corrupt:
                s = next(s for s, n in left.items() if n)
                first = plan.splits[s].paths[int(w.skipped_indices(s)[0])]
                raise FedheadError(
                    f"The '--out' parameter names {str(out)!r}, whose unfinished {tmp.name} left out "
                    f"{_images(sum(left.values()))} under --skip-corrupt (first: "
                    f"{os.path.abspath(first)!r}). Pass --skip-corrupt to continue it, or delete "
                    f"{tmp.name} to start again."
                )
            tally.total = sum(sizes.values())
            tally.read = sum(w.n_read(s) for s in plan.splits)
            prog = make_progress() if progress else contextlib.nullcontext()
            with prog:
                for split in plan.splits:
                    start, total = w.n_read(split), w.size(split)
                    if start >= total:
                        continue
                    task = prog.add_task(f"{split}", total=total, completed=start, info="") if progress else None
                    t0, n = time.perf_counter(), 0
                    for b in iter_batches(plan, split, start):
                        if b.skipped and not skip_corrupt:
                            raise _unreadable_error(b.skipped[0])
                        feats = encode(plan, b)
                        _check_finite(plan, split, b, feats)
                        with signals_deferred(), _writing(tmp):  # rows and counters: all or nothing
                            w.append(split, feats, b.labels, [u.index for u in b.skipped], _clients(plan, split, b))
                            tally.read += b.read
                        n += b.read
                        written += 1
                        if progress:
                            ips = n / max(time.perf_counter() - t0, 1e-9)
                            prog.update(task, advance=b.read, info=f"{ips:,.0f} img/s")
                        if kill_after and written >= kill_after:
                            os.kill(os.getpid(), signal.SIGKILL)
                        _pause_hook(written)
            per = {s: w.n_skipped(s) for s in plan.splits}
            skipped = sum(per.values())
            names = {
                s: [os.path.abspath(p) for p in v.paths]
                for s, v in plan.splits.items()
                if skipped and v.paths is not None
            }
            with signals_deferred(), _writing(tmp):
                path = w.finish(names or None)
    if skipped and progress:
        where = ", ".join(f"{n} in {s}" for s, n in per.items() if n)
        stderr_console().print(
            f"skipped {_images(skipped)} ({where}); {path} lists them under skipped/", soft_wrap=True
        )
    return path
