"""``fedhead finetune`` on Flower: the fine-tuning job's rounds over Flower's message API (a simulation with one
virtual SuperNode per client, or any other Grid).

The server is :class:`FlowerFinetuneJob`, the simulator's :class:`~fedhead.scratch.finetune.FinetuneJob` (the same
setup of a seed, the same client selection, ``Accumulator``, ``--peft`` aggregation, server optimiser and
evaluation) with its clients reached through a Grid instead of trained in process:

- node -> client: before a seed's first round every node is asked (a ``query`` message) which client it is; it
  answers its node config's ``partition-id`` (Flower's simulation sets it, ``0..K-1``) and its training size. The
  server maps each client index to the one node that claimed it; a second claim, an index outside ``0..K-1`` or
  a size that is not the client's (the server's own setup of the seed knows every client's size) refuses that
  node, and the client then fails each round it is selected in;
- a round: the global trainable vector (``ArrayRecord`` ``theta``, float32 ``[P]``) goes to the node of each
  selected client with the run's identity hash, the seed, the round and the client index (``ConfigRecord``); the
  node rebuilds the seed's deterministic setup once per process (:func:`node_setup`: the images, the partition,
  the model), trains with :meth:`~fedhead.scratch.finetune.Trainer.train_client` keyed by ``(seed, round,
  client)`` as the simulator does, and replies its trainable vector and its sample count;
- every reply is hostile input (:func:`check_train_reply`): exactly one array ``theta`` whose ``.npy`` header says
  float32 ``[P]`` and whose bytes hold exactly that (checked before anything is read, so nothing is allocated for
  what a header claims), finite; ``client`` the index it was sent for; ``num-examples`` an integer in ``1..`` the
  client's size; ``train-loss`` and ``client-ms`` finite numbers. A bad reply, an error reply or none within the
  timeout is that client's failure (logged, counted in the row's ``failures``, listed in
  :attr:`FlowerFinetune.failures`); the round aggregates the others in client order, as the simulator adds them.

The server holds the whole data set here (a simulation): the test accuracy and the validation accuracy on the
clients' pooled validation parts are computed on the server exactly as the simulator computes them. Bytes are the
simulator's accounting (the rule's message; the wire carries the dense float32 vector both ways). The run is the
simulator's run directory (the one round loop: config, rounds.csv, a checkpoint after every round, ``resume``, the
model files), with the rows' ``failures`` and ``exchange_ms`` beside; :func:`run_finetune_flower` also returns the rows
and the final vectors.
"""

from __future__ import annotations

import io
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from fedhead.core.peft import trainable_vector
from fedhead.federation.rundir import identity_hash
from fedhead.infra.devices import resolve_device, set_cpu_threads
from fedhead.infra.errors import FedheadError, param_error
from fedhead.scratch.finetune import (
    FinetuneConfig,
    FinetuneJob,
    Images,
    Trained,
    Trainer,
    build_model,
    client_key,
    fresh,
    identity_fields,
    loaded,
    resolve_finetune,
    run_finetune,
    setup_seed,
)

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation
except ImportError:  # pragma: no cover - the optional extra
    raise FedheadError("Flower is not installed. Install it with: pip install 'fedhead[flower]'") from None

LOG = logging.getLogger(__name__)
ROWS = ["seed", "round", "stage", "accuracy", "val_accuracy", "train_loss", "client_ms", "server_ms",
        "bytes_up_per_client", "bytes_total", "clients", "failures", "exchange_ms"]  # fmt: skip
REASON_CHARS = 200
NPY_HEADER = 65536  # the most bytes of a reply's .npy header read before its size is known


@dataclass
class FlowerFinetune:
    """What a Flower fine-tuning run gives back: the per-round rows (the simulator's fields and ``failures``), the
    final global trainable vector of each seed, every client failure and every refused node."""

    rows: list[dict] = field(default_factory=list)
    thetas: dict[int, torch.Tensor] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)  # {seed, round, client, reason}
    refused: list[dict] = field(default_factory=list)  # {seed, node, reason}
    summary: dict = field(default_factory=dict)  # the run directory's summary.json


# ---------------------------------------------------------------- replies: hostile input


class BadReply(Exception):
    """A reply that fails a check (turned into its reason by the check functions)."""


def _reason(kind: str, text: str) -> str:
    return " ".join(f"bad {kind} reply refused: {text}".split())[:REASON_CHARS]


