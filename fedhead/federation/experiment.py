"""The experiment definition: every field of a training run declared once, in :data:`FIELDS`.

Each :class:`Field` says its name, type, default, unit, help, help panel, declared constraint and where it
applies (which heads, partitions, methods, transports). Everything else is derived from this table, with one
spelling per field:

=====================  ================================================  =========================
surface                spelling of the field ``local_epochs``            derived by
=====================  ================================================  =========================
Python                 ``TrainConfig(local_epochs=2)``, ``fedhead.run``  ``fedhead.federation.config``
TOML experiment file   ``local_epochs = 2``                              ``fedhead.federation.config``
command-line flag      ``--local-epochs 2``                              ``fedhead.interface.options``
Flower run config      ``local-epochs = 2``                              ``fedhead.flower.common``
=====================  ================================================  =========================

The rule: the canonical name is the Python name; a flag is ``--`` + the name with ``-`` for ``_``; a TOML key is
the name; a Flower run-config key is the name with ``-`` for ``_``.

The parameters of the registered heads and partitions (:class:`fedhead.infra.params.Param`) are fields too,
derived from their declarations (name, constraint, help; the table's default is None, meaning "the head's /
partition's own default"), and they apply to the heads / partitions that declare them.

A field the user *gave* that does not apply to the chosen head, partition or method is refused in one line
(:func:`check_given`). A value counts as given when it differs from the field's default, from what the recipe
fills in, and from the field's inert values (``center = false`` changes nothing for a closed-form head), so
defaults and resolved configurations never trip it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import fedhead.core  # noqa: F401  (registers the built-in heads: the table derives their parameters)
from fedhead.core.aggregate import aggregator_names
from fedhead.core.clock import STALENESS
from fedhead.core.compress import COMPRESSED, DEFAULT_TOPK_FRACTION
from fedhead.core.dual import DUAL_MODES
from fedhead.core.engine import BACKENDS
from fedhead.core.flwr_partitions import FLWR_PREFIX, is_flwr, parse_partition_args
from fedhead.core.heads import HEADS
from fedhead.core.noise import ASYM_RULES, NOISE
from fedhead.core.partitions import PARTITIONS
from fedhead.core.personal import PERSONAL
from fedhead.core.plugins import load_plugins
from fedhead.core.serveropt import SERVER_OPTIMIZERS, server_optimizer_names
from fedhead.federation.tracking import TRACKERS
from fedhead.infra.errors import FedheadError, Interval, OneOf, python_names, unknown_name, validate
from fedhead.infra.params import Param

PAPER_SEEDS = (0, 42, 777, 1337, 15254)
LOCAL_EPOCHS = 3  # when neither --local-epochs nor --local-steps (nor a recipe) says
SECURE_MIN_CLIENTS = 3  # fewest clients per round --secure-aggregation accepts (config check)

# Recipes fill every field left as None. "paper" is the OvA-LP paper's setting to the letter (for reproduction);
# "default" is the one that measured robust across heads, partitions and class counts (docs/results.md, "Choosing the
# default recipe"); "fast": the default recipe from a closed-form start, softmax head, 30 local steps a round
# whatever a client's size: Fed3R+FT (docs/heads-methods-partitions.md, "Baselines"); an explicit --head keeps the
# ridge start, a closed-form head ignores it; an explicit --local-epochs replaces the 30 steps.
_DEFAULT_RECIPE = dict(
    head="ova2",
    val_fraction=0.1,
    optimizer="sgd",
    lr=0.01,
    weight_decay=1e-4,
    momentum=0.9,
    aggregate="fedavg",
    center=True,
    scale="none",
)
RECIPES: dict[str, dict] = {
    "paper": dict(_DEFAULT_RECIPE, optimizer="adamw", center=False, val_fraction=0.0),
    "default": dict(_DEFAULT_RECIPE),
    "fast": dict(_DEFAULT_RECIPE, head="softmax", init="ridge", local_steps=30),
}

# the help panels, in the order --help shows them
DATA, HEAD, LOCAL, SERVER, NOISE_GROUP, PRIVACY, PERSONAL_GROUP, RUN = (
    "Data and clients",
    "Head",
    "Local training",
    "Server and aggregation",
    "Label noise",
    "Privacy",
    "Personalisation",
    "Run and output",
)
GROUPS = (DATA, HEAD, LOCAL, SERVER, NOISE_GROUP, PRIVACY, PERSONAL_GROUP, RUN)
TRANSPORTS = ("in-process", "flower")  # fedhead train (and the bench grids) | fedhead flower simulate / superlink
REQUIRED = object()  # the default of a field that has none (features)

# special values of When.values
ITERATIVE = "iterative"  # a head trained by local steps (not closed form)
GIVEN = "given"  # any value but None
NOT_NONE = "not none"  # any value but the string "none"
FLWR = FLWR_PREFIX + "<ClassName>"  # a flwr-datasets partitioner (--partition flwr:<ClassName>)


# ---------------------------------------------------------------- declarations


# each registry a Names constraint reads: its names (read when a value is checked, so that plugins count) and
# what the messages call one of them
_REGISTRIES = {
    "head": (lambda: sorted(HEADS), "head"),
    "closed-form": (
        lambda: sorted(n for n in HEADS if getattr(HEADS[n].cls, "closed_form", False)),
        "closed-form head",
    ),
    "partition": (lambda: sorted(PARTITIONS), "partition"),
    "aggregate": (aggregator_names, "aggregator"),
    "server-opt": (server_optimizer_names, "server optimiser"),
    "noise": (lambda: list(NOISE), "noise kind"),
    "personalize": (lambda: list(PERSONAL), "personalisation method"),
}


@dataclass(frozen=True)
class Names:
    """A declared constraint over a registry's names (heads, partitions, ...), read when a value is checked, so
    the names registered by users' plugins count too."""

    registry: str  # a key of _REGISTRIES: head | closed-form | partition | aggregate | server-opt | noise

    def names(self) -> list[str]:
        load_plugins()
        return list(_REGISTRIES[self.registry][0]())

    def ok(self, v: Any) -> bool:
        if self.registry == "partition" and is_flwr(v):  # its class is checked where it is resolved (partitions)
            return True
        return isinstance(v, str) and v in self.names()

    def shown(self) -> list[str]:
        """The names a refusal lists: the registry's, and flwr:<ClassName> for a partition."""
        return self.names() + ([FLWR] if self.registry == "partition" else [])

    def describe(self) -> str:
        return f"must be a known {self.what}"

    @property
    def what(self) -> str:
        return _REGISTRIES[self.registry][1]


@dataclass(frozen=True)
class ClientIds:
    """Client ids as ``0,2,5`` (integers >= 0, each once) or ``all`` (--personal-models)."""

    def ok(self, v: Any) -> bool:
        return parse_client_ids(v) is not None

    def describe(self) -> str:
        return "must be client ids >= 0 separated by commas (each once), or all, e.g. 0,2"


