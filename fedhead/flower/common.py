"""What the ServerApp and the ClientApp share: the message protocol, config (de)serialisation, checks.

Protocol (message types, all in one run):

``query``  server -> every node, once before round 1 (and to nodes that join later). Content: the training
           configuration and the server store's fingerprint. The node opens its store, refuses a foreign one,
           and replies with its ``partition-id``, ``num-examples``, class counts and, when the recipe centres
           or scales features, its feature sum (float64 ``[D]``), sum of squared norms and count: the one
           exchange of feature statistics that :func:`fedhead.federation.train.federated_feature_stats` models.
``train``  server -> the round's sampled nodes: the global head ``[C, D+1]`` plus the round, seed, stage and the
           federated mean/scale. The node trains locally and replies with its head, ``num-examples``,
           class holds (for the ``grouped`` aggregator), its mean local loss and its compute time.
           SCAFFOLD (``--scaffold``): the server's ``c`` travels with the head (``scaffold-c``) and the config
           names the version of the node's own ``c_k`` to train from (``scaffold-in``, ``''`` = zeros) and the tag
           to keep the new one under (``scaffold-out``); the node replies with its delta ``c_k+ - c_k``
           (``scaffold-delta``), or with ``scaffold-lost`` when it no longer holds that version. The ``query``
           reply lists the versions a node holds (``scaffold-tags``).
``query.ccvr``  server -> every node, once after the last round (``--calibrate ccvr``): the node replies with
           :func:`fedhead.federation.train.ccvr_client_stats` of its prepared features as
           :meth:`fedhead.core.ccvr.ClassStats.to_bytes` (``ccvr-stats``, uint8).

With ``--secure-aggregation`` (:mod:`fedhead.flower.secure`) the ``query`` reply carries only the partition id,
and every exchange whose numbers the server adds up (the statistics before round 1, each ``train`` round,
``ccvr``) runs as Flower's SecAgg+ on ``train`` messages: the same request travels as the workflow's ``FitIns``
(config ``secure-kind`` names the exchange) and the node's plain reply becomes the vector that is masked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

from fedhead.core.closedform import ClientStats, pack_upper, unpack_upper
from fedhead.federation.config import TrainConfig
from fedhead.infra.errors import FedheadError
from fedhead.interface.options import parse_betas

INSTALL_HINT = "pip install 'fedhead[flower]'"
MESSAGE_PREFIX = "msg."  # a train reply's arrays: the aggregation rule's message tensors under "msg.<key>"

# run-config keys (pyproject [tool.flwr.app.config]) <-> TrainConfig fields. An empty string means
# "not given" (the recipe's value, or TrainConfig's default).
RUN_CONFIG_FIELDS = {
    "head": "head",
    "partition": "partition",
    "clients": "clients",
    "rounds": "rounds",
    "local-epochs": "local_epochs",
    "local-steps": "local_steps",
    "batch-size": "batch_size",
    "recipe": "recipe",
    "optimizer": "optimizer",
    "lr": "lr",
    "weight-decay": "weight_decay",
    "momentum": "momentum",
    "aggregate": "aggregate",
    "center": "center",
    "scale": "scale",
    "participation": "participation",
    "noise": "noise",
    "noise-rate": "noise_rate",
    "asym-map": "asym_rule",
    "noise-dataset": "noise_dataset",
    "backend": "backend",
    "device": "device",
    "eval-every": "eval_every",
    "init": "init",
    "init-scale": "init_scale",
    "prox-mu": "prox_mu",
    "server-opt": "server_opt",
    "server-lr": "server_lr",
    "server-momentum": "server_momentum",
    "server-tau": "server_tau",
    "server-betas": "server_betas",
    "scaffold": "scaffold",
    "calibrate": "calibrate",
    "ccvr-samples": "ccvr_samples",
    "dp-noise-multiplier": "dp_noise_multiplier",
    "dp-clip": "dp_clip",
    "dp-delta": "dp_delta",
    "dp-feature-clip": "dp_feature_clip",
    "secure-aggregation": "secure_aggregation",
}

# The test hooks (documented in DEPLOY.md): make a client raise in a given round, stop the server after a
# round's checkpoint. Both read the environment of the process that runs the app.
CRASH_ENV = "FEDHEAD_FLOWER_CRASH"  # "PID@ROUND[,PID@ROUND...]"
STOP_ENV = "FEDHEAD_FLOWER_STOP_AFTER"  # "ROUND"


def require_flower():
    """Import flwr or fail with the one-line install hint."""
    try:
        import flwr  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "flwr":
            raise FedheadError(f"Flower is not installed. Install the extra: {INSTALL_HINT}") from None
        raise
    return flwr


def config_to_json(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)


def config_from_json(text: str) -> TrainConfig:
    d = json.loads(text)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in d.items() if k in names})


def _parse_json_dict(key: str, value: Any) -> dict:
    if value in ("", None):
        return {}
    if isinstance(value, dict):
        return value
    try:
        out = json.loads(value)
    except ValueError:
        out = None
    if not isinstance(out, dict):
        raise FedheadError(
            f"The '{key}' run-config value must be a JSON object, e.g. "
            f"'{{\"shards_per_client\": 2}}'. Got {value!r} instead."
        )
    return out


def config_from_run_config(rc: dict) -> TrainConfig:
    """TrainConfig from a Flower run config (``[tool.flwr.app.config]`` plus ``flwr run -c`` overrides)."""
    kw: dict[str, Any] = {}
    for key, field in RUN_CONFIG_FIELDS.items():
        v = rc.get(key, "")
        if v == "" or v is None:
            continue
        kw[field] = parse_betas(v) if field == "server_betas" else v
    seeds = rc.get("seeds", "0")
    if isinstance(seeds, int):
        seeds = [seeds]
    else:
        try:
            seeds = [int(s) for s in str(seeds).replace(",", " ").split()]
        except ValueError:
            raise FedheadError(
                f"The 'seeds' run-config value must be integers separated by spaces. Got {seeds!r} instead."
            ) from None
    kw["seeds"] = seeds
    kw["partition_params"] = _parse_json_dict("partition-params", rc.get("partition-params", ""))
    kw["head_params"] = _parse_json_dict("head-params", rc.get("head-params", ""))
    store = rc.get("feature-store", "")
    if not store:
        raise FedheadError(
            "The 'feature-store' run-config value must name the server's feature store (its "
            "test split is used for central evaluation). Got '' instead. "
            "Use flwr run -c \"feature-store='PATH'\"."
        )
    return TrainConfig(features=str(store), **kw)


# ---------------------------------------------------------------- store fingerprints


def store_fingerprint(info) -> dict:
    """What must agree between the server's store and a node's store (encoder and label space)."""
    a = info.attrs
    return {
        "encoder": str(a.get("encoder", "")),
        "weights_sha256": str(a.get("weights_sha256", "")),
        "feature_dim": int(a.get("feature_dim", 0)),
        "num_classes": int(info.num_classes),
        "dataset": str(a.get("dataset", "")),
    }


def check_fingerprint(mine: dict, server: dict, where: str) -> None:
    """Refuse a store from another encoder (or another label space) than the server's, in one line."""
    if (mine["encoder"], mine["weights_sha256"], mine["feature_dim"]) != (
        server["encoder"],
        server["weights_sha256"],
        server["feature_dim"],
    ):
        raise FedheadError(
            f"{where} was extracted with encoder {mine['encoder']!r} (dim {mine['feature_dim']}, weights "
            f"{mine['weights_sha256'][:12] or '-'}), but the server's store with {server['encoder']!r} "
            f"(dim {server['feature_dim']}, weights {server['weights_sha256'][:12] or '-'}). "
            f"Re-extract this node's images with 'fedhead extract --encoder {server['encoder']}'."
        )
    if mine["num_classes"] != server["num_classes"]:
        raise FedheadError(
            f"{where} has {mine['num_classes']} classes, but the server's store has "
            f"{server['num_classes']}. Extract the same dataset's label space on every node."
        )


