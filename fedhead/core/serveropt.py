"""Server-side optimisers applied after aggregation (FedAvgM, FedAdam, FedYogi, FedAdagrad).

Each round the server has the global head before the round, ``x`` (``previous``), and the size-weighted
FedAvg of the client heads, ``a`` (``aggregated``). A server optimiser turns the pair into the new global
head. The rules, their defaults and their quirks follow Flower 1.41's message-API strategies in
``flwr/serverapp/strategy/`` (``fedavgm.py``, ``fedopt.py``, ``fedadam.py``, ``fedyogi.py``,
``fedadagrad.py``); the legacy ``flwr/server/strategy/`` classes use the same update rules but a
different ``tau`` default for FedAdam and FedAdagrad (1e-9 instead of 1e-3). ``t`` counts the server
steps taken so far, starting at 1 (Flower's ``server_round``).

``fedavg``
    ``x_new = a`` (the aggregate itself, not a copy: bit for bit).

``fedavgm`` (defaults ``lr = server_learning_rate = 1.0``, ``momentum = server_momentum = 0.0``)
    Pseudo-gradient with the SGD sign: ``g = x - a``. If ``momentum > 0``: ``u_1 = g`` and
    ``u_t = momentum * u_{t-1} + g`` (no dampening, no Nesterov), then ``g = u_t``.
    ``x_new = x - lr * g``. With ``lr == 1`` and ``momentum == 0`` Flower switches server optimisation off
    and returns the aggregate unchanged; so do we (bit for bit).

FedOpt family: delta with the ascent sign, ``d = a - x``; ``m_0 = v_0 = 0``;
``m_t = beta_1 * m_{t-1} + (1 - beta_1) * d``.

``fedadam`` (defaults ``lr = eta = 0.1``, ``betas = (0.9, 0.99)``, ``tau = 1e-3``)
    ``v_t = beta_2 * v_{t-1} + (1 - beta_2) * d**2``;
    ``eta_t = lr * sqrt(1 - beta_2**(t+1)) / (1 - beta_1**(t+1))``;
    ``x_new = x + eta_t * m_t / (sqrt(v_t) + tau)``.
    Note the exponent ``t + 1`` (Flower uses ``server_round + 1.0`` with ``server_round`` starting at 1),
    one more than Kingma & Ba's ``t``; we reproduce it. ``m_t`` and ``v_t`` themselves are not
    bias-corrected.

``fedyogi`` (defaults ``lr = eta = 0.01``, ``betas = (0.9, 0.99)``, ``tau = 1e-3``)
    ``v_t = v_{t-1} - (1 - beta_2) * d**2 * sign(v_{t-1} - d**2)`` (``sign(0) = 0``);
    ``x_new = x + lr * m_t / (sqrt(v_t) + tau)``; no bias correction.

``fedadagrad`` (defaults ``lr = eta = 0.1``, ``tau = 1e-3``; Flower fixes ``beta_1 = 0`` and has no
``beta_2``, so ``--server-betas`` does not apply)
    ``m_t = d``; ``v_t = v_{t-1} + d**2``; ``x_new = x + lr * m_t / (sqrt(v_t) + tau)``.

Flower's client-side ``eta_l`` is not used by any of these rules (it is only stored), so it has no
counterpart here. A parameter that does not apply to the chosen optimiser (e.g. ``--server-momentum`` with
``fedadam``) is an error rather than silently ignored.

Precision: the state (``u`` / ``m`` / ``v``) and the update arithmetic are float64 (float32 only on
devices without float64, i.e. MPS); the new head is cast back to the head's dtype. The heads are small
(``[C, D+1]``) so this costs nothing, and it keeps ``sqrt(v) + tau`` and the small pseudo-gradients
``a - x`` (a difference of two nearly equal float32 heads, exact in float64) free of extra rounding. Flower
does the same arithmetic in NumPy at the arrays' dtype (float64 for FedAdam's bias-corrected step under
NumPy 2); the results agree to float32 rounding (tested against Flower itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fedhead.core.plugins import class_registrar, load_plugins
from fedhead.infra.errors import FedheadError, Interval, param_error, unknown_name, validate
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

_FLAGS = {"lr": "--server-lr", "momentum": "--server-momentum", "betas": "--server-betas", "tau": "--server-tau"}


class ServerOptimizer:
    """A server optimiser: turns ``(previous global head, aggregate of the client heads)`` into the new global head,
    one round a step, and owns its state (:meth:`state_dict` / :meth:`load_state_dict`, which the round loop's
    checkpoint keeps).

    A subclass declares the parameters it takes among ``lr``, ``momentum``, ``betas`` and ``tau`` (the
    ``--server-*`` options) with their defaults in :attr:`defaults` (a parameter it does not declare is refused),
    allocates its state in :meth:`setup`, and computes a step in :meth:`update` (float64 ``x`` = previous head,
    ``a`` = aggregate; ``self.t`` is the step, from 1). Register it with :func:`register_server_optimizer`;
    ``--server-opt NAME`` then selects it in train, bench and Flower. ``ServerOptimizer(cfg, shape, device)``
    builds the registered class that ``cfg.name`` names."""

    name = ""
    defaults: dict = {}
    state_keys: tuple = ()  # the tensors of its state, by attribute name (None until the first step is fine)

    def __new__(cls, cfg: ServerOptConfig, *args, **kwargs):
        if cls is ServerOptimizer:
            cls = server_optimizer_class(cfg.name)
        return super().__new__(cls)

    def __init__(self, cfg: ServerOptConfig, shape: tuple, device, dtype=None):
        dtype = torch.float32 if dtype is None else dtype
        self.cfg = cfg.resolved()
        self.shape = tuple(shape)
        self.device = torch.device(device)
        self.dtype = dtype
        self.sdtype = _state_dtype(self.device, dtype)
        self.t = 0  # server steps taken (Flower's server_round after the step)
        self.setup()

    def setup(self) -> None:
        """Allocate the state (zeros of ``self.shape`` in ``self.sdtype`` on ``self.device``)."""

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, device=self.device, dtype=self.sdtype)

    @property
    def active(self) -> bool:
        """Whether :meth:`step` changes anything (False: the aggregate passes through, bit for bit)."""
        return True

    def update(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, previous: torch.Tensor, aggregated: torch.Tensor) -> torch.Tensor:
        """``previous`` = global head before the round ``[C, D+1]``; ``aggregated`` = the rule's aggregate.

        Returns the new global head (``aggregated`` itself when the optimiser is inactive)."""
        if tuple(previous.shape) != self.shape or tuple(aggregated.shape) != self.shape:
            raise ValueError(
                f"server optimiser built for shape {self.shape}, got previous "
                f"{tuple(previous.shape)} and aggregated {tuple(aggregated.shape)}"
            )
        self.t += 1
        if not self.active:
            return aggregated
        x = previous.detach().to(self.device, self.sdtype)
        a = aggregated.detach().to(self.device, self.sdtype)
        return self.update(x, a).to(previous.dtype)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """``{"name", "step", and each state tensor that exists}`` as CPU tensors and ints."""
        d: dict = {"name": self.name, "step": int(self.t)}
        for key in self.state_keys:
            val = getattr(self, key)
            if val is not None:
                d[key] = val.detach().to("cpu").clone()
        return d

    def load_state_dict(self, d: dict) -> None:
        name = d.get("name", self.name)
        if name != self.name:
            raise param_error(
                "--server-opt",
                self.name,
                f"must match the checkpoint's ({name!r})",
                f"Resume with --server-opt {name} or start a new run.",
            )
        for key in self.state_keys:
            val = d.get(key)
            if val is None:
                continue
            val = torch.as_tensor(val)
            if tuple(val.shape) != self.shape:
                raise FedheadError(
                    f"The server optimiser checkpoint holds '{key}' of shape {tuple(val.shape)}, "
                    f"but the head has shape {self.shape}. Start a new run for this head."
                )
            setattr(self, key, val.to(self.device, self.sdtype).clone())
        self.t = int(d.get("step", 0))


SERVER_OPTIMIZERS: dict[str, type] = {}


# class decorator: register a ServerOptimizer subclass under a name (--server-opt NAME)
register_server_optimizer = class_registrar(
    SERVER_OPTIMIZERS, ServerOptimizer, "server optimiser", "setup() and update()"
)


def server_optimizer_names() -> list[str]:
    load_plugins()
    return list(SERVER_OPTIMIZERS)


def server_optimizer_class(name: str) -> type:
    if name not in SERVER_OPTIMIZERS:
        load_plugins()  # a user's optimiser registered in FEDHEAD_PLUGINS or a fedhead.methods entry point
    if name not in SERVER_OPTIMIZERS:
        raise unknown_name("--server-opt", name, SERVER_OPTIMIZERS, "server optimiser")
    return SERVER_OPTIMIZERS[name]


# ------------------------------------------------------------ the built-in optimisers (Flower 1.41's rules)
# Flower 1.41 defaults (flwr/serverapp/strategy/*.py, __init__ signatures).
# fedavgm.py:95-96; fedadam.py:102-106; fedyogi.py:102-106; fedadagrad.py:98-100 (beta_1 = 0 at :115).


@register_server_optimizer("fedavg")
class FedAvg(ServerOptimizer):
    """No server optimiser: the aggregate is the new head (bit for bit)."""

    @property
    def active(self) -> bool:
        return False


@register_server_optimizer("fedavgm")
class FedAvgM(ServerOptimizer):
    """FedAvgM (Hsu et al. 2019): server momentum on the aggregate's step, Flower 1.41's rule."""

    defaults = {"lr": 1.0, "momentum": 0.0}
    state_keys = ("momentum",)

    def setup(self) -> None:
        self.momentum = None  # the momentum buffer, created on the first step

    @property
    def active(self) -> bool:
        return self.cfg.lr != 1.0 or self.cfg.momentum != 0.0  # Flower switches it off at lr 1, momentum 0

    def update(self, x, a):
        g = x - a
        if self.cfg.momentum > 0.0:
            self.momentum = g if self.momentum is None else self.cfg.momentum * self.momentum + g
            g = self.momentum
        return x - self.cfg.lr * g


class _FedOpt(ServerOptimizer):
    """FedOpt family: delta with the ascent sign ``d = a - x``; ``m_0 = v_0 = 0``."""

    state_keys = ("m", "v")

    def setup(self) -> None:
        self.m, self.v = self.zeros(), self.zeros()


@register_server_optimizer("fedadam")
class FedAdam(_FedOpt):
    """FedAdam (Reddi et al. 2021): Adam on the server, bias-corrected as Flower 1.41's."""

    defaults = {"lr": 1e-1, "betas": (0.9, 0.99), "tau": 1e-3}

    def update(self, x, a):
        (b1, b2), d = self.cfg.betas, a - x
        self.m = b1 * self.m + (1.0 - b1) * d
        self.v = b2 * self.v + (1.0 - b2) * (d * d)
        step_size = self.cfg.lr * math.sqrt(1.0 - b2 ** (self.t + 1.0)) / (1.0 - b1 ** (self.t + 1.0))
        return x + step_size * self.m / (torch.sqrt(self.v) + self.cfg.tau)


