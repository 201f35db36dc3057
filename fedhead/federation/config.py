"""The trainer's configuration: one dataclass, a comment per field, recipes resolved once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from fedhead.core.aggregate import aggregator_names
from fedhead.core.dp import validate_dp
from fedhead.core.engine import BACKENDS
from fedhead.infra.errors import FedheadError, Interval, OneOf, validate

PAPER_SEEDS = (0, 42, 777, 1337, 15254)

# Recipes fill every field left as None. "paper" is SPEC section 1 to the letter (for reproduction);
# "default" is the one that measured robust across heads, partitions and class counts (see README,
# "Choosing the default recipe", for the ablation behind it).
RECIPES: dict[str, dict] = {
    "paper": dict(
        head="ova2",
        optimizer="adamw",
        lr=0.01,
        weight_decay=1e-4,
        momentum=0.9,
        aggregate="fedavg",
        center=False,
        scale="none",
    ),
    "default": dict(
        head="ova2",
        optimizer="sgd",
        lr=0.01,
        weight_decay=1e-4,
        momentum=0.9,
        aggregate="fedavg",
        center=True,
        scale="none",
    ),
}
# "fast": the default recipe from a closed-form start, softmax head, 30 local steps a round whatever a client's
# size: Fed3R+FT (README "Baselines", measured by `fedhead bench baselines`); an explicit --head keeps the ridge
# start, a closed-form head ignores it; an explicit --local-epochs replaces the 30 steps.
RECIPES["fast"] = dict(RECIPES["default"], head="softmax", init="ridge", local_steps=30)
SECURE_MIN_CLIENTS = 3  # fewest clients per round --secure-aggregation accepts (config check)
LOCAL_EPOCHS = 3  # when neither --local-epochs nor --local-steps (nor a recipe) says


@dataclass
class TrainConfig:
    features: str  # path of the HDF5 feature store
    head: str | None = None  # softmax | ova | ova2 | fedabc | fedrs | fedlc | ncm | ridge | cof | lda
    # [recipe: ova2; fast: softmax]
    partition: str = "iid"  # iid | shard | dirichlet | bernoulli-dirichlet | zipf | kmeans
    partition_params: dict = field(default_factory=dict)  # alpha, p, shards_per_client, ... (None = default)
    head_params: dict = field(default_factory=dict)  # stage1_rounds, positive_keep, fedabc_margins, ...
    clients: int = 100  # number of simulated clients K
    rounds: int = 50  # communication rounds
    local_epochs: int | None = None  # local epochs per round [3]
    local_steps: int | None = None  # local steps (batches) per round instead of epochs [fast: 30]
    batch_size: int = 50  # local batch size
    recipe: str = "default"  # default | paper | fast: fills the None fields (head, optimizer, ...)
    optimizer: str | None = None  # adamw | sgd (fresh state per client per round)
    lr: float | None = None  # local learning rate
    weight_decay: float | None = None  # decoupled (AdamW) or L2 (SGD) weight decay
    momentum: float | None = None  # SGD momentum
    aggregate: str | None = None  # fedavg (size-weighted, whole head) | grouped (per-row, FedOVA style)
    # | a registered fedhead.Aggregator
    center: bool | None = None  # subtract the federated mean feature (one extra exchange in round 1)
    scale: str | None = None  # none | rms: divide by the federated RMS feature norm
    participation: float = 1.0  # fraction of clients per round, sampled by (seed, round)
    noise: str = "none"  # none | symmetric | asymmetric (per client, test labels clean)
    noise_rate: float = 0.0  # flip rate r in [0, 1)
    asym_rule: str = "auto"  # auto (dataset's map) | cyclic (y -> y+1 mod C)
    noise_dataset: str | None = None  # dataset name for the asymmetric map (default: the store's)
    seeds: list = field(default_factory=lambda: [0])  # each seed runs separately; mean +- std reported
    iid_reference: bool = False  # also run IID with everything else equal -> ratio_to_iid
    backend: str = "vectorized"  # vectorized | loop (per-client torch.optim, for checking)
    block_clients: int | None = None  # clients trained at once (default: from a memory budget)
    memory_budget_mb: float = 1536.0  # budget for the client-stacked tensors of one block
    device: str = "auto"  # auto | cpu | cuda
    eval_every: int = 1  # evaluate the global head every n rounds (and the last)
    # -- closed-form start, classic baselines, the ceiling (README "Baselines"; SPEC section 8)
    init: str | None = None  # ncm | ridge | cof | lda: round 1 exchanges statistics, solves the head
    init_scale: float | None = None  # temperature the solved head is multiplied by [measured, per head]
    central_reference: bool = False  # also train the head centrally on the pooled data -> ratio_to_central
    prox_mu: float = 0.0  # FedProx proximal term mu (0 = FedAvg)
    scaffold: bool = False  # SCAFFOLD control variates (option II)
    server_opt: str = "fedavg"  # fedavg | fedavgm | fedadam | fedyogi | fedadagrad
    server_lr: float | None = None  # server learning rate [Flower's default for server_opt]
    server_momentum: float | None = None  # fedavgm momentum [Flower's default]
    server_betas: tuple | None = None  # fedadam / fedyogi (beta1, beta2) [Flower's defaults]
    server_tau: float | None = None  # adaptivity tau [Flower's default]
    calibrate: str = "none"  # none | ccvr: calibrate the head on virtual features after the last round
    ccvr_samples: int = 200  # ccvr: virtual features per class
    # -- differential privacy (README "Differential privacy"; fedhead.core.dp): on when dp_noise_multiplier is given
    dp_noise_multiplier: float | None = None  # z: Gaussian noise std = z x the L2 sensitivity (0: clipping only)
    dp_clip: float | None = None  # S: client update L2 clip (iterative head, DP-FedAvg) or per-sample
    # feature-norm clip (closed-form head)
    dp_delta: float | None = None  # delta of the (epsilon, delta) the accountant reports
    dp_feature_clip: float | None = None  # iterative head: per-sample feature-norm clip of its statistics
    # (--center / --scale rms sums, --init statistics)
    # -- secure aggregation (Flower only; README "Secure aggregation"; fedhead.flower.secure)
    secure_aggregation: bool = False  # the server learns only sums over clients (Flower's SecAgg+)

    def resolved(self) -> "TrainConfig":
        """A copy with the recipe applied to every field left as None, validated."""
        validate("--recipe", self.recipe, OneOf(tuple(RECIPES)))
        c = dataclasses.replace(
            self,
            seeds=[int(s) for s in self.seeds],
            partition_params=dict(self.partition_params),
            head_params=dict(self.head_params),
        )
        if self.local_epochs is not None and self.local_steps is not None:
            raise FedheadError(
                f"The '--local-steps' parameter ({self.local_steps}) and '--local-epochs' "
                f"({self.local_epochs}) both set the local work of a round. Give one of them."
            )
        for k, v in RECIPES[self.recipe].items():
            if getattr(c, k) is None and not (k == "local_steps" and self.local_epochs is not None):
                setattr(c, k, v)
        if c.local_epochs is None:
            c.local_epochs = LOCAL_EPOCHS
        validate("--clients", c.clients, Interval(1, None, integer=True))
        validate("--rounds", c.rounds, Interval(1, None, integer=True))
        validate("--local-epochs", c.local_epochs, Interval(1, None, integer=True))
        if c.local_steps is not None:
            validate("--local-steps", c.local_steps, Interval(1, None, integer=True))
        validate("--batch-size", c.batch_size, Interval(1, None, integer=True))
        validate("--lr", c.lr, Interval(0, None, closed="neither"))
        validate("--weight-decay", c.weight_decay, Interval(0, None))
        validate("--momentum", c.momentum, Interval(0, 1, closed="left"))
        validate(
            "--participation",
            c.participation,
            Interval(0, 1, closed="right"),
            "Use a fraction of clients per round in (0, 1], e.g. 0.1.",
        )
        validate("--noise-rate", c.noise_rate, Interval(0, 1, closed="left"))

        validate("--aggregate", c.aggregate, OneOf(tuple(aggregator_names())))
        validate("--scale", c.scale, OneOf(("none", "rms")))
        validate("--eval-every", c.eval_every, Interval(1, None, integer=True))
        validate("--prox-mu", c.prox_mu, Interval(0, None))
        validate("--calibrate", c.calibrate, OneOf(("none", "ccvr")))
        validate("--ccvr-samples", c.ccvr_samples, Interval(1, None, integer=True))
        validate("--backend", c.backend, OneOf(BACKENDS))
        if c.block_clients is not None:
            validate(
                "--block-clients",
                c.block_clients,
                Interval(1, None, integer=True),
                "Leave it out to size the blocks from --memory-budget-mb.",
            )
        if c.init_scale is not None:
            validate("--init-scale", c.init_scale, Interval(0, None, closed="neither"))
        if c.server_betas is not None:
            c.server_betas = tuple(float(b) for b in c.server_betas)
        if not c.seeds:
            raise FedheadError("The '--seed' parameter needs at least one value. Got [] instead.")
        for s in c.seeds:
            validate("--seed", s, Interval(0, None, integer=True))
        if c.noise != "none" and c.noise_rate == 0:
            raise FedheadError(f"The '--noise-rate' parameter must be > 0 with --noise {c.noise}. Got 0.0 instead.")

        validate_dp(c)  # DP options, and the rule: DP-FedAvg replaces fedavg (aggregate = dp-fedavg)
        if c.secure_aggregation:
            m = max(
                1, int(round(c.participation * c.clients))
            )  # clients per round (fedhead.federation.train.sample_clients)
            if m < SECURE_MIN_CLIENTS:
                raise FedheadError(
                    f"The '--secure-aggregation' option needs at least {SECURE_MIN_CLIENTS} clients per "
                    f"round (SecAgg+ hides a client only among others: with 2, each could read the "
                    f"other's update off the new head). Got --clients {c.clients} with --participation "
                    f"{c.participation:g} ({m} per round) instead. Raise --clients or --participation, "
                    "or drop --secure-aggregation."
                )
        return c

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def identity(self) -> str:
        """Hash of everything that determines the results (for --resume checks)."""
        d = self.to_dict()
        for k in ("device", "block_clients", "memory_budget_mb"):
            d.pop(k, None)
        if not d.get("secure_aggregation"):
            d.pop("secure_aggregation", None)  # runs from before the option keep their identity
        for k in ("dp_noise_multiplier", "dp_clip", "dp_delta", "dp_feature_clip"):
            if d.get(k) is None:
                d.pop(k, None)  # runs without DP keep the identity they had before it
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
