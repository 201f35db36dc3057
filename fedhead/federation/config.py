"""The trainer's configuration, :class:`TrainConfig`: the dataclass of the experiment table
(:mod:`fedhead.federation.experiment`), its resolution (recipes, declared constraints, the rule for fields that do
not apply) and the TOML experiment file.

``TrainConfig`` is made from :data:`~fedhead.federation.experiment.FIELDS`: one dataclass field per table field, with
the table's default, so nothing here restates a field. The parameters of the heads and partitions are flat fields
(``TrainConfig(partition="dirichlet", alpha=0.1)``); the ``partition_params`` / ``head_params`` dictionaries of
earlier versions still work as keywords (merged into the flat fields, the dictionary's value winning) and as
read-only views. Parameters of a plugin's head or partition (not in the table) live in ``plugin_params``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import inspect
import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import tomli_w

from fedhead.core.aggregate import aggregator_names, create_aggregator
from fedhead.core.closedform import closed_form_names, is_closed_form
from fedhead.core.compress import CompressedFedAvg
from fedhead.core.dp import enabled as dp_enabled
from fedhead.core.dp import validate_dp
from fedhead.core.engine import OptimConfig
from fedhead.core.flwr_partitions import parse_partition_args
from fedhead.core.heads import HEADS, create_head, resolve_head_params
from fedhead.core.partitions import PARTITIONS, resolve_partition_params
from fedhead.core.personal import PERSONAL, create_personalizer
from fedhead.core.sampling import per_round
from fedhead.core.serveropt import ServerOptConfig
from fedhead.federation.experiment import (
    DEPRECATED_KEYWORDS,
    FIELD_LIST,
    FIELDS,
    GROUPS,
    LOCAL_EPOCHS,
    NOT_IDENTITY,
    PAPER_SEEDS,
    PERSONAL_MODELS_MAX,
    RECIPES,
    SECURE_MIN_CLIENTS,
    applies,
    check_given,
    check_value,
    field_help,
    is_given,
    only_applicable,
    parse_client_ids,
    parse_pair,
    parse_seeds,
    plugin_field,
    python_api,
)
from fedhead.infra.errors import FedheadError, python_spelling, unknown_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = [
    "TrainConfig",
    "RECIPES",
    "PAPER_SEEDS",
    "LOCAL_EPOCHS",
    "SECURE_MIN_CLIENTS",
    "applicable",
    "load_experiment",
    "experiment_toml",
]


def _declared_by_partition(name: str) -> bool:
    return any(p.name == name for spec in PARTITIONS.values() for p in spec.params)


class _Config:
    """The behaviour of :class:`TrainConfig` (its fields come from the experiment table)."""

    def __init__(self, *args, partition_params: dict | None = None, head_params: dict | None = None, **kw):
        names = [f.name for f in dataclasses.fields(self)]
        if len(args) > len(names):
            raise TypeError(f"TrainConfig() takes at most {len(names)} positional arguments ({len(args)} given)")
        for name, value in zip(names, args):
            if name in kw:
                raise TypeError(f"TrainConfig() got multiple values for argument {name!r}")
            kw[name] = value
        for old, new in DEPRECATED_KEYWORDS.items():
            if old in kw:
                warnings.warn(f"TrainConfig({old}=...) is deprecated; use {new}=", DeprecationWarning, stacklevel=2)
                if new in kw:
                    raise TypeError(f"TrainConfig() got both {old!r} and its new name {new!r}")
                kw[new] = kw.pop(old)
        plugin = {k: kw.pop(k) for k in [k for k in kw if k not in names] if plugin_field(k) is not None}
        unknown = [k for k in kw if k not in names]
        if unknown:
            raise TypeError(f"TrainConfig() got an unexpected keyword argument {unknown[0]!r}")
        for f in dataclasses.fields(self):
            if f.name in kw:
                value = kw[f.name]
            elif f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                raise TypeError(f"TrainConfig() missing required argument: {f.name!r}")
            setattr(self, f.name, value)
        given = {k: v for k, v in plugin.items() if v is not None}  # None: the head's own default, as for a field
        self.plugin_params = {**dict(self.plugin_params or {}), **given}  # a plugin's parameter as a keyword
        for group in (partition_params, head_params):
            self._merge(group or {})

    def _merge(self, params: dict) -> None:
        """Head or partition parameters by name: a table field, else a plugin's parameter."""
        for k, v in params.items():
            if k in FIELDS and FIELDS[k].kind:
                setattr(self, k, v)
            else:
                self.plugin_params[k] = v

    def _group(self, kind: str) -> dict:
        out = {
            f.name: getattr(self, f.name) for f in FIELD_LIST if f.kind == kind and getattr(self, f.name) is not None
        }
        for k, v in self.plugin_params.items():
            if (kind == "partition") == _declared_by_partition(k) and v is not None:
                out[k] = v
        return out

    def _set_group(self, kind: str, params: dict) -> None:
        for f in FIELD_LIST:
            if f.kind == kind:
                setattr(self, f.name, None)
        self.plugin_params = {
            k: v for k, v in self.plugin_params.items() if (kind == "partition") != _declared_by_partition(k)
        }
        self._merge(dict(params or {}))

    @property
    def partition_params(self) -> dict:
        """The partition parameters given (alpha, p, shards_per_client, ...; None = the partition's default)."""
        return self._group("partition")

    @partition_params.setter
    def partition_params(self, params: dict) -> None:
        self._set_group("partition", params)

    @property
    def personal_params(self) -> dict:
        """The personalisation method's parameters given (personal_epochs, personal_lambda, ...; None: the
        method's default)."""
        names = {p.name for spec in PERSONAL.values() for p in spec.params}
        got = {n: getattr(self, n) for n in sorted(names) if n in FIELDS and getattr(self, n) is not None}
        got.update({k: v for k, v in self.plugin_params.items() if k in names and v is not None})  # a plugin's
        return got

    @property
    def head_params(self) -> dict:
        """The head parameters given (stage1_rounds, fedlc_tau, ridge_lambda, ...; None = the head's default)."""
        return self._group("head")

    @head_params.setter
    def head_params(self, params: dict) -> None:
        self._set_group("head", params)

    # ------------------------------------------------------------ resolution

    @python_api
    def resolved(self) -> "TrainConfig":
        """A copy with the recipe applied to every field left as None, validated against the declared constraints,
        and checked by the one rule for fields that do not apply (:func:`~fedhead.federation.experiment.check_given`)."""
        check_value(FIELDS["recipe"], self.recipe)
        seeds = self.seeds if isinstance(self.seeds, (list, tuple)) else [self.seeds]
        if not seeds:
            raise FedheadError("The '--seeds' parameter needs at least one value. Got [] instead.")
        c = dataclasses.replace(self, seeds=[_int(s, "--seeds") for s in seeds], plugin_params=dict(self.plugin_params))
        twice = sorted({s for s in c.seeds if c.seeds.count(s) > 1})
        if twice:  # one run reported as several, with a std of 0
            raise FedheadError(
                f"The '--seeds' parameter names seed {twice[0]} more than once. Got {c.seeds} instead. Give each seed "
                "once."
            )
        if is_given(FIELDS["local_epochs"], self.local_epochs, self.recipe) and self.local_steps is not None:
            raise FedheadError(
                f"The '--local-steps' parameter ({self.local_steps}) and '--local-epochs' "
                f"({self.local_epochs}) both set the local work of a round. Give one of them."
            )
        for k, v in RECIPES[self.recipe].items():
            if getattr(c, k) is None and not (k == "local_steps" and self.local_epochs is not None):
                setattr(c, k, v)
        if c.local_epochs is None:
            c.local_epochs = LOCAL_EPOCHS
        for f in FIELD_LIST:
            check_value(f, getattr(c, f.name), cfg=c)
        for k, v in c.plugin_params.items():  # a plugin's parameters against their declarations
            pf = plugin_field(k)
            if pf is not None:
                check_value(pf, v, cfg=c)
        if c.server_betas is not None:
            c.server_betas = parse_pair(c.server_betas)
        if c.partition_arg is not None:  # KEY=VALUE items (flags, Flower) or a table, as one dict (config.toml's)
            c.partition_arg = parse_partition_args(c.partition_arg) or None
        _check_round_size(c)
        if c.noise != "none" and c.noise_rate == 0:
            raise FedheadError(f"The '--noise-rate' parameter must be > 0 with --noise {c.noise}. Got 0.0 instead.")
        if c.early_stop and not c.val_fraction:
            raise FedheadError(
                f"The '--early-stop' option ({c.early_stop}) watches the validation part, but --val-fraction is 0 "
                f"(recipe {c.recipe}). Give --val-fraction 0.1 (or more), or drop --early-stop."
            )
        validate_dp(c)  # DP options, and the rule: DP-FedAvg replaces fedavg (aggregate = dp-fedavg)
        if c.secure_aggregation:
            m = per_round(c)  # clients per round (fedhead.core.sampling)
            if m < SECURE_MIN_CLIENTS:
                raise FedheadError(
                    f"The '--secure-aggregation' option needs at least {SECURE_MIN_CLIENTS} clients per "
                    f"round (SecAgg+ hides a client only among others: with 2, each could read the "
                    f"other's update off the new head). Got --clients {c.clients} with {_round_size_text(c)} ({m} per "
                    "round) instead. Raise --clients or --participation (--clients-per-round), "
                    "or drop --secure-aggregation."
                )
        check_timing(c)  # fills the async rule's staleness weighting, which --staleness-exponent reads
        check_given(self, c)
        for f in FIELD_LIST:  # a value consistent with a method the field does not apply to (--rounds 1, ridge)
            if f.consistent and f.applies and not applies(f, c) and getattr(c, f.name) in f.consistent:
                setattr(c, f.name, f.default)
        check_method(c)  # the method against the head; a closed-form head's switches set
        return c

    def recipe_view(self) -> "TrainConfig":
        """A copy with the recipe's values filled in, nothing validated: what the run is about to be (its head),
        for deciding which options apply (:func:`applicable`)."""
        c = copy.copy(self)
        recipe = RECIPES.get(self.recipe, RECIPES["default"])
        for k, v in recipe.items():
            if getattr(c, k) is None:
                setattr(c, k, v)
        return c

    # ------------------------------------------------------------ records

    def to_dict(self) -> dict:
        """Every field, the head and partition parameters grouped as ``head_params`` / ``partition_params``
        (given ones only): the ``config`` record of config.json and what Flower sends its nodes."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in FIELD_LIST if not f.kind}
        d["partition_params"] = copy.deepcopy(self.partition_params)
        d["head_params"] = copy.deepcopy(self.head_params)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """The inverse of :meth:`to_dict` (unknown keys, e.g. from a newer fedhead, are left out)."""
        names = {f.name for f in dataclasses.fields(cls)} | {"partition_params", "head_params"}
        return cls(**{k: v for k, v in d.items() if k in names})

    def identity(self) -> str:
        """Hash of everything that determines the results (for --resume checks)."""
        d = self.to_dict()
        d["asym_rule"] = d.pop("asym_map")  # the field's name before the rename: earlier runs keep their identity
        for k in NOT_IDENTITY:
            if k != "features":  # the identity of earlier fedhead versions named the store by its path
                d.pop(k, None)
        if d.get("clients_per_round") is None:
            d.pop("clients_per_round", None)  # runs from before the option keep their identity
        for k in ("secure_aggregation", "eval_unseen_clients"):
            if not d.get(k):
                d.pop(k, None)  # runs from before the option keep their identity
        for k in ("dp_noise_multiplier", "dp_clip", "dp_delta", "dp_feature_clip", "topk_fraction", "error_feedback",
                  "trim_fraction", "norm_bound"):  # fmt: skip
            if d.get(k) is None:
                d.pop(k, None)  # runs without DP or compression keep the identity they had before them
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    # ------------------------------------------------------------ the experiment file

    @classmethod
    @python_api
    def from_toml(cls, path: str | Path, **overrides) -> "TrainConfig":
        """The experiment in the TOML file ``path``, with ``overrides`` (field -> value) on top."""
        return cls(**{**load_experiment(path), **overrides})

    def to_toml(self) -> str:
        return experiment_toml(self)


def _secure_statistics(cfg, name: str) -> None:
    """Secure aggregation's fixed layout carries raw class sums and the Gram only: refuse the rest in one line."""
    head = create_head(name, **cfg.head_params)
    if cfg.secure_aggregation and (head.needs_second or head.stats_map(1) is not None):
        raise FedheadError(
            f"The '--secure-aggregation' option does not carry the statistics of {name!r} yet (per-class second "
            "moments, random features or a --stats-sketch). Drop it, or use ncm, ridge, lda or cof unsketched."
        )


