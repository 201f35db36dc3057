"""FedheadStrategy: a Flower Strategy whose every decision is fedhead's own.

- participation: :func:`fedhead.federation.train.sample_clients` by (seed, round) over partition ids, not Flower's
  random node sampling; a partition id is mapped to the node that announced it in the ``query`` exchange;
- aggregation: :class:`fedhead.core.aggregate.Accumulator` (``fedavg`` size-weighted, or ``grouped`` by class holds)
  over the replies in partition-id order, exactly as the simulator adds its clients;
- two-stage heads: every train message carries the round (the head's stage is a function of it) and the stage;
- feature centring/scaling: one real exchange of per-node feature sums before round 1, combined in partition
  order in float64 (bit-identical to :func:`fedhead.federation.train.federated_feature_stats`), sent back each round;
- central evaluation of the global head on the server store's test split every round;
- the run directory of ``fedhead train`` (config.json, rounds.csv with extra ``failures`` columns,
  summary.json via :func:`fedhead.federation.train.summarize`, clients.csv, head-seed<S>.pt), a checkpoint after every
  round and ``resume`` after a server restart;
- faults: a node that raises or does not answer within ``round_timeout`` is recorded as a failure of that
  round and the round completes with the others; a node without a store or with a store from another
  encoder refuses the run before round 1 and the server stops with that node's one-line error;
- SCAFFOLD: the server's ``c`` (and ``N``) in the simulator's :class:`fedhead.core.engine.ScaffoldState`, sent with the
  head; each node keeps its own ``c_k`` in Flower's ``Context.state`` and returns its delta, which the server adds
  and applies with the simulator's rule (:class:`NodeVariates` keeps which version of ``c_k`` each node must
  train from; nodes with a state folder also keep ``c_k`` on disk, so a resumed server continues; a node that lost
  its ``c_k`` restarts SCAFFOLD from zero variates everywhere);
- CCVR: after the last round one ``query.ccvr`` exchange with every node (the simulator's
  :func:`fedhead.federation.train.ccvr_client_stats` there), pooled in partition order and calibrated by
  :func:`fedhead.federation.train.ccvr_calibrate`.

:meth:`FedheadStrategy.start` replaces :meth:`flwr.serverapp.strategy.Strategy.start` (which always starts
at round 1) so that the query exchange, checkpoints and resume fit around the same configure/aggregate calls.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING
from pathlib import Path
from typing import Iterable

import numpy as np

from fedhead.flower.common import require_flower

require_flower()

import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.serverapp.strategy import Strategy  # noqa: E402

from extract.store import Features  # noqa: E402
from fedhead.core.aggregate import Accumulator, aggregator_of  # noqa: E402
from fedhead.core.ccvr import ClassStats, PooledStats  # noqa: E402
from fedhead.core.closedform import StatsAccumulator, is_closed_form  # noqa: E402
from fedhead.core.dp import epsilon_schedule, noisy_feature_sums  # noqa: E402
from fedhead.core.engine import ScaffoldState, evaluate  # noqa: E402
from fedhead.core.heads import create_head, resolve_head_params  # noqa: E402
from fedhead.core.partitions import resolve_partition_params  # noqa: E402
from fedhead.federation.config import TrainConfig  # noqa: E402
from fedhead.federation.rundir import (  # noqa: E402
    ROUND_FIELDS,
    default_run_dir,
    read_csv,
    write_clients_per_seed,
    write_config,
    write_csv,
    write_experiment,
    write_summary,
)
from fedhead.federation.train import (
    CHECKPOINT,
    PAUSE_ENV,
    FeatureStats,
    ServerUpdate,
    ccvr_calibrate,
    prepare,
    sample_clients,
    solve_statistics,
    statistics_row,
    summarize,
    validate_method,
)
from fedhead.flower.common import (
    LOG,
    MESSAGE_PREFIX,
    ServerStopped,
    client_stats_from_record,
    config_to_json,
    short_reason,
    stop_after,
    store_fingerprint,
)
from fedhead.flower.secure import SecureRounds  # noqa: E402
from fedhead.infra.devices import resolve_device  # noqa: E402
from fedhead.infra.errors import FedheadError  # noqa: E402
from fedhead.infra.files import atomic_torch_save
from fedhead.infra.signals import pause_hook, raise_if_stopped

FLOWER_ROUND_FIELDS = ROUND_FIELDS + [
    "run",
    "partition",
    "clients_trained",
    "failures",
    "failed_clients",
    "failure_reason",
]


@dataclass
class ServerSettings:
    out: str | None = None  # run directory [runs/<stamp>-flower-<head>-<partition>]
    resume: bool = False  # continue the run in ``out`` from its checkpoint
    round_timeout: float = 600.0  # seconds to wait for a round's replies (late nodes = failures)
    wait_timeout: float = 120.0  # seconds to wait for ``clients`` nodes to connect / answer the query
    runs_root: str = "runs"


@dataclass
class RunOutcome:
    run_dir: Path
    summary: dict
    rows: list[dict]


@dataclass
class _Round:
    """What aggregate_train learnt about one round (read by the run loop for its row)."""

    trained: int = 0
    loss_sum: float = 0.0
    client_ms: list = field(default_factory=list)
    server_s: float = 0.0
    failed: dict = field(default_factory=dict)  # partition id -> reason


def validate_server_config(cfg: TrainConfig, store: Features) -> TrainConfig:
    """Like :func:`fedhead.federation.train.validate_config`, but the server's store may hold only the test split."""
    cfg = cfg.resolved()
    resolve_head_params(cfg.head, **cfg.head_params)
    resolve_partition_params(cfg.partition, **cfg.partition_params)
    validate_method(cfg)
    if cfg.iid_reference:
        raise FedheadError(
            "The '--iid-reference' option is not supported on Flower. Got True instead. "
            "Run the IID reference with 'fedhead train --iid-reference'."
        )
    if cfg.central_reference:
        raise FedheadError(
            "The '--central-reference' option is not supported on Flower (the server holds no "
            "training features to train the ceiling on). Got True instead. Run the ceiling with "
            "'fedhead train --central-reference' on a store of the pooled features."
        )
    if len(store.test_y) == 0:
        raise FedheadError(
            f"The 'feature-store' of the server ({cfg.features!r}) has an empty test split, "
            "which central evaluation needs. Extract the test images into it."
        )
    return cfg


