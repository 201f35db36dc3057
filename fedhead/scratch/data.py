"""Raw datasets for the scratch paths, loaded once into memory, and the colour-skew partition.

Images are kept as uint8 tensors ``[N, C, H, W]`` and converted to normalised float per batch
(:meth:`ScratchData.to_float`); Speech Commands clips become float32 MFCCs ``[N, 1, 50, 16]``.
Decoded CIFAR-10 JPEG folders and MFCCs are cached as ``.npz`` under the cache directory
(``FEDHEAD_CACHE`` or ``cache/scratch``). Augmentation is off.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from extract import datasets as X
from fedhead.infra.errors import FedheadError, Interval, param_error, unknown_name, validate
from fedhead.infra.files import atomic_path
from fedhead.scratch.mfcc import MfccConfig, mfcc


@dataclass
class ScratchData:
    name: str
    train_x: torch.Tensor  # uint8 [N, C, H, W] (images) or float32 [N, 1, T, F] (MFCCs)
    train_y: np.ndarray  # int64 [N]
    test_x: torch.Tensor
    test_y: np.ndarray
    classes: list[str]
    mean: tuple  # per-channel normalisation applied by to_float
    std: tuple
    input_kind: str  # "image" or "mfcc"
    info: dict = field(default_factory=dict)
    train_clients: np.ndarray | None = None  # int64 [N]: each training sample's natural client (speech: speaker)
    client_names: list = field(default_factory=list)  # the names of those ids

    def clients_of(self, idx: np.ndarray) -> np.ndarray | None:
        """The natural client ids of training samples ``idx``, renumbered 0 .. K-1 over the clients they hold (a
        subset may drop some), or None if the dataset records none (``--partition natural``)."""
        if self.train_clients is None:
            return None
        return np.unique(self.train_clients[idx], return_inverse=True)[1].astype(np.int64)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_shape(self) -> tuple:
        return tuple(self.train_x.shape[1:])

    def to_float(self, x: torch.Tensor) -> torch.Tensor:
        """A gathered batch (any leading dims) -> normalised float32 on the same device."""
        c = x.shape[-3]
        mean = torch.tensor(self.mean, device=x.device, dtype=torch.float32).view(c, 1, 1)
        std = torch.tensor(self.std, device=x.device, dtype=torch.float32).view(c, 1, 1)
        x = x.float()
        if self.input_kind == "image":
            x = x / 255.0
        return (x - mean) / std


# ---------------------------------------------------------------- registry

DATASETS: dict[str, Callable[[Path, Path], ScratchData]] = {}
DATASET_HELP: dict[str, str] = {}


def register_dataset(name: str, help: str):
    def deco(fn):
        DATASETS[name] = fn
        DATASET_HELP[name] = help
        return fn

    return deco


def cache_dir() -> Path:
    return Path(os.environ.get("FEDHEAD_CACHE", "cache")) / "scratch"


_LOADED: dict[tuple, ScratchData] = {}  # in-process memo of read-only loaded datasets (tests, benches)


def load_dataset(name: str, data_dir: str | Path) -> ScratchData:
    """Load (once per process) a registered dataset; callers must not modify the returned tensors."""
    if name not in DATASETS:
        raise unknown_name("--dataset", name, DATASETS, "dataset")
    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise param_error(
            "--data-dir", str(data_dir), "must be an existing directory", f"Point it at your copy of {name}."
        )
    key = (name, str(data_dir.resolve()), data_dir.stat().st_mtime_ns)
    if key not in _LOADED:
        _LOADED.clear()  # keep at most one dataset in memory
        _LOADED[key] = DATASETS[name](data_dir, cache_dir())
    return _LOADED[key]


def subsample(y: np.ndarray, n: int | None, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of a class-stratified random subset of size ``n`` (all indices when None)."""
    if n is None or n >= len(y):
        return np.arange(len(y))
    order = rng.permutation(len(y))
    # stratify: take the first round(n * p_c) of each class in the random order
    classes, counts = np.unique(y, return_counts=True)
    want = np.floor(counts / len(y) * n).astype(int)
    rem = n - want.sum()
    want[np.argsort(-(counts / len(y) * n - want))[:rem]] += 1
    keep = []
    ys = y[order]
    for c, w in zip(classes, want):
        keep.append(order[ys == c][:w])
    return np.sort(np.concatenate(keep))


# ---------------------------------------------------------------- MNIST / Fashion-MNIST (idx files)


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find_idx(root: Path, sub: str, stem: str) -> Path:
    for d in (root / sub / "raw", root / "raw", root):
        for suffix in ("", ".gz"):
            p = d / f"{stem}{suffix}"
            if p.exists():
                return p
    raise FedheadError(
        f"The '--data-dir' parameter has no {stem} file (looked in {root}/{sub}/raw, "
        f"{root}/raw and {root}). Got {str(root)!r} instead. Point it at the folder holding "
        f"{sub}/raw."
    )


