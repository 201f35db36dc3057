"""Image dataset registry for extraction (and for the scratch-CNN path).

API
    ``load_dataset(name, data_dir, split, *, rgb=True, download=False) -> ImageSplit``
        ``split`` is "train" or "test" (tinyimagenet: "test" is the official val set).
    ``ImageSplit``: ``labels`` int64 [N]; ``class_names`` list[str]; and either
        ``images`` uint8 numpy [N, H, W, C] (in-memory datasets; C = 3, or 1 with ``rgb=False`` for the
        grayscale ones) or ``paths`` list[str] (image files decoded on demand); ``len(split)``;
        ``split.image(i)`` -> uint8 [H, W, 3] (or [H, W, 1] if ``rgb=False`` and grayscale) for either kind.
    ``dataset_names()``; ``DATASETS`` (name -> loader function); ``LAYOUTS`` (name -> expected layout text).
    ``select_limit(labels, limit, seed=0)`` -> sorted indices of the ``--limit`` subset (see there).
    ``try_image(split, i)`` -> the image, or ``Unreadable(index, path, reason)`` for a file that cannot be
        decoded (truncated, not an image, unreadable); ``split.image(i)`` raises PIL's error instead.

Layouts (``data_dir`` is the folder you pass with ``--data-dir``)
    cifar10        ``cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}`` (torchvision; ``--download``)
    cifar100       ``cifar-100-python/{train,test,meta}`` (torchvision; ``--download``)
    mnist          ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` (torchvision; ``--download``)
    fashion-mnist  ``FashionMNIST/raw/...`` same file names (torchvision; ``--download``)
    tinyimagenet   ``tiny-imagenet-200/{wnids.txt,words.txt,train/<wnid>/images/*.JPEG,
                   val/images/*.JPEG,val/val_annotations.txt}`` (test = val; labels from val_annotations.txt)
    imagefolder    ``train/<class>/*.{jpg,png,...}`` and ``test/<class>/*`` (classes = sorted train folders)
    digits         scikit-learn's bundled 8x8 digits (no data dir); seeded (seed 0) stratified 75/25 split
For cifar10/cifar100/mnist/fashion-mnist/tinyimagenet ``data_dir`` may also be the inner folder itself.
Grayscale images are repeated to 3 channels unless ``rgb=False``.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import io
import math
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Protocol

import numpy as np

from fedhead.infra.errors import FedheadError, param_error, unknown_name
from fedhead.infra.files import name_inside

SPLITS = ("train", "test")
# the source image size (height, width) of the datasets whose images all have one size: the input size of a
# model exported for raw images (fedhead export) when --input-size is not given
SOURCE_SIZES = {"digits": (8, 8), "cifar10": (32, 32), "cifar100": (32, 32), "mnist": (28, 28),
                "fashion-mnist": (28, 28), "tinyimagenet": (64, 64)}  # fmt: skip
IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


@dataclass
class ImageSplit:
    """One split of an image dataset (see the module docstring)."""

    name: str
    split: str
    labels: np.ndarray
    class_names: list[str]
    images: np.ndarray | None = None  # uint8 [N, H, W, C]
    paths: list[str] | None = None  # or image files
    rgb: bool = True
    meta: dict = field(default_factory=dict)
    clients: np.ndarray | None = None  # each image's client name (extract.clients: --client-folders)
    # records read by a reader (extract.formats: tar shards, tables): ``paths`` then holds their names
    source: RecordSource | None = None

    def __len__(self) -> int:
        return int(len(self.labels))

    @property
    def in_memory(self) -> bool:
        return self.images is not None

    def image(self, i: int) -> np.ndarray:
        if self.images is not None:
            return self.images[i]
        if self.source is not None:
            return decode_bytes(self.source.read(i), self.rgb)
        return decode_image(self.paths[i], self.rgb)

    def subset(self, idx: np.ndarray) -> "ImageSplit":
        idx = np.asarray(idx, dtype=np.int64)
        return ImageSplit(
            name=self.name,
            split=self.split,
            labels=self.labels[idx],
            class_names=self.class_names,
            images=None if self.images is None else self.images[idx],
            paths=None if self.paths is None else [self.paths[i] for i in idx],
            rgb=self.rgb,
            meta=dict(self.meta),
            clients=None if self.clients is None else self.clients[idx],
            source=None if self.source is None else self.source.subset(idx),
        )


class RecordSource(Protocol):
    """Image records of a split that are not files (:mod:`extract.formats`): picklable to DataLoader workers,
    opening what it reads lazily in each process."""

    def __len__(self) -> int: ...

    def read(self, i: int) -> bytes:
        """Record ``i``'s image bytes; :class:`BadRecord` if the record has none or they cannot be read."""
        ...

    def name(self, i: int) -> str:
        """Record ``i``'s name in messages and the store's skipped list (shard and key, or table and row)."""
        ...

    def subset(self, idx: np.ndarray) -> "RecordSource": ...


