"""What the round loop asks of the clients, and the answers: a transport runs clients, the loop never does.

The in-process simulator (:mod:`fedhead.federation.inprocess`: the vectorized engine or the loop backend over a
store on this machine) and Flower (:mod:`fedhead.flower.strategy`: messages over a Grid, plain or SecAgg+) are the
two transports. Each answers the same questions for a seed: describe the clients (:meth:`Transport.begin`), sum
the sampled clients' statistics (:meth:`Transport.statistics`), train the sampled clients from a head and return
the rule's aggregate (:meth:`Transport.train_round`), and give CCVR's class statistics (:meth:`Transport.ccvr`).
Per-client state that must survive (SCAFFOLD's ``c_k``, error feedback's residuals ``e_k``) lives with the
transport, in memory or on the nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fedhead.core.compress import Residuals
from fedhead.core.engine import ScaffoldState
from fedhead.federation.clients import FeatureStats
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")


@dataclass
class Census:
    """What the server knows of a seed's clients before round 1: the federated feature statistics, the realised
    label-noise rate and (unless secure aggregation hides them) every client's size and class counts."""

    stats: FeatureStats
    realised_noise: float = 0.0
    sizes: Sequence | None = None  # [K] (a numpy array in process: 10,000 clients' counts are no Python lists)
    counts: Sequence | None = None  # [K, C]


@dataclass
class Exchange:
    """A summed statistics exchange: ``acc`` (a :class:`fedhead.core.closedform.StatsAccumulator`), the clients'
    mean milliseconds, the server's seconds spent on the exchange itself, extra row fields."""

    acc: object
    client_ms: float
    server_s: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass
class RoundResult:
    """A training round's aggregate (None: no client's update arrived, the head stays) and what it cost."""

    aggregate: torch.Tensor | None
    clients: int
    loss_sum: float
    client_ms: float
    server_s: float
    extra: dict = field(default_factory=dict)


@dataclass
class Calibration:
    """CCVR's pooled class statistics (:class:`fedhead.core.ccvr.PooledStats`), their bytes and client seconds."""

    pooled: object
    bytes_up: int
    client_s: float
    extra: dict = field(default_factory=dict)


@dataclass
class PersonalTest:
    """The test side of personalisation: the test split prepared like the training rows (``x`` with the trailing 1,
    ``y``), each client's local test set (:class:`fedhead.core.clientacc.LocalTests`) and the drift set (indices
    into the test split)."""

    x: torch.Tensor
    y: torch.Tensor
    tests: object
    drift: object


class Transport:
    """The interface the loop uses (see the module docstring); the methods below are the defaults."""

    name = ""
    extendable = False  # whether a finished run may continue with more rounds (its clients' state is kept)
    # the asynchronous rules: False, the simulated clock trains the buffered clients by train_round at the flush;
    # True, the transport's own messages run on the real clock (Flower: fedhead.flower.pushpull.PushPull)
    live_async = False
    extra_fields: tuple = ()  # columns of rounds.csv after the common ones

    def begin(self, seed: int, partition: str, partition_params: dict, saved: FeatureStats | None) -> Census:
        """Set up a seed's clients (``saved``: the statistics of a resumed seed, not exchanged again)."""
        raise NotImplementedError

    def scaffold_state(self, shape: tuple, device) -> ScaffoldState:
        """The SCAFFOLD variates the server side holds (``c``, and the clients' ``c_k`` where they live here)."""
        raise NotImplementedError

    def residual_state(self, shape: tuple, device) -> Residuals | None:
        """Error feedback's residuals where this side holds them (in process: every client's); None where the
        clients keep their own (Flower's nodes)."""
        return None

    def statistics(self, selected, solver, seed: int) -> Exchange:
        raise NotImplementedError

    def train_round(self, theta: torch.Tensor, selected, seed: int, rnd: int, server) -> RoundResult:
        raise NotImplementedError

    def ccvr(self, theta: torch.Tensor, seed: int, rnd: int) -> Calibration:
        raise NotImplementedError

    def validate(self, theta: torch.Tensor, scorer=None) -> dict | None:
        """The head's accuracy and loss on the clients' validation parts, pooled (``val_accuracy``, ``val_loss``,
        ``val_samples``); None where this transport has none (``--val-fraction 0``, or Flower, whose nodes do not
        report validation yet). ``scorer``: a head not linear in the features."""
        return None

    def validation_part(self) -> tuple | None:
        """The pooled validation parts ``(x [N, D+1] prepared, labels [N])`` where the server holds them (the
        in-process transport; the open-set quantiles of a model card come from them), else None."""
        return None

    def personalize(self, method, theta: torch.Tensor, scorer, seed: int, rnd: int, test, statistics=None,
                    solver=None, progress=None):  # fmt: skip
        """Every client's personal head by ``method`` (:mod:`fedhead.core.personal`) from the global ``theta``,
        scored on its local test set and the drift set; returns :class:`fedhead.core.personalize.PersonalCounts`.
        ``test``: :class:`PersonalTest`; ``statistics``/``solver``: the global statistics and the closed-form head
        that solved them (``closed-form``)."""
        raise NotImplementedError(f"the {self.name} transport does not personalise")

    def personal_heads(self, method, theta: torch.Tensor, seed: int, rnd: int, clients: list, statistics=None,
                       solver=None, beta=None) -> dict:  # fmt: skip
        """The personal heads of ``clients`` themselves (``{k: head}``, :func:`fedhead.core.personalize.personal_heads`:
        the heads :meth:`personalize` scored, for ``--personal-models``); ``beta``: the closed-form beta each client
        chose (``PersonalCounts.beta``)."""
        raise NotImplementedError(f"the {self.name} transport does not return personal heads")

    def central(self, head, seed: int) -> dict | None:
        """The central ceiling of this seed's training data, where the transport holds it (else None)."""
        return None

    def after_round(self, seed: int, rnd: int, last_round: int, row: dict) -> None:
        """After a round's checkpoint (logging, stop requests)."""

    def unit_state(self) -> dict:
        return {}

    def load_unit_state(self, state: dict) -> None:
        pass

    def run_state(self) -> dict:
        return {}

    def load_run_state(self, state: dict) -> None:
        pass

    def summary_fields(self, rows: list[dict]) -> dict:
        return {}
