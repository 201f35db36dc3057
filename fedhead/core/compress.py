"""Compressed client updates for the iterative heads: FedAvg of int8-quantised or top-k-sparsified updates, with
error feedback, as aggregation rules (:class:`fedhead.core.aggregate.Aggregator`).

Definitions (client ``k``, round ``t``, global head ``theta [C, D+1]``, trained head ``W_k``):

- update ``delta_k = W_k - theta``; with error feedback ``u_k = delta_k + e_k`` (``e_k`` the client's residual,
  zero at the start), without it ``u_k = delta_k``;
- compressed ``q_k = Q(u_k)``; with error feedback the client keeps ``e_k <- u_k - q_k`` for its next round (what
  compression dropped is sent later: Seide et al. 2014, Stich et al. 2018, Karimireddy et al. 2019);
- the server averages the ``q_k`` as FedAvg averages the updates: ``theta + sum_k n_k q_k / sum_k n_k``.

``Q`` and the bytes a client uploads (its wire form, what a Flower node sends; :meth:`CompressedFedAvg.nbytes`):

- ``fedavg-int8``: per row (class) ``c`` a symmetric scale ``s_c = max_j |u_cj| / 127`` and codes
  ``round(u_cj / s_c)`` in [-127, 127] (round half to even, deterministic; a zero row has scale 0 and codes 0), so
  ``|u - q| <= s_c / 2`` per entry. Bytes: ``C (D+1)`` int8 codes + ``C`` float32 scales.
- ``fedavg-topk``: the ``k = ceil(f C (D+1))`` entries of largest ``|u|`` over the whole ``[C, D+1]`` update
  (``--topk-fraction f``, default 0.01), ties broken towards the lower flat index (deterministic). Bytes: ``k``
  float32 values + ``k`` int32 indices into the flattened head (int32: ``C (D+1)`` exceeds 2^16 at the heads fedhead
  trains, e.g. 1,203 x 1,281).

The client's weight ``n_k`` is folded into the wire form (the int8 scales, the top-k values), so the server sums
the decoded messages exactly as it sums FedAvg's ``n_k W_k``: the simulator and Flower add the same numbers.

Per-client state: the residuals live in a :class:`Residuals` the rule holds (``rule.residuals``): every client's
in process (kept by the run's checkpoint), a node's own on Flower (``Context.state`` and its state folder), so a
message is a function of the client's own data and residual only. ``--no-error-feedback`` compresses ``delta_k``
alone and keeps no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedhead.core.aggregate import AGGREGATORS, Aggregator, register_aggregator
from fedhead.core.heads import HEADS
from fedhead.infra.errors import FedheadError
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

INT8_MAX = 127
DEFAULT_TOPK_FRACTION = 0.01
COMPRESSED = ("fedavg-int8", "fedavg-topk")  # the built-in compressing rules (--error-feedback applies to them)


# ---------------------------------------------------------------- the compressors (pure functions)


def int8_quantize(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``u [K, C, D+1]`` -> int8 codes ``[K, C, D+1]`` and per-row scales ``[K, C]`` (``u``'s dtype): ``s = max|u| /
    127`` per row, ``codes = round(u / s)`` clipped to [-127, 127]; a zero row gets scale 0 and codes 0."""
    scale = u.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(u / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def int8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The dense ``[K, C, D+1]`` of :func:`int8_quantize`'s output: ``codes * s``."""
    return codes.to(scale.dtype) * scale.unsqueeze(-1)


def topk_count(fraction: float, numel: int) -> int:
    """``k = ceil(fraction * numel)``, at least 1 and at most ``numel`` (the product rounded to 9 digits first, so
    0.07 x 100 is 7, not 8)."""
    return max(1, min(numel, math.ceil(round(fraction * numel, 9))))


def topk_sparsify(u: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``u [K, C, D+1]`` -> per client the values ``[K, k]`` and flat indices ``[K, k]`` (int32, ascending) of the
    ``k`` entries of largest ``|u|``; among entries equal to the k-th largest, the lower indices are kept."""
    K = u.shape[0]
    flat = u.reshape(K, -1)
    a = flat.abs()
    kth = torch.topk(a, k, dim=1, sorted=False).values.amin(1, keepdim=True)
    greater = a > kth
    equal = a == kth
    need = k - greater.sum(1, keepdim=True)
    take = greater | (equal & (equal.cumsum(1) <= need))
    idx = take.nonzero()[:, 1].view(K, k)  # row-major: each row's indices ascending
    return flat.gather(1, idx), idx.to(torch.int32)


def topk_densify(values: torch.Tensor, index: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The dense ``[K, *shape]`` of :func:`topk_sparsify`'s output (zeros elsewhere)."""
    K = values.shape[0]
    out = torch.zeros(K, math.prod(shape), device=values.device, dtype=values.dtype)
    return out.scatter_(1, index.long(), values).view(K, *shape)


# ---------------------------------------------------------------- per-client state


@dataclass(eq=False)
class Residuals:
    """Error feedback's residuals ``e_k``: ``e [M, C, D+1]`` for the clients ``held`` (sorted ids; None: all the
    federation's clients, row k = client k). The in-process transport holds every client's, a Flower node its own
    (:meth:`held_by`)."""

    e: torch.Tensor
    held: torch.Tensor | None = None

    @classmethod
    def zeros(cls, num_clients: int, C: int, D1: int, device, dtype=None) -> "Residuals":
        return cls(torch.zeros(num_clients, C, D1, device=device, dtype=torch.float32 if dtype is None else dtype))

    @classmethod
    def held_by(cls, ids, e: torch.Tensor) -> "Residuals":
        """The residuals ``e [len(ids), C, D+1]`` of the clients ``ids`` only (a Flower node: ``ids = [k]``)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if tuple(e.shape[:1]) != (len(ids),) or len(np.unique(ids)) != len(ids):
            raise FedheadError(
                f"The 'ids' parameter of Residuals.held_by must list distinct clients, one per row of e. Got ids "
                f"{ids.tolist()} for e of shape {tuple(e.shape)} instead."
            )
        order = np.argsort(ids, kind="stable")
        e = e.index_select(0, torch.as_tensor(order, device=e.device))
        return cls(e, torch.as_tensor(ids[order], device=e.device))

    def rows(self, ids) -> torch.Tensor:
        """The rows of :attr:`e` that hold the clients ``ids`` (refused in one line for a client not held)."""
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1), device=self.e.device)
        if self.held is None:
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.e.shape[0]):
                raise FedheadError(
                    f"The residuals hold clients 0..{self.e.shape[0] - 1}, not {ids.tolist()}. Build them with "
                    "Residuals.zeros(num_clients, C, D+1, device) for this federation."
                )
            return ids
        pos = torch.searchsorted(self.held, ids).clamp_(max=max(len(self.held) - 1, 0))
        if len(self.held) == 0 or not torch.equal(self.held[pos], ids):
            missing = sorted(set(ids.tolist()) - set(self.held.tolist()))
            raise FedheadError(
                f"The residuals hold clients {self.held.tolist()}, not client(s) {missing}. Build them with "
                "Residuals.held_by(ids, e) for the clients that send."
            )
        return pos

    def state_dict(self) -> dict:
        return {"e": self.e.detach().cpu().clone()}

    def load_state_dict(self, d: dict) -> None:
        got = d["e"]
        if tuple(got.shape) != tuple(self.e.shape):
            raise FedheadError(
                f"The checkpoint's error-feedback residuals have shape {tuple(got.shape)}, but this run needs "
                f"{tuple(self.e.shape)}. Resume with the same --clients, features and head, or start a fresh --out "
                "directory."
            )
        self.e.copy_(got)


# ---------------------------------------------------------------- the rules


def keeps_residuals(cfg) -> bool:
    """Whether the run ``cfg`` (a resolved TrainConfig) keeps error-feedback residuals per client: a compressing
    rule with error feedback on."""
    head = HEADS.get(cfg.head)
    if head is None or getattr(head.cls, "closed_form", False) or cfg.aggregate not in AGGREGATORS:
        return False
    cls = AGGREGATORS[cfg.aggregate]
    return issubclass(cls, CompressedFedAvg) and getattr(cfg, "error_feedback", None) is not False


class CompressedFedAvg(Aggregator):
    """FedAvg of compressed updates with optional error feedback (the module docstring); subclasses say how an
    update is compressed (:meth:`compress`), weighted (:meth:`weigh`) and expanded back (:meth:`expand`)."""

    client_state = True
    key = "weighted"  # the dense message: sum_k n_k q_k

    def __init__(self, error_feedback: bool = True, residuals: Residuals | None = None):
        self.error_feedback = bool(error_feedback)
        self.residuals = residuals  # error feedback: the clients' e_k this rule's messages read and update

    def compress(self, u: torch.Tensor) -> dict:
        """The compact form of the updates ``u [K, C, D+1]`` (``{name: [K, ...]}``), unweighted."""
        raise NotImplementedError

    def weigh(self, compact: dict, w: torch.Tensor) -> dict:
        """``compact`` with each client's decoded update multiplied by ``w [K]``."""
        raise NotImplementedError

    def expand(self, compact: dict, shape: tuple) -> torch.Tensor:
        """The dense ``[K, *shape]`` of ``compact``."""
        raise NotImplementedError

    def wire(self, theta, trained, sizes, holds, ids=None) -> dict:
        u = trained - theta.to(trained.dtype)
        if not bool(torch.isfinite(u).all()):
            raise FedheadError(
                f"The aggregator {self.name!r} got a client update that is not finite (inf or nan). Lower --lr, or "
                "check the features for inf/nan."
            )
        rows = None
        if self.error_feedback:
            if self.residuals is None or ids is None:
                raise FedheadError(
                    f"The aggregator {self.name!r} keeps error-feedback residuals per client, but it was given no "
                    f"{'client ids' if ids is None else 'Residuals'}. Pass ids= and set rule.residuals (the engine "
                    "and the Flower client do), or build it with error_feedback=False (--no-error-feedback)."
                )
            rows = self.residuals.rows(ids)
            u = u + self.residuals.e.index_select(0, rows).to(u.dtype)
        compact = self.compress(u)
        if rows is not None:  # e_k <- u_k - q_k
            self.residuals.e.index_copy_(0, rows, (u - self.expand(compact, u.shape[1:])).to(self.residuals.e.dtype))
        return self.weigh(compact, sizes.to(device=u.device, dtype=u.dtype))

    def unwire(self, sent: dict, theta: torch.Tensor) -> dict:
        return {self.key: self.expand(sent, tuple(theta.shape))}

    def message(self, theta, trained, sizes, holds, ids=None):
        return self.unwire(self.wire(theta, trained, sizes, holds, ids), theta)

    def update(self, previous, totals):
        return (previous.to(totals.sums[self.key].dtype) + totals.sums[self.key] / totals.n).to(previous.dtype)

    def wire_shapes(self, theta):
        sent = self.weigh(self.compress(torch.zeros_like(theta)[None]), torch.ones(1, device=theta.device))
        return {k: (tuple(v.shape[1:]), np.dtype(str(v.dtype).replace("torch.", ""))) for k, v in sent.items()}

    def nbytes(self, theta):
        """The bytes of one client's wire form (their shapes depend only on the head's)."""
        sent = self.weigh(self.compress(torch.zeros_like(theta)[None]), torch.ones(1, device=theta.device))
        return int(sum(v[0].numel() * v.element_size() for v in sent.values()))


@register_aggregator("fedavg-int8")
class Int8FedAvg(CompressedFedAvg):
    name = "fedavg-int8"
    description = "FedAvg of int8-quantised updates (per-row scale), error feedback unless --no-error-feedback"

    @classmethod
    def from_config(cls, cfg):
        return cls(error_feedback=getattr(cfg, "error_feedback", None) is not False)

    def compress(self, u):
        codes, scale = int8_quantize(u)
        return {"codes": codes, "scale": scale}

    def weigh(self, compact, w):
        return {"codes": compact["codes"], "scale": compact["scale"] * w.to(compact["scale"].dtype).view(-1, 1)}

    def expand(self, compact, shape):
        return int8_dequantize(compact["codes"], compact["scale"])


@register_aggregator("fedavg-topk")
class TopKFedAvg(CompressedFedAvg):
    name = "fedavg-topk"
    description = "FedAvg of top-k sparsified updates (--topk-fraction), error feedback unless --no-error-feedback"

    def __init__(self, fraction: float | None = None, error_feedback: bool = True, residuals: Residuals | None = None):
        super().__init__(error_feedback, residuals)
        self.fraction = DEFAULT_TOPK_FRACTION if fraction is None else float(fraction)
        if not 0 < self.fraction <= 1:
            raise FedheadError(
                f"The 'fraction' parameter of fedavg-topk must be in (0, 1]. Got {self.fraction!r} instead. Use e.g. "
                "0.01 (--topk-fraction)."
            )

    @classmethod
    def from_config(cls, cfg):
        return cls(getattr(cfg, "topk_fraction", None), getattr(cfg, "error_feedback", None) is not False)

    def compress(self, u):
        values, index = topk_sparsify(u, topk_count(self.fraction, math.prod(u.shape[1:])))
        return {"values": values, "index": index}

    def weigh(self, compact, w):
        return {"values": compact["values"] * w.to(compact["values"].dtype).view(-1, 1), "index": compact["index"]}

    def expand(self, compact, shape):
        return topk_densify(compact["values"], compact["index"], tuple(shape))
