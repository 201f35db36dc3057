"""``fedhead bench deploy``: a Flower federation of N SuperNodes on this machine, with nodes that die and come back
and a server that is killed and resumed, against the simulator's run of the same configuration.

The deployment is the one of fedhead/flower/DEPLOY.md (``fedhead flower superlink --features`` and one ``fedhead
flower supernode`` per client, each with its own share of a synthetic store, on loopback ports; the nodes pin
fedhead's own app with ``--app-sha256``, the SuperLink's Control API has a loopback port of its own). While it runs, after
each round the bench SIGKILLs the sessions of ``--churn`` x N nodes drawn at random (a machine that loses power: no
handler runs), and starts again the nodes it killed after the round before (a machine that comes back: the node
registers anew and the server learns its partition id again). After round ``--kill-server-at`` it SIGKILLs the
SuperLink's session (the server, its ServerApp and the Flower run) and starts the same command with ``--resume``; the
SuperLink keeps its state in memory, so the nodes find their registration gone and exit, and the bench starts them
again as a supervisor would (counted as node exits; a node still running 20 s after its log gave up is killed and
restarted, counted as a hang). (A SuperLink ``--database`` would keep the registrations, but
its SQLite file refused concurrent writes from 20 nodes on 2 cores: "database is locked", replies lost.)
The server keeps a checkpoint after every round, so the resumed run goes on from the last round it wrote; a node
that is down when its message arrives is a failure of that round (``--round-timeout``), which the run tolerates.

Reported (``deploy.json`` and a table): rounds completed, node kills and restarts, failed client messages, the final
accuracy and the simulator's (``fedhead train`` on the whole store, same options, no churn), whether rounds.csv
holds every round exactly once after the server's restart, peak resident memory per node (the node and the
ClientApp processes it starts), and seconds per round: each round's, and their mean by what the round ran under
(:data:`ROUND_KINDS`). A round with killed nodes ends when the SuperLink declares them unavailable (Flower's heartbeat:
a node is offline 2 x 30 s after its last heartbeat), sooner than ``--round-timeout`` where that is longer."""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from fedhead.core.synthetic import write_synthetic
from fedhead.federation.config import TrainConfig
from fedhead.federation.train import run_training
from fedhead.flower import asyncdeploy as A
from fedhead.flower.common import require_flower
from fedhead.flower.launch import own_app_sha256
from fedhead.flower.loopback import Deployment, free_ports, session_rss_kb, split_store
from fedhead.infra.console import stderr_console, stdout_console
from fedhead.infra.errors import FedheadError, Interval, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_json, atomic_write_text, check_out
from fedhead.interface.options import resolved_toml

STORE = dict(num_classes=10, test_per_class=20, dim=32, spread=2.2, seed=0)  # 40 training samples per node
GAVE_UP = "401 Unauthorized"  # a node's log: its registration is gone (the SuperLink restarted), so it shuts down
HUNG_AFTER = 20.0  # seconds after GAVE_UP a node that still runs is taken as hung in its shutdown and killed


