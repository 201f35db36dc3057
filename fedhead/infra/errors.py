"""User-facing errors: one line naming the parameter, the value and the fix (scikit-learn's template), and the
declared constraints (:class:`Interval`, :class:`OneOf`) that produce them. How an error becomes an exit code is
:mod:`fedhead.infra.exits`."""

from __future__ import annotations

import errno
import math
from dataclasses import dataclass
from typing import Any, Iterable

# a write that failed for want of space: no space, file too large (RLIMIT_FSIZE), quota
SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC))


class FedheadError(Exception):
    """An error caused by the user's input or environment, reported as one line."""

    exit_code = 2
    prefix = "error: "  # printed before the message (fedhead.infra.signals.Interrupted prints none)


def param_error(param: str, value: Any, constraint: str, fix: str | None = None) -> FedheadError:
    """The one message template: "The '--alpha' parameter must be > 0. Got 0 instead. <fix>"."""
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
