"""PNG plots of runs and bench reports (matplotlib, Agg backend: no display needed; imported only when drawing).

Four shapes cover every figure: panels of curves over rounds or rates (optionally with a reference curve,
horizontal reference lines and vertical marks), grouped bar charts with error bars, the label counts of a
partition (:class:`LabelCounts`: stacked bars per client, as flwr-datasets' ``plot_label_distributions`` draws
them, or a heatmap when there are too many clients or labels for bars), and histograms of per-client values
(:class:`Histogram`: the personalisation gains of personal.png). The data of a figure (its panels, its
counts) is built without matplotlib, so that it can be checked without drawing (:data:`DRAW_ENV`).
"""

from __future__ import annotations

import math
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
    hlines: list[tuple[float, str]] = field(default_factory=list)  # more (y, label) references (dashed)
    vlines: list[tuple[float, str]] = field(default_factory=list)  # (x, label) marks, e.g. a stage boundary
    ylabel: str = ""  # this panel's y label (panels of different quantities)


def write_curves(
    path: Path,
    panels: Sequence[Panel],
    xlabel: str,
    ylabel: str,
    title: str = "",
    ylim: tuple[float, float] | None = None,
    xscale: str = "linear",
    sharey: bool = True,
    integer_x: bool = False,
) -> Path:
    """One row of panels; each line with a shaded ±std band when ``err`` is given."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.8), squeeze=False, sharey=sharey)
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
        for (y, label), color in zip(p.hlines, ("black", "tab:red", "tab:purple")):
            ax.axhline(y, color=color, linestyle="--", linewidth=1, label=label)
        for x, label in p.vlines:
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
            ax.annotate(label, (x, 1), xycoords=("data", "axes fraction"), fontsize=7, color="grey",
                        xytext=(2, -10), textcoords="offset points")  # fmt: skip
        if p.ylabel:
            ax.set_ylabel(p.ylabel)
        ax.set_title(p.title, fontsize=10)
        ax.set_xscale(xscale)
        if integer_x:  # rounds
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ylim:
            ax.set_ylim(*ylim)
        if ax.get_legend_handles_labels()[0]:  # a panel with nothing labelled (a one-row run) gets no legend
            ax.legend(fontsize=7)
    if ylabel:
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


# ---------------------------------------------------------------- a partition's label counts

BAR_CLIENTS = 50  # up to this many clients (and BAR_LABELS labels) as stacked bars; beyond, a heatmap
BAR_LABELS = 20
# tab20 in an order where no label sits next to its own hue's other shade: dark i, light i+3, dark i+1, ...
# (the smallest RGB distance between neighbours is 0.43, tab10's is 0.45; tab20's own order puts each dark
# shade next to its light one)
TAB20_ORDER = [j for i in range(10) for j in (2 * i, 2 * ((i + 3) % 10) + 1)]
SPREAD_MAP = "turbo"  # beyond 20 labels: sampled at a stride, so that neighbouring labels get distant hues


def _stride(n: int) -> int:
    """A step near 0.382 n (the golden section) that is coprime with ``n``: label j takes position j * step mod n of
    the map, so every label gets its own colour and neighbours sit about 0.38 of the map apart."""
    step = max(1, round(0.382 * n))
    while math.gcd(step, n) != 1:
        step += 1
    return step


def label_colors(n: int) -> list[tuple[float, float, float, float]]:
    """A colour (RGBA) per label for ``n`` labels, neighbouring labels clearly apart (stacked bars put label j next
    to label j + 1): tab10 up to 10 labels, tab20 (:data:`TAB20_ORDER`) up to 20, beyond that :data:`SPREAD_MAP`
    sampled at the stride :func:`_stride`. Needs matplotlib's colour maps only, not a figure."""
    from matplotlib import colormaps

    if n <= 10:
        return [tuple(colormaps["tab10"](j)) for j in range(n)]
    if n <= 20:
        return [tuple(colormaps["tab20"](j)) for j in TAB20_ORDER[:n]]
    cmap, step = colormaps[SPREAD_MAP], _stride(n)
    return [tuple(cmap((j * step % n) / (n - 1))) for j in range(n)]


@dataclass
class LabelCounts:
    """What partition.png shows: ``counts`` [K clients, C labels] (None with ``note`` saying why there are none,
    e.g. secure aggregation), the label names, a title."""

    counts: np.ndarray | None
    labels: Sequence[str] = ()
    title: str = "Per client label distribution"
    note: str = ""

    def check(self) -> None:
        """The counts are a [K, C] array of non-negative integers (or there is a note instead)."""
        if self.counts is None:
            if not self.note:
                raise ValueError("LabelCounts without counts needs a note saying why")
            return
        c = np.asarray(self.counts)
        if c.ndim != 2 or c.shape[0] == 0 or (c < 0).any() or not np.isfinite(c).all():
            raise ValueError(f"label counts must be a non-empty [clients, labels] array >= 0, got shape {c.shape}")

    @property
    def kind(self) -> str:
        """``bars`` (stacked, one per client), ``heatmap`` (labels x clients) or ``note`` (no counts)."""
        if self.counts is None:
            return "note"
        k, c = np.asarray(self.counts).shape
        return "bars" if k <= BAR_CLIENTS and c <= BAR_LABELS else "heatmap"


