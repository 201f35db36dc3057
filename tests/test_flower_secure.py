"""Secure aggregation on Flower (``--secure-aggregation``, fedhead.flower.secure): Flower's SecAgg+ between the real
ServerApp strategy and ClientApp, in process over tests/test_flower_sim.py's ``LocalGrid``, with every message
serialised as a transport would (the protocol's nodes must not share message objects).

Tolerance. fedhead rounds every value to a multiple of 2^-24 (training rounds) or 2^-36 (statistics) before
SecAgg+, deterministically; the secure sum is then exact, so it differs from a plain run's float64 sum by at most
K 2^-25 per value (K clients): for FedAvg's n_k W_k about 1e-7 on the sum and 1e-9 on the averaged head, below the
float32 head's own resolution. A test sample's prediction can flip only if its top two scores are that close, so
the per-round accuracies must agree to one test sample (1/60 here; they agree exactly in practice) and the heads
to 1e-5."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")

from flower_hooks import CRASH_ENV, crash_env  # noqa: E402 (the tests' hooks, installed here)
from flwr.app import Message, MessageType  # noqa: E402
from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.quantization import quantize  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto  # noqa: E402
from test_flower_deploy import TIMEOUT, deployment, free_ports, node_stores, superlink_argv, supernode_argv  # noqa: E402,F401
from test_flower_sim import LocalGrid, accs, cfg_of, sim_nodes, task_identity, unavailable  # noqa: E402,F401

import fedhead  # noqa: E402
import fedhead.flower.client_app as client_app  # noqa: E402
import fedhead.flower.node as node_module  # noqa: E402
import fedhead.flower.secure as secure  # noqa: E402
from extract.store import load_store  # noqa: E402
from fedhead.core.synthetic import write_synthetic  # noqa: E402
from fedhead.federation.rundir import read_csv  # noqa: E402
from fedhead.flower.secure import (
    CLIPPING_RANGE,
    MODULUS_RANGE,
    QUANTIZATION_RANGE,
    FixedPoint,  # noqa: E402
    protocol_params,
)
from fedhead.flower.server_app import run_server  # noqa: E402
from fedhead.flower.strategy import ServerSettings  # noqa: E402
from fedhead.infra.errors import FedheadError  # noqa: E402

N_TEST = 60  # 6 classes x 10 test samples: one sample is 1/60 of accuracy


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic(
        tmp_path_factory.mktemp("flower-secure") / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16
    )


class WireGrid(LocalGrid):
    """LocalGrid with every message and reply serialised and parsed (as on the wire). ``seen`` keeps what the
    server received: ``(message type, stage, round, node, reply content)``; ``drop`` = {(stage, round, node)}
    makes those messages go unanswered (a node lost at that point of the protocol); ``gone`` (same form) makes the
    SuperLink answer them itself, as it does once the node's heartbeats stopped (Flower's NODE_UNAVAILABLE)."""

    def __init__(self, *a, drop=(), gone=(), **k):
        super().__init__(*a, **k)
        self.seen, self.drop, self.gone = [], set(drop), set(gone)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for m in messages:
            content = recorddict_from_proto(recorddict_to_proto(m.content))
            stage = (
                str(content.config_records[RECORD_KEY_CONFIGS][Key.STAGE])
                if RECORD_KEY_CONFIGS in content.config_records
                else ""
            )
            node = m.metadata.dst_node_id
            if (stage, m.metadata.group_id, node) in self.drop:
                continue
            if (stage, m.metadata.group_id, node) in self.gone:
                out.append(unavailable(m))
                continue
            wire = Message(
                content, dst_node_id=node, message_type=m.metadata.message_type, group_id=m.metadata.group_id
            )
            for r in super().send_and_receive([wire], timeout=timeout):
                if not r.has_error():
                    r = Message(recorddict_from_proto(recorddict_to_proto(r.content)), reply_to=wire)
                self.seen.append(
                    (m.metadata.message_type, stage, m.metadata.group_id, node, None if r.has_error() else r.content)
                )
                out.append(r)
        return out


def run(cfg, out, **grid_kw):
    grid = WireGrid(client_app.make_client_app(str(cfg.features)), sim_nodes(cfg.clients), **grid_kw)
    return run_server(grid, cfg, ServerSettings(out=str(out), wait_timeout=5)), grid


def assert_same_within_quantisation(secure_res, plain_res, out_s, out_p):
    a, b = accs(secure_res.rows), accs(plain_res.rows)
    assert len(a) == len(b)
    assert np.abs(np.array(a) - np.array(b)).max() <= 1 / N_TEST + 1e-12, (a, b)
    for rs, rp in zip(secure_res.rows, plain_res.rows):
        assert rs["stage"] == rp["stage"] and rs["clients_trained"] == rp["clients_trained"]
        if rp["train_loss"] == rp["train_loss"]:
            assert rs["train_loss"] == pytest.approx(rp["train_loss"], rel=1e-6)
    torch.testing.assert_close(
        torch.load(out_s / "head-seed0.pt"), torch.load(out_p / "head-seed0.pt"), atol=1e-5, rtol=1e-5
    )


# ---------------------------------------------------------------- fixed point (exact numbers)


def test_fixed_point_digits_and_sums_by_hand():
    f0 = FixedPoint(0, 2)  # integers, two base-2^30 digits, lowest block first
    np.testing.assert_array_equal(f0.encode(np.array([2.0**30 + 5, -(2.0**30) - 7, 3.0])), [5, -7, 3, 1, -1, 0])
    np.testing.assert_array_equal(f0.decode(np.array([5 - 7 + 3, 1 - 1 + 0])), [1.0])  # one value, three clients
    f = FixedPoint(24, 2)
    xs = [np.array([0.1, -2.5, 1e6, 3e-9]), np.array([0.2, 2.5, -1e6, 0.0]), np.array([-0.3, 1.0, 7.0, 1e-9])]
    digits = [f.encode(x) for x in xs]
    assert all(np.abs(d).max() <= 2**29 and np.array_equal(d, np.rint(d)) for d in digits)
    total = f.decode(np.sum(digits, 0))
    np.testing.assert_allclose(total, np.sum(xs, 0), rtol=0, atol=3 * f.step / 2)  # K x half a step
    # exactly the sum of the rounded values (each x rounded to a multiple of 2^-24)
    np.testing.assert_array_equal(total, np.sum([np.rint(x * 2**24) for x in xs], 0) / 2**24)
    # Flower's quantiser with fedhead's ranges is the identity on a digit (shifted by 2^29): nothing more is lost
    q = quantize([digits[0]], CLIPPING_RANGE, QUANTIZATION_RANGE)[0]
    np.testing.assert_array_equal(q, digits[0] + 2**29)
    with pytest.raises(FedheadError, match="fixed-point range"):
        f.encode(np.array([1.0, 2.0**35]))
    with pytest.raises(FedheadError, match="non-finite"):
        f.encode(np.array([np.nan]))
    assert (secure.STATS_FORMAT.bound, secure.STATS_FORMAT.step) == (2.0**53, 2.0**-36)


def test_protocol_parameters():
    assert [protocol_params(n) for n in (3, 4, 5, 32)] == [(1.0, 2), (1.0, 3), (1.0, 3), (1.0, 17)]
    assert protocol_params(100) == (29, 15) and protocol_params(1000) == (41, 21)


# ---------------------------------------------------------------- a secure run == the plain run


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # ova2, centred features
        dict(head="ridge"),
        dict(head="softmax", init="ridge", center=True, rounds=2),
        dict(head="cof", partition="dirichlet", partition_params={"alpha": 0.3, "min_size": 2}),
        dict(calibrate="ccvr", rounds=2),
        dict(scaffold=True, aggregate="grouped", participation=0.75, rounds=3),
        # DP with SecAgg+: the server adds the noise to the secure sum (the same keyed draw)
        dict(participation=0.75, dp_noise_multiplier=0.8, dp_clip=0.3, dp_delta=1e-4, dp_feature_clip=2.0),
        dict(head="ridge", dp_noise_multiplier=0.8, dp_clip=2.0, dp_delta=1e-4),
    ],
    ids=["ova2", "ridge", "init-ridge", "cof", "ccvr", "scaffold-grouped", "dp-ova2", "dp-ridge"],
)
def test_secure_run_matches_plain_run(store, tmp_path, kw):
    # no validation part under SecAgg+ (a node's counts would reach the server): the plain run holds none out either
    plain, _ = run(cfg_of(store, val_fraction=0.0, **kw), tmp_path / "plain")
    sec, grid = run(cfg_of(store, secure_aggregation=True, **kw), tmp_path / "secure")
    assert_same_within_quantisation(sec, plain, tmp_path / "secure", tmp_path / "plain")
    summary = json.loads((tmp_path / "secure" / "summary.json").read_text())
    kinds = [e["kind"] for e in summary["secure_aggregation"]["exchanges"]]
    assert kinds[0] == "census" and all(e["halted"] == "" for e in summary["secure_aggregation"]["exchanges"])
    if kw.get("head") in ("ridge", "cof") or kw.get("init"):
        assert "statistics" in kinds and (kw.get("head") != "cof" or "cof-spread" in kinds)
    assert ("ccvr" in kinds) == (kw.get("calibrate") == "ccvr")
    # SecAgg+ really ran: every training round went through its four stages, and cost more bytes than plain
    stages = {s for t, s, *_ in grid.seen if t == MessageType.TRAIN}
    assert stages == {"setup", "share_keys", "collect_masked_vectors", "unmask"}
    assert all(float(s["bytes_total"]) > float(p["bytes_total"]) for s, p in zip(sec.rows, plain.rows))
    assert not (tmp_path / "secure" / "clients.csv").exists() and (tmp_path / "plain" / "clients.csv").exists()
    assert summary["realised_noise_rate"] == plain.summary["realised_noise_rate"]
    if kw.get("dp_noise_multiplier"):
        assert [r["dp_epsilon"] for r in sec.rows] == [r["dp_epsilon"] for r in plain.rows]
        assert summary["dp_epsilon"] == plain.summary["dp_epsilon"] > 0
    # the Flower server writes each run's model too (HeadJob.finish), with the feature statistics it learnt through
    # SecAgg+: loaded again, it gives the run's own count of correct test predictions
    s = load_store(store)
    for out, res in (("plain", plain), ("secure", sec)):
        m = fedhead.load_model(tmp_path / out)
        correct = int((m.predict(s.test_x) == m.classes_[s.test_y]).sum())
        assert correct == m.card["metrics"]["test_correct"] == round(res.summary["final_accuracy"] * len(s.test_y))
        assert m.card["features"]["centered"] == (m.stats.mean is not None)


@pytest.mark.parametrize(
    "kw,per_node,match",
    [
        # CCVR: every class's counts, sums and second moments, C (D(D+1)/2 + D + 1) + 1 values
        (
            dict(calibrate="ccvr"),
            6 + 6 * 16 + 6 * 16 * 17 // 2 + 1,
            r"'--calibrate' option 'ccvr' with .* masked class moments \(4 nodes x 22,056 bytes: 6 classes.*Drop --calibrate",
        ),
        # ridge: class sums, counts, holders and the Gram's upper triangle, C D + 2 C + 1 + (D+1)(D+2)/2 values
        (
            dict(head="ridge"),
            6 * 16 + 2 * 6 + 1 + 17 * 18 // 2,
            r"'--head' 'ridge' with .* masked statistics \(4 nodes x 6,288 bytes: 17x17 Gram.*Use a head without",
        ),
    ],
    ids=["ccvr", "ridge"],
)
def test_an_exchange_that_cannot_fit_the_server_memory_is_refused_before_round_1(
    store, tmp_path, monkeypatch, kw, per_node, match
):
    """SecAgg+ sums dense vectors of 3 int64 digits per value and the server receives one from each node of an
    exchange: above the machine's free memory the run stops before training, in one line; at it, it runs."""
    import fedhead.infra.devices as util

    cfg = cfg_of(store, secure_aggregation=True, **kw, **({} if kw.get("head") == "ridge" else {"rounds": 2}))
    need = per_node * 3 * 8 * cfg.clients  # CCVR asks every node; ridge the round's sample
    monkeypatch.setattr(util, "available_memory", lambda: need - 1)
    with pytest.raises(FedheadError, match=match):
        run(cfg, tmp_path / "refused")
    assert not (tmp_path / "refused" / "rounds.csv").exists()
    monkeypatch.setattr(util, "available_memory", lambda: need)
    res, _ = run(cfg, tmp_path / "fits")
    assert len(res.rows) >= 1


