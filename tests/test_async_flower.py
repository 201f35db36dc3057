"""FedBuff on Flower's message API (issue 40, part 3): train messages pushed without waiting and replies pulled as
they come. With every node answering at once and K = M = clients per round it is synchronous FedAvg (the Flower
round and the simulator's); a slow node's update arrives stale and is weighted down. Slowness is counted in pulls
(fedhead.flower.inprocess.InProcessGrid ``slow``), never in wall-clock time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from fedhead.core.sampling import round_clients  # noqa: E402
from fedhead.federation.config import TrainConfig  # noqa: E402
from fedhead.flower.client_app import make_client_app  # noqa: E402
from fedhead.flower.inprocess import InProcessGrid, sim_nodes, task_identity  # noqa: E402
from fedhead.flower.server_app import run_server  # noqa: E402
from fedhead.flower.strategy import ServerSettings  # noqa: E402


@pytest.fixture(autouse=True)
def identity():
    with task_identity():
        yield


def cfg_for(store, **kw) -> TrainConfig:
    base = dict(features=str(store), clients=6, clients_per_round=3, rounds=3, local_steps=2, batch_size=16,
                device="cpu", head="ova2", partition="shard")  # fmt: skip
    return TrainConfig(**{**base, **kw})


def flower_run(cfg, out, slow=None):
    grid = InProcessGrid(make_client_app(str(cfg.features)), sim_nodes(cfg.clients), slow=slow)
    res = run_server(grid, cfg, ServerSettings(out=str(out), wait_timeout=5))
    return res, grid


def accs(rows):
    return [float(r["accuracy"]) for r in rows]


def test_flower_fedbuff_with_prompt_nodes_is_the_synchronous_round(tiny_store, tmp_path):
    sync, _ = flower_run(cfg_for(tiny_store), tmp_path / "sync")
    buf, grid = flower_run(cfg_for(tiny_store, async_rule="fedbuff"), tmp_path / "buf")
    assert grid.count == 9 and not grid.pushed  # 3 cohorts of 3 pushed, every reply pulled
    np.testing.assert_allclose(accs(buf.rows), accs(sync.rows), atol=1e-9)
    assert [r["clients_trained"] for r in buf.rows] == [3, 3, 3]
    torch.testing.assert_close(
        torch.load(tmp_path / "buf" / "head-seed0.pt"), torch.load(tmp_path / "sync" / "head-seed0.pt")
    )
    assert [r["staleness_mean"] for r in buf.rows] == [0.0] * 3


def test_a_slow_node_arrives_stale_on_flower(tiny_store, tmp_path):
    cfg = cfg_for(tiny_store, async_rule="fedbuff", buffer_size=2, concurrency=3, rounds=4, clients_per_round=None,
                  participation=0.5)  # fmt: skip
    first = round_clients(cfg.resolved(), 0, 1)  # the first cohort; its first node answers 2 pulls late
    res, grid = flower_run(cfg, tmp_path / "slow", slow={1000 + int(first[0]): 2})
    rows = res.rows
    assert len(rows) == 4 and all(np.isfinite(accs(rows)))
    assert all(r["clients_trained"] == 2 for r in rows)
    assert any(float(r["staleness_mean"]) > 0 for r in rows)  # updates trained from an older head were applied
    assert grid.count > 3  # slots refilled as replies came


def test_an_error_reply_is_that_nodes_failure_not_an_update(tiny_store, tmp_path):
    """A node that answers its train messages with an error (gone, or restarted under another id) fills no buffer
    slot: it is left out for the rest of the run and the update it held up reports it as a failure."""
    cfg = cfg_for(tiny_store, async_rule="fedbuff", buffer_size=2, concurrency=3, rounds=3, clients_per_round=None,
                  participation=0.5)  # fmt: skip
    bad = 1000 + int(round_clients(cfg.resolved(), 0, 1)[0])
    app = make_client_app(str(cfg.features))

    def failing(m, ctx):
        if m.metadata.dst_node_id == bad and "train" in m.metadata.message_type:
            raise RuntimeError("this node is gone")
        return app(m, ctx)

    grid = InProcessGrid(failing, sim_nodes(cfg.clients))
    res = run_server(grid, cfg, ServerSettings(out=str(tmp_path / "err"), wait_timeout=5))
    rows = res.rows
    assert len(rows) == 3 and all(np.isfinite(accs(rows)))
    assert all(int(r["clients_trained"]) == 2 for r in rows)  # every update took two real client updates
    assert sum(int(r.get("failures") or 0) for r in rows) == 1 and str(bad - 1000) in rows[0]["failed_clients"]
