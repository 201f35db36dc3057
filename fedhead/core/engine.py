"""One local-training engine over client-stacked tensors, and a plain per-client loop to check it.

A round trains the selected clients in blocks. Inside a block every tensor is stacked over clients:
head ``W [K, C, D+1]`` (bias folded in as the last column; features carry a trailing 1), optimizer state of
the same shape, and a batch plan ``idx [K, E, S*B]`` with a validity mask for clients whose last batch is
short. Clients are sorted by their number of steps, so the clients still training at step ``t`` are a
prefix ``[:K_t]`` and every update works on views, never on copies. Forward, loss, backward (``dW = G^T X``)
and the optimizer step are each one batched call for the whole block.

Speed (``fedhead bench speed`` measures it). Per step a block costs two batched matmuls (logits and the weight
gradient ``G^T X``), the loss and one optimizer pass over state as large as the heads. The optimizer step is
torch's fused multi-tensor kernel (``torch._fused_adamw_`` / ``torch._fused_sgd_``: one pass over W, G, m, v)
called with one tensor per group of clients that share their step count, with the plain in-place tensor math
as the fallback. Batches are gathered with ``index_select`` into a preallocated buffer, and the heads, the
gradient, the optimizer state and the gather buffer are workspace tensors kept across blocks and rounds
(fresh large allocations page-fault on every round on CPU). On CPU a block is trained in tiles of clients
whose optimizer state fits ``tile_mb`` (each tile runs all its steps before the next starts), which bounds
the state's memory; cache-sized tiles (~16 MB) were measured slower than whole-block tiles at paper scale
(per-step overhead outweighs the cache gain), hence the large default. On CUDA a tile is the whole block. A
head may offer ``loss_and_grad(logits, y, mask, ctx) -> (loss [K], dloss/dlogits [K, B, C])`` in closed
form; the engine uses it when present and autograd on ``loss`` otherwise.

Heads differ only in the loss they hand the engine (:mod:`fedhead.core.heads`). The ``loop`` backend trains one
client after another with ``torch.optim`` and autograd, as research code does; both backends use the same
batch plan, so they give the same global head to float tolerance (tested).

With SGD, a client whose samples are few against the feature dimension trains in the dual form instead
(:mod:`fedhead.core.dual`: its head as ``a theta + U^T X_k``, coefficients on its own rows; ``dual="auto"``):
:meth:`Engine.run_round` splits the round's clients between the two forms and adds both to the same aggregate.

FedProx and SCAFFOLD are keyword options of :meth:`Engine.run_round` (both backends). FedProx adds
``(mu/2) ||W - theta||^2`` (the whole head, bias column included) to each client's objective: the vectorized
backend adds ``mu (W - theta)`` to the gradient before the optimizer step, the loop backend adds the term to the
loss before ``backward``; ``mu = 0`` runs no extra operation (FedAvg bit for bit). SCAFFOLD (option II) adds
``c - c_k`` to the gradient the optimizer sees and keeps the control variates in a :class:`ScaffoldState`
(``N`` heads' worth, outside ``memory_budget_mb``); the vectorized backend gathers ``c - c_k`` per tile, in the
tile's sorted order, into one more tile-sized workspace buffer (also not counted by the budget).

Batch order and the per-sample uniforms (``positive_keep``) come from a generator keyed by
``(seed, round, client, epoch)``, so a client's local training does not depend on who else was sampled or on
the backend, and a Flower client can reproduce it alone.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from fedhead.core.aggregate import Accumulator, Aggregator, FedAvg, Grouped
from fedhead.core.dual import (
    DUAL_MODES,
    DualBatchPlan,
    DualProblem,
    dual_client_bytes,
    dual_pays,
    train_dual,
)
from fedhead.core.heads import Head, LossContext
from fedhead.core.streams import PlanSeeds
from fedhead.infra.devices import flush_denormals, keep_freed_memory
from fedhead.infra.errors import FedheadError, OneOf, validate
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

BACKENDS = ("vectorized", "loop")  # local-training backends of Engine (loop: per client, for checking)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 0.01
    weight_decay: float = 1e-4
    momentum: float = 0.9  # sgd only
    betas: tuple = (0.9, 0.999)  # adamw only
    eps: float = 1e-8  # adamw only

    def __post_init__(self):
        validate("--optimizer", self.name, OneOf(("adamw", "sgd")))

    @property
    def step_size(self) -> float:
        """The step one gradient makes in the long run: ``lr / (1 - momentum)`` for SGD with heavy-ball momentum,
        ``lr`` otherwise. SCAFFOLD's option II divides a client's drift by ``steps * step_size`` to estimate its
        mean gradient; with ``lr`` alone momentum 0.9 overestimates it tenfold (measured: the variates blow up)."""
        return self.lr / (1.0 - self.momentum) if self.name == "sgd" else self.lr


@dataclass
class LocalConfig:
    epochs: int = 3
    batch_size: int = 50
    steps: int | None = None  # fixed local steps per round (every client the same); None: ``epochs`` epochs

    @property
    def plan_epochs(self) -> int:
        """Rows of a client's batch plan: one per epoch, or one row of ``steps`` batches."""
        return 1 if self.steps else self.epochs

    def epochs_drawn(self, sizes) -> int:
        """The most epochs' generators a client of these ``sizes`` draws for its plan (:func:`step_plan` lays
        epochs end to end until its steps are filled)."""
        if not self.steps:
            return self.epochs
        return max((-(-self.steps * min(self.batch_size, int(n)) // int(n)) for n in sizes if n), default=1)


@dataclass
class RoundStats:
    loss_sum: float = 0.0  # sum over clients of their mean step loss
    clients: int = 0
    compute_s: float = 0.0  # wall seconds spent training (all blocks)
    server_s: float = 0.0  # wall seconds spent aggregating
    dual_clients: int = 0  # clients trained in the dual form (fedhead.core.dual); the others in the primal form


@dataclass(eq=False)
class ScaffoldState:
    """SCAFFOLD's control variates (Karimireddy et al. 2020, option II), updated in place by the engine.

    ``c [C, D+1]`` is the server's variate, ``ck [N, C, D+1]`` the clients' (all clients of the federation,
    indexed by client id; zeros at start). Every local step uses the gradient ``g + (c - c_k)`` (after the loss
    gradient and FedProx's term). After client ``k`` trained ``K_k`` local steps (epochs x its number of batches, or ``LocalConfig.steps``)
    with learning rate ``eta``, starting from ``theta`` and ending at ``w_k``:

        c_k+ = c_k - c + (theta - w_k) / (K_k * eta)

    and once all participating clients ``S`` are done the server sets

        c <- c + (|S| / N) * mean_{k in S} (c_k+ - c_k) = c + sum_{k in S} (c_k+ - c_k) / N.

    The client deltas are summed in float64 into ``pending`` by :meth:`client_update` and applied by
    :meth:`server_update` (:meth:`Engine.run_round` does both; a caller of :meth:`Engine.train_block` calls
    :meth:`server_update` after the round's last block). The model itself is aggregated as without SCAFFOLD.

    Bytes: each participating client downloads the head and ``c`` and uploads its head and ``c_k+ - c_k``:
    twice the head's bytes each way (:attr:`nbytes` is the extra each way per client).

    Where the variates live apart (Flower), the same class holds a part of them (:meth:`held_by`): a node holds
    its own ``c_k`` (one row) and trains with it in the engine exactly as the simulator does; its delta is its
    :attr:`pending`. The server holds none (zero rows) and ``N``; it adds the deltas it receives with
    :meth:`add_deltas` and runs :meth:`server_update`.
    """

    c: torch.Tensor  # [C, D+1] server control variate
    ck: torch.Tensor  # [M, C, D+1] client control variates held (all N by default: row k = client k)
    pending: torch.Tensor | None = None  # [C, D+1] float64: sum of client deltas not yet applied to c
    held: torch.Tensor | None = None  # [M] sorted ids of the clients in ``ck`` when only some are held; None: all
    total: int | None = None  # N when only some are held (c's update divides by it)

    def __post_init__(self):
        if self.pending is None:
            self.pending = torch.zeros(self.c.shape, device=self.c.device, dtype=torch.float64)

    @classmethod
    def zeros(cls, num_clients: int, C: int, D1: int, device, dtype=None) -> "ScaffoldState":
        dtype = torch.float32 if dtype is None else dtype
        return cls(
            c=torch.zeros(C, D1, device=device, dtype=dtype),
            ck=torch.zeros(num_clients, C, D1, device=device, dtype=dtype),
        )

    @classmethod
    def held_by(
        cls, ids, c: torch.Tensor, ck: torch.Tensor | None = None, num_clients: int | None = None
    ) -> "ScaffoldState":
        """The variates of the clients ``ids`` only: a Flower node holds its own (``ids = [k]``, ``ck [1, C, D+1]``
        from its last round, zeros when None), the Flower server none (``ids = []``) but knows ``num_clients``
        (N) for :meth:`server_update`. ``c`` is the server's variate as received (not copied)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        order = np.argsort(ids, kind="stable")
        if len(np.unique(ids)) != len(ids):
            raise FedheadError(
                f"The 'ids' parameter of ScaffoldState.held_by must list distinct clients. Got "
                f"{ids.tolist()} instead. Give each client once."
            )
        if ck is None:
            ck = torch.zeros((len(ids), *c.shape), device=c.device, dtype=c.dtype)
        elif tuple(ck.shape) != (len(ids), *c.shape):
            raise FedheadError(
                f"The 'ck' parameter of ScaffoldState.held_by must have shape {(len(ids), *c.shape)} "
                f"(one variate per id, shaped like c). Got {tuple(ck.shape)} instead."
            )
        else:
            ck = ck.index_select(0, torch.as_tensor(order, device=ck.device))
        return cls(c=c, ck=ck, held=torch.as_tensor(ids[order], device=c.device), total=num_clients)

    @property
    def num_clients(self) -> int:
        """N, the clients of the federation (:meth:`server_update` divides by it)."""
        if self.total is not None:
            return int(self.total)
        if self.held is not None:
            raise FedheadError(
                "The 'num_clients' parameter of ScaffoldState.held_by is needed to update the "
                "server's c (it divides by N). Got None instead. Give the federation's --clients."
            )
        return self.ck.shape[0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of :attr:`ck` that hold the clients ``ids`` (the ids themselves when all are held)."""
        if self.held is None:
            return ids
        held = self.held.to(ids.device)
        pos = torch.searchsorted(held, ids).clamp_(max=max(len(held) - 1, 0))
        if len(held) == 0 or not torch.equal(held[pos], ids):
            missing = sorted(set(ids.tolist()) - set(held.tolist()))
            raise FedheadError(
                f"The SCAFFOLD state holds the control variates of clients {held.tolist()}, not of "
                f"client(s) {missing}. Build it with ScaffoldState.held_by(ids, c, ck) for the "
                "clients it trains."
            )
        return pos

    @property
    def nbytes(self) -> int:
        """Bytes of one control variate (``c`` down or ``c_k+ - c_k`` up), per client and direction."""
        return self.c.numel() * self.c.element_size()

    def state_dict(self) -> dict:
        return {"c": self.c.detach().cpu().clone(), "ck": self.ck.detach().cpu().clone()}

    def load_state_dict(self, d: dict) -> None:
        for name in ("c", "ck"):
            mine, got = getattr(self, name), d[name]
            if tuple(got.shape) != tuple(mine.shape):
                raise FedheadError(
                    f"The checkpoint's SCAFFOLD variate '{name}' has shape {tuple(got.shape)}, but this "
                    f"run needs {tuple(mine.shape)}. Resume with the same --clients, features and "
                    f"head, or start a fresh --out directory."
                )
            mine.copy_(got)
        self.pending.zero_()

    def correction(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``c - c_k`` for the clients ``ids`` (in that order), ``[len(ids), C, D+1]``."""
        rows = self.rows(ids)
        out = torch.index_select(self.ck, 0, rows, out=out) if out is not None else self.ck.index_select(0, rows)
        return out.neg_().add_(self.c)

    def client_update(
        self, ids: torch.Tensor, theta: torch.Tensor, w: torch.Tensor, steps, lr: float, out: torch.Tensor | None = None
    ) -> None:
        """``c_k <- c_k - c + (theta - w_k) / (steps_k * lr)`` in place for the clients ``ids`` trained to
        ``w [len(ids), C, D+1]``; their deltas ``c_k+ - c_k`` are added to :attr:`pending`. Clients with no step
        keep their variate. ``out``: optional scratch ``[len(ids), C, D+1]``."""
        steps = np.asarray(steps, dtype=np.float64).reshape(-1)
        keep = steps > 0
        if not keep.all():
            if not keep.any():
                return
            sel = torch.as_tensor(np.flatnonzero(keep), device=w.device)
            ids, w, steps, out = ids[sel.to(ids.device)], w.index_select(0, sel), steps[keep], None
        scale = torch.as_tensor(1.0 / (steps * lr), device=w.device).to(w.dtype).view(-1, 1, 1)
        d = torch.sub(theta.to(w.dtype), w, out=out) if out is not None else theta.to(w.dtype) - w
        d.mul_(scale).sub_(self.c)  # c_k+ - c_k = (theta - w_k) / (K_k eta) - c
        self.ck.index_add_(0, self.rows(ids), d.to(self.ck.dtype))
        self.add_deltas(d)

    def add_deltas(self, d: torch.Tensor) -> None:
        """Add clients' deltas ``c_k+ - c_k`` (``[K, C, D+1]``) to :attr:`pending`, summed in float64: what
        :meth:`client_update` does for the clients it updates and a server that receives the deltas calls."""
        self.pending += d.to(self.pending.device).sum(0, dtype=torch.float64)

    def server_update(self) -> None:
        """``c <- c + pending / N`` (N = all clients), then clear ``pending``."""
        self.c += (self.pending / self.num_clients).to(self.c.dtype)
        self.pending.zero_()


# ---------------------------------------------------------------- batch plan


def client_plan(
    part: np.ndarray, seed: int, rnd: int, cid: int, epochs: int, seeds: PlanSeeds | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per-epoch shuffled sample indices ``[E, n]`` and per-sample uniforms ``[E, n]`` for one client; epoch ``e``
    draws from ``np.random.default_rng([seed, rnd, cid, e])`` (``seeds``: the same generators, hashed for a whole
    block of clients at once)."""
    n = len(part)
    idx = np.empty((epochs, n), dtype=np.int64)
    u = np.empty((epochs, n), dtype=np.float32)
    for e in range(epochs):
        rng = np.random.default_rng([seed, rnd, cid, e]) if seeds is None else seeds.rng(cid, e)
        idx[e] = part[rng.permutation(n)]
        u[e] = rng.random(n, dtype=np.float32)
    return idx, u


def step_plan(
    part: np.ndarray, seed: int, rnd: int, cid: int, steps: int, batch: int, seeds: PlanSeeds | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` batches of ``min(batch, n)`` samples for one client, ``[steps, b]`` indices and uniforms: the
    per-epoch shuffles of :func:`client_plan` laid end to end and cut into batches (a batch may span two
    epochs), so every client makes the same number of steps whatever its size."""
    n = len(part)
    b = min(batch, n)
    epochs = -(-steps * b // n)
    idx, u = client_plan(part, seed, rnd, cid, epochs, seeds)
    return idx.reshape(-1)[: steps * b].reshape(steps, b), u.reshape(-1)[: steps * b].reshape(steps, b)


def local_plan(
    part: np.ndarray, seed: int, rnd: int, cid: int, local: LocalConfig, width: int, seeds: PlanSeeds | None = None
):
    """One client's plan in the engine's layout ``[plan_epochs, width]`` (indices, validity mask, uniforms) and
    its number of steps per plan row; step ``t`` of a row uses columns ``t*B : (t+1)*B``."""
    B, n, E = local.batch_size, len(part), local.plan_epochs
    idx = np.zeros((E, width), dtype=np.int64)
    msk = np.zeros((E, width), dtype=np.float32)
    uu = np.zeros((E, width), dtype=np.float32)
    if local.steps:
        pi, pu = step_plan(part, seed, rnd, cid, local.steps, B, seeds)
        b = pi.shape[1]
        cols = (np.arange(local.steps)[:, None] * B + np.arange(b)[None]).reshape(-1)
        idx[0, cols], msk[0, cols], uu[0, cols] = pi.reshape(-1), 1.0, pu.reshape(-1)
        return idx, msk, uu, local.steps
    pi, pu = client_plan(part, seed, rnd, cid, E, seeds)
    idx[:, :n], msk[:, :n], uu[:, :n] = pi, 1.0, pu
    return idx, msk, uu, -(-n // B)


# ---------------------------------------------------------------- stacked optimizers


def _fused_available(name: str, device) -> bool:
    """Whether torch's fused optimizer kernel runs on ``device`` (checked once per device type)."""
    key = (name, torch.device(device).type)
    if key not in _FUSED_OK:
        try:
            w = [torch.zeros(2, device=device)]
            g = [torch.ones(2, device=device)]
            if name == "adamw":
                torch._fused_adamw_(
                    w,
                    g,
                    [torch.zeros(2, device=device)],
                    [torch.zeros(2, device=device)],
                    [],
                    [torch.ones((), device=device)],
                    lr=0.1,
                    beta1=0.9,
                    beta2=0.999,
                    weight_decay=0.0,
                    eps=1e-8,
                    amsgrad=False,
                    maximize=False,
                )
            else:
                torch._fused_sgd_(
                    w,
                    g,
                    [torch.zeros(2, device=device)],
                    weight_decay=0.0,
                    momentum=0.9,
                    lr=0.1,
                    dampening=0.0,
                    nesterov=False,
                    maximize=False,
                    is_first_step=False,
                )
            _FUSED_OK[key] = bool(torch.isfinite(w[0]).all()) and float(w[0][0]) < 0
        except (AttributeError, RuntimeError, NotImplementedError, TypeError):
            _FUSED_OK[key] = False
    return _FUSED_OK[key]


_FUSED_OK: dict = {}


def _groups(ends: list[int], *stacks, contiguous: bool = False) -> dict:
    """For every prefix length ``k`` in ``ends``: per stack, the list of slices the fused kernel updates.

    ``contiguous``: a prefix is one slice ``[:k]``; otherwise one slice per run ``[ends[i-1]:ends[i]]``
    (clients of a run share their step count). A stack of ``None`` stays ``None``."""
    out = {}
    for i, k in enumerate(ends):
        bounds = [(0, k)] if contiguous else list(zip([0] + ends[:i], ends[: i + 1]))
        out[k] = tuple(None if st is None else [st[a:b] if st.dim() > 1 else st[a] for a, b in bounds] for st in stacks)
    return out


class StackedAdamW:
    """torch.optim.AdamW's math on ``[K, ...]`` stacks with a per-client step count, updated in place.

    The state is preallocated for ``shape[0]`` clients; :meth:`bind` points it at the tile being trained,
    :meth:`step` updates the first ``k`` clients (the active prefix). The step counts live in the optimizer
    (one per client, reset by :meth:`bind`), as in torch.optim."""

    def __init__(self, cfg: OptimConfig, shape: tuple, device, dtype=None, fused: bool | None = None):
        dtype = torch.float32 if dtype is None else dtype
        self.cfg = cfg
        self.m = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.count = torch.zeros(shape[0], device=device, dtype=torch.float32)
        self.fused = _fused_available("adamw", device) if fused is None else fused
        self.tmp = None if self.fused else torch.empty(shape, device=device, dtype=dtype)
        self.count64 = torch.zeros(shape[0], device=device, dtype=torch.float64)

    def bind(self, w: torch.Tensor, g: torch.Tensor, runs: list[int] | None = None) -> None:
        """Start fresh state for the clients of ``w [k, ...]`` with gradients written to ``g [k, ...]``.

        ``runs``: end offsets of groups of consecutive clients that always step together (same number of
        steps), so the fused kernel sees one tensor per group instead of one per client."""
        k = w.shape[0]
        self.w, self.g = w, g
        self.m[:k].zero_()
        self.v[:k].zero_()
        self.count[:k].zero_()
        self.count64[:k].zero_()
        if self.fused:
            self.groups = _groups(runs or list(range(1, k + 1)), w, g, self.m[:k], self.v[:k], self.count[:k])

    def step(self, k: int) -> None:
        """One step for the first ``k`` bound clients, from the gradients in ``g[:k]``."""
        c = self.cfg
        b1, b2 = c.betas
        if self.fused:
            ws, gs, ms, vs, cs = self.groups[k]
            self.count[:k].add_(1.0)
            torch._fused_adamw_(
                ws,
                gs,
                ms,
                vs,
                [],
                cs,
                lr=c.lr,
                beta1=b1,
                beta2=b2,
                weight_decay=c.weight_decay,
                eps=c.eps,
                amsgrad=False,
                maximize=False,
            )
            return
        w, g = self.w[:k], self.g[:k]
        m, v, tmp = self.m[:k], self.v[:k], self.tmp[:k]
        steps = self.count64[:k]
        steps.add_(1.0)
        if c.weight_decay:
            w.mul_(1.0 - c.lr * c.weight_decay)
        m.lerp_(g, 1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        shape = (-1,) + (1,) * (v.dim() - 1)
        # bias corrections per client, computed in float64 and applied in the state's dtype
        bc2_sqrt = (1.0 - b2**steps).sqrt().to(v.dtype).view(shape)
        step_size = (c.lr / (1.0 - b1**steps)).to(v.dtype).view(shape)
        torch.sqrt(v, out=tmp)
        tmp.div_(bc2_sqrt).add_(c.eps)
        torch.div(m, tmp, out=tmp)
        tmp.mul_(step_size)
        w.sub_(tmp)


class StackedSGD:
    """torch.optim.SGD (momentum, L2 weight decay, no dampening) on ``[K, ...]`` stacks, in place."""

    def __init__(self, cfg: OptimConfig, shape: tuple, device, dtype=None, fused: bool | None = None):
        dtype = torch.float32 if dtype is None else dtype
        self.cfg = cfg
        self.buf = torch.zeros(shape, device=device, dtype=dtype) if cfg.momentum else None
        self.fused = _fused_available("sgd", device) if fused is None else fused

    def bind(self, w: torch.Tensor, g: torch.Tensor, runs: list[int] | None = None) -> None:
        k = w.shape[0]
        self.w, self.g = w, g
        if self.buf is not None:
            self.buf[:k].zero_()  # zero momentum: the first step's buffer is the gradient, as in torch
        if self.fused:
            # SGD has no step count: every prefix is one tensor
            self.groups = _groups(
                list(range(1, k + 1)), w, g, self.buf[:k] if self.buf is not None else None, contiguous=True
            )

    def step(self, k: int) -> None:
        c = self.cfg
        if self.fused:
            ws, gs, bs = self.groups[k]
            torch._fused_sgd_(
                ws,
                gs,
                bs if bs is not None else [],
                weight_decay=c.weight_decay,
                momentum=c.momentum,
                lr=c.lr,
                dampening=0.0,
                nesterov=False,
                maximize=False,
                is_first_step=False,
            )
            return
        w, g = self.w[:k], self.g[:k]
        if c.weight_decay:
            g.add_(w, alpha=c.weight_decay)
        if self.buf is not None:
            b = self.buf[:k]
            b.mul_(c.momentum).add_(g)
            g = b
        w.sub_(g, alpha=c.lr)


def make_stacked_optimizer(cfg: OptimConfig, shape, device, fused: bool | None = None):
    return (StackedAdamW if cfg.name == "adamw" else StackedSGD)(cfg, shape, device, fused=fused)


def make_torch_optimizer(cfg: OptimConfig, params):
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False
        )
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=False)


# ---------------------------------------------------------------- the engine


@dataclass
class ClientSet:
    """The federation's training data as the engine sees it (all on the training device)."""

    x: torch.Tensor  # [N, D+1] prepared features with a trailing 1
    y: torch.Tensor  # [N] local (possibly noisy) labels
    parts: list[np.ndarray]  # client -> global sample indices
    counts: np.ndarray  # [K, C] local class counts (after noise)
    num_classes: int

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(p) for p in self.parts], dtype=np.int64)


DUAL_PAD = 1.25  # a dual block's largest client at most this many times its smallest (rows padded to the largest)
DEFAULT_TILE_MB = 256.0  # CPU: optimizer state (head, gradient, two moments) of one tile of clients


class Engine:
    """Trains the selected clients of a round and streams them into an aggregator."""

    def __init__(
        self,
        data: ClientSet,
        head: Head,
        optim: OptimConfig,
        local: LocalConfig,
        *,
        backend: str = "vectorized",
        block_clients: int | None = None,
        memory_budget_mb: float = 1536.0,
        tile_clients: int | None = None,
        tile_mb: float = DEFAULT_TILE_MB,
        fused: bool | None = None,
        closed_form: bool = True,
        dual: str = "auto",
    ):
        validate("--backend", backend, OneOf(BACKENDS))
        validate("--dual", dual, OneOf(DUAL_MODES))
        self.dual = dual
        self.memory_budget_mb = memory_budget_mb
        self.data, self.head, self.optim, self.local, self.backend = data, head, optim, local, backend
        self.device = data.x.device
        C, D1 = data.num_classes, data.x.shape[1]
        state = C * D1 * 4  # one client's head in bytes
        B, E = local.batch_size, local.plan_epochs
        steps = local.steps or int(max((-(-len(p) // B) for p in data.parts), default=1))
        plan = E * steps * B * (8 + 4 + 4)  # idx, mask, uniforms
        if self.device.type == "cpu":
            # the block holds the trained heads (and their reordered copy); the optimizer state is per tile
            self.tile_clients = tile_clients or max(1, int(tile_mb * 2**20 // (4 * state)))
            per_client = 2 * state + plan
            fixed = self.tile_clients * (4 * state + B * D1 * 4 + 4 * B * C * 4)
        else:
            # one tile = the whole block: heads, copy, gradient, two moments
            self.tile_clients = tile_clients
            per_client = 5 * state + plan + B * D1 * 4 + 4 * B * C * 4
            fixed = 0
        auto = max(1, int((memory_budget_mb * 2**20 - fixed) // per_client))
        self.block_clients = block_clients or auto
        self.block_clients_given = block_clients
        self.fused = fused  # None: torch's fused kernel where it runs
        self.closed_form = closed_form and callable(getattr(head, "loss_and_grad", None))
        self._work: dict = {}  # workspace reused across blocks and rounds

    # -- public --------------------------------------------------------------------------------------

    def run_round(
        self,
        theta: torch.Tensor,
        selected: np.ndarray,
        seed: int,
        rnd: int,
        aggregator: str | Aggregator,
        *,
        prox_mu: float = 0.0,
        scaffold: ScaffoldState | None = None,
    ) -> tuple[torch.Tensor, RoundStats]:
        """Local training of ``selected`` clients from ``theta [C, D+1]``; returns the aggregate and stats.

        ``prox_mu``: FedProx's ``mu`` (0: plain local training, no extra operation). ``scaffold``: SCAFFOLD's
        control variates, used by every local step and updated in place (the clients' ``c_k`` of the trained
        clients, then the server's ``c``); the head is aggregated by ``aggregator`` as without it. Clients with
        no sample do not train and count as not participating. The aggregator gets each block's client ids, so a rule
        with per-client state (error feedback's residuals, :mod:`fedhead.core.compress`) updates the right clients'."""
        self._check_scaffold(theta, scaffold)
        if self.device.type == "cpu":
            flush_denormals()  # a decaying optimizer state must not fall into slow subnormal arithmetic
            keep_freed_memory()  # a step's large tensors reuse the last step's memory (no page faults)
        acc = Accumulator(aggregator, theta, seed=seed, rnd=rnd, sampled=len(selected))
        stats = RoundStats()
        active = [int(k) for k in selected if len(self.data.parts[k]) > 0]
        dual = set(self.dual_clients(active))
        for block in self.dual_blocks([k for k in active if k in dual], scaffold is not None):
            self._dual_block(theta, block, seed, rnd, prox_mu, scaffold, acc, stats)
        active = [k for k in active if k not in dual]
        for b in range(0, len(active), self.block_clients):
            block = active[b : b + self.block_clients]
            t0 = time.perf_counter()
            w, sizes, holds, losses = self._block(theta, block, seed, rnd, True, prox_mu, scaffold)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            stats.compute_s += t1 - t0
            acc.add(w, sizes, holds, ids=block)
            stats.server_s += time.perf_counter() - t1
            stats.loss_sum += float(losses.sum())
            stats.clients += len(block)
        if stats.clients == 0:
            return theta.clone(), stats
        t1 = time.perf_counter()
        out = acc.finish()
        if scaffold is not None:
            scaffold.server_update()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stats.server_s += time.perf_counter() - t1
        return out, stats

    def train_block(
        self,
        theta: torch.Tensor,
        block: list[int],
        seed: int,
        rnd: int,
        *,
        prox_mu: float = 0.0,
        scaffold: ScaffoldState | None = None,
    ):
        """Return the locally trained heads ``[K, C, D+1]`` (block order), sizes, holds and mean losses.

        ``prox_mu`` and ``scaffold`` as in :meth:`run_round`, except that the server's ``c`` is left alone: the
        clients' ``c_k`` are updated in place and their deltas wait in ``scaffold.pending`` until the caller
        runs ``scaffold.server_update()`` after the round's last block."""
        self._check_scaffold(theta, scaffold)
        if self.device.type == "cpu":
            flush_denormals()
            keep_freed_memory()
        return self._block(theta, block, seed, rnd, False, prox_mu, scaffold)

    def dual_clients(self, clients) -> list[int]:
        """The clients of ``clients`` that train in the dual form (:mod:`fedhead.core.dual`): with the vectorized
        backend and SGD, all (``dual="on"``), none (``"off"``) or those it pays for (``"auto"``: ``2 n_k <= D+1``,
        :func:`fedhead.core.dual.dual_pays`). AdamW is not closed under the dual form: always primal."""
        if self.backend != "vectorized" or self.optim.name != "sgd" or self.dual == "off":
            return []
        sizes = [len(self.data.parts[k]) for k in clients]
        if self.dual == "on":
            return [k for k, n in zip(clients, sizes) if n > 0]
        d1 = self.data.x.shape[1]
        return [k for k, n in zip(clients, sizes) if dual_pays(n, d1)]

    def dual_blocks(self, clients, scaffold: bool = False) -> list[list[int]]:
        """Blocks of dual clients, smallest first, each padded to its largest client within ``memory_budget_mb``
        (``block_clients``, when given, caps a block's clients)."""
        if not clients:
            return []
        C, d1, B, E = self.data.num_classes, self.data.x.shape[1], self.local.batch_size, self.local.plan_epochs
        sizes = np.array([len(self.data.parts[k]) for k in clients])
        budget = self.memory_budget_mb * 2**20
        blocks, cur, first = [], [], 0
        for j in np.argsort(sizes, kind="stable"):
            n = int(sizes[j])
            cols = E * (self.local.steps or -(-n // B)) * B
            per = dual_client_bytes(n, d1, C, cols, scaffold)
            full = (len(cur) + 1) * per > budget or len(cur) == (self.block_clients_given or len(clients))
            if cur and (full or n > max(8, DUAL_PAD * first)):  # bounded padding: a block's sizes within 1.25x
                blocks.append(cur)
                cur = []
            if not cur:
                first = n
            cur.append(int(clients[j]))
        return blocks + [cur]

    def _dual_plan(self, block, seed, rnd) -> tuple[list[int], DualProblem, DualBatchPlan]:
        """A dual block's clients sorted by steps (longest first), their padded rows and batch plan."""
        dev, B, E, data = self.device, self.local.batch_size, self.local.plan_epochs, self.data
        sizes = np.array([len(data.parts[k]) for k in block])
        steps = np.full(len(block), self.local.steps) if self.local.steps else -(-sizes // B)
        order = np.argsort(-steps, kind="stable")
        K, n, S = len(block), int(sizes.max()), int(steps.max())
        pos = np.zeros((K, E, S * B), dtype=np.int64)
        msk = np.zeros((K, E, S * B), dtype=np.float32)
        uu = np.zeros((K, E, S * B), dtype=np.float32)
        rows = np.zeros((K, n), dtype=np.int64)
        valid = np.zeros((K, n), dtype=bool)
        ids = np.asarray(block, dtype=np.int64)[order]
        seeds = PlanSeeds(seed, rnd, ids, self.local.epochs_drawn(sizes))
        for j, k in enumerate(ids):
            part = data.parts[k]
            m = len(part)
            rows[j, :m], valid[j, :m] = part, True
            if self.local.steps:  # the engine's plan over local positions (a permutation of range(n) either way)
                pos[j], msk[j], uu[j], _ = local_plan(np.arange(m), seed, rnd, int(k), self.local, S * B, seeds)
                continue
            msk[j, :, :m] = 1.0
            for e in range(E):  # client_plan's draws, written in place (the same generator and calls)
                rng = seeds.rng(int(k), e)
                pos[j, e, :m] = rng.permutation(m)
                uu[j, e, :m] = rng.random(m, dtype=np.float32)
        rows_t, valid_t = torch.from_numpy(rows).to(dev), torch.from_numpy(valid).to(dev)
        X = data.x.index_select(0, rows_t.view(-1)).view(K, n, -1).mul_(valid_t[..., None].to(data.x.dtype))
        y = data.y.index_select(0, rows_t.view(-1)).view(K, n)
        counts = torch.as_tensor(data.counts[ids], device=dev, dtype=torch.float32)
        prob = DualProblem(X=X, y=y, present=counts > 0, counts=counts, d=None)
        plan = DualBatchPlan(
            pos=torch.from_numpy(pos).to(dev),
            mask=torch.from_numpy(msk).to(dev, data.x.dtype),  # a closed-form loss's weights in the data's dtype
            u=torch.from_numpy(uu).to(dev),
            steps=[int(v) for v in steps[order]],
            batch=B,
            width=min(B, n),
        )
        return [int(k) for k in ids], prob, plan

    def _dual_block(self, theta, block, seed, rnd, prox_mu, scaffold, acc: Accumulator, stats: RoundStats) -> None:
        """Train one dual block and add it to ``acc``: a size- or holds-weighted sum of the coefficients for
        fedavg and grouped (one product), the primal heads for any other rule and for SCAFFOLD."""
        t0 = time.perf_counter()
        ids, prob, plan = self._dual_plan(block, seed, rnd)
        ids_t = torch.as_tensor(ids, device=self.device)
        if scaffold is not None:
            prob.d = scaffold.correction(ids_t.to(scaffold.ck.device)).to(self.device, prob.X.dtype)
        o = self.optim
        state = train_dual(
            theta, prob, plan, self.head, rnd=rnd, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
            prox_mu=prox_mu, closed_form=self.closed_form,
        )  # fmt: skip
        t1 = time.perf_counter()
        counts = torch.as_tensor(self.data.counts[ids], device=self.device)
        sizes, holds = counts.sum(1), counts > 0
        rule = type(acc.agg)
        if scaffold is None and rule in (FedAvg, Grouped):
            r = holds if rule is Grouped else sizes[:, None].expand_as(holds)
            acc.add_message({"weighted": state.weighted_sum(theta, prob.X, r)[None]}, sizes, holds)
        else:
            w = state.heads(theta, prob.X, prob.d)
            if scaffold is not None:
                steps = np.asarray(plan.steps) * self.local.plan_epochs
                scaffold.client_update(ids_t.to(scaffold.ck.device), theta, w, steps, o.step_size)
            acc.add(w.to(theta.dtype), sizes, holds, ids=ids)
        stats.compute_s += t1 - t0
        stats.server_s += time.perf_counter() - t1
        steps_t = torch.as_tensor(plan.steps, dtype=torch.float64, device=self.device) * self.local.plan_epochs
        stats.loss_sum += float((state.loss_sum / steps_t).sum())
        stats.clients += len(ids)
        stats.dual_clients += len(ids)

    def _check_scaffold(self, theta, scaffold):
        if scaffold is not None and (
            tuple(scaffold.c.shape) != tuple(theta.shape)
            or (scaffold.held is None and scaffold.num_clients < len(self.data.parts))
        ):
            raise FedheadError(
                f"The SCAFFOLD state holds {scaffold.ck.shape[0]} client variates of shape "
                f"{tuple(scaffold.c.shape)}, but the federation has {len(self.data.parts)} clients "
                f"and a head of shape {tuple(theta.shape)}. Build it with ScaffoldState.zeros("
                f"num_clients, C, D+1, device) for this federation."
            )

    def _block(self, theta, block, seed, rnd, reuse: bool, prox_mu: float = 0.0, scaffold=None):
        # reuse: the heads may live in the engine's workspace (valid until the next block; run_round only)
        if self.backend == "vectorized":
            w, losses = self._train_vectorized(theta, block, seed, rnd, reuse, prox_mu, scaffold)
        else:
            w, losses = self._train_loop(theta, block, seed, rnd, prox_mu, scaffold)
        counts = torch.as_tensor(self.data.counts[block], device=self.device)
        sizes = counts.sum(1)
        return w, sizes, counts > 0, losses

    # -- vectorized backend --------------------------------------------------------------------------

    def _buffer(self, name: str, shape: tuple, dtype=None) -> torch.Tensor:
        """A workspace tensor kept across blocks and rounds (fresh large allocations page-fault on CPU); ``dtype``
        None: float32."""
        dtype = torch.float32 if dtype is None else dtype
        n = math.prod(shape)
        buf = self._work.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            self._work[name] = buf = None  # free before allocating the larger one
            buf = self._work[name] = torch.empty(n, device=self.device, dtype=dtype)
        return buf[:n].view(shape)

    def _optimizer(self, T: int, C: int, D1: int):
        opt = self._work.get("opt")
        if opt is None or opt.capacity < T or opt.shape != (C, D1):
            self._work["opt"] = None
            opt = make_stacked_optimizer(self.optim, (T, C, D1), self.device, fused=self.fused)
            opt.capacity, opt.shape = T, (C, D1)
            self._work["opt"] = opt
        return opt

    def _train_vectorized(self, theta, block, seed, rnd, reuse=False, prox_mu=0.0, scaffold=None):
        dev, B, E = self.device, self.local.batch_size, self.local.plan_epochs
        K, (C, D1) = len(block), theta.shape
        sizes = np.array([len(self.data.parts[k]) for k in block])
        steps = np.full(K, self.local.steps) if self.local.steps else -(-sizes // B)
        order = np.argsort(-steps, kind="stable")  # longest first: active clients = prefix
        S = int(steps.max())
        idx = np.zeros((K, E, S * B), dtype=np.int64)
        msk = np.zeros((K, E, S * B), dtype=np.float32)
        uu = np.zeros((K, E, S * B), dtype=np.float32)
        seeds = PlanSeeds(seed, rnd, block, self.local.epochs_drawn(sizes))
        for j, o in enumerate(order):
            k = block[o]
            idx[j], msk[j], uu[j], _ = local_plan(self.data.parts[k], seed, rnd, k, self.local, S * B, seeds)
        # one host->device copy per block; per step only views of these
        idx_t = torch.from_numpy(idx).to(dev)
        msk_t = torch.from_numpy(msk).to(dev)
        u_t = torch.from_numpy(uu).to(dev)
        steps_sorted = steps[order]
        steps_t = torch.as_tensor(steps_sorted, device=dev, dtype=torch.float64)
        counts = torch.as_tensor(self.data.counts[np.asarray(block)[order]], device=dev, dtype=torch.float32)
        present = counts > 0

        T = min(K, self.tile_clients or K)
        w = self._buffer("w", (K, C, D1))
        w.copy_(theta.expand(K, C, D1))  # a real copy per client (expand(1, ...).contiguous() would alias theta)
        grad = self._buffer("grad", (T, C, D1))
        xbuf = self._buffer("x", (T * B, D1), self.data.x.dtype)
        opt = self._optimizer(T, C, D1)
        loss_sum = torch.zeros(K, device=dev, dtype=torch.float64)
        x, y, head = self.data.x, self.data.y, self.head
        mu_theta = theta.to(w.dtype) * prox_mu if prox_mu else None  # FedProx: mu (W - theta) = mu W - mu theta
        if scaffold is not None:
            ids_sorted = torch.as_tensor(np.asarray(block, dtype=np.int64)[order], device=scaffold.ck.device)
            corr = self._buffer("scaffold", (T, C, D1))  # c - c_k of the tile, sorted order
        for j0 in range(0, K, T):  # tiles: all steps of a few clients at a time
            j1 = min(K, j0 + T)
            wt = w[j0:j1]
            st = steps_sorted[j0:j1]
            runs = [i + 1 for i in range(len(st)) if i + 1 == len(st) or st[i + 1] != st[i]]
            opt.bind(wt, grad[: j1 - j0], runs)
            if scaffold is not None:
                ct = scaffold.correction(ids_sorted[j0:j1], out=corr[: j1 - j0])
            active = [int((st > t).sum()) for t in range(int(st.max()))]  # this tile's own step count
            ls = loss_sum[j0:j1]
            for e in range(E):
                for t, k in enumerate(active):
                    sl = slice(t * B, (t + 1) * B)
                    it = idx_t[j0 : j0 + k, e, sl].reshape(-1)
                    xb = torch.index_select(x, 0, it, out=xbuf[: k * B]).view(k, B, D1)  # [k, B, D1]
                    yb = y.index_select(0, it).view(k, B)
                    mk = msk_t[j0 : j0 + k, e, sl]
                    ctx = LossContext(
                        round=rnd, present=present[j0 : j0 + k], counts=counts[j0 : j0 + k], u=u_t[j0 : j0 + k, e, sl]
                    )
                    logits = torch.bmm(xb, wt[:k].transpose(1, 2))
                    if self.closed_form:
                        lk, gl = head.loss_and_grad(logits, yb, mk, ctx)
                    else:
                        logits.requires_grad_(True)
                        with torch.enable_grad():
                            lk = head.loss(logits, yb, mk, ctx)
                            (gl,) = torch.autograd.grad(lk.sum(), logits)
                    torch.bmm(gl.transpose(1, 2), xb, out=grad[:k])
                    if prox_mu:
                        grad[:k].add_(wt[:k], alpha=prox_mu).sub_(mu_theta)
                    if scaffold is not None:
                        grad[:k].add_(ct[:k])
                    ls[:k] += lk.detach()
                    opt.step(k)
            if scaffold is not None:  # c_k+ of the tile (the correction is spent)
                scaffold.client_update(ids_sorted[j0:j1], theta, wt, st * E, self.optim.step_size, out=corr[: j1 - j0])
        inv_t = torch.as_tensor(np.argsort(order), device=dev)
        mean_loss = (loss_sum / (steps_t * E))[inv_t]
        if not reuse:
            return w.index_select(0, inv_t), mean_loss
        if np.array_equal(order, np.arange(K)):
            return w, mean_loss
        return torch.index_select(w, 0, inv_t, out=self._buffer("out", (K, C, D1))), mean_loss

    # -- loop backend --------------------------------------------------------------------------------

    def _train_loop(self, theta, block, seed, rnd, prox_mu=0.0, scaffold=None):
        dev, B, E = self.device, self.local.batch_size, self.local.plan_epochs
        out, losses = [], []
        dt = self.data.x.dtype  # float32 as a run; float64 where a test checks another path against this one
        theta0 = theta.detach().to(dt)
        seeds = PlanSeeds(seed, rnd, block, self.local.epochs_drawn([len(self.data.parts[k]) for k in block]))
        for k in block:
            part = self.data.parts[k]
            width = (self.local.steps or -(-len(part) // B)) * B
            pi, pm, pu, nk = local_plan(part, seed, rnd, k, self.local, width, seeds)
            counts = torch.as_tensor(self.data.counts[k : k + 1], device=dev, dtype=torch.float32)
            wk = torch.nn.Parameter(theta.detach().clone().to(dt))
            opt = make_torch_optimizer(self.optim, [wk])
            if scaffold is not None:
                kid = torch.tensor([k], device=scaffold.ck.device)
                corr = scaffold.correction(kid)[0]  # c - c_k
            total, nsteps = 0.0, 0
            for e in range(E):
                for s in range(0, nk * B, B):
                    valid = pm[e, s : s + B] > 0
                    it = torch.as_tensor(pi[e, s : s + B][valid], device=dev)
                    xb, yb = self.data.x[it], self.data.y[it]
                    ctx = LossContext(
                        round=rnd,
                        present=counts > 0,
                        counts=counts,
                        u=torch.as_tensor(pu[e, s : s + B][valid], device=dev)[None],
                    )
                    with torch.enable_grad():
                        logits = xb @ wk.T
                        loss = self.head.loss(logits[None], yb[None], torch.ones(1, len(it), device=dev), ctx)[0]
                        objective = loss + 0.5 * prox_mu * (wk - theta0).pow(2).sum() if prox_mu else loss
                        opt.zero_grad(set_to_none=True)
                        objective.backward()
                    if scaffold is not None:
                        wk.grad.add_(corr)
                    opt.step()
                    total += float(loss.detach())
                    nsteps += 1
            if scaffold is not None:
                scaffold.client_update(kid, theta0, wk.detach()[None], [nsteps], self.optim.step_size)
            out.append(wk.detach())
            losses.append(total / max(1, nsteps))
        return torch.stack(out), torch.tensor(losses, dtype=torch.float64, device=dev)


def scores(theta: torch.Tensor, x: torch.Tensor, head=None) -> torch.Tensor:
    """Class scores of the rows of ``x`` (with the trailing 1): ``x @ theta^T``, or ``head.logits(theta, x)`` for a
    head that is not linear in ``x`` (``qda``, ``ridge-rf``)."""
    return head.logits(theta, x) if head is not None else x @ theta.T.to(x.dtype)


def evaluate(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, chunk: int = 65536, head=None) -> float:
    """Accuracy of ``argmax`` of :func:`scores` (x carries the trailing 1)."""
    correct = 0
    with torch.no_grad():
        for i in range(0, len(y), chunk):
            pred = scores(theta, x[i : i + chunk], head).argmax(1)
            correct += int((pred == y[i : i + chunk]).sum())
    return correct / max(1, len(y))


def accuracy_and_loss(
    theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, chunk: int = 65536, head=None
) -> tuple[float, float]:
    """Accuracy of ``argmax`` of :func:`scores` and the mean cross-entropy of ``softmax(scores)`` (the same loss for
    every head, so that runs of different heads compare; NaN when the scores are not finite), over the rows of
    ``x`` (with the trailing 1): the validation metrics of a round."""
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(y), chunk):
            s = scores(theta, x[i : i + chunk], head)
            yc = y[i : i + chunk]
            correct += int((s.argmax(1) == yc).sum())
            loss += float(torch.nn.functional.cross_entropy(s.double(), yc, reduction="sum"))
    n = max(1, len(y))
    return correct / n, loss / n
