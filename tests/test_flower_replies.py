"""Node replies as untrusted input (issue 42, finding 2): a malformed or lying reply is the failure of its node's
partition (rounds.csv's failure columns, with the reason), the round goes on with the others; a second node
claiming a partition already held is refused, never given that partition's messages.

Each case runs the real ServerApp strategy and ClientApp over tests/test_flower_sim.py's in-process grid, with one
node's replies tampered with after its ClientApp made them (:class:`TamperGrid`)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from test_flower_sim import LocalGrid, accs, cfg_of, local_run, sim_nodes, task_identity  # noqa: E402,F401

from fedhead.core.synthetic import write_synthetic  # noqa: E402
from fedhead.federation.rundir import read_csv  # noqa: E402
from fedhead.flower.client_app import make_client_app  # noqa: E402
from fedhead.flower.server_app import run_server  # noqa: E402
from fedhead.flower.strategy import ServerSettings  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic(
        tmp_path_factory.mktemp("flower-replies") / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16
    )


def rebuilt(reply: Message, arrays=None, metrics=None, request: Message | None = None) -> Message:
    """``reply`` with its arrays / metrics replaced by the functions' results on their dicts."""
    c = reply.content
    a = {k: v for k, v in c["arrays"].items()} if "arrays" in c.array_records else {}
    m = dict(c["metrics"].items()) if "metrics" in c.metric_records else {}
    if arrays:
        a = arrays(a)
    if metrics:
        m = metrics(m)
    content = {"arrays": ArrayRecord(a), "metrics": MetricRecord(m)}
    if "config" in c.config_records:
        content["config"] = ConfigRecord(dict(c["config"].items()))
    return Message(RecordDict(content), reply_to=request)


class TamperGrid(LocalGrid):
    """The in-process grid, with ``tamper(kind, round, pid, request, reply) -> reply`` applied to every reply; a
    log of the message kinds each node received (``got``)."""

    def __init__(self, app, nodes, tamper=None):
        super().__init__(app, nodes)
        self.tamper = tamper
        self.got: dict = {}

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        out = []
        for m in messages:
            (r,) = super().send_and_receive([m], timeout=timeout)
            node = m.metadata.dst_node_id
            self.got.setdefault(node, []).append((m.metadata.message_type, m.metadata.group_id))
            if self.tamper is not None and not r.has_error():
                pid = int(self.ctx[node].node_config["partition-id"])
                r = self.tamper(m.metadata.message_type, m.metadata.group_id, pid, m, r)
            out.append(r)
        return out


def tampered_run(cfg, out, tamper=None, nodes=None, grid_cls=TamperGrid):
    grid = grid_cls(make_client_app(str(cfg.features)), nodes or sim_nodes(cfg.clients), tamper)
    res = run_server(grid, cfg, ServerSettings(out=str(out), wait_timeout=3))
    return grid, res, read_csv(out / "rounds.csv")


def test_a_wrongly_shaped_train_reply_is_its_partitions_failure(store, tmp_path):
    """Finding: one train reply of the wrong shape aborted the whole run (torch.stack over the replies)."""

    def tamper(kind, group, pid, m, r):
        if kind == "train" and group == "2" and pid == 1:
            return rebuilt(r, arrays=lambda a: {**a, "msg.weighted": Array(a["msg.weighted"].numpy()[:, :-1].copy())},
                           request=m)  # fmt: skip
        return r

    _, res, rows = tampered_run(cfg_of(store), tmp_path / "r", tamper)
    assert [r["failed_clients"] for r in rows] == ["", "1", ""]
    assert [r["clients_trained"] for r in rows] == ["4", "3", "4"]
    assert "msg.weighted" in rows[1]["failure_reason"] and "refused" in rows[1]["failure_reason"]
    assert res.summary["failures"] == 1 and all(np.isfinite(accs(res.rows)))


def test_a_node_claiming_1e12_samples_is_refused(store, tmp_path):
    """Finding: a node claiming 10^12 samples with its update scaled to match replaced the model (FedAvg weighs by
    the claim), with no failure recorded: its count must be what its partition reported first."""
    plain = local_run(cfg_of(store), tmp_path / "plain")

    def tamper(kind, group, pid, m, r):
        if kind == "train" and pid == 0:
            w = m.content["arrays"]["head"].numpy()
            poison = (-50.0 * w).astype(np.float32) * 1e12  # n_k W_k of a head 50 times the server's, flipped
            return rebuilt(r, arrays=lambda a: {**a, "msg.weighted": Array(poison)},
                           metrics=lambda d: {**d, "num-examples": 10**12}, request=m)  # fmt: skip
        return r

    _, res, rows = tampered_run(cfg_of(store), tmp_path / "r", tamper)
    assert [r["failed_clients"] for r in rows] == ["0", "0", "0"]
    assert all("num-examples 1000000000000" in r["failure_reason"] for r in rows)
    assert accs(res.rows)[-1] > accs(plain.rows)[-1] - 0.15  # three clients' model, not the poisoned one


