"""SCAFFOLD and CCVR on Flower: the real ServerApp strategy and ClientApp over tests/test_flower_sim.py's in-process
``LocalGrid`` give the rows and the head of ``fedhead train`` (one definition of each method, run by both).

SCAFFOLD's client variates live in the nodes' ``Context.state`` (LocalGrid keeps one Context per node, as a
SuperNode does within a Flower run); the server holds ``c``. Besides parity, the tests check the invariant that
makes the protocol right, ``c = mean_k c_k`` over the versions the server counted, when a reply is lost and when
the server resumes with nodes that lost their variates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")


from flower_hooks import CRASH_ENV, STOP_ENV, ServerStopped  # noqa: E402 (the tests' hooks, installed here)
from test_flower_sim import LocalGrid, accs, cfg_of, local_run, sim_nodes, task_identity  # noqa: E402,F401

from extract.store import load_store  # noqa: E402
from fedhead.core.synthetic import write_synthetic  # noqa: E402
from fedhead.federation.rundir import read_csv  # noqa: E402
from fedhead.federation.train import run_training  # noqa: E402
from fedhead.flower.client_app import make_client_app  # noqa: E402
from fedhead.flower.node import VARIATES  # noqa: E402
from fedhead.flower.strategy import FedheadStrategy, ServerSettings, validate_server_config  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic(
        tmp_path_factory.mktemp("flower-scaffold") / "s.h5",
        num_classes=6,
        train_per_class=20,
        test_per_class=10,
        dim=16,
    )


def strategy_run(cfg, out, grid, resume=False):
    """The ServerApp's run with the strategy kept (its SCAFFOLD state is inspected afterwards)."""
    s = load_store(cfg.features)
    strat = FedheadStrategy(
        validate_server_config(cfg, s), s, ServerSettings(out=str(out), resume=resume, wait_timeout=5)
    )
    return strat, strat.start(grid)


def node_variates(strat, grid) -> torch.Tensor:
    """``[N, C, D+1]``: each node's c_k in the version the server counted (zeros for the zero variate)."""
    v, c = strat.variates, strat.server.scaffold.c
    out = torch.zeros((strat.cfg.clients, *c.shape), dtype=torch.float32)
    for pid in range(strat.cfg.clients):
        tag = v.tag(v.accepted[pid])
        if tag:
            out[pid] = torch.as_tensor(grid.ctx[strat.node_of[pid]].state[VARIATES][tag].numpy())
    return out


def assert_same_rows(flower_rows, train_rows):
    assert len(flower_rows) == len(train_rows)
    np.testing.assert_allclose(accs(flower_rows), accs(train_rows), atol=1e-9)
    for a, b in zip(flower_rows, train_rows):
        assert a["stage"] == b["stage"] and a["round"] == b["round"]
        assert int(a["clients_trained"]) == int(b["clients_trained"])
        assert float(a["bytes_total"]) == float(b["bytes_total"])
        assert float(a["bytes_up_per_client"]) == pytest.approx(float(b["bytes_up_per_client"]))


# ---------------------------------------------------------------- SCAFFOLD


@pytest.mark.parametrize("kw", [dict(participation=0.75), dict(backend="loop", head="softmax", rounds=2)])
def test_scaffold_matches_fedhead_train(store, tmp_path, kw):
    cfg = cfg_of(store, scaffold=True, **kw)
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    grid = LocalGrid(make_client_app(str(store)), sim_nodes(cfg.clients))
    strat, res = strategy_run(cfg_of(store, scaffold=True, **kw), tmp_path / "flower", grid)
    assert_same_rows(res.rows, ref.rows)
    head = torch.load(tmp_path / "flower" / "head-seed0.pt")
    torch.testing.assert_close(head, torch.load(tmp_path / "train" / "head-seed0.pt"), atol=1e-5, rtol=1e-5)
    # the variates really travel: twice the head's bytes each way, and the head is not FedAvg's
    plain = run_training(cfg_of(store, **kw), out=tmp_path / "plain", progress=False)
    assert float(res.rows[-1]["bytes_up_per_client"]) == 2 * float(plain.rows[-1]["bytes_up_per_client"])
    assert (head - torch.load(tmp_path / "plain" / "head-seed0.pt")).abs().max() > 1e-4
    # the server's c is the mean of the nodes' c_k (over all N), and not zero
    c = strat.server.scaffold.c
    assert c.abs().max() > 1e-4
    torch.testing.assert_close(c, node_variates(strat, grid).sum(0) / cfg.clients, atol=1e-6, rtol=1e-5)
    assert res.summary["scaffold_restarts"] == []


class DropReply(LocalGrid):
    """Delivers every message, but loses the reply of partition ``pid`` in round ``rnd`` (the node trained)."""

    def __init__(self, *a, drop=(1, 2), **k):
        super().__init__(*a, **k)
        self.drop = drop

    def send_and_receive(self, messages, *, timeout=None):
        out = super().send_and_receive(messages, timeout=timeout)
        return [
            r
            for r, m in zip(out, messages)
            if not (
                m.metadata.message_type == "train"
                and m.metadata.dst_node_id == 1000 + self.drop[0]
                and int(m.content["config"]["round"]) == self.drop[1]
            )
        ]


