"""What a fedhead node does with each message: the handlers behind :mod:`fedhead.flower.client_app`, which
imports this module on a message's first need (the SecAgg+ stages that only exchange keys and shares never
import it, nor torch).

Local training is the simulator's own code: ``Engine.train_block(theta, [partition-id], seed, round)``, whose
batch order is keyed by (seed, round, client, epoch), so a Flower client reproduces the simulated client's
update. The store is read once per process and cached (module-level cache keyed by path).

SCAFFOLD (``--scaffold``): the node keeps its control variate ``c_k`` in Flower's ``Context.state`` (record
``fedhead-scaffold``, which persists on the node between the messages of one Flower run) and trains with a
one-client :class:`fedhead.core.engine.ScaffoldState` built from it and the server's ``c``; it replies with its head
and its delta ``c_k+ - c_k``. It keeps two versions, by the tags the server gives: the variate the round started
from and the one it ended with, so the server (which names the version whose delta it applied last) and the node
agree even when a reply is lost. With a state folder the record is also written there (atomically, one file per
partition and (config, seed)) and read back when a new Flower run starts with an empty ``Context.state``; the tags
name the config, seed, the server's run id and SCAFFOLD's generation, so a file of another run is never taken for
this one's. Error feedback (``--aggregate fedavg-int8`` / ``fedavg-topk``): the node keeps its residual ``e_k``
the same way (record ``fedhead-residual``, two versions by the tags ``residual-in`` / ``residual-out``, files
``residual-p<id>-<key>.safetensors``, :mod:`fedhead.infra.safestate`) and sends its update compressed (the rule's
wire form); a node that lost the version the server names starts from a zero residual (nothing to restart: only what compression held back is lost). CCVR (``--calibrate ccvr``): the ``query.ccvr`` message returns :func:`fedhead.federation.clients.ccvr_client_stats` of the node's prepared features (:meth:`fedhead.core.ccvr.ClassStats.to_bytes`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from fedhead.flower.common import require_flower

require_flower()

import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402

from extract.store import Features, load_store  # noqa: E402
from fedhead.core.aggregate import aggregator_of  # noqa: E402
from fedhead.core.clientacc import LocalTests  # noqa: E402
from fedhead.core.closedform import client_stats  # noqa: E402
from fedhead.core.compress import Residuals, keeps_residuals  # noqa: E402
from fedhead.core.dp import feature_clip  # noqa: E402
from fedhead.core.engine import ClientSet, Engine, LocalConfig, OptimConfig, ScaffoldState, accuracy_and_loss  # noqa: E402
from fedhead.core.heads import create_head  # noqa: E402
from fedhead.core.linalg import clip_rows  # noqa: E402
from fedhead.core.noise import apply_noise  # noqa: E402
from fedhead.core.partitions import class_counts  # noqa: E402
from fedhead.core.personal import BETA_GRID, create_personalizer  # noqa: E402
from fedhead.core.personalize import ClientData, Setting, personalize_clients  # noqa: E402
from fedhead.core.plugins import load_plugins  # noqa: E402,F401 (the ClientApp's, before a handler runs)
from fedhead.federation.clients import (  # noqa: E402
    FeatureStats,
    build_federation,
    ccvr_client_stats,
    holdout,
    noise_dataset_name,
    prepare,
)
from fedhead.flower.common import (
    MESSAGE_PREFIX,
    beta_choice,
    canonical_run_config,
    check_fingerprint,
    client_stats_record,
    config_from_json,
    global_stats_from_record,
    store_fingerprint,
    test_split_key,
)
from fedhead.flower.secure import KIND as SECURE_KIND  # noqa: E402
from fedhead.flower.secure import node_values, plain_content, secure_reply  # noqa: E402
from fedhead.infra.devices import resolve_device  # noqa: E402
from fedhead.infra.errors import FedheadError  # noqa: E402
from fedhead.infra.safestate import load_state, save_state

LOG = logging.getLogger("flwr")
_STORES: dict[str, Features] = {}
_LOCAL: dict[tuple, "LocalData"] = {}
_TEST_KEYS: dict[str, str] = {}  # store path -> test_split_key of its test split (personalize)
VARIATES = "fedhead-scaffold"  # Context.state record: this node's SCAFFOLD c_k, by version tag
RESIDUALS = "fedhead-residual"  # Context.state record: this node's error-feedback residual e_k, by version tag
NODE_STATE = "node-state"  # simulation: the virtual nodes' state folder inside the server's run folder


@dataclass
class NodeSettings:
    store: str
    pid: int
    num_partitions: int | None
    device: str = "auto"
    state_dir: str | None = None  # SCAFFOLD: where the node's variates are also kept on disk
    delay: float = 0.0  # seconds a train reply waits before it leaves (a slow node: tests and benches alone)


@dataclass
class LocalData:
    """One node's view of the federation for one (config, seed): its slice, labels after noise, counts."""

    store: Features
    pid: int
    parts: list  # client id -> indices; only entry ``pid`` is this node's (others empty
    labels: np.ndarray  # in own-store mode)
    counts: np.ndarray  # [len(parts), C]
    device: torch.device
    engines: dict = field(default_factory=dict)
    val: np.ndarray | None = None  # this node's validation part (--val-fraction; None: none held out)

    @property
    def mine(self) -> np.ndarray:
        return self.parts[self.pid]

    def stats_message(self, clip: float | None = None) -> tuple[np.ndarray, float, int]:
        """Feature sum (float64), sum of squared norms and count over this node's samples (``clip``: DP's
        per-sample feature-norm clip first, as :func:`fedhead.federation.clients.federated_feature_stats` does)."""
        xp = (
            self.store.train_x[self.mine].astype(np.float64)
            if clip is None
            else clip_rows(self.store.train_x[self.mine], clip)
        )
        return xp.sum(0), float((xp * xp).sum()), len(self.mine)

    def engine(self, cfg, stats: FeatureStats) -> Engine:
        key = (
            None if stats.mean is None else hashlib.sha1(stats.mean.tobytes()).hexdigest(),
            stats.scale,
            cfg.head,
            tuple(sorted(cfg.head_params.items())),
            cfg.optimizer,
            cfg.lr,
            cfg.weight_decay,
            cfg.momentum,
            cfg.local_epochs,
            cfg.local_steps,
            cfg.batch_size,
            cfg.backend,
        )
        eng = self.engines.get(key)
        if eng is None:
            x = prepare(self.store.train_x, stats, self.device)
            data = ClientSet(
                x=x,
                y=torch.as_tensor(self.labels, device=self.device),
                parts=self.parts,
                counts=self.counts,
                num_classes=self.store.info.num_classes,
            )
            eng = Engine(
                data,
                create_head(cfg.head, **cfg.head_params),
                OptimConfig(name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum),
                LocalConfig(epochs=cfg.local_epochs, batch_size=cfg.batch_size, steps=cfg.local_steps),
                backend=cfg.backend,
                block_clients=1,
            )
            self.engines = {key: eng}  # one prepared copy per process is enough
        return eng