def _rounds(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [r for r in csv.DictReader(f) if r.get("stage") != "ccvr"]


class Churn:
    """The deployment and its schedule of kills and restarts (see the module docstring)."""

    def __init__(self, out: Path, nodes: int, rounds: int, churn: float, kill_server_at: int, seed: int, **kw):
        self.out, self.nodes, self.rounds = out, nodes, rounds
        self.k = int(round(churn * nodes))
        self.kill_server_at = kill_server_at
        self.rng = np.random.default_rng(seed)
        self.round_timeout = kw["round_timeout"]
        self.delays = kw.get("delays") or [0.0] * nodes  # node -> its --delay (slow nodes: bench deploy --async)
        env = dict(os.environ, FLWR_HOME=str(out / "flwr-home"), FEDHEAD_NO_PROGRESS="1", FEDHEAD_THREADS="1")
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self.d = Deployment(out / "logs", env)
        self.kills = self.restarts = self.server_kills = self.exits = self.hung = 0
        self.log_seen = [0] * nodes  # how far each node's log has been read (its current start's part)
        self.gave_up: dict[int, float] = {}  # node -> when its log first showed GAVE_UP since it started
        self.down: list[int] = []
        self.peak_kb = [0] * nodes
        self.round_end: dict[int, float] = {}
        self.kind: dict[int, str] = {1: "first"}  # round -> what it ran under (see ROUND_KINDS)
        self.link = self.control = 0  # the nodes' port and the Control API's (start)
        self.app = ""  # the FAB sha256 the nodes pin (start)

    def node_argv(self, i: int) -> list[str]:
        return ["flower", "supernode", "--insecure", "--superlink", f"127.0.0.1:{self.link}", "--features",
                str(self.stores[i]), "--partition-id", str(i), "--port", str(self.ports[i]), "--device", "cpu",
                "--app-sha256", self.app,
                *(["--delay", f"{self.delays[i]:g}"] if self.delays[i] > 0 else [])]  # fmt: skip

    def link_argv(self, resume: bool) -> list[str]:
        return [
            "flower", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(self.link),
            "--control-api-address", f"127.0.0.1:{self.control}",
            "--config", str(self.experiment), "--out", str(self.out / "run"),
            "--wait-timeout", "300", "--round-timeout", str(self.round_timeout), *(["--resume"] if resume else []),
        ]  # fmt: skip

    def start(self, experiment: Path, stores: list[Path]) -> None:
        self.experiment, self.stores = experiment, stores
        self.app = own_app_sha256()  # the nodes run fedhead's app alone (pinned: built once, not by every node)
        self.link, self.control, *self.ports = free_ports(2 + self.nodes)
        for i in range(self.nodes):
            self._start_node(i)
        self.d.start("superlink", self.link_argv(resume=False))
        self.t0 = time.monotonic()

    def _start_node(self, i: int) -> None:
        log = self.d.log_path(f"node{i}")
        self.log_seen[i] = log.stat().st_size if log.exists() else 0
        self.gave_up.pop(i, None)
        self.d.start(f"node{i}", self.node_argv(i))

    def _gave_up_long_ago(self, i: int, now: float) -> bool:
        """Whether node ``i``'s log showed :data:`GAVE_UP` since its start more than :data:`HUNG_AFTER` s ago."""
        if i not in self.gave_up:
            with open(self.d.log_path(f"node{i}"), "rb") as f:
                f.seek(self.log_seen[i])
                new = f.read()
            cut = new.rfind(b"\n") + 1  # a line still being written is read again next time
            self.log_seen[i] += cut
            if GAVE_UP.encode() in new[:cut]:
                self.gave_up[i] = now
        return i in self.gave_up and now - self.gave_up[i] > HUNG_AFTER

    def _supervise(self, now: float | None = None) -> None:
        """Restart a node that exited on its own, as a supervisor (systemd, Kubernetes) would: after the SuperLink
        restarts with its state in memory, Flower's nodes find their registration gone (401) and exit. A node
        whose log gave up more than :data:`HUNG_AFTER` s ago but still runs hung in its shutdown (Flower 1.42: a
        second SIGINT from its heartbeat thread can interrupt the first one's handler); it is killed and restarted
        (counted as hung)."""
        now = time.monotonic() if now is None else now
        for i in range(self.nodes):
            p = self.d.procs.get(f"node{i}")
            if i in self.down or p is None:
                continue
            if p.poll() is not None:
                self._start_node(i)
                self.exits += 1
            elif self._gave_up_long_ago(i, now):
                self.d.kill(f"node{i}")
                self._start_node(i)
                self.hung += 1

    def _sample_memory(self) -> None:
        for i in range(self.nodes):
            p = self.d.procs.get(f"node{i}")
            if p is not None and p.poll() is None:
                self.peak_kb[i] = max(self.peak_kb[i], session_rss_kb(p.pid))

    def _after_round(self, rnd: int) -> None:
        """Bring back the nodes killed after the round before; kill ``k`` others; the server after its round."""
        for i in self.down:
            self._start_node(i)
            self.restarts += 1
        if rnd == self.kill_server_at and rnd < self.rounds:  # the server alone dies this time
            self.down = []
            self.kind[rnd + 1] = "after_server_restart"
            self.d.kill("superlink")
            self.server_kills += 1
            self.d.start("superlink", self.link_argv(resume=True))
            return
        up = [i for i in range(self.nodes) if i not in self.down]
        self.down = (
            sorted(self.rng.choice(up, size=min(self.k, len(up)), replace=False).tolist()) if rnd < self.rounds else []
        )
        self.kind[rnd + 1] = "nodes_down" if self.down else "all_up"
        for i in self.down:
            self.d.kill(f"node{i}")
            self.kills += 1

    def run(self, timeout: float, progress=None) -> int:
        """Until the SuperLink's run ends (its exit code) or ``timeout`` seconds pass (None)."""
        seen = 0
        while time.monotonic() - self.t0 < timeout:
            self._sample_memory()
            if self.d.procs["superlink"].poll() is None:
                self._supervise()
            rows = _rounds(self.out / "run" / "rounds.csv")
            done = max((int(r["round"]) for r in rows), default=0)
            while seen < done:
                seen += 1
                self.round_end[seen] = time.monotonic() - self.t0
                if progress:
                    progress(f"round {seen}/{self.rounds} done ({len(self.down)} node(s) were down)")
                self._after_round(seen)
            code = self.d.procs["superlink"].poll()
            if code is not None and (seen >= self.rounds or code != 0):
                return code
            time.sleep(0.5)
        return None


# what a round ran under: "first" (from the SuperLink's start: the nodes connect, the query, round 1), "nodes_down"
# (the nodes killed after the round before are gone: their messages wait until the SuperLink declares them
# unavailable), "all_up", "after_server_restart" (the server's restart, the nodes' new registrations, the query)
ROUND_KINDS = ("first", "nodes_down", "all_up", "after_server_restart")


def round_seconds(ch: Churn) -> dict:
    """Each round's wall time, and their mean by what the round ran under (:data:`ROUND_KINDS`; None where no
    round of that kind ran)."""
    rounds = sorted(ch.round_end)
    took = dict(zip(rounds, np.diff([0.0, *(ch.round_end[r] for r in rounds)]).tolist()))
    out: dict = {"deploy_round_seconds": [round(took[r], 1) for r in rounds]}
    for kind in ROUND_KINDS:
        these = [took[r] for r in rounds if ch.kind.get(r) == kind]
        out[f"deploy_seconds_round_{kind}"] = float(np.mean(these)) if these else None
    return out


def _report(ch: Churn, code, sim: dict) -> dict:
    rows = _rounds(ch.out / "run" / "rounds.csv")
    rounds = [int(r["round"]) for r in rows]
    ends = [ch.round_end[r] for r in sorted(ch.round_end)]
    per_round = float(np.diff([0.0, *ends]).mean()) if ends else None
    summary = (
        json.loads((ch.out / "run" / "summary.json").read_text()) if (ch.out / "run" / "summary.json").exists() else {}
    )
    failed = sum(int(r.get("failures") or 0) for r in rows)
    return {
        "deploy_nodes": ch.nodes,
        "deploy_rounds": ch.rounds,
        "deploy_exit_code": code,
        "deploy_rounds_completed": len(set(rounds)),
        "deploy_rounds_csv_complete": rounds == list(range(1, ch.rounds + 1)),
        "deploy_node_kills": ch.kills,
        "deploy_node_restarts": ch.restarts,
        "deploy_server_kills": ch.server_kills,
        "deploy_node_exits_restarted": ch.exits,
        "deploy_node_hangs_restarted": ch.hung,
        "deploy_failed_messages": failed,
        "deploy_final_accuracy": float(rows[-1]["accuracy"]) if rows else None,
        "deploy_summary_rounds": summary.get("rounds"),
        "simulator_final_accuracy": sim["final_accuracy"],
        "deploy_seconds_per_round": per_round,
        **round_seconds(ch),
        "deploy_wall_seconds": ends[-1] if ends else None,
        "deploy_peak_node_mb_max": max(ch.peak_kb) / 1024,
        "deploy_peak_node_mb_mean": float(np.mean(ch.peak_kb)) / 1024,
    }


def _table(rec: dict):
    from rich.table import Table

    t = Table(title=f"bench deploy: {rec['deploy_nodes']} SuperNodes on loopback, nodes killed and restarted")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for k, v in rec.items():
        shown = " ".join(f"{x:g}" for x in v) if isinstance(v, list) else "—" if v is None else str(v)
        t.add_row(k.removeprefix("deploy_"), f"{v:.4g}" if isinstance(v, float) else shown)
    return t


def _fresh_out(out: Path) -> None:
    check_out(out, kind="dir")
    if out.exists() and any(out.iterdir()):
        raise FedheadError(f"The '--out' parameter {str(out)!r} already holds files. Choose an empty or new folder.")
    out.mkdir(parents=True, exist_ok=True)


def _churn_run(out: Path, nodes: int, cfg: TrainConfig, stores: list[Path], churn: float, kill_server_at: int,
               seed: int, round_timeout: float, timeout: float) -> None:  # fmt: skip
    """The default bench: the simulator's run, then the deployment under churn (the module docstring)."""
    err = stderr_console()
    err.print(f"[bold]bench deploy[/]: the simulator's run of the same configuration ({nodes} clients, no churn)")
    experiment = out / "experiment.toml"  # the one configuration of both runs: the simulator's and the SuperLink's
    atomic_write_text(experiment, resolved_toml(cfg))
    sim = run_training(cfg, out=out / "simulator", progress=False).summary
    ch = Churn(out, nodes, cfg.rounds, churn, kill_server_at or cfg.rounds // 2, seed, round_timeout=round_timeout)
    err.print(f"[bold]bench deploy[/]: a SuperLink and {nodes} SuperNodes on loopback (logs in {out / 'logs'})")
    try:
        ch.start(experiment, stores)
        code = ch.run(timeout, progress=lambda s: err.print(f"[bold]bench deploy[/]: {s}"))
    finally:
        ch.d.close()
    rec = _report(ch, code, sim)
    atomic_write_json(out / "deploy.json", rec)
    stdout_console().print(_table(rec))
    if code != 0:
        raise FedheadError(
            f"The deployment did not finish (SuperLink exit code {code}); its log is {out / 'logs' / 'superlink.log'}."
        )


def _run_mode(out: Path, cfg: TrainConfig, stores: list[Path], delays: list[float], kw: dict, progress) -> dict:
    """One mode's deployment (no churn, no server kill) until its SuperLink ends; its rows, round ends, exit code."""
    out.mkdir(parents=True, exist_ok=True)
    experiment = out / "experiment.toml"
    atomic_write_text(experiment, resolved_toml(cfg))
    ch = Churn(out, len(stores), cfg.rounds, 0.0, cfg.rounds, kw["seed"], round_timeout=kw["round_timeout"],
               delays=delays)  # fmt: skip
    t0 = time.monotonic()
    try:
        ch.start(experiment, stores)
        code = ch.run(kw["timeout"], progress=progress)
    finally:
        ch.d.close()
    return {"rows": _rounds(out / "run" / "rounds.csv"), "ends": ch.round_end, "code": code,
            "total_s": time.monotonic() - t0}  # fmt: skip


def _async_run(out: Path, cfg: TrainConfig, stores: list[Path], slow: float, slow_delay: float, buffer: int,
               target: float, **kw) -> None:  # fmt: skip
    """``--async``: sync rounds, then FedBuff, on the same nodes with the same slow ones (:mod:`.asyncdeploy`)."""
    err = stderr_console()
    nodes = len(stores)
    slow_ids = A.slow_nodes(nodes, slow, kw["seed"])
    delays = [slow_delay if i in slow_ids else 0.0 for i in range(nodes)]
    results = {}
    for mode, mcfg in A.mode_configs(cfg, buffer).items():
        err.print(f"[bold]bench deploy --async[/]: {mode}, {mcfg.rounds} server updates, {nodes} SuperNodes "
                  f"(slow: {slow_ids}, --delay {slow_delay:g} s; logs in {out / mode / 'logs'})")  # fmt: skip
        results[mode] = _run_mode(out / mode, mcfg, stores, delays, kw,
                                   lambda s, m=mode: err.print(f"[bold]bench deploy --async[/]: {m}: {s}"))  # fmt: skip
    rec = {"deploy_nodes": nodes, "deploy_slow_nodes": slow_ids, "deploy_slow_delay": slow_delay,
           "deploy_rounds": cfg.rounds, "fedbuff_buffer_size": buffer, "fedbuff_concurrency": nodes,
           "target": target, **A.summarize(results, target)}  # fmt: skip
    atomic_write_json(out / "deploy.json", rec)
    title = (f"bench deploy --async: {nodes} SuperNodes on loopback, {len(slow_ids)} slow (+{slow_delay:g} s); "
             f"FedBuff K={buffer}, concurrency {nodes}")  # fmt: skip
    stdout_console().print(A.async_table(rec, title))
    bad = {m: r["code"] for m, r in results.items() if r["code"] != 0}
    if bad:
        mode = next(iter(bad))
        raise FedheadError(
            f"The {mode} deployment did not finish (SuperLink exit code {bad[mode]}); its log is "
            f"{out / mode / 'logs' / 'superlink.log'}."
        )
    empty = {m: rec[f"{m}_empty_updates"] for m in results if rec[f"{m}_empty_updates"]}
    if empty:  # e.g. FedBuff pushing to nodes that re-registered under new ids: every reply the SuperLink's error
        mode = next(iter(empty))
        raise FedheadError(
            f"The {mode} run applied {empty[mode]} server update(s) without any client update (every reply an "
            f"error); the comparison is void. Read {out / mode / 'run' / 'rounds.csv'} (failure_reason) and rerun."
        )


def _check_async(async_: bool, nodes: int, churn, kill_server_at: int, slow, slow_delay: float, buffer, rt: float):
    """The options of ``--async`` (and none of them without it); returns (churn, slow, buffer) filled in."""
    if not async_:
        for name, value in (("--slow", slow), ("--buffer", buffer)):
            if value is not None:
                raise FedheadError(
                    f"The '{name}' option belongs to --async. Got {name} {value:g} without it. Add --async or drop it."
                )
        return 0.2 if churn is None else churn, 0.0, None
    for name, value in (("--churn", churn), ("--kill-server-at", kill_server_at or None)):
        if value is not None:
            raise FedheadError(
                f"The '{name}' option is not part of --async (the sync / FedBuff comparison runs without churn). "
                f"Got {name} {value:g} with --async. Drop one of them."
            )
    slow = 0.2 if slow is None else slow
    validate("--slow", slow, Interval(0, 1, closed="left"))
    validate("--slow-delay", slow_delay, Interval(0, rt, closed="left"), "Keep it below --round-timeout.")
    buffer = max(1, nodes // 2) if buffer is None else buffer
    validate("--buffer", buffer, Interval(1, nodes, integer=True), "FedBuff's K is at most the nodes in flight.")
    return 0.0, slow, buffer


@cli_errors
def deploy_cmd(
    nodes: int = typer.Option(20, "--nodes", help="SuperNodes (one client each)"),
    rounds: int = typer.Option(6, "--rounds", help="rounds (--async: the synchronous run's)"),
    churn: Optional[float] = typer.Option(
        None, "--churn", help="share of the nodes killed after each round (back after the next) \\[default: 0.2]"
    ),
    kill_server_at: int = typer.Option(
        0, "--kill-server-at", help="kill the SuperLink after this round and resume it (0: half of --rounds)"
    ),
    round_timeout: float = typer.Option(60.0, "--round-timeout", help="seconds a round waits for a node's reply"),
    local_epochs: int = typer.Option(1, "--local-epochs", help="local epochs"),
    seed: int = typer.Option(0, "--seed", help="which nodes are killed (--async: which are slow)"),
    async_: bool = typer.Option(
        False, "--async", help="synchronous rounds against FedBuff on the same nodes, --slow of them slow; no churn"
    ),
    slow: Optional[float] = typer.Option(
        None, "--slow", help="--async: share of the nodes that are slow \\[default: 0.2]"
    ),
    slow_delay: float = typer.Option(30.0, "--slow-delay", help="--async: seconds a slow node's train replies wait"),
    buffer: Optional[int] = typer.Option(
        None, "--buffer", help="--async: FedBuff's K (concurrency: every node) \\[default: half the nodes]"
    ),
    target: float = typer.Option(0.95, "--target", help="--async: time to this fraction of the best final accuracy"),
    timeout: float = typer.Option(3600.0, "--timeout", help="give up after this many seconds"),
    out: Path = typer.Option(Path("reports/bench-deploy"), "--out", help="folder: stores, logs, the run, deploy.json"),
):
    """A loopback Flower deployment under churn: N SuperNodes killed and restarted, the server killed and resumed.

    With --async: synchronous rounds against FedBuff on the same nodes, some of them slow, without churn."""
    require_flower()
    validate("--nodes", nodes, Interval(2, None, integer=True))
    validate("--rounds", rounds, Interval(2, None, integer=True))
    churn, slow, buffer = _check_async(async_, nodes, churn, kill_server_at, slow, slow_delay, buffer, round_timeout)
    validate("--churn", churn, Interval(0, 1, closed="left"))
    validate("--kill-server-at", kill_server_at, Interval(0, rounds - 1, integer=True))
    validate("--round-timeout", round_timeout, Interval(0, None, closed="neither"))
    validate("--local-epochs", local_epochs, Interval(1, None, integer=True))
    validate("--target", target, Interval(0, 1, closed="right"))
    validate("--timeout", timeout, Interval(0, None, closed="neither"))
    _fresh_out(out)
    server = write_synthetic(out / "server.h5", train_per_class=4 * nodes, **STORE)
    stores = split_store(server, out, nodes)
    cfg = TrainConfig(features=str(server), clients=nodes, rounds=rounds, partition="iid", local_epochs=local_epochs,
                      batch_size=10)  # fmt: skip
    if async_:
        _async_run(out, cfg, stores, slow, slow_delay, buffer, target, seed=seed, round_timeout=round_timeout,
                   timeout=timeout)  # fmt: skip
    else:
        _churn_run(out, nodes, cfg, stores, churn, kill_server_at, seed, round_timeout, timeout)
