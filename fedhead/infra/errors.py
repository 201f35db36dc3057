"""User-facing errors: one line naming the parameter, the value and the fix (scikit-learn's template), and the
declared constraints (:class:`Interval`, :class:`OneOf`) that produce them. How an error becomes an exit code is
:mod:`fedhead.infra.exits`."""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import re
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

# a write that failed for want of space: no space, file too large (RLIMIT_FSIZE), quota
SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC))


class FedheadError(Exception):
    """An error caused by the user's input or environment, reported as one line."""

    exit_code = 2
    prefix = "error: "  # printed before the message (fedhead.infra.signals.Interrupted prints none)


# ---------------------------------------------------------------- how a message names a parameter
# A message is written once, naming parameters as the command line does ('--local-epochs', '--no-center'). The
# Python API (fedhead.run, TrainConfig) names them by their fields ('local_epochs', 'center=False'): its entry points
# are decorated with python_names, which re-spells the message of a FedheadError leaving them, unless a command of
# the CLI is running (every command runs inside cli_names, where the flags are the names).

_SURFACE: ContextVar[str] = ContextVar("fedhead_surface", default="python")
_FLAG = re.compile(r"(?<![\w-])--(no-)?([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


@contextlib.contextmanager
def cli_names() -> Iterator[None]:
    """Messages raised inside name parameters by their flags (a command of the CLI is running)."""
    token = _SURFACE.set("cli")
    try:
        yield
    finally:
        _SURFACE.reset(token)


def on_cli() -> bool:
    """Whether a command of the CLI is running (messages name parameters by their flags), not the Python API."""
    return _SURFACE.get() == "cli"


def enter_cli_names() -> Callable[[], None]:
    """:func:`cli_names` without a ``with`` block (a click group's callback); returns the function that leaves it."""
    token = _SURFACE.set("cli")
    return lambda: _SURFACE.reset(token)


def python_spelling(message: str, names: Iterable[str]) -> str:
    """``message`` with the flags of the fields ``names`` as Python names them: ``--local-epochs`` becomes
    ``local_epochs``, ``--no-center`` becomes ``center=False`` (the spelling rule, flag = ``--`` + the name with
    ``-`` for ``_``, read backwards). Other flags (``--print-config``) are left as they are."""
    known = set(names)

    def spell(m: re.Match) -> str:
        negated, name = m.group(1), m.group(2).replace("-", "_")
        if negated and "no_" + name in known:
            return "no_" + name
        if name not in known:
            return m.group(0)
        return f"{name}=False" if negated else name

    return _FLAG.sub(spell, message)


def python_names(names: Callable[[], Iterable[str]]) -> Callable[[Callable], Callable]:
    """Decorate an entry point of the Python API: a :class:`FedheadError` leaving it names the fields ``names()``
    by their Python names (:func:`python_spelling`), unless it runs inside a command of the CLI."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except FedheadError as exc:
                if _SURFACE.get() != "cli" and exc.args and isinstance(exc.args[0], str):
                    exc.args = (python_spelling(exc.args[0], names()), *exc.args[1:])
                raise

        return wrapper

    return deco


def param_error(param: str, value: Any, constraint: str, fix: str | None = None) -> FedheadError:
    """The one message template: "The '--alpha' parameter must be > 0. Got 0 instead. <fix>" (in Python: "The
    'alpha' parameter ...", see :func:`python_names`)."""
    msg = f"The '{param}' parameter {constraint}. Got {value!r} instead."
    if fix:
        msg += f" {fix}"
    return FedheadError(msg)


# ---------------------------------------------------------------- declared constraints


@dataclass(frozen=True)
class Interval:
    """A numeric interval constraint, e.g. ``Interval(0, None, closed="neither")`` for > 0. Only finite numbers
    pass (a bound of None means unbounded, not that inf is accepted)."""

    low: float | None = None
    high: float | None = None
    closed: str = "both"  # "both", "left", "right", "neither"
    integer: bool = False

    def ok(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if isinstance(v, float) and not math.isfinite(v):  # nan, +-inf: never a usable setting (None = unbounded)
            return False
        if self.integer and isinstance(v, float) and not v.is_integer():
            return False
        if self.low is not None:
            if v < self.low or (v == self.low and self.closed in ("right", "neither")):
                return False
        if self.high is not None:
            if v > self.high or (v == self.high and self.closed in ("left", "neither")):
                return False
        return True

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        lo_in = self.closed in ("both", "left")
        hi_in = self.closed in ("both", "right")
        if self.low is not None and self.high is None:
            return f"must be {kind} {'>=' if lo_in else '>'} {self.low:g}"
        if self.high is not None and self.low is None:
            return f"must be {kind} {'<=' if hi_in else '<'} {self.high:g}"
        lb = "[" if lo_in else "("
        rb = "]" if hi_in else ")"
        return f"must be {kind} in {lb}{self.low:g}, {self.high:g}{rb}"


@dataclass(frozen=True)
class OneOf:
    choices: tuple

    def ok(self, v: Any) -> bool:
        return v in self.choices

    def describe(self) -> str:
        return "must be one of " + ", ".join(repr(c) for c in self.choices)


def validate(param: str, value: Any, constraint: Interval | OneOf, fix: str | None = None) -> Any:
    """Check one value against a declared constraint; raise the one-line error if it fails."""
    if not constraint.ok(value):
        raise param_error(param, value, constraint.describe(), fix)
    return value


def unknown_name(param: str, value: str, valid: Iterable[str], what: str = "name") -> FedheadError:
    """Error for an unknown registry name, listing the valid ones and suggesting close matches."""
    import difflib

    valid = sorted(valid)
    close = difflib.get_close_matches(value, valid, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    if len(valid) <= 30:
        listing = f" Valid: {', '.join(valid)}."
    else:
        listing = f" ({len(valid)} known names.)"
    return FedheadError(f"The '{param}' parameter must be a known {what}. Got {value!r} instead.{hint}{listing}")


def shown(v: Any) -> str:
    """A value from a file as a message shows it: its repr, cut to 60 characters."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def is_count(v: Any, hi: int, lo: int = 1) -> bool:
    """Whether ``v`` is an int (not a bool) in ``[lo, hi]``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