def node_settings(
    context: Context, default_store: str | None = None, default_state_dir: str | None = None
) -> NodeSettings:
    nc = dict(context.node_config)
    store = nc.get("feature-store") or context.run_config.get("client-feature-store") or default_store
    if not store and nc.get("num-partitions", "") != "":
        # Flower's simulation: every virtual node slices the one shared store the server also uses
        rc = canonical_run_config(dict(context.run_config))
        store = rc.get("features", "")
    if not store:
        raise FedheadError(
            "This SuperNode has no feature store. Start it with --node-config "
            "\"feature-store='PATH' partition-id=N\" (PATH written by 'fedhead extract')."
        )
    if "partition-id" not in nc:
        raise FedheadError(
            "This SuperNode has no partition id. Start it with --node-config "
            "\"feature-store='PATH' partition-id=N\" (N = 0 .. clients-1, unique per node)."
        )
    try:
        pid = int(nc["partition-id"])
        nparts = int(nc["num-partitions"]) if nc.get("num-partitions", "") != "" else None
    except (TypeError, ValueError):
        raise FedheadError(
            f"The node config 'partition-id'/'num-partitions' must be integers. Got "
            f"{nc.get('partition-id')!r}/{nc.get('num-partitions')!r} instead."
        ) from None
    state_dir = nc.get("state-dir") or None
    if state_dir is None and not nc.get("feature-store"):  # simulation: the nodes share the server's machine
        run_dir = canonical_run_config(dict(context.run_config)).get("out")
        state_dir = str(Path(str(run_dir)) / NODE_STATE) if run_dir else default_state_dir
    return NodeSettings(
        str(store),
        pid,
        nparts,
        str(nc.get("device", "auto")),
        None if state_dir is None else str(state_dir),
        float(nc.get("delay") or 0.0),  # 'fedhead flower supernode --delay' checked it
    )


