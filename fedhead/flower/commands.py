"""``fedhead flower simulate|superlink|supernode`` and ``fedhead bench flower``.

This module does not import flwr at import time (the core CLI registers it without the extra); each command
calls :func:`fedhead.flower.common.require_flower` first.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import typer

from extract.store import load_store, open_store
from fedhead.core.synthetic import validate_synthetic, write_synthetic
from fedhead.federation.config import TrainConfig, applicable
from fedhead.federation.train import head_run_dir, labels_store, run_training, validate_config
from fedhead.flower.common import require_flower, run_config_values
from fedhead.flower.launch import (  # noqa: F401 (stage_app: where it was)
    app_source,
    check_auth_public_keys,
    flower_env,
    flower_exe,
    is_loopback,
    refuse_insecure_off_loopback,
    split_address,
    stage_app,
    tls_args,
)
from fedhead.infra.console import stdout_console
from fedhead.infra.errors import FedheadError, Interval, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_json, check_out
from fedhead.infra.locks import exclusive_writer
from fedhead.infra.signals import Interrupted, signals_flag
from fedhead.interface.options import ExperimentArgs, resolved_toml, with_experiment_options
from fedhead.interface.tables import SUMMARY_COLUMNS, results_table

# ---------------------------------------------------------------- the options of `fedhead train`

# The training options of `fedhead flower simulate` and `superlink` are those of `fedhead train`
# (fedhead.interface.options, from the experiment table); simulated clients run on the CPU unless told.
FLOWER_DEFAULTS = {"device": ("cpu", "cpu")}


def run_config_of(cfg: TrainConfig, out: Path, resume: bool, round_timeout: float, wait_timeout: float) -> dict:
    """The Flower run config (``[tool.flwr.app.config]`` keys) for a TrainConfig: what ``flwr run -c`` gets."""
    return {
        **run_config_values(cfg),
        "features": str(Path(cfg.features).resolve()),
        "out": str(out.resolve()),
        "resume": resume,
        "round-timeout": float(round_timeout),
        "wait-timeout": float(wait_timeout),
    }


# ---------------------------------------------------------------- simulation


def check_simulation(
    cfg: TrainConfig,
    out: Path | None,
    resume: bool,
    round_timeout: float,
    num_cpus: int | None,
    client_cpus: float,
    client_store: str | None = None,
):
    """Everything :func:`simulate` can refuse without Ray, checked before Ray starts (Flower's simulation
    prints its warnings and Ray's logs, and takes 15 s or more, before the ServerApp would find a bad input):
    the server's store and the configuration as the ServerApp validates them, the checks of ``fedhead
    train`` against the store the virtual clients slice (the whole training split is here, unlike on a real
    server), the simulation's own options, and the state of ``out`` (``resume``). Returns the loaded server
    store (handed to the ServerApp, which need not load it again)."""
    from fedhead.flower.strategy import validate_server_config

    validate("--round-timeout", round_timeout, Interval(0, None, closed="neither"))
    validate("--client-cpus", client_cpus, Interval(0, None, closed="neither"))
    if num_cpus is not None:
        validate("--num-cpus", num_cpus, Interval(1, None, integer=True))
    cfg.resolved()  # names and ranges: before the store is read
    store = load_store(cfg.features, "--features")
    train_store = store if client_store is None else load_store(client_store, "--features")
    validate_config(cfg, train_store)  # --device included
    resolved = validate_server_config(cfg, store)
    if out is not None:
        _check_run_dir(check_out(out, kind="dir"), resume, resolved, store)
    return store


def _check_run_dir(out: Path, resume: bool, cfg: TrainConfig, store) -> None:
    """``--out`` as ``fedhead train`` takes it: without ``--resume`` empty or absent; with it, a run of the
    same configuration (a checkpoint, or a finished run that is reported again)."""
    head_run_dir(cfg, store, out, resume).open()


def simulate(
    cfg: TrainConfig,
    out: Path | None = None,
    resume: bool = False,
    round_timeout: float = 600.0,
    num_cpus: int | None = None,
    client_cpus: float = 1.0,
    client_store: str | None = None,
):
    """Run ``cfg`` on Flower's simulation engine (Ray), one virtual SuperNode per client; returns RunOutcome.
    Every input is checked (:func:`check_simulation`) before Ray starts."""
    require_flower()
    from flwr.simulation import run_simulation

    from fedhead.flower.client_app import make_client_app
    from fedhead.flower.node import NODE_STATE
    from fedhead.flower.server_app import make_server_app
    from fedhead.flower.strategy import ServerSettings

    store = check_simulation(cfg, out, resume, round_timeout, num_cpus, client_cpus, client_store)
    results: list = []
    # virtual SuperNodes are Ray actors started by the first message (imports included: over 2 minutes on
    # a loaded 2-core machine), so the first query gets the round's time limit, not the connect limit
    settings = ServerSettings(
        out=str(out) if out else None, resume=resume, round_timeout=round_timeout, wait_timeout=round_timeout
    )
    ncpu = num_cpus or os.cpu_count() or 1
    node_state = Path(out).resolve() / NODE_STATE if out else None  # SCAFFOLD's c_k of the virtual nodes
    backend = {
        "client_resources": {"num_cpus": float(client_cpus), "num_gpus": 0.0},
        "init_args": {
            "num_cpus": int(ncpu),
            "include_dashboard": False,
            "logging_level": "ERROR",
            "log_to_driver": True,
        },
    }
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    # Ray's driver aborts the process on SIGTERM; start Ray here (Flower then reuses it) and put fedhead's
    # handlers over Ray's: a signal sets a flag that the strategy checks after each round's checkpoint
    import ray

    if not ray.is_initialized():
        pythonpath = os.pathsep.join(sys.path + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        os.environ["PYTHONPATH"] = pythonpath
        ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **backend["init_args"])
    with signals_flag():
        run_simulation(
            make_server_app(cfg, settings, results, store=store),
            make_client_app(
                client_store if client_store is not None else cfg.features, str(node_state) if node_state else None
            ),
            num_supernodes=cfg.clients,
            backend_config=backend,
        )
    if not results:
        raise FedheadError(
            "The Flower simulation ended without a result (see the log above). Re-run with FEDHEAD_DEBUG=1 for details."
        )
    if isinstance(results[0], BaseException):
        raise results[0]
    if node_state:  # the virtual nodes' SCAFFOLD variates are needed only to resume an unfinished run
        shutil.rmtree(node_state, ignore_errors=True)
    return results[0]


def _print_summary(title: str, summary: dict) -> None:
    cols = SUMMARY_COLUMNS + [("failures", "failures")]
    stdout_console().print(results_table(title, [summary], cols))


@cli_errors
@with_experiment_options(defaults=FLOWER_DEFAULTS, run_options=("out", "resume", "round_timeout"), config=True)
def simulate_cmd(
    num_cpus: Optional[int] = typer.Option(None, help="CPUs Ray may use \\[default: all]"),
    client_cpus: float = typer.Option(1.0, help="CPUs per virtual client (Ray actor)"),
    *,
    experiment: ExperimentArgs,
    out: Optional[Path] = None,
    resume: bool = False,
    round_timeout: float = 600.0,
):
    """Run the same job as 'fedhead train' on Flower's simulation engine (one virtual SuperNode per client)."""
    cfg = experiment.train_config("flower")
    if experiment.print_config:
        typer.echo(resolved_toml(cfg), nl=False)
        return
    if resume and out is None:
        raise FedheadError("The '--resume' option needs --out naming the interrupted run's directory. Got none.")
    out = Path(
        out
        or Path("runs") / time.strftime(f"%Y%m%d-%H%M%S-flower-{cfg.resolved().head}-{cfg.partition.replace(':', '-')}")
    )
    check_out(out, kind="dir")  # before the lock beside it (simulate checks everything else)
    with exclusive_writer(out, f"the run directory {str(out)!r}"):
        try:
            res = simulate(cfg, out, resume, round_timeout, num_cpus, client_cpus)
        except Interrupted as exc:
            raise Interrupted(
                exc.signum,
                f"interrupted; the checkpoint in {str(out)!r} is consistent: re-run the "
                f"same command with --resume --out {out} to continue",
            ) from None
    _print_summary(f"fedhead flower simulate — {res.run_dir}", res.summary)


# ---------------------------------------------------------------- deployment


@contextlib.contextmanager
def flwr_connection(address: str, insecure: bool, root_cert: Optional[Path] = None):
    """A throw-away FLWR_HOME whose ``config.toml`` names the SuperLink ``address`` as connection ``fedhead``
    (what ``flwr run`` and ``flwr supernode register`` read)."""
    import tomli_w

    with tempfile.TemporaryDirectory(prefix="fedhead-flwr-") as home:
        conn = {"address": address}
        if insecure:
            conn["insecure"] = True
        if root_cert:
            conn["root-certificates"] = str(Path(root_cert).expanduser().resolve())
        Path(home, "config.toml").write_text(tomli_w.dumps({"superlink": {"default": "fedhead", "fedhead": conn}}))
        yield home


def register_supernodes(home: str, keys: list[tuple[str, bytes]], env: dict, parallel: int = 4) -> None:
    """``flwr supernode register`` every key with the SuperLink of ``home``'s connection (Flower's CLI-managed
    SuperNode authentication: with ``--enable-supernode-auth`` only registered keys may join); ``parallel``
    registrations at a time."""
    import json

    e = dict(env, FLWR_HOME=home)
    todo = list(enumerate(keys))
    while todo:
        batch, todo = todo[:parallel], todo[parallel:]
        running = []
        for i, (label, line) in batch:
            keyfile = Path(home, f"supernode-{i}.pub")
            keyfile.write_bytes(line + b"\n")
            running.append(
                (
                    label,
                    subprocess.Popen(
                        [flower_exe("flwr"), "supernode", "register", str(keyfile), "fedhead", "--format", "json"],
                        env=e,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    ),
                )
            )
        for label, proc in running:
            out, err = proc.communicate()
            try:
                res = json.loads(out[out.index("{") :])
            except ValueError:
                res = {"success": False, "error-message": (err or out).strip()}
            why = " ".join(str(res.get("error-message", "")).replace("Using SuperLink: fedhead", "").split())
            if "Public key already in use" in why:  # a --database SuperLink that registered it before
                print(f"fedhead: the SuperNode key in {label} was already registered", file=sys.stderr)
            elif proc.returncode != 0 or not res.get("success"):
                for _, other in running:
                    _stop(other, grace=2)
                raise FedheadError(
                    f"The SuperLink refused to register the SuperNode key in {label} "
                    f"(flwr supernode register): {why[-300:]}"
                )
            else:
                print(f"fedhead: registered the SuperNode key in {label} as node {res.get('node-id')}", file=sys.stderr)


def _wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen) -> None:
    import socket

    host = "::1" if host in ("::", "[::]") else "127.0.0.1" if host in ("0.0.0.0", "") else host.strip("[]")
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise FedheadError(
                f"the SuperLink's process exited with code {proc.returncode} before listening on "
                f"{host}:{port}. Is the port free?"
            )
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise FedheadError(f"the SuperLink did not listen on {host}:{port} within {timeout:g} s.")