class BadRecord(Exception):
    """A record that has no readable image (a missing member, a label that does not parse): its reason."""


def records_sha256(split: ImageSplit) -> str | None:
    """SHA-256 of a split's record names, for the formats of :mod:`extract.formats` (part of the store's request:
    other records are another store); None for the other datasets (their requests are unchanged)."""
    if not split.meta.get("hash_records") or split.paths is None:
        return None
    return hashlib.sha256("\n".join(split.paths).encode("utf-8", "surrogatepass")).hexdigest()


def decode_image(path: "str | io.BytesIO", rgb: bool = True) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        if rgb or im.mode not in ("L", "1", "I", "I;16"):
            arr = np.array(im.convert("RGB"))
        else:
            arr = np.array(im.convert("L"))[..., None]
    return arr


def decode_bytes(data: bytes, rgb: bool = True) -> np.ndarray:
    """An image file's bytes (a record of :mod:`extract.formats`) decoded as :func:`decode_image` decodes a file."""
    return decode_image(io.BytesIO(data), rgb)


class Unreadable(NamedTuple):
    """An image file that could not be decoded: its index in the split, its path, and what is wrong."""

    index: int
    path: str
    reason: str


def unreadable_reason(exc: BaseException) -> str:
    """What is wrong with an image file whose decoding raised ``exc``, in a few words."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(exc, BadRecord):
        return str(exc)
    text = str(exc).replace(str(getattr(exc, "filename", "") or "\0"), "").strip(" :'")
    if isinstance(exc, FileNotFoundError):
        return "missing (removed after the folder was listed)"
    if isinstance(exc, PermissionError):
        return "not readable (permission denied)"
    if isinstance(exc, UnidentifiedImageError):
        return "not an image (PIL cannot identify it)"
    if isinstance(exc, Image.DecompressionBombError):
        return "too large (above PIL's decompression-bomb limit)"
    if "truncated" in text.lower():
        detail = re.sub(r"(?i)image file is truncated|truncated file read", "", text).strip(" ()")
        return f"truncated ({detail[:80]})" if detail else "truncated"
    return f"corrupt ({type(exc).__name__}: {text[:80]})"


def try_image(split: "ImageSplit", i: int) -> "np.ndarray | Unreadable":
    """``split.image(i)``, or an :class:`Unreadable` record if that file cannot be decoded (PIL raises
    many exception types for broken files; interrupts and fedhead's own errors pass through)."""
    try:
        return split.image(i)
    except Exception as exc:  # noqa: BLE001 - every decoding failure of one file is reported, none swallowed
        if isinstance(exc, (FedheadError, MemoryError)) or split.paths is None:
            raise
        where = split.paths[i] if split.source is not None else os.path.abspath(split.paths[i])
        return Unreadable(int(i), where, unreadable_reason(exc))


LAYOUTS: dict[str, str] = {}
DATASETS: dict[str, Callable[..., ImageSplit]] = {}
DOWNLOAD_HINT: dict[str, str] = {}
# the options a loader takes besides data_dir (extract.formats: --train-shards, --image-column, ...); such a loader
# checks data_dir itself
OPTIONS: dict[str, tuple[str, ...]] = {}


def register_dataset(name: str, layout: str, hint: str, options: tuple[str, ...] = ()):
    def deco(fn):
        DATASETS[name] = fn
        LAYOUTS[name] = layout
        DOWNLOAD_HINT[name] = hint
        OPTIONS[name] = tuple(options)
        return fn

    return deco


def dataset_names() -> list[str]:
    return list(DATASETS)


def load_dataset(
    name: str,
    data_dir: str | os.PathLike | None,
    split: str,
    *,
    rgb: bool = True,
    download: bool = False,
    options: dict | None = None,
) -> ImageSplit:
    """Load one split of a registered dataset (one-line FedheadError on unknown names or bad folders). ``options``
    (flag name without dashes, underscores -> value; None = not given) go to the loaders that take them."""
    if name not in DATASETS:
        raise unknown_name("--dataset", name, DATASETS, "dataset")
    if split not in SPLITS:
        raise param_error("split", split, "must be 'train' or 'test'")
    given = {k: v for k, v in (options or {}).items() if v is not None}
    for k in given:
        if k not in OPTIONS[name]:
            users = sorted(n for n, o in OPTIONS.items() if k in o)
            flag = "--" + k.replace("_", "-")
            raise FedheadError(
                f"The '{flag}' parameter applies to --dataset {', '.join(users)}. Got it with --dataset {name}. "
                f"Drop {flag}, or use one of those datasets."
            )
    if OPTIONS[name]:
        return DATASETS[name](
            Path(data_dir) if data_dir is not None else None, split, rgb=rgb, download=download, options=given
        )
    if name != "digits" and data_dir is None:
        raise param_error(
            "--data-dir",
            None,
            f"is required for dataset {name!r}",
            f"Expected layout: {LAYOUTS[name]}. {DOWNLOAD_HINT[name]}",
        )
    return DATASETS[name](Path(data_dir) if data_dir is not None else None, split, rgb=rgb, download=download)


def layout_error(name: str, data_dir: Path | None, problem: str) -> FedheadError:
    return FedheadError(
        f"The '--data-dir' parameter {str(data_dir)!r} does not hold {name} data ({problem}). "
        f"Expected layout: {LAYOUTS[name]}. {DOWNLOAD_HINT[name]}"
    )


def _gray_to(images: np.ndarray, rgb: bool) -> np.ndarray:
    images = images[..., None] if images.ndim == 3 else images
    if rgb and images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    return np.ascontiguousarray(images)


# ---------------------------------------------------------------- CIFAR (torchvision pickles)


def _find_inner(data_dir: Path, inner: str) -> Path:
    if data_dir is None:
        return Path(inner)
    if (data_dir / inner).is_dir():
        return data_dir / inner
    if data_dir.name == inner:
        return data_dir
    return data_dir / inner


CIFAR_MAX_BYTES = 1 << 30  # one CIFAR file (CIFAR-100's train batch: 155 MB)
_NUMERIC = set("biuf")  # the dtype kinds a CIFAR batch holds


class _Refused(pickle.UnpicklingError):
    """A pickle that asks for more than a CIFAR batch needs."""


def _plain_dtype(spec, align=False, copy=True) -> np.dtype:
    """``numpy.dtype`` for a batch: a numeric dtype by its short name, always a copy (pickle then sets its state)."""
    if not isinstance(spec, str) or len(spec) > 4:
        raise _Refused(f"a dtype {str(spec)[:20]!r}")
    dtype = np.dtype(spec, bool(align), True)
    if dtype.kind not in _NUMERIC or dtype.fields is not None or dtype.subdtype is not None:
        raise _Refused(f"the dtype {spec!r}")
    return dtype


class _NdarrayName:
    """What the name ``numpy.ndarray`` unpickles to: only :func:`_empty_array` takes it (calling the class would
    allocate any size)."""


def _empty_array(cls, shape, dtype):
    """``numpy.core.multiarray._reconstruct`` as numpy pickles an array: an empty one, filled by its state (numpy
    checks the data against the shape)."""
    if cls is not _NdarrayName or tuple(shape) != (0,) or dtype not in ("b", b"b"):
        raise _Refused("an array reconstructed otherwise than numpy pickles one")
    return np.ndarray((0,), np.uint8)


def _from_buffer(buf, dtype, shape, order):
    """``numpy._core.numeric._frombuffer`` (protocol 5): the array over the bytes it carries."""
    if not isinstance(buf, (bytes, bytearray)) or not isinstance(dtype, np.dtype) or dtype.kind not in _NUMERIC:
        raise _Refused("an array from a buffer of another kind")
    return np.frombuffer(buf, dtype).reshape(shape, order=order)


def _scalar(dtype, data):
    if not isinstance(dtype, np.dtype) or dtype.kind not in _NUMERIC or not isinstance(data, (bytes, str)):
        raise _Refused("a numpy scalar of another kind")
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    return core.multiarray.scalar(dtype, data)


def _latin1(text, encoding="utf-8", errors="strict"):
    """``_codecs.encode`` as pickle writes bytes (protocol 2 under Python 3): latin-1 text to bytes, nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Refused(f"the codec {str(encoding)[:20]!r}")
    return codecs.encode(text, "latin1")


_CIFAR_GLOBALS = {
    **{(m, "_reconstruct"): _empty_array for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "scalar"): _scalar for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "_frombuffer"): _from_buffer for m in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): _NdarrayName,
    ("numpy", "dtype"): _plain_dtype,
    ("_codecs", "encode"): _latin1,
}


class CifarUnpickler(pickle.Unpickler):
    """The CIFAR python batches' pickles and nothing else: dicts, lists, strings, numbers and numeric numpy arrays
    (numpy's own pickling of them, numpy 1 or 2, protocol 2 to 5); any other global is refused, so that a crafted
    batch cannot run code."""

    def find_class(self, module: str, name: str):
        found = _CIFAR_GLOBALS.get((module, name))
        if found is None:
            raise _Refused(f"it calls {module}.{name}, which a CIFAR batch never does")
        return found


def _plain(obj, depth: int = 0) -> bool:
    """Whether an unpickled batch holds only what a CIFAR batch does (no object arrays, no reconstruction marker)."""
    if depth > 8:
        return False
    if isinstance(obj, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_plain(v, depth + 1) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.dtype.kind in _NUMERIC and obj.dtype.fields is None and not obj.dtype.hasobject
    return obj is None or isinstance(obj, (str, bytes, int, float, np.generic))


def _unpickle(path: Path, name: str, data_dir: Path) -> dict:
    """One CIFAR file through :class:`CifarUnpickler`, its size checked first (the file is read whole: a length in
    the pickle cannot make a read allocate more than the file holds)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > CIFAR_MAX_BYTES:
                raise layout_error(name, data_dir, f"{path.name} holds {size} bytes, more than a CIFAR batch")
            data = f.read(CIFAR_MAX_BYTES + 1)
        obj = CifarUnpickler(io.BytesIO(data), encoding="latin1").load()
    except FileNotFoundError:
        raise layout_error(name, data_dir, f"missing {path.name}") from None
    except FedheadError:
        raise
    except _Refused as exc:
        raise layout_error(name, data_dir, f"{path.name} is not a readable CIFAR batch: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - truncated/garbage pickles
        raise layout_error(name, data_dir, f"{path.name} is not a readable CIFAR batch: {type(exc).__name__}") from None
    if not isinstance(obj, dict) or not _plain(obj):
        raise layout_error(name, data_dir, f"{path.name} is not a readable CIFAR batch: not a dict of arrays and lists")
    return obj


def _tv_download(cls_name: str, data_dir: Path, train: bool):
    import torchvision

    try:
        getattr(torchvision.datasets, cls_name)(root=str(data_dir), train=train, download=True)
    except Exception as exc:  # noqa: BLE001 - network errors of every kind
        raise FedheadError(
            f"Downloading {cls_name} into {str(data_dir)!r} failed ({str(exc).splitlines()[0][:120]}). "
            "Check the network or place the files yourself."
        ) from None


def _cifar_rows(d: dict, name: str, data_dir: Path, key: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        x = np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        y = np.asarray(d[key], dtype=np.int64)
    except (KeyError, ValueError) as exc:
        raise layout_error(name, data_dir, f"malformed batch ({type(exc).__name__}: {exc})") from None
    if len(x) != len(y):
        raise layout_error(name, data_dir, "image and label counts differ")
    return x, y


@register_dataset(
    "cifar10",
    "<data-dir>/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}",
    "Download with 'fedhead extract --dataset cifar10 --data-dir DIR --download' "
    "(torchvision) or get cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html.",
)
def _cifar10(data_dir, split, *, rgb=True, download=False):
    root = _find_inner(data_dir, "cifar-10-batches-py")
    if download and not (root / "batches.meta").exists():
        _tv_download("CIFAR10", data_dir, split == "train")
        root = _find_inner(data_dir, "cifar-10-batches-py")
    if not root.is_dir():
        raise layout_error("cifar10", data_dir, "no cifar-10-batches-py folder")
    files = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    xs, ys = zip(*[_cifar_rows(_unpickle(root / f, "cifar10", data_dir), "cifar10", data_dir, "labels") for f in files])
    meta = _unpickle(root / "batches.meta", "cifar10", data_dir)
    names = [str(n) for n in meta.get("label_names", [])] or [str(i) for i in range(10)]
    return ImageSplit("cifar10", split, np.concatenate(ys), names, images=np.concatenate(xs))


@register_dataset(
    "cifar100",
    "<data-dir>/cifar-100-python/{train,test,meta}",
    "Download with 'fedhead extract --dataset cifar100 --data-dir DIR --download' "
    "(torchvision) or get cifar-100-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html.",
)
def _cifar100(data_dir, split, *, rgb=True, download=False):
    root = _find_inner(data_dir, "cifar-100-python")
    if download and not (root / "meta").exists():
        _tv_download("CIFAR100", data_dir, split == "train")
        root = _find_inner(data_dir, "cifar-100-python")
    if not root.is_dir():
        raise layout_error("cifar100", data_dir, "no cifar-100-python folder")
    x, y = _cifar_rows(_unpickle(root / split, "cifar100", data_dir), "cifar100", data_dir, "fine_labels")
    meta = _unpickle(root / "meta", "cifar100", data_dir)
    names = [str(n) for n in meta.get("fine_label_names", [])] or [str(i) for i in range(100)]
    return ImageSplit("cifar100", split, y, names, images=x)


# ---------------------------------------------------------------- MNIST family (idx files)


IDX_MAX_BYTES = 256 << 20  # one idx file's data (MNIST's train images: 47 MB)


def read_idx(path: Path, max_bytes: int = IDX_MAX_BYTES) -> np.ndarray:
    """Read an idx file (uint8 data, optionally .gz) into a numpy array: its header first (magic, dimensions), then
    exactly the bytes it claims, at most ``max_bytes``: a gzip bomb is refused after reading its header, a file
    with more or fewer bytes than its header claims without decompressing more than one byte past it."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4 or head[:3] != b"\x00\x00\x08":
            raise ValueError("bad idx magic number")
        ndim = head[3]
        raw = f.read(4 * ndim)
        if not 1 <= ndim <= 4 or len(raw) != 4 * ndim:
            raise ValueError(f"bad idx header ({ndim} dimensions)")
        dims = [int.from_bytes(raw[4 * i : 4 * i + 4], "big") for i in range(ndim)]
        size = math.prod(dims)
        if size > max_bytes:
            raise ValueError(f"its header claims {dims} ({size} bytes), more than the {max_bytes} an idx file may")
        data = f.read(size)
        if len(data) != size:
            raise ValueError(f"{len(data)} bytes of data where its header {dims} claims {size}")
        if f.read(1):
            raise ValueError(f"more data than its header {dims} claims")
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def _mnist_like(name: str, folder: str, tv_cls: str, names: list[str]):
    def load(data_dir, split, *, rgb=True, download=False):
        root = _find_inner(data_dir, folder)
        raw = root / "raw" if (root / "raw").is_dir() else root
        prefix = "train" if split == "train" else "t10k"
        files = {}
        for kind, stem in (("x", f"{prefix}-images-idx3-ubyte"), ("y", f"{prefix}-labels-idx1-ubyte")):
            cand = [raw / stem, raw / (stem + ".gz")]
            found = next((c for c in cand if c.is_file()), None)
            if found is None and download:
                _tv_download(tv_cls, data_dir, split == "train")
                found = next((c for c in cand if c.is_file()), None)
            if found is None:
                raise layout_error(name, data_dir, f"missing {stem}")
            files[kind] = found
        arrays = {}
        for kind, path in files.items():
            try:
                arrays[kind] = read_idx(path)
            except (ValueError, OSError, EOFError, gzip.BadGzipFile) as exc:
                raise layout_error(name, data_dir, f"malformed idx file {path.name}: {exc}") from None
        x, y = arrays["x"], arrays["y"].astype(np.int64)
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise layout_error(name, data_dir, "image and label files do not match")
        return ImageSplit(name, split, y, list(names), images=_gray_to(x, rgb), rgb=rgb)

    return load


register_dataset(
    "mnist",
    "<data-dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]",
    "Download with 'fedhead extract --dataset mnist --data-dir DIR --download' (torchvision).",
)(_mnist_like("mnist", "MNIST", "MNIST", [str(i) for i in range(10)]))
register_dataset(
    "fashion-mnist",
    "<data-dir>/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]",
    "Download with 'fedhead extract --dataset fashion-mnist --data-dir DIR --download' (torchvision).",
)(
    _mnist_like(
        "fashion-mnist",
        "FashionMNIST",
        "FashionMNIST",
        ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"],
    )
)


# ---------------------------------------------------------------- folders


def images_in(folder: Path) -> list[str]:
    """The image files below ``folder`` (recursively, by suffix), sorted by path."""
    return sorted(str(p) for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTS and p.is_file())


@register_dataset(
    "imagefolder",
    "<data-dir>/train/<class>/*.jpg and <data-dir>/test/<class>/*.jpg",
    "Put one folder per class under train/ and test/ (torchvision ImageFolder layout).",
)
def _imagefolder(data_dir, split, *, rgb=True, download=False):
    tr = data_dir / "train"
    if not tr.is_dir() or not (data_dir / split).is_dir():
        raise layout_error("imagefolder", data_dir, f"no {'train' if not tr.is_dir() else split}/ folder")
    classes = sorted(p.name for p in tr.iterdir() if p.is_dir())
    if not classes:
        raise layout_error("imagefolder", data_dir, "train/ has no class folders")
    folder = data_dir / split
    extra = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name not in classes)
    if extra:
        raise layout_error("imagefolder", data_dir, f"{split}/ has classes missing from train/: {extra[:3]}")
    paths, labels = [], []
    for c, cls in enumerate(classes):
        if (folder / cls).is_dir():
            files = images_in(folder / cls)
            paths += files
            labels += [c] * len(files)
    if not paths:
        raise layout_error("imagefolder", data_dir, f"{split}/ has no image files")
    return ImageSplit("imagefolder", split, np.asarray(labels, dtype=np.int64), classes, paths=paths, rgb=rgb)


@register_dataset(
    "tinyimagenet",
    "<data-dir>/tiny-imagenet-200/{wnids.txt,train/<wnid>/images/*.JPEG,val/images/*.JPEG,val/val_annotations.txt}",
    "Download http://cs231n.stanford.edu/tiny-imagenet-200.zip and unzip it into DIR.",
)
def _tinyimagenet(data_dir, split, *, rgb=True, download=False):
    root = _find_inner(data_dir, "tiny-imagenet-200")
    wn = root / "wnids.txt"
    if not wn.is_file():
        raise layout_error("tinyimagenet", data_dir, "missing wnids.txt")
    wnids = [w.strip() for w in wn.read_text().split() if w.strip()]
    for w in wnids:  # each names a folder train/<wnid>
        name_inside(root / "train", w, f"The TinyImageNet list {str(wn)!r}")
    index = {w: i for i, w in enumerate(wnids)}
    words = {}
    if (root / "words.txt").is_file():
        for line in (root / "words.txt").read_text().splitlines():
            k, _, v = line.partition("\t")
            words[k.strip()] = v.split(",")[0].strip()
    names = [words.get(w) or w for w in wnids]
    paths, labels = [], []
    if split == "train":
        for w in wnids:
            d = root / "train" / w / "images"
            if not d.is_dir():
                raise layout_error("tinyimagenet", data_dir, f"missing train/{w}/images")
            files = images_in(d)
            paths += files
            labels += [index[w]] * len(files)
    else:
        ann = root / "val" / "val_annotations.txt"
        if not ann.is_file():
            raise layout_error("tinyimagenet", data_dir, "missing val/val_annotations.txt")
        for line in ann.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) < 2:
                continue
            if parts[1] not in index:
                raise layout_error("tinyimagenet", data_dir, f"val annotation class {parts[1]!r} not in wnids.txt")
            p = name_inside(root / "val" / "images", parts[0], f"The TinyImageNet list {str(ann)!r}")
            if not p.is_file():
                raise layout_error("tinyimagenet", data_dir, f"missing val/images/{parts[0]}")
            paths.append(str(p))
            labels.append(index[parts[1]])
    if not paths:
        raise layout_error("tinyimagenet", data_dir, f"no {split} images")
    return ImageSplit("tinyimagenet", split, np.asarray(labels, dtype=np.int64), names, paths=paths, rgb=rgb)


# ---------------------------------------------------------------- scikit-learn digits


DIGITS_SEED = 0
DIGITS_TEST_FRACTION = 0.25


@register_dataset(
    "digits", "none (scikit-learn's bundled 8x8 digits; --data-dir is ignored)", "It ships with scikit-learn."
)
def _digits(data_dir, split, *, rgb=True, download=False):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = np.clip(np.round(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    y = d.target.astype(np.int64)
    idx = np.arange(len(y))
    tr, te = train_test_split(idx, test_size=DIGITS_TEST_FRACTION, stratify=y, random_state=DIGITS_SEED)
    sel = np.sort(tr if split == "train" else te)
    return ImageSplit("digits", split, y[sel], [str(i) for i in range(10)], images=_gray_to(x[sel], rgb), rgb=rgb)


# ---------------------------------------------------------------- --limit


LIMIT_SEED = 0


def select_limit(labels: np.ndarray, limit: int | None, seed: int = LIMIT_SEED) -> np.ndarray:
    """Indices kept by ``--limit N``: a seeded, class-stratified round-robin draw.

    Each class's samples are shuffled with ``default_rng(seed)``; the classes are then visited in
    turn (class order shuffled too), taking one sample each time, until N are taken. Every class gets
    floor(N/C) or ceil(N/C) samples (fewer only if it runs out). The kept indices are returned sorted,
    i.e. in the dataset's own order. ``limit`` None or >= N keeps everything.
    """
    n = len(labels)
    if limit is None or limit >= n:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    lab = labels[perm]
    # rank of each permuted sample within its class
    order = np.argsort(lab, kind="stable")
    ranks = np.empty(n, dtype=np.int64)
    sorted_lab = lab[order]
    starts = np.searchsorted(sorted_lab, sorted_lab, side="left")
    ranks[order] = np.arange(n) - starts
    classes = rng.permutation(np.unique(labels))
    lut = np.zeros(int(labels.max()) + 1, dtype=np.int64)
    lut[classes] = np.arange(len(classes))
    cpos = lut[lab]
    key = np.lexsort((cpos, ranks))
    return np.sort(perm[key[:limit]])
