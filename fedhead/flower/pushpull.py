"""The asynchronous rules (FedBuff, FedAsync: :mod:`fedhead.federation.asyncserver`) on Flower's message API: train
messages pushed without waiting (``grid.push_messages``), replies pulled as they come (``grid.pull_messages``),
so that a real deployment runs the rule the simulator runs, on the real clock.

A message carries the head of the round it left at and that round as its ``server-round``: the node trains from it
keyed by (seed, round, partition), as a synchronous round and the simulator do. Replies wait in arrival order until
the server update takes them; a message unanswered after ``--round-timeout`` seconds is given up (its partition is
idle again). The messages in flight belong to this Flower run: a resumed server (a new run) starts with none.
"""

from __future__ import annotations

import time

import numpy as np

from fedhead.flower.common import require_flower, short_reason

require_flower()

from flwr.app import Array, ArrayRecord, ConfigRecord  # noqa: E402

from fedhead.federation.transport import RoundResult  # noqa: E402

POLL_S = 0.05  # seconds between pulls while no reply came


class PushPull:
    """The transport's half of the asynchronous rules on Flower (mixed into
    :class:`fedhead.flower.strategy.FedheadStrategy`, whose train messages and reply checks it reuses)."""

    live_async = True  # the asynchronous rule runs on the real clock, through push_train / pull_train

    def async_reset(self) -> None:
        self.flights: dict = {}  # message id -> (partition, round, message, push time)
        self.arrived: list = []  # (partition, round, message, reply), in arrival order
        self.lost: set = set()  # partitions whose node answered with an error: left out for the rest of this run
        self.errors: dict = {}  # partition -> reason: error replies the next server update reports as failures

    def in_flight(self) -> set:
        return {f[0] for f in getattr(self, "flights", {}).values()}

    def flight_versions(self) -> set:
        return {f[1] for f in getattr(self, "flights", {}).values()}

    def unavailable(self) -> set:
        return set(getattr(self, "lost", set()))

    def arrived_at(self, version: int) -> set:
        return {a[0] for a in getattr(self, "arrived", []) if a[1] == version}

    def push_train(self, theta, pids: list, rnd: int, server) -> None:
        """Train messages with ``theta`` (the head of round ``rnd``) to the nodes of ``pids``, pushed, not awaited."""
        self.theta, self.server = theta, server
        arrays = ArrayRecord({"head": Array(theta.cpu().numpy())})
        msgs = self.train_messages(rnd, arrays, ConfigRecord(), [int(p) for p in pids])
        pid_of = {n: p for p, n in self.node_of.items()}
        now = time.monotonic()
        for m, mid in zip(msgs, self.grid.push_messages(msgs)):
            self.flights[mid] = (pid_of[m.metadata.dst_node_id], rnd, m, now)

    def pull_train(self) -> int:
        """The replies that came since the last pull (kept in arrival order); messages past ``--round-timeout``
        given up. Returns how many came."""
        got = list(self.grid.pull_messages(list(self.flights))) if self.flights else []
        for r in got:
            f = self.flights.pop(r.metadata.reply_to_message_id, None)
            if f is not None and r.has_error():  # that node's failure (gone, restarted under a new id): no update
                self.lost.add(f[0])
                self.errors[f[0]] = short_reason(r.error.reason)
            elif f is not None:
                self.arrived.append((f[0], f[1], f[2], r))
        late = time.monotonic() - self.settings.round_timeout
        for mid in [mid for mid, f in self.flights.items() if f[3] < late]:
            del self.flights[mid]
        if not got:
            time.sleep(POLL_S)
        return len(got)

    def take_arrived(self, k: int) -> list[tuple[int, int]]:
        """The first ``k`` arrived replies as (partition, round); their replies wait for :meth:`train_group`."""
        taken, self.arrived = self.arrived[:k], self.arrived[k:]
        self._taken = {(p, v): (m, r) for p, v, m, r in taken}
        return [(p, v) for p, v, _, _ in taken]

    def train_group(self, head, version: int, pids, server) -> RoundResult:
        """The taken replies of ``pids`` trained from round ``version``'s ``head``, summed by the rule as a
        synchronous round's (:meth:`aggregate_train`)."""
        items = [self._taken.pop((int(p), version)) for p in pids]
        self.theta, self.server = head, server
        self.last = self.new_round()
        self._selected = [int(p) for p in pids]
        self._sent = [m for m, _ in items]
        self.aggregate_train(version, [r for _, r in items])
        lr = self.last
        lr.failed.update(self.errors)  # the error replies since the last update: failures of this one
        self.errors = {}
        client_ms = float(np.mean(lr.client_ms)) if lr.client_ms else 0.0
        return RoundResult(lr.aggregate, lr.trained, lr.loss_sum, client_ms, lr.server_s, lr.failure_fields())
