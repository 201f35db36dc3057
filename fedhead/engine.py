"""One local-training engine over client-stacked tensors, and a plain per-client loop to check it.

A round trains the selected clients in blocks. Inside a block every tensor is stacked over clients:
head ``W [K, C, D+1]`` (bias folded in as the last column; features carry a trailing 1), optimizer state of
the same shape, and a batch plan ``idx [K, E, S*B]`` with a validity mask for clients whose last batch is
short. Clients are sorted by their number of steps, so the clients still training at step ``t`` are a
prefix ``[:K_t]`` and every update works on views, never on copies. Forward, loss, backward (``dW = G^T X``)
and the optimizer step are each one batched call for the whole block.

Heads differ only in the loss they hand the engine (:mod:`fedhead.heads`). The ``loop`` backend trains one
client after another with ``torch.optim`` and autograd, as research code does; both backends use the same
batch plan, so they give the same global head to float tolerance (tested).

Batch order and the per-sample uniforms (``positive_keep``) come from a generator keyed by
``(seed, round, client, epoch)``, so a client's local training does not depend on who else was sampled or on
the backend, and a Flower client can reproduce it alone.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from .aggregate import Accumulator
from .errors import FedheadError, OneOf, validate
from .heads import Head, LossContext


@dataclass
class OptimConfig:
    name: str = "adamw"          # adamw | sgd
    lr: float = 0.01
    weight_decay: float = 1e-4
    momentum: float = 0.9        # sgd only
    betas: tuple = (0.9, 0.999)  # adamw only
    eps: float = 1e-8            # adamw only

    def __post_init__(self):
        validate("--optimizer", self.name, OneOf(("adamw", "sgd")))


@dataclass
class LocalConfig:
    epochs: int = 3
    batch_size: int = 50


@dataclass
class RoundStats:
    loss_sum: float = 0.0         # sum over clients of their mean step loss
    clients: int = 0
    compute_s: float = 0.0        # wall seconds spent training (all blocks)
    server_s: float = 0.0         # wall seconds spent aggregating


# ---------------------------------------------------------------- batch plan


def client_plan(part: np.ndarray, seed: int, rnd: int, cid: int, epochs: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-epoch shuffled sample indices ``[E, n]`` and per-sample uniforms ``[E, n]`` for one client."""
    n = len(part)
    idx = np.empty((epochs, n), dtype=np.int64)
    u = np.empty((epochs, n), dtype=np.float32)
    for e in range(epochs):
        rng = np.random.default_rng([seed, rnd, cid, e])
        idx[e] = part[rng.permutation(n)]
        u[e] = rng.random(n, dtype=np.float32)
    return idx, u


# ---------------------------------------------------------------- stacked optimizers


class StackedAdamW:
    """torch.optim.AdamW's math on ``[K, ...]`` stacks with a per-client step count, updated in place."""

    def __init__(self, cfg: OptimConfig, shape: tuple, device, dtype=torch.float32):
        self.cfg = cfg
        self.m = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.tmp = torch.empty(shape, device=device, dtype=dtype)

    def reset(self, k: int) -> None:
        self.m[:k].zero_()
        self.v[:k].zero_()

    def step(self, w: torch.Tensor, g: torch.Tensor, k: int, steps: torch.Tensor) -> None:
        c = self.cfg
        b1, b2 = c.betas
        m, v, tmp = self.m[:k], self.v[:k], self.tmp[:k]
        if c.weight_decay:
            w.mul_(1.0 - c.lr * c.weight_decay)
        m.lerp_(g, 1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        shape = (-1,) + (1,) * (v.dim() - 1)
        # bias corrections per client, computed in float64 and applied in the state's dtype
        bc2_sqrt = (1.0 - b2 ** steps).sqrt().to(v.dtype).view(shape)
        step_size = (c.lr / (1.0 - b1 ** steps)).to(v.dtype).view(shape)
        torch.sqrt(v, out=tmp)
        tmp.div_(bc2_sqrt).add_(c.eps)
        torch.div(m, tmp, out=tmp)
        tmp.mul_(step_size)
        w.sub_(tmp)


class StackedSGD:
    """torch.optim.SGD (momentum, L2 weight decay, no dampening) on ``[K, ...]`` stacks, in place."""

    def __init__(self, cfg: OptimConfig, shape: tuple, device, dtype=torch.float32):
        self.cfg = cfg
        self.buf = torch.zeros(shape, device=device, dtype=dtype) if cfg.momentum else None

    def reset(self, k: int) -> None:
        if self.buf is not None:
            self.buf[:k].zero_()

    def step(self, w: torch.Tensor, g: torch.Tensor, k: int, steps: torch.Tensor) -> None:
        c = self.cfg
        if c.weight_decay:
            g.add_(w, alpha=c.weight_decay)
        if self.buf is not None:
            b = self.buf[:k]
            b.mul_(c.momentum).add_(g)
            g = b
        w.sub_(g, alpha=c.lr)


def make_stacked_optimizer(cfg: OptimConfig, shape, device):
    return (StackedAdamW if cfg.name == "adamw" else StackedSGD)(cfg, shape, device)


def make_torch_optimizer(cfg: OptimConfig, params):
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay, foreach=False)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                           foreach=False)


