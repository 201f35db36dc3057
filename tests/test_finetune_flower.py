"""fedhead finetune on Flower (issue 39): one ``--peft lora`` round over Flower's message API equals the simulator's
(the global trainable vector and the accuracies), with every message serialised as a network carries it (the
in-process grid of tests/test_flower_sim.py) and on Flower's simulation engine (Ray, slow tier); a node's bad reply
is that client's failure, never the run's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")

from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict  # noqa: E402

from extract.encoders import load_encoder  # noqa: E402
from fedhead.flower.inprocess import InProcessGrid, sim_nodes, task_identity  # noqa: E402
from fedhead.scratch.finetune import FinetuneConfig, FinetuneJob, load_images, resolve_finetune  # noqa: E402
from fedhead.scratch.ftflower import (  # noqa: E402
    check_query_reply,
    check_train_reply,
    make_finetune_client_app,
    run_finetune_flower,
    serve_finetune,
)

TINY = dict(encoder="test_vit", pretrained=False, image_size=32, dataset="digits", data_dir=None, limit=120,
            clients=3, participation=1.0, rounds=1, plots=False, peft="lora", device="cpu")  # fmt: skip


@pytest.fixture(autouse=True)
def identity():
    """Flower's Message constructor reads the process's task identity (a SuperLink sets it; so do we)."""
    with task_identity():
        yield


@pytest.fixture(scope="module")
def simulator():
    """The simulator's round 1 (FinetuneJob driven directly): its row and global trainable vector."""
    cfg = resolve_finetune(FinetuneConfig(**TINY))
    enc = load_encoder(cfg.encoder, pretrained=False, image_size=cfg.image_size)
    job = FinetuneJob(cfg, enc, load_images(cfg, enc), torch.device("cpu"), log=None, run=None)
    job.start((0,), None)
    row = job.round((0,), 1)
    return row, job.theta.detach().cpu().clone()


def in_process(cfg: FinetuneConfig, out_dir, grid_cls=InProcessGrid):
    grid = grid_cls(make_finetune_client_app(cfg), sim_nodes(cfg.clients), wire=True)
    return serve_finetune(grid, cfg, out_dir, timeout=60)


def test_one_lora_round_over_flower_messages_equals_the_simulator(simulator, tmp_path):
    row, theta = simulator
    res = in_process(FinetuneConfig(**TINY), tmp_path / "run")
    assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "model-seed0.safetensors").exists()
    assert res.summary["final_accuracy"] == pytest.approx(row["accuracy"], abs=1e-9)
    assert len(res.rows) == 1 and not res.failures and not res.refused
    got = res.rows[0]
    assert got["clients"] == row["clients"] == 3 and got["failures"] == 0
    torch.testing.assert_close(res.thetas[0], theta, atol=1e-6, rtol=0)
    assert got["accuracy"] == pytest.approx(row["accuracy"], abs=1e-9)
    assert got["val_accuracy"] == pytest.approx(row["val_accuracy"], abs=1e-9)
    assert got["train_loss"] == pytest.approx(row["train_loss"], rel=1e-5)
    assert got["bytes_total"] == row["bytes_total"] and got["bytes_up_per_client"] == row["bytes_up_per_client"]


class TamperGrid(InProcessGrid):
    """The in-process grid with the replies of node 1001 (client 1) to train messages replaced by a NaN vector."""

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for r in super().send_and_receive(messages, timeout=timeout):
            if r.metadata.message_type == "train" and r.metadata.src_node_id == 1001 and not r.has_error():
                m = dict(r.content["metrics"].items())
                bad = np.full(r.content["arrays"]["theta"].shape, np.nan, np.float32)
                r = Message(RecordDict({"arrays": ArrayRecord({"theta": Array(bad)}), "metrics": MetricRecord(m)}),
                            reply_to=_request(messages, r))  # fmt: skip
            out.append(r)
        return out


def _request(messages, reply):
    return next(m for m in messages if m.metadata.dst_node_id == reply.metadata.src_node_id)


def test_a_nan_reply_is_its_clients_failure_and_the_round_goes_on(simulator, tmp_path):
    res = in_process(FinetuneConfig(**TINY), tmp_path / "run", TamperGrid)
    row = res.rows[0]
    assert row["stage"] == "train" and row["clients"] == 2 and row["failures"] == 1
    assert [(f["client"], f["round"]) for f in res.failures] == [(1, 1)]
    assert "inf or nan" in res.failures[0]["reason"]
    assert torch.isfinite(res.thetas[0]).all()
    assert not torch.equal(res.thetas[0], simulator[1])  # two clients' average, not three


# ---------------------------------------------------------------- the reply checks, on hand-made replies


P = 5


