"""Feature geometry of a store (OvA-LP paper, Sec. 3.2 / Fig. 2): alignment, intra, inter, ratio.

The paper's formulas were lost from its text; its prose and numbers fix them as follows (all on
L2-normalised features z = f(x)/||f(x)||, class centroids mu_c = mean of the class's normalised features,
not re-normalised):

- alignment = E_{(x, x+) same class, x != x+} ||z - z+||^2   (Wang & Isola 2020: expected squared distance
  between positive pairs; averaged over all same-class ordered pairs, so larger classes weigh more)
- intra     = mean over samples of ||z - mu_y||               (compactness of each class)
- inter     = mean over class pairs c != c' of ||mu_c - mu_c'|| (separation of the centroids)
- ratio     = intra / inter                                   (smaller = better geometry)
- spread    = mean over samples of ||z - mu||, mu the mean of all z (not in the paper: how far the features
  fan out on the sphere; features crowded in a narrow cone have small distances of every kind, so
  alignment, intra and inter compare only between stores of similar spread, the ratio always)

(The paper's values agree: Ratio 0.974 = 0.818 / 0.840 and 1.885 ~ 0.917 / 0.487; alignment 1.366 ~
2 x intra^2.) Smaller alignment, intra and ratio and larger inter indicate stronger geometry. Each seed
draws up to ``per_class`` samples per class with ``numpy.random.default_rng(seed)``; mean ± std over seeds.
"""

from __future__ import annotations

import numpy as np

METRICS = ("alignment", "intra", "inter", "ratio")
COLUMNS = METRICS + ("spread",)  # what a report shows: the paper's four metrics and the spread


def normalize(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(n, 1e-12)


def geometry_metrics(x: np.ndarray, y: np.ndarray, normalized: bool = True) -> dict[str, float]:
    """The four metrics of ``x`` [N, D] with labels ``y`` [N] (classes with < 2 samples skip alignment)."""
    z = normalize(x) if normalized else np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    classes = np.unique(y)
    cents = np.stack([z[y == c].mean(0) for c in classes])
    # alignment, exactly: sum over ordered pairs i != j of ||zi - zj||^2 = 2 n sum ||zi||^2 - 2 ||sum zi||^2
    pair_sum, pairs = 0.0, 0
    intra = 0.0
    for c, mu in zip(classes, cents):
        zc = z[y == c]
        n = len(zc)
        intra += float(np.linalg.norm(zc - mu, axis=1).sum())
        if n >= 2:
            s = zc.sum(0)
            pair_sum += 2 * n * float((zc * zc).sum()) - 2 * float(s @ s)
            pairs += n * (n - 1)
    intra /= len(z)
    if len(classes) >= 2:
        sq = (cents * cents).sum(1)
        d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * cents @ cents.T, 0.0)
        iu = np.triu_indices(len(classes), 1)
        inter = float(np.sqrt(d2[iu]).mean())
    else:
        inter = float("nan")
    alignment = pair_sum / pairs if pairs else float("nan")
    spread = float(np.linalg.norm(z - z.mean(0), axis=1).mean())
    return {
        "alignment": alignment,
        "intra": intra,
        "inter": inter,
        "ratio": intra / inter if inter and inter == inter else float("nan"),
        "spread": spread,
    }


def subsample(y: np.ndarray, per_class: int | None, seed: int) -> np.ndarray:
    """Up to ``per_class`` indices per class (all when None), drawn with ``default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    idx = []
    for c in np.unique(y):
        ic = np.flatnonzero(y == c)
        if per_class is not None and len(ic) > per_class:
            ic = rng.choice(ic, size=per_class, replace=False)
        idx.append(np.sort(ic))
    return np.concatenate(idx)


def store_geometry(x: np.ndarray, y: np.ndarray, seeds, per_class: int | None) -> list[dict[str, float]]:
    """Metrics per seed (each seed its own class-balanced subsample)."""
    out = []
    for s in seeds:
        idx = subsample(y, per_class, int(s))
        out.append({"seed": int(s), "n": int(len(idx)), **geometry_metrics(x[idx], y[idx])})
    return out