@register_server_optimizer("fedyogi")
class FedYogi(_FedOpt):
    """FedYogi (Reddi et al. 2021): Yogi's additive second-moment update on the server, Flower 1.41's rule."""

    defaults = {"lr": 1e-2, "betas": (0.9, 0.99), "tau": 1e-3}

    def update(self, x, a):
        (b1, b2), d = self.cfg.betas, a - x
        self.m = b1 * self.m + (1.0 - b1) * d
        d2 = d * d
        self.v = self.v - (1.0 - b2) * d2 * torch.sign(self.v - d2)
        return x + self.cfg.lr * self.m / (torch.sqrt(self.v) + self.cfg.tau)


@register_server_optimizer("fedadagrad")
class FedAdagrad(_FedOpt):
    """FedAdagrad (Reddi et al. 2021): Adagrad on the server, Flower 1.41's rule."""

    defaults = {"lr": 1e-1, "tau": 1e-3}

    def update(self, x, a):
        d = a - x
        self.m = d
        self.v = self.v + d * d
        return x + self.cfg.lr * self.m / (torch.sqrt(self.v) + self.cfg.tau)


SERVER_OPTS = tuple(SERVER_OPTIMIZERS)  # the built-in ones
DEFAULTS: dict[str, dict] = {n: dict(SERVER_OPTIMIZERS[n].defaults) for n in SERVER_OPTS}


