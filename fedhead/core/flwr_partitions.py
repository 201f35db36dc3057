"""flwr-datasets' partitioners as fedhead partitions: ``--partition flwr:<ClassName>`` with ``--partition-arg KEY=VALUE``.

A ``flwr:<ClassName>`` partition builds a small ``datasets.Dataset`` of the store's training labels (a ``label``
column, the natural client ids as ``client`` where the store records them, and each row's training index), its rows
shuffled as ``flwr_datasets.FederatedDataset`` shuffles a split (``shuffle=True``: ``Dataset.shuffle(seed)``, here
with the run's seed), hands it to ``flwr_datasets.partitioner.<ClassName>`` and reads each partition's training
indices back from the index column. The partitioner gets ``num_partitions`` (``--clients``), ``partition_by``
(``label``; ``client`` for the natural-id partitioners) and ``seed`` (the run's) from fedhead where its ``__init__``
takes them, and the ``--partition-arg`` values as keyword arguments.

``--partition-arg`` values are literals read by :func:`ast.literal_eval` (never evaluated as code): numbers,
``true``/``false``, ``none``, quoted strings, lists like ``[1,2]``; a bare word (``allow-smaller``) is a string.

flwr-datasets and datasets are imported only when a ``flwr:`` partition is used (the ``data`` extra).
"""

from __future__ import annotations

import ast
import inspect
import re
import warnings
from typing import Any

import numpy as np

from fedhead.infra.errors import FedheadError, unknown_name

__all__ = [
    "FLWR_PREFIX",
    "is_flwr",
    "parse_partition_args",
    "format_partition_args",
    "flwr_partitioner_names",
    "resolve_flwr_args",
    "flwr_needs_clients",
    "flwr_partition",
]

FLWR_PREFIX = "flwr:"
ARG = "--partition-arg"
INSTALL = "pip install 'fedhead[data]'"
# what fedhead fills in itself, and from where
FILLED = {
    "num_partitions": "--clients",
    "partition_by": "the label column (the natural client ids for the natural-id partitioners)",
    "seed": "the run's seed (--seeds)",
}
NATURAL = ("NaturalIdPartitioner", "GroupedNaturalIdPartitioner")  # partition_by = the store's natural client ids
UNSUPPORTED = {
    "Partitioner": "the abstract base class",
    "VerticalEvenPartitioner": "a vertical partitioner (it splits the columns, not the samples)",
    "VerticalSizePartitioner": "a vertical partitioner (it splits the columns, not the samples)",
    "IdToSizeFncPartitioner": "it takes a Python function, which a --partition-arg literal cannot give (use "
    "flwr:LinearPartitioner, flwr:SquarePartitioner or flwr:ExponentialPartitioner)",
}
INDEX = "_fedhead_index"  # the column that carries each row's training index
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")
_ITEMS = re.compile(r"[\s,;]+(?=[A-Za-z_][A-Za-z0-9_]*\s*=)")  # between KEY=VALUE items: spaces, commas, semicolons
_WORDS = {"true": True, "false": False, "none": None, "null": None}
_EXAMPLE = f"Write KEY=VALUE, e.g. {ARG} alpha=0.1 (repeat {ARG} for more)."


def is_flwr(name: Any) -> bool:
    """Whether ``name`` names a flwr-datasets partitioner (``flwr:<ClassName>``)."""
    return isinstance(name, str) and name.startswith(FLWR_PREFIX)


# ---------------------------------------------------------------- values


def _literal(text: str, item: str, param: str) -> Any:
    """One ``--partition-arg`` value: a Python/TOML literal, or a bare word as a string."""
    text = text.strip()
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if _WORD.match(text):
            return text
        raise FedheadError(
            f"The '{param}' parameter has a value that does not parse: values are numbers, true/false, none, quoted "
            f"strings, words or lists like [1,2]. Got {item!r} instead. {_EXAMPLE}"
        ) from None
    return _checked(value, item, param)