def _stop(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def superlink_command(
    host: str, port: int, tls: list[str], database: Optional[str], supernode_auth: bool = False
) -> list[str]:
    """Flower's SuperLink on ``host:port``, the Control API's address (loopback): Flower 1.42 serves its Control,
    Runtime and Fleet APIs there together. An app may not install packages (``uv sync``) on this host."""
    cmd = [
        flower_exe("flower-superlink"),
        *tls,
        "--host",
        host,
        "--port",
        str(port),
        "--disable-runtime-dependency-installation",
    ]
    if supernode_auth:
        cmd.append("--enable-supernode-auth")
    if database:
        cmd += ["--database", database]
    return cmd


def gateway_command(host: str, port: int, control: tuple[str, int], tls: list[str]) -> list[str]:
    """fedhead's gateway (:mod:`fedhead.flower.gateway`) on ``host:port``, the nodes' port: the Fleet API of the
    SuperLink at ``control`` and nothing else, with the SuperLink's certificate."""

    def bracket(h: str) -> str:
        return f"[{h}]" if ":" in h else h

    cmd = [sys.executable, "-m", "fedhead.flower.gateway", "--listen", f"{bracket(host)}:{port}",
           "--upstream", f"{bracket(control[0])}:{control[1]}"]  # fmt: skip
    return cmd + [a for a in tls if a != "--insecure"]


class Link:
    """The SuperLink's two processes: Flower's (``link_cmd``, on the Control API's loopback address
    ``control_at``) and the gateway (``gateway_cmd``, on the nodes' address); ``addresses``: where each listens."""

    def __init__(self, link_cmd: list[str], gateway_cmd: list[str], env: dict, addresses: list[tuple[str, int]],
                 control_at: str, insecure: bool, ca: Optional[Path]):  # fmt: skip
        self.cmds, self.env, self.addresses = [link_cmd, gateway_cmd], env, addresses
        self.control_at, self.insecure, self.ca = control_at, insecure, ca
        self.procs: list[subprocess.Popen] = []

    def run(self, keys: list[tuple[str, bytes]], rc: dict | None = None) -> int:
        """Start both, register ``keys``, then submit the run of config ``rc`` and wait for its end (``flwr run``'s
        exit code), or without one serve until either process exits (its exit code); both are stopped after, and
        on SIGTERM."""
        prev = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            for cmd in self.cmds:
                self.procs.append(subprocess.Popen(cmd, env=self.env))
            for (host, port), proc in zip(self.addresses, self.procs):
                _wait_port(host, port, 60.0, proc)
            with flwr_connection(self.control_at, self.insecure, self.ca) as home:
                if keys:
                    register_supernodes(home, keys, self.env)
                if rc is not None:
                    return submit_run(home, rc, env=self.env)
            while all(p.poll() is None for p in self.procs):
                time.sleep(0.5)
            return next(p.returncode for p in self.procs if p.returncode is not None)
        finally:
            signal.signal(signal.SIGTERM, prev)
            for p in self.procs:
                _stop(p)


def submit_run(home: str, rc: dict, app_dir: Path | None = None, env: dict | None = None) -> int:
    """``flwr run <fedhead> fedhead --run-config <toml> --stream`` with the connection of ``home``
    (:func:`flwr_connection`); waits for the end of the run."""
    import tomli_w

    app_dir = app_source(app_dir)
    Path(home, "run.toml").write_text(tomli_w.dumps(rc))
    staged = stage_app(app_dir, Path(home, "app"))
    from flwr.cli.build import build_fab_from_disk

    digest = hashlib.sha256(build_fab_from_disk(staged)).hexdigest()
    print(f"fedhead: submitting the fedhead app, FAB sha256 {digest} (what the nodes pin: --app-sha256)",
          file=sys.stderr)  # fmt: skip
    cmd = [flower_exe("flwr"), "run", str(staged), "fedhead", "--run-config", str(Path(home, "run.toml")), "--stream"]
    e = dict(env or flower_env())
    e["FLWR_HOME"] = home
    return subprocess.call(cmd, env=e)


def check_link_addresses(host: str, port: int, control_api_address: str, insecure: bool) -> tuple[str, int]:
    """The nodes' port, ``--insecure`` there, and the Control API's address: loopback, another port (or the
    one-line error); returns that address as ``(host, port)``."""
    validate("--port", port, Interval(1, 65535, integer=True))
    if insecure:
        refuse_insecure_off_loopback("--host", host)
    control = split_address("--control-api-address", control_api_address)
    if not is_loopback(control[0]):
        raise FedheadError(
            f"The '--control-api-address' parameter must be a loopback address: Flower's Control API there runs "
            f"any app it is sent (no authentication). Got {control_api_address!r} instead. Keep 127.0.0.1:PORT and "
            "reach it from elsewhere through SSH: ssh -L 9091:127.0.0.1:9091 SERVER_HOST."
        )
    if control[1] == port:
        raise FedheadError(
            f"The '--control-api-address' parameter must name another port than --port (the nodes'). Got "
            f"{control_api_address!r} and --port {port}. Choose another port, e.g. 127.0.0.1:9091."
        )
    return control


def check_link_keys(auth_public_keys: Optional[List[Path]], insecure: bool) -> list[tuple[str, bytes]]:
    """The SuperNode keys of ``--auth-public-keys`` (none without it), refused with ``--insecure``."""
    keys = check_auth_public_keys(list(auth_public_keys)) if auth_public_keys else []
    if keys and insecure:
        raise FedheadError(
            "The '--auth-public-keys' option needs TLS (Flower refuses SuperNode authentication "
            "with --insecure). Got --insecure. Pass --ssl-certfile, --ssl-keyfile and "
            "--ssl-ca-certfile instead."
        )
    return keys


def build_link(
    host: str,
    port: int,
    control_api_address: str,
    insecure: bool,
    ssl_certfile: Optional[Path],
    ssl_keyfile: Optional[Path],
    ssl_ca_certfile: Optional[Path],
    auth_public_keys: Optional[List[Path]],
    database: Optional[str],
    wait_timeout: float,
) -> tuple[Link, list[tuple[str, bytes]]]:
    """Check every SuperLink file and option before any process starts; return the Link and the keys to register."""
    control = check_link_addresses(host, port, control_api_address, insecure)
    # the gateway and fedhead (registering keys, submitting the job) reach Flower's port on loopback
    tls = tls_args(insecure, ssl_certfile, ssl_keyfile, ssl_ca_certfile, control[0])
    keys = check_link_keys(auth_public_keys, insecure)
    validate("--wait-timeout", wait_timeout, Interval(0, None, closed="neither"))
    env = flower_env()
    cmd = superlink_command(control[0], control[1], tls, database, supernode_auth=bool(keys))
    gateway = gateway_command(host, port, control, tls)
    control_at = f"[{control[0]}]:{control[1]}" if ":" in control[0] else f"{control[0]}:{control[1]}"
    if not is_loopback(host):
        print(f"fedhead: the SuperLink's port {host}:{port} carries Flower's Fleet API alone (SuperNodes); its "
              f"Control and Runtime APIs (flwr run, flwr supernode register) listen on {control_at} only",
              file=sys.stderr)  # fmt: skip
    return Link(cmd, gateway, env, [control, (host, port)], control_at, insecure, ssl_ca_certfile), keys


def run_link_job(
    link: Link,
    keys: list[tuple[str, bytes]],
    experiment: ExperimentArgs,
    features: Path | str,
    out: Optional[Path],
    resume: bool,
    round_timeout: float,
    wait_timeout: float,
) -> None:
    """Run the training job of ``experiment`` on ``link``'s SuperNodes (``flwr run``) and print its summary."""
    validate("--round-timeout", round_timeout, Interval(0, None, closed="neither"))
    cfg = experiment.train_config("flower", features=str(features))

    open_store(cfg.features, "--features")
    cfg.resolved()
    out = out or Path("runs") / time.strftime(
        f"%Y%m%d-%H%M%S-flower-{cfg.resolved().head}-{cfg.partition.replace(':', '-')}"
    )
    code = link.run(keys, run_config_of(cfg, Path(out), resume, round_timeout, wait_timeout))
    summary_path = Path(out) / "summary.json"
    if code != 0 or not summary_path.exists():
        raise FedheadError(
            f"The Flower run failed (flwr run exit code {code}); its log is above. "
            f"Partial results and the checkpoint are in {str(out)!r} (resume with --resume)."
        )
    import json

    _print_summary(f"fedhead flower superlink — {out}", json.loads(summary_path.read_text()))


@cli_errors
@with_experiment_options(
    exclude=("features",),
    defaults=FLOWER_DEFAULTS,
    run_options=("out", "resume", "round_timeout", "wait_timeout"),
    config=True,
)
def superlink_cmd(
    host: str = typer.Option(
        "127.0.0.1",
        help="address the SuperNodes connect to; it carries Flower's Fleet API alone (0.0.0.0 or this machine's "
        "address to take nodes from other machines)",
    ),
    port: int = typer.Option(9093, help="the SuperNodes' port (the Fleet API alone)"),
    control_api_address: str = typer.Option(
        "127.0.0.1:9091",
        "--control-api-address",
        help="loopback HOST:PORT of Flower's own SuperLink port: its Control API (flwr run, flwr supernode "
        "register; no authentication), Runtime API and Fleet API. From elsewhere: ssh -L 9091:127.0.0.1:9091",
    ),
    insecure: bool = typer.Option(False, "--insecure", help="no TLS (loopback and tests only)"),
    ssl_certfile: Optional[Path] = typer.Option(
        None, help="TLS certificate of the SuperLink (PEM; SANs for the address nodes use and for 127.0.0.1)"
    ),
    ssl_keyfile: Optional[Path] = typer.Option(None, help="TLS private key of the SuperLink (PEM, unencrypted)"),
    ssl_ca_certfile: Optional[Path] = typer.Option(None, help="CA certificate that signed --ssl-certfile (PEM)"),
    auth_public_keys: Optional[List[Path]] = typer.Option(
        None,
        "--auth-public-keys",
        help="SuperNode authentication: only nodes whose public key is listed may join (OpenSSH ECDSA lines as "
        "ssh-keygen -t ecdsa -b 384 writes them; repeat or list several per file). Starts Flower's SuperLink "
        "with --enable-supernode-auth and registers each key with 'flwr supernode register'. Needs TLS",
    ),
    database: Optional[str] = typer.Option(None, help="SuperLink state file \\[default: in memory]"),
    features: Optional[Path] = typer.Option(
        None,
        "--features",
        help="the server's store: with it (or with features in --config), also submit the training run "
        "(same options as 'fedhead flower simulate') and stop when done",
    ),
    *,
    experiment: ExperimentArgs,
    out: Optional[Path] = None,
    resume: bool = False,
    round_timeout: float = 600.0,
    wait_timeout: float = 300.0,
):
    """Start a Flower SuperLink; with --features, also run the training job on the connected SuperNodes."""
    require_flower()
    if features is None and experiment.config is not None:
        features = experiment.fields().get("features")
    if experiment.print_config:  # the training run it would submit, resolved; nothing starts
        extra = {"features": str(features)} if features is not None else {}
        typer.echo(resolved_toml(experiment.train_config("flower", **extra)), nl=False)
        return
    link, keys = build_link(
        host,
        port,
        control_api_address,
        insecure,
        ssl_certfile,
        ssl_keyfile,
        ssl_ca_certfile,
        auth_public_keys,
        database,
        wait_timeout,
    )
    if features is None:  # serve in the foreground, after registering the listed SuperNodes; runs: 'flwr run'
        raise SystemExit(link.run(keys))
    run_link_job(link, keys, experiment, features, out, resume, round_timeout, wait_timeout)


# ---------------------------------------------------------------- benchmark


def bench_config(
    clients: int,
    rounds: int,
    num_classes: int,
    train_per_class: int,
    head: str,
    partition: str,
    local_epochs: int,
    batch_size: int,
) -> TrainConfig:
    """The benchmark's TrainConfig (no store yet), checked against the labels of the synthetic store it will use."""
    import numpy as np

    cfg = TrainConfig(
        **applicable(
            dict(
                features="",
                head=head,
                partition=partition,
                clients=clients,
                rounds=rounds,
                local_epochs=local_epochs,
                batch_size=batch_size,
                device="cpu",
            )
        )
    )
    validate_config(
        cfg,
        labels_store(np.repeat(np.arange(num_classes), train_per_class), [f"class{c:03d}" for c in range(num_classes)]),
    )
    return cfg


def check_bench_out(out: Path) -> Path:
    """``--out`` of ``fedhead bench flower``: a folder that is absent or empty (or the one-line error)."""
    out = check_out(Path(out), kind="dir")
    if out.exists() and any(out.iterdir()):
        raise FedheadError(f"The '--out' parameter names {str(out)!r}, which already holds files. Choose another.")
    return out


def time_train_and_flower(cfg: TrainConfig, out: Path, num_cpus: Optional[int]) -> dict:
    """Run ``cfg`` in 'fedhead train' then in Flower's simulation; their wall times and how their accuracies compare."""
    import numpy as np

    t0 = time.perf_counter()
    a = run_training(cfg, out=out / "train", progress=False)
    t_train = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = simulate(cfg, out / "flower", num_cpus=num_cpus)
    t_flower = time.perf_counter() - t0
    acc_a = np.array([r["accuracy"] for r in a.rows], dtype=float)
    acc_b = np.array([r["accuracy"] for r in b.rows], dtype=float)
    return {
        "train_wall_s": t_train,
        "flower_wall_s": t_flower,
        "ratio_flower_over_train": t_flower / t_train,
        "final_accuracy_train": float(acc_a[-1]),
        "final_accuracy_flower": float(acc_b[-1]),
        "max_round_accuracy_diff": float(np.abs(acc_a - acc_b).max()),
    }


def print_bench(result: dict) -> None:
    """The benchmark's table, then its result as one JSON line, on stdout."""
    import json

    stdout_console().print(
        results_table(
            f"fedhead bench flower — {result['clients']} clients, {result['rounds']} rounds",
            [result],
            [
                ("train_wall_s", "fedhead train s"),
                ("flower_wall_s", "Flower simulation s"),
                ("ratio_flower_over_train", "ratio"),
                ("final_accuracy_train", "acc train"),
                ("final_accuracy_flower", "acc flower"),
                ("max_round_accuracy_diff", "max |Δacc|"),
            ],
        )
    )
    typer.echo(json.dumps(result))


@cli_errors
def bench_cmd(
    clients: int = typer.Option(100, help="clients (virtual SuperNodes)"),
    rounds: int = typer.Option(20, help="rounds"),
    num_classes: int = typer.Option(10, help="classes of the synthetic store"),
    train_per_class: int = typer.Option(100, help="training samples per class"),
    dim: int = typer.Option(32, help="feature dimension"),
    head: str = typer.Option("ova2", help="head"),
    partition: str = typer.Option("shard", help="partition"),
    local_epochs: int = typer.Option(1, help="local epochs"),
    batch_size: int = typer.Option(50, help="local batch size"),
    num_cpus: Optional[int] = typer.Option(None, help="CPUs Ray may use \\[default: all]"),
    out: Path = typer.Option(Path("reports/bench-flower"), help="directory for the store, both runs and bench.json"),
):
    """Time the same job in 'fedhead train' and in Flower's simulation engine; print both wall times."""
    require_flower()
    import dataclasses

    # every option first (nothing is written on bad input): the store's sizes, the run (against the store's
    # labels), Ray's CPUs and --out
    sizes = dict(num_classes=num_classes, train_per_class=train_per_class, test_per_class=20, dim=dim)
    validate_synthetic(**sizes, spread=2.2, seed=0)
    cfg = bench_config(clients, rounds, num_classes, train_per_class, head, partition, local_epochs, batch_size)
    if num_cpus is not None:
        validate("--num-cpus", num_cpus, Interval(1, None, integer=True))
    out = check_bench_out(out)
    store = write_synthetic(out / "store.h5", **sizes)
    cfg = dataclasses.replace(cfg, features=str(store))
    result = {
        "clients": clients,
        "rounds": rounds,
        "num_classes": num_classes,
        "dim": dim,
        "head": head,
        "partition": partition,
        "local_epochs": local_epochs,
        **time_train_and_flower(cfg, out, num_cpus),
        "cpus": os.cpu_count(),
    }
    atomic_write_json(out / "bench.json", result)
    print_bench(result)