@dataclass(frozen=True)
class PartitionArgs:
    """flwr-datasets' keyword arguments (--partition-arg): ``KEY=VALUE`` items or a table of literal values
    (:func:`fedhead.core.flwr_partitions.parse_partition_args`; the class's own keywords are checked when resolved)."""

    def ok(self, v: Any) -> bool:
        try:
            parse_partition_args(v)
        except FedheadError:
            return False
        return True

    def describe(self) -> str:
        return "must be KEY=VALUE items with literal values, e.g. alpha=0.1"


@dataclass(frozen=True)
class Pair:
    """Two numbers in [0, 1) as ``b1,b2`` (the server optimiser's betas)."""

    def ok(self, v: Any) -> bool:
        b = parse_pair(v)
        return b is not None and all(Interval(0, 1, closed="left").ok(x) for x in b)

    def describe(self) -> str:
        return "must be two numbers in [0, 1) as beta1,beta2, e.g. 0.9,0.99"


@dataclass(frozen=True)
class When:
    """A condition under which a field applies: the resolved value of ``field`` is one of ``values`` (or the
    special ITERATIVE, GIVEN, NOT_NONE)."""

    field: str
    values: tuple | str

    @property
    def choices(self) -> tuple | str:
        """``values``, or what a registry gives when it is a function (names users register count too)."""
        return self.values() if callable(self.values) else self.values

    def holds(self, cfg) -> bool:
        v = getattr(cfg, self.field)
        if self.values == ITERATIVE:
            return v in HEADS and not getattr(HEADS[v].cls, "closed_form", False)
        if self.values == GIVEN:
            return v is not None
        if self.values == NOT_NONE:
            return v not in (None, "none")
        if self.values == FLWR:
            return is_flwr(v)
        return v in self.choices

    def wanted(self) -> str:
        """The condition as the messages say it: "--head fedlc", "runs with --init", "an iterative head"."""
        flag = flag_of(self.field)
        if self.values == ITERATIVE:
            return "an iterative head (softmax, ova, ova2, ...)"
        if self.values == GIVEN:
            return f"runs with {flag}"
        if self.values == NOT_NONE:
            return f"{flag} {' | '.join(n for n in NOISE if n != 'none')}"
        if self.values == FLWR:
            return f"{flag} {FLWR}"
        return f"{flag} {' | '.join(self.choices)}"


@dataclass(frozen=True)
class Field:
    name: str  # the Python name; flag, TOML key and run-config key are derived (see the module docstring)
    type: type  # str | int | float | bool | list (seeds) | tuple (server_betas)
    default: Any
    help: str  # what it is, briefly (no default: default_text and default say that)
    group: str  # help panel
    constraint: Any = None  # Interval | OneOf | Names | Pair | Param constraint: checked when resolved
    applies: tuple = ()  # When conditions, any of which makes the field apply; () = always
    inert: tuple = ()  # values that change nothing where the field does not apply
    default_text: str = ""  # what the default (None) means, for --help, e.g. "recipe: 0.01"
    unit: str = ""
    fix: str = ""  # appended to a constraint error
    consistent: tuple = ()  # values accepted where the field does not apply (--rounds 1 for a closed-form head)
    identity: bool = True  # part of what determines a run's results (a resume compares it); False: where it runs
    transports: tuple = TRANSPORTS
    transport_why: str = ""  # why the field runs on its transports only (the refusal's reason; default: resources)
    kind: str = ""  # "head" | "partition": a registry parameter (TrainConfig.head_params / partition_params)
    deprecated: tuple = ()  # old Python keywords (TrainConfig accepts them with a DeprecationWarning)
    old_flags: tuple = ()  # old command-line flags (hidden aliases that print one deprecation line)
    old_keys: tuple = ()  # old Flower run-config keys (accepted with one warning line in the log)

    @property
    def flag(self) -> str:
        return flag_of(self.name)

    @property
    def key(self) -> str:
        """The Flower run-config key."""
        return self.name.replace("_", "-")

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def shown_default(self) -> str:
        """The default as --help and the experiment file's comments show it."""
        if self.default_text:
            return self.default_text
        if self.type is bool:
            return "on" if self.default else "off"
        if isinstance(self.default, (list, tuple)):
            return ",".join(str(v) for v in self.default)
        return "none" if self.default is None else f"{self.default:g}" if self.type is float else str(self.default)


def field_help(f: Field) -> str:
    """``f``'s help with the names its registry holds now (``{names}``: the heads, a plugin's included), so that
    --help, the experiment file and the API reference never list fewer heads than there are."""
    if "{names}" not in f.help:
        return f.help  # the registered heads (the plugins once loaded: the CLI loads them before its options)
    if f.name == "init":
        names = " | ".join(n for n in sorted(HEADS) if getattr(HEADS[n].cls, "init_capable", False))
    else:
        iterative = [n for n in HEADS if not getattr(HEADS[n].cls, "closed_form", False)]
        closed = [n for n in HEADS if getattr(HEADS[n].cls, "closed_form", False)]
        names = f"{' | '.join(iterative)}; closed form (one exchange of statistics): {' | '.join(closed)}"
    return f.help.replace("{names}", names)


def updatable_heads() -> tuple:
    """The closed-form heads (built-in and registered) whose solve reads the summed statistics alone: the heads whose
    kept statistics ``fedhead update`` / ``forget`` change exactly (``ClosedFormHead.updatable``)."""
    load_plugins()
    return tuple(n for n, spec in HEADS.items() if getattr(spec.cls, "updatable", False))


def grid_heads() -> tuple:
    """The heads (built-in and registered) with a parameter that declares a validation grid (Param.grid)."""
    load_plugins()
    return tuple(n for n, spec in HEADS.items() if any(p.grid for p in spec.params))


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


# ---------------------------------------------------------------- registry parameters -> fields


