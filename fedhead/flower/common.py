"""What the ServerApp and the ClientApp share: the message protocol, config (de)serialisation, checks.

Protocol (message types, all in one run):

``query``  server -> every node, once before round 1 (and to nodes that join later). Content: the training
           configuration and the server store's fingerprint. The node opens its store, refuses a foreign one,
           and replies with its ``partition-id``, ``num-examples``, class counts and, when the recipe centres
           or scales features, its feature sum (float64 ``[D]``), sum of squared norms and count: the one
           exchange of feature statistics that :func:`fedhead.federation.clients.federated_feature_stats` models.
``train``  server -> the round's sampled nodes: the global head ``[C, D+1]`` plus the round, seed, stage and the
           federated mean/scale. The node trains locally and replies with its head, ``num-examples``,
           class holds (for the ``grouped`` aggregator), its mean local loss and its compute time.
           SCAFFOLD (``--scaffold``): the server's ``c`` travels with the head (``scaffold-c``) and the config
           names the version of the node's own ``c_k`` to train from (``scaffold-in``, ``''`` = zeros) and the tag
           to keep the new one under (``scaffold-out``); the node replies with its delta ``c_k+ - c_k``
           (``scaffold-delta``), or with ``scaffold-lost`` when it no longer holds that version. The ``query``
           reply lists the versions a node holds (``scaffold-tags``).
``query.ccvr``  server -> every node, once after the last round (``--calibrate ccvr``): the node replies with
           :func:`fedhead.federation.clients.ccvr_client_stats` of its prepared features as
           :meth:`fedhead.core.ccvr.ClassStats.to_bytes` (``ccvr-stats``, uint8).
``query.personalize``  server -> every node, once after the last round (``--personalize``): the final global head,
           the method and its parameters, the seed and round, the indices into the test split of the node's local
           test set (``local-test``) and of the drift set (``drift``), the federation's class totals, a fingerprint
           of the server's test split (the node reads those rows from its own store, which must hold the same split)
           and, for ``closed-form``, the summed global statistics (``gs-*``, :func:`global_stats_record`). The node
           personalises its own client (:func:`fedhead.core.personalize.personalize_clients`) and replies with counts
           only: ``test-samples``, ``correct``, ``drift`` (and ``beta``); the personal head never leaves it. When
           closed-form's beta is chosen on validation, the reply also holds ``val-correct`` (the node's validation
           correct counts per beta of :data:`fedhead.core.personal.BETA_GRID`, ``-1`` without a validation part),
           and the nodes without a validation part are asked again with the beta the pooled counts chose
           (``personal-beta``), as the in-process transport pools them.

With ``--secure-aggregation`` (:mod:`fedhead.flower.secure`) the ``query`` reply carries only the partition id,
and every exchange whose numbers the server adds up (the statistics before round 1, each ``train`` round,
``ccvr``) runs as Flower's SecAgg+ on ``train`` messages: the same request travels as the workflow's ``FitIns``
(config ``secure-kind`` names the exchange) and the node's plain reply becomes the vector that is masked.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fedhead.core.closedform import ClientStats, StatsAccumulator, pack_upper, unpack_upper
from fedhead.core.flwr_partitions import format_partition_args, parse_partition_args
from fedhead.federation.config import TrainConfig
from fedhead.federation.experiment import FIELD_LIST, FIELDS, RUN_OPTIONS, parse_pair, parse_seeds, plugin_field
from fedhead.flower import require_flower  # noqa: F401 - where the Flower modules import it
from fedhead.infra.errors import FedheadError

MESSAGE_PREFIX = "msg."  # a train reply's arrays: the aggregation rule's message tensors under "msg.<key>"
PERSONAL_KIND = "query.personalize"  # --personalize after the last round: the node's own client, counts back

# run-config keys (pyproject [tool.flwr.app.config]) <-> TrainConfig fields, by the table's rule (the field's name
# with '-' for '_'): every field a Flower run takes. An empty string means "not given" (the recipe's value, or the
# field's default). block_clients, memory_budget_mb (node-local resources), iid_reference and central_reference
# (fedhead train only) are not run-config keys.
RUN_CONFIG_FIELDS = {f.key: f.name for f in FIELD_LIST if "flower" in f.transports}
RUN_CONFIG_FIELDS["plugin-params"] = "plugin_params"  # JSON: parameters of a plugin's head or partition
# keys of the run that are not experiment fields (flags --out, --resume, --round-timeout, --wait-timeout)
RUN_KEYS = {f.key: f for f in RUN_OPTIONS.values() if "flower" in f.transports}
# simulation only: the store every virtual node slices (read by the ClientApp)
CLIENT_STORE_KEY = "client-feature-store"
# renamed keys, still accepted (one warning line in the log): old key -> new key
OLD_KEYS = {old: f.key for f in [*FIELD_LIST, *RUN_OPTIONS.values()] for old in f.old_keys}
OLD_JSON_KEYS = ("partition-params", "head-params")  # JSON objects of parameters, now flat keys (alpha = 0.1)


def app_config_defaults() -> dict:
    """``[tool.flwr.app.config]`` as the table makes it: every run-config key with its default ('' = not given;
    the recipe's value or the field's default), the run's own keys, then the renamed keys (kept so that Flower,
    which drops unknown keys, still passes them on)."""
    out: dict[str, Any] = {}
    for key, name in RUN_CONFIG_FIELDS.items():
        f = FIELDS.get(name)
        out[key] = "" if f is None or f.default is None or f.required else _rc_value(f, f.default)
        if name == "features":
            out[CLIENT_STORE_KEY] = ""
    for key, f in RUN_KEYS.items():
        out[key] = "" if f.default is None else f.default
    for old in [*OLD_KEYS, *OLD_JSON_KEYS]:
        out[old] = ""
    return out


def _rc_value(f, v: Any) -> Any:
    """A field's value as a run-config value (Flower's values are scalars: lists as comma-separated text,
    --partition-arg's table as KEY=VALUE text)."""
    if f.type is dict:
        return format_partition_args(parse_partition_args(v))
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return v


