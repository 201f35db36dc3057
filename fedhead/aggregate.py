"""Aggregators are pure functions: stacked client heads and counts in, the global head out.

Both are sums over clients, so the engine can feed clients block by block into an :class:`Accumulator`
and get exactly what the pure function gives on the whole stack (tested).

- ``fedavg``: size-weighted average of the whole head, ``sum_k n_k W_k / sum_k n_k``.
- ``grouped`` (FedOVA style): row ``c`` is the unweighted mean over the clients that trained it (hold
  class ``c`` locally); a row nobody trained keeps its previous value.
"""

from __future__ import annotations

from typing import Callable

import torch

from .errors import unknown_name


def fedavg(stacked: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``stacked [K, C, D]``, ``sizes [K]`` -> ``[C, D]``."""
    w = sizes.to(torch.float64) / sizes.to(torch.float64).sum()
    return torch.einsum("k,kcd->cd", w.to(stacked.dtype), stacked)


def grouped(stacked: torch.Tensor, holds: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``stacked [K, C, D]``, ``holds [K, C]`` bool, ``previous [C, D]`` -> ``[C, D]``."""
    h = holds.to(stacked.dtype)
    num = torch.einsum("kc,kcd->cd", h, stacked)
    den = h.sum(0)
    out = previous.clone()
    trained = den > 0
    out[trained] = num[trained] / den[trained, None]
    return out


class Accumulator:
    """Streaming form of an aggregator: ``add`` client blocks, then ``finish(previous)``."""

    def __init__(self, kind: str, shape: tuple, device, dtype=torch.float32):
        if kind not in AGGREGATORS:
            raise unknown_name("--aggregate", kind, AGGREGATORS, "aggregator")
        self.kind = kind
        self.num = torch.zeros(shape, device=device, dtype=torch.float64 if device.type == "cpu" else dtype)
        self.den = torch.zeros(shape[0] if kind == "grouped" else (), device=device, dtype=self.num.dtype)

    def add(self, stacked: torch.Tensor, sizes: torch.Tensor, holds: torch.Tensor) -> None:
        if self.kind == "fedavg":
            s = sizes.to(self.num.dtype)
            self.num += torch.einsum("k,kcd->cd", s.to(stacked.dtype), stacked).to(self.num.dtype)
            self.den += s.sum()
        else:
            h = holds.to(stacked.dtype)
            self.num += torch.einsum("kc,kcd->cd", h, stacked).to(self.num.dtype)
            self.den += h.sum(0).to(self.num.dtype)

    def finish(self, previous: torch.Tensor) -> torch.Tensor:
        if self.kind == "fedavg":
            return (self.num / self.den).to(previous.dtype)
        out = previous.clone()
        trained = self.den > 0
        out[trained] = (self.num[trained] / self.den[trained, None]).to(previous.dtype)
        return out


AGGREGATORS: dict[str, Callable] = {"fedavg": fedavg, "grouped": grouped}
