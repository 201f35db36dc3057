"""States (checkpoints, final states, a node's kept variates) in a file that cannot run code when read: one
safetensors file whose tensors and numpy arrays are the state's arrays and whose header metadata holds the rest
of the state (its skeleton) as JSON.

The skeleton keeps what pickle would: dicts (any hashable key: str, int, tuple...), lists and tuples apart, ints of
any size (numpy's PCG64 state), floats with nan/inf/-0.0, bools, None, numpy scalars and torch dtypes. A JSON object
in it is always one tag and its payload; anything else is a plain JSON value:

``{"d": [[key, value], ...]}`` dict; ``{"l": [...]}`` list; ``{"t": [...]}`` tuple; ``{"T": name}`` a tensor and
``{"A": name}`` a numpy array (the safetensors entry ``name``); ``{"n": [dtype, value]}`` a numpy scalar;
``{"dt": name}`` a torch dtype; ``{"f": "nan" | "inf" | "-inf"}`` a float JSON cannot write.

:func:`save_state` refuses (TypeError) anything else, so that a new kind of state fails in the tests, not in a
user's resume. :func:`load_state` checks the file's size and header before reading its arrays, and refuses a file
of another shape in one line; nothing in it is evaluated or unpickled.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from fedhead.infra.errors import FedheadError
from fedhead.infra.files import atomic_write_bytes

SKELETON = "fedhead.state"  # the metadata key of the skeleton
MAX_HEADER = 100_000_000  # safetensors' own limit on its header
MAX_DEPTH = 64  # nesting of the skeleton
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
             "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
             "C64": 8}  # fmt: skip
_TORCH_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
                 "bfloat16", "float32", "float64", "complex64")  # fmt: skip
# the numpy dtypes a state holds (and a format-3 pickle may: fedhead.federation.rundir)
NUMPY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
                "float64")  # fmt: skip
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# ---------------------------------------------------------------- writing


class _Encoder:
    def __init__(self):
        self.tensors: dict[str, Any] = {}
        self.storages: set[int] = set()  # safetensors refuses tensors that share memory: a second one is copied

    def array(self, tag: str, t) -> dict:
        name = f"{tag.lower()}{len(self.tensors)}"
        self.tensors[name] = t
        return {tag: name}

    def __call__(self, v: Any, where: str, depth: int = 0) -> Any:
        import torch

        if depth > MAX_DEPTH:
            raise TypeError(f"The state cannot store {where}: nested deeper than {MAX_DEPTH}")
        if v is None or isinstance(v, (bool, str)):
            return v
        if type(v) is int:
            return v
        if type(v) is float:
            return v if math.isfinite(v) else {"f": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, (np.bool_, np.integer, np.floating)) and v.dtype.name in NUMPY_DTYPES:
            return {"n": [v.dtype.name, self(v.item(), where, depth + 1)]}
        if isinstance(v, torch.dtype) and str(v).removeprefix("torch.") in _TORCH_DTYPES:
            return {"dt": str(v).removeprefix("torch.")}
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided or v.is_quantized or str(v.dtype).removeprefix("torch.") not in _TORCH_DTYPES:
                raise TypeError(f"The state cannot store {where}: a {v.layout} {v.dtype} tensor")
            t = v.detach().cpu()
            whole = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
            if not whole or t.untyped_storage().data_ptr() in self.storages:
                t = t.clone(memory_format=torch.contiguous_format)
            self.storages.add(t.untyped_storage().data_ptr())
            return self.array("T", t)
        if isinstance(v, np.ndarray):
            if type(v) is not np.ndarray or v.dtype.name not in NUMPY_DTYPES or not v.dtype.isnative:
                raise TypeError(f"The state cannot store {where}: a numpy array of dtype {v.dtype}")
            return self.array("A", torch.from_numpy(np.array(v, order="C", copy=True)))
        if type(v) in (list, tuple):
            return {"l" if type(v) is list else "t": [self(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if type(v) is dict:
            items = []
            for k, x in v.items():
                if not _is_key(k):
                    raise TypeError(f"The state cannot store {where}: the key {k!r} ({type(k).__name__})")
                items.append([self(k, where, depth + 1), self(x, f"{where}[{k!r}]", depth + 1)])
            return {"d": items}
        raise TypeError(f"The state cannot store {where}: {type(v).__module__}.{type(v).__qualname__}")


def _is_key(k: Any) -> bool:
    """A dict key the skeleton keeps: str, int, bool, None, or a tuple of those."""
    if k is None or type(k) in (str, int, bool):
        return True
    return type(k) is tuple and all(_is_key(x) for x in k)


def encode_state(obj: Any) -> bytes:
    """``obj`` as the bytes of a safetensors file (TypeError naming the first part it cannot store)."""
    import safetensors.torch

    enc = _Encoder()
    skeleton = json.dumps(enc(obj, "the state"), allow_nan=False, separators=(",", ":"))
    return safetensors.torch.save(enc.tensors, metadata={SKELETON: skeleton})


def save_state(obj: Any, path: str | os.PathLike) -> None:
    """``obj`` into ``path`` atomically (a failed write raises its OSError and leaves the old file)."""
    atomic_write_bytes(path, encode_state(obj))


# ---------------------------------------------------------------- reading


class _Bad(Exception):
    """What is wrong with the file (the reason of the one-line error)."""


def _header(f, size: int) -> dict:
    if size < 8:
        raise _Bad(f"{size} bytes: too short for a safetensors file")
    (n,) = struct.unpack("<Q", f.read(8))
    if n < 2 or n > min(MAX_HEADER, size - 8):
        raise _Bad(f"its header claims {n} bytes of the file's {size}")
    try:
        header = json.loads(f.read(n))
    except (ValueError, RecursionError):
        raise _Bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise _Bad("its header is not a JSON object")
    body = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(entry, dict) and entry.get("dtype") in _ITEMSIZE and isinstance(entry.get("shape"), list)
                and all(type(d) is int and d >= 0 for d in entry["shape"])
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
                and all(type(o) is int for o in entry["data_offsets"])):  # fmt: skip
            raise _Bad(f"the header entry {name[:40]!r} is not a tensor's")
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= body or end - begin != math.prod(entry["shape"]) * _ITEMSIZE[entry["dtype"]]:
            raise _Bad(f"the tensor {name[:40]!r} claims more bytes than the file holds")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not isinstance(meta.get(SKELETON), str):
        raise _Bad("it holds no fedhead state (no skeleton in its metadata)")
    return header


class _Decoder:
    def __init__(self, tensors):
        self.tensors = tensors  # name -> a loader of that tensor

    def tensor(self, name: Any):
        if not isinstance(name, str) or name not in self.tensors:
            raise _Bad(f"the skeleton names the tensor {str(name)[:40]!r}, which the file does not hold")
        return self.tensors[name]()

    def __call__(self, v: Any, depth: int = 0) -> Any:
        import torch

        if depth > MAX_DEPTH:
            raise _Bad(f"its skeleton is nested deeper than {MAX_DEPTH}")
        if v is None or isinstance(v, (bool, str, int, float)):
            return v
        if not (isinstance(v, dict) and len(v) == 1):
            raise _Bad("its skeleton holds a JSON value of another shape")
        (tag, p), sub = next(iter(v.items())), depth + 1
        if tag in ("l", "t") and isinstance(p, list):
            items = [self(x, sub) for x in p]
            return items if tag == "l" else tuple(items)
        if tag == "d" and isinstance(p, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in p):
            out = {}
            for k, x in p:
                key = self(k, sub)
                if not _is_key(key):
                    raise _Bad("its skeleton holds a dict key of another type")
                out[key] = self(x, sub)
            return out
        if tag == "T":
            return self.tensor(p)
        if tag == "A":
            t = self.tensor(p)
            if str(t.dtype).removeprefix("torch.") not in NUMPY_DTYPES:
                raise _Bad(f"the numpy array {p!r} has the dtype {t.dtype}")
            return t.numpy()
        if tag == "n" and isinstance(p, list) and len(p) == 2 and p[0] in NUMPY_DTYPES:
            value = self(p[1], sub)
            kind = np.dtype(p[0]).kind
            if not isinstance(value, {"b": bool, "i": int, "u": int, "f": (int, float)}[kind]) or (
                kind in "iu" and isinstance(value, bool)
            ):
                raise _Bad(f"the numpy scalar {p[0]} holds {type(value).__name__}")
            return np.dtype(p[0]).type(value)
        if tag == "dt" and p in _TORCH_DTYPES:
            return getattr(torch, p)
        if tag == "f" and p in _NONFINITE:
            return _NONFINITE[p]
        raise _Bad(f"its skeleton holds the unknown tag {str(tag)[:20]!r}")


def load_state(path: str | os.PathLike, what: str, param: str, fix: str | None = None) -> Any:
    """The state :func:`save_state` wrote into ``path``, or a one-line FedheadError naming ``param`` (the option
    that named the file), ``what`` the file is and why it cannot be read (``fix``: what to do instead)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with open(path, "rb") as f:
            header = _header(f, os.fstat(f.fileno()).st_size)
        with safe_open(path, framework="pt", device="cpu") as st:
            names = set(st.keys())
            if names != {k for k in header if k != "__metadata__"}:
                raise _Bad("its tensors changed while it was read")
            skeleton = json.loads(header["__metadata__"][SKELETON])
            return _Decoder({n: (lambda n=n: st.get_tensor(n)) for n in names})(skeleton)
    except _Bad as exc:
        why = str(exc)
    except (OSError, ValueError, TypeError, KeyError, OverflowError, RecursionError, RuntimeError) as exc:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else 'unreadable'}"
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors (SafetensorError) and the like
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else 'unreadable'}"
    raise FedheadError(
        f"The '{param}' option cannot read the {what} {str(path)!r}: {why}. "
        + (fix or "It is not a state fedhead wrote, or it is damaged; restore it or do without it.")
    )