def crash_rounds(pid: int) -> set[int]:
    """Rounds in which this partition must crash (test hook ``FEDHEAD_FLOWER_CRASH=PID@ROUND,...``)."""
    out = set()
    for item in os.environ.get(CRASH_ENV, "").replace(" ", "").split(","):
        if "@" in item:
            p, r = item.split("@", 1)
            if p.isdigit() and r.isdigit() and int(p) == pid:
                out.add(int(r))
    return out


def stop_after() -> int | None:
    v = os.environ.get(STOP_ENV, "")
    return int(v) if v.isdigit() else None


class ServerStopped(RuntimeError):
    """Raised by the test hook ``FEDHEAD_FLOWER_STOP_AFTER``: the server 'dies' after a checkpoint."""


# ---------------------------------------------------------------- the statistics message


def client_stats_record(m) -> dict:
    """A :class:`fedhead.core.closedform.ClientStats` as the arrays of a reply (the Gram as its upper triangle)."""
    import numpy as np
    from flwr.app import Array

    out = {
        "cf-classes": Array(np.asarray(m.classes, dtype=np.int64)),
        "cf-counts": Array(np.asarray(m.counts, dtype=np.int64)),
        "cf-sums": Array(np.ascontiguousarray(m.sums, dtype=np.float64).reshape(len(m.classes), -1)),
    }
    if m.gram is not None:
        out["cf-gram"] = Array(pack_upper(m.gram))
    return out


def client_stats_from_record(arrays, dim: int):
    """The inverse of :func:`client_stats_record`."""
    gram = unpack_upper(arrays["cf-gram"].numpy(), dim + 1) if "cf-gram" in arrays else None
    sums = arrays["cf-sums"].numpy().reshape(-1, dim)
    return ClientStats(arrays["cf-classes"].numpy(), arrays["cf-counts"].numpy(), sums, gram)


# ---------------------------------------------------------------- the server's log and a node's failure, in one line

LOG = logging.getLogger("flwr")


def marked_reason(reason: str) -> str | None:
    m = re.search(r"\[\[(.*?)\]\]", reason or "", re.S)
    return m.group(1).strip() if m else None


def short_reason(reason: str) -> str:
    inner = marked_reason(reason)
    if inner:
        return inner
    m = re.search(r"<class '([\w.]+)'>:<'(.*?)'>", reason or "", re.S)
    text = f"{m.group(1).split('.')[-1]}: {m.group(2)}" if m else (reason or "unknown error")
    return " ".join(text.split())[:300]