def open_node_store(path: str) -> Features:
    key = str(Path(path).resolve())
    if key not in _STORES:
        _STORES[key] = load_store(path, param="feature-store (node config)")
    return _STORES[key]


def local_data(ns: NodeSettings, cfg, seed: int) -> LocalData:
    key = (str(Path(ns.store).resolve()), ns.pid, ns.num_partitions, cfg.identity(), seed, ns.device)
    if key in _LOCAL:
        return _LOCAL[key]
    store = open_node_store(ns.store)
    C = store.info.num_classes
    if ns.num_partitions is not None:
        if ns.num_partitions != cfg.clients:
            raise FedheadError(
                f"The node config 'num-partitions' must equal the server's --clients "
                f"({cfg.clients}). Got {ns.num_partitions} instead."
            )
        if not 0 <= ns.pid < ns.num_partitions:
            raise FedheadError(
                f"The node config 'partition-id' must be in [0, {ns.num_partitions}). Got {ns.pid} instead."
            )
        fed = build_federation(store, cfg, seed, cfg.partition, cfg.partition_params)
        parts, labels, counts = fed.parts, fed.labels, fed.counts
        val = None if fed.val_parts is None else fed.val_parts[ns.pid]
    else:
        # own store: all of its training split is this node's data; noise keyed by (seed, partition id)
        empty = np.zeros(0, dtype=np.int64)
        parts = [empty] * ns.pid + [np.arange(len(store.train_y))]
        noisy, _ = apply_noise(
            cfg.noise,
            cfg.noise_rate,
            [store.train_y[p] for p in parts],
            C,
            dataset=noise_dataset_name(store, cfg),
            seed=seed,
            asym_rule=cfg.asym_map,
        )
        labels = noisy[ns.pid]
        val = None
        if cfg.val_fraction:  # the node's own validation part, as build_federation holds one out of each client's
            parts, vals = holdout(parts, labels, cfg.val_fraction, seed)
            val = None if vals is None else vals[ns.pid]
        counts = class_counts(parts, labels, C)
    if len(_LOCAL) > 8:
        _LOCAL.clear()
    ld = LocalData(store, ns.pid, parts, labels, counts, resolve_device(ns.device), val=val)
    _LOCAL[key] = ld
    return ld


def hello(msg: Message, context: Context, default_store: str | None, default_state_dir: str | None) -> Message:
    """The ``query`` handler: the node's size, class counts and flipped labels, the statistics the server asks for
    and the SCAFFOLD variates it holds (under secure aggregation: its id and variates only; the rest goes summed)."""
    c = msg.content["config"]
    cfg = config_from_json(str(c["train-config"]))
    ns = node_settings(context, default_store, default_state_dir)
    store = open_node_store(ns.store)
    check_fingerprint(
        store_fingerprint(store.info),
        _json(c["server-store"]),
        f"The feature store {ns.store!r} of node partition {ns.pid}",
    )
    ld = local_data(ns, cfg, int(c["seed"]))
    if cfg.secure_aggregation and not str(c.get(SECURE_KIND, "")):
        # secure aggregation: sizes, class counts and statistics reach the server only summed (SecAgg+)
        content = {"metrics": MetricRecord({"partition-id": ns.pid})}
        if cfg.scaffold:
            held = held_variates(context, ns, cfg, int(c["seed"]))
            content["config"] = ConfigRecord({"scaffold-tags": " ".join(held.keys() if held is not None else [])})
        return Message(RecordDict(content), reply_to=msg)
    flipped = int((ld.labels[ld.mine] != store.train_y[ld.mine]).sum())
    metrics = {"partition-id": ns.pid, "num-examples": int(len(ld.mine)), "noise-flipped": flipped}
    arrays = {"class-counts": Array(np.asarray(ld.counts[ns.pid], dtype=np.int64))}
    if bool(c["want-stats"]):
        s, sq, n = ld.stats_message(feature_clip(cfg))
        arrays["feature-sum"] = Array(s)
        metrics["feature-sq"] = sq
        metrics["feature-count"] = n
    if str(c.get("closed-form", "")):
        # the statistics exchange of a closed-form head / --init start: the simulator's client_stats
        solver = create_head(str(c["closed-form"]), **cfg.head_params)
        t0 = time.perf_counter()
        kw = solver.message_kwargs(store.train_x.shape[1])
        m = client_stats(
            store.train_x[ld.mine], ld.labels[ld.mine], store.info.num_classes, kw.pop("gram"), feature_clip(cfg), **kw
        )
        metrics["stats-ms"] = 1000 * (time.perf_counter() - t0)
        arrays.update(client_stats_record(m))
    content = {"arrays": ArrayRecord(arrays), "metrics": MetricRecord(metrics)}
    if cfg.scaffold:  # the server checks, on (re)connecting, that the node still holds its c_k
        held = held_variates(context, ns, cfg, int(c["seed"]))
        content["config"] = ConfigRecord({"scaffold-tags": " ".join(held.keys() if held is not None else [])})
    return Message(RecordDict(content), reply_to=msg)


