"""The dual form of local SGD: a client's head carried as coefficients on its own feature rows.

Every gradient of a linear head is ``G^T Xb`` (``G = dloss/dlogits`` of a batch, ``Xb`` its feature rows with the
trailing 1), so it lies in the row span of the client's data ``X_k [n_k, D+1]``. With plain SGD, heavy-ball momentum,
L2 weight decay ``wd``, FedProx's ``mu (W - theta)`` and SCAFFOLD's constant correction ``d_k = c - c_k``, a client's
head after any number of local steps therefore stays

    W_k = a * theta + U^T X_k + s * d_k          (a, s scalars; U [n_k, C])

and its momentum buffer ``M = a_m theta + V^T X_k + s_m d_k`` has the same form. With ``lam = mu + wd``, a step whose
batch rows ``P`` have ``dloss/dlogits`` ``G [b, C]`` (scattered into ``Gd [n_k, C]`` at ``P``) has the gradient

    g = (lam a - mu) theta + (lam U + Gd)^T X_k + (lam s + [scaffold]) d_k

and torch's SGD (``M <- m M + g``, first step ``M = g``; ``W <- W - lr M``) acts on the three coefficients alone.
The logits of a batch are ``a * (X_k theta^T)[P] + K_k[P] U + s * (X_k d_k^T)[P]`` with the client's Gram
``K_k = X_k X_k^T``: a step costs ``O(b n_k C)`` instead of ``O(b D C)`` plus a pass over a ``[C, D+1]`` state,
and a round's size-weighted sum of heads is ``(sum r_k a_k) theta + (U r)cat^T Xcat``, one ``(C x N) @ (N x D+1)``
product. AdamW (a per-coordinate step) is not closed under this form: it keeps the primal engine.

:class:`fedhead.core.engine.Engine` picks this form per client (its ``dual`` option); the functions here train one
block of clients stacked and padded to the block's largest client (padding rows are zeros and never in a batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedhead.core.heads import Head, LossContext

DUAL_MODES = ("auto", "on", "off")  # Engine(dual=...): auto (where it pays) | on (every SGD client) | off (primal)


def dual_pays(n: int, d1: int) -> bool:
    """``auto``'s rule: a client of ``n`` samples trains in the dual form when ``2 n <= D+1`` (its coefficient state
    ``n x C`` and its Gram are then well below the ``C x (D+1)`` head, and a step's matmul ``b x n x C`` below
    the primal ``b x (D+1) x C``)."""
    return 0 < n and 2 * n <= d1


def dual_client_bytes(n: int, d1: int, C: int, plan_cols: int, scaffold: bool) -> int:
    """Bytes one client of a dual block padded to ``n`` rows holds: rows, Gram, ``X theta^T``, U, V, a step's
    gathered rows and gradient (~3 more ``n x C``), its plan; with SCAFFOLD its correction and trained head."""
    per = 4 * (n * d1 + n * n + 6 * n * C) + 16 * plan_cols
    return per + (3 * 4 * C * d1 if scaffold else 0)


@dataclass
class DualBatchPlan:
    """A block's batch plan in local row positions, clients sorted by steps (longest first)."""

    pos: torch.Tensor  # [K, E, W] int64 local row of each plan column (0 where padding)
    mask: torch.Tensor  # [K, E, W] 1.0 valid, 0.0 padding
    u: torch.Tensor  # [K, E, W] per-sample uniforms
    steps: list[int]  # [K] steps per plan row, non-increasing
    batch: int  # B: step t of a row uses columns t*B : t*B + width
    width: int  # min(B, n_max): the columns a step can use