def _int(m, key: str, lo: int, hi: int) -> int:
    v = m[key]
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise BadReply(f"{key} is not an integer")
    if not lo <= int(v) <= hi:
        raise BadReply(f"{key} {int(v)} outside [{lo}, {hi}]")
    return int(v)


def _number(m, key: str, lo: float | None = None) -> float:
    v = m[key]
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise BadReply(f"{key} is not a number")
    if not math.isfinite(float(v)) or (lo is not None and float(v) < lo):
        raise BadReply(f"{key} {float(v)!r} is not a finite number" + (f" >= {lo:g}" if lo is not None else ""))
    return float(v)


def read_vector(arr: Any, params: int, what: str = "theta") -> np.ndarray:
    """A Flower ``Array`` holding exactly float32 ``[params]``, finite, as numpy. The ``.npy`` header is read from
    at most :data:`NPY_HEADER` bytes and checked against the bytes that follow before any value is read."""
    if not isinstance(arr, Array) or arr.stype != "numpy.ndarray":
        raise BadReply(f"{what} is not a numpy Flower Array")
    data = arr.data
    if not isinstance(data, (bytes, bytearray)):
        raise BadReply(f"{what}'s data are not bytes")
    f = io.BytesIO(bytes(data[:NPY_HEADER]))
    try:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, fortran, dt = read(f)
    except Exception as exc:  # noqa: BLE001 - any unreadable header is the node's failure
        raise BadReply(f"{what} is not a .npy array ({type(exc).__name__})") from None
    if fortran or dt != np.dtype("<f4") or tuple(shape) != (params,):
        raise BadReply(f"{what} is {dt} {tuple(shape)}, expected float32 ({params},)")
    if len(data) - f.tell() != 4 * params:
        raise BadReply(f"{what} has {len(data) - f.tell()} data bytes, expected {4 * params}")
    a = np.frombuffer(data, dtype="<f4", count=params, offset=f.tell()).astype(np.float32)
    if not np.isfinite(a).all():
        raise BadReply(f"{what} holds inf or nan")
    return a


@dataclass(frozen=True)
class TrainReply:
    vector: np.ndarray  # float32 [P]
    num_examples: int
    loss: float
    client_ms: float


def check_train_reply(reply: Any, client: int, size: int, params: int) -> TrainReply | str:
    """A node's train reply for ``client`` (``size`` training samples) as :class:`TrainReply`, or the one-line
    reason it is refused (an error reply's reason included). Never raises."""
    try:
        if reply.has_error():
            return " ".join(f"the node failed: {reply.error.reason}".split())[:REASON_CHARS]
        content = reply.content
        if set(content.array_records) != {"arrays"} or set(content["arrays"].keys()) != {"theta"}:
            raise BadReply("the arrays are not exactly one 'theta'")
        if "metrics" not in content.metric_records:
            raise BadReply("no metrics record")
        m = content["metrics"]
        if _int(m, "client", 0, 2**31) != client:
            raise BadReply(f"client {m['client']}, but the message was for client {client}")
        n = _int(m, "num-examples", 1, size)
        loss, ms = _number(m, "train-loss"), _number(m, "client-ms", 0.0)
        return TrainReply(read_vector(content["arrays"]["theta"], params), n, loss, ms)
    except BadReply as exc:
        return _reason("train", str(exc))
    except KeyError as exc:
        return _reason("train", f"missing {exc}")
    except Exception as exc:  # noqa: BLE001 - any malformed record is the node's failure
        return _reason("train", f"malformed record ({type(exc).__name__}: {exc})")


def check_query_reply(reply: Any, clients: int, sizes: list[int]) -> int | str:
    """The client index a node's query reply claims (its ``num-examples`` must be that client's size), or the
    one-line reason the node is refused. Never raises."""
    try:
        if reply.has_error():
            return " ".join(f"the node failed: {reply.error.reason}".split())[:REASON_CHARS]
        m = reply.content["metrics"]
        k = _int(m, "client", 0, clients - 1)
        n = _int(m, "num-examples", 0, 2**53)
        if n != sizes[k]:
            raise BadReply(f"num-examples {n}, but client {k} has {sizes[k]}")
        return k
    except BadReply as exc:
        return _reason("query", str(exc))
    except KeyError as exc:
        return _reason("query", f"missing {exc}")
    except Exception as exc:  # noqa: BLE001
        return _reason("query", f"malformed record ({type(exc).__name__}: {exc})")


