"""Aggregation rules, each written once as a protocol object: what a client sends after local training (its
*message*) and what the server makes of the messages' sum (its *update*).

Every rule is a sum over clients: the simulator feeds the engine's client blocks into an :class:`Accumulator`
(each block's messages summed at once), a Flower server adds one client's message at a time
(:meth:`Accumulator.add_message`) -- the same object, the same numbers, in any order. A sum is also what secure
aggregation can compute without seeing one client's message.

- ``fedavg``: size-weighted average of the whole head, ``sum_k n_k W_k / sum_k n_k``; message ``n_k W_k``.
- ``grouped`` (FedOVA style): row ``c`` is the unweighted mean over the clients that trained it (hold class
  ``c`` locally); a row nobody trained keeps its previous value; message ``holds_k * W_k`` (row-wise).
- ``dp-fedavg`` (DP-FedAvg, McMahan et al. 2018; what a run uses with ``--dp-noise-multiplier``): message the
  update ``W_k - theta`` clipped to L2 norm ``--dp-clip S``; the server adds ``N(0, (z S)^2 I)`` to the sum, keyed
  by (seed, round), and divides by the number of clients sampled that round (docs/privacy.md).

- ``fedavg-int8`` and ``fedavg-topk`` (:mod:`fedhead.core.compress`): FedAvg of compressed updates, with error
  feedback (per-client residuals kept across rounds); a message is sent as its compact wire form (int8 codes and
  scales; top-k values and indices), and the server decodes it before summing.
- ``median`` and ``trimmed-mean`` (robust to poisoning clients): the coordinate-wise median, or the mean after
  dropping the ``--trim-fraction`` largest and smallest values of each coordinate, of the clients' updates
  ``W_k - theta``, each first clipped on the server to L2 norm ``--norm-bound``; unweighted (a client's sample
  count is its own claim). Not sums (``summable = False``): the accumulator keeps every client's message, so they
  cannot run under SecAgg+ or DP.

Users add rules with :func:`register_aggregator` (docs/extending.md); ``--aggregate NAME`` then
selects one in ``fedhead train``, every bench command and Flower. Besides the message's tensors the server knows
each client's sample count and which classes it holds (both are also sent without any rule: Flower's
``num-examples`` and the ``holds`` flags), summed into :class:`Totals`. The bytes a client uploads per round are
its message's bytes (:meth:`Aggregator.nbytes`): the head's bytes for fedavg, grouped and dp-fedavg, the bytes
of the compact wire form for the compressed rules.

:func:`fedavg` and :func:`grouped` are the same rules as pure functions of the stacked heads (for tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedhead.core.dp import gaussian
from fedhead.core.plugins import class_registrar, load_plugins
from fedhead.infra.devices import available_memory
from fedhead.infra.errors import FedheadError, unknown_name
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")


@dataclass
class Totals:
    """What the server has after a round: the clients' messages summed (float64 on CPU), the sample count
    ``n``, the number of clients holding each class ``holds [C]`` and the number of ``clients`` whose messages
    were added; and what the server knows without any message: the run's ``seed``, the ``round`` and the number
    of clients it ``sampled`` that round (public: fedhead samples by (seed, round); some may send nothing, an
    empty client or a failed node). None where the caller did not say (a rule that needs them refuses)."""

    sums: dict
    n: torch.Tensor
    holds: torch.Tensor
    clients: int
    round: int | None = None
    seed: int | None = None
    sampled: int | None = None
    each: dict | None = None  # a rule that is no sum (summable = False): every client's message, {key: [K, ...]}


class Aggregator:
    """One aggregation rule (subclass it and override :meth:`message` and :meth:`update`).

    ``message(theta, trained, sizes, holds)`` gets the global head ``theta [C, D+1]`` the clients started from,
    their trained heads ``trained [K, C, D+1]``, sample counts ``sizes [K]`` and class flags ``holds [K, C]``
    (K = 1 on a Flower node) and returns a dict of tensors, each ``[K, ...]``: per-client numbers the server
    only ever sees summed (``message`` runs on the clients: it must not depend on the server's state).
    ``update(previous, totals)`` returns the new global head from :class:`Totals`. A rule may keep state across
    rounds on the server: the round loop keeps one instance per seed and checkpoints :meth:`state_dict`.

    A rule whose clients keep state of their own across rounds (error feedback's residuals) sets
    ``client_state = True``: its ``message`` also gets ``ids=`` (the clients' ids, ``[K]``) and reads and updates
    the clients' state it holds (:class:`fedhead.core.compress.Residuals`: every client's in process, a node's own
    on Flower). A rule whose message travels in another form than the dense tensors it sums overrides
    :meth:`wire` (what a client sends) and :meth:`unwire` (the server's dense message from it).

    A rule whose update is no function of the messages' sum (a median) sets ``summable = False``: the accumulator
    then keeps every client's message (:attr:`Totals.each`), and secure aggregation and DP, which only ever
    release a sum, refuse it."""

    name = ""
    description = ""
    client_state = False  # True: message() takes ids= and keeps per-client state (compress.CompressedFedAvg)
    summable = True  # False: update() reads every client's message (Totals.each), not their sum

    @classmethod
    def from_config(cls, cfg) -> "Aggregator":
        """The rule for a run's :class:`fedhead.federation.config.TrainConfig` (a rule with parameters reads them here)."""
        return cls()

    def message(self, theta: torch.Tensor, trained: torch.Tensor, sizes: torch.Tensor, holds: torch.Tensor) -> dict:
        raise NotImplementedError

    def update(self, previous: torch.Tensor, totals: Totals) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The rule's server-side state (tensors, numbers) for the checkpoint; none by default."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (a resumed run)."""

    def wire(
        self, theta: torch.Tensor, trained: torch.Tensor, sizes: torch.Tensor, holds: torch.Tensor, ids=None
    ) -> dict:
        """What the clients send (``{key: [K, ...]}``): the message itself unless a rule encodes it (Flower's node
        sends this; :meth:`unwire` on the server gives back :meth:`message`'s tensors)."""
        if self.client_state:
            return self.message(theta, trained, sizes, holds, ids=ids)
        return self.message(theta, trained, sizes, holds)

    def unwire(self, sent: dict, theta: torch.Tensor) -> dict:
        """The dense message of what :meth:`wire` sent from the head ``theta`` (identity unless a rule encodes its
        message)."""
        return sent

    def wire_shapes(self, theta: torch.Tensor) -> dict:
        """``{key: (shape, numpy dtype)}`` of one client's :meth:`wire` form (a dry run; a Flower server checks each
        reply against it). A rule with per-client state overrides it."""
        msg = self.message(theta, theta[None], torch.ones(1, device=theta.device), _all_held(theta))
        return {k: (tuple(v.shape[1:]), _numpy_dtype(v)) for k, v in msg.items()}

    def nbytes(self, theta: torch.Tensor) -> int:
        """Bytes one client uploads: its message's tensors (a dry run on one client)."""
        msg = self.message(
            theta,
            theta[None],
            torch.ones(1, device=theta.device),
            torch.ones(1, theta.shape[0], dtype=torch.bool, device=theta.device),
        )
        return int(sum(v[0].numel() * v.element_size() for v in msg.values()))


class FedAvg(Aggregator):
    name = "fedavg"
    description = "size-weighted average of the whole head"

    def message(self, theta, trained, sizes, holds):
        return {"weighted": trained * sizes.to(trained.dtype).view(-1, 1, 1)}

    def update(self, previous, totals):
        return (totals.sums["weighted"] / totals.n).to(previous.dtype)


class Grouped(Aggregator):
    name = "grouped"
    description = "per class row, the mean over the clients holding the class (FedOVA)"

    def message(self, theta, trained, sizes, holds):
        return {"weighted": trained * holds.to(trained.dtype).unsqueeze(-1)}

    def update(self, previous, totals):
        out = previous.clone()
        trained = totals.holds > 0
        out[trained] = (totals.sums["weighted"][trained] / totals.holds[trained, None]).to(previous.dtype)
        return out


class DPFedAvg(Aggregator):
    """DP-FedAvg with fixed clipping (McMahan et al. 2018, the rule of Flower's
    ``DifferentialPrivacy{Client,Server}SideFixedClipping``): each client's update ``W_k - theta`` clipped to L2
    norm ``clip`` (its message: clipped on the client, so the server never sees more), the unweighted sum plus
    ``N(0, (noise_multiplier * clip)^2 I)``, divided by the number of clients sampled that round. Noise is drawn
    by :func:`fedhead.core.dp.gaussian` keyed by (seed, round): the simulator, the loop backend and Flower add the same
    noise, and a resumed run the same as an uninterrupted one."""

    name = "dp-fedavg"
    description = "DP-FedAvg: updates clipped to --dp-clip, unweighted sum + Gaussian noise, / clients sampled"

    def __init__(self, clip: float | None = None, noise_multiplier: float | None = None):
        self.clip, self.noise_multiplier = clip, noise_multiplier

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.dp_clip, cfg.dp_noise_multiplier)

    def _check(self):
        if self.clip is None or self.noise_multiplier is None:
            raise FedheadError(
                "The aggregator 'dp-fedavg' needs --dp-clip and --dp-noise-multiplier. Got "
                f"clip={self.clip!r}, noise multiplier={self.noise_multiplier!r} instead. Give both "
                "(and --dp-delta); in Python build it with create_aggregator(name, cfg)."
            )

    def message(self, theta, trained, sizes, holds):
        self._check()
        d = trained - theta
        norm = d.flatten(1).to(torch.float64).norm(dim=1)
        factor = (self.clip / norm.clamp_min(1e-300)).clamp(max=1.0)
        return {"clipped": d * factor.to(d.dtype).view(-1, *([1] * (d.dim() - 1)))}

    def update(self, previous, totals):
        self._check()
        if totals.seed is None or totals.round is None:
            raise FedheadError(
                "The aggregator 'dp-fedavg' draws its noise by (seed, round), but the Totals it got "
                "carry none. Build the Accumulator with seed= and rnd= (as the engine and the Flower "
                "strategy do)."
            )

        m = totals.sampled if totals.sampled is not None else totals.clients
        total = totals.sums["clipped"]
        noise = gaussian(tuple(total.shape), self.noise_multiplier * self.clip, totals.seed, totals.round, "dp-fedavg")
        return (previous + (total + noise.to(device=total.device, dtype=total.dtype)) / max(1, m)).to(previous.dtype)

    def nbytes(self, theta):
        return theta.numel() * theta.element_size()  # the clipped update: one head's bytes


class Robust(Aggregator):
    """The coordinate-wise trimmed mean of the clients' updates ``W_k - theta`` (Yin et al. 2018): per entry, the
    ``floor(trim K)`` largest and smallest of the K values dropped (at most all but the middle one or two), the
    rest averaged; ``trim = None`` (or 0.5) is the coordinate-wise median (the middle value, or the mean of the two
    middle ones). ``norm_bound``: each update is
    first scaled to L2 norm at most this (on the server, so a client cannot skip it). Unweighted: a client's sample
    count is its own claim. One client in K moves no entry beyond the range of the others' once ``trim >= 1/K``."""

    name = "trimmed-mean"
    description = "coordinate-wise trimmed mean of the updates (--trim-fraction), each clipped to --norm-bound"
    summable = False
    default_trim = 0.1

    def __init__(self, trim: float | None = None, norm_bound: float | None = None):
        self.trim = self.default_trim if trim is None else float(trim)
        self.norm_bound = None if norm_bound is None else float(norm_bound)
        if self.trim is not None and not 0 <= self.trim <= 0.5:
            raise FedheadError(
                f"The '--trim-fraction' parameter must be in [0, 0.5]. Got {self.trim!r} instead. Use e.g. 0.1 "
                "(the share of the largest and of the smallest values dropped per entry; 0.5: the median)."
            )
        if self.norm_bound is not None and not (math.isfinite(self.norm_bound) and self.norm_bound > 0):
            raise FedheadError(
                f"The '--norm-bound' parameter must be a positive number. Got {self.norm_bound!r} instead. Use e.g. "
                "the norm of a typical client update (see a FedAvg run), or leave it out."
            )

    @classmethod
    def from_config(cls, cfg):
        return cls(getattr(cfg, "trim_fraction", None), getattr(cfg, "norm_bound", None))

    def message(self, theta, trained, sizes, holds):
        return {"update": trained - theta.to(trained.dtype)}

    def dropped(self, k: int) -> int:
        """Values dropped at each end of an entry's ``k`` values."""
        if self.trim is None:
            return (k - 1) // 2
        return min(int(math.floor(self.trim * k)), (k - 1) // 2)

    def update(self, previous, totals):
        if totals.each is None:
            raise FedheadError(
                f"The aggregator {self.name!r} needs every client's update, but its Totals carry only their sum. "
                "Feed it through an Accumulator (which keeps them for rules with summable = False)."
            )
        u = totals.each["update"]
        k = u.shape[0]
        if k == 0:
            return previous.clone()
        if self.norm_bound is not None:
            norm = u.flatten(1).norm(dim=1)
            u = u * (self.norm_bound / norm.clamp_min(1e-300)).clamp(max=1.0).view(-1, *([1] * (u.dim() - 1)))
        t = self.dropped(k)
        kept = torch.sort(u, dim=0).values[t : k - t]
        return (previous.to(u.dtype) + kept.sum(0) / (k - 2 * t)).to(previous.dtype)


class Median(Robust):
    name = "median"
    description = "coordinate-wise median of the updates, each clipped to --norm-bound"
    default_trim = None

    @classmethod
    def from_config(cls, cfg):
        return cls(None, getattr(cfg, "norm_bound", None))


AGGREGATORS: dict[str, type] = {
    "fedavg": FedAvg,
    "grouped": Grouped,
    "dp-fedavg": DPFedAvg,
    "median": Median,
    "trimmed-mean": Robust,
}


# class decorator: register an Aggregator subclass under a name (--aggregate NAME)
register_aggregator = class_registrar(AGGREGATORS, Aggregator, "aggregator", "message() and update()")


def aggregator_names() -> list[str]:
    load_plugins()
    return list(AGGREGATORS)


def create_aggregator(name: str, cfg=None) -> Aggregator:
    """The rule ``name``; with a run's ``cfg``, built from it (:meth:`Aggregator.from_config`: ``dp-fedavg``
    reads --dp-clip and --dp-noise-multiplier)."""
    if name not in AGGREGATORS:
        load_plugins()
    if name not in AGGREGATORS:
        raise unknown_name("--aggregate", name, AGGREGATORS, "aggregator")
    cls = AGGREGATORS[name]
    return cls() if cfg is None else cls.from_config(cfg)


def aggregator_of(cfg) -> Aggregator:
    """The rule a resolved :class:`fedhead.federation.config.TrainConfig` runs (clients and server alike)."""
    return create_aggregator(cfg.aggregate, cfg)


class Accumulator:
    """A round's sums: ``add`` client blocks (simulator) or ``add_message`` one client's message (a server that
    receives messages), then ``finish()``. ``previous`` is the head the clients started from; ``seed``, ``rnd``
    and ``sampled`` (clients sampled this round) reach the rule in :class:`Totals`."""

    def __init__(
        self,
        kind: str | Aggregator,
        previous: torch.Tensor,
        *,
        seed: int | None = None,
        rnd: int | None = None,
        sampled: int | None = None,
    ):
        self.agg = kind if isinstance(kind, Aggregator) else create_aggregator(kind)
        self.previous = previous
        self.seed, self.rnd, self.sampled = seed, rnd, sampled  # handed to the rule in Totals
        dev = previous.device
        self.dtype = torch.float64 if dev.type == "cpu" else previous.dtype
        self.sums: dict = {}
        self.n = torch.zeros((), device=dev, dtype=self.dtype)
        self.holds = torch.zeros(previous.shape[0], device=dev, dtype=self.dtype)
        self.clients = 0
        self.each: dict | None = None if self.agg.summable else {}  # a rule that is no sum: every client's message

    def message(self, trained: torch.Tensor, sizes: torch.Tensor, holds: torch.Tensor, ids=None) -> dict:
        """The messages of clients that trained ``trained [K, C, D+1]`` (what each of them sends, dense); ``ids``:
        the clients' ids, which a rule with per-client state needs (:attr:`Aggregator.client_state`)."""
        if self.agg.client_state:
            return self.agg.message(self.previous, trained, sizes, holds, ids=ids)
        return self.agg.message(self.previous, trained, sizes, holds)

    def add(self, stacked: torch.Tensor, sizes: torch.Tensor, holds: torch.Tensor, ids=None) -> None:
        """Add the clients ``ids`` that trained ``stacked [K, C, D+1]`` (their messages summed at once)."""
        self.add_message(self.message(stacked, sizes, holds, ids), sizes, holds)

    def add_message(self, msg: dict, sizes: torch.Tensor, holds: torch.Tensor) -> None:
        """Add messages ``{key: [K, ...]}`` of K clients with their sample counts ``[K]`` and holds ``[K, C]``
        (a rule that is no sum keeps them as they are, :attr:`Totals.each`)."""
        kept = self.each if self.each is not None else self.sums
        if kept and set(msg) != set(kept):
            raise FedheadError(
                f"The aggregator {self.agg.name!r} sent messages with keys {sorted(msg)} after "
                f"{sorted(kept)}. Its message() must return the same keys for every client."
            )
        if self.each is not None:
            self._check_memory(msg)
        for k, v in msg.items():
            if self.each is not None:
                self.each.setdefault(k, []).append(v.to(self.previous.device, self.dtype))
                continue
            s = v.to(self.previous.device).sum(0, dtype=self.dtype)
            self.sums[k] = s if k not in self.sums else self.sums[k] + s
        self.n += sizes.to(self.previous.device).sum(dtype=self.dtype)
        self.holds += holds.to(self.previous.device).sum(0, dtype=self.dtype)
        self.clients += len(sizes)

    def _check_memory(self, msg: dict) -> None:
        """Refuse, in one line, a rule that keeps every client's message when the round's cannot fit in memory."""
        if self.each:
            return
        per = sum(v[0].numel() for v in msg.values()) * torch.finfo(self.dtype).bits // 8
        k, free = self.sampled or len(next(iter(msg.values()), [])), available_memory()
        if free is not None and per * k > free:
            raise FedheadError(
                f"The aggregator {self.agg.name!r} keeps every client's message: {k} clients x {per / 1e6:.1f} MB = "
                f"{per * k / 1e9:.1f} GB, but this machine has {free / 1e9:.1f} GB free. Use fewer clients a round "
                "(--participation), or --aggregate fedavg."
            )

    def finish(self) -> torch.Tensor:
        each = None if self.each is None else {k: torch.cat(v) for k, v in self.each.items()}
        return self.agg.update(
            self.previous,
            Totals(
                self.sums,
                self.n,
                self.holds,
                self.clients,
                round=self.rnd,
                seed=self.seed,
                sampled=self.sampled,
                each=each,
            ),  # fmt: skip
        )


def _all_held(theta: torch.Tensor) -> torch.Tensor:
    return torch.ones(1, theta.shape[0], dtype=torch.bool, device=theta.device)


def _numpy_dtype(v: torch.Tensor) -> np.dtype:
    return np.dtype(str(v.dtype).replace("torch.", ""))


def fedavg(stacked: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``stacked [K, C, D]``, ``sizes [K]`` -> ``[C, D]``."""
    w = sizes.to(torch.float64) / sizes.to(torch.float64).sum()
    return torch.einsum("k,kcd->cd", w.to(stacked.dtype), stacked)


def grouped(stacked: torch.Tensor, holds: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``stacked [K, C, D]``, ``holds [K, C]`` bool, ``previous [C, D]`` -> ``[C, D]``."""
    h = holds.to(stacked.dtype)
    num = torch.einsum("kc,kcd->cd", h, stacked)
    den = h.sum(0)
    out = previous.clone()
    trained = den > 0
    out[trained] = num[trained] / den[trained, None]
    return out