def check_personal(cfg) -> None:
    """``--personalize`` against the head, its statistics and secure aggregation (read off the method's class), and
    ``--personal-models``' clients against --clients."""
    method = create_personalizer(cfg.personalize, **cfg.personal_params)
    name = cfg.personalize
    if method.needs_hidden:
        raise FedheadError(
            f"The '--personalize' parameter {name} needs a head with a hidden layer (a shared layer and a personal "
            f"one), and fedhead's heads are linear on the frozen features. Got --head {cfg.head}. Use --personalize "
            f"{method.instead} instead."
        )
    head = create_head(cfg.head, **cfg.head_params)
    if method.needs_linear and not head.linear:
        raise FedheadError(
            f"The '--personalize' parameter {name} trains a personal linear head from the global one, but --head "
            f"{cfg.head} is not linear in the features. Use --personalize prior, or a linear head (ridge, lda, ova2)."
        )
    if method.needs_log_scores and not head.log_scores:
        raise FedheadError(
            f"The '--personalize' parameter {name} adds the log label prior to the head's scores, but --head "
            f"{cfg.head} scores are not log-probabilities. Use --head lda, qda, softmax or ova2, or --personalize "
            "closed-form or finetune."
        )
    if method.generic_head and cfg.head != method.generic_head:
        raise FedheadError(
            f"The '--personalize' parameter {name} pairs its personal heads with a generic head trained with "
            f"--head {method.generic_head}. Got --head {cfg.head}. Add --head {method.generic_head}."
        )
    if method.needs_statistics:
        solver = cfg.head if is_closed_form(cfg.head) else cfg.init
        if solver is None:
            raise FedheadError(
                f"The '--personalize' parameter {name} solves each client's statistics with the global ones, but "
                f"--head {cfg.head} exchanges none. Use a closed-form head (--head ridge, lda, ...) or add --init ridge."
            )
        if create_head(solver, **cfg.head_params).needs_client_means:
            raise FedheadError(
                f"The '--personalize' parameter {name} cannot mix a client's statistics into {solver}'s (its solve "
                "reads the spread of the clients' class means). Use --head ridge or lda."
            )
    if cfg.secure_aggregation:
        raise FedheadError(
            f"The '--personalize' parameter {name} cannot be combined with --secure-aggregation: the per-client "
            "metrics would reach the server one by one. Drop one of them."
        )
    if cfg.personal_models is not None:  # model files of one head each, held in memory until the run writes them
        ids = parse_client_ids(cfg.personal_models)
        n = cfg.clients if ids == "all" else len(ids)
        if n > PERSONAL_MODELS_MAX:
            raise FedheadError(
                f"The '--personal-models' parameter {cfg.personal_models} would write {n:,} personal models per seed "
                f"(one head each, held in memory until the run writes them), more than {PERSONAL_MODELS_MAX:,}. Got "
                f"it with --clients {cfg.clients}. List the clients whose models you need, e.g. --personal-models 0,1,2."
            )
        if ids != "all" and ids[-1] >= cfg.clients:
            raise FedheadError(
                f"The '--personal-models' parameter names client {ids[-1]}, but the run has --clients {cfg.clients} "
                f"(ids 0 to {cfg.clients - 1}). Got {cfg.personal_models} instead. Name clients below {cfg.clients}."
            )