def by_node(replies, sent: list) -> list[tuple[int, Any]]:
    """``(node, reply)``: the node a message was sent to names its reply (a reply the SuperLink writes itself names
    the SuperLink as sender)."""
    dst = {m.metadata.message_id: m.metadata.dst_node_id for m in sent if m.metadata.message_id}
    return [(dst.get(r.metadata.reply_to_message_id, r.metadata.src_node_id), r) for r in replies]


# ---------------------------------------------------------------- the server: the simulator's job over a Grid


class FlowerFinetuneJob(FinetuneJob):
    """:class:`FinetuneJob` whose clients train on the nodes of ``grid`` (see the module's docstring)."""

    fields = ROWS

    def __init__(self, cfg: FinetuneConfig, enc, data: Images, device, grid: Grid, *, timeout: float,
                 out: FlowerFinetune):  # fmt: skip
        super().__init__(cfg, enc, data, device, log=None, run=None)
        self.grid, self.timeout, self.out = grid, timeout, out
        self.identity = identity_hash(identity_fields(cfg))

    def round(self, unit: tuple, rnd: int) -> dict:
        row = super().round(unit, rnd)
        self.out.rows.append(row)
        return row

    def finish_unit(self, unit: tuple, rows: list) -> tuple[list, dict]:
        self.out.thetas[unit[0]] = self.theta.detach().cpu().clone()
        return super().finish_unit(unit, rows)

    def start(self, unit: tuple, saved: dict | None) -> tuple[int, list]:
        first = super().start(unit, saved)
        self.params = int(self.theta.numel())
        self.sizes = [len(p) for p in self.s.parts]
        self.node_of = self.connect(unit[0])
        return first

    def _config(self, seed: int, **extra) -> ConfigRecord:
        return ConfigRecord({"identity": self.identity, "seed": int(seed), **extra})

    def connect(self, seed: int) -> dict[int, int]:
        """Ask every node which client it is: ``{client: node}`` (refused nodes logged and recorded)."""
        t0 = time.monotonic()
        ids = list(self.grid.get_node_ids())
        while len(ids) < self.cfg.clients and time.monotonic() - t0 < self.timeout:
            time.sleep(0.5)
            ids = list(self.grid.get_node_ids())
        msgs = [Message(RecordDict({"config": self._config(seed)}), dst_node_id=n, message_type=MessageType.QUERY,
                        group_id=f"query-{seed}") for n in ids]  # fmt: skip
        node_of: dict[int, int] = {}
        for node, r in by_node(self.grid.send_and_receive(msgs, timeout=self.timeout), msgs):
            k = check_query_reply(r, self.cfg.clients, self.sizes)
            if isinstance(k, int) and k in node_of:
                k = f"client {k} is claimed by node {node_of[k]} already"
            if isinstance(k, str):
                LOG.warning("[fedhead] node %s refused: %s", node, k)
                self.out.refused.append({"seed": seed, "node": int(node), "reason": k})
                continue
            node_of[k] = node
        return node_of

    def exchange(self, seed: int, rnd: int, selected: list[int]) -> tuple[dict[int, TrainReply], dict[int, str]]:
        """One train message to the node of each selected client; its checked replies and the failures."""
        failed: dict[int, str] = {}
        arrays = ArrayRecord({"theta": Array(self.theta.detach().cpu().numpy().astype(np.float32))})
        msgs, client_of = [], {}
        for k in selected:
            if k not in self.node_of:
                failed[k] = "no node holds this client"
                continue
            client_of[self.node_of[k]] = k
            content = RecordDict({"arrays": arrays, "config": self._config(seed, round=int(rnd), client=int(k))})
            msgs.append(Message(content, dst_node_id=self.node_of[k], message_type=MessageType.TRAIN,
                                group_id=str(rnd)))  # fmt: skip
        got: dict[int, TrainReply] = {}
        answered: set[int] = set()
        replies = self.grid.send_and_receive(msgs, timeout=self.timeout) if msgs else []
        for node, r in by_node(replies, msgs):
            k = client_of.get(node)
            if k is None:
                continue
            if k in answered:  # a second reply: neither is used
                got.pop(k, None)
                failed[k] = "bad train reply refused: more than one reply"
                continue
            answered.add(k)
            checked = check_train_reply(r, k, self.sizes[k], self.params)
            if isinstance(checked, str):
                failed[k] = checked
            else:
                got[k] = checked
        for k in client_of.values():
            if k not in answered:
                failed[k] = f"no reply within {self.timeout:g} s"
        return got, failed

    def train_clients(self, seed: int, rnd: int, selected: list[int]) -> Trained:
        """The selected clients trained on their nodes; a failed or malformed reply is that client's failure."""
        t0 = time.perf_counter()
        got, failed = self.exchange(seed, rnd, selected)
        exchange_ms = (time.perf_counter() - t0) * 1000
        for k, why in sorted(failed.items()):
            LOG.warning("[fedhead] seed %s round %s: client %s left out: %s", seed, rnd, k, why)
            self.out.failures.append({"seed": seed, "round": rnd, "client": k, "reason": why})
        replies = [got[k] for k in sorted(got)]
        return Trained(
            vectors=[torch.from_numpy(r.vector).to(self.device) for r in replies],
            sizes=[r.num_examples for r in replies],
            losses=[r.loss for r in replies],
            client_ms=float(np.mean([r.client_ms for r in replies])) if replies else None,
            extra={"failures": len(failed), "exchange_ms": exchange_ms},
        )


