"""Declared parameters shared by the registries (heads, partitions): name, default, constraint, help."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedhead.infra.errors import Interval, OneOf, validate


@dataclass(frozen=True)
class Param:
    name: str  # python name, e.g. "stage1_rounds"
    default: Any
    constraint: Interval | OneOf | Any | None  # or any object with ok(value) and describe()
    help: str
    flag: str = ""  # CLI flag, e.g. "--stage1-rounds"
    grid: tuple = ()  # values tried on the validation part (--select-on-val) when the user does not give one

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


def doc_line(obj: Any) -> str:
    """The first paragraph of ``obj``'s docstring as one line, or "" when it has none (a user's head or partition
    may have none)."""
    paragraph = (getattr(obj, "__doc__", None) or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def resolve_params(params: list[Param], given: dict[str, Any], owner: str) -> dict[str, Any]:
    """Fill defaults for missing/None values and validate each against its declared constraint."""
    out = {}
    known = {p.name for p in params}
    for key in given:
        if key not in known and given[key] is not None:
            raise TypeError(f"{owner} takes no parameter {key!r} (known: {sorted(known)})")
    for p in params:
        v = given.get(p.name)
        if v is None:
            v = p.default
        if p.constraint is not None and v is not None:
            validate(p.cli_flag, v, p.constraint)
        out[p.name] = v
    return out
