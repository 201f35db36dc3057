"""Aggregation rules, each written once as a protocol object: what a client sends after local training (its
*message*) and what the server makes of the messages' sum (its *update*).

Every rule is a sum over clients: the simulator feeds the engine's client blocks into an :class:`Accumulator`
(each block's messages summed at once), a Flower server adds one client's message at a time
(:meth:`Accumulator.add_message`) -- the same object, the same numbers, in any order. A sum is also what secure
aggregation can compute without seeing one client's message.

- ``fedavg``: size-weighted average of the whole head, ``sum_k n_k W_k / sum_k n_k``; message ``n_k W_k``.
- ``grouped`` (FedOVA style): row ``c`` is the unweighted mean over the clients that trained it (hold class
  ``c`` locally); a row nobody trained keeps its previous value; message ``holds_k * W_k`` (row-wise).

Users add rules with :func:`register_aggregator` (README "Your own head or method"); ``--aggregate NAME`` then
selects one in ``fedhead train``, every bench command and Flower. Besides the message's tensors the server knows
each client's sample count and which classes it holds (both are also sent without any rule: Flower's
``num-examples`` and the ``holds`` flags), summed into :class:`Totals`. The bytes a client uploads per round are
its message's bytes (:meth:`Aggregator.nbytes`): the head's bytes for both built-in rules.

:func:`fedavg` and :func:`grouped` are the same rules as pure functions of the stacked heads (for tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import FedheadError, unknown_name


@dataclass
class Totals:
    """What the server has after a round: the clients' messages summed (float64 on CPU), the sample count
    ``n``, the number of clients holding each class ``holds [C]`` and the number of ``clients``."""

    sums: dict
    n: torch.Tensor
    holds: torch.Tensor
    clients: int


class Aggregator:
    """One aggregation rule (subclass it and override :meth:`message` and :meth:`update`).

    ``message(theta, trained, sizes, holds)`` gets the global head ``theta [C, D+1]`` the clients started from,
    their trained heads ``trained [K, C, D+1]``, sample counts ``sizes [K]`` and class flags ``holds [K, C]``
    (K = 1 on a Flower node) and returns a dict of tensors, each ``[K, ...]``: per-client numbers the server
    only ever sees summed. ``update(previous, totals)`` returns the new global head from :class:`Totals`. A rule
    holds no state across rounds (server-side state is a server optimiser's, ``--server-opt``)."""

    name = ""
    description = ""

    def message(self, theta: torch.Tensor, trained: torch.Tensor, sizes: torch.Tensor,
                holds: torch.Tensor) -> dict:
        raise NotImplementedError

    def update(self, previous: torch.Tensor, totals: Totals) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self, theta: torch.Tensor) -> int:
        """Bytes one client uploads: its message's tensors (a dry run on one client)."""
        msg = self.message(theta, theta[None], torch.ones(1, device=theta.device),
                           torch.ones(1, theta.shape[0], dtype=torch.bool, device=theta.device))
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


AGGREGATORS: dict[str, type] = {"fedavg": FedAvg, "grouped": Grouped}


def register_aggregator(name: str):
    """Class decorator: register an :class:`Aggregator` subclass under ``name`` (``--aggregate NAME``)."""

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, Aggregator)):
            raise FedheadError(f"The aggregator {name!r} must be a subclass of fedhead.Aggregator. Got {cls!r} "
                               "instead. Subclass it and override message() and update().")
        cls.name = name
        AGGREGATORS[name] = cls
        return cls

    return deco


def aggregator_names() -> list[str]:
    from .plugins import load_plugins

    load_plugins()
    return list(AGGREGATORS)


def create_aggregator(name: str) -> Aggregator:
    if name not in AGGREGATORS:
        from .plugins import load_plugins

        load_plugins()
    if name not in AGGREGATORS:
        raise unknown_name("--aggregate", name, AGGREGATORS, "aggregator")
    return AGGREGATORS[name]()


class Accumulator:
    """A round's sums: ``add`` client blocks (simulator) or ``add_message`` one client's message (a server that
    receives messages), then ``finish()``. ``previous`` is the head the clients started from."""

    def __init__(self, kind: str | Aggregator, previous: torch.Tensor):
        self.agg = kind if isinstance(kind, Aggregator) else create_aggregator(kind)
        self.previous = previous
        dev = previous.device
        self.dtype = torch.float64 if dev.type == "cpu" else previous.dtype
        self.sums: dict = {}
        self.n = torch.zeros((), device=dev, dtype=self.dtype)
        self.holds = torch.zeros(previous.shape[0], device=dev, dtype=self.dtype)
        self.clients = 0

    def message(self, trained: torch.Tensor, sizes: torch.Tensor, holds: torch.Tensor) -> dict:
        """The messages of clients that trained ``trained [K, C, D+1]`` (what each of them sends)."""
        return self.agg.message(self.previous, trained, sizes, holds)

    def add(self, stacked: torch.Tensor, sizes: torch.Tensor, holds: torch.Tensor) -> None:
        self.add_message(self.message(stacked, sizes, holds), sizes, holds)

    def add_message(self, msg: dict, sizes: torch.Tensor, holds: torch.Tensor) -> None:
        """Add messages ``{key: [K, ...]}`` of K clients with their sample counts ``[K]`` and holds ``[K, C]``."""
        if self.sums and set(msg) != set(self.sums):
            raise FedheadError(f"The aggregator {self.agg.name!r} sent messages with keys {sorted(msg)} after "
                               f"{sorted(self.sums)}. Its message() must return the same keys for every client.")
        for k, v in msg.items():
            s = v.to(self.previous.device).sum(0, dtype=self.dtype)
            self.sums[k] = s if k not in self.sums else self.sums[k] + s
        self.n += sizes.to(self.previous.device).sum(dtype=self.dtype)
        self.holds += holds.to(self.previous.device).sum(0, dtype=self.dtype)
        self.clients += len(sizes)

    def finish(self) -> torch.Tensor:
        return self.agg.update(self.previous, Totals(self.sums, self.n, self.holds, self.clients))


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
