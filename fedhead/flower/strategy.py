"""FedheadStrategy: fedhead's Flower transport. The round loop is the simulator's own
(:func:`fedhead.federation.loop.run_job` over a :class:`fedhead.federation.job.HeadJob`); :meth:`FedheadStrategy.start`
lends it this strategy as the transport that reaches the clients through a Flower Grid:

- participation: :func:`fedhead.core.sampling.round_clients` by (seed, round) over partition ids (the loop's),
  not Flower's random node sampling; a partition id is mapped to the node that announced it in the ``query``
  exchange;
- aggregation: :class:`fedhead.core.aggregate.Accumulator` over the replies in partition-id order, exactly as the
  simulator adds its clients; the server update (optimiser, SCAFFOLD's ``c``) and evaluation are the loop's;
- two-stage heads: every train message carries the round (the head's stage is a function of it) and the stage;
- feature centring/scaling: one real exchange of per-node feature sums before round 1, combined in partition
  order in float64 (bit-identical to :func:`fedhead.federation.clients.federated_feature_stats`), sent each round;
- faults: a node that raises or does not answer within ``round_timeout`` is recorded as a failure of that
  round (the ``failures`` columns of rounds.csv) and the round completes with the others; a node without a store
  or with a store from another encoder refuses the run before round 1 and the server stops with its one line;
- untrusted replies: every reply is checked (:func:`fedhead.flower.replies.check_reply`) before it is used; a bad
  one is its partition's failure, as a crash is; a node claiming a partition another live node holds is refused
  (``refused_nodes`` in summary.json), and one taking over the partition of a node that left must report that
  partition's first counts; bad statistics in a query reply leave the partition's statistics out;
- SCAFFOLD: the server holds ``c`` (and ``N``) in the simulator's :class:`fedhead.core.engine.ScaffoldState`, sent
  with the head; each node keeps its own ``c_k`` in Flower's ``Context.state`` and returns its delta, which the
  server adds with the simulator's rule (:class:`NodeVariates` keeps which version of ``c_k`` each node must train
  from; nodes with a state folder also keep ``c_k`` on disk, so a resumed server continues; a node that lost its
  ``c_k`` restarts SCAFFOLD from zero variates everywhere);
- error feedback (``fedavg-int8``, ``fedavg-topk``): each node keeps its residual ``e_k`` as it keeps ``c_k`` (two
  versions by tag; the server names the one its last applied reply left); replies carry the rule's compact wire
  form, which the server expands (:meth:`fedhead.core.aggregate.Aggregator.unwire`) before summing;
- CCVR: after the last round one ``query.ccvr`` exchange with every node (the simulator's
  :func:`fedhead.federation.clients.ccvr_client_stats` there), pooled in partition order;
- personalisation (``--personalize``): after the last round one ``query.personalize`` to every node, which
  personalises its own client and answers with counts only (the server never sees a personal head); the global
  head's counts on each local test set and the drift set are the server's own (the in-process computation on the
  same test split). A node that fails or answers badly is left out of the metrics (local test size 0) and listed
  in summary.json's ``personal_failures``. Closed-form's beta chosen on validation: the nodes send their validation
  counts per beta, and those without a validation part are asked again with the beta the pooled counts chose;
- with ``--secure-aggregation`` every sum comes from Flower's SecAgg+ (:mod:`fedhead.flower.secure`).
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
from flwr.common.constant import ErrorCode  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.serverapp.strategy import Strategy  # noqa: E402

from extract.store import Features  # noqa: E402
from fedhead.core.aggregate import Accumulator  # noqa: E402
from fedhead.core.ccvr import ClassStats, PooledStats  # noqa: E402
from fedhead.core.closedform import StatsAccumulator, is_closed_form  # noqa: E402
from fedhead.core.compress import keeps_residuals  # noqa: E402
from fedhead.core.dp import noisy_feature_sums  # noqa: E402
from fedhead.core.engine import ScaffoldState  # noqa: E402
from fedhead.core.heads import create_head  # noqa: E402
from fedhead.core.personal import BETA_DEFAULT, BETA_GRID, create_personalizer  # noqa: E402
from fedhead.core.personalize import ClientData, PersonalCounts, Setting, personalize_clients  # noqa: E402
from fedhead.core.sampling import round_clients  # noqa: E402
from fedhead.federation.clients import FeatureStats  # noqa: E402
from fedhead.federation.config import TrainConfig  # noqa: E402
from fedhead.federation.rundir import RunDir, default_run_dir  # noqa: E402
from fedhead.federation.server import ServerUpdate  # noqa: E402
from fedhead.federation.tracking import require as require_tracker  # noqa: E402
from fedhead.federation.train import head_run_dir, run_head, run_record  # noqa: E402
from fedhead.federation.transport import Calibration, Census, Exchange, RoundResult, Transport  # noqa: E402
from fedhead.flower.common import (  # noqa: E402
    LOG,
    MESSAGE_PREFIX,
    PERSONAL_KIND,
    beta_choice,
    by_node,
    client_stats_from_record,
    config_to_json,
    global_stats_record,
    short_reason,
    store_fingerprint,
    test_split_key,
)
from fedhead.flower.pushpull import PushPull  # noqa: E402
from fedhead.flower.replies import Expect, check_reply  # noqa: E402
from fedhead.flower.secure import SecureRounds  # noqa: E402
from fedhead.infra.devices import resolve_device  # noqa: E402
from fedhead.infra.errors import FedheadError  # noqa: E402
from fedhead.infra.signals import raise_if_stopped  # noqa: E402


@dataclass
class ServerSettings:
    out: str | None = None  # run directory [runs/<stamp>-flower-<head>-<partition>]
    resume: bool = False  # continue the run in ``out`` from its checkpoint
    round_timeout: float = 600.0  # seconds to wait for a round's replies (late nodes = failures)
    wait_timeout: float = 300.0  # seconds to wait for ``clients`` nodes to connect / answer the query
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
    aggregate: torch.Tensor | None = None  # the rule's result over the replies (None: none arrived)

    def failure_fields(self) -> dict:
        failed = sorted(self.failed)
        return {"failures": len(failed), "failed_clients": " ".join(map(str, failed)),
                "failure_reason": self.failed[failed[0]] if failed else ""}  # fmt: skip


def validate_server_config(cfg: TrainConfig, store: Features) -> TrainConfig:
    """Like :func:`fedhead.federation.train.validate_config`, but the server's store may hold only the test split."""
    cfg = cfg.resolved()  # every check of the configuration alone
    require_tracker(cfg.log)
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
    if getattr(cfg, "personal_models", None) is not None:
        raise FedheadError(
            f"The '--personal-models' option is not supported on Flower (each node personalises its own client and "
            f"sends back only its counts: the server never sees a personal head). Got {cfg.personal_models!r} "
            "instead. Write personal models with 'fedhead train --personalize ... --personal-models ...'."
        )
    if cfg.secure_aggregation:  # no validation under SecAgg+ (a node's counts would reach the server unmasked):
        cfg = replace(cfg, val_fraction=0.0)  # the nodes, which get this config, hold nothing out
    if len(store.test_y) == 0:
        raise FedheadError(
            f"The 'features' store of the server ({cfg.features!r}) has an empty test split, "
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


class FedheadStrategy(PushPull, Strategy, Transport):
    """See the module docstring. ``cfg`` is resolved; ``store`` is the server's (test split used). It is the Flower
    transport of the round loop (:class:`fedhead.federation.transport.Transport`), and :meth:`start` lends it to
    the loop."""

    name = "flower"
    extra_fields = ("run", "partition", "clients_trained", "failures", "failed_clients", "failure_reason")

    def __init__(self, cfg: TrainConfig, store: Features, settings: ServerSettings):
        self.cfg, self.store, self.settings = cfg, store, settings
        self.device = resolve_device(cfg.device)
        self.head = create_head(cfg.head, **cfg.head_params)
        self.fingerprint = json.dumps(store_fingerprint(store.info), sort_keys=True)
        self.cfg_json = config_to_json(cfg)
        self.seed = cfg.seeds[0]
        self.grid: Grid | None = None  # the Grid of the run (start)
        self.node_of: dict[int, int] = {}  # partition id -> node id
        self.info: dict = {}  # partition id -> its query reply (this seed)
        self.stats = FeatureStats(None, 1.0, 0, 0)
        self.theta: torch.Tensor | None = None
        self.server: ServerUpdate | None = None  # the loop's server update of the current round
        self.last = _Round()
        self._sent: list = []  # the train messages of the round (configure_train)
        self._first_round: int | None = None  # the first round this process runs for the current seed
        closed = is_closed_form(cfg.head)
        self.solver = create_head(cfg.head if closed else cfg.init, **cfg.head_params) if (closed or cfg.init) else None
        self.variates: NodeVariates | None = None  # SCAFFOLD: which c_k each node trains from
        self.residual_tags: NodeVariates | None = None  # error feedback: which e_k each node adds
        self.lost_variates: str | None = None  # SCAFFOLD: why it must restart before the next round
        self.restarts: list = []  # SCAFFOLD: the (seed, round) where it restarted
        self.refused: dict = {}  # node id -> why its query reply was refused (it gets no message of a partition)
        self.claimed: dict = {}  # node id -> the partition it claimed while another live node held it
        self.bad_stats: dict = {}  # partition id -> why its statistics (query reply) were left out, this seed
        self.refused_stats: list = []  # every seed's bad_stats, for summary.json
        self._first: dict = {}  # partition id -> (num-examples, class counts) of its first report, this seed
        self.personal_failed: list = []  # --personalize: the partitions left out, every seed's (summary.json)
        self._test_key: str | None = None  # test_split_key of the server's test split (personalize)
        # --secure-aggregation: every sum below comes from Flower's SecAgg+ (fedhead.flower.secure)
        self.secure = SecureRounds(self) if cfg.secure_aggregation else None

    def scaffold_state(self, shape: tuple, device) -> ScaffoldState:
        """The server's SCAFFOLD state: ``c`` and ``N`` only, the clients' variates live on their nodes."""
        return ScaffoldState.held_by([], torch.zeros(shape, device=device), num_clients=self.cfg.clients)

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
        sel = round_clients(self.cfg, self.seed, server_round)
        self.last = _Round()
        self._selected = [int(k) for k in sel]
        msgs = self.train_messages(server_round, arrays, config, self._selected)
        self._sent = msgs  # their ids (given when they are pushed) name the node of a reply the SuperLink wrote
        return msgs

    def new_round(self) -> _Round:
        return _Round()

    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, pids: list) -> list:
        """The train messages of round ``server_round`` (its head ``arrays``) to the nodes of ``pids``; a partition
        without a node is marked failed in ``self.last``."""
        cfg_rec = self._round_config(server_round)
        for k, v in config.items():
            cfg_rec[k] = v
        scaffold = self.server.scaffold
        if scaffold is not None:  # SCAFFOLD: the server's c travels with the head
            arrays = ArrayRecord({**dict(arrays.items()), "scaffold-c": Array(scaffold.c.cpu().numpy())})
        msgs = []
        for pid in pids:
            node = self.node_of.get(pid)
            if node is None:
                self.last.failed[pid] = "no connected SuperNode has this partition id"
                continue
            rec = cfg_rec
            tags = {}
            if scaffold is not None:  # which c_k to train from, and under which tag to keep the result
                tags["scaffold-in"] = self.variates.tag(self.variates.accepted[pid])
                tags["scaffold-out"] = self.variates.tag(server_round)
            if self.residual_tags is not None:  # error feedback: which e_k to add, under which tag to keep the next
                tags["residual-in"] = self.residual_tags.tag(self.residual_tags.accepted[pid])
                tags["residual-out"] = self.residual_tags.tag(server_round)
            if tags:
                rec = ConfigRecord({**dict(cfg_rec.items()), **tags})
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
        selected = set(self._selected)
        spec = self.server.rule.wire_shapes(self.theta)  # what each reply's message must be
        for node, r in by_node(replies, self._sent):
            pid = pid_of.get(node)
            if pid is None or pid not in selected:
                continue
            if pid in answered:  # a second reply: neither is used
                self.last.failed[pid] = "bad train reply refused: more than one reply"
                good = [g for g in good if g[0] != pid]
                continue
            answered.add(pid)
            if r.has_error():
                self.last.failed[pid] = short_reason(r.error.reason)
                continue
            why = check_reply("train", r, self._expect(pid, message=spec))
            if why:
                self.last.failed[pid] = why
                continue
            m = r.content["metrics"]
            if int(m.get("scaffold-lost", 0)):
                self.last.failed[pid] = (
                    "the node no longer holds its SCAFFOLD control variate (restarted?); "
                    "SCAFFOLD restarts from zero variates next round"
                )
                self.lost_variates = f"the node of partition {pid} no longer held its control variate"
                continue
            if int(m.get("residual-lost", 0)):
                LOG.log(WARNING, "[fedhead] partition %s lost its error-feedback residual; it restarted from zero", pid)
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
        sent = {
            k[len(MESSAGE_PREFIX) :]: torch.stack(
                [torch.as_tensor(r.content["arrays"][k].numpy()) for _, r in good]
            ).to(self.device)
            for k in keys
        }
        msg = self.server.rule.unwire(sent, self.theta)  # a compressed rule's wire form -> its dense message
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
            self.server.rule, self.theta, seed=self.seed, rnd=server_round, sampled=len(self._selected)
        )  # the simulator's sums of the same messages, into the loop's rule
        acc.add_message(msg, sizes, holds)
        acc.clients = clients
        aggregated = acc.finish()
        if self.server.scaffold is not None:  # the simulator's rule: c += sum of the deltas / N
            self.server.scaffold.add_deltas(deltas.to(self.device))
            self.server.scaffold.server_update()
            for pid in pids:
                self.variates.accepted[pid] = server_round
        if self.residual_tags is not None:  # the e_k each node kept after this round is the one to use next
            for pid in pids:
                self.residual_tags.accepted[pid] = server_round
        self.last.aggregate = aggregated  # the server update (optimiser) is the loop's, as in the simulator
        self.last.server_s = time.perf_counter() - t0
        self.last.trained = clients
        self.last.loss_sum = float(loss_sum)
        self.last.client_ms = list(client_ms)
        return (
            ArrayRecord({"head": Array(aggregated.cpu().numpy())}),
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

    def _query(
        self, grid: Grid, node_ids: list[int], want_stats: bool, strict: bool = True
    ) -> list[tuple[int, Message]]:
        """The ``query`` exchange with ``node_ids``; a node's error reply stops the run (``strict``: before round 1)
        or refuses that node."""
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
        replies = by_node(grid.send_and_receive(msgs, timeout=self.settings.wait_timeout), msgs)
        out = []
        for node, r in replies:
            if r.has_error():
                if (
                    r.error.code == ErrorCode.NODE_UNAVAILABLE
                ):  # a registration whose node is gone (it may come back as another)
                    LOG.log(WARNING, "SuperNode %s is unavailable (no heartbeat); left out", node)
                    continue
                if not strict:
                    self._refuse(node, f"it refused the query: {short_reason(r.error.reason)}")
                    continue
                raise FedheadError(f"SuperNode {node} refused the run before round 1: {short_reason(r.error.reason)}")
            out.append((node, r))
        return out

    def _refuse(self, node: int, why: str) -> None:
        """A node whose query reply cannot be taken: it gets no message of any partition (logged, summary.json)."""
        if self.refused.get(node) != why:
            LOG.log(WARNING, "[fedhead] SuperNode %s refused: %s", node, why)
        self.refused[node] = why

    def _second_claim(self, node: int, holder: int, pid: int) -> str:
        """``node`` claims partition ``pid``, which the live node ``holder`` has: remembered (it is asked again once
        ``holder`` is gone), and why it is refused."""
        self.claimed[node] = pid
        return (
            f"SuperNodes {holder} and {node} both have partition-id {pid}; the second was refused (give every node "
            "its own partition id)"
        )

    def _query_expect(self, want_stats: bool, **kw) -> Expect:
        """What a query reply must hold (``want_stats``: with the statistics this server asks for)."""
        C, D = self.store.info.num_classes, self.store.test_x.shape[1]
        cf = gram = second = None
        if want_stats and self.solver is not None:
            m = self.solver.message_kwargs(D)
            cf, gram, second = (D if m["lift"] is None else m["lift"].dim), bool(m["gram"]), bool(m["second"])
        return Expect(
            C, D, self.cfg.clients, secure=self.secure is not None, stats=want_stats, closed_form=cf,
            gram=bool(gram), second=bool(second), **kw,
        )  # fmt: skip

    def _expect(self, pid: int, **kw) -> Expect:
        """What a reply of partition ``pid`` must hold: its first report's counts, the run's shapes."""
        n, counts = self._first.get(pid, (None, None))
        head = tuple(self.theta.shape) if self.theta is not None else None
        C, D = self.store.info.num_classes, self.store.test_x.shape[1]
        return Expect(C, D, self.cfg.clients, pid=pid, num_examples=n, class_counts=counts, head=head,
                      scaffold=self.cfg.scaffold, **kw)  # fmt: skip

    def _remember_first(self, pid: int, r: Message) -> None:
        if self.secure is None:
            m = r.content["metrics"]
            counts = tuple(int(v) for v in r.content["arrays"]["class-counts"].numpy())
            self._first[pid] = (int(m["num-examples"]), counts)

    def connect(self, grid: Grid, need_stats: bool) -> dict:
        """Query every node: partition ids, sizes, class counts and (once) the feature statistics.

        A node the SuperLink reports unavailable (a registration left by a node that died, e.g. kept in the
        SuperLink's --database across its restart) is left out; while a partition id has no live node, nodes that
        join later are asked too, until --wait-timeout."""
        ids = self._wait_for_nodes(grid)
        K, t0 = self.cfg.clients, time.monotonic()
        node_of, info, asked = {}, {}, set()
        self._first, self.bad_stats = {}, {}
        expect = self._query_expect(need_stats)
        while True:
            new = [n for n in ids if n not in asked]
            replies = self._query(grid, new, need_stats) if new else []
            asked.update(new)
            for node, r in replies:
                pid, why = self._partition_of(node, r, node_of, expect)
                if why is not None:
                    self._refuse(node, why)
                    continue
                node_of[pid], info[pid] = node, r
                self._remember_first(pid, r)
            missing = sorted(set(range(K)) - set(node_of))
            if not missing:
                break
            if time.monotonic() - t0 > self.settings.wait_timeout:
                refused = "; ".join(f"{why}" for n, why in sorted(self.refused.items()) if n in asked)
                raise FedheadError(
                    f"No connected SuperNode has partition-id {missing[0]} (missing: {missing}). "
                    f"Start one node per partition id 0..{K - 1}." + (f" Refused: {refused}." if refused else "")
                )
            time.sleep(0.5)
            ids = list(grid.get_node_ids())
        self.node_of = node_of
        return info

    def _partition_of(self, node: int, r: Message, node_of: dict, expect: Expect) -> tuple[int | None, str | None]:
        """The partition a node's first query reply claims, or why the node is refused (a malformed reply, a
        partition another node holds). Bad statistics in a good reply leave only the statistics out."""
        why = check_reply("query", r, expect)
        if why:
            return None, f"SuperNode {node}: {why}"
        pid = int(r.content["metrics"]["partition-id"])
        if pid in node_of:
            return None, self._second_claim(node, node_of[pid], pid)
        if expect.stats and self.secure is None:
            bad = check_reply("stats", r, expect)
            if bad:
                LOG.log(WARNING, "[fedhead] the statistics of partition %s are left out: %s", pid, bad)
                self.bad_stats[pid] = bad
                self.refused_stats.append({"seed": int(self.seed), "partition": pid, "reason": bad})
        return pid, None

    def refresh_nodes(self, grid: Grid) -> None:
        """Nodes that (re)joined since the last query: learn their partition ids (no statistics)."""
        known = set(self.node_of.values())
        live = set(grid.get_node_ids())
        # a node refused for claiming a held partition is asked again once that partition's node is gone
        retry = {n for n, p in self.claimed.items() if n in live and self.node_of.get(p) not in live}
        new = [n for n in live if n not in known and (n not in self.refused or n in retry)]
        if not new:
            return
        replies = self._query(grid, sorted(new), False, strict=False)
        lost, expect = [], self._query_expect(False)
        for node, r in replies:
            why = check_reply("query", r, expect)
            if why:
                self._refuse(node, f"SuperNode {node}: {why}")
                continue
            pid = int(r.content["metrics"]["partition-id"])
            holder = self.node_of.get(pid)
            if holder is not None and holder in live:  # never re-route a partition whose node is still there
                self._refuse(node, self._second_claim(node, holder, pid))
                continue
            n, counts = self._first.get(pid, (None, None))
            why = check_reply("query", r, replace(expect, pid=pid, num_examples=n, class_counts=counts))
            if why:  # the partition's node left; this one is not it
                self._refuse(node, f"SuperNode {node} claims partition {pid} of a node that left: {why}")
                continue
            self.refused.pop(node, None)
            self.claimed.pop(node, None)
            self.node_of[pid] = node
            if self.variates is not None and self.variates.lost(pid, r):
                lost.append(pid)
        if lost:
            self.lost_variates = f"the rejoined nodes of partitions {lost} no longer hold their control variates"

    def combine_stats(self, info: dict) -> FeatureStats:
        """The server half of :func:`fedhead.federation.clients.federated_feature_stats`, in partition order."""
        cfg = self.cfg
        if not cfg.center and cfg.scale == "none":
            return FeatureStats(None, 1.0, 0, 0)
        d = self.store.test_x.shape[1]
        total = np.zeros(d, dtype=np.float64)
        sq, n = 0.0, 0
        for pid in range(cfg.clients):
            if pid in self.bad_stats:  # left out (logged when its reply came)
                continue
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

    def summed_statistics(self, info: dict, pids: list[int], grid: Grid | None = None):
        """The server half of the statistics exchange: the sampled clients' messages added in partition order
        into the accumulator the simulator uses (:class:`fedhead.core.closedform.StatsAccumulator`); with secure
        aggregation their sums, from a SecAgg+ exchange over ``grid``."""
        if self.secure is not None:
            return self.secure.statistics(grid, sorted(pids))
        C, D = self.store.info.num_classes, self.store.test_x.shape[1]
        kw = self.solver.message_kwargs(D)
        D = D if kw["lift"] is None else kw["lift"].dim  # ridge-rf: the statistics of the random features
        msgs = [client_stats_from_record(info[p].content["arrays"], D) for p in sorted(pids)]
        counts = None
        if self.solver.needs_client_means:
            counts = np.zeros((len(msgs), C), dtype=np.int64)
            for i, m in enumerate(msgs):
                counts[i, m.classes] = m.counts
        acc = StatsAccumulator(C, D, gram=kw["gram"], cof_counts=counts, second=kw["second"])
        for m in msgs:
            acc.add(m)
        return acc

    # ---------------------------------------------------------------- the transport of the round loop

    def begin(self, seed: int, partition: str, partition_params: dict, saved: FeatureStats | None) -> Census:
        """Query every node for the seed (partition ids, class counts and, once, the feature statistics); a resumed
        seed keeps the statistics of its checkpoint (``saved``)."""
        cfg = self.cfg
        self.seed, self._first_round = seed, None
        self.async_reset()  # --async-rule: no message of another seed (or of an earlier Flower run) is awaited
        self.info = self.connect(self.grid, need_stats=saved is None)
        self.variates = (
            NodeVariates(cfg.identity(), seed, np.zeros(cfg.clients, dtype=np.int64)) if cfg.scaffold else None
        )
        self.lost_variates = None
        self.residual_tags = (
            NodeVariates("ef:" + cfg.identity(), seed, np.zeros(cfg.clients, dtype=np.int64))
            if keeps_residuals(cfg)
            else None
        )
        if self.secure is not None:  # the server never sees a node's counts: no clients.csv rows
            self.stats, realised = (saved, None) if saved is not None else self.secure.census(self.grid)
            return Census(self.stats, realised)
        counts = [self.info[p].content["arrays"]["class-counts"].numpy().tolist() for p in range(cfg.clients)]
        if saved is not None:  # the checkpoint's statistics; the clients' counts (per-client metrics) of this query
            self.stats = saved
            return Census(saved, None, [int(sum(c)) for c in counts], counts)
        self.stats = self.combine_stats(self.info)
        flipped = sum(int(self.info[p].content["metrics"].get("noise-flipped", 0)) for p in range(cfg.clients))
        total = sum(int(self.info[p].content["metrics"]["num-examples"]) for p in range(cfg.clients))
        return Census(self.stats, flipped / total if total else 0.0, [int(sum(c)) for c in counts], counts)

    def _start_round(self, rnd: int) -> None:
        """Before each exchange after this process's first of the seed: learn the nodes that (re)joined."""
        if self._first_round is None:
            self._first_round = rnd
        elif rnd > self._first_round:
            self.refresh_nodes(self.grid)

    def _secure_bytes(self, clients: int, extra_down: int = 0) -> dict:
        return self.secure.take_bytes(clients, extra_down) if self.secure is not None else {}

    def statistics(self, selected, solver, seed: int) -> Exchange:
        """The statistics came with the query (or come from one SecAgg+ exchange): sum the sampled clients'."""
        self._selected = [int(k) for k in selected]
        self._start_round(1)
        t0 = time.perf_counter()
        if self.secure is None:
            self._ask_statistics(self._selected)
        bad = {p: self.bad_stats[p] for p in self._selected if p in self.bad_stats}
        pids = [p for p in self._selected if p not in bad]
        acc = self.summed_statistics(self.info, pids, self.grid)
        if self.secure is not None:
            client_ms = self.secure.client_ms
        else:
            client_ms = float(np.mean([float(self.info[p].content["metrics"].get("stats-ms", 0.0)) for p in pids]))
        self.last = _Round(trained=acc.clients, failed=bad)
        head_bytes = self._head_bytes()
        extra = {
            **self.last.failure_fields(),
            **self._secure_bytes(len(selected), len(selected) * head_bytes if is_closed_form(self.cfg.head) else 0),
        }
        return Exchange(acc, client_ms, time.perf_counter() - t0, extra)

    def _ask_statistics(self, pids: list) -> None:
        """The closed-form statistics of ``pids`` where their query replies hold none (a resumed seed's query asks
        for none; the loop asks for them again after round 1, e.g. for ``--personalize closed-form``): one query
        with the statistics to their nodes now (they are the same, keyed by the seed). A partition whose node does
        not answer, or answers badly, has its statistics left out, as before round 1."""
        need = [p for p in pids if p not in self.bad_stats and "cf-classes" not in self.info[p].content["arrays"]]
        nodes = {self.node_of[p]: p for p in need if p in self.node_of}
        replies = dict(self._query(self.grid, sorted(nodes), True, strict=False)) if nodes else {}
        for p in need:
            r = replies.get(self.node_of.get(p))
            n, counts = self._first.get(p, (None, None))
            expect = self._query_expect(True, pid=p, num_examples=n, class_counts=counts)
            why = (check_reply("query", r, expect) or check_reply("stats", r, expect)) if r is not None else "no reply"
            if why:
                LOG.log(WARNING, "[fedhead] the statistics of partition %s are left out: %s", p, why)
                self.bad_stats[p] = why
                self.refused_stats.append({"seed": int(self.seed), "partition": p, "reason": why})
            else:
                self.info[p] = r

    def _head_bytes(self) -> int:
        return self.store.info.num_classes * (self.store.test_x.shape[1] + 1) * 4

    def train_round(self, theta: torch.Tensor, selected, seed: int, rnd: int, server) -> RoundResult:
        """One round's train messages to the sampled nodes; their replies summed as the simulator adds them."""
        self.theta, self.server = theta, server
        self._start_round(rnd)
        if self.lost_variates:
            self.restart_variates(rnd, self.lost_variates)
            self.restarts.append([seed, rnd])
            self.lost_variates = None
        msgs = self.configure_train(rnd, ArrayRecord({"head": Array(theta.cpu().numpy())}), ConfigRecord(), self.grid)
        if self.secure is not None:
            self.secure.train_round(self.grid, rnd, msgs)
        else:
            self.aggregate_train(rnd, self.grid.send_and_receive(msgs, timeout=self.settings.round_timeout))
        lr = self.last
        extra = {**lr.failure_fields(), **self._secure_bytes(len(self._selected))}
        client_ms = float(np.mean(lr.client_ms)) if lr.client_ms else 0.0
        return RoundResult(lr.aggregate, lr.trained, lr.loss_sum, client_ms, lr.server_s, extra)

    def validate(self, theta: torch.Tensor, scorer=None) -> dict | None:
        """One ``query.validate`` to every node: each evaluates the head on its own validation part and returns its
        correct predictions, samples and summed loss (checked: :func:`check_reply`), summed here in partition order.
        A node that fails is left out of that evaluation (``val_samples`` says how many were counted). None
        without a validation part, and under secure aggregation (per-node counts would reach the server)."""
        cfg, grid = self.cfg, self.grid
        if not cfg.val_fraction or self.secure is not None:
            return None
        cr = ConfigRecord({**dict(self._round_config(0).items()),
                           "scorer-params": json.dumps(scorer.params) if scorer is not None else ""})  # fmt: skip
        arrays = ArrayRecord({"head": Array(theta.detach().cpu().numpy())})
        msgs = [
            Message(
                RecordDict({"arrays": arrays, "config": cr}),
                dst_node_id=self.node_of[p],
                message_type="query.validate",
                group_id="validate",
            )  # fmt: skip
            for p in range(cfg.clients)
            if p in self.node_of
        ]
        pid_of = {n: p for p, n in self.node_of.items()}
        got: dict[int, tuple] = {}
        bad: set = set()
        for node, r in by_node(grid.send_and_receive(msgs, timeout=self.settings.round_timeout), msgs):
            pid = pid_of.get(node)
            if pid is None or r.has_error() or pid in bad:
                continue
            if pid in got or check_reply("validate", r, self._expect(pid)):  # a second reply: neither is used
                got.pop(pid, None)
                bad.add(pid)
                continue
            m = r.content["metrics"]
            got[pid] = (int(m["val-samples"]), int(m["val-correct"]), float(m["val-loss"]))
        n = sum(g[0] for g in got.values())
        if not n:
            return None
        correct = sum(got[p][1] for p in sorted(got))
        loss = sum(got[p][2] for p in sorted(got))
        return {"val_accuracy": correct / n, "val_loss": loss / n, "val_samples": n}

    def ccvr(self, theta: torch.Tensor, seed: int, rnd: int) -> Calibration:
        """CCVR after the last round: one ``query.ccvr`` to every node for the class statistics of its prepared
        features (:func:`fedhead.federation.clients.ccvr_client_stats`), pooled in partition order as the simulator
        pools them (the nodes that fail are the row's failures)."""
        cfg, grid = self.cfg, self.grid
        self.theta = theta
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
            for node, r in by_node(grid.send_and_receive(msgs, timeout=self.settings.round_timeout), msgs):
                pid = pid_of.get(node)
                if pid is None:
                    continue
                if r.has_error():
                    failed[pid] = short_reason(r.error.reason)
                elif pid in got or pid in failed:  # a second reply: neither is used
                    got.pop(pid, None)
                    failed[pid] = "bad ccvr reply refused: more than one reply"
                else:
                    why = check_reply("ccvr", r, self._expect(pid))
                    if why:
                        failed[pid] = why
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
        failures = _Round(failed=failed).failure_fields()
        extra = {**failures, **self._secure_bytes(cfg.clients, cfg.clients * self._head_bytes())}
        self._ccvr_nodes = len(got)
        return Calibration(pooled, up, client_ms / 1000, extra)

    # ---------------------------------------------------------------- personalisation: on the nodes, counts back

    def personalize(self, method, theta: torch.Tensor, scorer, seed: int, rnd: int, test, statistics=None,
                    solver=None, progress=None) -> PersonalCounts:  # fmt: skip
        """One ``query.personalize`` to every node (:mod:`fedhead.flower.common`): each personalises its own client
        and answers with its counts; the global head's counts are the server's own. Closed-form's beta chosen on
        validation: a second message to the nodes without a validation part, with the beta the pooled validation
        counts chose (:meth:`_pooled_beta`). Failed or bad replies: their partitions count nowhere (size 0)."""
        if self.secure is not None:  # refused by the configuration's checks; never reached
            raise FedheadError("The '--personalize' option cannot run under --secure-aggregation.")
        t0 = time.perf_counter()
        ref = self._global_counts(theta, scorer, test)
        picks = (
            method.name == "closed-form" and method.params.get("personal_beta") is None and bool(self.cfg.val_fraction)
        )
        self.refresh_nodes(self.grid)
        base = self._personal_base(method, theta, scorer, rnd, test, statistics, solver, picks)
        asked = [p for p in range(self.cfg.clients) if ref.sizes[p] or picks]  # no local test: nothing to count
        got, failed = self._personal_exchange(base, test, asked, len(BETA_GRID) if picks else 0, "personalize")
        if picks:
            self._pooled_beta(base, test, got, failed)
        if progress:
            progress(self.cfg.clients)
        sizes = ref.sizes.copy()
        correct, drift = np.zeros(len(sizes), dtype=np.int64), np.zeros(len(sizes), dtype=np.int64)
        beta = np.full(len(sizes), np.nan)
        for p, (c, d, b, _) in got.items():
            correct[p], drift[p], beta[p] = c, d, b
        sizes[sorted(failed)] = 0  # left out of every personal metric
        for p in sorted(failed):
            self.personal_failed.append({"seed": int(seed), "partition": int(p), "reason": failed[p]})
        if failed:
            LOG.log(WARNING, "[fedhead] seed %s personalisation: %s of %s nodes left out (partition %s: %s)", seed,
                    len(failed), len(asked), min(failed), failed[min(failed)])  # fmt: skip
        return PersonalCounts(sizes, correct, ref.correct_global, drift, ref.drift_global, ref.drift_size, beta,
                              time.perf_counter() - t0)  # fmt: skip

    def _global_counts(self, theta: torch.Tensor, scorer, test) -> PersonalCounts:
        """The global head's correct predictions on every local test set and the drift set, and the sets' sizes:
        ``personalize_clients`` of ``none`` on the server's test split, as the in-process transport counts them."""
        cfg, C = self.cfg, self.store.info.num_classes
        empty = [np.zeros(0, dtype=np.int64)] * cfg.clients
        data = ClientData(x=None, labels=None, parts=empty, val_parts=None, counts=np.zeros((cfg.clients, C)),
                          totals=np.zeros(C), test_x=test.x, test_y=test.y, tests=test.tests, drift=test.drift)  # fmt: skip
        return personalize_clients(create_personalizer("none"), theta, data, Setting(cfg.head, cfg.head_params, None,
                                   cfg.batch_size), scorer)  # fmt: skip

    def _personal_base(self, method, theta, scorer, rnd: int, test, statistics, solver, picks: bool) -> tuple:
        """What every node's ``query.personalize`` holds: (config, arrays) without the node's local test set."""
        if self._test_key is None:
            self._test_key = test_split_key(self.store.test_x, self.store.test_y)
        totals = np.sum([self.info[p].content["arrays"]["class-counts"].numpy() for p in sorted(self.info)], 0)
        cr = {**dict(self._round_config(rnd).items()), "personal-method": method.name,
              "personal-params": json.dumps(method.params), "personal-picks": bool(picks),
              "scorer-params": json.dumps(scorer.params) if scorer is not None else "", "test-split": self._test_key,
              "solver": solver.name if solver is not None else "",
              "solver-params": json.dumps(solver.params) if solver is not None else ""}  # fmt: skip
        arrays = {"head": Array(theta.detach().cpu().numpy()),
                  "drift": Array(np.asarray(test.drift, dtype=np.int64)),
                  "class-totals": Array(np.asarray(totals, dtype=np.int64))}  # fmt: skip
        if method.needs_statistics and statistics is not None:
            arrays.update(global_stats_record(statistics))
            cr["stats-noisy"] = bool(statistics.noisy)
        return cr, arrays

    def _personal_exchange(self, base: tuple, test, pids: list, betas: int, group: str, beta=None) -> tuple:
        """``query.personalize`` to the nodes of ``pids`` (``beta``: the one to use); returns ``{pid: (correct,
        drift, beta, val-correct or None)}`` of the good replies and ``{pid: reason}`` of the others."""
        cr = ConfigRecord({**base[0], **({"personal-beta": float(beta), "personal-picks": False} if beta else {})})
        failed = {p: "no connected SuperNode has this partition id" for p in pids if p not in self.node_of}
        msgs = [
            Message(RecordDict({"arrays": ArrayRecord({**base[1], "local-test": Array(
                np.asarray(test.tests.of(p), dtype=np.int64))}), "config": cr}), dst_node_id=self.node_of[p],
                message_type=PERSONAL_KIND, group_id=group)
            for p in pids
            if p in self.node_of
        ]  # fmt: skip
        pid_of, want, got = {n: p for p, n in self.node_of.items()}, set(pids), {}
        for node, r in by_node(self.grid.send_and_receive(msgs, timeout=self.settings.round_timeout), msgs):
            pid = pid_of.get(node)
            if pid is None or pid not in want:
                continue
            if pid in got or pid in failed:  # a second reply: neither is used
                got.pop(pid, None)
                failed[pid] = "bad personalize reply refused: more than one reply"
                continue
            if r.has_error():
                failed[pid] = short_reason(r.error.reason)
                continue
            expect = self._expect(pid, tests=len(test.tests.of(pid)), drift=len(test.drift), betas=betas)
            why = check_reply("personalize", r, expect)
            if why:
                failed[pid] = why
                continue
            m = r.content["metrics"]
            val = r.content["arrays"]["val-correct"].numpy() if betas else None
            got[pid] = (int(m["correct"]), int(m["drift"]), float(m.get("beta", float("nan"))), val)
        for p in pids:
            if p not in got and p not in failed:
                failed[p] = f"no reply within {self.settings.round_timeout:g} s"
        return got, failed

    def _pooled_beta(self, base: tuple, test, got: dict, failed: dict) -> None:
        """Closed-form's beta for the clients without a validation part: the one the pooled validation counts of
        the others chose (the in-process rule); their nodes answered with beta 1 (what the in-process transport
        uses when no client has a validation part) and are asked again with it unless it is 1 (``got`` and
        ``failed`` updated in place)."""
        own = {p: v[3] for p, v in got.items() if v[3][0] >= 0}
        if not own:  # no validation part anywhere: beta 1 for every client, as answered
            return
        beta = BETA_GRID[beta_choice(np.sum([own[p] for p in sorted(own)], 0))]
        rest = sorted(p for p in got if p not in own)
        if not rest or beta == BETA_DEFAULT:
            return
        again, bad = self._personal_exchange(base, test, rest, 0, "personalize-beta", beta)
        for p in rest:
            got.pop(p)
            if p in again:
                got[p] = again[p]
            else:
                failed[p] = bad[p]

    def after_round(self, seed: int, rnd: int, last_round: int, row: dict) -> None:
        """Log the round; a signal (``fedhead flower simulate``) stops the server here, after the round's
        checkpoint."""
        failed = f", {row['failures']} failed ({row['failure_reason']})" if row.get("failures") else ""
        if row.get("stage") == "ccvr":
            LOG.log(INFO, "[fedhead] seed %s CCVR calibration: accuracy %.4f from %s nodes%s", seed,
                    row["accuracy"], getattr(self, "_ccvr_nodes", 0), failed)  # fmt: skip
            return
        LOG.log(INFO, "[fedhead] seed %s round %s/%s: accuracy %.4f, %s clients trained%s", seed, rnd, last_round,
                row["accuracy"], row.get("clients_trained", 0), failed)  # fmt: skip
        raise_if_stopped()  # a signal during `flower simulate`: stop at this consistent point

    def unit_state(self) -> dict:
        return {
            "variates": self.variates.state_dict() if self.variates is not None else None,
            "residuals": self.residual_tags.state_dict() if self.residual_tags is not None else None,
        }

    def load_unit_state(self, state: dict) -> None:
        """A resumed seed: which version of ``c_k`` each node trains from. A resumed server is a new Flower run:
        its nodes start with an empty Context.state and find their variates only in a state folder (error feedback's
        residuals likewise: a node that lost its own starts from zero)."""
        r = state.get("residuals")
        if self.residual_tags is not None and r is not None:
            self.residual_tags.accepted[:] = r["accepted"]
            self.residual_tags.run = str(r.get("run", ""))
        v = state.get("variates")
        if self.variates is None or v is None:
            return
        self.variates.accepted[:] = v["accepted"]
        self.variates.generation = int(v["generation"])
        self.variates.restarts = list(v.get("restarts", []))
        self.variates.run = str(v.get("run", ""))
        lost = [p for p in range(self.cfg.clients) if self.variates.lost(p, self.info[p])]
        if lost:
            self.lost_variates = (
                f"the nodes of partitions {lost} no longer hold their control variates (the server resumed in a new "
                "Flower run)"
            )

    def run_state(self) -> dict:
        return {"scaffold_restarts": list(self.restarts)}

    def load_run_state(self, state: dict) -> None:
        self.restarts = list(state.get("scaffold_restarts", []))

    def summary_fields(self, rows: list[dict]) -> dict:
        out = {"runtime": "flower", "failures": int(sum(int(r.get("failures") or 0) for r in rows))}
        if self.cfg.scaffold:
            out["scaffold_restarts"] = [{"seed": int(s), "round": int(r)} for s, r in self.restarts]
        if self.secure is not None:
            out["secure_aggregation"] = self.secure.summary()
        if self.refused:
            out["refused_nodes"] = [{"node": int(n), "reason": why} for n, why in sorted(self.refused.items())]
        if self.refused_stats:
            out["refused_statistics"] = list(self.refused_stats)
        if self.personal_failed:
            out["personal_failures"] = list(self.personal_failed)
        return out

    # ---------------------------------------------------------------- the run: the one round loop over this transport

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
        """Run the configuration through :func:`fedhead.federation.loop.run_job` with this strategy as its
        transport, in the run directory ``settings.out`` (Flower's own ``Strategy.start`` always begins at round
        1; this one resumes from the checkpoint)."""
        st = self.settings
        self.grid = grid
        if timeout is not None:
            st.round_timeout = timeout
        if num_rounds:
            self.cfg = replace(self.cfg, rounds=int(num_rounds))
        cfg = self.cfg
        run_dir = Path(st.out) if st.out else default_run_dir(st.runs_root, "flower", cfg.head, cfg.partition)
        run = flower_run_dir(cfg, self.store, run_dir, st.resume)

        def record(opened) -> dict:
            if opened.kind == "resume":
                ck = opened.checkpoint
                LOG.log(INFO, "[fedhead] resuming %s after round %s of seed %s", run_dir, ck["current"]["round"],
                        ck["seed"])  # fmt: skip
            self.summary()
            return {**run_record(cfg, self.store, self.device, "flower"), "flower_version": _flwr_version(),
                    "round_timeout_s": st.round_timeout}  # fmt: skip

        summary, rows = run_head(cfg, self.store, self, run, record, progress=False)
        return RunOutcome(run_dir, summary, rows)


def flower_run_dir(cfg: TrainConfig, store: Features, run_dir: Path, resume: bool) -> RunDir:
    """The run directory of a Flower server: resumed with ``resume``; a restarted server that finds nothing saved
    starts afresh; more rounds for a finished run are refused (its nodes' state is gone)."""
    return head_run_dir(cfg, store, run_dir, resume, out_param="out", resume_param="resume", restart_ok=True)


def _flwr_version() -> str:
    try:
        from importlib.metadata import version

        return version("flwr")
    except Exception:  # noqa: BLE001
        return "unknown"