def serve_finetune(grid: Grid, cfg: FinetuneConfig, out_dir, *, timeout: float = 600.0, resume: bool = False,
                   log: Callable[[str], None] = lambda s: None) -> FlowerFinetune:  # fmt: skip
    """Run every seed of ``cfg`` with its clients on the nodes of ``grid`` through the one round loop
    (:func:`fedhead.scratch.finetune.run_finetune`: the run directory ``out_dir``, a checkpoint after every round,
    ``resume``); returns the rows, the final vectors and the summary."""
    cfg = checked_config(cfg)
    out = FlowerFinetune()

    def make(cfg, enc, data, device, log_, run):
        job = FlowerFinetuneJob(cfg, enc, data, device, grid, timeout=timeout, out=out)
        job.log, job.run = log_, run
        return job

    out.summary = run_finetune(cfg, out_dir, log=log, resume=resume, make_job=make)
    return out


def checked_config(cfg: FinetuneConfig) -> FinetuneConfig:
    """``cfg`` resolved (:func:`resolve_finetune`) and refused in one line where this path does not apply."""
    cfg = resolve_finetune(cfg)
    if cfg.peft == "head":
        raise param_error("--peft", "head", "trains a head on frozen features, not on Flower's fine-tuning path",
                          "Run 'fedhead flower simulate' on the extracted features instead.")  # fmt: skip
    return cfg


# ---------------------------------------------------------------- the nodes


@dataclass
class NodeSetup:
    """One process's setup of a seed: every client's training indices, the images and labels, the model."""

    trainer: Trainer
    data: Images
    y: torch.Tensor  # training labels after label noise (CPU)
    parts: list[np.ndarray]


_SETUPS: dict = {}  # this process's setup of a seed: {(identity, seed): NodeSetup} (one entry)


def node_setup(cfg: FinetuneConfig, seed: int) -> NodeSetup:
    """The seed's setup, built once per process (every virtual node that runs in it shares it)."""
    identity = identity_hash(identity_fields(cfg))
    if (identity, seed) not in _SETUPS:
        _SETUPS.clear()
        enc, data = loaded(cfg)  # the process's encoder and images, as the simulator keeps them
        device = resolve_device(cfg.device)
        if device.type == "cpu":
            set_cpu_threads()
        s = setup_seed(cfg, data, seed)
        model, tuning = build_model(cfg, fresh(enc), len(data.classes), seed)
        model.to(device)
        if device.type == "cuda":
            model.to(memory_format=torch.channels_last)
        _SETUPS[(identity, seed)] = NodeSetup(Trainer(cfg, enc, model, tuning, device), data, s.y, s.parts)
    return _SETUPS[(identity, seed)]


def _own_client(context: Context, cfg: FinetuneConfig) -> int:
    k = context.node_config.get("partition-id")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < cfg.clients:
        raise FedheadError(f"This node's 'partition-id' is {k!r}; give it a client index in 0..{cfg.clients - 1}.")
    return k