def _checked(value: Any, item: Any, param: str) -> Any:
    """``value`` if it is a number, bool, string, None or a list of them (tuples as lists), else the error."""
    if isinstance(value, (list, tuple)):
        return [_checked(v, item, param) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise FedheadError(
        f"The '{param}' parameter takes numbers, true/false, none, strings and lists of them. Got {item!r} instead. "
        f"{_EXAMPLE}"
    )


def _items(value: Any, param: str) -> list[str]:
    if isinstance(value, str):
        return [t for t in _ITEMS.split(value.strip()) if t]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return [t for v in value for t in _ITEMS.split(v.strip()) if t]
    raise FedheadError(
        f"The '{param}' parameter must be KEY=VALUE items (a table of values in a file). Got {value!r} instead. "
        f"{_EXAMPLE}"
    )


def parse_partition_args(value: Any, param: str = ARG) -> dict:
    """``--partition-arg`` values as a dict: a dict (Python, a TOML table) checked, or ``KEY=VALUE`` text (one
    item, a list of items, or items separated by spaces, commas or semicolons) parsed. None is ``{}``. A key given
    twice, a key that is no Python name or a value that does not parse is one line naming ``param``."""
    if value is None:
        return {}
    if isinstance(value, dict):
        pairs = [(k, _checked(v, f"{k}={v!r}", param)) for k, v in value.items()]
    else:
        pairs = []
        for item in _items(value, param):
            key, eq, text = item.partition("=")
            if not eq or not text.strip():
                raise FedheadError(f"The '{param}' parameter must be KEY=VALUE. Got {item!r} instead. {_EXAMPLE}")
            pairs.append((key.strip(), _literal(text, item, param)))
    out: dict = {}
    for key, v in pairs:
        if not isinstance(key, str) or not _KEY.match(key):
            raise FedheadError(
                f"The '{param}' parameter needs a keyword argument name as KEY (letters, digits, _). Got {key!r} "
                f"instead. {_EXAMPLE}"
            )
        if key in out:
            raise FedheadError(f"The '{param}' parameter names {key} twice. Got {value!r} instead. Give {key} once.")
        out[key] = v
    return out


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, list):
        return "[" + ",".join(_text(x) for x in v) + "]"
    if isinstance(v, str) and (not _WORD.match(v) or v.lower() in _WORDS):
        return repr(v)
    return str(v)


def format_partition_args(args: dict) -> str:
    """``args`` as ``KEY=VALUE`` text that :func:`parse_partition_args` reads back to ``args`` (a Flower run-config
    value: Flower's values are scalars)."""
    return " ".join(f"{k}={_text(v)}" for k, v in args.items())


# ---------------------------------------------------------------- the partitioners


def _package():
    """``flwr_datasets.partitioner``, or the one line that names the extra."""
    try:
        import flwr_datasets.partitioner as package  # heavy (seconds) and optional: only when a flwr: partition runs
    except ImportError as exc:
        raise FedheadError(
            f"The '--partition' parameter flwr:<ClassName> needs flwr-datasets, which cannot be imported ({exc}). "
            f"Install the data extra: {INSTALL}."
        ) from None
    return package


def flwr_partitioner_names() -> list[str]:
    """The flwr-datasets partitioners a ``flwr:`` partition can use (``flwr:`` + class name)."""
    package = _package()
    return sorted(FLWR_PREFIX + n for n in getattr(package, "__all__", []) if n not in UNSUPPORTED)


def _class(name: str):
    package = _package()
    cls_name = name[len(FLWR_PREFIX) :]
    if cls_name in UNSUPPORTED and hasattr(package, cls_name):
        raise FedheadError(
            f"The '--partition' parameter names {name}, {UNSUPPORTED[cls_name]}. Got {name!r} instead. Use another "
            f"of: {', '.join(flwr_partitioner_names())}."
        )
    if cls_name not in getattr(package, "__all__", []):
        raise unknown_name("--partition", name, flwr_partitioner_names(), "flwr-datasets partitioner")
    return getattr(package, cls_name)


def _signature(cls) -> dict[str, inspect.Parameter]:
    params = inspect.signature(cls.__init__).parameters
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n: p for n, p in params.items() if n != "self" and p.kind not in kinds}