@dataclass
class NodeVariates:
    """The server's record of SCAFFOLD's client variates, which live on the nodes (their ``Context.state``).

    ``accepted[k]`` is the round whose delta of partition ``k`` the server applied last (0: none, the zero
    variate SCAFFOLD starts from); the train message names that version of ``c_k`` (:meth:`tag`) and the one the
    node is to keep after training, so a node whose reply was lost (its delta never applied) trains again from
    the version the server's ``c`` counts. ``generation`` changes the tags when SCAFFOLD restarts (``restarts``:
    the rounds where it did); ``run`` is drawn when a run starts and kept by its checkpoint, so the variates a node
    kept on disk for another run of the same config are never taken for this run's."""

    identity: str
    seed: int
    accepted: np.ndarray  # [N] int64
    generation: int = 0
    restarts: list = field(default_factory=list)
    run: str = field(default_factory=lambda: os.urandom(6).hex())

    def tag(self, rnd: int) -> str:
        return f"{self.identity}/{self.seed}/{self.run}/{self.generation}/{int(rnd)}" if rnd else ""

    def lost(self, pid: int, reply: Message) -> bool:
        """Whether the query reply of partition ``pid`` shows that its node no longer holds the ``c_k`` it needs."""
        if not self.accepted[pid]:
            return False
        held = str(reply.content["config"]["scaffold-tags"]).split() if "config" in reply.content else []
        return self.tag(self.accepted[pid]) not in held

    def state_dict(self) -> dict:
        return {
            "accepted": self.accepted.copy(),
            "generation": self.generation,
            "restarts": list(self.restarts),
            "run": self.run,
        }