def write_label_counts(path: Path, spec: LabelCounts) -> Path:
    """partition.png: stacked bars of each client's label counts (client id on x, a colour per label from
    :func:`label_colors`, neighbouring labels in distant colours; as flwr-datasets'
    ``plot_label_distributions(plot_type="bar")``), a heatmap of labels x clients (counts as colour,
    as its ``plot_type="heatmap"``) beyond BAR_CLIENTS clients or BAR_LABELS labels, or the note alone."""
    spec.check()
    plt = _plt()
    kind = spec.kind
    if kind == "note":
        fig, ax = plt.subplots(figsize=(6.4, 2.0))
        ax.axis("off")
        ax.text(0.5, 0.5, spec.note, ha="center", va="center", wrap=True, fontsize=9)
        ax.set_title(spec.title, fontsize=10)
        return _save(fig, path)
    counts = np.asarray(spec.counts)
    k, c = counts.shape
    names = [str(x) for x in spec.labels] if len(spec.labels) == c else [str(j) for j in range(c)]
    if kind == "bars":
        fig, ax = plt.subplots(figsize=(6.4 + 0.04 * k, 4.2))
        colors = label_colors(c)
        bottom = np.zeros(k)
        for j in range(c):
            ax.bar(np.arange(k), counts[:, j], bottom=bottom, color=colors[j], label=names[j])
            bottom += counts[:, j]
        ax.set_xlabel("client")
        ax.set_ylabel("count")
        step = max(1, k // 25)
        ax.set_xticks(np.arange(0, k, step))
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles[::-1], labels[::-1], title="labels", fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    else:
        fig, ax = plt.subplots(figsize=(min(14.0, 6.4 + 0.01 * k), min(9.0, 2.5 + 0.06 * c)))
        im = ax.imshow(counts.T, aspect="auto", interpolation="nearest", cmap="Greens", origin="lower")
        fig.colorbar(im, ax=ax, label="count")
        ax.set_xlabel("client")
        ax.set_ylabel("label")
        if c <= BAR_LABELS:
            ax.set_yticks(np.arange(c))
            ax.set_yticklabels(names, fontsize=7)
    ax.set_title(spec.title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


# ---------------------------------------------------------------- a histogram of per-client values

HIST_BINS = 30  # at most this many bins (fewer for few values: about 2 per value)


@dataclass
class Histogram:
    """Histograms of per-client values on shared bins: ``series`` ``(label, values)``, one per seed (pooled in one
    panel, told apart by the legend), with a vertical reference line at 0 labelled ``zero`` (empty: none)."""

    series: list
    title: str = ""
    xlabel: str = ""
    ylabel: str = "count"
    zero: str = ""

    def check(self) -> None:
        """At least one series; every value finite."""
        if not self.series:
            raise ValueError("a histogram needs at least one series")
        for label, v in self.series:
            a = np.asarray(v, dtype=float)
            if a.ndim != 1 or not np.isfinite(a).all():
                raise ValueError(f"histogram series {label!r} must be finite values [n], got shape {a.shape}")

    def edges(self) -> np.ndarray:
        """The shared bin edges over every series' values and 0, about HIST_BINS bins at most, one of them centred
        on 0 (no gain is a bin of its own, not the edge between a loss and a gain)."""
        values = np.concatenate([np.asarray(v, dtype=float) for _, v in self.series] + [np.zeros(1)])
        lo, hi = float(values.min()), float(values.max())
        n = int(min(HIST_BINS, max(5, 2 * math.sqrt(values.size))))
        w = (hi - lo) / n if hi - lo > 1e-12 else 0.1
        first, last = math.floor(lo / w + 0.5), math.ceil(hi / w - 0.5)
        return (np.arange(first, last + 2) - 0.5) * w


def write_histogram(path: Path, spec: Histogram) -> Path:
    """One panel: a bar histogram for one series, step outlines (filled lightly) for several, each labelled with its
    mean and count; the dashed line at 0."""
    spec.check()
    plt = _plt()
    edges = spec.edges()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    several = len(spec.series) > 1
    for i, (label, v) in enumerate(spec.series):
        a = np.asarray(v, dtype=float)
        text = f"{label} (mean {a.mean():+.3f}, {a.size} clients)" if a.size else f"{label} (no client)"
        if several:
            ax.hist(a, bins=edges, histtype="stepfilled", alpha=0.15, color=f"C{i % 10}")
            ax.hist(a, bins=edges, histtype="step", linewidth=1.4, color=f"C{i % 10}", label=text)
        else:
            ax.hist(a, bins=edges, color="C0", edgecolor="white", linewidth=0.5, label=text)
    if spec.zero:
        ax.axvline(0.0, color="black", linestyle="--", linewidth=1, label=spec.zero)
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of clients
    ax.set_xlabel(spec.xlabel)
    ax.set_ylabel(spec.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if spec.title:
        ax.set_title(spec.title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)