def _param_field(name: str, owners: list[tuple[str, Param]], kind: str, group: str) -> Field:
    """One field for a registry parameter declared by one or more heads / partitions (e.g. ``alpha``)."""
    p = owners[0][1]
    names = [o for o, _ in owners]
    defaults = {o: q.default for o, q in owners}
    if len(set(map(repr, defaults.values()))) == 1:
        shown = _show(p.default)
    else:
        shown = "; ".join(f"{o}: {_show(d)}" for o, d in defaults.items())
    prefix = ", ".join(names)
    text = p.help if p.help.lower().startswith(prefix.split(",")[0]) else f"{prefix}: {p.help[:1].lower()}{p.help[1:]}"
    applies: tuple = (When(kind, tuple(names)),)
    if kind == "head":
        closed = tuple(n for n in names if getattr(HEADS[n].cls, "closed_form", False))
        if closed:  # a closed-form head's parameters also shape the --init start
            applies += (When("init", closed),)
    ptype = type(p.default) if p.default is not None else str
    same = all(q.constraint == p.constraint for _, q in owners)  # else: each owner's own (check_value with cfg)
    return Field(
        name,
        ptype,
        None,
        text.rstrip("."),
        group,
        constraint=p.constraint if same else None,
        applies=applies,
        default_text=shown,
        kind=kind,
    )


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _personal_fields() -> list[Field]:
    """The personalisation methods' parameters (:mod:`fedhead.core.personal`) as plain fields that apply where
    ``--personalize`` names a method declaring them."""
    shown = {"personal_lr": "the run's --lr", "personal_beta": "chosen per client on its validation part"}
    return [
        dataclasses.replace(
            f, kind="", default_text=shown.get(f.name, f.default_text), type=float if f.name in shown else f.type
        )
        for f in _registry_fields(PERSONAL, "personalize", PERSONAL_GROUP)
    ]


def _registry_fields(registry: dict, kind: str, group: str) -> list[Field]:
    owners: dict[str, list[tuple[str, Param]]] = {}
    for name, spec in registry.items():
        for p in spec.params:
            owners.setdefault(p.name, []).append((name, p))
    return [_param_field(n, o, kind, group) for n, o in owners.items()]


# ---------------------------------------------------------------- the table

_HEAD_NAMES = "the head (every registered one: a plugin's too): {names}"
_SERVER_PARAMS = {"lr": "server_lr", "momentum": "server_momentum", "betas": "server_betas", "tau": "server_tau"}


def _server_opts_with(param: str):
    """The server optimisers (built-in and registered) that take ``param``, read when a run is checked."""
    return lambda: tuple(n for n in server_optimizer_names() if param in SERVER_OPTIMIZERS[n].defaults)


_IT = (When("head", ITERATIVE),)
_POS = Interval(0, None, closed="neither")
_COUNT = Interval(1, None, integer=True)

_ASYNC = ("fedbuff", "fedasync")
_IN_PROCESS = ("in-process",)
_CLOCKED = "a rule of fedhead train's simulated clock; Flower rounds stay synchronous"


def _timing_fields() -> list[Field]:
    """The simulated clients' timing (:mod:`fedhead.core.clock`): every run's ``sim_time_s``."""
    return [
        Field(
            "client_speed",
            float,
            1000.0,
            "simulated clock: the median client's compute speed (each client's drawn log-normal around it, once "
            "per seed)",
            DATA,
            constraint=_POS,
            unit="samples/s",
            fix="Use a positive speed, e.g. 1000.",
        ),
        Field(
            "client_bandwidth",
            float,
            1e6,
            "simulated clock: the median client's network bandwidth, both ways (log-normal around it)",
            DATA,
            constraint=_POS,
            unit="bytes/s",
            fix="Use a positive bandwidth, e.g. 1e6.",
        ),
        Field(
            "timing_sigma",
            float,
            0.5,
            "simulated clock: sigma of the log-normal spread of the clients' speed and bandwidth (0: all equal)",
            DATA,
            constraint=Interval(0, None),
            fix="Use a sigma >= 0, e.g. 0.5.",
        ),
        Field(
            "stragglers",
            float,
            0.0,
            "simulated clock: fraction of the clients that are --straggler-slowdown times slower",
            DATA,
            constraint=Interval(0, 1),
            fix="Use a fraction in [0, 1], e.g. 0.2.",
        ),
        Field(
            "straggler_slowdown",
            float,
            10.0,
            "simulated clock: how many times slower a straggler computes and communicates",
            DATA,
            constraint=Interval(1, None),
            fix="Use a factor >= 1, e.g. 10.",
        ),
        Field(
            "dropout",
            float,
            0.0,
            "probability that a dispatched client never returns (keyed by seed and dispatch); it counts nowhere",
            DATA,
            constraint=Interval(0, 1, closed="left"),
            applies=_IT,
            transports=_IN_PROCESS,
            transport_why=_CLOCKED,
            fix="Use a probability in [0, 1), e.g. 0.1.",
        ),
    ]


def _async_fields() -> list[Field]:
    """Synchronous rounds with a deadline and over-selection, and the asynchronous rules (:mod:`fedhead.federation.asyncserver`)."""
    sync = (When("async_rule", ("none",)),)
    return [
        Field(
            "async_rule",
            str,
            "none",
            "server rule on the simulated clock: none (synchronous rounds) | fedbuff (a server update per "
            "--buffer-size arrived updates, staleness-weighted) | fedasync (one per arrived update, mixed in); "
            "--rounds counts server updates",
            SERVER,
            constraint=OneOf(("none", *_ASYNC)),
            applies=_IT,
        ),
        Field(
            "buffer_size",
            int,
            None,
            "fedbuff: updates buffered per server update (K; at most --concurrency)",
            SERVER,
            constraint=_COUNT,
            applies=(When("async_rule", ("fedbuff",)),),
            default_text="clients per round",
        ),
        Field(
            "concurrency",
            int,
            None,
            "fedbuff / fedasync: clients training at once (at most --clients)",
            SERVER,
            constraint=_COUNT,
            applies=(When("async_rule", _ASYNC),),
            default_text="clients per round",
        ),
        Field(
            "staleness",
            str,
            None,
            "fedbuff / fedasync: weight of an update tau server updates old: constant | sqrt (1/sqrt(1+tau)) | "
            "poly ((1+tau)^-a, a = --staleness-exponent)",
            SERVER,
            constraint=OneOf(STALENESS),
            applies=(When("async_rule", _ASYNC),),
            default_text="fedbuff: sqrt; fedasync: poly",
        ),
        Field(
            "staleness_exponent",
            float,
            0.5,
            "--staleness poly: the exponent a",
            SERVER,
            constraint=_POS,
            applies=(When("staleness", ("poly",)),),
        ),
        Field(
            "async_mixing",
            float,
            0.6,
            "fedasync: mixing weight alpha of an arrived model (theta <- (1 - alpha s) theta + alpha s W_k)",
            SERVER,
            constraint=Interval(0, 1, closed="right"),
            applies=(When("async_rule", ("fedasync",)),),
        ),
        Field(
            "deadline",
            float,
            None,
            "synchronous rounds: simulated seconds the server waits; clients not back by then are dropped from the "
            "round",
            SERVER,
            constraint=_POS,
            applies=sync,
            default_text="none (wait for every client)",
            unit="s",
            transports=_IN_PROCESS,
            transport_why=_CLOCKED,
            fix="Use a positive number of seconds, e.g. 30.",
        ),
        Field(
            "over_selection",
            float,
            0.0,
            "synchronous rounds: select ceil((1 + F) x clients per round) and keep the first clients per round to "
            "finish (Bonawitz et al. 2019: 0.3)",
            SERVER,
            constraint=Interval(0, None),
            applies=sync,
            transports=_IN_PROCESS,
            transport_why=_CLOCKED,
            fix="Use a fraction >= 0, e.g. 0.3.",
        ),
    ]