def _idx_dataset(name: str, sub: str, classes: list[str], mean: float, std: float):
    def load(root: Path, cache: Path) -> ScratchData:
        def part(prefix):
            x = _read_idx(_find_idx(root, sub, f"{prefix}-images-idx3-ubyte"))
            y = _read_idx(_find_idx(root, sub, f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
            return torch.from_numpy(x.copy()).unsqueeze(1), y

        trx, try_ = part("train")
        tex, tey = part("t10k")
        return ScratchData(name, trx, try_, tex, tey, classes, (mean,), (std,), "image")

    return load


register_dataset("mnist", "MNIST idx files (<data-dir>/MNIST/raw)")(
    _idx_dataset("mnist", "MNIST", [str(i) for i in range(10)], 0.1307, 0.3081)
)
# ---------------------------------------------------------------- CIFAR-10 (image folders or python batches)


def _cache_key(root: Path, tag: str) -> str:
    return hashlib.sha1(f"{root.resolve()}|{tag}".encode()).hexdigest()[:12]


def _image_folder(root: Path, classes: list[str] | None = None):
    from PIL import Image

    classes = classes or sorted(d.name for d in root.iterdir() if d.is_dir())
    xs, ys = [], []
    for ci, c in enumerate(classes):
        files = sorted(p for p in (root / c).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        for p in files:
            with Image.open(p) as im:
                xs.append(np.asarray(im.convert("RGB"), dtype=np.uint8))
            ys.append(ci)
    return np.stack(xs).transpose(0, 3, 1, 2).copy(), np.array(ys, dtype=np.int64), classes


@register_dataset("cifar10", "CIFAR-10 image folders (<data-dir>/{train,test}/<class>/*.jpg) or cifar-10-batches-py")
def _cifar10(root: Path, cache: Path) -> ScratchData:
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    if not ((root / "train").is_dir() and (root / "test").is_dir()):
        return _extract_loader("cifar10", rgb=True)(root, cache)  # cifar-10-batches-py layout
    path = cache / f"cifar10-{_cache_key(root, 'folders')}.npz"
    if path.exists():
        z = np.load(path)
        trx, try_, tex, tey = z["train_x"], z["train_y"], z["test_x"], z["test_y"]
        classes = [str(c) for c in z["classes"]]
    else:
        trx, try_, classes = _image_folder(root / "train")
        tex, tey, _ = _image_folder(root / "test", classes)

        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, train_x=trx, train_y=try_, test_x=tex, test_y=tey, classes=np.array(classes))
    return ScratchData("cifar10", torch.from_numpy(trx), try_, torch.from_numpy(tex), tey, classes, mean, std, "image")


# ---------------------------------------------------------------- other image datasets via extract.datasets


def _extract_loader(name: str, rgb: bool):
    """Adapter for the shared image-dataset registry (``extract.datasets``): decoded once into uint8
    [N, C, H, W]; path-based datasets (imagefolder, tinyimagenet) are cached as .npz."""

    def load(root: Path, cache: Path) -> ScratchData:
        def arr(split) -> np.ndarray:
            if split.in_memory:
                imgs = split.images
            else:
                first = split.image(0).shape
                imgs = np.empty((len(split), *first), dtype=np.uint8)
                for i in range(len(split)):
                    im = split.image(i)
                    if im.shape != first:
                        raise FedheadError(
                            f"The '--data-dir' parameter holds images of different sizes "
                            f"({first} and {im.shape}). Got {str(root)!r} instead. The scratch "
                            f"path needs one image size; resize the copy first."
                        )
                    imgs[i] = im
            return np.ascontiguousarray(imgs.transpose(0, 3, 1, 2))

        tr, te = X.load_dataset(name, root, "train", rgb=rgb), X.load_dataset(name, root, "test", rgb=rgb)
        path = cache / f"{name}-{_cache_key(root, 'extract')}.npz"
        if not tr.in_memory and path.exists():
            z = np.load(path)
            trx, tex = z["train_x"], z["test_x"]
        else:
            trx, tex = arr(tr), arr(te)
            if not tr.in_memory:
                with atomic_path(path) as tmp:
                    with open(tmp, "wb") as f:
                        np.savez(f, train_x=trx, test_x=tex)
        sample = torch.from_numpy(trx[:10000]).float() / 255.0
        mean = tuple(float(v) for v in sample.mean(dim=(0, 2, 3)))
        std = tuple(float(v) for v in sample.std(dim=(0, 2, 3)).clamp(min=1e-3))
        return ScratchData(
            name,
            torch.from_numpy(trx),
            np.asarray(tr.labels, dtype=np.int64),
            torch.from_numpy(tex),
            np.asarray(te.labels, dtype=np.int64),
            list(tr.class_names),
            mean,
            std,
            "image",
            {"loader": "extract.datasets"},
        )

    return load


for _name, _rgb, _help in (
    ("fashion-mnist", False, "Fashion-MNIST (<data-dir>/FashionMNIST/raw), via extract.datasets"),
    ("cifar100", True, "CIFAR-100 (cifar-100-python), via extract.datasets"),
    ("tinyimagenet", True, "Tiny ImageNet 64x64 (tiny-imagenet-200), via extract.datasets; cached .npz"),
    ("imagefolder", True, "train/<class>/* and test/<class>/* of one image size, via extract.datasets"),
    ("digits", False, "scikit-learn 8x8 digits (no data dir needed; pass any folder), via extract.datasets"),
):
    register_dataset(_name, _help)(_extract_loader(_name, _rgb))


# ---------------------------------------------------------------- Speech Commands -> MFCC

KWS_WORDS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go"]


def _read_wav(path: Path) -> np.ndarray:
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise FedheadError(f"{path}: expected 16-bit mono WAV.")
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0


@register_dataset(
    "speech-commands",
    "Speech Commands, the 10 command words (<data-dir>/<word>/*.wav, 16 kHz), "
    "as 50x16 MFCCs; test = 20% of speakers (hash of the speaker id); the training speakers are its natural "
    "clients (--partition natural)",
)
def _speech(root: Path, cache: Path) -> ScratchData:
    missing = [w for w in KWS_WORDS if not (root / w).is_dir()]
    if missing:
        raise FedheadError(
            f"The '--data-dir' parameter must hold one folder per command word; missing "
            f"{', '.join(missing)} in {str(root)!r}."
        )
    path = cache / f"kws-{_cache_key(root, 'mfcc50x16')}.npz"
    # the speaker of every clip, in the order of the clips below (file names: <speaker>_nohash_<n>.wav)
    speakers = np.array([p.name.split("_")[0] for w in KWS_WORDS for p in sorted((root / w).glob("*.wav"))])
    if path.exists():
        z = np.load(path)
        feats, ys, test = z["x"], z["y"], z["test"]
    else:
        clips, ys, test = [], [], []
        for ci, w in enumerate(KWS_WORDS):
            for p in sorted((root / w).glob("*.wav")):
                a = _read_wav(p)[:16000]
                clips.append(np.pad(a, (0, 16000 - len(a))))
                ys.append(ci)
                speaker = p.name.split("_")[0]
                test.append(int(hashlib.sha1(speaker.encode()).hexdigest(), 16) % 5 == 0)
        feats = mfcc(torch.from_numpy(np.stack(clips)), MfccConfig()).numpy().astype(np.float32)
        ys, test = np.array(ys, dtype=np.int64), np.array(test)

        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, x=feats, y=ys, test=test)
    x = torch.from_numpy(feats).unsqueeze(1)  # [N, 1, 50, 16]
    tr = ~test
    names, ids = np.unique(speakers[tr], return_inverse=True)
    mean, std = float(x[torch.from_numpy(tr)].mean()), float(x[torch.from_numpy(tr)].std())
    return ScratchData(
        "speech-commands",
        x[torch.from_numpy(tr)],
        ys[tr],
        x[torch.from_numpy(test)],
        ys[test],
        list(KWS_WORDS),
        (mean,),
        (std,),
        "mfcc",
        {"mfcc": "50 frames x 16 coefficients"},
        train_clients=ids.astype(np.int64) if len(speakers) == len(ys) else None,
        client_names=[str(n) for n in names],
    )


# ---------------------------------------------------------------- colour skew (SPEC section 2, D&C)


def color_skew(
    labels: np.ndarray, num_clients: int, *, seed: int, skew: float = 0.95, num_test: int = 0
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """D&C / FedMA colour skew for 2 collaborators.

    Half the classes (chosen at random) go to collaborator 0 with a ``skew`` fraction of its images
    grayscaled; the other classes go to collaborator 1 with ``1 - skew`` grayscaled; ``num_test`` test
    images are grayscaled at 50%. Returns (parts, train_gray_indices, test_gray_indices).
    """
    if num_clients != 2:
        raise param_error(
            "--clients", num_clients, "must be 2 with --partition color-skew", "Use --clients 2 (two collaborators)."
        )
    validate("--skew", skew, Interval(0, 1))
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    classes = np.unique(labels)
    first = rng.choice(classes, size=len(classes) // 2, replace=False)
    in_first = np.isin(labels, first)
    parts = [np.flatnonzero(in_first), np.flatnonzero(~in_first)]
    gray = []
    for p, frac in zip(parts, (skew, 1.0 - skew)):
        n = int(round(frac * len(p)))
        gray.append(rng.choice(p, size=n, replace=False))
    test_gray = rng.choice(num_test, size=num_test // 2, replace=False) if num_test else np.zeros(0, int)
    return parts, np.sort(np.concatenate(gray)), np.sort(test_gray)


def grayscale_(x: torch.Tensor, idx: np.ndarray) -> None:
    """In place: copy channel R into G and B for rows ``idx`` of a uint8 [N, 3, H, W] tensor."""
    if len(idx) == 0:
        return
    t = torch.as_tensor(idx, dtype=torch.long)
    r = x[t, 0:1]
    x[t] = r.expand(-1, x.shape[1], -1, -1)
