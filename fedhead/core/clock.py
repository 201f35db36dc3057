"""Simulated client timing: the virtual clock of a federated run (issue 40), torch-free.

Every client of a seed gets a compute speed (samples per second) and a network bandwidth (bytes per second), drawn
once from the run's seed: log-normal around the stated medians, ``speed_k = --client-speed * exp(sigma z1_k)`` and
``bw_k = --client-bandwidth * exp(sigma z2_k)`` with ``z ~ N(0, 1)`` and ``sigma = --timing-sigma``; a fraction
``--stragglers`` of the clients (drawn with the same generator) is ``--straggler-slowdown`` times slower in both.
One dispatch of a client (the head down, its local work, its message up) takes

    down_bytes / bw_k + work_k / speed_k + up_bytes / bw_k

seconds, ``work_k`` being the samples it processes (local epochs x its samples, or local steps x batch size). A
dispatch is lost with probability ``--dropout`` (the client never returns; the server notices at the time it
would have returned), drawn from (seed, dispatch key, client). Everything is keyed by the seed: the clock is
deterministic for a seed and needs no state beyond the simulated time and, for the asynchronous rules, the clients
in flight (:class:`EventQueue`).

Synchronous rounds (:func:`sync_round`): the server waits for its selected clients; with ``--deadline`` it stops
waiting then (later clients are dropped from the round), with ``--over-selection F`` it selects ``ceil((1 + F) m)``
clients and keeps the first ``m`` to finish (Bonawitz et al. 2019). The asynchronous rules (FedBuff: Nguyen et al.
2022; FedAsync: Xie et al. 2019) weight an update ``tau`` server updates old by :func:`staleness_weight`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["TimingModel", "EventQueue", "Flight", "sync_round", "staleness_weight", "STALENESS"]

_SPEED_KEY, _DROP_KEY, _PICK_KEY = 0xC10C, 0xD809, 0xA5C
STALENESS = ("constant", "sqrt", "poly")  # 1 | 1/sqrt(1+tau) (FedBuff) | (1+tau)^-a (FedAsync)


def staleness_weight(kind: str, tau: int, exponent: float = 0.5) -> float:
    """The weight of an update ``tau`` server updates stale: ``constant`` 1, ``sqrt`` 1/sqrt(1 + tau) (FedBuff),
    ``poly`` (1 + tau)^-exponent (FedAsync's polynomial staleness function); 1 at tau = 0 for all."""
    if kind == "constant" or tau <= 0:
        return 1.0
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + tau)
    return float((1.0 + tau) ** -exponent)