def check_method(cfg) -> None:
    """The method options (closed form, --init, FedProx, SCAFFOLD, server optimiser, CCVR) against the head, and
    the head's and partition's parameters against their declarations (part of :meth:`TrainConfig.resolved`); a
    closed-form head needs no feature centring (its statistics carry the means), so it is switched off."""
    resolve_head_params(cfg.head, **cfg.head_params)
    resolve_partition_params(cfg.partition, **cfg.partition_params)
    if cfg.optimizer is not None:  # None: a configuration not resolved yet (the recipe fills it in)
        OptimConfig(name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    if is_closed_form(cfg.head) and cfg.init is not None and cfg.init == RECIPES[cfg.recipe].get("init"):
        cfg.init = None  # the recipe's closed-form start does not apply to a closed-form head
    if is_closed_form(cfg.head):
        for flag, given in (
            ("--init", cfg.init),
            ("--prox-mu", cfg.prox_mu),
            ("--scaffold", cfg.scaffold),
            ("--server-opt", cfg.server_opt != "fedavg" and cfg.server_opt),
            ("--calibrate", cfg.calibrate != "none" and cfg.calibrate),
        ):
            if given:
                raise FedheadError(
                    f"The '{flag}' parameter does not apply to the closed-form head {cfg.head!r} "
                    f"(solved once from statistics, no local training). Got {given!r} instead. "
                    "Drop it, or choose an iterative head (softmax, ova, ova2, ...)."
                )
        cfg.center, cfg.scale = False, "none"
        _secure_statistics(cfg, cfg.head)
    if cfg.secure_aggregation and not is_closed_form(cfg.head) and cfg.aggregate in aggregator_names():
        if not create_aggregator(cfg.aggregate).summable:
            raise FedheadError(
                f"The '--aggregate' parameter {cfg.aggregate} cannot be combined with --secure-aggregation: the rule "
                "needs every client's update, and SecAgg+ releases only their sum. Got --aggregate "
                f"{cfg.aggregate} with --secure-aggregation. Drop one of them."
            )
        if isinstance(create_aggregator(cfg.aggregate), CompressedFedAvg):
            raise FedheadError(
                f"The '--aggregate' parameter {cfg.aggregate} cannot be combined with --secure-aggregation: SecAgg+ "
                "sums dense vectors of field elements, so a compressed update would travel dense (no bytes saved). "
                f"Got --aggregate {cfg.aggregate} with --secure-aggregation. Drop one of them."
            )
    if cfg.scaffold and cfg.optimizer != "sgd":
        raise FedheadError(
            f"The '--scaffold' option needs --optimizer sgd: its control variates estimate each "
            f"client's mean gradient from SGD steps. Got --optimizer {cfg.optimizer!r} instead. "
            "Use --optimizer sgd (the default recipe)."
        )
    if cfg.init is not None and not is_closed_form(cfg.init):
        raise unknown_name("--init", cfg.init, closed_form_names(), "closed-form head")
    if cfg.init is not None and not create_head(cfg.init, **cfg.head_params).init_capable:
        able = ", ".join(n for n in closed_form_names() if create_head(n).init_capable)
        raise FedheadError(
            f"The '--init' parameter {cfg.init!r} is no linear head on raw features that an iterative head can start "
            f"from. Use one of {able}."
        )
    if cfg.init is not None:
        resolve_head_params(cfg.init, **cfg.head_params)
        _secure_statistics(cfg, cfg.init)
    if cfg.personalize is not None:
        check_personal(cfg)
    if cfg.server_opt != "fedavg" or any(
        v is not None for v in (cfg.server_lr, cfg.server_momentum, cfg.server_betas, cfg.server_tau)
    ):
        ServerOptConfig(name=cfg.server_opt, lr=cfg.server_lr, momentum=cfg.server_momentum, betas=cfg.server_betas,
                        tau=cfg.server_tau).resolved()  # fmt: skip
    check_lifecycle(cfg)


def check_lifecycle(cfg) -> None:
    """``--keep-statistics`` against DP, and ``--withdrawn-clients`` against the clients (docs/lifecycle.md)."""
    if cfg.keep_statistics and dp_enabled(cfg):
        raise FedheadError(
            "The '--keep-statistics' option cannot be combined with differential privacy: an update or a removal "
            "would change the noisy sums without accounting for their noise. Got --keep-statistics with "
            f"--dp-noise-multiplier {cfg.dp_noise_multiplier:g}. Drop one of them."
        )
    if cfg.withdrawn_clients is None:
        return
    ids = parse_client_ids(cfg.withdrawn_clients)
    if ids == "all" or (isinstance(ids, list) and (len(ids) >= cfg.clients or max(ids) >= cfg.clients)):
        raise FedheadError(
            f"The '--withdrawn-clients' parameter must name some of the clients 0 .. {cfg.clients - 1} (not all of "
            f"them). Got {cfg.withdrawn_clients!r} instead. List the ids of the clients that withdrew, e.g. 3,7."
        )


def check_timing(c) -> None:
    """The simulated clock's server rules (:mod:`fedhead.federation.asyncserver`): FedBuff / FedAsync with the
    rules they are honest for, a buffer no larger than the clients in flight, over-selection within the clients;
    fills the rule's staleness weighting (FedBuff: sqrt, FedAsync: poly) when none is given."""
    m = per_round(c)
    if c.async_rule == "none":
        picked = math.ceil((1 + c.over_selection) * m - 1e-9)
        if picked > c.clients:
            raise FedheadError(
                f"The '--over-selection' parameter {c.over_selection:g} selects {picked} clients a round (ceil((1 + "
                f"{c.over_selection:g}) x {m})), more than --clients {c.clients}. Got --over-selection "
                f"{c.over_selection:g}; use at most {(c.clients / m) - 1:.3g}, or more --clients."
            )
        return
    if c.staleness is None:
        c.staleness = "poly" if c.async_rule == "fedasync" else "sqrt"
    for flag, bad, why in (
        ("--aggregate", c.aggregate != "fedavg" and c.aggregate, "it combines FedAvg aggregates of the updates"),
        ("--scaffold", c.scaffold, "SCAFFOLD's variates assume every client trains from the same head"),
        ("--secure-aggregation", c.secure_aggregation, "SecAgg+ masks one round's cohort, not a buffer"),
        ("--eval-unseen-clients", c.eval_unseen_clients, "it reads the synchronous rounds' draws"),
    ):
        if bad:
            raise FedheadError(
                f"The '{flag}' parameter cannot be combined with --async-rule {c.async_rule}: {why}. Got {flag} "
                f"{bad!r}. Drop {flag} (--aggregate fedavg) or use --async-rule none."
            )
    conc = c.concurrency or m
    if conc > c.clients:
        raise FedheadError(
            f"The '--concurrency' parameter must be <= --clients ({c.clients}). Got {conc} instead. Use at most "
            f"{c.clients} clients in flight, or more --clients."
        )
    buf = c.buffer_size or m
    if c.async_rule == "fedbuff" and buf > conc:
        raise FedheadError(
            f"The '--buffer-size' parameter must be <= --concurrency ({conc}, the clients training at once, at most "
            f"--clients {c.clients}). Got {buf} instead. Use a buffer of at most {conc} updates, or raise "
            "--concurrency."
        )


def _round_size_text(c) -> str:
    if c.clients_per_round is not None:
        return f"--clients-per-round {c.clients_per_round}"
    return f"--participation {c.participation:g}"


def _check_round_size(c) -> None:
    """--clients-per-round: not with a --participation other than 1, and at most --clients."""
    if c.clients_per_round is None:
        return
    if c.participation != FIELDS["participation"].default:
        raise FedheadError(
            f"The '--clients-per-round' ({c.clients_per_round}) and '--participation' ({c.participation:g}) "
            "options both set the clients of a round. Give one of them."
        )
    if c.clients_per_round > c.clients:
        raise FedheadError(
            f"The '--clients-per-round' parameter must be <= --clients ({c.clients}). Got {c.clients_per_round} "
            f"instead. Use at most {c.clients} clients per round, or more --clients."
        )


def _int(v: Any, param: str) -> int:
    """A seed as an int ("3", 3 and 3.0 are 3), or the one-line error."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            pass
    raise FedheadError(f"The '{param}' parameter must be integers >= 0. Got {v!r} instead.")


def _annotation(f) -> Any:
    t = f.type
    return t if f.required or f.default is not None else Optional[t]


def _dataclass_field(f) -> dataclasses.Field:
    meta = {"experiment": f}
    if f.required:
        return dataclasses.field(metadata=meta)
    if isinstance(f.default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=f.default: copy.deepcopy(d), metadata=meta)
    return dataclasses.field(default=f.default, metadata=meta)


TrainConfig = dataclasses.make_dataclass(
    "TrainConfig",
    [(f.name, _annotation(f), _dataclass_field(f)) for f in FIELD_LIST]
    + [("plugin_params", dict, dataclasses.field(default_factory=dict))],
    bases=(_Config,),
    init=False,
    namespace={"__module__": __name__},
)


def _type_name(f) -> str:
    name = {list: "list[int]", tuple: "tuple[float, float]"}.get(f.type, f.type.__name__)
    return name if f.required or f.default is not None else f"{name} | None"


def _docstring() -> str:
    """TrainConfig's docstring, made from the experiment table: one entry per field, its help text and default
    (what ``help(TrainConfig)`` and the API reference show; Google style, so mkdocstrings lists the fields)."""
    lines = [
        "A training run, as ``fedhead train`` takes it: ``TrainConfig(features=..., head=..., ...)``.",
        "",
        "One field per entry of the experiment table (``fedhead.federation.experiment.FIELDS``); a field's flag is",
        "``--`` + its name with ``-`` for ``_``, its TOML key the name. ``None`` means the recipe's value (or the head's",
        "or partition's own default). ``resolved()`` fills the recipe in and validates; ``fedhead.run(cfg)`` runs it.",
        "",
        "Attributes:",
    ]
    for f in FIELD_LIST:
        default = "required" if f.required else f"default: {f.shown_default()}"
        unit = f" ({f.unit})" if f.unit else ""
        text = python_spelling(f"{field_help(f)}{unit} [{default}]", FIELDS)  # '--init' -> 'init', as Python names it
        lines.append(f"    {f.name} ({_type_name(f)}): {text}.")
    lines.append("    plugin_params (dict): parameters of a plugin's head or partition, e.g. ``{'smoothing': 0.1}``.")
    return "\n".join(lines) + "\n"


TrainConfig.__doc__ = _docstring()


def _signature(cls) -> inspect.Signature:
    """What help() and editors show for ``TrainConfig(...)``: the fields with their defaults, then the dicts of
    earlier versions."""
    params = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        params.append(
            inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=f.type)
        )
    old = [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in ("partition_params", "head_params")
    ]
    return inspect.Signature(params + old)


TrainConfig.__signature__ = _signature(TrainConfig)


def applicable(kw: dict) -> dict:
    """The keyword arguments of ``TrainConfig(**kw)`` that apply to the run they describe (e.g. no ``rounds`` for a
    closed-form head): how a caller that sets the same options for many runs (a bench grid, a test helper) passes
    each run only what applies to it."""
    view = TrainConfig(**kw).recipe_view()
    return only_applicable(kw, view)


# ---------------------------------------------------------------- the TOML experiment file


def _toml_type_error(key: str, where: str, want: str, value: Any) -> FedheadError:
    return FedheadError(f"The '{key}' key in {where} must be {want}. Got {value!r} instead.")


def _typed(f, value: Any, where: str) -> Any:
    """A TOML value as the field's type (one line naming the key if it is not)."""
    key = f.name
    if f.type is bool:
        if not isinstance(value, bool):
            raise _toml_type_error(key, where, "true or false", value)
        return value
    if f.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _toml_type_error(key, where, "an integer", value)
        return value
    if f.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _toml_type_error(key, where, "a number", value)
        return float(value)
    if f.type is list:  # seeds
        if isinstance(value, bool) or not isinstance(value, (int, str, list)):
            raise _toml_type_error(key, where, "a list of integers, e.g. [0, 42]", value)
        return parse_seeds(value, key)
    if f.type is tuple:  # server_betas
        pair = parse_pair(value)
        if pair is None:
            raise _toml_type_error(key, where, "two numbers, e.g. [0.9, 0.99]", value)
        return pair
    if f.type is dict:  # partition_arg: a table, or KEY=VALUE items (parsed by its constraint, naming the key)
        return value
    if f.name == "fedabc_margins" and isinstance(value, list):
        return ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise _toml_type_error(key, where, "a string", value)
    return value


_NOT_FIELDS = {
    "out": "give --out on the command line (the file describes the experiment, not where it is written)",
    "resume": "give --resume on the command line",
    "head_params": "write each parameter as its own key, e.g. stage1_rounds = 2 (a plugin's go in [plugin_params])",
    "partition_params": "write each parameter as its own key, e.g. alpha = 0.1",
}


def load_experiment(path: str | Path) -> dict:
    """The fields of the experiment file ``path`` (TOML, keys = TrainConfig's field names), each checked against
    its type and declared constraint: a bad key or value is one line naming the key."""
    p = Path(path)
    where = repr(str(path))
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise FedheadError(
            f"The '--config' parameter names {where}, which does not exist. Give an experiment file "
            "(fedhead train --print-config writes one)."
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FedheadError(f"The '--config' parameter names {where}, which cannot be read ({exc}).") from None
    except tomllib.TOMLDecodeError as exc:
        raise FedheadError(f"The '--config' parameter names {where}, which is not valid TOML ({exc}).") from None
    out: dict = {}
    # the head / partition the file chooses: a parameter declared differently by several is checked against its own
    owners = SimpleNamespace(
        partition=data.get("partition", FIELDS["partition"].default), head=data.get("head"), init=data.get("init")
    )
    for key, value in data.items():
        new = DEPRECATED_KEYWORDS.get(key)
        if new is not None:
            raise FedheadError(f"The '{key}' key in {where} was renamed. Got {key} = {value!r}. Write {new} instead.")
        if key == "plugin_params":
            if not isinstance(value, dict):
                raise _toml_type_error(key, where, "a table, e.g. [plugin_params] smoothing = 0.1", value)
            out[key] = {**out.get(key, {}), **value}
            continue
        f = FIELDS.get(key)
        pf = plugin_field(key) if f is None else None
        if pf is not None:  # a plugin's parameter, as its own key like a built-in head's
            value = _typed(pf, value, where)
            try:
                check_value(pf, value, param=key, cfg=owners)
            except FedheadError as exc:
                raise FedheadError(
                    str(exc).replace(f"The '{key}' parameter", f"The '{key}' key in {where}", 1)
                ) from None
            out.setdefault("plugin_params", {})[key] = value
            continue
        if f is None:
            if key in _NOT_FIELDS:
                raise FedheadError(
                    f"The '{key}' key in {where} is not an experiment field. Got {value!r}. "
                    f"{_NOT_FIELDS[key][:1].upper()}{_NOT_FIELDS[key][1:]}."
                )
            close = difflib.get_close_matches(key, list(FIELDS), n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            shown = f"'{key}'" if key.isprintable() else repr(key)  # a hostile key: one line, escaped
            raise FedheadError(
                f"The {shown} key in {where} is not an experiment field.{hint} "
                "(fedhead train --print-config shows them all.)"
            )
        value = _typed(f, value, where)
        try:
            check_value(f, value, param=key, cfg=owners)
        except FedheadError as exc:
            raise FedheadError(str(exc).replace(f"The '{key}' parameter", f"The '{key}' key in {where}", 1)) from None
        out[key] = value
    return out


def _toml_value(v: Any) -> str:
    """One TOML value (arrays and tables inline)."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return tomli_w.dumps({"x": v}).split("=", 1)[1].strip()


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() and k.isascii() else _toml_value(k)


def experiment_toml(cfg, title: str = "fedhead experiment") -> str:
    """``cfg`` as an experiment file: every field with a value that applies to the run, by help panel (a field
    left unset, or that does not apply, is left out; a head's or partition's own defaults are shown as comments).
    ``fedhead train --config FILE`` runs it again."""
    lines = [
        f"# {title}: fedhead train --config FILE runs it (flags given with it override its values).",
        "# Keys are TrainConfig's fields; the flag of a key is --key with '-' for '_'. Unset keys are left out.",
    ]
    local_steps = getattr(cfg, "local_steps", None)
    view = cfg.recipe_view()
    for group in GROUPS:
        body = []
        for f in FIELD_LIST:
            if f.group != group or not applies(f, view):
                continue  # a field that does not apply is left out (resolution gives it the same value again)
            v = getattr(cfg, f.name)
            if f.name == "local_epochs" and local_steps is not None:
                continue  # local steps replace epochs (resolution fills epochs in anyway)
            if v is None:
                if f.kind == "head" and cfg.head in HEADS:
                    spec = {p.name: p for p in HEADS[cfg.head].params}
                    if f.name in spec:
                        body.append(f"# {f.name} = {_toml_value(spec[f.name].default)}  ({cfg.head}'s default)")
                elif f.kind == "partition" and cfg.partition in PARTITIONS:
                    spec = {p.name: p for p in PARTITIONS[cfg.partition].params}
                    if f.name in spec:
                        body.append(f"# {f.name} = {_toml_value(spec[f.name].default)}  ({cfg.partition}'s default)")
                continue
            body.append(f"{f.name} = {_toml_value(v)}")
        if body:
            lines += ["", f"# -- {group}", *body]
    plugin = {k: v for k, v in (cfg.plugin_params or {}).items() if v is not None}  # None: the head's default
    if plugin:
        lines += ["", "[plugin_params]"] + [f"{k} = {_toml_value(v)}" for k, v in plugin.items()]
    return "\n".join(lines) + "\n"