def ccvr(msg: Message, context: Context, default_store: str | None, default_state_dir: str | None) -> Message:
    """The ``query.ccvr`` handler: CCVR's class statistics of the node's prepared features."""
    c = msg.content["config"]
    cfg = config_from_json(str(c["train-config"]))
    ns = node_settings(context, default_store, default_state_dir)
    ld = local_data(ns, cfg, int(c["seed"]))
    t0 = time.perf_counter()
    blob = b""
    if len(ld.mine):
        x = ld.engine(cfg, _feature_stats(c)).data.x
        blob = ccvr_client_stats(x, ld.labels, ld.mine, ld.store.info.num_classes).to_bytes()
    arrays = ArrayRecord({"ccvr-stats": Array(np.frombuffer(blob, dtype=np.uint8).copy())})
    metrics = MetricRecord(
        {"partition-id": ns.pid, "num-examples": int(len(ld.mine)), "client-ms": 1000 * (time.perf_counter() - t0)}
    )
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


def validate(msg: Message, context: Context, default_store: str | None, default_state_dir: str | None) -> Message:
    """The ``query.validate`` handler: the global head's correct predictions, samples and summed cross-entropy on the
    node's validation part (only these three numbers leave the node)."""
    c = msg.content["config"]
    cfg = config_from_json(str(c["train-config"]))
    ns = node_settings(context, default_store, default_state_dir)
    ld = local_data(ns, cfg, int(c["seed"]))
    t0 = time.perf_counter()
    n, correct, loss = 0, 0, 0.0
    if ld.val is not None and len(ld.val):
        arr = msg.content["arrays"]["head"].numpy()
        theta = torch.as_tensor(arr, dtype=torch.float64 if arr.dtype == np.float64 else torch.float32)
        params = json.loads(str(c["scorer-params"])) if str(c.get("scorer-params", "")) else None
        scorer = None if params is None else create_head(cfg.head, **params)
        x = prepare(ld.store.train_x[ld.val], _feature_stats(c), ld.device)
        y = torch.as_tensor(ld.labels[ld.val], device=ld.device)
        acc, mean_loss = accuracy_and_loss(theta.to(ld.device), x, y, head=scorer)
        n = len(ld.val)
        correct, loss = int(round(acc * n)), mean_loss * n
    metrics = {"partition-id": ns.pid, "val-samples": n, "val-correct": correct, "val-loss": float(loss),
               "client-ms": 1000 * (time.perf_counter() - t0)}  # fmt: skip
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def personalize(msg: Message, context: Context, default_store: str | None, default_state_dir: str | None) -> Message:
    """The ``query.personalize`` handler: this node's own client personalised from the final global head
    (:func:`fedhead.core.personalize.personalize_clients` over a federation in which only this partition holds data,
    at its own index: the batches and draws the in-process transport makes for it), scored on its local test set and
    the drift set. Only counts leave the node: the local test size, the personal head's correct predictions there and
    on the drift set, closed-form's beta and (when the server asks) its validation correct counts per beta."""
    c, arrays = msg.content["config"], msg.content["arrays"]
    cfg = config_from_json(str(c["train-config"]))
    seed, rnd = int(c["seed"]), int(c["round"])
    ns = node_settings(context, default_store, default_state_dir)
    ld = local_data(ns, cfg, seed)
    _check_test_split(ns, ld.store, str(c["test-split"]))
    t0 = time.perf_counter()
    params = json.loads(str(c["personal-params"]))
    if str(c.get("personal-beta", "")) != "":  # the beta the pooled validation counts chose (no validation part)
        params["personal_beta"] = float(c["personal-beta"])
    method = create_personalizer(str(c["personal-method"]), **params)
    arr = arrays["head"].numpy()
    theta = torch.as_tensor(arr, dtype=torch.float64 if arr.dtype == np.float64 else torch.float32, device=ld.device)
    scorer = create_head(cfg.head, **json.loads(str(c["scorer-params"]))) if str(c["scorer-params"]) else None
    solver = statistics = None
    if str(c.get("solver", "")):
        solver = create_head(str(c["solver"]), **json.loads(str(c["solver-params"])))
        statistics = global_stats_from_record(arrays, ld.store.info.num_classes, bool(c.get("stats-noisy", False)))
    # the engine keys a client's batches by its index: a trained personal head needs the node's client at its
    # partition id among cfg.clients; every other method reads nothing of the index (apfl keys its draws by ids)
    K, p = (cfg.clients, ns.pid) if method.how == "epochs" else (1, 0)
    data = _own_client(ld, K, p, _feature_stats(c), arrays, method.needs_statistics)
    optim = OptimConfig(name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    s = Setting(cfg.head, cfg.head_params, optim, cfg.batch_size, cfg.backend, cfg.memory_budget_mb, seed, rnd)
    out = {}
    if bool(c.get("personal-picks", False)):  # closed-form's beta chosen on validation (the in-process pass)
        picks = _validation_picks(method, theta, data, s, scorer, statistics, solver, p)
        out["val-correct"] = Array(picks)
        if picks[0] >= 0:  # its own choice; without a validation part beta 1 until the server names the pooled one
            method = create_personalizer(
                method.name, **{**method.params, "personal_beta": BETA_GRID[beta_choice(picks)]}
            )
        else:
            data.val_parts = None
    got = personalize_clients(method, theta, data, s, scorer, statistics, solver)
    metrics = {"partition-id": ns.pid, "test-samples": int(got.sizes[p]), "correct": int(got.correct[p]),
               "drift": int(got.drift[p]), "client-ms": 1000 * (time.perf_counter() - t0)}  # fmt: skip
    if got.beta[p] == got.beta[p]:
        metrics["beta"] = float(got.beta[p])
    return Message(RecordDict({"arrays": ArrayRecord(out), "metrics": MetricRecord(metrics)}), reply_to=msg)


def _check_test_split(ns: NodeSettings, store: Features, key: str) -> None:
    """Refuse, in one line, a store whose test split is not the server's (the local test sets index into it)."""
    path = str(Path(ns.store).resolve())
    if path not in _TEST_KEYS:
        _TEST_KEYS[path] = test_split_key(store.test_x, store.test_y)
    if _TEST_KEYS[path] != key:
        raise FedheadError(
            f"The feature store {ns.store!r} of node partition {ns.pid} holds another test split than the server's, "
            "and --personalize scores each client on rows of the server's test split. Give the node a store with "
            "the server's test split (the same 'fedhead extract' of the test images), or drop --personalize."
        )


def _own_client(ld: LocalData, K: int, at: int, stats: FeatureStats, arrays, raw: bool) -> ClientData:
    """The federation as this node sees it for personalisation: ``K`` clients of which only the one at index ``at``
    holds training, validation and local test rows (this node's own); every other client is empty, and the ids
    name this node's partition at ``at``. The rows are the node's only (its training then validation part, its
    local test set and the drift set), prepared as the in-process transport prepares the whole split; ``raw`` keeps
    the raw features too (closed-form)."""
    C, pid = ld.store.info.num_classes, at
    mine = np.asarray(ld.mine, dtype=np.int64)
    val = np.zeros(0, dtype=np.int64) if ld.val is None else np.asarray(ld.val, dtype=np.int64)
    rows = np.concatenate([mine, val])
    empty = np.zeros(0, dtype=np.int64)
    parts, vals = [empty] * K, [empty] * K
    parts[pid], vals[pid] = np.arange(len(mine)), np.arange(len(mine), len(rows))
    counts = np.zeros((K, C), dtype=np.int64)
    counts[pid] = ld.counts[ld.pid]
    own = np.asarray(arrays["local-test"].numpy(), dtype=np.int64)
    drift = np.asarray(arrays["drift"].numpy(), dtype=np.int64)
    trows = np.unique(np.concatenate([own, drift]))
    indptr = np.zeros(K + 1, dtype=np.int64)
    indptr[pid + 1 :] = len(own)
    valid = np.zeros(K, dtype=bool)
    valid[pid] = len(own) > 0
    tests = LocalTests(indptr, np.searchsorted(trows, own), valid)
    train_x, test_x = ld.store.train_x[rows], ld.store.test_x[trows]
    return ClientData(
        x=prepare(train_x, stats, ld.device), labels=torch.as_tensor(ld.labels[rows], device=ld.device),
        parts=parts, val_parts=None if ld.val is None else vals, counts=counts,
        totals=np.asarray(arrays["class-totals"].numpy(), dtype=np.int64), test_x=prepare(test_x, stats, ld.device),
        test_y=torch.as_tensor(ld.store.test_y[trows], device=ld.device), tests=tests,
        drift=np.searchsorted(trows, drift), raw=torch.as_tensor(train_x, dtype=torch.float32) if raw else None,
        raw_test=torch.as_tensor(test_x, dtype=torch.float32) if raw else None,
        ids=[ld.pid if k == at else k for k in range(K)],
    )  # fmt: skip


def _validation_picks(method, theta, data: ClientData, s: Setting, scorer, statistics, solver, pid: int) -> np.ndarray:
    """Correct predictions of this client's closed-form personal head on its validation part for every beta of
    :data:`fedhead.core.personal.BETA_GRID` (all -1 without a validation part): the in-process validation pass,
    run as :func:`fedhead.core.personalize.personalize_clients`' test pass over the validation rows (the same solve
    and scores, the same rows and labels)."""
    out = np.full(len(BETA_GRID), -1, dtype=np.int64)
    val = data.val_parts[pid] if data.val_parts is not None else []
    if not len(val) or not len(data.parts[pid]):
        return out
    K = len(data.parts)
    v = torch.as_tensor(np.asarray(val, dtype=np.int64))
    indptr = np.zeros(K + 1, dtype=np.int64)
    indptr[pid + 1 :] = len(val)
    valid = np.zeros(K, dtype=bool)
    valid[pid] = True
    vdata = replace(
        data, val_parts=None, test_x=data.x[v.to(data.x.device)], test_y=data.labels[v.to(data.labels.device)],
        tests=LocalTests(indptr, np.arange(len(val), dtype=np.int64), valid), drift=np.zeros(0, dtype=np.int64),
        raw_test=data.raw[v],
    )  # fmt: skip
    for i, b in enumerate(BETA_GRID):
        m = create_personalizer(method.name, **{**method.params, "personal_beta": b})
        out[i] = int(personalize_clients(m, theta, vdata, s, scorer, statistics, solver).correct[pid])
    return out


def plain_train(msg: Message, context: Context, default_store: str | None, default_state_dir: str | None) -> Message:
    """The ``train`` handler of a plain (not secure) exchange: the node's local training from the server's head, and
    the aggregation rule's message of its update (SCAFFOLD: with its variate's delta, kept on the node)."""
    c = msg.content["config"]
    cfg = config_from_json(str(c["train-config"]))
    seed, rnd = int(c["seed"]), int(c["round"])
    ns = node_settings(context, default_store, default_state_dir)
    ld = local_data(ns, cfg, seed)
    stats = _feature_stats(c)
    theta = torch.as_tensor(msg.content["arrays"]["head"].numpy(), dtype=torch.float32, device=ld.device)
    n = len(ld.mine)
    scaffold = None
    if cfg.scaffold and n > 0:
        scaffold = _node_variate(msg, held_variates(context, ns, cfg, seed), ns.pid, theta)
        if scaffold is None:  # the server names a c_k this node no longer holds (it restarted)
            return Message(
                RecordDict(
                    {"metrics": MetricRecord({"partition-id": ns.pid, "num-examples": int(n), "scaffold-lost": 1})}
                ),
                reply_to=msg,
            )
        start = scaffold.ck[0].clone()
    if n == 0:
        w, holds, loss, ms = theta, torch.zeros(theta.shape[0], dtype=torch.bool), 0.0, 0.0
    else:
        eng = ld.engine(cfg, stats)
        t0 = time.perf_counter()
        ws, sizes, hs, losses = eng.train_block(theta, [ns.pid], seed, rnd, prox_mu=cfg.prox_mu, scaffold=scaffold)
        if ld.device.type == "cuda":
            torch.cuda.synchronize()
        ms = 1000 * (time.perf_counter() - t0)
        w, holds, loss = ws[0], hs[0], float(losses[0])
    # the aggregation rule's message (fedavg: n_k W_k) as it travels (a compressed rule's wire form): the
    # simulator's Accumulator.message for one client, encoded
    rule, lost, residuals = aggregator_of(cfg), False, None
    if keeps_residuals(cfg):  # error feedback: this node's own residual, in the version the server names
        rule.residuals, lost = _node_residual(msg, context, ns, cfg, seed, theta)
        residuals = rule.residuals.e[0].clone()
    sent = rule.wire(theta, w[None], torch.tensor([float(n)], device=w.device), holds[None].to(w.device), ids=[ns.pid])
    if residuals is not None and n > 0:
        _keep_variates(
            context,
            variates_file(ns, cfg, seed, "residual"),
            str(c["residual-in"]) if not lost else "",
            residuals,
            str(c["residual-out"]),
            rule.residuals.e[0],
            record=RESIDUALS,
        )
    arrays = ArrayRecord(
        {
            **{MESSAGE_PREFIX + k: Array(v[0].detach().cpu().numpy()) for k, v in sent.items()},
            "holds": Array(holds.cpu().numpy().astype(np.uint8)),
        }
    )
    if scaffold is not None:
        # one client's pending sum is its delta c_k+ - c_k (float32 values, exact in float32)
        arrays["scaffold-delta"] = Array(scaffold.pending.to(torch.float32).cpu().numpy())
        _keep_variates(
            context,
            variates_file(ns, cfg, seed),
            str(c["scaffold-in"]),
            start,
            str(c["scaffold-out"]),
            scaffold.ck[0],
        )
    metrics = {"partition-id": ns.pid, "num-examples": int(n), "train-loss": loss, "client-ms": ms}
    if lost:
        metrics["residual-lost"] = 1
    if ns.delay > 0:  # a slow node (--delay): its reply leaves this much later; client-ms stays the training's
        time.sleep(ns.delay)
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}), reply_to=msg)