def _server_config(msg: Message, cfg: FinetuneConfig) -> ConfigRecord:
    conf = msg.content["config"]
    if conf.get("identity") != identity_hash(identity_fields(cfg)):
        raise FedheadError("The server runs another fine-tuning configuration than this node's; start both with "
                           "the same options.")  # fmt: skip
    seed = conf.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed not in cfg.seeds:
        raise FedheadError(f"The server asked for seed {seed!r}, which this run does not have ({cfg.seeds}).")
    return conf


def make_finetune_client_app(cfg: FinetuneConfig) -> ClientApp:
    """A ClientApp training the client of its node's ``partition-id`` for the fine-tuning run ``cfg``."""
    cfg = checked_config(cfg)
    app = ClientApp()

    @app.query()
    def hello(msg: Message, context: Context) -> Message:
        k, conf = _own_client(context, cfg), _server_config(msg, cfg)
        setup = node_setup(cfg, int(conf["seed"]))
        metrics = MetricRecord({"client": k, "num-examples": len(setup.parts[k])})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        t0 = time.perf_counter()
        k, conf = _own_client(context, cfg), _server_config(msg, cfg)
        if conf.get("client") != k:
            raise FedheadError(f"The server sent client {conf.get('client')!r}'s message to the node of client {k}.")
        seed, rnd = int(conf["seed"]), conf.get("round")
        if isinstance(rnd, bool) or not isinstance(rnd, int) or not 1 <= rnd <= cfg.rounds:
            raise FedheadError(f"The server sent round {rnd!r}; this run has rounds 1..{cfg.rounds}.")
        setup = node_setup(cfg, seed)
        tr = setup.trainer
        params = int(trainable_vector(tr.model).numel())
        try:
            theta = torch.from_numpy(read_vector(msg.content["arrays"]["theta"], params)).to(tr.device)
        except BadReply as exc:
            raise FedheadError(f"The server's global vector is refused: {exc}.") from None
        idx = torch.from_numpy(setup.parts[k])
        vec, loss = tr.train_client(theta, setup.data.train_x[idx].to(tr.device), setup.y[idx].to(tr.device),
                                    client_key(seed, rnd, k))  # fmt: skip
        metrics = {"client": k, "num-examples": len(idx), "train-loss": float(loss),
                   "client-ms": (time.perf_counter() - t0) * 1000}  # fmt: skip
        arrays = ArrayRecord({"theta": Array(vec.detach().cpu().numpy().astype(np.float32))})
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


# ---------------------------------------------------------------- Flower's simulation engine


def make_finetune_server_app(cfg: FinetuneConfig, out_dir, results: list, *, timeout: float = 600.0,
                             log: Callable[[str], None] = lambda s: None) -> ServerApp:  # fmt: skip
    """A ServerApp running :func:`serve_finetune`; its outcome (or its exception) is appended to ``results``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            results.append(serve_finetune(grid, cfg, out_dir, timeout=timeout, log=log))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
            results.append(exc)

    return app


def run_finetune_flower(cfg: FinetuneConfig, out_dir, *, num_cpus: int | None = None, client_cpus: float = 1.0,
                        timeout: float = 600.0, log: Callable[[str], None] = lambda s: None) -> FlowerFinetune:  # fmt: skip
    """``cfg`` on Flower's simulation engine (Ray): one virtual SuperNode per client, the server in this process.
    ``timeout``: seconds to wait for a message's replies (the first starts the nodes' processes). Returns the
    per-round rows and each seed's final global trainable vector; the run directory is ``out_dir``."""
    cfg = checked_config(cfg)
    results: list = []
    backend = {
        "client_resources": {"num_cpus": float(client_cpus), "num_gpus": 0.0},
        "init_args": {"num_cpus": int(num_cpus or os.cpu_count() or 1), "include_dashboard": False,
                      "logging_level": "ERROR", "log_to_driver": True},
    }  # fmt: skip
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    run_simulation(make_finetune_server_app(cfg, out_dir, results, timeout=timeout, log=log), make_finetune_client_app(cfg),
                   num_supernodes=cfg.clients, backend_config=backend)  # fmt: skip
    if not results:
        raise FedheadError("The Flower simulation ended without a result (see the log above).")
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]


__all__ = ["FlowerFinetune", "FlowerFinetuneJob", "check_train_reply", "make_finetune_client_app",
           "make_finetune_server_app", "run_finetune_flower", "serve_finetune"]  # fmt: skip