def test_scaffold_lost_reply_keeps_c_the_mean_of_the_nodes_variates(store, tmp_path):
    cfg = cfg_of(store, scaffold=True, rounds=4, head="softmax")
    grid = DropReply(make_client_app(str(store)), sim_nodes(cfg.clients))
    strat, res = strategy_run(cfg, tmp_path / "r", grid)
    rows = read_csv(tmp_path / "r" / "rounds.csv")
    assert [r["failed_clients"] for r in rows] == ["", "1", "", ""]
    assert rows[1]["clients_trained"] == "3" and rows[2]["clients_trained"] == "4"
    # partition 1 trained in round 2 but the server never counted it: round 3 started from its round-1 c_k
    assert strat.variates.accepted.tolist() == [4, 4, 4, 4]
    torch.testing.assert_close(
        strat.server.scaffold.c, node_variates(strat, grid).sum(0) / cfg.clients, atol=1e-6, rtol=1e-5
    )
    assert len(grid.ctx[1001].state[VARIATES]) == 2  # the version it started from and the one it made


def test_scaffold_resume(store, tmp_path, monkeypatch):
    """A server resume with nodes that kept their variates continues exactly (the checkpoint holds c and which
    c_k each node holds): in the same Flower run (Context.state) or in a new one whose nodes keep them in a state
    folder; with nodes that lost them (a new Flower run starts with an empty Context.state), SCAFFOLD restarts
    from zero variates at the first resumed round and c stays the mean of the c_k."""
    cfg = cfg_of(store, scaffold=True, rounds=4, head="softmax")
    ref = run_training(cfg, out=tmp_path / "train", progress=False)

    def nodes(state_dir=None):
        return [{**nc, "state-dir": str(state_dir)} if state_dir else nc for nc in sim_nodes(cfg.clients)]

    for name, fresh_nodes, state_dir in (
        ("kept", False, None),
        ("lost", True, None),
        ("disk", True, tmp_path / "node-state"),
    ):
        grid = LocalGrid(make_client_app(str(store)), nodes(state_dir))
        monkeypatch.setenv(STOP_ENV, "2")
        with pytest.raises(ServerStopped):
            strategy_run(cfg, tmp_path / name, grid)
        monkeypatch.delenv(STOP_ENV)
        if fresh_nodes:
            grid = LocalGrid(make_client_app(str(store)), nodes(state_dir))
            assert all(VARIATES not in ctx.state for ctx in grid.ctx.values())
        strat, res = strategy_run(cfg, tmp_path / name, grid, resume=True)
        torch.testing.assert_close(
            strat.server.scaffold.c, node_variates(strat, grid).sum(0) / cfg.clients, atol=1e-6, rtol=1e-5
        )
        if name != "lost":
            assert_same_rows(res.rows, ref.rows)
            assert res.summary["scaffold_restarts"] == []
            torch.testing.assert_close(
                torch.load(tmp_path / name / "head-seed0.pt"),
                torch.load(tmp_path / "train" / "head-seed0.pt"),
                atol=1e-5,
                rtol=1e-5,
            )
        else:
            assert res.summary["scaffold_restarts"] == [{"seed": 0, "round": 3}]
            assert_same_rows(res.rows[:2], ref.rows[:2])
            assert strat.variates.generation == 1 and len(res.rows) == 4
    assert len(list((tmp_path / "node-state").glob("scaffold-p*-*.safetensors"))) == cfg.clients  # one file a node


@pytest.mark.parametrize("damage", ["other-run", "corrupt"])
def test_scaffold_resume_never_takes_variates_it_did_not_make(store, tmp_path, monkeypatch, damage):
    """The state folder's file of another run of the same config (its tags name that run) or a damaged file is
    a lost variate: SCAFFOLD restarts at the first resumed round, as without a folder, and c stays the mean."""
    cfg = cfg_of(store, scaffold=True, rounds=4, head="softmax")
    state = tmp_path / "node-state"
    nodes = [{**nc, "state-dir": str(state)} for nc in sim_nodes(cfg.clients)]
    monkeypatch.setenv(STOP_ENV, "2")
    with pytest.raises(ServerStopped):
        strategy_run(cfg, tmp_path / "r", LocalGrid(make_client_app(str(store)), nodes))
    if damage == "other-run":  # a second run of the same config, with the same nodes' folder
        with pytest.raises(ServerStopped):
            strategy_run(cfg, tmp_path / "other", LocalGrid(make_client_app(str(store)), nodes))
    else:
        victim = sorted(state.glob("scaffold-p1-*.safetensors"))[0]
        victim.write_bytes(victim.read_bytes()[:40])
    monkeypatch.delenv(STOP_ENV)
    grid = LocalGrid(make_client_app(str(store)), nodes)
    strat, res = strategy_run(cfg, tmp_path / "r", grid, resume=True)
    assert res.summary["scaffold_restarts"] == [{"seed": 0, "round": 3}]
    torch.testing.assert_close(
        strat.server.scaffold.c, node_variates(strat, grid).sum(0) / cfg.clients, atol=1e-6, rtol=1e-5
    )