def secure_exchange(msg: Message, context: Context, handlers: dict, default_store: str | None) -> Message:
    """One node's part of a secure exchange (:mod:`fedhead.flower.secure`): the plain handler of the exchange runs
    on the fedhead message the SecAgg+ one carries, and its reply becomes the vector ``secaggplus_mod`` masks."""
    kind, content = plain_content(msg)
    if kind not in handlers:
        raise FedheadError(f"Unknown secure exchange {kind!r} from the server. Update this node's fedhead.")
    msg.content = content
    reply = handlers[kind](msg, context)
    cfg = config_from_json(str(content["config"]["train-config"]))
    store = open_node_store(node_settings(context, default_store).store)
    layout, values = node_values(kind, content, reply, store.info.num_classes, store.train_x.shape[1], cfg)
    return secure_reply(msg, layout.encode(values, f"{kind} message"))


def _feature_stats(c) -> FeatureStats:
    """The federated feature mean/scale a train or ccvr message carries."""
    mean = np.asarray(c["stats-mean"], dtype=np.float64) if "stats-mean" in c else None
    return FeatureStats(mean, float(c["stats-scale"]), 0, 0)


def variates_file(ns: NodeSettings, cfg, seed: int, prefix: str = "scaffold") -> Path | None:
    """The node's file of SCAFFOLD variates (``prefix`` residual: error-feedback residuals) for one (config, seed),
    or None without a state folder."""
    if ns.state_dir is None:
        return None
    key = hashlib.sha1(f"{cfg.identity()}/{int(seed)}".encode()).hexdigest()[:16]
    return Path(ns.state_dir) / f"{prefix}-p{ns.pid}-{key}.safetensors"


