"""Sharded extraction: the shards of a request, the part each shard writes, and the merge into one store.

A request's source images are cut into **shards**: runs of ``shard_images`` source images of one split, rounded up
to whole batches (``--batch-size``), so that a shard is encoded in exactly the batches a single-process run forms
for the same images. Each shard is encoded on its own (any process, GPU or machine: extract/engines.py) into a
**part**, ``<out>.parts/<split>-<start>-<stop>.h5``: float32 features of the shard's readable images, their labels,
natural client ids, and the source indices of the images left out under ``--skip-corrupt``. A part is written to a
temporary name and renamed, so a part exists whole or not at all; a killed worker loses at most the shard it was
encoding, and a re-run encodes only the shards without a part.

The **merge** appends the parts in source order (never in the order workers finished) through the same
:class:`extract.store.StoreWriter` that a single-process run uses, with the same request: features, labels, class
names, clients and the content hash equal those of a single-process extraction of the same inputs (bit-equal on
the CPU when both run with the same ``--threads``; the thread count changes the last bits of a forward). The merge
itself resumes like any store (``<out>.partial``), and the parts folder is removed once the store is complete.

Parts are read back as input that may be stale or foreign: a part of another request (other images, labels,
encoder or batch size) is refused in one line naming it, its shapes are checked against the shard before anything
is read, and its values must be finite.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import h5py
import numpy as np

from extract.run import Batch, Plan, _check_finite, _unreadable_error, encode, iter_batches
from extract.store import FORMAT, StoreWriter, hdf5_io
from fedhead.infra.errors import FedheadError

PART_FORMAT = "fedhead-extract-part"
DEFAULT_SHARD_IMAGES = 4096


class Shard(NamedTuple):
    """Source images ``start .. stop - 1`` of ``split``."""

    split: str
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"{self.split}-{self.start:012d}-{self.stop:012d}.h5"


@dataclass
class Part:
    """What one shard's encoding gives: its readable images' features (float32) and labels, their natural client
    ids (train split of a store with clients, else None), and the source indices of the images left out."""

    features: np.ndarray
    labels: np.ndarray
    skipped: np.ndarray
    clients: np.ndarray | None = None
    skipped_names: tuple = ()


def parts_dir(out: str | os.PathLike) -> Path:
    """The folder of ``out``'s parts: ``<out>.parts`` beside it."""
    return Path(str(out) + ".parts")


