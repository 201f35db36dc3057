"""A real Flower deployment on loopback: one SuperLink and 3 SuperNodes as subprocesses, each node with its
own tiny feature store, 2 rounds; node 1 crashes in round 2 (the round completes with the other two and the
failure is recorded in rounds.csv). Bounded in time; every process started here is killed at the end."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")

from extract.store import load_store, write_store  # noqa: E402
from fedhead.synthetic import write_synthetic  # noqa: E402

FEDHEAD = str(Path(sys.executable).parent / "fedhead")
TIMEOUT = 300


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def node_stores(tmp: Path, k: int) -> tuple[Path, list[Path]]:
    """The server's store and ``k`` node stores, each with a disjoint third of the training images."""
    server = write_synthetic(tmp / "server.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16)
    s = load_store(server)
    attrs = {k_: s.info.attrs[k_] for k_ in ("dataset", "encoder", "weights_source", "weights_sha256",
                                              "preprocessing", "image_size")}
    paths = []
    for i in range(k):
        idx = np.arange(i, len(s.train_y), k)
        paths.append(write_store(tmp / f"node{i}.h5", train=(s.train_x[idx], s.train_y[idx]),
                                 test=(s.test_x[:2], s.test_y[:2]), class_names=s.info.class_names,
                                 attrs=attrs, request={"node": i}))
    return server, paths


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(5)


@pytest.mark.slow
def test_superlink_and_three_supernodes_on_loopback(tmp_path):
    server, stores = node_stores(tmp_path, 3)
    link_port, *node_ports = free_ports(4)
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr-home"), FEDHEAD_NO_PROGRESS="1")
    env.pop("FEDHEAD_FLOWER_CRASH", None)
    out = tmp_path / "run"
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for i, (store, port) in enumerate(zip(stores, node_ports)):
            node_env = dict(env, FEDHEAD_FLOWER_CRASH="1@2") if i == 1 else env
            log = open(tmp_path / f"node{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                [FEDHEAD, "flower", "supernode", "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                 "--features", str(store), "--partition-id", str(i), "--port", str(port), "--device", "cpu"],
                env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log = open(tmp_path / "superlink.log", "w")
        logs.append(log)
        link = subprocess.Popen(
            [FEDHEAD, "flower", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(link_port),
             "--features", str(server), "--clients", "3", "--rounds", "2", "--local-epochs", "2",
             "--batch-size", "10", "--partition", "iid", "--out", str(out), "--wait-timeout", "120",
             "--round-timeout", "120"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(link)
        try:
            code = link.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        text = (tmp_path / "superlink.log").read_text()
        assert code == 0, f"superlink run failed (exit {code}):\n{text[-4000:]}"
    finally:
        stop_all(procs)
        for log in logs:
            log.close()

    with open(out / "rounds.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["round"]) for r in rows] == [1, 2]
    assert rows[0]["failures"] == "0" and rows[0]["clients_trained"] == "3"
    assert rows[1]["failures"] == "1" and rows[1]["failed_clients"] == "1"
    assert "injected crash" in rows[1]["failure_reason"]
    assert rows[1]["clients_trained"] == "2"
    assert all(0.0 < float(r["accuracy"]) <= 1.0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runtime"] == "flower" and summary["failures"] == 1 and summary["rounds"] == 2
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["runtime"] == "flower"
    assert (out / "head-seed0.pt").exists() and not (out / "checkpoint.pt").exists()
    sizes = [int(r["size"]) for r in csv.DictReader(open(out / "clients.csv"))]
    assert sizes == [40, 40, 40]