def run_config_values(cfg: TrainConfig) -> dict:
    """The run-config keys of ``cfg``'s fields that are set (what ``flwr run -c`` gets)."""
    rc: dict[str, Any] = {}
    for key, name in RUN_CONFIG_FIELDS.items():
        v = getattr(cfg, name)
        if name == "plugin_params":
            if v:
                rc[key] = json.dumps(v)
        elif v is not None:
            rc[key] = _rc_value(FIELDS[name], v)
    return rc


def config_to_json(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)


def config_from_json(text: str) -> TrainConfig:
    return TrainConfig.from_dict(json.loads(text))


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


def _coerce(key: str, f, v: Any) -> Any:
    """A run-config value as the field's type (Flower's values are TOML scalars; numbers may come as text)."""
    want = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(f.type)
    if f.type is list:
        return parse_seeds(v, key)
    if f.type is dict:  # partition-arg: KEY=VALUE text (parsed, naming the key)
        return parse_partition_args(v, key) or None
    if f.type is tuple:
        pair = parse_pair(v)
        if pair is None:
            raise FedheadError(f"The '{key}' run-config value must be two numbers b1,b2. Got {v!r} instead.")
        return pair
    if f.type is bool and isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if f.type in (int, float) and isinstance(v, str):
        try:
            v = f.type(v)
        except ValueError:
            pass
    if f.type is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    ok = isinstance(v, f.type) and not (f.type is not bool and isinstance(v, bool))
    if not ok:
        raise FedheadError(f"The '{key}' run-config value must be {want}. Got {v!r} instead.")
    return v