FIELD_LIST: list[Field] = [
    # ---- data and clients
    Field(
        "features",
        str,
        REQUIRED,
        "HDF5 feature store written by 'fedhead extract' (Flower: the server's, whose test split is evaluated "
        "centrally; in simulation also the store every virtual client slices)",
        DATA,
        default_text="required",
        old_keys=("feature-store",),
        identity=False,
    ),
    Field(
        "partition",
        str,
        "iid",
        "how the training set is split: iid | shard | dirichlet | bernoulli-dirichlet | zipf | kmeans | natural "
        "(one client per client id the store records; --clients = their number) | flwr:<ClassName> (flwr-datasets' "
        "partitioner, e.g. flwr:DirichletPartitioner; pip install 'fedhead[data]')",
        DATA,
        constraint=Names("partition"),
    ),
    *_registry_fields(PARTITIONS, "partition", DATA),
    Field(
        "partition_arg",
        dict,
        None,
        "flwr:<ClassName>: a keyword argument of the flwr-datasets partitioner as KEY=VALUE (repeatable; values are "
        "literals: numbers, true/false, strings, lists like [1,2]); num_partitions, partition_by and seed come from "
        "--clients, the labels and the run's seed",
        DATA,
        constraint=PartitionArgs(),
        applies=(When("partition", FLWR),),
        inert=({}, [], (), ""),
        default_text="none",
        kind="partition",
    ),
    Field(
        "clients",
        int,
        100,
        "number of clients K (Flower: the SuperNodes, partition ids 0 .. K-1)",
        DATA,
        constraint=_COUNT,
    ),
    Field(
        "participation",
        float,
        1.0,
        "fraction of the clients sampled each round (seeded by seed and round)",
        DATA,
        constraint=Interval(0, 1, closed="right"),
        fix="Use a fraction of clients per round in (0, 1], e.g. 0.1.",
    ),
    Field(
        "clients_per_round",
        int,
        None,
        "clients sampled each round, a fixed number instead of --participation's fraction (e.g. 10 of 9,275; "
        "seeded by seed and round, the same clients as the fraction that rounds to it)",
        DATA,
        constraint=_COUNT,
        default_text="--participation x --clients",
        fix="Use a number of clients per round >= 1 and <= --clients, e.g. 10.",
    ),
    *_timing_fields(),
    # ---- the head
    Field("head", str, None, _HEAD_NAMES, HEAD, constraint=Names("head"), default_text="recipe: ova2; fast: softmax"),
    *_registry_fields(HEADS, "head", HEAD),
    Field(
        "init",
        str,
        None,
        "closed-form start of an iterative head: {names} (round 1 exchanges statistics)",
        HEAD,
        constraint=Names("closed-form"),
        applies=_IT,
        default_text="none; fast recipe: ridge",
    ),
    Field(
        "init_scale",
        float,
        None,
        "temperature the --init head is multiplied by",
        HEAD,
        constraint=_POS,
        applies=(When("init", GIVEN),),
        default_text="measured: ridge 10, others 1",
    ),
    # ---- local training
    Field(
        "recipe",
        str,
        "default",
        "fills the options left unset: default (robust, measured) | paper (the OvA-LP paper's settings) | fast "
        "(softmax from a Fed3R start, 30 local steps)",
        LOCAL,
        constraint=OneOf(tuple(RECIPES)),
    ),
    Field(
        "rounds",
        int,
        50,
        "communication rounds (a closed-form head takes one exchange: 1 is accepted there, so one command sweeps "
        "over heads)",
        LOCAL,
        constraint=_COUNT,
        applies=_IT,
        consistent=(1,),
    ),
    Field(
        "local_epochs",
        int,
        None,
        "local epochs per round",
        LOCAL,
        constraint=_COUNT,
        applies=_IT,
        default_text=f"{LOCAL_EPOCHS}; fast recipe: --local-steps 30",
    ),
    Field(
        "local_steps",
        int,
        None,
        "local steps (batches) per round for every client, instead of epochs",
        LOCAL,
        constraint=_COUNT,
        applies=_IT,
        default_text="none; fast recipe: 30",
    ),
    Field("batch_size", int, 50, "local batch size", LOCAL, constraint=_COUNT, applies=_IT, unit="samples"),
    Field(
        "optimizer",
        str,
        None,
        "local optimizer, fresh state every round: adamw (AdamW, decoupled weight decay; not fedhead scratch's "
        "adam, which is Adam with L2 decay) | sgd (L2 weight decay)",
        LOCAL,
        constraint=OneOf(("adamw", "sgd")),
        applies=_IT,
        default_text="recipe: sgd; paper: adamw",
    ),
    Field("lr", float, None, "local learning rate", LOCAL, constraint=_POS, applies=_IT, default_text="recipe: 0.01"),
    Field(
        "weight_decay",
        float,
        None,
        "weight decay: decoupled (adamw) or L2 (sgd)",
        LOCAL,
        constraint=Interval(0, None),
        applies=_IT,
        default_text="recipe: 0.0001",
    ),
    Field(
        "momentum",
        float,
        None,
        "SGD momentum",
        LOCAL,
        constraint=Interval(0, 1, closed="left"),
        applies=(When("optimizer", ("sgd",)),),
        default_text="recipe: 0.9",
    ),
    Field(
        "prox_mu",
        float,
        0.0,
        "FedProx proximal term mu (0 = FedAvg)",
        LOCAL,
        constraint=Interval(0, None),
        applies=_IT,
    ),
    Field("scaffold", bool, False, "SCAFFOLD control variates (option II; needs --optimizer sgd)", LOCAL, applies=_IT),
    Field(
        "backend",
        str,
        "vectorized",
        "local-training engine: vectorized (all clients of a block at once) | loop (per client, for checking)",
        LOCAL,
        constraint=OneOf(BACKENDS),
        applies=_IT,
    ),
    Field(
        "dual",
        str,
        "auto",
        "dual-form local SGD (a client's head as coefficients on its own samples; docs/scale.md): auto (clients "
        "with 2 n_k <= D+1) | on (every client) | off (primal heads); AdamW and the loop backend always run primal",
        LOCAL,
        constraint=OneOf(DUAL_MODES),
        applies=_IT,
        transports=("in-process",),
        identity=False,
    ),
    Field(
        "block_clients",
        int,
        None,
        "clients trained at once",
        LOCAL,
        constraint=_COUNT,
        applies=_IT,
        default_text="from --memory-budget-mb",
        fix="Leave it out to size the blocks from --memory-budget-mb.",
        transports=("in-process",),
        identity=False,
    ),
    Field(
        "memory_budget_mb",
        float,
        1536.0,
        "budget for the client-stacked tensors of one block",
        LOCAL,
        constraint=_POS,
        applies=_IT,
        unit="MB",
        transports=("in-process",),
        identity=False,
    ),
    # ---- server and aggregation
    Field(
        "aggregate",
        str,
        None,
        "aggregation rule: fedavg (size-weighted) | grouped (per row, FedOVA style) | fedavg-int8 | fedavg-topk "
        "(compressed updates, error feedback) | median | trimmed-mean (robust to poisoning clients) | a registered "
        "rule",
        SERVER,
        constraint=Names("aggregate"),
        applies=_IT,
        default_text="recipe: fedavg",
    ),
    Field(
        "topk_fraction",
        float,
        None,
        "fedavg-topk: fraction of the head's entries each client sends (those of largest |update + residual|)",
        SERVER,
        constraint=Interval(0, 1, closed="right"),
        applies=(When("aggregate", ("fedavg-topk",)),),
        default_text=f"{DEFAULT_TOPK_FRACTION:g}",
        fix="Use a fraction in (0, 1], e.g. 0.01.",
    ),
    Field(
        "error_feedback",
        bool,
        None,
        "fedavg-int8 / fedavg-topk: error feedback (a client adds what compression dropped to its next update)",
        SERVER,
        applies=(When("aggregate", COMPRESSED),),
        default_text="on",
    ),
    Field(
        "trim_fraction",
        float,
        None,
        "trimmed-mean: share of the largest and of the smallest client values dropped per head entry (0.5: the median)",
        SERVER,
        constraint=Interval(0, 0.5, closed="both"),
        applies=(When("aggregate", ("trimmed-mean",)),),
        default_text="0.1",
        fix="Use a fraction in [0, 0.5], at least 1/(clients a round) to drop one poisoning client, e.g. 0.25.",
    ),
    Field(
        "norm_bound",
        float,
        None,
        "median / trimmed-mean: each client's update W_k - theta clipped on the server to this L2 norm",
        SERVER,
        constraint=_POS,
        applies=(When("aggregate", ("median", "trimmed-mean")),),
        default_text="no bound",
        fix="Use a positive norm, e.g. that of a typical client update.",
    ),
    Field(
        "center",
        bool,
        None,
        "subtract the federated mean feature (one extra exchange in round 1)",
        SERVER,
        applies=_IT,
        inert=(False,),
        default_text="recipe: on; paper: off",
    ),
    Field(
        "scale",
        str,
        None,
        "feature scaling: none | rms (divide by the federated RMS feature norm)",
        SERVER,
        constraint=OneOf(("none", "rms")),
        applies=_IT,
        inert=("none",),
        default_text="recipe: none",
    ),
    Field(
        "server_opt",
        str,
        "fedavg",
        "server optimiser: fedavg | fedavgm | fedadam | fedyogi | fedadagrad",
        SERVER,
        constraint=Names("server-opt"),
        applies=_IT,
    ),
    Field(
        "server_lr",
        float,
        None,
        "server learning rate",
        SERVER,
        constraint=_POS,
        applies=(When("server_opt", _server_opts_with("lr")),),
        default_text="Flower's for --server-opt",
        fix="Use a positive server learning rate, e.g. 0.1.",
    ),
    Field(
        "server_momentum",
        float,
        None,
        "fedavgm: server momentum",
        SERVER,
        constraint=Interval(0, 1, closed="left"),
        applies=(When("server_opt", _server_opts_with("momentum")),),
        default_text="Flower's: 0",
        fix="Use a momentum in [0, 1), e.g. 0.9; 0 disables it.",
    ),
    Field(
        "server_betas",
        tuple,
        None,
        "fedadam / fedyogi: beta1,beta2",
        SERVER,
        constraint=Pair(),
        applies=(When("server_opt", _server_opts_with("betas")),),
        default_text="Flower's: 0.9,0.99",
        fix="Example: --server-betas 0.9,0.99",
    ),
    Field(
        "server_tau",
        float,
        None,
        "fedadam / fedyogi / fedadagrad: adaptivity tau",
        SERVER,
        constraint=_POS,
        applies=(When("server_opt", _server_opts_with("tau")),),
        default_text="Flower's: 0.001",
        fix="Use a small positive value, e.g. 1e-3.",
    ),
    Field(
        "calibrate",
        str,
        "none",
        "after the last round: none | ccvr (calibrate the head on virtual features)",
        SERVER,
        constraint=OneOf(("none", "ccvr")),
        applies=_IT,
    ),
    Field(
        "ccvr_samples",
        int,
        200,
        "ccvr: virtual features per class",
        SERVER,
        constraint=_COUNT,
        applies=(When("calibrate", ("ccvr",)),),
    ),
    *_async_fields(),
    # ---- label noise
    Field(
        "noise",
        str,
        "none",
        "label noise per client (test labels stay clean): none | symmetric | asymmetric",
        NOISE_GROUP,
        constraint=Names("noise"),
    ),
    Field(
        "noise_rate",
        float,
        0.0,
        "label flip rate r",
        NOISE_GROUP,
        constraint=Interval(0, 1, closed="left"),
        applies=(When("noise", NOT_NONE),),
    ),
    Field(
        "asym_map",
        str,
        "auto",
        "asymmetric map: auto (the dataset's) | cyclic (y -> y+1 mod C)",
        NOISE_GROUP,
        constraint=OneOf(ASYM_RULES),
        applies=(When("noise", ("asymmetric",)),),
        deprecated=("asym_rule",),
    ),
    Field(
        "noise_dataset",
        str,
        None,
        "dataset whose asymmetric map applies",
        NOISE_GROUP,
        applies=(When("noise", ("asymmetric",)),),
        default_text="the store's",
    ),
    # ---- privacy (their combinations are checked by fedhead.core.dp.validate_dp)
    Field(
        "dp_noise_multiplier",
        float,
        None,
        "differential privacy: Gaussian noise std z x the L2 sensitivity (needs --dp-clip and --dp-delta; "
        "0 = clipping only)",
        PRIVACY,
        constraint=Interval(0, None),
        default_text="off",
        fix="Use 0 for clipping without noise (no privacy), e.g. 1.0 for privacy.",
    ),
    Field(
        "dp_clip",
        float,
        None,
        "DP: client update L2 clip (iterative head, DP-FedAvg) or per-sample feature-norm clip (closed-form head)",
        PRIVACY,
        constraint=_POS,
        fix="Use a positive norm bound, e.g. 0.5.",
    ),
    Field(
        "dp_delta",
        float,
        None,
        "DP: delta of the (epsilon, delta) the accountant reports",
        PRIVACY,
        constraint=Interval(0, 1, closed="neither"),
        fix="Use a delta below 1/(number of clients), e.g. 1e-5.",
    ),
    Field(
        "dp_feature_clip",
        float,
        None,
        "DP, iterative head: per-sample feature-norm clip of its statistics (--center, --scale rms, --init)",
        PRIVACY,
        constraint=_POS,
        fix="Use a positive feature-norm bound, e.g. the median feature norm of the store.",
    ),
    Field(
        "secure_aggregation",
        bool,
        False,
        "Flower's SecAgg+: the server learns only sums over each round's clients (head updates, feature and "
        "closed-form statistics; >= 3 clients a round)",
        PRIVACY,
        transports=("flower",),
    ),
    # ---- run and output
    Field(
        "seeds",
        list,
        [0],
        "seeds, repeated or comma-separated; each runs separately, mean +- std reported (the paper's: "
        + ",".join(map(str, PAPER_SEEDS))
        + ")",
        RUN,
        constraint=Interval(0, None, integer=True),
        old_flags=("--seed",),
    ),
    Field(
        "iid_reference",
        bool,
        False,
        "also run IID with everything else equal (ratio_to_iid)",
        RUN,
        transports=("in-process",),
    ),
    Field(
        "central_reference",
        bool,
        False,
        "also train the head centrally on the pooled data, the ceiling (ratio_to_central)",
        RUN,
        transports=("in-process",),
    ),
    Field(
        "client_test",
        bool,
        True,
        "give every client a local test set drawn from the test split in its training label proportions (FedABC's "
        "protocol; seeded, no sample twice within a client) and report local_accuracy_mean/worst10/best10/std on "
        "them (none under secure aggregation: the server never sees a client's label counts)",
        RUN,
    ),
    Field(
        "eval_unseen_clients",
        bool,
        False,
        "also report the per-client accuracy of the clients no round has sampled yet (partial participation: "
        "clients that never trained), as unseen_client_accuracy_mean/worst10/best10/std and unseen_clients",
        RUN,
    ),
    Field(
        "val_fraction",
        float,
        None,
        "share of each client's training data held out as its validation part (seeded, stratified by class within "
        "the client); everything that chooses (selected round, early stopping, Acc@95) reads it, never the test "
        "split; 0: no validation, nothing selected",
        RUN,
        constraint=Interval(0, 1, closed="left"),
        default_text="recipe: 0.1; paper: 0",
        fix="Use a share in [0, 1), e.g. 0.1 (0 turns validation off).",
    ),
    Field(
        "select_on_val",
        bool,
        True,
        "closed-form heads: choose each regularisation parameter left unset from the grid its head declares, by "
        "accuracy on the validation part (one solve per value, no extra round; off under DP)",
        HEAD,
        applies=(When("head", lambda: grid_heads()),),
    ),
    Field(
        "keep_statistics",
        bool,
        False,
        "closed-form heads: keep the summed statistics beside each model (statistics-seed<S>-v<N>.safetensors, "
        "owner-only) so that fedhead update / fedhead forget take clients in or out exactly; not with DP",
        HEAD,
        applies=(When("head", lambda: updatable_heads()),),
    ),
    Field(
        "withdrawn_clients",
        str,
        None,
        "client ids whose data the run leaves out (they withdrew): the partition is drawn as without them, their "
        "parts are emptied, so a run equals one that never had them (fedhead forget's retraining); e.g. 3,7",
        DATA,
        constraint=ClientIds(),
        default_text="none",
        transports=("in-process",),
    ),
    Field(
        "early_stop",
        int,
        0,
        "stop a run after this many evaluations without a better validation value (--early-stop-metric); 0: off",
        RUN,
        constraint=Interval(0, None, integer=True),
        applies=_IT,
        unit="evaluations",
    ),
    Field(
        "early_stop_metric",
        str,
        "accuracy",
        "what --early-stop and the selected round watch: accuracy (higher is better) | loss (the validation "
        "cross-entropy of the head's scores, lower is better)",
        RUN,
        constraint=OneOf(("accuracy", "loss")),
        applies=_IT,
    ),
    Field(
        "on_diverge",
        str,
        "stop",
        "a round whose training loss is not finite or 1000x the first round's: stop (one line naming the round, "
        "non-zero exit) | continue",
        RUN,
        constraint=OneOf(("stop", "continue")),
        applies=_IT,
    ),
    Field("device", str, "auto", "auto | cpu | cuda (Flower: the server and simulated clients)", RUN, identity=False),
    Field(
        "eval_every",
        int,
        1,
        "evaluate the global head every n rounds (and the last)",
        RUN,
        constraint=_COUNT,
        applies=_IT,
    ),
    # ---- personalisation
    Field(
        "personalize",
        str,
        None,
        "after the rounds, give every client its own head and score it on the client's local test set (FedABC's "
        "protocol: pfl_accuracy, per-client gain over the global head, drift): none (the global head) | prior | "
        "finetune | ditto | apfl | fedrod (--head bsm) | fedabc | local | closed-form (ridge, lda, ...: needs the "
        "statistics of a closed-form head or --init); fedper | fedrep | lg need a hidden layer (refused)",
        PERSONAL_GROUP,
        constraint=Names("personalize"),
        default_text="off",
    ),
    *_personal_fields(),
    Field(
        "personal_drift",
        int,
        None,
        "test samples per class of the class-balanced drift set every personal head is also scored on (FedABC's "
        "drift measure, drift_accuracy); 0: none",
        PERSONAL_GROUP,
        constraint=Interval(0, None, integer=True),
        applies=(When("personalize", lambda: tuple(PERSONAL)),),
        default_text="1000 / classes, at least 1",
    ),
    Field(
        "personal_models",
        str,
        None,
        "write the personal heads of these clients as model files model-seed<S>-client<K>.json (+ .safetensors), "
        "for fedhead predict / export --client K and fedhead.load_model(run, client=K): client ids as 0,2,5, or "
        "all (at most 1,000 clients)",
        PERSONAL_GROUP,
        constraint=ClientIds(),
        applies=(When("personalize", lambda: tuple(PERSONAL)),),
        default_text="none",
        transports=("in-process",),  # on Flower each node keeps its personal head: the server never sees one
    ),
    # where the rows go besides rounds.csv (not part of a run's identity: a resume may change them)
    Field(
        "plots",
        bool,
        True,
        "write curves.png (accuracy and loss per round) and partition.png (label counts per client) into the run "
        "directory when the run ends",
        RUN,
        identity=False,
    ),
    Field(
        "log",
        str,
        "none",
        "also write every row to a tracker, each round as it comes: none | tensorboard (pip install "
        "'fedhead[tensorboard]') | mlflow (a local store; pip install 'fedhead[mlflow]')",
        RUN,
        constraint=OneOf(TRACKERS),
        identity=False,
    ),
    Field(
        "log_dir",
        str,
        None,
        "the tracker's folder (tensorboard: the run's event files go to LOG_DIR/<run name>; mlflow: the store)",
        RUN,
        applies=(When("log", TRACKERS[1:]),),
        default_text="OUT/tensorboard | OUT/mlruns",
        identity=False,
    ),
]
FIELDS: dict[str, Field] = {f.name: f for f in FIELD_LIST}
assert len(FIELDS) == len(FIELD_LIST), "a field declared twice"
HEAD_PARAMS = tuple(f.name for f in FIELD_LIST if f.kind == "head")
PARTITION_PARAMS = tuple(f.name for f in FIELD_LIST if f.kind == "partition")
DEPRECATED_KEYWORDS = {old: f.name for f in FIELD_LIST for old in f.deprecated}
# where a run runs and where its rows go besides rounds.csv, not what it finds (left out of a run's identity)
NOT_IDENTITY = tuple(f.name for f in FIELD_LIST if not f.identity)