def test_a_second_node_claiming_a_held_partition_before_round_1_is_refused(store, tmp_path):
    """Finding: a node claiming a partition id another node holds aborted the run before round 1. It is refused;
    the run is the plain one and the intruder gets no train message."""
    cfg = cfg_of(store)
    plain = local_run(cfg, tmp_path / "plain")
    nodes = [*sim_nodes(4), {"partition-id": 2, "num-partitions": 4}]
    grid, res, rows = tampered_run(cfg, tmp_path / "r", nodes=nodes)
    assert accs(res.rows) == accs(plain.rows) and all(r["failures"] == "0" for r in rows)
    assert {kind for kind, _ in grid.got[1004]} == {"query"}
    assert res.summary["refused_nodes"] == [{"node": 1004, "reason": res.summary["refused_nodes"][0]["reason"]}]
    assert "partition-id 2" in res.summary["refused_nodes"][0]["reason"]


class LateIntruder(TamperGrid):
    """A fifth node, claiming partition 2 (held by node 1002), joins after round 1."""

    def __init__(self, app, nodes, tamper=None):
        super().__init__(app, nodes, tamper)
        self.intruder = {n: c for n, c in self.ctx.items() if n == 1004}
        self.ctx = {n: c for n, c in self.ctx.items() if n != 1004}

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if messages and messages[0].metadata.group_id == "1":
            self.ctx.update(self.intruder)  # it registers while round 1 runs
        return super().send_and_receive(messages, timeout=timeout)


def test_a_node_claiming_a_held_partition_after_round_1_gets_none_of_its_messages(store, tmp_path):
    """Finding: a node joining after round 1 with a held partition id silently received that partition's
    messages (the server re-routed the partition to it)."""
    cfg = cfg_of(store)
    plain = local_run(cfg, tmp_path / "plain")
    nodes = [*sim_nodes(4), {"partition-id": 2, "num-partitions": 4}]
    grid, res, rows = tampered_run(cfg, tmp_path / "r", nodes=nodes, grid_cls=LateIntruder)
    assert {kind for kind, _ in grid.got[1004]} == {"query"}
    assert [g for kind, g in grid.got[1002] if kind == "train"] == ["1", "2", "3"]
    assert accs(res.rows) == accs(plain.rows)


def test_malformed_closed_form_statistics_are_that_partitions_failure(store, tmp_path):
    """Finding: malformed statistics in one node's reply aborted the run (a reshape in the server's sum)."""

    def tamper(kind, group, pid, m, r):
        if kind == "query" and pid == 1 and "cf-sums" in r.content["arrays"]:
            return rebuilt(r, arrays=lambda a: {**a, "cf-sums": Array(np.zeros(7))}, request=m)
        return r

    _, res, rows = tampered_run(cfg_of(store, head="ridge"), tmp_path / "r", tamper)
    assert [r["failed_clients"] for r in rows] == ["1"] and rows[0]["clients_trained"] == "3"
    assert "cf-sums" in rows[0]["failure_reason"] and np.isfinite(accs(res.rows)).all()


def test_non_finite_feature_statistics_are_left_out(store, tmp_path):
    """A node's feature sum with a nan made the federated mean nan (every prepared feature nan, no failure
    recorded): its statistics are left out and the refusal is in summary.json."""

    def tamper(kind, group, pid, m, r):
        if kind == "query" and pid == 3 and "feature-sum" in r.content["arrays"]:
            return rebuilt(r, arrays=lambda a: {**a, "feature-sum": Array(np.full(16, np.nan))}, request=m)
        return r

    _, res, rows = tampered_run(cfg_of(store), tmp_path / "r", tamper)
    assert np.isfinite(accs(res.rows)).all() and accs(res.rows)[-1] > 0.3
    assert any("feature-sum" in r["reason"] for r in res.summary["refused_statistics"])