def canonical_run_config(rc: dict) -> dict:
    """``rc`` with the renamed keys read as their new names (one warning line each in the log): the run config as
    this version of fedhead names it (``rc`` is updated in place and returned)."""
    for old, new in OLD_KEYS.items():
        if rc.get(old) not in ("", None):
            LOG.warning("[fedhead] the run-config key '%s' is deprecated; use '%s'", old, new)
            if rc.get(new) in ("", None):
                rc[new] = rc[old]
    return rc


def config_from_run_config(rc: dict) -> TrainConfig:
    """TrainConfig from a Flower run config (``[tool.flwr.app.config]`` plus ``flwr run -c`` overrides). Renamed
    keys are read as their new names (:func:`canonical_run_config`, which updates ``rc`` in place)."""
    canonical_run_config(rc)
    kw: dict[str, Any] = {}
    for key, name in RUN_CONFIG_FIELDS.items():
        v = rc.get(key, "")
        if v == "" or v is None:
            continue
        if name == "plugin_params":
            kw[name] = _parse_json_dict(key, v)
        else:
            kw[name] = _coerce(key, FIELDS[name], v)
    for key in OLD_JSON_KEYS:
        params = _parse_json_dict(key, rc.get(key, ""))
        if params:
            LOG.warning("[fedhead] the run-config key '%s' is deprecated; give each parameter as its own key", key)
            kw.setdefault(key.replace("-", "_"), {}).update(params)
    if not kw.get("features"):
        raise FedheadError(
            "The 'features' run-config value must name the server's feature store (its "
            "test split is used for central evaluation). Got '' instead. "
            "Use flwr run -c \"features='PATH'\"."
        )
    kw["features"] = str(kw["features"])
    known = {*RUN_CONFIG_FIELDS, *RUN_KEYS, *OLD_KEYS, *OLD_JSON_KEYS, CLIENT_STORE_KEY}
    for key, v in rc.items():  # a plugin head's or partition's parameter as its own key (gamma = 1.0)
        if key in known or v in ("", None):
            continue
        f = plugin_field(key.replace("-", "_"))
        if f is not None:
            kw.setdefault("plugin_params", {})[f.name] = _coerce(key, f, v)
    return TrainConfig(**kw)


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
    if m.second is not None:  # qda, fedpft: one upper triangle per held class
        iu = np.triu_indices(m.sums.shape[1])
        out["cf-second"] = Array(np.ascontiguousarray(np.asarray(m.second)[:, iu[0], iu[1]], dtype=np.float64))
    return out


def client_stats_from_record(arrays, dim: int):
    """The inverse of :func:`client_stats_record`."""
    import numpy as np

    gram = unpack_upper(arrays["cf-gram"].numpy(), dim + 1) if "cf-gram" in arrays else None
    sums = arrays["cf-sums"].numpy().reshape(-1, dim)
    second = None
    if "cf-second" in arrays:
        second = np.stack([unpack_upper(v, dim) for v in arrays["cf-second"].numpy().reshape(len(sums), -1)])
        second = second.reshape(len(sums), dim, dim)
    return ClientStats(arrays["cf-classes"].numpy(), arrays["cf-counts"].numpy(), sums, gram, second)


# ---------------------------------------------------------------- personalisation (query.personalize)


def test_split_key(test_x, test_y) -> str:
    """A fingerprint of a store's test split (its shapes, labels and features): the local test sets of a
    ``query.personalize`` message index into the server's, so a node reads those rows only from the same split."""
    import hashlib

    import numpy as np

    x, y = np.ascontiguousarray(test_x), np.ascontiguousarray(test_y, dtype=np.int64)
    h = hashlib.sha256(f"{x.shape}/{x.dtype}/{y.shape}".encode())
    h.update(y.tobytes())
    h.update(x.tobytes())
    return h.hexdigest()