def shard_rows(batch_size: int, shard_images: int) -> int:
    """Source images per shard: ``shard_images`` rounded up to whole batches."""
    return batch_size * max(1, -(-int(shard_images) // int(batch_size)))


def plan_shards(sizes: dict[str, int], batch_size: int, shard_images: int) -> list[Shard]:
    """The shards of a request, in source order (splits in the store's order, then by start)."""
    rows = shard_rows(batch_size, shard_images)
    return [Shard(s, a, min(a + rows, n)) for s, n in sizes.items() for a in range(0, n, rows)]


def request_json(plan: Plan) -> str:
    """The request as the store records it (sorted keys): a part belongs to the request whose text it holds."""
    return json.dumps(plan.request, sort_keys=True)


def _shard_plan(plan: Plan, shard: Shard) -> Plan:
    """``plan`` restricted to the shard's source images (a view: batches are formed from the shard's start)."""
    sub = plan.splits[shard.split].subset(np.arange(shard.start, shard.stop))
    return Plan(**{**plan.__dict__, "splits": {shard.split: sub}})


def encode_shard(plan: Plan, shard: Shard, skip_corrupt: bool, on_batch: Callable[[Batch], None] | None = None) -> Part:
    """Encode one shard in the batches a single-process run forms for it. An unreadable image stops it with the
    one-line error of a single-process run unless ``skip_corrupt``; ``on_batch`` is called after every batch."""
    sub = _shard_plan(plan, shard)
    feats, labels, skipped, names = [], [], [], []
    for b in iter_batches(sub, shard.split, 0):
        if b.skipped and not skip_corrupt:
            raise _unreadable_error(b.skipped[0])
        x = encode(sub, b)
        where = b._replace(start=b.start + shard.start)
        _check_finite(plan, shard.split, where, x)
        feats.append(x)
        labels.append(b.labels)
        skipped.extend(shard.start + u.index for u in b.skipped)
        names.extend(os.path.abspath(u.path) for u in b.skipped)
        if on_batch is not None:
            on_batch(where)
    skipped = np.asarray(skipped, dtype=np.int64)
    clients = None
    if plan.clients is not None and shard.split == "train":
        keep = np.setdiff1d(np.arange(shard.start, shard.stop), skipped)
        clients = plan.clients[keep]
    dim = plan.encoder.feature_dim
    return Part(
        features=np.concatenate(feats) if feats else np.zeros((0, dim), np.float32),
        labels=np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64),
        skipped=skipped,
        clients=clients,
        skipped_names=tuple(names),
    )


def write_part(folder: Path, shard: Shard, part: Part, request: str, seconds: float = 0.0, worker: str = "") -> Path:
    """Write ``part`` as ``folder/<shard.name>``: to a temporary name first, then renamed (whole or absent).
    ``seconds`` (the shard's encoding time) and ``worker`` (who encoded it) go into the store's ``extraction``
    attribute at the merge."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / shard.name
    tmp = folder / f".{shard.name}.tmp-{os.getpid()}"
    with hdf5_io(), h5py.File(tmp, "w") as f:
        f.attrs["format"] = PART_FORMAT
        f.attrs["store_format"] = FORMAT
        f.attrs["request"] = request
        f.attrs["split"] = shard.split
        f.attrs["start"] = shard.start
        f.attrs["stop"] = shard.stop
        f.attrs["seconds"] = float(seconds)
        f.attrs["worker"] = str(worker)
        f.create_dataset("features", data=np.ascontiguousarray(part.features, dtype=np.float32))
        f.create_dataset("labels", data=np.asarray(part.labels, dtype=np.int64))
        f.create_dataset("skipped", data=np.asarray(part.skipped, dtype=np.int64))
        f.create_dataset("skipped_names", data=list(part.skipped_names), dtype=h5py.string_dtype("utf-8"))
        if part.clients is not None:
            f.create_dataset("clients", data=np.asarray(part.clients, dtype=np.int64))
    os.replace(tmp, path)
    return path


def _foreign(path: Path, problem: str) -> FedheadError:
    return FedheadError(
        f"The '--out' parameter's parts folder holds {str(path)!r}, {problem}. Delete {str(path.parent)!r} (or pass "
        "--overwrite) to encode every shard again."
    )


def _request_diff(old: str, new: str) -> str:
    try:
        a, b = json.loads(old), json.loads(new)
    except ValueError:
        return "format"
    return ", ".join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))) or "format"


def _check_attrs(path: Path, a: dict, shard: Shard, request: str) -> dict:
    """``a`` (a part's attributes) if they are this shard's of this request, else a one-line error."""
    if a.get("format") != PART_FORMAT:
        raise _foreign(path, "which is not a part written by fedhead extract")
    if a.get("request") != request:
        raise _foreign(path, f"a part of a different request (differs in: {_request_diff(a.get('request'), request)})")
    if (a.get("split"), int(a.get("start", -1)), int(a.get("stop", -1))) != tuple(shard):
        raise _foreign(path, "whose recorded split and range differ from its name")
    return a


def part_attrs(path: Path, shard: Shard, request: str) -> dict | None:
    """The attributes of this shard's finished part of this request (who encoded it, in how many seconds); None if
    there is none; a one-line error if it is a part of another request (other images, labels, class names, encoder
    or batch size) or not a part."""
    if not path.exists():
        return None
    try:
        with h5py.File(path, "r") as f:
            a = dict(f.attrs)
    except OSError:
        raise _foreign(path, "which is not an HDF5 file") from None
    return _check_attrs(path, a, shard, request)


def part_ok(path: Path, shard: Shard, request: str) -> bool:
    """True if ``path`` is this shard's finished part of this request, False if there is none (see
    :func:`part_attrs`)."""
    return part_attrs(path, shard, request) is not None


def done_shards(folder: Path, shards: list[Shard], request: str, drop_foreign: bool = False) -> set[Shard]:
    """The shards whose part is finished. A foreign part is a one-line error (see :func:`part_ok`), or deleted with
    ``drop_foreign`` (``--overwrite``)."""
    done = set()
    for s in shards:
        try:
            if part_ok(folder / s.name, s, request):
                done.add(s)
        except FedheadError:
            if not drop_foreign:
                raise
            (folder / s.name).unlink()
    return done


def read_part(path: Path, shard: Shard, request: str, feature_dim: int, clients: bool) -> Part:
    """Read a finished part back, its shapes checked against the shard before its arrays are read."""
    n = shard.stop - shard.start
    try:
        f = h5py.File(path, "r")
    except OSError:
        raise _foreign(path, "which is missing or not an HDF5 file") from None
    with f:
        _check_attrs(path, dict(f.attrs), shard, request)
        x, y, k, names = f.get("features"), f.get("labels"), f.get("skipped"), f.get("skipped_names")
        if x is None or y is None or k is None or names is None:
            raise _foreign(path, "which lacks its features, labels or skipped list")
        rows = x.shape[0]
        if x.shape != (rows, feature_dim) or y.shape != (rows,) or k.ndim != 1 or rows + k.shape[0] != n:
            raise _foreign(path, f"whose arrays do not fit its {n} source images x {feature_dim} features")
        if names.shape != k.shape:
            raise _foreign(path, "whose skipped names do not match its skipped list")
        if clients != ("clients" in f) or (clients and f["clients"].shape != (rows,)):
            raise _foreign(path, "whose client ids do not match the request's")
        part = Part(
            features=x[()].astype(np.float32, copy=False),
            labels=y[()].astype(np.int64, copy=False),
            skipped=k[()].astype(np.int64, copy=False),
            clients=f["clients"][()].astype(np.int64, copy=False) if clients else None,
            skipped_names=tuple(v.decode() if isinstance(v, bytes) else str(v) for v in names[()]),
        )
    if not np.isfinite(part.features).all():
        raise _foreign(path, "with NaN or inf features")
    if len(part.skipped) and (part.skipped.min() < shard.start or part.skipped.max() >= shard.stop):
        raise _foreign(path, "whose skipped images lie outside its range")
    return part


def worker_times(shards: list[Shard], attrs: list[dict]) -> dict:
    """Per worker (rank, or Ray actor): the source images it encoded and its encoding seconds, summed over the parts
    (a part from an earlier, interrupted run counts for the worker of that run); and the steady-state images/s of
    the whole job: all images over the busiest worker's seconds (start-up and merge not counted)."""
    per: dict[str, list[float]] = {}
    for shard, a in zip(shards, attrs):
        who, secs = str(a.get("worker", "")), float(a.get("seconds", 0.0))
        got = per.setdefault(who or "?", [0, 0.0])
        got[0] += shard.stop - shard.start
        got[1] += secs
    busiest = max((v[1] for v in per.values()), default=0.0)
    total = sum(v[0] for v in per.values())
    return {
        "worker_images": {k: int(v[0]) for k, v in sorted(per.items())},
        "worker_seconds": {k: round(v[1], 3) for k, v in sorted(per.items())},
        "images_per_sec": round(total / busiest, 2) if busiest > 0 else None,
    }


def merge(plan: Plan, shards: list[Shard], folder: Path, out: Path, skip_corrupt: bool, attrs: dict) -> Path:
    """Append every shard's part, in source order, into ``out`` (through ``out``'s ``.partial``, which resumes at
    the first part not yet appended); remove the parts folder when the store is complete."""
    request = request_json(plan)
    found = [part_attrs(folder / shard.name, shard, request) for shard in shards]
    if None in found:  # every part is checked before the store is begun
        missing = shards[found.index(None)]
        raise FedheadError(
            f"The '--out' parameter's parts folder {str(folder)!r} lacks {missing.name} (removed while the run was "
            "going). Re-run the same command to encode the shards without a part."
        )
    attrs = {**attrs, "extraction": {**attrs.get("extraction", {}), **worker_times(shards, found)}}
    enc = plan.encoder
    sizes = {s: len(v) for s, v in plan.splits.items()}
    with StoreWriter(
        out,
        request=plan.request,
        sizes=sizes,
        feature_dim=enc.feature_dim,
        class_names=plan.request["class_names"],
        attrs=attrs,
        dtype=plan.dtype,
        client_names=plan.client_names,
    ) as w:
        names: dict[str, list[str]] = {s: [] for s in sizes}
        for shard in shards:
            part = read_part(
                folder / shard.name,
                shard,
                request,
                enc.feature_dim,
                plan.clients is not None and shard.split == "train",
            )
            if len(part.skipped) and not skip_corrupt:
                raise FedheadError(
                    f"The '--out' parameter's part {str(folder / shard.name)!r} left out {len(part.skipped)} "
                    f"unreadable image(s) (first: {part.skipped_names[0]!r}) under --skip-corrupt. Pass "
                    "--skip-corrupt to keep them out, or delete the part to encode that shard again."
                )
            names[shard.split].extend(part.skipped_names)
            if shard.start < w.n_read(shard.split):  # appended before the merge was stopped
                continue
            w.append(shard.split, part.features, part.labels, part.skipped.tolist(), part.clients)
        source = None
        if any(names.values()):
            source = {s: _names_by_index(w.skipped_indices(s), v) for s, v in names.items()}
        path = w.finish(source)
    shutil.rmtree(folder, ignore_errors=True)
    return path


def _names_by_index(indices: np.ndarray, names: list[str]) -> dict:
    """``{source index: name}`` of a split's images left out (StoreWriter.finish indexes names by source index)."""
    return dict(zip((int(i) for i in indices), names))
