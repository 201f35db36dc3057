"""Real Flower deployments on loopback: one SuperLink and SuperNodes as subprocesses, each node with its own
tiny feature store, started with the commands of fedhead/flower/DEPLOY.md.

* insecure, 3 nodes, 2 rounds; node 1 crashes in round 2 (the round completes with the other two and the
  failure is recorded in rounds.csv);
* TLS (CA, server certificate and key made here with ``cryptography``, tests/certs.py): two nodes that trust
  the CA train; a node that trusts another CA cannot connect (Flower's exit code 305, certificate verify
  failed)
  and the run finishes with the two;
* TLS + SuperNode authentication (Flower's ``--enable-supernode-auth`` with the keys of
  ``--auth-public-keys`` registered): the two listed nodes train; a node with an unlisted key and a node
  without a key are refused by the SuperLink and the run finishes with the two.

Every wait is bounded; every process started here is killed at the end, also when an assertion fails."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")

from certs import make_ca, make_node_key, make_server_cert  # noqa: E402
from flower_hooks import crash_env  # noqa: E402 (the tests' hooks: loaded by node1's processes)

from fedhead.core.synthetic import write_synthetic  # noqa: E402
from fedhead.flower.loopback import Deployment, free_ports, split_store, stop_all  # noqa: E402,F401

TIMEOUT = 300


def node_stores(tmp: Path, k: int) -> tuple[Path, list[Path]]:
    """The server's store and ``k`` node stores, each with a disjoint third of the training images."""
    server = write_synthetic(tmp / "server.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16)
    return server, split_store(server, tmp, k)


# ---------------------------------------------------------------- the commands (as fedhead/flower/DEPLOY.md shows them)


def superlink_argv(
    link_port: int, server: Path, out: Path, clients: int, rounds: int, *security: str, control_port: int
) -> list[str]:
    return [
        "flower",
        "superlink",
        *security,
        "--host",
        "127.0.0.1",
        "--port",
        str(link_port),
        "--control-api-address",
        f"127.0.0.1:{control_port}",
        "--features",
        str(server),
        "--clients",
        str(clients),
        "--rounds",
        str(rounds),
        "--local-epochs",
        "1",
        "--batch-size",
        "10",
        "--partition",
        "iid",
        "--out",
        str(out),
        "--wait-timeout",
        "120",
        "--round-timeout",
        "120",
    ]


def supernode_argv(link_port: int, store: Path, pid: int, port: int, *security: str) -> list[str]:
    return [
        "flower",
        "supernode",
        *security,
        "--superlink",
        f"127.0.0.1:{link_port}",
        "--features",
        str(store),
        "--partition-id",
        str(pid),
        "--port",
        str(port),
        "--device",
        "cpu",
    ]


def tls_server(pki: dict) -> tuple[str, ...]:
    return ("--ssl-certfile", str(pki["cert"]), "--ssl-keyfile", str(pki["key"]), "--ssl-ca-certfile", str(pki["ca"]))


def insecure_commands(
    link_port: int, node_ports: list[int], server: Path, stores: list[Path], out: Path, control_port: int
) -> dict[str, list[str]]:
    cmds = {
        f"node{i}": supernode_argv(link_port, store, i, port, "--insecure")
        for i, (store, port) in enumerate(zip(stores, node_ports))
    }
    return {**cmds, "superlink": superlink_argv(link_port, server, out, 3, 2, "--insecure", control_port=control_port)}


def tls_commands(
    link_port: int, node_ports: list[int], server: Path, stores: list[Path], out: Path, pki: dict, control_port: int
) -> dict[str, list[str]]:
    """Two nodes that trust the CA; a rogue that trusts another CA (and claims node 1's partition id: had it
    joined, the server would have seen partition 1 twice)."""
    ca = ("--root-certificates", str(pki["ca"]))
    cmds = {
        f"node{i}": supernode_argv(link_port, store, i, port, *ca)
        for i, (store, port) in enumerate(zip(stores, node_ports))
    }
    cmds["rogue"] = supernode_argv(link_port, stores[0], 1, node_ports[2], "--root-certificates", str(pki["other_ca"]))
    return {
        **cmds,
        "superlink": superlink_argv(link_port, server, out, 2, 1, *tls_server(pki), control_port=control_port),
    }


def auth_commands(
    link_port: int,
    node_ports: list[int],
    server: Path,
    stores: list[Path],
    out: Path,
    pki: dict,
    keys: dict,
    control_port: int,
) -> dict[str, list[str]]:
    """The SuperLink lists the keys of node0 and node1; the stranger's key is not listed; the keyless node has
    none (both claim node 1's partition id)."""
    ca = ("--root-certificates", str(pki["ca"]))
    cmds = {
        "superlink": superlink_argv(
            link_port,
            server,
            out,
            2,
            1,
            *tls_server(pki),
            "--auth-public-keys",
            str(keys["listed"]),
            control_port=control_port,
        )
    }
    for i, (store, port) in enumerate(zip(stores, node_ports)):
        cmds[f"node{i}"] = supernode_argv(
            link_port, store, i, port, *ca, "--auth-supernode-private-key", str(keys[f"node{i}"])
        )
    cmds["stranger"] = supernode_argv(
        link_port, stores[0], 1, node_ports[2], *ca, "--auth-supernode-private-key", str(keys["stranger"])
    )
    cmds["keyless"] = supernode_argv(link_port, stores[0], 1, node_ports[3], *ca)
    return cmds


@pytest.fixture
def deployment(tmp_path):
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr-home"), FEDHEAD_NO_PROGRESS="1")
    env.pop("FEDHEAD_FLOWER_CRASH", None)
    d = Deployment(tmp_path, env)
    try:
        yield d
    finally:
        d.close()


@pytest.mark.slow
def test_superlink_and_three_supernodes_on_loopback(tmp_path, deployment):
    server, stores = node_stores(tmp_path, 3)
    link_port, control_port, *node_ports = free_ports(5)
    out = tmp_path / "run"
    d = deployment
    cmds = insecure_commands(link_port, node_ports, server, stores, out, control_port)
    for name in ("node0", "node1", "node2"):
        d.start(name, cmds[name], **(crash_env("1@2") if name == "node1" else {}))
    d.start("superlink", cmds["superlink"])
    code = d.wait("superlink", TIMEOUT)
    assert code == 0, f"superlink run failed (exit {code}):\n{d.log('superlink')[-4000:]}"

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
    assert (out / "head-seed0.pt").exists() and not (out / "checkpoint.safetensors").exists()
    sizes = [int(r["size"]) for r in csv.DictReader(open(out / "clients.csv"))]
    assert sizes == [36, 36, 36]  # 40 training images each, 10% held out as the node's validation part


# ---------------------------------------------------------------- TLS and SuperNode authentication

REFUSED = "Exit Code: 305"  # Flower's report of a SuperNode that cannot connect to (or is refused by) the SuperLink


@pytest.fixture
def pki(tmp_path):
    """The CA, the SuperLink's certificate (SANs localhost, 127.0.0.1, ::1) and key, and a second CA."""
    certs = tmp_path / "certs"
    ca = make_ca(certs, "ca")
    server_cert, server_key = make_server_cert(ca, certs, "server")
    other = make_ca(certs, "other-ca")
    return {"ca": ca.cert, "cert": server_cert, "key": server_key, "other_ca": other.cert}


def _assert_finished_with_two(d: Deployment, out: Path) -> None:
    code = d.wait("superlink", TIMEOUT)
    assert code == 0, f"superlink run failed (exit {code}):\n{d.log('superlink')[-4000:]}"
    with open(out / "rounds.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["round"]) for r in rows] == [1]
    assert rows[0]["clients_trained"] == "2" and rows[0]["failures"] == "0", rows
    assert 0.0 < float(rows[0]["accuracy"]) <= 1.0
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1
    sizes = [int(r["size"]) for r in csv.DictReader(open(out / "clients.csv"))]
    # the two legitimate nodes' stores (120 training images / 2), 10% held out as each node's validation part
    assert sizes == [54, 54]


def _assert_refused(d: Deployment, name: str, reason: str) -> None:
    code = d.wait(name, 60)
    assert code is not None and code != 0, f"{name} was not refused (exit {code}):\n{d.log(name)[-3000:]}"
    assert REFUSED in d.log(name) and reason in d.log(name), d.log(name)[-3000:]


@pytest.mark.slow
def test_tls_deployment_refuses_a_node_that_trusts_another_ca(tmp_path, deployment, pki):
    server, (store0, store1) = node_stores(tmp_path, 2)
    link_port, control_port, *node_ports = free_ports(5)
    out = tmp_path / "run"
    d = deployment
    cmds = tls_commands(link_port, node_ports, server, [store0, store1], out, pki, control_port)
    for name in ("node0", "node1", "rogue"):  # nodes first, as on real machines: they retry until it listens
        d.start(name, cmds[name])
    d.start("superlink", cmds["superlink"])
    _assert_refused(d, "rogue", "CERTIFICATE_VERIFY_FAILED")
    _assert_finished_with_two(d, out)
    assert f"Uvicorn running on https://127.0.0.1:{link_port}" in d.log("superlink")  # TLS, not plain HTTP


@pytest.mark.slow
def test_supernode_authentication_admits_only_listed_keys(tmp_path, deployment, pki):
    server, (store0, store1) = node_stores(tmp_path, 2)
    link_port, control_port, *node_ports = free_ports(6)
    keys = tmp_path / "keys"
    (k0, p0), (k1, p1) = make_node_key(keys, "node0"), make_node_key(keys, "node1")
    unlisted, _ = make_node_key(keys, "stranger")
    listed = keys / "supernodes.pub"  # cat node0.pub node1.pub > supernodes.pub
    listed.write_bytes(p0.read_bytes() + p1.read_bytes())
    out = tmp_path / "run"
    d = deployment
    cmds = auth_commands(
        link_port,
        node_ports,
        server,
        [store0, store1],
        out,
        pki,
        {"listed": listed, "node0": k0, "node1": k1, "stranger": unlisted},
        control_port,
    )
    d.start("superlink", cmds["superlink"])
    # Flower refuses a node whose key is not registered yet: the nodes start once the SuperLink registered the
    # listed keys
    d.wait_for("superlink", "registered the SuperNode key", count=2)
    for name in ("stranger", "keyless", "node0", "node1"):
        d.start(name, cmds[name])
    _assert_refused(d, "stranger", "Failed to activate SuperNode")
    _assert_refused(d, "keyless", "SuperNode authentication is enabled")
    _assert_finished_with_two(d, out)
    link = d.log("superlink")
    assert "[/v1/fleet/activate-node][ApiError:2004]" in link  # the SuperLink refused the stranger
    assert "[/v1/fleet/register-node][ApiError:2001]" in link  # ... and the node without a key
    assert link.count("[Fleet.ActivateNode] Activated node_id") == 2  # only the two listed nodes joined


# ---------------------------------------------------------------- the documented commands are the tested ones

ROOT = Path(__file__).resolve().parents[1]


def _documented(text: str) -> str:
    """Shell lines of ``text`` with continuations joined, spaces collapsed and a trailing ``&`` dropped."""
    text = text.replace("\\\n", " ")
    return "\n".join(" ".join(line.split()).removesuffix(" &") for line in text.splitlines())


def test_deploy_docs_show_the_commands_the_tests_run():
    """Every command of the three loopback deployments above, with the file names and ports of the docs,
    appears verbatim in fedhead/flower/DEPLOY.md, the guide's one copy: the documentation site shows that file
    (docs/deployment.md includes it), and no other page or the README repeats its text."""
    import shlex

    deploy = (ROOT / "fedhead" / "flower" / "DEPLOY.md").read_text()
    page = (ROOT / "docs" / "deployment.md").read_text()
    assert '--8<-- "fedhead/flower/DEPLOY.md"' in page, "docs/deployment.md must include DEPLOY.md"
    paragraphs = [p for p in deploy.split("\n\n") if len(p) > 200]  # the guide's text, paragraph by paragraph
    for other in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = other.read_text()
        assert not [p for p in paragraphs if p in text], f"{other.name} repeats DEPLOY.md's text"

    ports, stores, out = [9094, 9095, 9096, 9097], [Path(f"node{i}.h5") for i in range(3)], Path("runs/fl")
    pki = {"ca": "ca.pem", "cert": "server.pem", "key": "server.key", "other_ca": "other-ca.pem"}
    keys = {"listed": "supernodes.pub", "node0": "node0", "node1": "node1", "stranger": "stranger"}
    commands = {
        **{f"insecure {k}": v for k, v in insecure_commands(9093, ports, Path("server.h5"), stores, out, 9091).items()},
        **{f"tls {k}": v for k, v in tls_commands(9093, ports, Path("server.h5"), stores[:2], out, pki, 9091).items()},
        **{
            f"auth {k}": v
            for k, v in auth_commands(9093, ports, Path("server.h5"), stores[:2], out, pki, keys, 9091).items()
        },
    }
    documented = _documented(deploy).splitlines()
    for name, argv in commands.items():
        line = "fedhead " + shlex.join(argv)
        assert line in documented, f"{name}: DEPLOY.md does not show the tested command\n{line}"


def test_the_client_app_a_supernode_loads_imports_no_torch():
    """A deployed SuperNode starts one ClientApp process per message (Flower's subprocess isolation), and the stages
    of a SecAgg+ exchange that only set up, share and unmask keys never reach fedhead's handlers: the module Flower
    loads (pyproject's clientapp) imports Flower, not torch nor the handlers' module, so those processes do not pay
    for them. A fresh interpreter, since this test process has imported torch already."""
    import subprocess
    import sys

    from fedhead.federation.config import tomllib

    ref = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["components"]["clientapp"]
    module, attr = ref.split(":")
    probe = (
        f"import sys, {module} as m; assert type(getattr(m, {attr!r})).__name__ == 'ClientApp'; "
        "print(sorted(k for k in ('torch', 'fedhead.flower.node', 'fedhead.core.engine') if k in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


def test_the_supernode_command_checks_its_options_without_torch(tmp_path):
    """``fedhead flower supernode`` checks its options and becomes ``flower-supernode``: run from the shell (``cli.main``)
    it imports only its own module, so a node's start does not pay for torch. A fresh interpreter; a missing store
    stops it at the last check before the exec."""
    import subprocess
    import sys

    argv = ["flower", "supernode", "--insecure", "--superlink", "127.0.0.1:9", "--partition-id", "0", "--features"]
    probe = (
        f"import sys; sys.argv = ['fedhead', *{argv!r}, {str(tmp_path / 'none.h5')!r}]; import cli\n"
        "try:\n    cli.main()\nexcept SystemExit as e:\n"
        "    print(e.code, sorted(k for k in ('torch', 'fedhead.flower.commands') if k in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.stdout.strip() == "2 []", (r.stdout, r.stderr[-2000:])
    assert "'--features'" in r.stderr and r.stderr.count("\n") == 1


def test_the_command_line_names_the_command_it_runs():
    import cli

    # a command run from the shell imports its own module alone (a SuperNode starts without the trainer's modules);
    # the groups list every command from cli.COMMANDS without importing them (tests/test_help_imports.py)
    code = (
        "import sys, cli\n"
        "sys.argv = ['fedhead', 'flower', 'supernode', '--help']\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('fedhead.commands', 'fedhead.bench.commands', 'fedhead.flower.commands',"
        " 'fedhead.scratch.commands', 'extract.commands', 'fedhead.flower.launch') if m in sys.modules))"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['fedhead.flower.launch']", out.stdout[-400:]
    root = cli.app  # every command registered
    assert {(g, n) for _, _, n, g, _ in cli.COMMANDS} == {
        (g, c.name) for g, t in (("bench", cli.bench_app), ("flower", cli.flower_app)) for c in t.registered_commands
    } | {(None, c.name) for c in root.registered_commands}


def test_flwr_run_builds_the_same_fab_from_the_staged_copy(tmp_path):
    """``fedhead flower superlink`` hands ``flwr run`` a staged copy of the app (flwr walks every file of the folder
    it is given, a .venv included, before it filters): the FAB built from the copy is the FAB of the tree, for a tree
    with a virtual environment, caches, an ignored folder and files outside the patterns; patterns that do not start
    with a name are built from the tree itself. The real pyproject's patterns all start with a name."""
    import zipfile
    from io import BytesIO

    from flwr.cli.build import build_fab_from_disk

    from fedhead.federation.config import tomllib
    from fedhead.flower.commands import stage_app

    def fab(folder: Path) -> dict:
        z = zipfile.ZipFile(BytesIO(build_fab_from_disk(folder)))
        return {n: z.read(n) for n in z.namelist()}

    app = tmp_path / "src"
    files = {
        "cli.py": "x = 1\n",
        "pkg/__init__.py": "",
        "pkg/sub/mod.py": "y = 2\n",
        "pkg/GUIDE.md": "# guide\n",
        "pkg/notes.txt": "not in the patterns\n",
        "pkg/__pycache__/mod.cpython-311.pyc": "junk",
        "pkg/ignored/gone.py": "z = 3\n",
        ".gitignore": "pkg/ignored/\n",
        ".venv/lib/site.py": "v = 0\n",
        "README.md": "# readme\n",
        "other/tool.py": "w = 1\n",
    }
    for name, text in files.items():
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(text)
    toml = """[project]\nname = "demo"\nversion = "1.0.0"\ndependencies = []\n
[tool.flwr.app]\npublisher = "me"\nfab-include = %s\n
[tool.flwr.app.components]\nserverapp = "pkg.sub.mod:app"\nclientapp = "pkg.sub.mod:app"\n
[tool.flwr.app.config]\nk = 1\n"""
    (app / "pyproject.toml").write_text(toml % '["cli.py", "pkg/**/*.py", "pkg/GUIDE.md"]')
    staged = stage_app(app, tmp_path / "staged")
    assert staged != app and not (staged / ".venv").exists() and not (staged / "other").exists()
    want = fab(app)
    assert {"cli.py", "pkg/sub/mod.py", "pkg/GUIDE.md"} <= set(want) and "pkg/ignored/gone.py" not in want
    assert fab(staged) == want
    (app / "pyproject.toml").write_text(toml % '["**/*.py"]')
    assert stage_app(app, tmp_path / "again") == app
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["fab-include"]
    assert all(not any(c in p.split("/")[0] for c in "*?[!") for p in include)


def test_the_server_looks_for_replies_soon_and_then_less_often(monkeypatch):
    """The deployed ServerApp's Grid (PromptGrid) returns every reply, looks again 0.05 s after sending and then ever
    less often up to 1 s apart (Flower's own looks every 3 s), starts over when replies come, and stops at the
    timeout with the replies it has. Checked on a fake clock: no real waiting."""
    from types import SimpleNamespace

    from fedhead.flower import server_app
    from fedhead.flower.server_app import PromptGrid

    clock = SimpleNamespace(now=0.0, sleeps=[])

    def sleep(s):
        clock.sleeps.append(s)
        clock.now += s

    monkeypatch.setattr(server_app.time, "sleep", sleep)
    monkeypatch.setattr(server_app.time, "monotonic", lambda: clock.now)

    class Fake:
        """Replies to message i arrive at time ``arrive[i]``; each pull returns those arrived and not yet pulled."""

        def __init__(self, arrive):
            self.arrive, self.pulled, self.pulls = arrive, set(), 0

        def push_messages(self, messages):
            return [str(i) for i, _ in enumerate(messages)]

        def pull_messages(self, ids):
            self.pulls += 1
            ready = [i for i in ids if self.arrive[int(i)] <= clock.now and i not in self.pulled]
            self.pulled |= set(ready)
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in ready]

        def get_node_ids(self):
            return [7]

    fake = Fake([0.0, 0.3, 5.0])
    grid = PromptGrid(fake)
    assert grid.get_node_ids() == [7]  # the rest is the wrapped Grid's
    got = grid.send_and_receive(["a", "b", "c"], timeout=60)
    assert sorted(m.metadata.reply_to_message_id for m in got) == ["0", "1", "2"]
    assert clock.sleeps[0] == PromptGrid.FIRST and max(clock.sleeps) == PromptGrid.LAST
    assert all(b >= a or b == PromptGrid.FIRST for a, b in zip(clock.sleeps, clock.sleeps[1:]))
    assert clock.now < 5.0 + PromptGrid.LAST + 1e-9  # the last reply was noticed within one pause
    clock.now, clock.sleeps = 0.0, []
    got = PromptGrid(Fake([0.0, 99.0])).send_and_receive(["a", "b"], timeout=4)
    assert [m.metadata.reply_to_message_id for m in got] == ["0"] and clock.now == 4.0


# ---------------------------------------------------------------- a deployment a stranger cannot take over


def _flwr_home(home: Path, address: str, ca: Path | None = None) -> Path:
    """An FLWR_HOME whose connection ``fedhead`` names ``address`` (TLS with ``ca``, else insecure)."""
    conn = f'address = "{address}"\n' + (f'root-certificates = "{ca}"\n' if ca else "insecure = true\n")
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "fedhead"\n\n[superlink.fedhead]\n{conn}')
    return home


def _flwr(home: Path, *args: str, timeout: float = 120):
    import subprocess
    import sys

    flwr = str(Path(sys.executable).parent / "flwr")
    env = dict(os.environ, FLWR_HOME=str(home))
    return subprocess.run([flwr, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _flwr_json(r) -> dict:
    """The JSON answer of a ``flwr ... --format json`` (it exits 0 on failure too)."""
    return json.loads(r.stdout[r.stdout.find("{") :]) if "{" in r.stdout else {}


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) of the sockets listening on ``port``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                out.add(addr)
    return out


LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


def superlink_serve_argv(link_port: int, control_port: int, *security: str) -> list[str]:
    """``fedhead flower superlink`` serving (no --features): runs come from ``flwr run`` on the Control API."""
    return ["flower", "superlink", *security, "--port", str(link_port), "--control-api-address",
            f"127.0.0.1:{control_port}"]  # fmt: skip


def control_address(link_port: int, control_port: int) -> str:
    return f"127.0.0.1:{control_port}"


@pytest.mark.slow
def test_the_superlink_binds_loopback_by_default(tmp_path, deployment):
    """Without --host every socket of the SuperLink (its port and its Control API) listens on loopback only."""
    link_port, control_port = free_ports(2)
    d = deployment
    d.start("superlink", superlink_serve_argv(link_port, control_port, "--insecure"))
    d.wait_for("superlink", "Uvicorn running on", count=2, timeout=120)  # Flower's and the gateway's
    for port in (link_port, control_port):
        got = _listening(port)
        assert got and got <= LOOPBACK_HEX, (port, got, d.log("superlink")[-2000:])


@pytest.mark.slow
def test_a_stranger_with_the_ca_certificate_cannot_register_a_key(tmp_path, deployment, pki):
    """Finding 1: with TLS and --auth-public-keys, a machine that holds only the public CA certificate and reaches
    the SuperLink's port runs ``flwr supernode register attacker.pub`` and ``flwr run`` there. The port the nodes
    reach carries the Fleet API alone: both are refused, and the attacker's node is not let in."""
    server, (store0,) = node_stores(tmp_path, 1)
    link_port, control_port, node_port = free_ports(3)
    keys = tmp_path / "keys"
    _, listed = make_node_key(keys, "node0")
    attacker, attacker_pub = make_node_key(keys, "attacker")
    d = deployment
    d.start(
        "superlink",
        superlink_serve_argv(link_port, control_port, *tls_server(pki), "--auth-public-keys", str(listed)),
    )
    d.wait_for("superlink", "registered the SuperNode key", count=1)
    home = _flwr_home(tmp_path / "attacker-home", f"127.0.0.1:{link_port}", pki["ca"])
    r = _flwr(home, "supernode", "register", str(attacker_pub), "fedhead", "--format", "json")
    assert not _flwr_json(r).get("success"), f"the attacker's key was registered:\n{r.stdout}\n{r.stderr}"
    r = _flwr(home, "supernode", "list", "fedhead", "--format", "json")
    assert "node-id" not in r.stdout, f"the Control API answered on the nodes' port:\n{r.stdout}"
    marker = tmp_path / "ran.txt"
    r = _flwr(home, "run", str(_evil_app(tmp_path / "evil", marker)), "fedhead", "--format", "json")
    assert not _flwr_json(r).get("success"), f"the attacker started a run:\n{r.stdout}\n{r.stderr}"
    assert "StartRun" not in d.log("superlink") and not marker.exists()
    d.start(
        "attacker-node",
        supernode_argv(link_port, store0, 0, node_port, "--root-certificates", str(pki["ca"]),
                       "--auth-supernode-private-key", str(attacker)),
    )  # fmt: skip
    _assert_refused(d, "attacker-node", "Failed to activate SuperNode")


EVIL_TOML = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "evilapp"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "stranger"

[tool.flwr.app.components]
serverapp = "evilapp.apps:server"
clientapp = "evilapp.apps:client"

[tool.flwr.app.config]
x = 1
"""

EVIL_APPS = """
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

MARKER = {marker!r}
server = ServerApp()
client = ClientApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    t0, nodes = time.monotonic(), []
    while not nodes and time.monotonic() - t0 < 60:
        nodes = list(grid.get_node_ids())
        time.sleep(0.5)
    msgs = [Message(RecordDict({{"c": ConfigRecord({{"x": 1}})}}), dst_node_id=n, message_type=MessageType.QUERY)
            for n in nodes]
    replies = list(grid.send_and_receive(msgs, timeout=60))
    print("evil replies:", [r.has_error() and r.error.reason for r in replies], flush=True)


@client.query()
def steal(msg: Message, context: Context) -> Message:
    Path(MARKER).write_text(repr(dict(context.node_config)))
    return Message(RecordDict(), reply_to=msg)
"""


def _evil_app(folder: Path, marker: Path) -> Path:
    (folder / "evilapp").mkdir(parents=True)
    (folder / "pyproject.toml").write_text(EVIL_TOML)
    (folder / "evilapp" / "__init__.py").write_text("")
    (folder / "evilapp" / "apps.py").write_text(EVIL_APPS.format(marker=str(marker)))
    return folder


@pytest.mark.slow
def test_a_supernode_runs_only_the_app_it_pinned(tmp_path, deployment):
    """Finding 1: a SuperNode ran whatever app its SuperLink handed it. Here the SuperLink's own operator (on its
    Control API) submits an app that is not fedhead's: the node refuses it before any of its code runs (the
    ClientApp would write a file with the node's config), and its ServerApp gets the node's error reply."""
    import subprocess
    import sys
    import time

    _, (store0,) = node_stores(tmp_path, 1)
    link_port, control_port, node_port = free_ports(3)
    marker = tmp_path / "stolen.txt"
    app = _evil_app(tmp_path / "evil", marker)
    d = deployment
    d.start("superlink", superlink_serve_argv(link_port, control_port, "--insecure"))
    d.start("node0", supernode_argv(link_port, store0, 0, node_port, "--insecure"))
    d.wait_for("superlink", "Uvicorn running on", count=2, timeout=120)
    home = _flwr_home(tmp_path / "operator-home", control_address(link_port, control_port))
    flwr = str(Path(sys.executable).parent / "flwr")
    run = subprocess.Popen([flwr, "run", str(app), "fedhead", "--stream"], env=dict(os.environ, FLWR_HOME=str(home)),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        t0 = time.monotonic()
        while not marker.exists() and "refused the app" not in d.log("node0") and time.monotonic() - t0 < 180:
            time.sleep(0.5)
        assert not marker.exists(), f"the unpinned app ran on the node: {marker.read_text()}"
        assert "refused the app" in d.log("node0"), d.log("node0")[-3000:]
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
    assert "The FAB could not be verified" in out, out[-3000:]
    assert not marker.exists()


def test_the_shipped_code_holds_no_fault_injection():
    """The tests' hooks (a partition that raises in a round, a server that stops after one) live in
    tests/flower_hooks.py, loaded as a plugin: no environment variable makes the shipped code fail."""
    hooks = ("FEDHEAD_FLOWER_CRASH", "FEDHEAD_FLOWER_STOP_AFTER", "injected crash")
    found = [
        f"{path.relative_to(ROOT)}: {hook}"
        for folder in ("fedhead", "extract")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for hook in hooks
        if hook in path.read_text()
    ]
    assert not found, found


def _refused(argv: list[str], monkeypatch) -> str:
    """``fedhead ARGV`` in-process with every process start replaced by a stand-in that fails: the one line on
    stderr of the command's refusal (exit 2; nothing started)."""
    import subprocess

    from typer.testing import CliRunner

    import cli

    def started(*args, **kw):
        raise AssertionError(f"{argv}: a process would start here ({args[:1]})")

    monkeypatch.setattr(os, "execve", started)
    monkeypatch.setattr(subprocess, "Popen", started)
    res = CliRunner().invoke(cli.app, argv)
    assert res.exception is None or isinstance(res.exception, SystemExit), (argv, repr(res.exception))
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, (argv, res.output)
    return res.stderr


def test_insecure_is_refused_off_loopback(tmp_path, monkeypatch):
    """``--insecure`` sends the node's updates and the server's model in the clear: refused, before any process
    starts or any store is read, for a SuperLink bound beyond loopback and a SuperNode whose SuperLink is not on
    loopback (one line naming --insecure, the address option and the fix)."""
    none = str(tmp_path / "none.h5")
    cases = [
        (["flower", "superlink", "--insecure", "--host", "0.0.0.0", "--port", "9", "--features", none], "'--host'"),
        (["flower", "superlink", "--insecure", "--host", "::", "--port", "9", "--features", none], "'--host'"),
        (["flower", "superlink", "--insecure", "--host", "10.1.2.3", "--port", "9"], "'--host'"),
        (["flower", "supernode", "--insecure", "--superlink", "192.0.2.7:9093", "--partition-id", "0",
          "--features", none], "'--superlink'"),
    ]  # fmt: skip
    for argv, option in cases:
        err = _refused(argv, monkeypatch)
        assert "'--insecure'" in err and option in err, (argv, err)
    for host in ("127.0.0.1", "localhost", "[::1]"):  # loopback stays allowed: the store is the next check
        argv = ["flower", "supernode", "--insecure", "--superlink", f"{host}:9093", "--partition-id", "0",
                "--features", none]  # fmt: skip
        assert "'--features'" in _refused(argv, monkeypatch), host


def test_the_control_api_stays_on_loopback_and_pins_are_hex(tmp_path, monkeypatch):
    """Flower's own port (Control API: no authentication) is refused off loopback and on the nodes' port; a pin
    that is not a sha256 and a --superlink that is not HOST:PORT are refused: one line each, before anything
    starts or any store is read."""
    none = str(tmp_path / "none.h5")
    link = ["flower", "superlink", "--insecure", "--port", "9093", "--features", none]
    node = ["flower", "supernode", "--insecure", "--partition-id", "0", "--features", none]
    cases = [
        (link + ["--control-api-address", "0.0.0.0:9091"], "'--control-api-address'"),
        (link + ["--control-api-address", "10.0.0.5:9091"], "'--control-api-address'"),
        (link + ["--control-api-address", "127.0.0.1:9093"], "'--control-api-address'"),
        (link + ["--control-api-address", "127.0.0.1"], "'--control-api-address'"),
        (node + ["--superlink", "127.0.0.1:9093", "--app-sha256", "abc"], "'--app-sha256'"),
        (node + ["--superlink", "127.0.0.1"], "'--superlink'"),
    ]
    for argv, option in cases:
        assert option in _refused(argv, monkeypatch), argv


def test_a_superlink_bound_wider_says_what_its_port_carries(tmp_path, monkeypatch, pki):
    """Bound beyond loopback, ``fedhead flower superlink`` says on stderr, before it starts anything, that its port
    carries the Fleet API alone and where the Control API listens (the processes are stand-ins here: nothing
    binds a non-loopback address in the tests)."""
    import subprocess

    from typer.testing import CliRunner

    import cli
    from fedhead.infra.errors import FedheadError

    def stand_in(*args, **kw):
        raise FedheadError("stand-in: the SuperLink would start here")

    monkeypatch.setattr(os, "execve", stand_in)
    monkeypatch.setattr(subprocess, "Popen", stand_in)
    argv = ["flower", "superlink", *tls_server(pki), "--host", "0.0.0.0", "--port", "9093"]
    res = CliRunner().invoke(cli.app, argv)
    lines = res.stderr.splitlines()
    assert len(lines) == 2 and "stand-in" in lines[1], res.output
    assert "0.0.0.0:9093 carries Flower's Fleet API alone" in lines[0] and "127.0.0.1:9091 only" in lines[0], lines
    res = CliRunner().invoke(cli.app, [a if a != "0.0.0.0" else "127.0.0.1" for a in argv])
    assert res.stderr.splitlines() == ["error: stand-in: the SuperLink would start here"], res.output  # loopback


def test_the_gateway_forwards_the_fleet_api_alone():
    """fedhead's gateway on the nodes' port (fedhead/flower/gateway.py), as an ASGI app in front of a stand-in
    SuperLink: ``POST /v1/fleet/<name>`` passes with its body and the nodes' signed headers, the client's address
    replaces any X-Forwarded-For it claims; the Control and Runtime APIs, other methods, queries, dotted or encoded
    paths get 404 and never reach the SuperLink."""
    import asyncio

    import httpx

    from fedhead.flower.gateway import FleetGateway

    seen = []

    def superlink(request: httpx.Request) -> httpx.Response:
        seen.append(request)

        async def stream():  # a streamed answer, as from a real connection
            yield b"reply:" + request.content

        return httpx.Response(200, content=stream(), headers={"x-flwr": "1"})

    async def call(method: str, path: str, body: bytes = b"", query: bytes = b"", headers=()) -> tuple[int, bytes]:
        gw = FleetGateway("http://127.0.0.1:9", False)
        gw.client = httpx.AsyncClient(transport=httpx.MockTransport(superlink), base_url="http://127.0.0.1:9")
        chunks = [body[:3], body[3:]]
        sent = []

        async def receive():
            part = chunks.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(chunks)}

        async def send(msg):
            sent.append(msg)

        scope = {"type": "http", "method": method, "path": path, "query_string": query, "client": ("10.9.8.7", 5),
                 "headers": [(b"content-length", str(len(body)).encode()), *headers]}  # fmt: skip
        await gw(scope, receive, send)
        await gw.client.aclose()
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    status, body = asyncio.run(
        call("POST", "/v1/fleet/pull-messages", b"protobuf", headers=[(b"x-forwarded-for", b"127.0.0.1"),
             (b"flwr-public-key", b"k"), (b"proxy-authorization", b"x")])
    )  # fmt: skip
    assert (status, body) == (200, b"reply:protobuf")
    fwd = seen.pop()
    assert fwd.url.path == "/v1/fleet/pull-messages" and fwd.headers["flwr-public-key"] == "k"
    assert fwd.headers.get_list("x-forwarded-for") == ["10.9.8.7"] and "proxy-authorization" not in fwd.headers
    for method, path, query in [
        ("POST", "/v1/control/start-run", b""),
        ("POST", "/v1/control/register-node", b""),
        ("POST", "/v1/runtime/acquire-task", b""),
        ("GET", "/v1/fleet/pull-messages", b""),
        ("POST", "/v1/fleet/pull-messages", b"x=1"),
        ("POST", "/v1/fleet/../control/start-run", b""),
        ("POST", "/v1/fleet/pull-messages/", b""),
        ("POST", "/v1/fleet//control", b""),
        ("POST", "/docs", b""),
        ("GET", "/health", b""),
    ]:
        assert asyncio.run(call(method, path, b"x", query))[0] == 404, (method, path, query)
    assert not seen
