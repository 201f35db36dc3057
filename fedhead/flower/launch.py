"""``fedhead flower supernode`` and what a deployment's commands share, without torch: the environment and programs of
Flower's processes, and the checks of TLS certificates and SuperNode keys. A SuperNode's ``fedhead`` process only checks
its options and becomes ``flower-supernode`` (``os.execve``), so the command line imports this module alone for it
(:func:`cli.main` registers only the command it runs); ``fedhead flower superlink`` (:mod:`fedhead.flower.commands`)
uses the same checks."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import List, Optional

import typer

from extract.store import open_store
from fedhead.flower import require_flower
from fedhead.infra.errors import FedheadError, Interval, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import check_out

# ---------------------------------------------------------------- the environment of Flower's processes

TASK_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # Flower's SuperExec: seconds between looks for new tasks


def flower_env(flwr_home: Path | None = None) -> dict:
    """Environment for Flower's processes: the venv's bin first on PATH (they spawn flower-superexec etc.), and their
    SuperExec looking for new tasks every 0.5 s instead of every second (a node starts a ClientApp process per message:
    0.25 s sooner on average; at 0.2 s each SuperExec of a one-minute test deployment used 1.9 s of CPU polling).
    ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` set by the user is kept."""
    env = dict(os.environ)
    env.setdefault(TASK_POLL_ENV, "0.5")
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


def flower_exe(name: str) -> str:
    path = Path(sys.executable).parent / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise FedheadError(f"The '{name}' program was not found. Install the extra: pip install 'fedhead[flower]'")
    return found


# ---------------------------------------------------------------- addresses


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, ``[v6]`` or ``localhost``) is this machine's loopback; a wildcard
    (``0.0.0.0``, ``::``) or any other name is not."""
    import ipaddress

    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_address(param: str, address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as ``(host, port)``, or the one-line error naming ``param``."""
    host, sep, port = address.strip().rpartition(":")
    if (
        not sep
        or not host
        or not port.isdigit()
        or not 1 <= int(port) <= 65535
        or host.count(":")
        and not (host.startswith("[") and host.endswith("]"))
    ):
        raise FedheadError(
            f"The '{param}' parameter must be HOST:PORT (IPv6 as [ADDRESS]:PORT, port 1-65535). Got {address!r} "
            "instead. Pass e.g. 127.0.0.1:9091."
        )
    return host.strip("[]"), int(port)


def refuse_insecure_off_loopback(param: str, host: str) -> None:
    """``--insecure`` only where nothing crosses a network: the updates, the model and the nodes' identities
    would travel in the clear, and anyone on the path could read or change them."""
    if not is_loopback(host):
        raise FedheadError(
            f"The '--insecure' option is refused off loopback. Got '{param}' {host!r}, which is not loopback "
            "(updates and the model would cross the network in the clear). Use TLS (DEPLOY.md step 0), or "
            f"{param} 127.0.0.1 to stay on this machine."
        )


# ---------------------------------------------------------------- the app a SuperNode runs


def stage_app(app_dir: Path, dest: Path) -> Path:
    """A copy of what the FAB can hold: ``pyproject.toml``, ``.gitignore`` and the top-level files and folders that
    its ``fab-include`` patterns start with (``__pycache__`` left out; ``app_dir`` itself when a pattern does not
    start with a name). ``flwr run`` builds the FAB by walking every file under the folder it is given and filtering
    afterwards; a source tree with its ``.venv`` inside has some 70,000 files, and that walk took 7 s of every run's
    start."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    include = tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"].get("fab-include")
    tops = {p.lstrip("/").split("/")[0] for p in include or ["*"]}
    if any(c in top for top in tops for c in "*?[!"):  # a pattern that may match anywhere: build from the tree
        return app_dir
    tops |= {"pyproject.toml", ".gitignore"}
    dest.mkdir(parents=True, exist_ok=True)
    for name in sorted(tops):
        src = app_dir / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, dest / name)
    return dest


APP_DIR = Path(__file__).resolve().parents[2]  # fedhead's source tree: the Flower app (pyproject.toml)


def app_source(app_dir: Path | None = None) -> Path:
    """fedhead's source tree, which ``flwr run`` builds the FAB from (or the one-line error)."""
    app_dir = app_dir or APP_DIR
    if not (app_dir / "pyproject.toml").exists():
        raise FedheadError(
            f"The fedhead Flower app needs its source tree (pyproject.toml) to build the FAB; "
            f"none in {str(app_dir)!r}. Install fedhead from its repository (pip install -e)."
        )
    return app_dir


def own_app_sha256(app_dir: Path | None = None) -> str:
    """The sha256 of the FAB that ``flwr run`` builds from fedhead's source tree: what ``fedhead flower superlink``
    submits and what a node of the same fedhead pins by default (the FAB's zip entries carry a fixed date)."""
    import hashlib
    import tempfile

    from flwr.cli.build import build_fab_from_disk

    src = app_source(app_dir)
    with tempfile.TemporaryDirectory(prefix="fedhead-fab-") as tmp:
        return hashlib.sha256(build_fab_from_disk(stage_app(src, Path(tmp, "app")))).hexdigest()


# ---------------------------------------------------------------- TLS and SuperNode authentication files
# Checked before any process starts: a missing, unreadable or malformed file is one line naming the option,
# the file and how to make a right one (fedhead/flower/DEPLOY.md, step 0 "Certificates and keys").

_TLS_FIX = (
    "Make the CA and the server certificate as fedhead/flower/DEPLOY.md shows (step 0), or pass --insecure on loopback."
)
_KEY_FIX = (
    "Make a SuperNode key pair with: ssh-keygen -t ecdsa -b 384 -N '' -f node-key "
    "(node-key is the private key, node-key.pub the public one)."
)


def _file_bytes(param: str, path: Path, want: str, fix: str) -> bytes:
    """The bytes of the file an option names, or the one-line error (missing, not a file, unreadable, empty)."""
    p = Path(path).expanduser()
    head = f"The '{param}' parameter must name {want}. Got {str(path)!r} instead"
    if not p.exists():
        raise FedheadError(f"{head}, which does not exist. {fix}")
    if not p.is_file():
        raise FedheadError(f"{head}, which is not a regular file. {fix}")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise FedheadError(f"{head}, which cannot be read ({exc.strerror}). {fix}") from None
    if not data.strip():
        raise FedheadError(f"{head}, which is empty. {fix}")
    return data


def check_certificates(param: str, path: Path, fix: str = _TLS_FIX) -> list:
    """The PEM certificates in ``path`` (a certificate, or a chain / CA bundle)."""
    from cryptography import x509

    want = "a PEM certificate file (-----BEGIN CERTIFICATE-----)"
    data = _file_bytes(param, path, want, fix)
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        kind = "a private key" if b"PRIVATE KEY-----" in data else "not a PEM certificate"
        raise FedheadError(
            f"The '{param}' parameter must name {want}. Got {str(path)!r} instead, which is {kind}. {fix}"
        ) from None


def check_tls_key(param: str, path: Path, cert_param: str, cert, fix: str = _TLS_FIX) -> None:
    """An unencrypted PEM private key whose public half is the certificate's."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    want = "an unencrypted PEM private key (-----BEGIN PRIVATE KEY-----)"
    data = _file_bytes(param, path, want, fix)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # encrypted: Flower's servers take no password
        raise FedheadError(
            f"The '{param}' parameter must name {want}. Got {str(path)!r} instead, which is "
            f"encrypted. Decrypt it: openssl pkey -in KEY -out server.key"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        kind = "a certificate" if b"CERTIFICATE-----" in data else "not a PEM private key"
        raise FedheadError(
            f"The '{param}' parameter must name {want}. Got {str(path)!r} instead, which is {kind}. {fix}"
        ) from None
    pub = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*pub) != cert.public_key().public_bytes(*pub):
        raise FedheadError(
            f"The '{param}' parameter must name the private key of the '{cert_param}' "
            f"certificate. Got {str(path)!r} instead, which belongs to another certificate. "
            f"Pass the key made with that certificate."
        )


def check_server_certificate(
    chain: list, cas: list, certfile: Path, ca_certfile: Path, client_host: str | None
) -> None:
    """The SuperLink's certificate is in date, signed by the CA (directly or through the intermediates of its
    file) and, when fedhead connects to the SuperLink itself (``client_host``), names that address."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm

    leaf = chain[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise FedheadError(
            f"The '--ssl-certfile' certificate must be valid now. Got {str(certfile)!r} instead, "
            f"valid from {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} to "
            f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC. Make a new one (DEPLOY.md step 0)."
        )

    def issued_by(cert, issuer) -> bool:
        try:
            cert.verify_directly_issued_by(issuer)
            return True
        except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):  # not its issuer
            return False

    current, rest = leaf, list(chain[1:])
    for _ in range(len(chain)):
        if any(issued_by(current, ca) for ca in cas):
            break
        nxt = next((c for c in rest if issued_by(current, c)), None)
        if nxt is None:
            raise FedheadError(
                f"The '--ssl-certfile' certificate must be signed by the '--ssl-ca-certfile' CA. "
                f"Got {str(certfile)!r}, which {str(ca_certfile)!r} did not sign. Pass the CA "
                "certificate that signed it (the one the nodes get as --root-certificates)."
            )
        rest.remove(nxt)
        current = nxt
    if client_host is None:
        return
    try:
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        sans = x509.SubjectAlternativeName([])
    ips = {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
    dns = [d.lower() for d in sans.get_values_for_type(x509.DNSName)]
    try:
        ok = str(ipaddress.ip_address(client_host)) in ips
    except ValueError:
        host = client_host.lower()
        ok = host in dns or any(d.startswith("*.") and host.partition(".")[2] == d[2:] for d in dns)
    if not ok:
        names = ", ".join([f"IP:{a}" for a in sorted(ips)] + [f"DNS:{d}" for d in dns]) or "none"
        raise FedheadError(
            f"The '--ssl-certfile' certificate must name {client_host} in its subjectAltName "
            f"(fedhead connects to the SuperLink there to register keys and submit the job). Got "
            f"{str(certfile)!r}, which names {names}. Add it (DEPLOY.md step 0)."
        )


def tls_args(insecure: bool, certfile, keyfile, ca_certfile, client_host: str | None = None) -> list[str]:
    """Flower's TLS options of the SuperLink, after checking the three files (Flower needs all three) and
    the certificate (:func:`check_server_certificate`)."""
    given = {"--ssl-certfile": certfile, "--ssl-keyfile": keyfile, "--ssl-ca-certfile": ca_certfile}
    if insecure:
        if any(given.values()):
            name = next(k for k, v in given.items() if v)
            raise FedheadError(
                f"The '--insecure' option contradicts '{name}'. Got both. Drop --insecure to serve "
                "TLS, or drop the certificate options (loopback/tests only)."
            )
        return ["--insecure"]
    if not any(given.values()):
        raise FedheadError(
            "The '--insecure' option is off but no certificate was given. Pass --ssl-certfile, "
            "--ssl-keyfile and --ssl-ca-certfile, or --insecure (loopback/tests only)."
        )
    missing = [k for k, v in given.items() if not v]
    if missing:
        raise FedheadError(
            f"The '{missing[0]}' parameter is required with the other TLS options. Got none. "
            "Pass --ssl-certfile, --ssl-keyfile and --ssl-ca-certfile together."
        )
    cas = check_certificates("--ssl-ca-certfile", ca_certfile)
    chain = check_certificates("--ssl-certfile", certfile)
    check_tls_key("--ssl-keyfile", keyfile, "--ssl-certfile", chain[0])
    check_server_certificate(chain, cas, certfile, ca_certfile, client_host)
    return ["--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile), "--ssl-ca-certfile", str(ca_certfile)]


def _nist_ec(key) -> bool:
    from cryptography.hazmat.primitives.asymmetric import ec

    return isinstance(key, ec.EllipticCurvePublicKey) and isinstance(
        key.curve, (ec.SECP192R1, ec.SECP224R1, ec.SECP256R1, ec.SECP384R1, ec.SECP521R1)
    )


def _key_kind(key) -> str:
    """'an Ed25519 key', 'an RSA key', 'an ECDSA key on secp256k1', ... (for the messages)."""
    curve = getattr(key, "curve", None)
    if curve is not None:
        return f"an ECDSA key on {curve.name}"
    name = type(key).__name__.lstrip("_").replace("PublicKey", "").replace("PrivateKey", "")
    return f"{'an' if name[:1] in 'AEIORU' else 'a'} {name} key"


def check_auth_public_keys(files: list[Path]) -> list[tuple[str, bytes]]:
    """``(label, key line)`` of every SuperNode public key in ``files`` (OpenSSH lines, ``ssh-keygen``'s
    ``.pub``; several per file allowed, blank lines and ``#`` comments skipped), each an ECDSA key on a NIST
    curve as Flower's ``flwr supernode register`` takes it, none twice."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    want = "a file of SuperNode public keys (OpenSSH ECDSA lines, e.g. the .pub of ssh-keygen -t ecdsa -b 384)"
    keys, seen = [], {}
    for path in files:
        lines = _file_bytes("--auth-public-keys", path, want, _KEY_FIX).splitlines()
        for no, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith(b"#"):
                continue
            label = f"{str(path)!r} line {no}"
            try:
                key = serialization.load_ssh_public_key(line)
            except (ValueError, UnsupportedAlgorithm):
                key = None
            if not _nist_ec(key):
                if key is not None:
                    what = f"{_key_kind(key)}, not ECDSA on a NIST curve (Flower's SuperNode keys are)"
                elif b"PRIVATE KEY" in line:
                    what = "part of a private key: list the .pub file, and keep the private key on its node"
                elif b"BEGIN PUBLIC KEY" in line:
                    what = "a PEM public key (convert it: ssh-keygen -i -m PKCS8 -f KEY.pem > KEY.pub)"
                else:
                    what = "not an OpenSSH public key"
                raise FedheadError(
                    f"The '--auth-public-keys' parameter must name {want}. Got {label} instead, "
                    f"which is {what}. {_KEY_FIX}"
                )
            blob = line.split()[1]
            if blob in seen:
                raise FedheadError(
                    f"The '--auth-public-keys' parameter lists the same key twice: {seen[blob]} and "
                    f"{label}. Give every SuperNode its own key pair and list each once."
                )
            seen[blob] = label
            keys.append((label, line))
    if not keys:
        raise FedheadError(
            f"The '--auth-public-keys' parameter must name {want}. Got {[str(f) for f in files]!r} "
            f"instead, which hold no key. {_KEY_FIX}"
        )
    return keys


def check_auth_private_key(path: Path) -> None:
    """The SuperNode's private key as ``flower-supernode --auth-supernode-private-key`` loads it: an
    unencrypted OpenSSH ECDSA key on a NIST curve."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    want = "an OpenSSH ECDSA private key (-----BEGIN OPENSSH PRIVATE KEY-----)"
    data = _file_bytes("--auth-supernode-private-key", path, want, _KEY_FIX)
    head = f"The '--auth-supernode-private-key' parameter must name {want}. Got {str(path)!r} instead, which is"
    try:
        key = serialization.load_ssh_private_key(data, password=None)
    except TypeError:
        raise FedheadError(f"{head} encrypted. Remove the passphrase: ssh-keygen -p -N '' -f KEY") from None
    except (ValueError, UnsupportedAlgorithm):
        kind = (
            "a PEM key, not OpenSSH (convert it: ssh-keygen -p -N '' -f KEY)"
            if b"-----BEGIN" in data and b"OPENSSH" not in data
            else "not an OpenSSH private key"
        )
        raise FedheadError(f"{head} {kind}. {_KEY_FIX}") from None
    if not _nist_ec(key.public_key()):
        raise FedheadError(
            f"{head} {_key_kind(key)}, not ECDSA on a NIST curve (Flower's SuperNode keys are). {_KEY_FIX}"
        )


# ---------------------------------------------------------------- fedhead flower supernode

MAX_DELAY = 3600.0  # seconds: --delay is a slow node for tests and benches, not a way to park one


def check_pins(values: list[str]) -> list[str]:
    """The ``--app-sha256`` values, lower-case hex (or the one-line error)."""
    pins = []
    for h in values:
        if not re.fullmatch(r"[0-9a-fA-F]{64}", h.strip()):
            raise FedheadError(
                f"The '--app-sha256' parameter must be the 64 hex digits of a FAB's sha256. Got {h!r} instead. "
                "Pass the value 'fedhead flower superlink' prints (fedhead: ... FAB sha256 ...)."
            )
        pins.append(h.strip().lower())
    return pins


def make_state_dir(state_dir: Path) -> Path:
    """``--state-dir``, made and writable, as an absolute path (or the one-line error)."""
    state_dir = check_out(state_dir, "--state-dir", kind="dir").resolve()
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FedheadError(
            f"The '--state-dir' parameter names {str(state_dir)!r}, which cannot be created "
            f"({exc.strerror}). Choose a folder this user can write."
        ) from None
    if not os.access(state_dir, os.W_OK | os.X_OK):
        raise FedheadError(
            f"The '--state-dir' parameter names {str(state_dir)!r}, which this user cannot "
            "write. Choose a folder this user can write."
        )
    return state_dir


def check_node_connection(
    superlink: str,
    insecure: bool,
    root_certificates: Optional[Path],
    auth_supernode_private_key: Optional[Path],
    app_sha256: Optional[List[str]],
) -> tuple[list[str], list[str]]:
    """Check the SuperLink address, TLS, node key and app pins; return the pins and flower-supernode's TLS options."""
    link_host, _ = split_address("--superlink", superlink)
    if insecure:
        refuse_insecure_off_loopback("--superlink", link_host)
    pins = check_pins(app_sha256 or [])
    if insecure and root_certificates is not None:
        raise FedheadError(
            "The '--insecure' option contradicts '--root-certificates'. Got both. Drop --insecure "
            "to connect with TLS, or drop --root-certificates (loopback/tests only)."
        )
    if not insecure and root_certificates is None:
        raise FedheadError(
            "The '--insecure' option is off but no --root-certificates was given. Pass the "
            "SuperLink's CA certificate, or --insecure (loopback/tests only)."
        )
    if root_certificates is not None:
        check_certificates(
            "--root-certificates",
            root_certificates,
            "Pass the CA certificate (ca.pem) that signed the SuperLink's certificate.",
        )
    if auth_supernode_private_key is not None:
        if insecure:
            raise FedheadError(
                "The '--auth-supernode-private-key' option needs TLS (Flower's SuperLink refuses "
                "SuperNode authentication without it). Got --insecure. Pass --root-certificates "
                "instead."
            )
        check_auth_private_key(auth_supernode_private_key)
    tls = ["--insecure"] if insecure else ["--root-certificates", str(root_certificates)]
    if auth_supernode_private_key is not None:
        tls += ["--auth-supernode-private-key", str(auth_supernode_private_key)]
    return pins, tls


def node_config_of(
    features: Path, partition_id: int, num_partitions: Optional[int], port: int, device: str, delay: float = 0.0
) -> str:
    """Check the node's store, partition, port and delay; returns its ``--node-config`` (without ``state-dir``)."""
    info = open_store(features, "--features")  # refuse a missing/partial/foreign file right here
    validate("--partition-id", partition_id, Interval(0, None, integer=True))
    if num_partitions is not None:
        validate("--num-partitions", num_partitions, Interval(1, None, integer=True))
        validate("--partition-id", partition_id, Interval(0, num_partitions - 1, integer=True))
    validate("--port", port, Interval(1, 65535, integer=True))
    validate("--delay", delay, Interval(0, MAX_DELAY), "Give the seconds a slow node's train replies wait, e.g. 30.")
    node_config = f"feature-store={str(Path(info.path).resolve())!r} partition-id={partition_id} device={device!r}"
    if num_partitions is not None:
        node_config += f" num-partitions={num_partitions}"
    if delay > 0:
        node_config += f" delay={float(delay)!r}"
    return node_config


def supernode_command(
    pins: list[str], tls: list[str], superlink: str, host: str, port: int, node_config: str
) -> list[str]:
    """The node's command: :mod:`fedhead.flower.pin` (only the pinned apps) wrapping ``flower-supernode``."""
    return [
        sys.executable,
        "-m",
        "fedhead.flower.pin",
        *[a for h in pins for a in ("--app-sha256", h)],
        "--",
        *tls,
        "--superlink",
        superlink,
        "--host",
        host,
        "--port",
        str(port),
        "--node-config",
        node_config,
    ]


@cli_errors
def supernode_cmd(
    superlink: str = typer.Option(..., help="the SuperLink's address HOST:PORT"),
    features: Path = typer.Option(..., "--features", help="this node's own feature store ('fedhead extract')"),
    partition_id: int = typer.Option(..., help="this node's client id, 0 .. clients-1, unique per node"),
    num_partitions: Optional[int] = typer.Option(
        None, help="slice a shared store like 'fedhead train' (= --clients); omit to use the whole store"
    ),
    host: str = typer.Option("127.0.0.1", help="address of this node's local runtime API"),
    port: int = typer.Option(9094, help="port of this node's local runtime API (one per node per machine)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda for local training"),
    insecure: bool = typer.Option(False, "--insecure", help="no TLS (loopback and tests only)"),
    root_certificates: Optional[Path] = typer.Option(
        None, help="CA certificate of the SuperLink's TLS (PEM): the node connects only to a SuperLink it signed"
    ),
    auth_supernode_private_key: Optional[Path] = typer.Option(
        None,
        "--auth-supernode-private-key",
        help="this node's private key for SuperNode authentication (OpenSSH ECDSA, ssh-keygen -t ecdsa -b 384); "
        "its .pub must be listed in the SuperLink's --auth-public-keys. Needs TLS",
    ),
    state_dir: Optional[Path] = typer.Option(
        None,
        help="folder where this node also keeps its SCAFFOLD control variates, so that a server resumed "
        "in a new Flower run continues SCAFFOLD; without it a resume restarts SCAFFOLD from zero",
    ),
    delay: float = typer.Option(
        0.0,
        "--delay",
        help="a testing and bench aid: this node's train replies leave SECONDS later (a slow node; "
        "'fedhead bench deploy --async'). 0: none",
    ),
    app_sha256: Optional[List[str]] = typer.Option(
        None,
        "--app-sha256",
        help="the only apps this node runs: the sha256 of their FAB, as 'fedhead flower superlink' prints it "
        "(repeat for several) \\[default: the FAB of this fedhead's own source tree]",
    ),
):
    """Start a Flower SuperNode that trains the head on this machine's own feature store."""
    require_flower()

    # every file and option before the node starts
    pins, tls = check_node_connection(superlink, insecure, root_certificates, auth_supernode_private_key, app_sha256)
    node_config = node_config_of(features, partition_id, num_partitions, port, device, delay)
    flower_exe("flower-supernode")
    if not pins:  # building the FAB takes a moment: after the other checks
        pins = [own_app_sha256()]
    if state_dir is not None:  # last: the folder is made only when every other option is good
        node_config += f" state-dir={str(make_state_dir(state_dir))!r}"
    print(f"fedhead: this node runs only the app(s) with FAB sha256 {', '.join(pins)}", file=sys.stderr)
    cmd = supernode_command(pins, tls, superlink, host, port, node_config)
    os.execve(cmd[0], cmd, flower_env())