# Options of a run that are not part of the experiment (where and how to run it): flags and run-config keys by
# the same rule, never in the experiment file.
RUN_OPTIONS: dict[str, Field] = {
    f.name: f
    for f in (
        Field(
            "out",
            str,
            None,
            "run directory",
            RUN,
            default_text="runs/<timestamp>-<head>-<partition>, -2, -3, ... when taken",
            old_keys=("run-dir",),
        ),
        Field("resume", bool, False, "continue the interrupted run in --out from its checkpoint", RUN),
        Field(
            "overwrite",
            bool,
            False,
            "replace the run in --out (a finished one, or what a failed run left); only a folder a run wrote",
            RUN,
            transports=("in-process",),
        ),
        Field(
            "round_timeout",
            float,
            600.0,
            "Flower: seconds to wait for a round's replies (late or crashed nodes count as failures)",
            RUN,
            constraint=_POS,
            unit="s",
        ),
        Field(
            "wait_timeout",
            float,
            300.0,
            "Flower: seconds to wait for --clients SuperNodes to connect (then the run stops, naming how many did)",
            RUN,
            constraint=_POS,
            unit="s",
        ),
    )
}


def plugin_fields() -> list[Field]:
    """The fields of the parameters that heads and partitions registered after the table was built declare (a
    plugin's ``Param("gamma", ...)``): a flag (``--gamma``), a TOML key, a ``fedhead.run`` keyword and a Flower
    run-config key like a built-in head's, kept in ``TrainConfig.plugin_params``. Loads the plugins first."""
    load_plugins()
    out = []
    for registry, kind, group in ((HEADS, "head", HEAD), (PARTITIONS, "partition", DATA),
                                  (PERSONAL, "personalize", PERSONAL_GROUP)):  # fmt: skip
        owners: dict[str, list[tuple[str, Param]]] = {}
        for name, spec in registry.items():
            for p in spec.params:
                if p.name not in FIELDS and p.name not in RUN_OPTIONS:
                    owners.setdefault(p.name, []).append((name, p))
        out += [_param_field(n, o, kind, group) for n, o in owners.items()]
    return out