@dataclass
class DualState:
    """The trained block: ``W_k = a_k theta + U_k^T X_k + s_k d_k`` (sorted order)."""

    a: torch.Tensor  # [K]
    U: torch.Tensor  # [K, n, C]
    s: torch.Tensor  # [K] (0 without SCAFFOLD)
    loss_sum: torch.Tensor  # [K] float64, sum over steps of the client's batch loss

    def heads(self, theta: torch.Tensor, X: torch.Tensor, d: torch.Tensor | None) -> torch.Tensor:
        """The primal heads ``[K, C, D+1]``."""
        w = torch.bmm(self.U.transpose(1, 2), X)
        w.add_(theta.to(w.dtype)[None] * self.a.view(-1, 1, 1))
        if d is not None:
            w.add_(d * self.s.view(-1, 1, 1))
        return w

    def weighted_sum(self, theta: torch.Tensor, X: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``sum_k r_k (.) W_k`` with per-client, per-class weights ``r [K, C]`` (row ``c`` of head ``k`` times
        ``r[k, c]``; no SCAFFOLD term): one ``(C x K n) @ (K n x D+1)`` product."""
        K, n, C = self.U.shape
        ur = (self.U * r[:, None, :].to(self.U.dtype)).reshape(K * n, C)
        out = ur.T @ X.reshape(K * n, -1)
        coef = (r.to(self.a.dtype) * self.a[:, None]).sum(0)
        return out.add_(theta.to(out.dtype) * coef[:, None])


@dataclass
class DualProblem:
    """What a dual block trains on (sorted order, padded to ``n`` rows)."""

    X: torch.Tensor  # [K, n, D+1] feature rows (zeros past a client's size)
    y: torch.Tensor  # [K, n] labels (0 past a client's size)
    present: torch.Tensor  # [K, C] bool
    counts: torch.Tensor  # [K, C] float
    d: torch.Tensor | None  # [K, C, D+1] SCAFFOLD's c - c_k, or None


def train_dual(
    theta: torch.Tensor,
    prob: DualProblem,
    plan: DualBatchPlan,
    head: Head,
    *,
    rnd: int,
    lr: float,
    momentum: float,
    weight_decay: float,
    prox_mu: float = 0.0,
    closed_form: bool = True,
) -> DualState:
    """Local SGD of a block of clients in the dual form (module docstring); same batches as the primal engine."""
    X, dt = prob.X, prob.X.dtype
    K, n, _ = X.shape
    C = theta.shape[0]
    gram = torch.bmm(X, X.transpose(1, 2))  # [K, n, n]
    xt = (X.reshape(K * n, -1) @ theta.to(dt).T).view(K, n, C)  # X_k theta^T
    xd = torch.bmm(X, prob.d.transpose(1, 2)) if prob.d is not None else None  # X_k d_k^T
    a = torch.ones(K, dtype=dt, device=X.device)
    s = torch.zeros(K, dtype=dt, device=X.device)
    U = torch.zeros(K, n, C, dtype=dt, device=X.device)
    am, sm = torch.zeros_like(a), torch.zeros_like(s)
    V = torch.zeros_like(U) if momentum else None
    lam, one = prox_mu + weight_decay, 1.0 if prob.d is not None else 0.0
    loss_sum = torch.zeros(K, dtype=torch.float64, device=X.device)
    active = [sum(1 for st in plan.steps if st > t) for t in range(max(plan.steps, default=0))]
    B, bw = plan.batch, plan.width
    for e in range(plan.pos.shape[1]):
        for t, k in enumerate(active):
            sl = slice(t * B, t * B + bw)
            P = plan.pos[:k, e, sl]  # [k, bw]
            logits = torch.gather(xt[:k], 1, P[..., None].expand(k, bw, C)).mul_(a[:k, None, None])
            rows = torch.gather(gram[:k], 1, P[..., None].expand(k, bw, n))
            logits.baddbmm_(rows, U[:k])
            if xd is not None:
                logits.add_(torch.gather(xd[:k], 1, P[..., None].expand(k, bw, C)) * s[:k, None, None])
            yb = torch.gather(prob.y[:k], 1, P)
            ctx = LossContext(round=rnd, present=prob.present[:k], counts=prob.counts[:k], u=plan.u[:k, e, sl])
            lk, gl = _loss_and_grad(head, logits, yb, plan.mask[:k, e, sl], ctx, closed_form)
            loss_sum[:k] += lk.detach()
            _sgd_step(
                a[:k],
                U[:k],
                s[:k],
                am[:k],
                V[:k] if V is not None else None,
                sm[:k],
                P,
                gl.to(dt),
                lr,
                momentum,
                lam,
                prox_mu,
                one,
            )
    return DualState(a=a, U=U, s=s, loss_sum=loss_sum)


def _loss_and_grad(head: Head, logits, y, mask, ctx, closed_form: bool):
    if closed_form:
        return head.loss_and_grad(logits, y, mask, ctx)
    logits.requires_grad_(True)
    with torch.enable_grad():
        lk = head.loss(logits, y, mask, ctx)
        (gl,) = torch.autograd.grad(lk.sum(), logits)
    return lk, gl


def _sgd_step(a, U, s, am, V, sm, P, gl, lr, momentum, lam, mu, one) -> None:
    """torch.optim.SGD's step on the coefficients, in place: ``g = (lam a - mu, lam U + Gd, lam s + one)``."""
    idx = P[..., None].expand(*P.shape, U.shape[2])
    if V is not None:
        am.mul_(momentum).add_(a * lam - mu)
        sm.mul_(momentum).add_(s * lam + one)
        V.mul_(momentum).add_(U, alpha=lam).scatter_add_(1, idx, gl)
        a.sub_(am, alpha=lr)
        s.sub_(sm, alpha=lr)
        U.sub_(V, alpha=lr)
        return
    ga, gs = a * lam - mu, s * lam + one
    a.sub_(ga, alpha=lr)
    s.sub_(gs, alpha=lr)
    U.mul_(1.0 - lr * lam).scatter_add_(1, idx, gl.mul_(-lr))