def _applies_to(field: str) -> str:
    names = [n for n, cls in SERVER_OPTIMIZERS.items() if field in cls.defaults]
    return " or ".join(names)


@dataclass
class ServerOptConfig:
    name: str = "fedavg"
    lr: float | None = None  # server learning rate (eta / server_learning_rate); None = the optimiser's default
    momentum: float | None = None  # fedavgm only; None = Flower's default (0.0)
    betas: tuple | None = None  # (beta_1, beta_2), fedadam / fedyogi only; None = (0.9, 0.99)
    tau: float | None = None  # adaptivity, fedadam / fedyogi / fedadagrad; None = 1e-3

    def resolved(self) -> ServerOptConfig:
        """A copy with the chosen optimiser's defaults filled in, validated.

        Fields that do not apply to the optimiser stay ``None``; setting one is an error.
        """
        if not isinstance(self.name, str) or self.name not in server_optimizer_names():
            raise param_error(
                "--server-opt",
                self.name,
                "must be one of " + ", ".join(repr(n) for n in SERVER_OPTIMIZERS),
                "Pick one of them ('fedavg' means no server optimiser).",
            )
        defaults = SERVER_OPTIMIZERS[self.name].defaults
        out = {}
        for field, flag in _FLAGS.items():
            value = getattr(self, field)
            if field not in defaults:
                if value is not None:
                    raise param_error(
                        flag,
                        value,
                        f"does not apply to --server-opt {self.name!r}",
                        f"Drop {flag} or use --server-opt {_applies_to(field)}.",
                    )
                out[field] = None
                continue
            out[field] = defaults[field] if value is None else value

        if out["lr"] is not None:
            out["lr"] = float(
                validate(
                    "--server-lr",
                    out["lr"],
                    Interval(0, None, closed="neither"),
                    "Use a positive server learning rate, e.g. 0.1.",
                )
            )
        if out["momentum"] is not None:
            out["momentum"] = float(
                validate(
                    "--server-momentum",
                    out["momentum"],
                    Interval(0, 1, closed="left"),
                    "Use a momentum in [0, 1), e.g. 0.9; 0 disables it.",
                )
            )
        if out["betas"] is not None:
            betas = out["betas"]
            if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
                raise param_error(
                    "--server-betas", betas, "must be two numbers beta_1,beta_2", "Use e.g. --server-betas 0.9,0.99."
                )
            for b in betas:
                validate(
                    "--server-betas",
                    b,
                    Interval(0, 1, closed="left"),
                    "Each of beta_1, beta_2 must be in [0, 1), e.g. 0.9,0.99.",
                )
            out["betas"] = (float(betas[0]), float(betas[1]))
        if out["tau"] is not None:
            out["tau"] = float(
                validate(
                    "--server-tau",
                    out["tau"],
                    Interval(0, None, closed="neither"),
                    "Use a small positive value, e.g. 1e-3.",
                )
            )
        return replace(self, **out)


def _state_dtype(device, dtype) -> torch.dtype:
    return dtype if torch.device(device).type == "mps" else torch.float64