class FedheadStrategy(Strategy):
    """See the module docstring. ``cfg`` is resolved; ``store`` is the server's (test split used)."""

    def __init__(self, cfg: TrainConfig, store: Features, settings: ServerSettings):
        self.cfg, self.store, self.settings = cfg, store, settings
        self.device = resolve_device(cfg.device)
        self.head = create_head(cfg.head, **cfg.head_params)
        self.fingerprint = json.dumps(store_fingerprint(store.info), sort_keys=True)
        self.cfg_json = config_to_json(cfg)
        self.seed = cfg.seeds[0]
        self.node_of: dict[int, int] = {}  # partition id -> node id
        self.stats = FeatureStats(None, 1.0, 0, 0)
        self.theta: torch.Tensor | None = None
        self.last = _Round()
        closed = is_closed_form(cfg.head)
        self.solver = create_head(cfg.head if closed else cfg.init, **cfg.head_params) if (closed or cfg.init) else None
        self.server = self.server_update()
        self.variates: NodeVariates | None = None  # SCAFFOLD: which c_k each node trains from
        self.lost_variates: str | None = None  # SCAFFOLD: why it must restart before the next round
        # --secure-aggregation: every sum below comes from Flower's SecAgg+ (fedhead.flower.secure)
        self.secure = SecureRounds(self) if cfg.secure_aggregation else None

    def server_update(self) -> ServerUpdate:
        """The simulator's :class:`fedhead.federation.train.ServerUpdate` for one seed (server optimiser, SCAFFOLD's ``c``).
        The clients' variates live on their nodes: the server's SCAFFOLD state holds ``c`` and ``N`` only."""
        shape = (self.store.info.num_classes, self.store.test_x.shape[1] + 1)
        server = ServerUpdate(replace(self.cfg, scaffold=False), shape, self.device)  # no [N, C, D+1] here
        if self.cfg.scaffold:
            server.scaffold = ScaffoldState.held_by(
                [], torch.zeros(shape, device=self.device), num_clients=self.cfg.clients
            )
        return server

    def restart_variates(self, rnd: int, why: str) -> None:
        """SCAFFOLD from zero variates everywhere (``c = 0``; every node's next tag names the zero variate): the
        only state that keeps ``c`` the mean of the ``c_k`` once a node has lost its own."""
        v = self.variates
        LOG.log(WARNING, "[fedhead] SCAFFOLD restarts from zero control variates at round %s: %s", rnd, why)
        self.server.scaffold.c.zero_()
        self.server.scaffold.pending.zero_()
        v.accepted[:] = 0
        v.generation += 1
        v.restarts.append(int(rnd))

    # ---------------------------------------------------------------- Strategy interface

    def summary(self) -> None:
        c = self.cfg
        LOG.log(
            INFO,
            "FedheadStrategy: head=%s partition=%s clients=%s rounds=%s aggregate=%s participation=%s seeds=%s",
            c.head,
            c.partition,
            c.clients,
            c.rounds,
            c.aggregate,
            c.participation,
            c.seeds,
        )

    def _round_config(self, server_round: int) -> ConfigRecord:
        cr = ConfigRecord(
            {
                "train-config": self.cfg_json,
                "server-store": self.fingerprint,
                "seed": int(self.seed),
                "round": int(server_round),
                "stage": self.head.stage(server_round),
                "stats-scale": float(self.stats.scale),
            }
        )
        if self.stats.mean is not None:
            cr["stats-mean"] = [float(v) for v in self.stats.mean]
        return cr

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        sel = sample_clients(self.cfg.clients, self.cfg.participation, self.seed, server_round)
        self.last = _Round()
        self._selected = [int(k) for k in sel]
        cfg_rec = self._round_config(server_round)
        for k, v in config.items():
            cfg_rec[k] = v
        scaffold = self.server.scaffold
        if scaffold is not None:  # SCAFFOLD: the server's c travels with the head
            arrays = ArrayRecord({**dict(arrays.items()), "scaffold-c": Array(scaffold.c.cpu().numpy())})
        msgs = []
        for pid in self._selected:
            node = self.node_of.get(pid)
            if node is None:
                self.last.failed[pid] = "no connected SuperNode has this partition id"
                continue
            rec = cfg_rec
            if scaffold is not None:  # which c_k to train from, and under which tag to keep the result
                rec = ConfigRecord(
                    {
                        **dict(cfg_rec.items()),
                        "scaffold-in": self.variates.tag(self.variates.accepted[pid]),
                        "scaffold-out": self.variates.tag(server_round),
                    }
                )
            msgs.append(
                Message(
                    RecordDict({"arrays": arrays, "config": rec}),
                    dst_node_id=node,
                    message_type=MessageType.TRAIN,
                    group_id=str(server_round),
                )
            )
        return msgs

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        pid_of = {n: p for p, n in self.node_of.items()}
        good = []
        answered = set()
        for r in replies:
            pid = pid_of.get(r.metadata.src_node_id)
            if pid is None:
                continue
            answered.add(pid)
            if r.has_error():
                self.last.failed[pid] = short_reason(r.error.reason)
                continue
            m = r.content["metrics"]
            if int(m.get("scaffold-lost", 0)):
                self.last.failed[pid] = (
                    "the node no longer holds its SCAFFOLD control variate (restarted?); "
                    "SCAFFOLD restarts from zero variates next round"
                )
                self.lost_variates = f"the node of partition {pid} no longer held its control variate"
                continue
            if int(m["num-examples"]) == 0:
                continue  # an empty client is skipped, as in the simulator
            good.append((pid, r))
        for pid in self._selected:
            if pid not in answered and pid not in self.last.failed:
                self.last.failed[pid] = f"no reply within {self.settings.round_timeout:g} s"
        if not good:
            return None, MetricRecord({"clients-trained": 0, "failures": len(self.last.failed)})
        good.sort(key=lambda t: t[0])  # partition order = the simulator's order
        t0 = time.perf_counter()
        keys = sorted(k for k in good[0][1].content["arrays"].keys() if k.startswith(MESSAGE_PREFIX))
        msg = {
            k[len(MESSAGE_PREFIX) :]: torch.stack(
                [torch.as_tensor(r.content["arrays"][k].numpy()) for _, r in good]
            ).to(self.device)
            for k in keys
        }
        holds = torch.stack([torch.as_tensor(r.content["arrays"]["holds"].numpy()).bool() for _, r in good]).to(
            self.device
        )
        sizes = torch.as_tensor([int(r.content["metrics"]["num-examples"]) for _, r in good], device=self.device)
        deltas = (
            torch.stack([torch.as_tensor(r.content["arrays"]["scaffold-delta"].numpy()) for _, r in good])
            if self.server.scaffold is not None
            else None
        )
        return self._finish_round(
            server_round,
            msg,
            sizes,
            holds,
            len(good),
            deltas,
            [pid for pid, _ in good],
            sum(float(r.content["metrics"]["train-loss"]) for _, r in good),
            [float(r.content["metrics"]["client-ms"]) for _, r in good],
            t0,
        )

    def _finish_round(
        self,
        server_round: int,
        msg: dict,
        sizes: torch.Tensor,
        holds: torch.Tensor,
        clients: int,
        deltas: torch.Tensor | None,
        pids: list,
        loss_sum: float,
        client_ms: list,
        t0: float,
    ):
        """The server's half of a round from ``clients`` clients' messages: stacked per client (a plain round), or
        one secure sum (``[1, ...]`` each, :meth:`fedhead.flower.secure.SecureRounds.train_round`)."""
        acc = Accumulator(
            aggregator_of(self.cfg), self.theta, seed=self.seed, rnd=server_round, sampled=len(self._selected)
        )  # the simulator's sums of the same messages
        acc.add_message(msg, sizes, holds)
        acc.clients = clients
        aggregated = acc.finish()
        if self.server.scaffold is not None:  # the simulator's rule: c += sum of the deltas / N
            self.server.scaffold.add_deltas(deltas.to(self.device))
            self.server.scaffold.server_update()
            for pid in pids:
                self.variates.accepted[pid] = server_round
        theta = self.server.step(self.theta, aggregated)
        self.last.server_s = time.perf_counter() - t0
        self.last.trained = clients
        self.last.loss_sum = float(loss_sum)
        self.last.client_ms = list(client_ms)
        self.theta = theta
        return (
            ArrayRecord({"head": Array(theta.cpu().numpy())}),
            MetricRecord(
                {
                    "clients-trained": clients,
                    "failures": len(self.last.failed),
                    "train-loss": self.last.loss_sum / clients,
                }
            ),
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # evaluation is central, on the server's test split

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    # ---------------------------------------------------------------- nodes and the query exchange

    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        n, t0 = self.cfg.clients, time.monotonic()
        while True:
            ids = list(grid.get_node_ids())
            if len(ids) >= n:
                return ids
            if time.monotonic() - t0 > self.settings.wait_timeout:
                raise FedheadError(
                    f"Only {len(ids)} of {n} SuperNodes connected after {self.settings.wait_timeout:g} s. Start "
                    f"one 'fedhead flower supernode' per client (partition-id 0..{n - 1}), or lower --clients."
                )
            time.sleep(0.5)

    def _query(self, grid: Grid, node_ids: list[int], want_stats: bool) -> list[tuple[int, Message]]:
        cr = ConfigRecord(
            {
                "train-config": self.cfg_json,
                "server-store": self.fingerprint,
                "seed": int(self.seed),
                "want-stats": bool(want_stats),
                # the statistics exchange of a closed-form head or an --init start (round 1)
                "closed-form": self.solver.name if (want_stats and self.solver is not None) else "",
            }
        )
        msgs = [
            Message(RecordDict({"config": cr}), dst_node_id=n, message_type=MessageType.QUERY, group_id="query")
            for n in node_ids
        ]
        replies = list(grid.send_and_receive(msgs, timeout=self.settings.wait_timeout))
        out = []
        for r in replies:
            node = r.metadata.src_node_id
            if r.has_error():
                raise FedheadError(f"SuperNode {node} refused the run before round 1: {short_reason(r.error.reason)}")
            out.append((node, r))
        return out

    def connect(self, grid: Grid, need_stats: bool) -> dict:
        """Query every node: partition ids, sizes, class counts and (once) the feature statistics."""
        ids = self._wait_for_nodes(grid)
        replies = self._query(grid, ids, need_stats)
        K = self.cfg.clients
        if len(replies) < len(ids):
            missing = sorted(set(ids) - {n for n, _ in replies})
            raise FedheadError(
                f"SuperNodes {missing} did not answer the query within "
                f"{self.settings.wait_timeout:g} s. Check that they are running."
            )
        node_of, info = {}, {}
        for node, r in replies:
            m = r.content["metrics"]
            pid = int(m["partition-id"])
            if not 0 <= pid < K:
                raise FedheadError(
                    f"SuperNode {node} has partition-id {pid}, but the run has --clients {K}. "
                    f"Give the nodes partition ids 0..{K - 1}."
                )
            if pid in node_of:
                raise FedheadError(
                    f"SuperNodes {node_of[pid]} and {node} both have partition-id {pid}. "
                    "Give every node its own partition id."
                )
            node_of[pid] = node
            info[pid] = r
        missing = sorted(set(range(K)) - set(node_of))
        if missing:
            raise FedheadError(
                f"No connected SuperNode has partition-id {missing[0]} (missing: {missing}). "
                f"Start one node per partition id 0..{K - 1}."
            )
        self.node_of = node_of
        return info

    def refresh_nodes(self, grid: Grid) -> None:
        """Nodes that (re)joined since the last query: learn their partition ids (no statistics)."""
        known = set(self.node_of.values())
        new = [n for n in grid.get_node_ids() if n not in known]
        if not new:
            return
        try:
            replies = self._query(grid, new, False)
        except FedheadError as exc:
            LOG.log(WARNING, "a rejoining node was refused: %s", exc)
            return
        lost = []
        for node, r in replies:
            pid = int(r.content["metrics"]["partition-id"])
            if 0 <= pid < self.cfg.clients:
                self.node_of[pid] = node
                if self.variates is not None and self.variates.lost(pid, r):
                    lost.append(pid)
        if lost:
            self.lost_variates = f"the rejoined nodes of partitions {lost} no longer hold their control variates"

    def combine_stats(self, info: dict) -> FeatureStats:
        """The server half of :func:`fedhead.federation.train.federated_feature_stats`, in partition order."""
        cfg = self.cfg
        if not cfg.center and cfg.scale == "none":
            return FeatureStats(None, 1.0, 0, 0)
        d = self.store.test_x.shape[1]
        total = np.zeros(d, dtype=np.float64)
        sq, n = 0.0, 0
        for pid in range(cfg.clients):
            r = info[pid]
            total += r.content["arrays"]["feature-sum"].numpy()
            sq += float(r.content["metrics"]["feature-sq"])
            n += int(r.content["metrics"]["feature-count"])
        return self.stats_from_sums(total, sq, n, (d + 2) * 4, (d + 1) * 4)

    def stats_from_sums(self, total: np.ndarray, sq: float, n, up: float, down: float) -> FeatureStats:
        """The federated mean and scale from the summed feature statistics (a plain run's replies added in partition
        order, or a secure census); ``up``/``down``: bytes per client of that exchange."""
        cfg = self.cfg
        total, sq, n = noisy_feature_sums(total, sq, n, cfg, self.seed)  # DP: the simulator's noise (no-op)
        mean = total / max(1, n)
        s = 1.0
        if cfg.scale == "rms":
            var = sq / max(1, n) - (float(mean @ mean) if cfg.center else 0.0)
            s = float(np.sqrt(max(var, 1e-12)))
        return FeatureStats(mean if cfg.center else None, s, up, down)

    def statistics(self, info: dict, pids: list[int], grid: Grid | None = None):
        """The server half of the statistics exchange: the sampled clients' messages added in partition order
        into the accumulator the simulator uses (:class:`fedhead.core.closedform.StatsAccumulator`); with secure
        aggregation their sums, from a SecAgg+ exchange over ``grid``."""
        if self.secure is not None:
            return self.secure.statistics(grid, sorted(pids))
        C, D = self.store.info.num_classes, self.store.test_x.shape[1]
        msgs = [client_stats_from_record(info[p].content["arrays"], D) for p in sorted(pids)]
        counts = None
        if self.solver.needs_client_means:
            counts = np.zeros((len(msgs), C), dtype=np.int64)
            for i, m in enumerate(msgs):
                counts[i, m.classes] = m.counts
        acc = StatsAccumulator(C, D, gram=self.solver.needs_gram, cof_counts=counts)
        for m in msgs:
            acc.add(m)
        return acc

    def calibrate(self, grid: Grid, rnd: int, xt: torch.Tensor, y_test: torch.Tensor) -> dict:
        """CCVR after the last round: one ``query.ccvr`` to every node for the class statistics of its prepared
        features (:func:`fedhead.federation.train.ccvr_client_stats`), pooled in partition order and calibrated by
        :func:`fedhead.federation.train.ccvr_calibrate`, as the simulator does; returns the ``ccvr`` row (with failures)."""
        cfg = self.cfg
        self.refresh_nodes(grid)
        cr = self._round_config(rnd)
        mtype = MessageType.TRAIN if self.secure is not None else "query.ccvr"  # SecAgg+ runs on train messages
        msgs = [
            Message(RecordDict({"config": cr}), dst_node_id=self.node_of[p], message_type=mtype, group_id="ccvr")
            for p in range(cfg.clients)
            if p in self.node_of
        ]
        got, failed = (
            {},
            {p: "no connected SuperNode has this partition id" for p in range(cfg.clients) if p not in self.node_of},
        )
        pid_of = {n: p for p, n in self.node_of.items()}
        if self.secure is not None:  # the class moments, summed by SecAgg+
            pooled, got, failed, up, client_ms = self.secure.ccvr(grid, msgs, rnd, failed)
        else:
            for r in grid.send_and_receive(msgs, timeout=self.settings.round_timeout):
                pid = pid_of.get(r.metadata.src_node_id)
                if pid is None:
                    continue
                if r.has_error():
                    failed[pid] = short_reason(r.error.reason)
                else:
                    got[pid] = r
            for p in range(cfg.clients):
                if p not in got and p not in failed:
                    failed[p] = f"no reply within {self.settings.round_timeout:g} s"
            pooled = PooledStats(self.store.info.num_classes, self.store.test_x.shape[1])
            up, client_ms = 0, 0.0
            for p in sorted(got):  # partition order = the simulator's order
                blob = got[p].content["arrays"]["ccvr-stats"].numpy().tobytes()
                client_ms += float(got[p].content["metrics"]["client-ms"])
                if blob:
                    pooled.add(ClassStats.from_bytes(blob, pooled.dim))
                    up += len(blob)
        self.theta, row = ccvr_calibrate(
            self.head, self.theta, pooled, cfg, self.seed, xt, y_test, rnd, cfg.clients, up, client_ms / 1000
        )
        if self.secure is not None:
            row.update(
                self.secure.take_bytes(cfg.clients, cfg.clients * self.theta.numel() * self.theta.element_size())
            )
        lost = sorted(failed)
        LOG.log(
            INFO,
            "[fedhead] seed %s CCVR calibration: accuracy %.4f from %s nodes%s",
            self.seed,
            row["accuracy"],
            len(got),
            f", {len(lost)} failed ({failed[lost[0]]})" if lost else "",
        )
        return {
            "seed": self.seed,
            **row,
            "run": "main",
            "partition": cfg.partition,
            "failures": len(lost),
            "failed_clients": " ".join(map(str, lost)),
            "failure_reason": failed[lost[0]] if lost else "",
        }

    # ---------------------------------------------------------------- the run

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn=None,
    ) -> RunOutcome:
        cfg, st = self.cfg, self.settings
        if timeout is not None:
            st.round_timeout = timeout
        rounds = 1 if is_closed_form(cfg.head) else (num_rounds or cfg.rounds)
        privacy = epsilon_schedule(cfg, rounds)  # DP: epsilon per round ({} without DP)
        run_dir = Path(st.out) if st.out else default_run_dir(st.runs_root, "flower", cfg.head, cfg.partition)
        ckpt_path = run_dir / CHECKPOINT
        ckpt = self._load_resume(run_dir, ckpt_path)
        if isinstance(ckpt, RunOutcome):
            return ckpt
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config(
            run_dir,
            {
                "identity": cfg.identity(),
                "config": cfg.to_dict(),
                "head_params": resolve_head_params(cfg.head, **cfg.head_params),
                "partition_params": resolve_partition_params(cfg.partition, **cfg.partition_params),
                "store": {
                    "path": str(self.store.info.path),
                    **self.store.info.attrs,
                    "shapes": {k: list(v) for k, v in self.store.info.shapes.items()},
                },
                "device": str(self.device),
                "torch_version": torch.__version__,
                "runtime": "flower",
                "flower_version": _flwr_version(),
                "round_timeout_s": st.round_timeout,
                "randomness": "numpy default_rng keyed by (seed, round[, client, epoch]); no global seeding",
            },
        )
        write_experiment(run_dir, cfg)
        self.summary()

        rows: list[dict] = list(ckpt["rows"]) if ckpt else []
        done: set = set(ckpt["done_seeds"]) if ckpt else set()
        realised: dict = dict(ckpt.get("realised", {})) if ckpt else {}
        client_rows: list = list(ckpt.get("client_rows", [])) if ckpt else []
        restarts: list = list(ckpt.get("scaffold_restarts", [])) if ckpt else []  # SCAFFOLD: (seed, round)
        wall0 = time.perf_counter() - (ckpt["wall_s"] if ckpt else 0.0)
        C, D = self.store.info.num_classes, self.store.test_x.shape[1]
        y_test = torch.as_tensor(self.store.test_y, device=self.device)
        stop = stop_after()
        for seed in cfg.seeds:
            if seed in done:
                continue
            self.seed = seed
            resuming = ckpt is not None and ckpt["current"] == seed
            info = self.connect(grid, need_stats=not resuming)
            self.server = self.server_update()  # a fresh server optimiser and SCAFFOLD c per seed
            if cfg.scaffold:
                self.variates = NodeVariates(cfg.identity(), seed, np.zeros(cfg.clients, dtype=np.int64))
            self.lost_variates = None
            if resuming:
                s = ckpt["stats"]
                self.stats = FeatureStats(
                    None if s["mean"] is None else np.asarray(s["mean"]), s["scale"], s["up"], s["down"]
                )
                self.theta = ckpt["theta"].to(self.device)
                start = int(ckpt["round"]) + 1
                self.server.load_state_dict(ckpt.get("server", {}), self.device)
                if self.variates is not None:
                    v = ckpt["variates"]
                    self.variates.accepted[:] = v["accepted"]
                    self.variates.generation = int(v["generation"])
                    self.variates.run = str(v.get("run", ""))
                    # a resumed server is a new Flower run: its nodes start with an empty Context.state and find
                    # their variates only if they keep them in a state folder (node config state-dir)
                    lost = [p for p in range(cfg.clients) if self.variates.lost(p, info[p])]
                    if lost:
                        self.lost_variates = (
                            f"the nodes of partitions {lost} no longer hold their control variates "
                            "(the server resumed in a new Flower run)"
                        )
            else:
                self.theta = torch.zeros(C, D + 1, device=self.device)
                start = 1
                if self.secure is not None:  # the server never sees a node's counts: no clients.csv rows
                    self.stats, realised[f"{seed}:main"] = self.secure.census(grid)
                else:
                    self.stats = self.combine_stats(info)
                    counts = [info[p].content["arrays"]["class-counts"].numpy().tolist() for p in range(cfg.clients)]
                    client_rows = [r for r in client_rows if r["seed"] != seed]
                    client_rows.append({"seed": seed, "sizes": [int(sum(c)) for c in counts], "counts": counts})
                    flipped = sum(int(info[p].content["metrics"].get("noise-flipped", 0)) for p in range(cfg.clients))
                    total = sum(int(info[p].content["metrics"]["num-examples"]) for p in range(cfg.clients))
                    realised[f"{seed}:main"] = flipped / total if total else 0.0
            xt = prepare(self.store.test_x, self.stats, self.device)
            head_bytes = self.theta.numel() * self.theta.element_size()
            msg_bytes = aggregator_of(cfg).nbytes(self.theta)
            down = self.server.transfer_multiplier() * head_bytes  # SCAFFOLD's c travels too
            up = down - head_bytes + msg_bytes  # the rule's message (+ the c_k delta)
            for rnd in range(start, rounds + 1):
                extra_up = self.stats.bytes_up_per_client if rnd == 1 else 0
                extra_down = self.stats.bytes_down_per_client if rnd == 1 else 0
                stats_clients = cfg.clients if rnd == 1 else 0
                if self.solver is not None and rnd == 1:
                    # the statistics came with the query: sum the sampled clients' messages, solve
                    sel = sample_clients(cfg.clients, cfg.participation, seed, 1)
                    self._selected = [int(k) for k in sel]
                    t0 = time.perf_counter()
                    sacc = self.statistics(info, self._selected, grid)
                    t1 = time.perf_counter()
                    self.theta = solve_statistics(self.solver, sacc, cfg, self.stats, self.device, seed=seed)
                    row = statistics_row(
                        sacc,
                        0.0,
                        time.perf_counter() - t1,
                        cfg,
                        len(sel),
                        head_bytes,
                        extra_up,
                        stats_clients * (extra_up + extra_down),
                    )
                    row["client_ms"] = (
                        self.secure.client_ms
                        if self.secure is not None
                        else float(
                            np.mean([float(info[p].content["metrics"].get("stats-ms", 0.0)) for p in self._selected])
                        )
                    )
                    row["server_ms"] = 1000 * (time.perf_counter() - t0)
                    self.last = _Round(trained=sacc.clients)
                    lr = self.last
                else:
                    if rnd > start:
                        self.refresh_nodes(grid)
                    if self.lost_variates:
                        self.restart_variates(rnd, self.lost_variates)
                        restarts.append([seed, rnd])
                        self.lost_variates = None
                    arrays = ArrayRecord({"head": Array(self.theta.cpu().numpy())})
                    msgs = self.configure_train(rnd, arrays, ConfigRecord(), grid)
                    if self.secure is not None:
                        self.secure.train_round(grid, rnd, msgs)
                    else:
                        self.aggregate_train(rnd, grid.send_and_receive(msgs, timeout=st.round_timeout))
                    lr = self.last
                    row = {
                        "stage": self.head.stage(rnd),
                        "train_loss": lr.loss_sum / max(1, lr.trained),
                        "client_ms": float(np.mean(lr.client_ms)) if lr.client_ms else 0.0,
                        "server_ms": 1000 * lr.server_s,
                        "bytes_up_per_client": up + extra_up,
                        "bytes_total": len(self._selected) * (up + down) + stats_clients * (extra_up + extra_down),
                        "clients_trained": lr.trained,
                    }
                if self.secure is not None:  # every SecAgg+ message of the round (a closed-form head: + its head)
                    row.update(
                        self.secure.take_bytes(
                            len(self._selected), len(self._selected) * head_bytes if is_closed_form(cfg.head) else 0
                        )
                    )
                evaluate_now = rnd % cfg.eval_every == 0 or rnd == rounds
                acc = evaluate(self.theta, xt, y_test) if evaluate_now else float("nan")
                failed = sorted(lr.failed)
                rows.append(
                    {
                        "seed": seed,
                        "round": rnd,
                        "accuracy": acc,
                        **row,
                        "ratio_to_iid": None,
                        "run": "main",
                        "partition": cfg.partition,
                        "failures": len(failed),
                        "failed_clients": " ".join(map(str, failed)),
                        "failure_reason": lr.failed[failed[0]] if failed else "",
                        **privacy.get(rnd, {}),
                    }
                )
                LOG.log(
                    INFO,
                    "[fedhead] seed %s round %s/%s: accuracy %.4f, %s clients trained%s",
                    seed,
                    rnd,
                    rounds,
                    acc,
                    lr.trained,
                    f", {len(failed)} failed ({lr.failed[failed[0]]})" if failed else "",
                )
                atomic_torch_save(
                    {
                        "identity": cfg.identity(),
                        "current": seed,
                        "round": rnd,
                        "theta": self.theta.cpu(),
                        "rows": rows,
                        "done_seeds": sorted(done),
                        "realised": realised,
                        "client_rows": client_rows,
                        "stats": {
                            "mean": self.stats.mean,
                            "scale": self.stats.scale,
                            "up": self.stats.bytes_up_per_client,
                            "down": self.stats.bytes_down_per_client,
                        },
                        "server": self.server.state_dict(),
                        "variates": self.variates.state_dict() if self.variates is not None else None,
                        "scaffold_restarts": restarts,
                        "wall_s": time.perf_counter() - wall0,
                    },
                    ckpt_path,
                )
                write_csv(run_dir / "rounds.csv", rows, FLOWER_ROUND_FIELDS)
                pause_hook(PAUSE_ENV, len(rows))
                raise_if_stopped()  # a signal during `flower simulate`: stop at this consistent point
                if stop is not None and rnd == stop:
                    raise ServerStopped(f"server stopped after round {rnd} ({'FEDHEAD_FLOWER_STOP_AFTER'})")
            if cfg.calibrate == "ccvr":
                rows.append(self.calibrate(grid, rounds + 1, xt, y_test))
                write_csv(run_dir / "rounds.csv", rows, FLOWER_ROUND_FIELDS)
            ckpt = None
            done.add(seed)
            torch.save(self.theta.cpu(), run_dir / f"head-seed{seed}.pt")

        write_csv(run_dir / "rounds.csv", rows, FLOWER_ROUND_FIELDS)
        if client_rows:  # none with --secure-aggregation
            write_clients_per_seed(run_dir, client_rows)
        summary = summarize(rows, cfg, realised, time.perf_counter() - wall0)
        summary["runtime"] = "flower"
        summary["failures"] = int(sum(r["failures"] for r in rows))
        if cfg.scaffold:
            summary["scaffold_restarts"] = [{"seed": int(s), "round": int(r)} for s, r in restarts]
        if self.secure is not None:
            summary["secure_aggregation"] = self.secure.summary()
        write_summary(run_dir, summary)
        if ckpt_path.exists():
            ckpt_path.unlink()
        return RunOutcome(run_dir, summary, rows)

    def _load_resume(self, run_dir: Path, ckpt_path: Path):
        cfg = self.cfg
        if not self.settings.resume:
            if run_dir.exists() and any(run_dir.iterdir()):
                raise FedheadError(
                    f"The 'run-dir' parameter names {str(run_dir)!r}, which already holds files. "
                    "Use resume=true to continue that run, or choose another run-dir."
                )
            return None
        if not ckpt_path.exists():
            if (run_dir / "summary.json").exists() and (run_dir / "config.json").exists():
                prev = json.loads((run_dir / "config.json").read_text())
                if prev.get("identity") != cfg.identity():
                    raise FedheadError(
                        f"The 'resume' option found a run in {str(run_dir)!r} with a different "
                        "configuration. Use the same options, or a new run-dir."
                    )
                return RunOutcome(
                    run_dir, json.loads((run_dir / "summary.json").read_text()), read_csv(run_dir / "rounds.csv")
                )
            if run_dir.exists() and any(run_dir.iterdir()):
                raise FedheadError(
                    f"The 'resume' option needs a checkpoint in {str(run_dir)!r}, but none "
                    "exists. Run without resume, or name the run's directory."
                )
            return None  # nothing there yet: a fresh run
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ckpt.get("identity") != cfg.identity():
            raise FedheadError(
                f"The 'resume' option found a run in {str(run_dir)!r} with a different "
                "configuration. Use the same options as the interrupted run, or a new run-dir."
            )
        LOG.log(INFO, "[fedhead] resuming %s after round %s of seed %s", run_dir, ckpt["round"], ckpt["current"])
        return ckpt


def _flwr_version() -> str:
    try:
        from importlib.metadata import version

        return version("flwr")
    except Exception:  # noqa: BLE001
        return "unknown"
