"""The asynchronous server rules on the virtual clock (issue 40): FedBuff (Nguyen et al. 2022) and FedAsync (Xie
et al. 2019), one server update per round of the one round loop (:mod:`fedhead.federation.loop`), so
``--rounds`` counts server updates.

A step at round ``r`` keeps ``--concurrency`` clients in flight (:class:`fedhead.core.clock.EventQueue`), each
dispatched with the head of the round it left at (its *version*); the clock advances from arrival to arrival until
``--buffer-size`` updates are buffered (FedAsync: 1). Events at equal times are processed as arrivals, then the
flush, then the new dispatches, so that equally fast clients with buffer = concurrency = clients per round are
synchronous FedAvg with the same client draws: a whole cohort dispatched while nobody is in flight is the sync
round's draw (:func:`fedhead.core.sampling.round_clients`), any other dispatch a draw among the idle clients keyed
by (seed, round, dispatches so far). A lost client (``--dropout``) frees its slot when it would have returned.

The buffered clients are trained at the flush, grouped by version, by the transport's own ``train_round`` from
that version's head keyed by (seed, version, client): training at arrival is training at dispatch, and the heads
of versions with clients in flight are kept (and checkpointed). FedBuff's new head is
``theta + sum_g s(tau_g) n_g (A_g - theta_{v_g}) / sum_g n_g`` over the version groups ``g`` (their FedAvg
aggregate ``A_g``, sample count ``n_g``, staleness ``tau_g = r - v_g``, weight ``s``: ``--staleness``); at staleness
0 it is FedAvg. FedAsync's is ``theta + alpha s(tau) (W_k - theta)`` (``alpha``: ``--async-mixing``). The server
optimiser (``--server-opt``) then steps from it as from any round's aggregate.

A transport with ``live_async`` (Flower: :mod:`fedhead.flower.pushpull`) runs the same rule on the real clock: its
messages are pushed and pulled instead of the simulated arrivals, and each version group's replies are summed by
the transport (``train_group``) instead of trained here.
"""

from __future__ import annotations

import time

import numpy as np

from fedhead.core.clock import EventQueue, TimingModel, staleness_weight
from fedhead.core.sampling import per_round, round_clients
from fedhead.federation.config import TrainConfig
from fedhead.federation.transport import RoundResult, Transport
from fedhead.infra.errors import FedheadError
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

MAX_EVENTS = 1_000_000  # arrivals one server update may wait for (a guard: --dropout < 1 always ends sooner)