# ---------------------------------------------------------------- the engine


@dataclass
class ClientSet:
    """The federation's training data as the engine sees it (all on the training device)."""

    x: torch.Tensor                 # [N, D+1] prepared features with a trailing 1
    y: torch.Tensor                 # [N] local (possibly noisy) labels
    parts: list[np.ndarray]         # client -> global sample indices
    counts: np.ndarray              # [K, C] local class counts (after noise)
    num_classes: int

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(p) for p in self.parts], dtype=np.int64)


BACKENDS = ("vectorized", "loop")


class Engine:
    """Trains the selected clients of a round and streams them into an aggregator."""

    def __init__(self, data: ClientSet, head: Head, optim: OptimConfig, local: LocalConfig, *,
                 backend: str = "vectorized", block_clients: int | None = None,
                 memory_budget_mb: float = 1536.0):
        validate("--backend", backend, OneOf(BACKENDS))
        self.data, self.head, self.optim, self.local, self.backend = data, head, optim, local, backend
        self.device = data.x.device
        C, D1 = data.num_classes, data.x.shape[1]
        per_client = (5 * C * D1 + 2 * local.batch_size * D1 + 4 * local.batch_size * C) * 4
        auto = max(1, int(memory_budget_mb * 2**20 // per_client))
        self.block_clients = block_clients or auto

    # -- public --------------------------------------------------------------------------------------

    def run_round(self, theta: torch.Tensor, selected: np.ndarray, seed: int, rnd: int,
                  aggregator: str) -> tuple[torch.Tensor, RoundStats]:
        """Local training of ``selected`` clients from ``theta [C, D+1]``; returns the aggregate and stats."""
        acc = Accumulator(aggregator, tuple(theta.shape), self.device)
        stats = RoundStats()
        active = [int(k) for k in selected if len(self.data.parts[k]) > 0]
        for b in range(0, len(active), self.block_clients):
            block = active[b:b + self.block_clients]
            t0 = time.perf_counter()
            w, sizes, holds, losses = self.train_block(theta, block, seed, rnd)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            stats.compute_s += t1 - t0
            acc.add(w, sizes, holds)
            stats.server_s += time.perf_counter() - t1
            stats.loss_sum += float(losses.sum())
            stats.clients += len(block)
        if stats.clients == 0:
            return theta.clone(), stats
        t1 = time.perf_counter()
        out = acc.finish(theta)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stats.server_s += time.perf_counter() - t1
        return out, stats

    def train_block(self, theta: torch.Tensor, block: list[int], seed: int, rnd: int):
        """Return the locally trained heads ``[K, C, D+1]`` (block order), sizes, holds and mean losses."""
        fn = self._train_vectorized if self.backend == "vectorized" else self._train_loop
        w, losses = fn(theta, block, seed, rnd)
        counts = torch.as_tensor(self.data.counts[block], device=self.device)
        sizes = counts.sum(1)
        return w, sizes, counts > 0, losses

    # -- vectorized backend --------------------------------------------------------------------------

    def _train_vectorized(self, theta, block, seed, rnd):
        dev, B, E = self.device, self.local.batch_size, self.local.epochs
        K, (C, D1) = len(block), theta.shape
        sizes = np.array([len(self.data.parts[k]) for k in block])
        steps = -(-sizes // B)
        order = np.argsort(-steps, kind="stable")              # longest first: active clients = prefix
        S = int(steps.max())
        idx = np.zeros((K, E, S * B), dtype=np.int64)
        msk = np.zeros((K, E, S * B), dtype=np.float32)
        uu = np.zeros((K, E, S * B), dtype=np.float32)
        for j, o in enumerate(order):
            k = block[o]
            n = sizes[o]
            pi, pu = client_plan(self.data.parts[k], seed, rnd, k, E)
            idx[j, :, :n] = pi
            msk[j, :, :n] = 1.0
            uu[j, :, :n] = pu
        idx_t = torch.from_numpy(idx).to(dev)
        msk_t = torch.from_numpy(msk).to(dev)
        u_t = torch.from_numpy(uu).to(dev)
        steps_sorted = steps[order]
        active = [int((steps_sorted > t).sum()) for t in range(S)]
        steps_t = torch.as_tensor(steps_sorted, device=dev, dtype=torch.float64)
        counts = torch.as_tensor(self.data.counts[np.asarray(block)[order]], device=dev, dtype=torch.float32)
        present = counts > 0

        w = torch.empty(K, C, D1, device=dev, dtype=torch.float32)
        w.copy_(theta)                     # a real copy per client (expand() would alias theta when K == 1)
        grad = torch.empty_like(w)
        opt = make_stacked_optimizer(self.optim, (K, C, D1), dev)
        loss_sum = torch.zeros(K, device=dev, dtype=torch.float64)
        x, y = self.data.x, self.data.y
        for e in range(E):
            for t in range(S):
                k = active[t]
                sl = slice(t * B, (t + 1) * B)
                it = idx_t[:k, e, sl]
                xb = x[it]                                      # [k, B, D1]
                yb = y[it]
                logits = torch.bmm(xb, w[:k].transpose(1, 2)).requires_grad_(True)
                ctx = LossContext(round=rnd, present=present[:k], counts=counts[:k], u=u_t[:k, e, sl])
                with torch.enable_grad():
                    lk = self.head.loss(logits, yb, msk_t[:k, e, sl], ctx)
                    (gl,) = torch.autograd.grad(lk.sum(), logits)
                torch.bmm(gl.transpose(1, 2), xb, out=grad[:k])
                loss_sum[:k] += lk.detach()
                opt.step(w[:k], grad[:k], k, e * steps_t[:k] + t + 1)
        inv = np.argsort(order)
        inv_t = torch.as_tensor(inv, device=dev)
        mean_loss = (loss_sum / (steps_t * E))[inv_t]
        return w[inv_t], mean_loss

    # -- loop backend --------------------------------------------------------------------------------

    def _train_loop(self, theta, block, seed, rnd):
        dev, B, E = self.device, self.local.batch_size, self.local.epochs
        out, losses = [], []
        for k in block:
            part = self.data.parts[k]
            n = len(part)
            pi, pu = client_plan(part, seed, rnd, k, E)
            counts = torch.as_tensor(self.data.counts[k:k + 1], device=dev, dtype=torch.float32)
            wk = torch.nn.Parameter(theta.detach().clone().to(torch.float32))
            opt = make_torch_optimizer(self.optim, [wk])
            total, nsteps = 0.0, 0
            for e in range(E):
                for s in range(0, n, B):
                    it = torch.as_tensor(pi[e, s:s + B], device=dev)
                    xb, yb = self.data.x[it], self.data.y[it]
                    ctx = LossContext(round=rnd, present=counts > 0, counts=counts,
                                      u=torch.as_tensor(pu[e, s:s + B], device=dev)[None])
                    with torch.enable_grad():
                        logits = xb @ wk.T
                        loss = self.head.loss(logits[None], yb[None], torch.ones(1, len(it), device=dev), ctx)[0]
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                    opt.step()
                    total += float(loss.detach())
                    nsteps += 1
            out.append(wk.detach())
            losses.append(total / max(1, nsteps))
        return torch.stack(out), torch.tensor(losses, dtype=torch.float64, device=dev)


def evaluate(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, chunk: int = 65536) -> float:
    """Accuracy of ``argmax(x @ theta^T)`` (x carries the trailing 1)."""
    correct = 0
    with torch.no_grad():
        for i in range(0, len(y), chunk):
            pred = (x[i:i + chunk] @ theta.T.to(x.dtype)).argmax(1)
            correct += int((pred == y[i:i + chunk]).sum())
    return correct / max(1, len(y))