def _sym(a):
    """A float64 array of symmetric matrices ``[..., n, n]`` as their upper triangles ``[..., n(n+1)/2]`` when exactly
    symmetric (half the bytes, nothing lost), else as given."""
    import numpy as np

    a = np.ascontiguousarray(a, dtype=np.float64)
    if not np.array_equal(a, np.swapaxes(a, -1, -2)):
        return a
    iu = np.triu_indices(a.shape[-1])
    return np.ascontiguousarray(a[..., iu[0], iu[1]])


def _unsym(v, n: int, ndim: int):
    """The inverse of :func:`_sym`: ``v`` with ``ndim`` dimensions as matrices ``n x n`` (packed when one fewer)."""
    import numpy as np

    if v.ndim == ndim:
        return v
    out = np.zeros((*v.shape[:-1], n, n), dtype=v.dtype)
    iu = np.triu_indices(n)
    out[..., iu[0], iu[1]] = v
    out[..., iu[1], iu[0]] = v
    return out


def global_stats_record(acc) -> dict:
    """The summed statistics a closed-form personal head mixes with the client's own
    (:class:`fedhead.core.closedform.StatsAccumulator`: class sums and counts, the Gram and per-class second moments
    where the head has them) as a message's arrays; symmetric matrices as their upper triangles."""
    from flwr.app import Array

    out = {"gs-sums": Array(acc.sums.detach().cpu().double().numpy()),
           "gs-counts": Array(acc.counts.detach().cpu().double().numpy())}  # fmt: skip
    if acc.gram is not None:
        out["gs-gram"] = Array(_sym(acc.gram.detach().cpu().numpy()))
    if acc.second is not None:
        out["gs-second"] = Array(_sym(acc.second.detach().cpu().numpy()))
    return out


def global_stats_from_record(arrays, num_classes: int, noisy: bool = False):
    """The inverse of :func:`global_stats_record`: a :class:`fedhead.core.closedform.StatsAccumulator` holding the
    server's sums exactly."""
    import numpy as np
    import torch

    sums = np.asarray(arrays["gs-sums"].numpy(), dtype=np.float64).reshape(num_classes, -1)
    D = sums.shape[1]
    acc = StatsAccumulator(num_classes, D)
    acc.sums = torch.as_tensor(sums)
    acc.counts = torch.as_tensor(np.asarray(arrays["gs-counts"].numpy(), dtype=np.float64).reshape(num_classes))
    if "gs-gram" in arrays:
        acc.gram = torch.as_tensor(_unsym(arrays["gs-gram"].numpy(), D + 1, 2))
    if "gs-second" in arrays:
        acc.second = torch.as_tensor(_unsym(arrays["gs-second"].numpy(), D, 3))
    acc.noisy = bool(noisy)
    return acc


def beta_choice(picks) -> int:
    """The index of the beta whose validation correct counts ``picks`` (one per beta of
    :data:`fedhead.core.personal.BETA_GRID`) are highest, the larger beta on a tie: the in-process rule
    (:func:`fedhead.core.personalize.personalize_clients`), for a node's own counts and for the pooled ones."""
    import numpy as np

    p = np.asarray(picks)
    return len(p) - 1 - int(np.argmax(p[::-1]))


# ---------------------------------------------------------------- the server's log and a node's failure, in one line

LOG = logging.getLogger("flwr")


def by_node(replies, sent) -> list[tuple[int, Any]]:
    """``(node, reply)`` for the replies to the messages ``sent``. A node's own reply names it as the sender; a reply
    the SuperLink writes itself (Flower's NODE_UNAVAILABLE once the node's heartbeats stopped) names the SuperLink,
    and only the message it answers says which node is meant (by its id, which Flower gives a message when it is
    pushed: read ``sent`` after the replies came)."""
    dst = {m.metadata.message_id: m.metadata.dst_node_id for m in sent if m.metadata.message_id}
    return [(dst.get(r.metadata.reply_to_message_id, r.metadata.src_node_id), r) for r in replies]


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
