"""The run directory every training command writes (names fixed: later tools read them), and its life cycle.

``config.json``     the full resolved configuration, the store's metadata, the fedhead version, the run's identity
``config.toml``     the resolved experiment as an experiment file: ``fedhead train --config RUN/config.toml`` repeats it
``rounds.csv``      one row per (seed, round): ROUND_FIELDS, then any extra columns
``summary.json``    final (test) accuracy, the round validation selected and the test accuracy there, Acc@95, ratios,
                    mean and std over seeds, wall seconds
``clients.csv``     client id, size, number of classes, per-class counts (compact ``class:count`` form)
``checkpoint.safetensors``   while the run is unfinished: everything needed to continue it (one format for every
                             command)
``final-state.safetensors``  once finished: the last state of every seed, so that ``--resume`` with more rounds
                             extends it

Checkpoints and final states are :mod:`fedhead.infra.safestate` files (arrays and JSON: reading one runs no
code). A run directory of an older fedhead holds them pickled (``checkpoint.pt``, ``final-state.pt``): read only
with ``FEDHEAD_TRUST_PICKLED_RUNS=1``, by torch's weights-only unpickler (:func:`read_state`).

All files are written atomically (a temporary file renamed over the final name). :class:`RunDir` is the one life
cycle of such a directory (fresh, resumed, extended, finished and reported again), shared by ``fedhead train``,
``fedhead flower`` and ``fedhead scratch``.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from fedhead import __version__
from fedhead.infra.errors import FedheadError
from fedhead.infra.files import atomic_write_json, atomic_write_text
from fedhead.infra.lazy import lazy_module
from fedhead.infra.safestate import NUMPY_DTYPES, load_state, save_state
from fedhead.infra.signals import Interrupted

torch = lazy_module("torch")

ROUND_FIELDS = [
    "seed",
    "round",
    "stage",
    "accuracy",
    "train_loss",
    "client_ms",
    "server_ms",
    "bytes_up_per_client",
    "bytes_total",
    "ratio_to_iid",
]


def default_run_dir(root: str | Path, *parts: str) -> Path:
    """A new run directory ``<root>/<stamp>-<parts>`` that no other run has: created here (empty), so two runs that
    start in the same second (a sweep from Python, two shells) never share it; the second gets ``-2``, and so on."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = "-".join([stamp, *[p.replace(":", "-") for p in parts if p]])  # flwr:<ClassName>: no ':' in a name
    Path(root).mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = Path(root) / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FedheadError(
        f"The '--out' parameter was not given, and {str(Path(root) / base)!r} and 9,998 variants of "
        "it exist already. Give --out."
    )


def write_experiment(run_dir: str | Path, cfg) -> Path:
    """``config.toml``: the run's resolved experiment (a :class:`fedhead.federation.config.TrainConfig`) as an
    experiment file, so that ``fedhead train --config RUN_DIR/config.toml`` repeats the run (its feature store path
    as the run was given it, relative to the working directory it ran in)."""
    path = Path(run_dir) / "config.toml"
    atomic_write_text(path, cfg.to_toml())
    return path


def write_csv(path: str | Path, rows: Sequence[dict], fields: Sequence[str] | None = None) -> None:
    """Write dict rows as CSV atomically; the columns are ``fields`` then any other keys in order."""
    cols = list(fields or [])
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _fmt(r.get(k)) for k in cols})
    atomic_write_text(path, buf.getvalue())


