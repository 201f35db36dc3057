"""fedhead on Flower: parity with 'fedhead train' on Flower's simulation engine, the feature-statistics
exchange, and the fault cases (no store, foreign encoder, a crashing client, a server restart).

The fault cases run the real ServerApp strategy and ClientApp with Flower's Message/Record types over
``LocalGrid``, a synchronous in-process Grid (no Ray start-up: seconds, not minutes); the parity test uses
Flower's simulation engine and tests/test_flower_deploy.py real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")


from flower_hooks import CRASH_ENV, STOP_ENV, ServerStopped  # noqa: E402 (the tests' hooks, installed here)

from extract.store import load_store, write_store  # noqa: E402
from fedhead.core.synthetic import write_synthetic  # noqa: E402
from fedhead.federation.clients import build_federation
from fedhead.federation.config import TrainConfig, applicable  # noqa: E402
from fedhead.federation.rundir import read_csv  # noqa: E402
from fedhead.federation.train import run_training  # noqa: E402
from fedhead.flower.client_app import make_client_app  # noqa: E402
from fedhead.flower.commands import run_config_of, simulate  # noqa: E402
from fedhead.flower.common import config_from_run_config  # noqa: E402
from fedhead.flower.inprocess import InProcessGrid, sim_nodes  # noqa: E402
from fedhead.flower.inprocess import task_identity as flower_task_identity  # noqa: E402
from fedhead.flower.server_app import run_server  # noqa: E402
from fedhead.flower.strategy import FedheadStrategy, ServerSettings  # noqa: E402
from fedhead.infra.errors import FedheadError  # noqa: E402


class LocalGrid(InProcessGrid):
    """The in-process grid without the wire format (messages handed over as objects)."""


@pytest.fixture(autouse=True)
def task_identity():
    """Flower's Message constructor reads the process's task identity (a SuperLink sets it; so do we)."""
    with flower_task_identity():
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic(
        tmp_path_factory.mktemp("flower") / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16
    )


def cfg_of(store, **kw) -> TrainConfig:
    base = dict(
        features=str(store),
        head="ova2",
        partition="shard",
        partition_params={"shards_per_client": 2},
        clients=4,
        rounds=3,
        local_epochs=2,
        batch_size=10,
        device="cpu",
    )
    # the base's --rounds etc. only where they apply (a closed-form head takes none); the case's own options as given
    return TrainConfig(**{**applicable({**base, **kw}), **kw})


def local_run(cfg, out, store_for_clients=None, nodes=None, resume=False):
    app = make_client_app(str(store_for_clients or cfg.features))
    grid = LocalGrid(app, nodes or sim_nodes(cfg.clients))
    return run_server(grid, cfg, ServerSettings(out=str(out), resume=resume, wait_timeout=5))


def accs(rows):
    return [float(r["accuracy"]) for r in rows]


# ---------------------------------------------------------------- parity on Flower's simulation engine


@pytest.mark.slow
def test_simulation_engine_matches_fedhead_train(store, tmp_path, shared_ray):
    cfg = cfg_of(store, participation=0.75)  # 3 of 4 clients per round, centred features, two stages
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    res = simulate(cfg, tmp_path / "flower", num_cpus=2)
    assert len(res.rows) == len(ref.rows) == 3
    np.testing.assert_allclose(accs(res.rows), accs(ref.rows), atol=1e-9)
    for a, b in zip(res.rows, ref.rows):
        assert a["stage"] == b["stage"] and a["clients_trained"] == b["clients_trained"]
        assert a["bytes_total"] == b["bytes_total"] and a["failures"] == 0
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    torch.testing.assert_close(
        torch.load(tmp_path / "flower" / "head-seed0.pt"),
        torch.load(tmp_path / "train" / "head-seed0.pt"),
        atol=1e-5,
        rtol=1e-5,
    )
    assert read_csv(tmp_path / "flower" / "clients.csv") == read_csv(tmp_path / "train" / "clients.csv")
    s = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert s["final_accuracy"] == pytest.approx(ref.summary["final_accuracy"]) and s["runtime"] == "flower"


@pytest.mark.slow
def test_simulation_engine_runs_closed_form_and_init(store, tmp_path, shared_ray):
    """`flower simulate` == `fedhead train` per round for the ridge head and for a Fed3R-started softmax."""
    for name, kw in (
        ("ridge", dict(head="ridge")),
        ("init", dict(head="softmax", init="ridge", rounds=2, prox_mu=0.01, server_opt="fedadam")),
    ):
        cfg = cfg_of(store, **kw)
        ref = run_training(cfg, out=tmp_path / f"train-{name}", progress=False)
        res = simulate(cfg_of(store, **kw), tmp_path / f"flower-{name}", num_cpus=2)
        assert [r["stage"] for r in res.rows] == [r["stage"] for r in ref.rows]
        np.testing.assert_allclose(accs(res.rows), accs(ref.rows), atol=1e-9)
        assert [r["bytes_total"] for r in res.rows] == [r["bytes_total"] for r in ref.rows]


# ---------------------------------------------------------------- the same code paths, in process


def test_grouped_noise_rms_parity_in_process(store, tmp_path):
    cfg = cfg_of(store, aggregate="grouped", noise="symmetric", noise_rate=0.2, scale="rms", head="ova")
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    res = local_run(cfg, tmp_path / "flower")
    np.testing.assert_allclose(accs(res.rows), accs(ref.rows), atol=1e-9)
    assert res.summary["realised_noise_rate"] == pytest.approx(ref.summary["realised_noise_rate"])
    assert res.summary["realised_noise_rate"] > 0


def test_stats_exchange_is_bit_identical(store):
    cfg = cfg_of(store, scale="rms").resolved()
    s = load_store(store)
    fed = build_federation(s, cfg, 0, cfg.partition, cfg.partition_params)
    strat = FedheadStrategy(cfg, s, ServerSettings(wait_timeout=5))
    info = strat.connect(LocalGrid(make_client_app(str(store)), sim_nodes(4)), need_stats=True)
    mine = strat.combine_stats(info)
    assert np.array_equal(mine.mean, fed.stats.mean) and mine.scale == fed.stats.scale
    assert (mine.bytes_up_per_client, mine.bytes_down_per_client) == (
        fed.stats.bytes_up_per_client,
        fed.stats.bytes_down_per_client,
    )


def test_node_without_store_is_refused_before_round_one(store, tmp_path):
    cfg = cfg_of(store)
    nodes = [{"partition-id": i} for i in range(4)]
    with pytest.raises(FedheadError, match=r"refused the run before round 1: This SuperNode has no feature store"):
        run_server(
            LocalGrid(make_client_app(None), nodes), cfg, ServerSettings(out=str(tmp_path / "r"), wait_timeout=5)
        )
    assert not (tmp_path / "r" / "rounds.csv").exists()


def test_store_from_another_encoder_is_refused(store, tmp_path):
    s = load_store(store)
    attrs = {k: s.info.attrs[k] for k in ("dataset", "weights_source", "weights_sha256", "preprocessing", "image_size")}
    other = write_store(
        tmp_path / "other.h5",
        train=(s.train_x, s.train_y),
        test=(s.test_x, s.test_y),
        class_names=s.info.class_names,
        attrs={**attrs, "encoder": "vit_b16"},
    )
    with pytest.raises(FedheadError, match=r"extracted with encoder 'vit_b16'.*server's store with 'synthetic'"):
        local_run(cfg_of(store), tmp_path / "r", store_for_clients=other)


def test_crashing_client_is_recorded_and_the_round_completes(store, tmp_path, monkeypatch):
    monkeypatch.setenv(CRASH_ENV, "2@2")
    res = local_run(cfg_of(store), tmp_path / "r")
    rows = read_csv(tmp_path / "r" / "rounds.csv")
    assert [r["failures"] for r in rows] == ["0", "1", "0"]
    assert rows[1]["failed_clients"] == "2" and rows[1]["clients_trained"] == "3"
    assert "injected crash of partition 2 in round 2" in rows[1]["failure_reason"]
    assert rows[2]["clients_trained"] == "4" and res.summary["failures"] == 1


def test_server_restart_resumes_from_checkpoint(store, tmp_path, monkeypatch):
    cfg = cfg_of(store)
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    monkeypatch.setenv(STOP_ENV, "2")
    with pytest.raises(ServerStopped):
        local_run(cfg, tmp_path / "r")
    assert (tmp_path / "r" / "checkpoint.safetensors").exists() and len(read_csv(tmp_path / "r" / "rounds.csv")) == 2
    monkeypatch.delenv(STOP_ENV)
    with pytest.raises(FedheadError, match="already holds files"):
        local_run(cfg, tmp_path / "r")
    res = local_run(cfg, tmp_path / "r", resume=True)
    np.testing.assert_allclose(accs(res.rows), accs(ref.rows), atol=1e-9)
    assert not (tmp_path / "r" / "checkpoint.safetensors").exists()
    with pytest.raises(FedheadError, match="different configuration"):
        local_run(cfg_of(store, rounds=4), tmp_path / "r", resume=True)


def test_duplicate_partition_ids_are_refused(store, tmp_path):
    nodes = sim_nodes(4)
    nodes[3] = {"partition-id": 2, "num-partitions": 4}
    with pytest.raises(FedheadError, match="both have partition-id 2"):
        local_run(cfg_of(store), tmp_path / "r", nodes=nodes)


# ---------------------------------------------------------------- configuration and packaging


def test_run_config_round_trip_and_pyproject_defaults(store, tmp_path):
    import dataclasses

    import tomllib

    from fedhead.flower.common import RUN_CONFIG_FIELDS

    cfg = cfg_of(
        store,
        lr=0.05,
        center=False,
        seeds=[0, 42],
        noise="asymmetric",  # --noise-dataset applies to the asymmetric map only
        noise_rate=0.1,
        noise_dataset="cifar10",
        server_opt="fedadam",
        server_betas=(0.8, 0.95),
        local_epochs=None,
        local_steps=4,
    )
    back = config_from_run_config(run_config_of(cfg, tmp_path, False, 60, 60))
    assert back.resolved().to_dict() == {**cfg.resolved().to_dict(), "features": str(Path(store).resolve())}
    # every training option reaches a Flower run: a run-config key each, except the ones with keys of their own,
    # the node-local resources and the references Flower refuses
    own = {
        "features",
        "partition_params",
        "head_params",
        "seeds",
        "block_clients",
        "memory_budget_mb",
        "dual",  # the in-process engine's form of local SGD (a Flower node trains its client in the primal form)
        "iid_reference",
        "central_reference",
        "personal_models",  # the personal heads stay on the nodes: no model file of one on the server
        "deadline",  # the simulated clock's synchronous rules and lost dispatches (Flower: the real ones)
        "over_selection",
        "dropout",
        "withdrawn_clients",  # a simulated federation's withdrawn clients (on Flower a withdrawn node stays away)
    }
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert fields - own - set(RUN_CONFIG_FIELDS.values()) == set()
    pp = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    app = pp["tool"]["flwr"]["app"]
    assert app["components"] == {
        "serverapp": "fedhead.flower.server_app:app",
        "clientapp": "fedhead.flower.client_app:app",
    }
    defaults = dict(app["config"], **{"feature-store": str(store)})
    config_from_run_config(defaults).resolved()


def test_core_does_not_import_flwr_and_missing_extra_is_one_line(monkeypatch):
    code = (
        "import sys, cli, fedhead.federation.train, fedhead.commands, fedhead.flower.commands; "
        "assert 'flwr' not in sys.modules, 'flwr imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
    from fedhead.flower import common

    monkeypatch.setitem(sys.modules, "flwr", None)
    with pytest.raises(FedheadError, match=r"pip install 'fedhead\[flower\]'"):
        common.require_flower()


# ---------------------------------------------------------------- closed-form heads and --init on Flower


@pytest.mark.parametrize(
    "kw",
    [
        dict(head="ridge"),
        dict(head="cof", partition="dirichlet", partition_params={"alpha": 0.3, "min_size": 2}),
        dict(head="softmax", init="ridge", rounds=3),
        dict(head="ova2", init="ncm", rounds=2, participation=0.75, server_opt="fedavgm", server_momentum=0.9),
        dict(head="qda", partition="dirichlet", partition_params={"alpha": 0.3, "min_size": 2}),
        dict(head="fedpft", head_params={"fedpft_weight_decay": 0.01}),
        dict(head="ridge-rf", head_params={"rf_width": 64}),
    ],
)
def test_statistics_exchange_matches_fedhead_train(store, tmp_path, kw):
    """The statistics message and its sums are the simulator's (client by client over Flower's records); the
    solve, the --init mapping and the server optimiser are one definition: per-round rows agree."""
    cfg = cfg_of(store, **kw)
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    res = local_run(cfg_of(store, **kw), tmp_path / "flower")
    closed = ("ridge", "cof", "qda", "fedpft", "ridge-rf")
    assert len(res.rows) == len(ref.rows) == (1 if kw["head"] in closed else cfg.rounds)
    np.testing.assert_allclose(accs(res.rows), accs(ref.rows), atol=1e-9)
    for a, b in zip(res.rows, ref.rows):
        assert a["stage"] == b["stage"] and a["clients_trained"] == b["clients_trained"]
        assert a["bytes_total"] == b["bytes_total"]
        assert a["bytes_up_per_client"] == pytest.approx(b["bytes_up_per_client"])
    torch.testing.assert_close(
        torch.load(tmp_path / "flower" / "head-seed0.pt"),
        torch.load(tmp_path / "train" / "head-seed0.pt"),
        atol=1e-5,
        rtol=1e-5,
    )


def test_bad_scaffold_and_ccvr_options_are_refused_by_the_server_app(store, tmp_path):
    """SCAFFOLD and CCVR run on Flower (tests/test_flower_scaffold_ccvr.py); the ServerApp refuses what
    `fedhead train` refuses, before round 1."""
    for kw, flag in (
        (dict(scaffold=True, optimizer="adamw"), "--scaffold"),
        (dict(head="ridge", calibrate="ccvr"), "--calibrate"),
    ):
        with pytest.raises(FedheadError, match=flag):
            local_run(cfg_of(store, **kw), tmp_path / flag.strip("-"))
        assert not (tmp_path / flag.strip("-") / "rounds.csv").exists()


def unavailable(m):
    """The reply a SuperLink writes itself for message ``m`` once its node stopped sending heartbeats (Flower's own
    function; the SuperLink is its sender), with the id ``m`` gets when it is pushed."""
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    m.metadata.__dict__["_message_id"] = m.object_id
    return create_message_error_unavailable_res_message(m.metadata, "node_unavail")


class RejoinGrid(LocalGrid):
    """A SuperLink that kept a dead node's registration (node 999: Flower answers NODE_UNAVAILABLE) and whose node
    for partition 1 joins only after the server first asked for the nodes (it was restarting)."""

    def __init__(self, app, nodes):
        super().__init__(app, nodes)
        self.late = {n: c for n, c in self.ctx.items() if c.node_config["partition-id"] == 1}
        self.ctx = {n: c for n, c in self.ctx.items() if n not in self.late}
        self.asked = 0

    def get_node_ids(self):
        self.asked += 1
        if self.asked > 2:
            self.ctx.update(self.late)
        return [*self.ctx, 999]

    def send_and_receive(self, messages, *, timeout=None):
        dead = [m for m in messages if m.metadata.dst_node_id == 999]
        live = [m for m in messages if m.metadata.dst_node_id != 999]
        return super().send_and_receive(live, timeout=timeout) + [unavailable(m) for m in dead]


def test_a_dead_registration_is_left_out_and_a_late_partition_waited_for(store, tmp_path):
    """A server (re)started while the SuperLink still lists a node that died, and before the node of a partition
    (re)joined: the dead node is left out, the server waits for the partition, and the run is the plain one."""
    cfg = cfg_of(store)
    plain = local_run(cfg, tmp_path / "plain")
    grid = RejoinGrid(make_client_app(str(store)), sim_nodes(cfg.clients))
    res = run_server(grid, cfg, ServerSettings(out=str(tmp_path / "rejoin"), wait_timeout=5))
    assert grid.asked > 2  # it did wait for partition 1
    assert accs(res.rows) == accs(plain.rows) and all(r["failures"] == 0 for r in res.rows)


class DyingGrid(LocalGrid):
    """The node of partition 2 dies after round 1: from then on the SuperLink answers its messages itself."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if not messages or messages[0].metadata.group_id in ("query", "1"):
            return super().send_and_receive(messages, timeout=timeout)
        node = next(n for n, c in self.ctx.items() if c.node_config["partition-id"] == 2)
        live = [m for m in messages if m.metadata.dst_node_id != node]
        return super().send_and_receive(live, timeout=timeout) + [unavailable(m) for m in messages if m not in live]


def test_a_node_that_died_is_a_failure_of_its_partition_with_flowers_reason(store, tmp_path):
    """The reply the SuperLink writes for a dead node names the SuperLink as its sender: the round still records
    the failure under the node's partition, with Flower's reason, not as a reply that never came."""
    cfg = cfg_of(store)
    res = run_server(
        DyingGrid(make_client_app(str(store)), sim_nodes(cfg.clients)),
        cfg,
        ServerSettings(out=str(tmp_path / "r"), wait_timeout=5),
    )
    rows = read_csv(tmp_path / "r" / "rounds.csv")
    assert [r["failed_clients"] for r in rows] == ["", "2", "2"]
    assert [r["clients_trained"] for r in rows] == ["4", "3", "3"]
    assert all("Node Unavailable" in r["failure_reason"] for r in rows[1:]), rows
    assert res.summary["failures"] == 2