def resolve_flwr_args(name: str, args: Any) -> dict:
    """The ``--partition-arg`` values of partition ``name`` (``flwr:<ClassName>``) parsed and checked against the
    class's ``__init__``: an unknown class, a keyword it does not take, one fedhead fills in itself, or a required
    one left out is one line. Returns the values as a dict (what config.toml records)."""
    cls = _class(name)
    values = parse_partition_args(args)
    params = _signature(cls)
    takes = [n for n in params if n not in FILLED]
    for key, v in values.items():
        if key in FILLED and key in params:
            raise FedheadError(
                f"The '{ARG}' parameter {key} is filled in by fedhead for {name}: {FILLED[key]}. Got {key}={v!r} "
                f"instead. Drop it{' and give --clients' if key == 'num_partitions' else ''}."
            )
        if key not in params or key in FILLED:
            raise FedheadError(
                f"The '{ARG}' parameter {key} is not a keyword argument of {name}. Got {key}={v!r} instead. {name} "
                f"takes: {', '.join(takes) or 'nothing besides what fedhead fills in'}."
            )
    missing = [n for n in takes if params[n].default is inspect.Parameter.empty and n not in values]
    if missing:
        raise FedheadError(
            f"The '{ARG}' parameter must give {', '.join(missing)} for {name} (required by its __init__). Got "
            f"{format_partition_args(values) or 'none'} instead. Give {ARG} {missing[0]}=VALUE."
        )
    return values


def flwr_needs_clients(name: str) -> bool:
    """Whether partition ``name`` reads the store's natural client ids (the natural-id partitioners)."""
    return name[len(FLWR_PREFIX) :] in NATURAL


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _dataset(labels: np.ndarray, seed: int, client_ids: np.ndarray | None):
    """The labels (and natural client ids) as a ``datasets.Dataset`` whose rows are shuffled as FederatedDataset
    shuffles a split (``numpy.random.default_rng(seed).permutation``), each row carrying its training index."""
    import datasets  # optional and heavy: only here
    import pyarrow as pa

    perm = np.random.default_rng(int(seed)).permutation(len(labels))
    columns = {"label": pa.array(labels[perm].astype(np.int64)), INDEX: pa.array(perm.astype(np.int64))}
    if client_ids is not None:
        columns["client"] = pa.array(np.asarray(client_ids, dtype=np.int64)[perm])
    return datasets.Dataset(pa.table(columns))


def flwr_partition(
    name: str, labels: np.ndarray, num_clients: int, *, seed: int, args: dict, client_ids: np.ndarray | None = None
) -> list[np.ndarray]:
    """The training indices of each of the ``num_clients`` partitions of flwr-datasets' ``name`` (``flwr:<Class>``)
    over ``labels``, with the keyword arguments ``args`` (:func:`resolve_flwr_args`). The partitioner's own errors
    (and a partition count other than ``--clients``) are one line naming the class."""
    cls = _class(name)
    params = _signature(cls)
    natural = flwr_needs_clients(name)
    if natural and client_ids is None:
        raise FedheadError(
            f"The '--partition' parameter {name} needs the client of each training sample, which this store does not "
            "record. Re-extract it with --client-folders, --clients-csv or --client-pattern (fedhead extract), or "
            "choose another --partition."
        )
    kw = dict(args)
    filled = {"num_partitions": int(num_clients), "partition_by": "client" if natural else "label", "seed": int(seed)}
    kw.update({k: v for k, v in filled.items() if k in params})
    ds = _dataset(np.asarray(labels), seed, client_ids if natural else None)
    shown = format_partition_args(args) or "no --partition-arg"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DirichletPartitioner warns on every redraw: its error says enough
            partitioner = cls(**kw)
            partitioner.dataset = ds
            k = int(partitioner.num_partitions)
            if k != num_clients:
                raise FedheadError(
                    f"The '--clients' parameter must be the number of partitions {name} makes ({k} with {shown}). "
                    f"Got {num_clients} instead. Use --clients {k}, or other --partition-arg values."
                )
            tables = [partitioner.load_partition(i).with_format("arrow")[:] for i in range(k)]
    except FedheadError:
        raise
    except Exception as exc:  # the partitioner's own refusal (ValueError, KeyError, ...): its message, one line
        raise FedheadError(
            f"The '--partition' parameter {name} failed with {shown} and --clients {num_clients}: "
            f"{type(exc).__name__}: {_one_line(exc)}. Change the --partition-arg values or --clients."
        ) from None
    return [t.column(INDEX).to_numpy().astype(np.int64) for t in tables]
