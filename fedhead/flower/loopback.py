"""A Flower deployment on one machine: the processes of ``fedhead flower superlink`` and ``fedhead flower supernode``
on loopback ports, each in its own session with its own log (``fedhead bench deploy`` and the deployment tests).

Nothing here imports flwr: the processes do."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from extract.store import load_store, write_store

FEDHEAD = str(Path(sys.executable).parent / "fedhead")


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now (bound together, then released)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def split_store(server: Path, folder: Path, k: int, test_rows: int = 2) -> list[Path]:
    """``k`` node stores in ``folder``, node ``i`` holding training rows ``i, i+k, ...`` of ``server`` (disjoint,
    the same classes and encoder record) and its first ``test_rows`` test rows."""
    s = load_store(server)
    keys = ("dataset", "encoder", "weights_source", "weights_sha256", "preprocessing", "image_size")
    attrs = {key: s.info.attrs[key] for key in keys}
    paths = []
    for i in range(k):
        idx = np.arange(i, len(s.train_y), k)
        paths.append(
            write_store(
                folder / f"node{i}.h5",
                train=(s.train_x[idx], s.train_y[idx]),
                test=(s.test_x[:test_rows], s.test_y[:test_rows]),
                class_names=s.info.class_names,
                attrs=attrs,
                request={"node": i},
            )
        )
    return paths


def stop_all(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
    """``sig`` to each process's session, then SIGKILL to those still running after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(5)


def session_rss_kb(pid: int) -> int:
    """Resident memory (kB) of the processes of ``pid``'s session (a node and the ClientApp processes it started)."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) != pid:
                continue
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError, ProcessLookupError):
            continue
    return total


class Deployment:
    """Processes of one loopback deployment, each in its own session with its own log file; :meth:`close`
    kills them all (TERM, then KILL) whatever happened."""

    def __init__(self, tmp: Path, env: dict):
        self.tmp, self.env = Path(tmp), env
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []

    def log_path(self, name: str) -> Path:
        """The log file of ``name`` (every start of it appends there)."""
        return self.tmp / f"{name}.log"

    def start(self, name: str, argv: list[str], **env: str) -> subprocess.Popen:
        log = open(self.log_path(name), "a")
        self.logs.append(log)
        p = subprocess.Popen(
            [FEDHEAD, *argv], env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs[name] = p
        return p

    def kill(self, name: str) -> None:
        """SIGKILL ``name``'s whole session (a machine that dies: no handler runs)."""
        stop_all([self.procs[name]], signal.SIGKILL, grace=10.0)

    def log(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")

    def wait(self, name: str, timeout: float) -> int | None:
        """The exit code of ``name``, or None if it still runs after ``timeout`` seconds."""
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_for(self, name: str, text: str, count: int = 1, timeout: float = 120) -> None:
        """Until ``name``'s log holds ``text`` ``count`` times (fails if it exits first or time runs out)."""
        t0 = time.monotonic()
        while self.log(name).count(text) < count:
            p = self.procs[name]
            assert p.poll() is None, f"{name} exited ({p.returncode}) before {text!r}:\n{self.log(name)[-3000:]}"
            assert time.monotonic() - t0 < timeout, f"no {text!r} from {name} in {timeout} s:\n{self.log(name)[-3000:]}"
            time.sleep(0.2)

    def close(self) -> None:
        stop_all(list(self.procs.values()))
        for log in self.logs:
            log.close()