def plugin_field(name: str) -> Field | None:
    """The field of a plugin's parameter ``name`` (:func:`plugin_fields`), or None."""
    if name in FIELDS:
        return None
    return next((f for f in plugin_fields() if f.name == name), None)


def field_names() -> set[str]:
    """Every field's name, and every parameter of a registered head or partition (a plugin's too)."""
    return set(FIELDS) | {p.name for registry in (HEADS, PARTITIONS) for spec in registry.values() for p in spec.params}


# The entry points of the Python API (fedhead.run, TrainConfig.resolved, TrainConfig.from_toml) name fields in their
# errors as Python does ('lr'), the CLI as flags ('--lr'): one message, two spellings (fedhead.infra.errors).
python_api = python_names(field_names)


# ---------------------------------------------------------------- values


PERSONAL_MODELS_MAX = 1000  # --personal-models: most clients whose personal heads a run writes (per seed)


def parse_client_ids(v: Any) -> list[int] | str | None:
    """``0,2,5`` as the list of ids (ascending), ``all`` as "all", anything else (a negative or repeated id, not
    text) as None."""
    if not isinstance(v, str):
        return None
    text = v.replace(" ", "")
    if text.lower() == "all":
        return "all"
    parts = text.split(",")
    if not text or not all(t.isdigit() and t.isascii() for t in parts):
        return None
    ids = [int(t) for t in parts]
    return sorted(ids) if len(set(ids)) == len(ids) else None