def test_a_malformed_ccvr_reply_is_that_partitions_failure(store, tmp_path):
    """Finding: a CCVR reply that is no whole number of class records aborted the run after its last round."""

    def tamper(kind, group, pid, m, r):
        if group == "ccvr" and pid == 3:
            blob = r.content["arrays"]["ccvr-stats"].numpy()
            return rebuilt(r, arrays=lambda a: {**a, "ccvr-stats": Array(blob[:-1].copy())}, request=m)
        return r

    _, res, rows = tampered_run(cfg_of(store, calibrate="ccvr"), tmp_path / "r", tamper)
    assert rows[-1]["stage"] == "ccvr" and rows[-1]["failed_clients"] == "3"
    assert "ccvr-stats" in rows[-1]["failure_reason"]


def test_a_rejoining_node_must_report_its_partitions_counts(store, tmp_path):
    """A node that takes over a partition whose node left must report the counts that partition reported first;
    one that does not is refused (the partition stays a failure), never given the partition's messages."""

    class Rejoin(TamperGrid):
        def __init__(self, app, nodes, tamper=None):
            super().__init__(app, nodes, tamper)
            self.spare = {n: c for n, c in self.ctx.items() if n == 1004}
            self.ctx = {n: c for n, c in self.ctx.items() if n != 1004}

        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if messages and messages[0].metadata.group_id == "1":
                self.ctx.pop(1002)  # partition 2's node leaves during round 1, another one claims it
                self.ctx.update(self.spare)
            return super().send_and_receive(messages, timeout=timeout)

    def tamper(kind, group, pid, m, r):
        if kind == "query" and m.metadata.dst_node_id == 1004:
            return rebuilt(r, metrics=lambda d: {**d, "num-examples": d["num-examples"] + 1}, request=m)
        return r

    nodes = [*sim_nodes(4), {"partition-id": 2, "num-partitions": 4}]
    grid, res, rows = tampered_run(cfg_of(store), tmp_path / "r", tamper, nodes=nodes, grid_cls=Rejoin)
    assert {kind for kind, _ in grid.got[1004]} == {"query"}
    assert [r["failed_clients"] for r in rows] == ["2", "2", "2"]


def test_a_masked_vector_of_the_wrong_shape_is_that_nodes_dropout(store, tmp_path):
    """Under SecAgg+ the server cannot read a node's vector, only its shape: one of the wrong length aborted the run
    (Flower's workflow adds the masked vectors); it is now that node's failure, recovered as a dropout (threshold 3
    of 4), and the round equals a plain round without the node."""
    from flwr.common import bytes_to_ndarray, ndarray_to_bytes
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
    from test_flower_secure import WireGrid, assert_same_within_quantisation

    class ShortVector(WireGrid):
        def send_and_receive(self, messages, *, timeout=None):
            out = super().send_and_receive(messages, timeout=timeout)
            for r in out:
                cr = r.content.config_records.get(RECORD_KEY_CONFIGS) if not r.has_error() else None
                if cr is not None and Key.MASKED_PARAMETERS in cr and r.metadata.src_node_id == 1002:
                    if r.metadata.group_id == "2":
                        got = list(cr[Key.MASKED_PARAMETERS])
                        cr[Key.MASKED_PARAMETERS] = [got[0], ndarray_to_bytes(bytes_to_ndarray(got[1])[:-1])]
            return out

    def run(cfg, out, grid_cls, **kw):
        grid = grid_cls(make_client_app(str(cfg.features)), sim_nodes(cfg.clients), **kw)
        return run_server(grid, cfg, ServerSettings(out=str(out), wait_timeout=5))

    class Missing(WireGrid):  # the plain reference: partition 2's reply lost in round 2
        def send_and_receive(self, messages, *, timeout=None):
            out = super().send_and_receive(messages, timeout=timeout)
            return [r for r in out if not (r.metadata.src_node_id == 1002 and r.metadata.group_id == "2")]

    plain = run(cfg_of(store, val_fraction=0.0), tmp_path / "plain", Missing)  # SecAgg+ holds none out
    sec = run(cfg_of(store, secure_aggregation=True), tmp_path / "secure", ShortVector)
    rows = read_csv(tmp_path / "secure" / "rounds.csv")
    assert [r["failed_clients"] for r in rows] == ["", "2", ""]
    assert "bad masked vector refused" in rows[1]["failure_reason"]
    assert_same_within_quantisation(sec, plain, tmp_path / "secure", tmp_path / "plain")
