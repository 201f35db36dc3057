"""``fedhead bench deploy``'s supervisor (fedhead/flower/churn.py), on fake node processes: which nodes it restarts."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")

from fedhead.flower.churn import GAVE_UP, HUNG_AFTER, Churn, round_seconds  # noqa: E402


class FakeProc:
    def __init__(self, code=None):
        self.code = code

    def poll(self):
        return self.code


def _churn(tmp_path, monkeypatch, nodes=3, churn=0.0, rounds=4):
    ch = Churn(tmp_path, nodes, rounds=rounds, churn=churn, kill_server_at=2, seed=0, round_timeout=10.0)
    started, killed = [], []

    def start(name, argv):
        started.append(name)
        ch.d.procs[name] = FakeProc()
        (tmp_path / "logs" / f"{name}.log").open("a").write("INFO: Starting Flower SuperNode\n")

    monkeypatch.setattr(ch.d, "start", start)
    monkeypatch.setattr(ch.d, "kill", lambda name: (killed.append(name), setattr(ch.d.procs[name], "code", -9)))
    monkeypatch.setattr(ch, "node_argv", lambda i: [f"node{i}"])
    for i in range(nodes):
        ch._start_node(i)
    started.clear()
    return ch, started, killed


def _log(tmp_path, i, text):
    with open(tmp_path / "logs" / f"node{i}.log", "a") as f:
        f.write(text)


def test_the_supervisor_restarts_nodes_that_exited_and_leaves_the_killed_ones_down(tmp_path, monkeypatch):
    ch, started, killed = _churn(tmp_path, monkeypatch)
    ch.d.procs["node0"].code = 1  # exited on its own: restarted
    ch.d.procs["node2"].code = -9
    ch.down = [2]  # killed by the schedule: stays down until the next round
    ch._supervise(now=0.0)
    assert started == ["node0"] and killed == [] and ch.exits == 1 and ch.hung == 0


def test_a_node_still_running_long_after_its_log_gave_up_is_killed_and_restarted(tmp_path, monkeypatch):
    ch, started, killed = _churn(tmp_path, monkeypatch)
    _log(tmp_path, 1, f"httpx.HTTPStatusError: Client error '{GAVE_UP}' for url\nINFO: SuperExec terminated\n")
    _log(tmp_path, 2, f"Client error '{GAVE_UP[:5]}")  # half a line: not read until it ends
    ch._supervise(now=100.0)
    assert started == [] and killed == []  # it may still be shutting down
    ch._supervise(now=100.0 + HUNG_AFTER / 2)
    assert started == [] and killed == []
    _log(tmp_path, 2, f"{GAVE_UP[5:]}' for url\n")
    ch._supervise(now=101.0 + HUNG_AFTER)
    assert killed == ["node1"] and started == ["node1"] and ch.hung == 1 and ch.exits == 0
    ch._supervise(now=102.0 + HUNG_AFTER)  # the restarted node's log part holds no give-up yet: left alone
    assert killed == ["node1"] and ch.hung == 1
    ch._supervise(now=200.0)
    assert killed == ["node1", "node2"] and ch.hung == 2  # node2's give-up, once its line ended
    ch.d.procs["node1"].code = 0  # a node that gave up and then exited: an exit, not a hang
    _log(tmp_path, 1, f"{GAVE_UP}\n")
    ch._supervise(now=300.0)
    assert started[-1] == "node1" and ch.exits == 1 and ch.hung == 2


def test_each_round_is_timed_under_what_it_ran(tmp_path, monkeypatch):
    """Rounds 1-5 of 5 nodes, one killed after each round and the server after round 2: the first round, a round with
    a node down, the round after the server's restart, then two with a node down; means by kind."""
    ch, started, killed = _churn(tmp_path, monkeypatch, nodes=5, churn=0.2, rounds=5)
    ch.link, ch.experiment = 0, tmp_path / "experiment.toml"
    ch.d.start("superlink", ["superlink"])
    for rnd, end in zip(range(1, 6), (100.0, 160.0, 300.0, 350.0, 410.0)):
        ch.round_end[rnd] = end
        ch._after_round(rnd)
    assert [ch.kind[r] for r in range(1, 6)] == [
        "first",
        "nodes_down",
        "after_server_restart",
        "nodes_down",
        "nodes_down",
    ]
    assert len(killed) == 1 + 1 + 1 + 1 and killed.count("superlink") == 1  # no node killed after the last round
    got = round_seconds(ch)
    assert got["deploy_round_seconds"] == [100.0, 60.0, 140.0, 50.0, 60.0]
    assert got["deploy_seconds_round_first"] == 100.0 and got["deploy_seconds_round_after_server_restart"] == 140.0
    assert got["deploy_seconds_round_nodes_down"] == pytest.approx((60.0 + 50.0 + 60.0) / 3)
    assert got["deploy_seconds_round_all_up"] is None
