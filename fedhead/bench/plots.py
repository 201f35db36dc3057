"""PNG plots of bench reports (matplotlib, Agg backend: no display needed).

Two shapes cover every figure: panels of curves over rounds or rates (optionally with a reference
curve or a horizontal reference line), and grouped bar charts with error bars.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from fedhead.infra.files import atomic_path


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@dataclass
class Line:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    err: Sequence[float] | None = None
    style: str = "-"  # "-" results, "--" references (IID), ":" paper values
    color: str | None = None
    marker: str | None = None


@dataclass
class Panel:
    title: str
    lines: list[Line] = field(default_factory=list)
    hline: tuple[float, str] | None = None  # (y, label), e.g. (1.0, "IID")


def write_curves(
    path: Path,
    panels: Sequence[Panel],
    xlabel: str,
    ylabel: str,
    title: str = "",
    ylim: tuple[float, float] | None = None,
    xscale: str = "linear",
) -> Path:
    """One row of panels; each line with a shaded ±std band when ``err`` is given."""
    plt = _plt()
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.8), squeeze=False, sharey=True)
    for ax, p in zip(axes[0], panels):
        for ln in p.lines:
            x, y = np.asarray(ln.x, float), np.asarray(ln.y, float)
            if x.size == 0:
                continue
            kw = dict(
                label=ln.label, linestyle=ln.style, marker=ln.marker or ("o" if x.size <= 12 else None), markersize=3.5
            )
            if ln.color:
                kw["color"] = ln.color
            if ln.style != "-":  # references (IID, paper) on top of the results
                kw["zorder"] = 4
            h = ax.plot(x, y, **kw)[0]
            if ln.err is not None and len(ln.err) == len(y):
                e = np.asarray(ln.err, float)
                ax.fill_between(x, y - e, y + e, color=h.get_color(), alpha=0.15, linewidth=0)
        if p.hline is not None:
            ax.axhline(p.hline[0], color="black", linestyle="--", linewidth=1, label=p.hline[1])
        ax.set_title(p.title, fontsize=10)
        ax.set_xscale(xscale)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ylim:
            ax.set_ylim(*ylim)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def write_bars(
    path: Path,
    groups: Sequence[str],
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    ylabel: str,
    title: str = "",
    hline: tuple[float, str] | None = None,
) -> Path:
    """Grouped bars: one group per ``groups`` entry, one bar per series (mean, std per group)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(groups) * max(1, len(series)) ** 0.5 + 2), 3.8))
    k = max(1, len(series))
    width = 0.8 / k
    x = np.arange(len(groups))
    for i, (label, (means, stds)) in enumerate(series.items()):
        m = np.asarray(means, float)
        s = np.nan_to_num(np.asarray(stds, float))
        ax.bar(x - 0.4 + width * (i + 0.5), m, width, yerr=s, capsize=3, label=label)
    if hline is not None:
        ax.axhline(hline[0], color="black", linestyle="--", linewidth=1, label=hline[1])
    ax.set_xticks(x)
    ax.set_xticklabels(groups, rotation=15 if len(groups) > 4 else 0, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    plt = _plt()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path
