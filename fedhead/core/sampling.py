"""Which clients train in a round: a fixed number drawn without replacement, keyed by (seed, round) only, so every
head, backend and transport (in-process, Flower) samples the same clients, and a round's draw costs the same
whatever happened in the rounds before it.

The number per round is ``--clients-per-round`` when given, else ``--participation`` x ``--clients`` rounded (at
least 1): the papers' "10 of 9,275 clients a round" is ``clients_per_round = 10``, the same clients as the fraction
that rounds to 10.
"""

from __future__ import annotations

import numpy as np

__all__ = ["per_round", "sample_clients", "round_clients"]


def per_round(cfg) -> int:
    """Clients a round of the run ``cfg`` trains (``clients``, ``participation``, ``clients_per_round``)."""
    if getattr(cfg, "clients_per_round", None) is not None:
        return min(int(cfg.clients_per_round), int(cfg.clients))
    return max(1, int(round(cfg.participation * cfg.clients)))


def sample_clients(num_clients: int, participation: float, seed: int, rnd: int, count: int | None = None) -> np.ndarray:
    """Clients of round ``rnd``, sorted: ``count`` of them (default ``round(participation * num_clients)``, at
    least 1), the same for every head and backend given (seed, round)."""
    m = max(1, int(round(participation * num_clients))) if count is None else int(count)
    if m >= num_clients:
        return np.arange(num_clients)
    rng = np.random.default_rng([seed, rnd, 0x5EED])
    return np.sort(rng.choice(num_clients, size=m, replace=False))


def round_clients(cfg, seed: int, rnd: int) -> np.ndarray:
    """The clients of round ``rnd`` of the run ``cfg`` (:func:`per_round` of them)."""
    return sample_clients(int(cfg.clients), cfg.participation, seed, rnd, count=per_round(cfg))