class AsyncServer:
    """One seed's asynchronous server: its clock and the heads its clients in flight started from."""

    def __init__(self, cfg: TrainConfig, timing: TimingModel, seed: int, sizes: np.ndarray):
        self.cfg, self.timing, self.seed = cfg, timing, seed
        self.sizes = np.asarray(sizes, dtype=np.float64)
        m = per_round(cfg)
        self.buffer = 1 if cfg.async_rule == "fedasync" else cfg.buffer_size or m
        self.concurrency = cfg.concurrency or m
        self.queue = EventQueue()
        self.heads: dict[int, torch.Tensor] = {}
        self.durations = np.zeros(len(self.sizes))

    @property
    def now(self) -> float:
        return self.queue.now

    def _fill(self, rnd: int) -> None:
        """Dispatch idle clients at round ``rnd`` until ``--concurrency`` are in flight."""
        q, need = self.queue, self.concurrency - len(self.queue.flights)
        if need <= 0:
            return
        if not q.flights and not q.buffer and need == per_round(self.cfg):
            clients = round_clients(self.cfg, self.seed, rnd)  # a whole cohort: the synchronous round's draw
        else:
            clients = q.pick(q.eligible(len(self.sizes), rnd), need, self.seed, rnd)
        q.dispatch(clients, rnd, self.durations, self.timing, self.seed)

    def _collect(self, rnd: int) -> None:
        """Advance the clock until the buffer holds its updates (arrivals, then the flush, then dispatches)."""
        q = self.queue
        for _ in range(MAX_EVENTS):
            if len(q.buffer) >= self.buffer:
                return
            if not q.flights:
                self._fill(rnd)
            if not q.flights:  # nobody left to wait for: flush what there is
                return
            q.buffer += [(f.client, f.version, f.arrival) for f in q.advance() if not f.dropped]
            if len(q.buffer) < self.buffer:
                self._fill(rnd)
        raise FedheadError(
            f"Round {rnd} waited for {MAX_EVENTS:,} client arrivals without {self.buffer} updates (--dropout "
            f"{self.cfg.dropout:g}). Lower --dropout or --buffer-size."
        )

    def step(self, theta: torch.Tensor, rnd: int, transport: Transport, server, durations: np.ndarray) -> RoundResult:
        """Round ``rnd``'s server update from ``theta`` (the head of round ``rnd - 1``): the aggregate the server
        optimiser steps to (None when no update arrived), its clients' training, the mean staleness."""
        self.durations = durations
        self.heads[rnd] = theta.detach().clone()
        groups: dict[int, list] = {}
        if transport.live_async:
            taken = self._live(rnd, transport, server)
        else:
            self._fill(rnd)
            self._collect(rnd)
            taken = [(c, v) for c, v, _ in self.queue.take(self.buffer)]
        for c, v in taken:
            groups.setdefault(v, []).append(c)

        def train(v: int, sel: np.ndarray) -> RoundResult:
            if transport.live_async:
                return transport.train_group(self.heads[v], v, sel, server)
            return transport.train_round(self.heads[v], sel, self.seed, v, server)

        out = self._combine(theta, rnd, groups, train)
        keep = {f.version for f in self.queue.flights} | {v for _, v, _ in self.queue.buffer}
        keep |= transport.flight_versions() | {v for _, v, _, _ in transport.arrived} if transport.live_async else set()
        self.heads = {v: h for v, h in self.heads.items() if v in keep}
        return out

    def _live(self, rnd: int, transport: Transport, server) -> list[tuple[int, int]]:
        """Flower: push train messages to idle nodes until ``--concurrency`` are out, pull replies until the buffer
        holds its updates (a reply refills its slot at once); the clock is the real one."""
        t0 = time.monotonic()
        for _ in range(MAX_EVENTS):
            if len(transport.arrived) >= self.buffer:
                break
            busy = transport.in_flight()
            need = self.concurrency - len(busy)
            if need > 0:
                if not busy and not transport.arrived and need == per_round(self.cfg) and not transport.unavailable():
                    clients = round_clients(self.cfg, self.seed, rnd)
                else:
                    taken = busy | transport.arrived_at(rnd) | transport.unavailable()
                    idle = np.array([k for k in range(len(self.sizes)) if k not in taken], dtype=np.int64)
                    if len(idle) == 0 and not busy:  # every node lost or waiting: the update takes what came
                        break
                    clients = self.queue.pick(idle, need, self.seed, rnd)
                    self.queue.dispatches += len(clients)
                transport.push_train(self.heads[rnd], clients, rnd, server)
            if not transport.in_flight():
                break
            transport.pull_train()
        self.queue.now += time.monotonic() - t0
        return transport.take_arrived(self.buffer)

    def _combine(self, theta: torch.Tensor, rnd: int, groups: dict, train) -> RoundResult:
        cfg = self.cfg
        kind = cfg.staleness or ("poly" if cfg.async_rule == "fedasync" else "sqrt")
        delta, n_all, clients, loss, ms, server_s, taus = None, 0.0, 0, 0.0, 0.0, 0.0, []
        single, failed, reasons = None, [], []
        for v in sorted(groups):
            sel = np.array(sorted(groups[v]), dtype=np.int64)
            res = train(v, sel)
            failed += [t for t in str((res.extra or {}).get("failed_clients") or "").split() if t]
            reasons += [str(res.extra["failure_reason"])] if (res.extra or {}).get("failure_reason") else []
            clients, loss, server_s = clients + res.clients, loss + res.loss_sum, server_s + res.server_s
            ms += res.client_ms * res.clients
            taus += [rnd - v] * len(sel)
            if res.aggregate is None:
                continue
            s = staleness_weight(kind, rnd - v, cfg.staleness_exponent)
            n = float(self.sizes[sel].sum()) or float(len(sel))
            if cfg.async_rule == "fedasync":
                d = cfg.async_mixing * s * (res.aggregate - theta)
            else:
                d = s * n * (res.aggregate - self.heads[v])
                n_all += n
            single = res.aggregate if (len(groups) == 1 and v == rnd and s == 1.0) else None
            delta = d if delta is None else delta + d
        if delta is None:
            agg = None
        elif single is not None and cfg.async_rule == "fedbuff":  # staleness 0, one group: FedAvg itself
            agg = single
        else:
            agg = theta + (delta if cfg.async_rule == "fedasync" else delta / max(n_all, 1e-300))
        stale = float(np.mean(taus)) if taus else float("nan")
        extra = {"staleness_mean": stale}
        if failed:  # a Flower group's failed nodes (error replies among them), as a synchronous round reports them
            extra.update(failures=len(failed), failed_clients=" ".join(failed), failure_reason=reasons[0] if reasons
                         else "")  # fmt: skip
        return RoundResult(agg, clients, loss, ms / max(1, clients), server_s, extra)

    def state_dict(self) -> dict:
        return {"queue": self.queue.state_dict(), "heads": [[v, h.detach().cpu()] for v, h in self.heads.items()]}

    def load_state_dict(self, d: dict, device) -> None:
        self.queue = EventQueue.from_state(d["queue"])
        self.heads = {int(v): h.to(device) for v, h in d["heads"]}