def held_variates(context: Context, ns: NodeSettings, cfg, seed: int) -> ArrayRecord | None:
    """The versions of ``c_k`` this node holds: ``Context.state``'s record, else (a new Flower run) the state
    folder's file, which then becomes the record."""
    return _held(context, VARIATES, variates_file(ns, cfg, seed), "SCAFFOLD variates")


def _held(context: Context, record: str, path: Path | None, what: str) -> ArrayRecord | None:
    """The versions of a per-node state kept under ``record`` in ``Context.state``, else in the file ``path``."""
    held = context.state.get(record)
    if held is None and path is not None and path.is_file():
        try:
            saved = load_state(path, what, "--state-dir")
            if not (isinstance(saved, dict) and all(isinstance(v, torch.Tensor) for v in saved.values())):
                raise FedheadError(f"{str(path)!r} holds no {what}")
        except FedheadError as exc:  # a damaged file is a lost state: as without a state folder
            LOG.warning("[fedhead] ignoring the %s in %s: %s", what, path, exc)
            return None
        held = ArrayRecord({str(t): Array(v.numpy()) for t, v in saved.items()})
        context.state[record] = held
    return held


def _node_variate(msg: Message, held: ArrayRecord | None, pid: int, theta: torch.Tensor) -> ScaffoldState | None:
    """This node's one-client SCAFFOLD state: the server's ``c`` (sent with the head) and the ``c_k`` kept under
    the tag the server names (``''``: the zero variate SCAFFOLD starts from); None when that version is gone."""
    tag = str(msg.content["config"]["scaffold-in"])
    c = torch.as_tensor(msg.content["arrays"]["scaffold-c"].numpy(), dtype=theta.dtype, device=theta.device)
    if not tag:
        ck = None
    elif held is not None and tag in held:
        ck = torch.as_tensor(held[tag].numpy(), dtype=theta.dtype, device=theta.device)[None]
    else:
        return None
    return ScaffoldState.held_by([pid], c, ck)