def read_csv(path: str | Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # a cell a spreadsheet would run as a formula (OWASP)


def _fmt(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, str):  # text from elsewhere (a node's error) is never a formula: a leading ' keeps it text;
        v = "'" + v if v.startswith(FORMULA_STARTS) else v  # a bare CR (which the writer leaves unquoted) is a
        return v.replace("\r\n", "\n").replace("\r", "\n")  # row break to readers: a quoted LF instead
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    if isinstance(v, np.floating):
        return _fmt(float(v))
    return v


def write_rounds(run_dir: str | Path, rows: Sequence[dict], fields: Sequence[str] = ROUND_FIELDS) -> None:
    write_csv(Path(run_dir) / "rounds.csv", rows, fields)


def write_config(run_dir: str | Path, config: dict) -> None:
    atomic_write_json(Path(run_dir) / "config.json", {"fedhead_version": __version__, **config})


def write_summary(run_dir: str | Path, summary: dict) -> None:
    atomic_write_json(Path(run_dir) / "summary.json", summary)


def _client_rows(sizes, class_counts, extra: dict[str, Sequence] | None = None, **fixed) -> list[dict]:
    """One row per client; the compact form lists only non-zero classes as ``c:n`` pairs."""
    rows = []
    for k, (n, counts) in enumerate(zip(sizes, class_counts)):
        counts = np.asarray(counts)
        nz = np.flatnonzero(counts)
        row = {
            **fixed,
            "client": k,
            "size": int(n),
            "num_classes": int(len(nz)),
            "class_counts": " ".join(f"{c}:{int(counts[c])}" for c in nz),
        }
        for key, vals in (extra or {}).items():
            row[key] = vals[k]
        rows.append(row)
    return rows


def write_clients(
    run_dir: str | Path, sizes: np.ndarray, class_counts: np.ndarray, extra: dict[str, Sequence] | None = None
) -> None:
    """``class_counts`` is [K, C]: one row per client."""
    write_csv(
        Path(run_dir) / "clients.csv",
        _client_rows(sizes, class_counts, extra),
        ["client", "size", "num_classes", "class_counts"],
    )


def write_clients_per_seed(run_dir: str | Path, groups: Sequence[dict]) -> None:
    """``groups``: ``{"seed", "sizes", "counts"}`` per seed; a ``seed`` column appears when there are several."""
    if len(groups) == 1:
        write_clients(run_dir, groups[0]["sizes"], groups[0]["counts"])
        return
    rows = [r for g in groups for r in _client_rows(g["sizes"], g["counts"], seed=g["seed"])]
    write_csv(Path(run_dir) / "clients.csv", rows, ["seed", "client", "size", "num_classes", "class_counts"])


# ---------------------------------------------------------------- metrics (SPEC section 7)


def acc95_round(accuracies: Sequence[float], reference: float | None = None) -> int | None:
    """First round (1-based) whose accuracy reaches 0.95 x ``reference`` (default: the final accuracy)."""
    acc = list(accuracies)
    if not acc:
        return None
    target = 0.95 * (acc[-1] if reference is None else reference)
    for i, a in enumerate(acc):
        if a >= target:
            return i + 1
    return None


def mean_std(values: Iterable[float | None]) -> tuple[float, float]:
    v = np.array([x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


# ---------------------------------------------------------------- the life cycle of a run directory

CHECKPOINT = "checkpoint.safetensors"
FINAL_STATE = "final-state.safetensors"
# 4: format 3's content as a safestate file; 3: one format for train, Flower and scratch (the loop's), pickled;
# earlier ones are refused
CHECKPOINT_FORMAT = 4
PICKLED = {CHECKPOINT: "checkpoint.pt", FINAL_STATE: "final-state.pt"}  # format 3's names
PICKLED_FORMAT = 3
# what only a run directory holds at its top: --overwrite empties a folder only if it holds one of them
RUN_MARKERS = {"config.json", "rounds.csv", "summary.json", CHECKPOINT, FINAL_STATE, *PICKLED.values()}
TRUST_PICKLES_ENV = "FEDHEAD_TRUST_PICKLED_RUNS"  # "1": read format 3's pickles (weights-only) of a trusted run


def _pickle_globals() -> list:
    """What a format-3 pickle may name besides tensors: numpy arrays, their numeric dtypes and scalars."""
    multiarray = (getattr(np, "_core", None) or np.core).multiarray  # numpy 2 / numpy 1
    return [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, bytes,
            *{type(np.dtype(n)) for n in NUMPY_DTYPES}]  # fmt: skip


def read_state(path: str | Path, what: str = "checkpoint", param: str = "--resume", fix: str | None = None) -> Any:
    """A checkpoint or final state (the one reader of both): a safestate file, or a format-3 pickle (``*.pt``) only
    with ``FEDHEAD_TRUST_PICKLED_RUNS=1``, read by torch's weights-only unpickler (never ``weights_only=False``).
    ``param``: the option that named the run; ``fix``: what to do instead (the one-line errors' end)."""
    path = Path(path)
    fix = fix or "Choose another run directory."
    if path.suffix != ".pt":
        return load_state(path, what, param, fix)
    if os.environ.get(TRUST_PICKLES_ENV) != "1":
        raise FedheadError(
            f"The '{param}' option found the {what} {str(path)!r} in the pickle format of an older fedhead, which "
            f"can run code when read. If you trust where this run directory came from, set {TRUST_PICKLES_ENV}=1 "
            f"to read it (with torch's weights-only loader); otherwise: {fix}"
        )
    try:
        with torch.serialization.safe_globals(_pickle_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable pickle is the same one-line error
        why = (str(exc).strip().splitlines() or [""])[0][:160]
        raise FedheadError(
            f"The '{param}' option cannot read the pickled {what} {str(path)!r} ({type(exc).__name__}: {why}). {fix}"
        ) from None


def identity_hash(fields: dict) -> str:
    """The short hash of a run's identity fields (what determines its results)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _show(v: Any) -> str:
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def identity_differences(before: dict, now: dict, name: Callable[[str], str] = str) -> list[str]:
    """Each setting that differs between two identities, with both values: ``--lr 0.01 (the run) -> 0.1``; a group
    of settings (``partition_params``) is named setting by setting. ``name``: how a setting is named (its flag)."""
    out = []
    for k in sorted(set(before) | set(now)):
        b, n = before.get(k), now.get(k)
        if b == n:
            continue
        if isinstance(b, dict) and isinstance(n, dict) and k.endswith("_params"):
            out += identity_differences(b, n, name)
            continue
        shown = "unset" if b is None else _show(b), "unset" if n is None else _show(n)
        out.append(f"{name(k)} {shown[0]} (the run) -> {shown[1]}")
    return out


@dataclass
class Opened:
    """What :meth:`RunDir.open` found: ``kind`` is ``fresh`` (nothing to continue), ``resume`` (a checkpoint),
    ``extend`` (a finished run given more rounds: ``checkpoint`` is its final state) or ``finished`` (reported
    again: ``summary`` and ``rows``). ``previous`` is the config.json found (its ``cpu_threads`` is reused)."""

    kind: str
    checkpoint: dict | None = None
    summary: dict | None = None
    rows: list | None = None
    previous: dict = field(default_factory=dict)
    replace: bool = False  # --overwrite: the earlier run in the folder goes when the new one is prepared


@dataclass
class RunDir:
    """One run directory's life cycle: refuse what cannot continue in one line, load what can.

    ``identity``: the settings that determine the results (names -> values; the feature store by its content
    hash, not its path); a resume with other settings is refused naming each difference. ``legacy``: identity
    hashes a run written by an earlier fedhead may carry for the same settings. ``extendable``: an identity
    field (``rounds``) that may grow on a finished run, which then continues from its final state.
    ``restart_ok``: a resume that finds nothing saved starts afresh (a Flower server restarted before its
    first checkpoint) instead of being refused. ``out_param`` / ``resume_param``: the names the errors use.
    ``identity_of``: the identity of the run a config.json describes (to name differences without storing the
    identity twice). ``overwrite``: a directory holding an earlier run (or what a failed run left) is emptied and
    the run starts afresh there; a folder that does not look like a run directory is never emptied.
    ``setting_name``: how a differing setting is named in the refusals (its flag)."""

    path: Path
    identity: dict
    resume: bool = False
    out_param: str = "--out"
    resume_param: str = "--resume"
    legacy: tuple = ()
    extendable: str | None = None
    restart_ok: bool = False
    identity_of: Callable[[dict], dict] | None = None
    overwrite: bool = False
    overwrite_param: str | None = None  # the option that replaces a run, where the command has one (train)
    setting_name: Callable[[str], str] = str

    def __post_init__(self):
        self.path = Path(self.path)
        self.hash = identity_hash(self.identity)

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT

    def resume_hint(self) -> str:
        """How to continue this run after a stop (nothing to continue before config.json exists)."""
        if not (self.path / "config.json").exists():
            return "re-run the same command"
        if self.resume_param.startswith("--"):
            return f"re-run the same command with {self.resume_param} {self.out_param} {self.path} to continue"
        return f"start the run again with {self.resume_param}=true and {self.out_param}='{self.path}' to continue"

    @contextlib.contextmanager
    def interrupted(self) -> Iterator[None]:
        """An interrupt (SIGINT/SIGTERM) re-raised with how to continue this run."""
        try:
            yield
        except Interrupted as exc:
            if (self.path / "config.json").exists():
                msg = f"interrupted; the checkpoint in {str(self.path)!r} is consistent: {self.resume_hint()}"
            else:
                msg = f"interrupted before anything was written to {str(self.path)!r}; re-run the same command"
            raise Interrupted(exc.signum, msg) from None

    @contextlib.contextmanager
    def failed(self) -> Iterator[None]:
        """A run that fails after writing (a partition a later seed cannot draw, a diverged round) says how to
        retry: its folder now holds a run, which a plain re-run would refuse."""
        try:
            yield
        except Interrupted:
            raise  # interrupted(): its own exit code and how to continue
        except FedheadError as exc:
            if self.resume or self.overwrite_param is None or getattr(self, "record", None) is None:
                raise  # continued, no --overwrite to offer, or failed before prepare() wrote anything
            raise FedheadError(
                f"{str(exc).rstrip()} The run stopped in {str(self.path)!r}: to retry with other settings add "
                f"{self.overwrite_param} (or choose another {self.out_param}); with the same settings, "
                f"{self.resume_param} continues it."
            ) from None

    def _again(self) -> str:
        if self.overwrite_param is None:
            return f"Use the same options as the interrupted run, or a new {self.out_param}."
        return (
            f"Use the same options as the interrupted run, or a new {self.out_param}, or "
            f"{self.overwrite_param} to replace that run."
        )

    def _state_file(self, name: str) -> Path | None:
        """The run's ``name`` (CHECKPOINT or FINAL_STATE), else its format-3 pickle, else None."""
        for path in (self.path / name, self.path / PICKLED[name]):
            if path.exists():
                return path
        return None

    def _state(self, path: Path, what: str) -> Any:
        fix = f"Choose another {self.out_param}, or run again without {self.resume_param} into an empty one."
        state = read_state(path, what, self.resume_param, fix)
        wanted = PICKLED_FORMAT if path.suffix == ".pt" else CHECKPOINT_FORMAT
        return state if isinstance(state, dict) and state.get("format") == wanted else None

    def _read(self, name: str, loader, what: str) -> Any:
        try:
            return loader(self.path / name)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one-line error
            raise FedheadError(
                f"The '{self.resume_param}' option cannot read the {what} {str(self.path / name)!r} "
                f"({type(exc).__name__}). Choose another {self.out_param}, or run again without {self.resume_param} "
                "into an empty one."
            ) from None

    def _same_run(self, previous: dict) -> tuple[bool, list[str]]:
        """Whether ``previous`` (a config.json) is this run, and the differing settings when it is not."""
        if previous.get("identity") in {self.hash, *self.legacy}:
            return True, []
        return False, identity_differences(self._previous_identity(previous), self.identity, self.setting_name)

    def _previous_identity(self, previous: dict) -> dict:
        try:
            return self.identity_of(previous) if self.identity_of is not None else {}
        except (KeyError, TypeError, ValueError, AttributeError):  # a config.json of another shape: no names
            return {}

    def _refuse(self, differences: list[str], what: str = "run") -> FedheadError:
        named = f": {'; '.join(differences)}" if differences else ""
        return FedheadError(
            f"The '{self.resume_param}' option found a {what} in {str(self.path)!r} with a different configuration"
            f"{named}. {self._again()}"
        )

    def open(self) -> Opened:
        """Check ``path`` against this run (nothing is written) and say how to continue."""
        if self.overwrite and self.resume:
            raise FedheadError(
                f"The '{self.overwrite_param}' option replaces the run in {str(self.path)!r}, and "
                f"'{self.resume_param}' continues it. Got both. Give one of them."
            )
        if not self.resume:
            if self.path.exists() and any(self.path.iterdir()):
                if self.overwrite:
                    self._check_replaceable()
                    return Opened("fresh", replace=True)
                if self.overwrite_param is None:  # a command without --overwrite (scratch, Flower)
                    again = f"Use {self.resume_param} to continue that run, or choose another {self.out_param}."
                elif self._looks_like_run():
                    again = (
                        f"Use {self.resume_param} to continue that run, {self.overwrite_param} to replace it, or "
                        f"choose another {self.out_param}."
                    )
                else:
                    again = f"Choose another {self.out_param}: it is not a run directory."
                raise FedheadError(
                    f"The '{self.out_param}' parameter names {str(self.path)!r}, which already holds files. {again}"
                )
            return Opened("fresh")
        if not (self.path / "config.json").exists():
            if self.restart_ok and not (self.path.exists() and any(self.path.iterdir())):
                return Opened("fresh")
            raise FedheadError(
                f"The '{self.resume_param}' option needs a run to continue in {str(self.path)!r}, but it holds none "
                f"(no config.json). Run without {self.resume_param}, or name the interrupted run with "
                f"{self.out_param}."
            )
        previous = self._read("config.json", lambda p: json.loads(p.read_text()), "configuration")
        same, differences = self._same_run(previous)
        saved = self._state_file(CHECKPOINT)
        if saved is not None:
            if not same:
                raise self._refuse(differences)
            ckpt = self._state(saved, "checkpoint")
            if ckpt is None or ckpt.get("identity") not in ({self.hash} | set(self.legacy)):
                raise self._refuse([], "checkpoint")
            return Opened("resume", checkpoint=ckpt, previous=previous)
        finished = (self.path / "summary.json").exists()
        if finished and not same:
            extended = self._extension(previous, differences)
            if extended is not None:
                return Opened("extend", checkpoint=extended, previous=previous)
            raise self._refuse(differences)
        if not same:
            raise self._refuse(differences)
        if finished:
            summary = self._read("summary.json", lambda p: json.loads(p.read_text()), "summary")
            rows = read_csv(self.path / "rounds.csv") if (self.path / "rounds.csv").exists() else []
            return Opened("finished", summary=summary, rows=rows, previous=previous)
        return Opened("fresh", previous=previous)  # stopped before its first round was saved: start again

    def _extension(self, previous: dict, differences: list[str]) -> dict | None:
        """A finished run whose identity differs only by more rounds continues from its final state."""
        key, before = self.extendable, self._previous_identity(previous)
        final = self._state_file(FINAL_STATE)
        if key is None or not before or final is None:
            return None
        others = {k: v for k, v in before.items() if k != key}
        if others != {k: v for k, v in self.identity.items() if k != key}:
            return None
        if not isinstance(before.get(key), int) or self.identity.get(key, 0) <= before[key]:
            return None
        return self._state(final, "final state")

    def _looks_like_run(self) -> bool:
        """Whether the folder holds what a run writes (config.json, a checkpoint or the results), nothing else."""
        names = {p.name for p in self.path.iterdir()}
        return bool(names & RUN_MARKERS)

    def _check_replaceable(self) -> None:
        """``--overwrite`` empties only a run directory: a folder that holds no run file, or a file that no run
        writes at its top (someone's data), is refused."""
        if not self.path.is_dir() or not self._looks_like_run():
            raise FedheadError(
                f"The '{self.overwrite_param}' option replaces a run directory, but {str(self.path)!r} holds no run "
                f"(no config.json, checkpoint or rounds.csv). Choose another {self.out_param}; fedhead never empties "
                "a folder it did not write."
            )

    def _clear(self) -> None:
        """Empty the run directory (``--overwrite``): the old run moves aside first, then goes, so a crash in
        between leaves either the old run or an empty folder plus a ``.replaced-*`` sibling, never a mixture."""
        import shutil

        aside = self.path.with_name(f".{self.path.name}.replaced-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(self.path, aside)
        self.path.mkdir()
        shutil.rmtree(aside, ignore_errors=True)

    def prepare(self, config: dict, opened: Opened) -> None:
        """Create the folder and write config.json with this run's identity (an extended run's is its new one);
        with ``--overwrite`` the earlier run there goes first."""
        if opened.replace and self.path.exists():
            self._clear()
        self.path.mkdir(parents=True, exist_ok=True)
        self.record = {"identity": self.hash}
        write_config(self.path, {**self.record, **config})

    def rewrite_config(self, config: dict) -> None:
        """config.json again, with what the run found (the identity written by :meth:`prepare` kept)."""
        write_config(self.path, {**self.record, **config})

    def save_checkpoint(self, state: dict) -> None:
        save_state({"format": CHECKPOINT_FORMAT, "identity": self.hash, **state}, self.checkpoint_path)
        (self.path / PICKLED[CHECKPOINT]).unlink(missing_ok=True)  # a format-3 run continued: its pickle is stale

    def finish(self, final_state: dict | None) -> None:
        """The run is complete (its summary written): keep its final state for an extension, drop the checkpoint
        (and the pickles of a format-3 run it continued)."""
        if final_state is not None:
            save_state({"format": CHECKPOINT_FORMAT, "identity": self.hash, **final_state}, self.path / FINAL_STATE)
            (self.path / PICKLED[FINAL_STATE]).unlink(missing_ok=True)
        self.checkpoint_path.unlink(missing_ok=True)
        (self.path / PICKLED[CHECKPOINT]).unlink(missing_ok=True)