# ---------------------------------------------------------------- what the server sees


def test_server_receives_masked_vectors_not_the_clients_messages(store, tmp_path, monkeypatch):
    true, sums = {}, []
    reply = node_module.secure_reply

    def spy_reply(msg, vector):  # the node side: the digits it is about to mask
        true[(msg.metadata.group_id, msg.metadata.dst_node_id)] = vector.copy()
        return reply(msg, vector)

    secure_sum = secure.secure_sum

    def spy_sum(grid, messages, kind, layout, rnd, timeout):  # the server side: what it made of them
        res = secure_sum(grid, messages, kind, layout, rnd, timeout)
        sums.append((kind, str(rnd), layout, res))
        return res

    monkeypatch.setattr(node_module, "secure_reply", spy_reply)
    monkeypatch.setattr(secure, "secure_sum", spy_sum)
    res, grid = run(cfg_of(store, secure_aggregation=True, rounds=2), tmp_path / "r")
    assert res.rows[-1]["clients_trained"] == 4

    # the query reply names the node's partition and nothing else (no size, class counts or statistics)
    for t, _, _, _, content in grid.seen:
        if t == MessageType.QUERY:
            assert set(content["metrics"].keys()) == {"partition-id"} and not content.array_records

    node = 1001  # one client, round 2: what the server received from it
    got = [c for t, s, g, n, c in grid.seen if s == "collect_masked_vectors" and g == "2" and n == node]
    assert len(got) == 1
    content = got[0]
    masked = [bytes_to_ndarray(b) for b in content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
    assert all(len(rec) == 0 for rec in content.array_records.values())  # the parameters were cleared
    assert set(content.metric_records) <= {"fitres.num_examples", secure.METRICS}
    assert content.metric_records["fitres.num_examples"]["num_examples"] == 1  # weight 1, not n_k
    digits = true[("2", node)]
    quantised = digits.astype(np.int64) + 2**29  # what Flower's quantiser made of them (exact)
    assert masked[1].shape == quantised.shape
    diff = (masked[1] - quantised) % MODULUS_RANGE
    assert np.mean(diff != 0) > 0.99  # every entry carries a mask ...
    assert 0.3 < masked[1].mean() / MODULUS_RANGE < 0.7  # ... uniform over Z_(2^62): it tells nothing of the digits
    assert np.abs(quantised).max() < 2**31
    # yet the server's sum is exactly the clients' true sum
    kind, rnd, layout, r2 = next(x for x in sums if x[0] == "train" and x[1] == "2")
    total = layout.decode(np.sum([true[("2", n)] for n in r2.included], 0))
    for name, v in r2.sums.items():
        np.testing.assert_array_equal(v, total[name])
    # and the sum is not this client's message
    mine = layout.decode(digits)
    assert not np.allclose(mine["msg.weighted"], r2.sums["msg.weighted"])


# ---------------------------------------------------------------- dropouts


def test_one_dropout_of_four_is_recovered(store, tmp_path, monkeypatch):
    """Partition 2 crashes in round 2 after the keys were shared: SecAgg+ removes its pairwise masks from the shares
    of the others (threshold 3 of 4) and the round equals a plain round without partition 2."""
    monkeypatch.setenv(CRASH_ENV, "2@2")
    plain, _ = run(cfg_of(store, val_fraction=0.0), tmp_path / "plain")  # SecAgg+ holds no validation part
    sec, _ = run(cfg_of(store, secure_aggregation=True), tmp_path / "secure")
    assert_same_within_quantisation(sec, plain, tmp_path / "secure", tmp_path / "plain")
    rows = read_csv(tmp_path / "secure" / "rounds.csv")
    assert [r["failures"] for r in rows] == ["0", "1", "0"] and rows[1]["clients_trained"] == "3"
    assert rows[1]["failed_clients"] == "2"
    assert "injected crash of partition 2 in round 2" in rows[1]["failure_reason"]
    assert "SecAgg+ stage collect_masked_vectors" in rows[1]["failure_reason"]


def test_dropouts_below_the_threshold_fail_the_round(store, tmp_path, monkeypatch):
    monkeypatch.setenv(CRASH_ENV, "1@2,2@2")
    sec, _ = run(cfg_of(store, secure_aggregation=True), tmp_path / "secure")
    rows = read_csv(tmp_path / "secure" / "rounds.csv")
    assert [r["clients_trained"] for r in rows] == ["4", "0", "4"]
    assert rows[1]["failures"] == "4" and rows[1]["failed_clients"] == "0 1 2 3"
    reason = rows[1]["failure_reason"]
    assert "2 of 4 nodes sent their masked vectors, fewer than the reconstruction threshold 3" in reason
    assert "injected crash of partition 1 in round 2" in reason
    assert rows[1]["accuracy"] == rows[0]["accuracy"]  # no update reached the head
    assert sec.summary["secure_aggregation"]["exchanges"][2]["halted"] == reason


@pytest.mark.parametrize("how, reason", [("drop", "no reply within"), ("gone", "Node Unavailable")])
def test_node_lost_before_masking_is_left_out_and_the_protocol_restarts(store, tmp_path, monkeypatch, how, reason):
    """Flower's unmask stage cannot recover a node lost before it shared its keys (it asks the others for shares
    that were never made): fedhead restarts the round's protocol without it. The round equals a plain round
    without that node. The node's message goes unanswered (``drop``) or the SuperLink answers it itself
    (``gone``: the reply names the SuperLink as its sender, and the failure is still the node's)."""
    monkeypatch.setenv(CRASH_ENV, "3@2")
    plain, _ = run(cfg_of(store, val_fraction=0.0), tmp_path / "plain")  # SecAgg+ holds no validation part
    monkeypatch.delenv(CRASH_ENV)
    sec, grid = run(cfg_of(store, secure_aggregation=True), tmp_path / "secure", **{how: {("setup", "2", 1003)}})
    assert_same_within_quantisation(sec, plain, tmp_path / "secure", tmp_path / "plain")
    rows = read_csv(tmp_path / "secure" / "rounds.csv")
    assert [r["clients_trained"] for r in rows] == ["4", "3", "4"]
    assert rows[1]["failed_clients"] == "3" and reason in rows[1]["failure_reason"]
    assert "(SecAgg+ stage setup)" in rows[1]["failure_reason"]
    ex = sec.summary["secure_aggregation"]["exchanges"][2]
    assert (ex["round"], ex["restarts"], ex["included"]) == (2, 1, 3)


# ---------------------------------------------------------------- real processes


@pytest.mark.slow
def test_secure_aggregation_on_a_loopback_deployment(tmp_path, deployment):  # noqa: F811 - the imported fixture
    """The commands of DEPLOY.md with --secure-aggregation: a SuperLink and three SuperNodes as processes (Flower's
    subprocess isolation: the SecAgg+ state of a node lives in its Context.state between messages); node 1
    crashes in round 1 after the keys were shared and the round completes with the other two (about 3 minutes
    on 2 cores: every stage's message starts a ClientApp process on each node)."""
    server, stores = node_stores(tmp_path, 3)
    link_port, control_port, *node_ports = free_ports(5)
    out = tmp_path / "run"
    d = deployment
    for i, (store, port) in enumerate(zip(stores, node_ports)):
        d.start(
            f"node{i}",
            supernode_argv(link_port, store, i, port, "--insecure"),
            **(crash_env("1@1") if i == 1 else {}),
        )
    d.start(
        "superlink",
        superlink_argv(link_port, server, out, 3, 1, "--insecure", "--secure-aggregation", control_port=control_port),
    )
    code = d.wait("superlink", TIMEOUT)
    assert code == 0, f"superlink run failed (exit {code}):\n{d.log('superlink')[-4000:]}"
    rows = read_csv(out / "rounds.csv")
    assert [r["clients_trained"] for r in rows] == ["2"] and rows[0]["failed_clients"] == "1"
    assert "injected crash of partition 1 in round 1" in rows[0]["failure_reason"]
    summary = json.loads((out / "summary.json").read_text())
    ex = summary["secure_aggregation"]["exchanges"]
    assert [(e["kind"], e["included"], e["halted"]) for e in ex] == [("census", 3, ""), ("train", 2, "")]
    assert not (out / "clients.csv").exists()


def test_secure_run_draws_the_note_instead_of_label_counts(store, tmp_path, monkeypatch):
    """The server of a secure run never sees a client's label counts: partition.png says so (no clients.csv)."""
    from fedhead.federation import outputs

    monkeypatch.delenv(outputs.DRAW_ENV, raising=False)
    specs = []
    real = outputs.label_counts
    monkeypatch.setattr(outputs, "label_counts", lambda report: specs.append(real(report)) or specs[-1])
    run(cfg_of(store, secure_aggregation=True, rounds=1), tmp_path / "s")
    assert [s.kind for s in specs] == ["note"] and "Secure aggregation" in specs[0].note
    assert (tmp_path / "s" / "partition.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "s" / "curves.png").exists() and not (tmp_path / "s" / "clients.csv").exists()