def parse_pair(v: Any) -> tuple | None:
    """``b1,b2`` (text or a sequence) as two floats, else None."""
    if isinstance(v, str):
        try:
            v = tuple(float(t) for t in v.replace(" ", "").split(","))
        except ValueError:
            return None
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_number(x) for x in v):
        return tuple(float(x) for x in v)
    return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_seeds(items, param: str = "--seeds") -> list[int]:
    """Seeds given as integers, or as text repeated or comma-separated ("0,42 777"), in order; a seed named twice is
    refused (one run reported as several)."""
    if isinstance(items, (int, str)) and not isinstance(items, bool):
        items = [items]
    out: list[int] = []
    for item in items:
        toks = [item] if _number(item) else str(item).replace(",", " ").split()
        for tok in toks:
            try:
                v = int(tok) if not isinstance(tok, float) or tok.is_integer() else None
            except ValueError:
                v = None
            if v is None:
                raise FedheadError(
                    f"The '{param}' parameter must be integers >= 0. Got {tok!r} instead. Use e.g. {param} 0,42,777."
                )
            validate(param, v, Interval(0, None, integer=True))
            if v in out:  # a repeated seed would report a std of 0 over runs that are one
                raise FedheadError(
                    f"The '{param}' parameter names seed {v} twice. Got {items!r}. Give each seed once, e.g. "
                    f"{param} {','.join(str(s) for s in out)}."
                )
            out.append(v)
    return out


def check_value(f: Field, value: Any, param: str | None = None, cfg=None) -> None:
    """``value`` against ``f``'s declared constraint; the one-line error names ``param`` (default: the flag). With
    ``cfg``, a head's or partition's parameter is checked against the declaration of the head / partition chosen
    there (``min_size`` is >= 0 for dirichlet, >= 1 for zipf)."""
    param = param or f.flag
    if value is None:
        return
    constraint = f.constraint
    if f.kind and cfg is not None:
        chosen = [cfg.partition] if f.kind == "partition" else [cfg.head, cfg.init]
        registry = PARTITIONS if f.kind == "partition" else HEADS
        owners = [registry.get(n) for n in chosen if isinstance(n, str)]
        declared = [p for o in owners if o is not None for p in o.params if p.name == f.name]
        if declared:
            constraint = declared[0].constraint
    if constraint is None:
        return
    if isinstance(constraint, Names):
        if not constraint.ok(value):
            raise unknown_name(param, value, constraint.shown(), constraint.what)
        return
    if isinstance(constraint, PartitionArgs):
        parse_partition_args(value, param)  # the one-line error says which item and why
        return
    if f.name == "seeds":
        for s in value:
            validate(param, s, constraint, f.fix or None)
        return
    validate(param, value, constraint, f.fix or None)