def reply(theta=None, *, client=1, n=10, loss=0.5, ms=3.0, extra_arrays=None, metrics=None) -> Message:
    arrays = {"theta": Array(np.arange(P, dtype=np.float32) if theta is None else theta), **(extra_arrays or {})}
    m = {"client": client, "num-examples": n, "train-loss": loss, "client-ms": ms}
    m = m if metrics is None else metrics(m)
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord(m)}), dst_node_id=1,
                   message_type="train")  # fmt: skip


def forged(header_shape: tuple, values: int) -> Array:
    """A numpy Array whose .npy header claims ``header_shape`` but whose data hold ``values`` float32 values."""
    real = Array(np.zeros(values, np.float32))
    data = bytes(real.data).replace(repr((values,)).encode(), repr(header_shape).encode(), 1)
    return Array(dtype="float32", shape=header_shape, stype="numpy.ndarray", data=data)


def test_a_well_formed_reply_is_taken():
    r = check_train_reply(reply(), client=1, size=10, params=P)
    assert not isinstance(r, str), r
    np.testing.assert_array_equal(r.vector, np.arange(P, dtype=np.float32))
    assert (r.num_examples, r.loss, r.client_ms) == (10, 0.5, 3.0)


@pytest.mark.parametrize(
    "bad, why",
    [
        (lambda: reply(np.zeros(P + 1, np.float32)), "expected float32 (5,)"),
        (lambda: reply(np.zeros((1, P), np.float32)), "expected float32 (5,)"),
        (lambda: reply(np.zeros(P, np.float64)), "expected float32 (5,)"),
        (lambda: reply(np.array([0, 1, np.nan, 3, 4], np.float32)), "inf or nan"),
        (lambda: reply(np.array([0, 1, np.inf, 3, 4], np.float32)), "inf or nan"),
        (lambda: reply(extra_arrays={"other": Array(np.zeros(1, np.float32))}), "exactly one 'theta'"),
        (lambda: reply(client=2), "client 2"),
        (lambda: reply(n=0), "num-examples 0 outside"),
        (lambda: reply(n=11), "num-examples 11 outside"),
        (lambda: reply(n=10.0), "num-examples is not an integer"),
        (lambda: reply(loss=float("nan")), "train-loss"),
        (lambda: reply(ms=-1.0), "client-ms"),
        (
            lambda: reply(metrics=lambda m: {k: v for k, v in m.items() if k != "num-examples"}),
            "missing 'num-examples'",
        ),
    ],
)
def test_a_malformed_reply_is_refused_with_its_reason(bad, why):
    got = check_train_reply(bad(), client=1, size=10, params=P)
    assert isinstance(got, str) and got.startswith("bad train reply refused") and why in got, got


def test_a_header_that_lies_about_its_size_is_refused_before_any_allocation():
    huge = reply()
    huge.content["arrays"]["theta"] = forged((2**40,), P)  # a header asking for 4 TB over 20 bytes of data
    got = check_train_reply(huge, client=1, size=10, params=P)
    assert isinstance(got, str) and "expected float32 (5,)" in got
    short = reply()
    short.content["arrays"]["theta"] = forged((P,), P - 1)  # the right header over too few bytes
    got = check_train_reply(short, client=1, size=10, params=P)
    assert isinstance(got, str) and "data bytes" in got


def test_an_error_reply_is_a_failure_with_the_nodes_reason():
    request = reply()
    err = Message(Error(code=1, reason="<class 'RuntimeError'>:<'out of memory'>"), reply_to=request)
    got = check_train_reply(err, client=1, size=10, params=P)
    assert isinstance(got, str) and "out of memory" in got


def test_query_replies_name_a_client_of_the_run_with_its_size():
    def q(**m):
        return Message(RecordDict({"metrics": MetricRecord(m)}), dst_node_id=1, message_type="query")

    assert check_query_reply(q(client=2, **{"num-examples": 7}), clients=3, sizes=[5, 6, 7]) == 2
    assert "outside" in check_query_reply(q(client=3, **{"num-examples": 7}), clients=3, sizes=[5, 6, 7])
    assert "client 2 has 7" in check_query_reply(q(client=2, **{"num-examples": 8}), clients=3, sizes=[5, 6, 7])
    assert "missing" in check_query_reply(q(client=2), clients=3, sizes=[5, 6, 7])


# ---------------------------------------------------------------- Flower's simulation engine (Ray)


@pytest.mark.slow
def test_simulation_engine_runs_one_lora_round_equal_to_the_simulator(simulator, shared_ray, tmp_path):
    row, theta = simulator
    res = run_finetune_flower(FinetuneConfig(**TINY), tmp_path / "flower", num_cpus=2, timeout=600)
    assert len(res.rows) == 1 and res.rows[0]["failures"] == 0 and res.rows[0]["clients"] == 3
    torch.testing.assert_close(res.thetas[0], theta, atol=1e-6, rtol=0)
    assert res.rows[0]["accuracy"] == pytest.approx(row["accuracy"], abs=1e-9)