def _keep_variates(
    context: Context,
    path: Path | None,
    tag_in: str,
    start: torch.Tensor,
    tag_out: str,
    end: torch.Tensor,
    record: str = VARIATES,
) -> None:
    """Keep the variate the round started from and the one it ended with (older versions are dropped): the
    server's next message names the second if it applied this round's delta, the first if the reply was lost.
    With a state folder the two are also written to ``path`` (atomically) before the reply leaves the node.
    ``record``: the ``Context.state`` record (error feedback's residuals are kept the same way)."""
    keep = {tag_out: end.detach().cpu().clone()}
    if tag_in:
        keep[tag_in] = start.detach().cpu().clone()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_state(keep, path)
    context.state[record] = ArrayRecord({t: Array(v.numpy()) for t, v in keep.items()})


def _node_residual(
    msg: Message, context: Context, ns: NodeSettings, cfg, seed: int, theta: torch.Tensor
) -> tuple[Residuals, bool]:
    """This node's error-feedback residual ``e_k`` in the version the server names (``residual-in``; ``''``: the
    zero residual of a client that never sent), and whether that version was lost (then it starts from zero)."""
    tag = str(msg.content["config"]["residual-in"])
    held = _held(context, RESIDUALS, variates_file(ns, cfg, seed, "residual"), "error-feedback residuals")
    e = torch.zeros((1, *theta.shape), dtype=theta.dtype, device=theta.device)
    lost = bool(tag) and (held is None or tag not in held)
    if tag and not lost:
        e = torch.as_tensor(held[tag].numpy(), dtype=theta.dtype, device=theta.device)[None].clone()
    if lost:
        LOG.warning("[fedhead] partition %s lost its error-feedback residual %s: it starts from zero", ns.pid, tag)
    return Residuals.held_by([ns.pid], e), lost


def _json(v):
    import json

    return json.loads(str(v))
