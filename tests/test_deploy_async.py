"""``fedhead bench deploy --async`` (fedhead/flower/asyncdeploy.py): synchronous rounds against FedBuff with slow
SuperNodes (``fedhead flower supernode --delay``). The configurations and the report on toy rows here; one tiny real
deployment (three nodes, one slow) is slow-marked (tests/conftest.py SLOW). No assertion on which mode is faster:
only that a synchronous round waits for the slow node's delay, a lower bound the sleep itself sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")

from fedhead.federation.config import TrainConfig  # noqa: E402
from fedhead.flower.asyncdeploy import mode_configs, slow_nodes, summarize  # noqa: E402


def test_both_modes_get_the_same_client_work():
    base = TrainConfig(features="x.h5", clients=8, rounds=4, partition="iid")
    cfgs = mode_configs(base, 4)
    assert cfgs["sync"] is base and cfgs["fedbuff"].rounds == 8  # 4 rounds x 8 clients = 8 updates x 4
    assert (cfgs["fedbuff"].async_rule, cfgs["fedbuff"].buffer_size, cfgs["fedbuff"].concurrency) == ("fedbuff", 4, 8)
    assert mode_configs(base, 3)["fedbuff"].rounds == 11  # ceil(32 / 3): at least the synchronous work


def test_the_slow_nodes_are_a_seeded_share():
    assert slow_nodes(10, 0.2, 0) == slow_nodes(10, 0.2, 0) and len(slow_nodes(10, 0.2, 0)) == 2
    assert slow_nodes(8, 0.0, 0) == [] and len(slow_nodes(3, 0.34, 1)) == 1


def _rows(accs, clients, stale=None):
    return [{"round": str(i + 1), "accuracy": str(a), "clients_trained": str(c),
             **({} if stale is None else {"staleness_mean": str(stale[i])})}
            for i, (a, c) in enumerate(zip(accs, clients))]  # fmt: skip


def test_the_report_on_toy_rows():
    results = {
        "sync": {"rows": _rows([0.5, 0.8], [4, 4]), "ends": {1: 10.0, 2: 30.0}, "code": 0},
        "fedbuff": {
            "rows": _rows([0.4, 0.7, 0.78, 0.79], [2, 2, 2, 2], [0, 0, 1, 0.5]),
            "ends": {1: 5.0, 2: 9.0, 3: 12.0, 4: 16.0},
            "code": 0,
        },
    }
    rec = summarize(results, 0.95)
    assert rec["target_accuracy"] == pytest.approx(0.76)
    assert (rec["sync_server_updates"], rec["sync_client_updates"], rec["fedbuff_client_updates"]) == (2, 8, 8)
    assert (rec["sync_wall_seconds"], rec["fedbuff_wall_seconds"]) == (30.0, 16.0)
    assert (rec["sync_seconds_to_target"], rec["fedbuff_seconds_to_target"]) == (30.0, 12.0)
    assert rec["sync_staleness_mean"] == 0.0 and rec["fedbuff_staleness_mean"] == pytest.approx(1.5 * 2 / 8)
    assert rec["sync_empty_updates"] == 0 and rec["fedbuff_empty_updates"] == 0
    assert rec["sync_round_seconds"] == [10.0, 20.0] and rec["fedbuff_round_seconds"] == [5.0, 4.0, 3.0, 4.0]
    never = summarize({**results, "sync": {**results["sync"], "rows": _rows([0.5, 0.6], [4, 0])}}, 0.95)
    assert never["sync_seconds_to_target"] is None and never["sync_empty_updates"] == 1


@pytest.mark.slow
def test_bench_deploy_async_on_three_nodes_one_slow(tmp_path):
    out, delay = tmp_path / "bench", 3.0
    env = dict(os.environ, FEDHEAD_NO_PROGRESS="1")
    cmd = [sys.executable, "-m", "cli", "bench", "deploy", "--async", "--nodes", "3", "--rounds", "2", "--slow", "0.34",
           "--slow-delay", str(delay), "--buffer", "2", "--round-timeout", "120", "--timeout", "900", "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=2400)
    assert p.returncode == 0, p.stderr[-4000:]
    rec = json.loads((out / "deploy.json").read_text())
    assert len(rec["deploy_slow_nodes"]) == 1 and rec["fedbuff_buffer_size"] == 2
    assert (rec["sync_exit_code"], rec["fedbuff_exit_code"]) == (0, 0)
    assert (rec["sync_server_updates"], rec["fedbuff_server_updates"]) == (2, 3)  # ceil(2 x 3 / 2)
    # 6 client updates each when every reply comes; a node the SuperLink declares unavailable on a loaded machine
    # (no heartbeat) is a failure of its round, which the run tolerates
    assert 0 < rec["sync_client_updates"] <= 6 and 0 < rec["fedbuff_client_updates"] <= 6
    assert rec["sync_staleness_mean"] == 0.0 and rec["fedbuff_staleness_mean"] >= 0.0
    assert all(0.0 < rec[f"{m}_final_accuracy"] <= 1.0 for m in ("sync", "fedbuff"))
    if rec["sync_client_updates"] == 6:  # every round had the slow node's reply: each waited for its delay
        assert rec["sync_wall_seconds"] >= 2 * delay
    assert "fedbuff" in p.stdout and "server_updates" in p.stdout