# ---------------------------------------------------------------- where a field applies


def recipe_fill(name: str, recipe: str) -> Any:
    """What resolution fills into ``name`` when it is left unset (None if nothing)."""
    if name == "local_epochs":
        return LOCAL_EPOCHS
    return RECIPES.get(recipe, {}).get(name)


def is_given(f: Field, value: Any, recipe: str) -> bool:
    """Whether ``value`` of ``f`` was set on purpose: not its default, not what the recipe fills in and not
    inert (so a default, or a resolved configuration, never counts as given)."""
    if value is None or value == f.default or value in f.inert:
        return False
    return value != recipe_fill(f.name, recipe)


def applies(f: Field, resolved) -> bool:
    """Whether ``f`` applies to the run ``resolved``: one of its conditions holds, and the field that condition
    reads applies itself (``--momentum`` needs ``--optimizer sgd``, which needs an iterative head)."""
    return not f.applies or any(
        w.holds(resolved) and (w.field not in FIELDS or applies(FIELDS[w.field], resolved)) for w in f.applies
    )


def _blocking(f: Field, resolved) -> Field:
    """The field whose own conditions fail for ``f``: ``f``, or the field a condition of ``f`` that holds reads."""
    for w in f.applies:
        if w.holds(resolved) and w.field in FIELDS:
            return _blocking(FIELDS[w.field], resolved)
    return f


def given_fields(raw, recipe: str | None = None) -> list[Field]:
    recipe = recipe or getattr(raw, "recipe", "default")
    return [f for f in FIELD_LIST if is_given(f, getattr(raw, f.name), recipe)]


def not_applying_message(fields: list[Field], resolved) -> str:
    """ "The '--fedlc-tau' option does not apply to --head ova2: it applies to --head fedlc only. Drop --fedlc-tau
    or use --head fedlc." (the parameters, the value they meet, the fix), for options refused for one reason."""
    conds = _blocking(fields[0], resolved).applies
    flags = [f.flag for f in fields]
    what = f"'{flags[0]}' option" if len(flags) == 1 else "'" + "', '".join(flags[:-1]) + f"' and '{flags[-1]}' options"
    verb, they, drop = ("does", "it applies", flags[0]) if len(flags) == 1 else ("do", "they apply", "them")
    got = []
    for w in conds:
        v = getattr(resolved, w.field)
        got.append(f"runs without {flag_of(w.field)}" if v is None else f"{flag_of(w.field)} {v}")
    got = list(dict.fromkeys(got))
    if conds[0].values == ITERATIVE:
        same = [f"{f.flag} {f.consistent[0]}" for f in fields if f.consistent]
        also = f" ({', '.join(same)} is accepted: it is what the head does)" if same else ""
        return (
            f"The {what} {verb} not apply to --head {resolved.head}, a closed-form head solved once from "
            f"statistics: {they} to iterative heads only. Drop {drop}{also}, or use an iterative head (softmax, "
            "ova, ova2, ...)."
        )
    wanted = " or ".join(w.wanted() for w in conds)
    fix = " or ".join(f"give {flag_of(w.field)}" if w.values == GIVEN else f"use {w.wanted()}" for w in conds)
    return f"The {what} {verb} not apply to {' and '.join(got)}: {they} to {wanted} only. Drop {drop} or {fix}."


def check_given(raw, resolved) -> None:
    """Refuse, in one line, a field given in ``raw`` that does not apply to ``resolved`` (its head, partition,
    method, recipe); then the parameters of plugins' heads and partitions (``plugin_params``) that no chosen head
    or partition declares. (The transport is checked by :func:`check_transport`, where it is known.)"""
    refused: dict[tuple, list[Field]] = {}  # by reason: one line names every option refused for the first one
    for f in given_fields(raw, resolved.recipe):
        if f.applies and not applies(f, resolved) and getattr(raw, f.name) not in f.consistent:
            refused.setdefault(_blocking(f, resolved).applies, []).append(f)
    if refused:
        raise FedheadError(not_applying_message(next(iter(refused.values())), resolved))
    for key in getattr(raw, "plugin_params", {}) or {}:
        owners = [n for n, s in HEADS.items() if any(p.name == key for p in s.params)]
        powners = [n for n, s in PARTITIONS.items() if any(p.name == key for p in s.params)]
        mowners = [n for n, s in PERSONAL.items() if any(p.name == key for p in s.params)]
        if not owners and not powners and not mowners:
            raise FedheadError(
                f"The '{key}' parameter is not declared by any registered head, partition or personalisation "
                "method. Got it in plugin_params. Drop it, or register the one that takes it (FEDHEAD_PLUGINS)."
            )
        chosen = resolved.head in owners or resolved.init in owners or resolved.partition in powners
        if not chosen and resolved.personalize not in mowners:
            whom = " | ".join(owners + powners + mowners)
            raise FedheadError(
                f"The '{key}' parameter applies to {whom} only. Got --head {resolved.head} and --partition "
                f"{resolved.partition}. Drop it or use {whom}."
            )


def check_transport(raw, transport: str) -> None:
    """Refuse a field given in ``raw`` that the ``transport`` (in-process | flower) does not run."""
    for f in given_fields(raw):
        if transport not in f.transports:
            raise FedheadError(transport_message(f, transport))


def transport_message(f: Field, transport: str) -> str:
    if f.transports == ("flower",):
        return (
            f"The '{f.flag}' option applies to Flower runs only (fedhead flower simulate / superlink). Got it with "
            f"fedhead train. Drop {f.flag}, or run on Flower."
        )
    why = f.transport_why or "the server holds no training features, and no node-local resources"
    return (
        f"The '{f.flag}' option applies to fedhead train only, not to Flower runs ({why}). Got it with a Flower run. "
        f"Drop {f.flag}, or run it with fedhead train."
    )


def only_applicable(values: dict, cell) -> dict:
    """The subset of ``values`` (field -> value) that applies to the run ``cell`` (a TrainConfig with its recipe
    filled in): what a bench grid passes on from its shared options to each of its runs."""
    out = {}
    for name, v in values.items():
        f = FIELDS.get(name)
        if f is None or not is_given(f, v, cell.recipe) or applies(f, cell):
            out[name] = v
    return out