def test_simulation_nodes_keep_variates_in_the_run_folder():
    """Flower's simulation (no feature-store in the node config): the state folder is <run-dir>/node-state; a
    SuperNode's comes only from its own node config."""
    from flwr.app import Context, RecordDict

    from fedhead.flower.node import node_settings

    def settings(nc, rc):
        return node_settings(Context(run_id=1, node_id=1, node_config=nc, state=RecordDict(), run_config=rc))

    sim = {"partition-id": 0, "num-partitions": 4}
    assert settings(sim, {"feature-store": "s.h5", "run-dir": "/r"}).state_dir == "/r/node-state"
    assert settings(sim, {"feature-store": "s.h5"}).state_dir is None
    own = {"feature-store": "mine.h5", "partition-id": 0}
    assert settings(own, {"run-dir": "/r"}).state_dir is None
    assert settings({**own, "state-dir": "/n"}, {"run-dir": "/r"}).state_dir == "/n"


@pytest.mark.slow
def test_simulation_engine_keeps_node_variates(store, tmp_path, shared_ray):
    """On Flower's simulation engine (Ray actors) a node's Context.state persists between rounds: a SCAFFOLD run
    with CCVR gives the rows of `fedhead train` (a node that lost its c_k would fail its round instead)."""
    from fedhead.flower.commands import simulate

    kw = dict(scaffold=True, participation=0.75, calibrate="ccvr", ccvr_samples=30)
    ref = run_training(cfg_of(store, **kw), out=tmp_path / "train", progress=False)
    res = simulate(cfg_of(store, **kw), tmp_path / "flower", num_cpus=2)
    assert_same_rows(res.rows, ref.rows)
    assert res.summary["failures"] == 0 and res.summary["scaffold_restarts"] == []
    assert res.summary["uncalibrated_accuracy"] == pytest.approx(ref.summary["uncalibrated_accuracy"], abs=1e-12)


# ---------------------------------------------------------------- CCVR


@pytest.mark.parametrize(
    "kw",
    [
        dict(
            head="softmax",
            rounds=2,
            partition="dirichlet",
            ccvr_samples=200,
            partition_params={"alpha": 0.3, "min_size": 2},
        ),
        dict(head="ova2", scaffold=True, participation=0.75, scale="rms", ccvr_samples=30),
    ],
)
def test_ccvr_matches_fedhead_train(store, tmp_path, kw):
    cfg = cfg_of(store, calibrate="ccvr", **kw)
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    res = local_run(cfg_of(store, calibrate="ccvr", **kw), tmp_path / "flower")
    assert res.rows[-1]["stage"] == "ccvr" and res.rows[-1]["round"] == cfg.rounds + 1
    assert res.rows[-1]["failures"] == 0
    assert res.rows[-1]["accuracy"] != res.rows[-2]["accuracy"]  # the calibration changed the head
    assert_same_rows(res.rows, ref.rows)
    assert res.summary["uncalibrated_accuracy"] == pytest.approx(ref.summary["uncalibrated_accuracy"], abs=1e-12)
    assert res.summary["final_accuracy"] == pytest.approx(ref.summary["final_accuracy"], abs=1e-12)
    torch.testing.assert_close(
        torch.load(tmp_path / "flower" / "head-seed0.pt"),
        torch.load(tmp_path / "train" / "head-seed0.pt"),
        atol=1e-5,
        rtol=1e-5,
    )
    assert [r["stage"] for r in read_csv(tmp_path / "flower" / "rounds.csv")][-1] == "ccvr"


def test_ccvr_node_failure_is_recorded(store, tmp_path, monkeypatch):
    cfg = cfg_of(store, head="softmax", rounds=1, calibrate="ccvr", ccvr_samples=10)
    monkeypatch.setenv(CRASH_ENV, "2@2")  # round 2 = the calibration exchange
    res = local_run(cfg, tmp_path / "r")
    last = res.rows[-1]
    assert last["stage"] == "ccvr" and last["failures"] == 1 and last["failed_clients"] == "2"
    assert "injected crash of partition 2 in round 2" in last["failure_reason"]
    assert res.summary["failures"] == 1


def test_run_config_carries_scaffold_and_ccvr(store, tmp_path):
    """`fedhead flower superlink` hands the job to `flwr run` as a run config: the options must survive it."""
    from fedhead.flower.commands import run_config_of
    from fedhead.flower.common import config_from_run_config

    cfg = cfg_of(store, scaffold=True, calibrate="ccvr", ccvr_samples=50)
    back = config_from_run_config(run_config_of(cfg, tmp_path, False, 60, 60))
    assert (back.scaffold, back.calibrate, back.ccvr_samples) == (True, "ccvr", 50)
