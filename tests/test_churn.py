"""``fedhead bench deploy``'s supervisor (fedhead/flower/churn.py), on fake node processes: which nodes it restarts."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")

from fedhead.flower.churn import GAVE_UP, HUNG_AFTER, Churn  # noqa: E402


class FakeProc:
    def __init__(self, code=None):
        self.code = code

    def poll(self):
        return self.code


def _churn(tmp_path, monkeypatch, nodes=3):
    ch = Churn(tmp_path, nodes, rounds=4, churn=0.0, kill_server_at=2, seed=0, round_timeout=10.0)
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
