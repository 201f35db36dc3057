"""Small numerical helpers shared by the closed-form solves and differential privacy."""

from __future__ import annotations

import numpy as np

from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")


def clip_rows(x, bound: float):
    """A float64 copy of ``x [n, D]`` (numpy or torch) with every row scaled to L2 norm at most ``bound``."""
    if isinstance(x, torch.Tensor):
        x64 = x.to(torch.float64)
        norm = x64.norm(dim=1)
        return x64 * (bound / norm.clamp_min(1e-300)).clamp(max=1.0)[:, None]
    x64 = np.asarray(x, dtype=np.float64)
    norm = np.sqrt(np.square(x64).sum(1))
    return x64 * np.minimum(1.0, bound / np.maximum(norm, 1e-300))[:, None]


def psd_part(a: torch.Tensor) -> torch.Tensor:
    """The nearest positive semidefinite matrix to the symmetric ``a`` (negative eigenvalues set to 0)."""
    ev, vec = torch.linalg.eigh((a + a.T) / 2)
    out = (vec * ev.clamp_min(0.0)) @ vec.T
    return (out + out.T) / 2