@dataclass(frozen=True)
class TimingModel:
    """The clients' speeds (see the module docstring); ``work`` [K]: the samples each client processes a dispatch."""

    speed: float = 1000.0  # median samples/s
    bandwidth: float = 1e6  # median bytes/s
    sigma: float = 0.5
    stragglers: float = 0.0
    slowdown: float = 10.0
    dropout: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> "TimingModel":
        return cls(cfg.client_speed, cfg.client_bandwidth, cfg.timing_sigma, cfg.stragglers,
                   cfg.straggler_slowdown, cfg.dropout)  # fmt: skip

    def client_rates(self, num_clients: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Every client's (samples/s, bytes/s) for ``seed``: the same whatever the run does with them."""
        rng = np.random.default_rng([seed, _SPEED_KEY])
        z = rng.standard_normal((2, num_clients))
        slow = rng.random(num_clients) < self.stragglers
        factor = np.where(slow, 1.0 / self.slowdown, 1.0)
        return self.speed * np.exp(self.sigma * z[0]) * factor, self.bandwidth * np.exp(self.sigma * z[1]) * factor

    def durations(self, seed: int, work: np.ndarray, down_bytes: float, up_bytes: float) -> np.ndarray:
        """Seconds of one dispatch of every client (``work`` [K] samples each)."""
        speed, bw = self.client_rates(len(work), seed)
        return down_bytes / bw + np.asarray(work, dtype=np.float64) / speed + up_bytes / bw

    def dropped(self, seed: int, key: int, client: int) -> bool:
        """Whether client ``client``'s dispatch ``key`` (a sync round's number, an async dispatch's counter) is lost."""
        if self.dropout <= 0:
            return False
        return bool(np.random.default_rng([seed, key, client, _DROP_KEY]).random() < self.dropout)


def sync_round(
    selected: np.ndarray, durations: np.ndarray, dropped: np.ndarray, keep: int, deadline: float | None
) -> tuple[np.ndarray, float]:
    """A synchronous round's clients that count and its simulated seconds: of ``selected`` (their ``durations`` and
    ``dropped`` flags), those back by ``deadline`` (None: no deadline), the first ``keep`` to finish (ties by client
    id), sorted. The round ends when the ``keep``-th is back; short of ``keep``, at the deadline, or without one when
    the last selected client is back or known lost."""
    selected = np.asarray(selected, dtype=np.int64)
    t = np.asarray(durations, dtype=np.float64)
    ok = ~np.asarray(dropped, dtype=bool)
    if deadline is not None:
        ok &= t <= deadline
    order = [i for i in np.lexsort((selected, t)) if ok[i]][:keep]
    kept = np.sort(selected[order]) if order else np.zeros(0, dtype=np.int64)
    if len(order) == keep:
        return kept, float(t[order[-1]])
    return kept, float(deadline) if deadline is not None else float(t.max(initial=0.0))


@dataclass
class Flight:
    """A client in flight: back (or lost) at ``arrival``, trained from the head of round ``version``."""

    arrival: float
    client: int
    version: int
    dropped: bool


@dataclass
class EventQueue:
    """The asynchronous server's clock: simulated ``now``, the clients in ``flights``, the ``buffer`` of arrived
    updates as (client, version, arrival), and the count of dispatches so far (the key of their dropout draws)."""

    now: float = 0.0
    flights: list = field(default_factory=list)
    buffer: list = field(default_factory=list)
    dispatches: int = 0

    def busy(self) -> set:
        return {f.client for f in self.flights}

    def eligible(self, num_clients: int, version: int) -> np.ndarray:
        """Clients that may be dispatched at ``version``: idle, and without a buffered update from that version (a
        client trains from a head once: its training is keyed by (seed, version, client))."""
        taken = self.busy() | {c for c, v, _ in self.buffer if v == version}
        return np.array([k for k in range(num_clients) if k not in taken], dtype=np.int64)

    def pick(self, candidates: np.ndarray, count: int, seed: int, version: int) -> np.ndarray:
        """``count`` of ``candidates`` (all when fewer), drawn by (seed, version, dispatches so far), sorted."""
        if count >= len(candidates):
            return np.sort(candidates)
        rng = np.random.default_rng([seed, version, self.dispatches, _PICK_KEY])
        return np.sort(rng.choice(candidates, size=count, replace=False))

    def dispatch(self, clients, version: int, durations: np.ndarray, timing: TimingModel, seed: int) -> None:
        for k in np.asarray(clients, dtype=np.int64).tolist():
            lost = timing.dropped(seed, self.dispatches, k)
            self.flights.append(Flight(self.now + float(durations[k]), k, version, lost))
            self.dispatches += 1

    def advance(self) -> list[Flight]:
        """Move ``now`` to the next arrival and return every flight ending then (by client id); lost ones too."""
        t = min(f.arrival for f in self.flights)
        done = sorted((f for f in self.flights if f.arrival == t), key=lambda f: f.client)
        self.flights = [f for f in self.flights if f.arrival != t]
        self.now = t
        return done

    def take(self, k: int) -> list:
        """The first ``k`` buffered updates (by arrival, then client), removed from the buffer."""
        self.buffer.sort(key=lambda b: (b[2], b[0]))
        out, self.buffer = self.buffer[:k], self.buffer[k:]
        return out

    def state_dict(self) -> dict:
        return {"now": self.now, "dispatches": self.dispatches,
                "flights": [[f.arrival, f.client, f.version, f.dropped] for f in self.flights],
                "buffer": [list(b) for b in self.buffer]}  # fmt: skip

    @classmethod
    def from_state(cls, d: dict) -> "EventQueue":
        flights = [Flight(float(a), int(c), int(v), bool(x)) for a, c, v, x in d["flights"]]
        buffer = [(int(c), int(v), float(a)) for c, v, a in d["buffer"]]
        return cls(float(d["now"]), flights, buffer, int(d["dispatches"]))
