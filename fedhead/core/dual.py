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

from fedhead.core.heads import Head, LossContext
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

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


DUAL_TILE_MB = 256.0  # a tile's per-step tensors (logits, Gram rows, gradient); 16 MB measured slower


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
    tile_mb: float | None = None,
) -> DualState:
    """Local SGD of a block of clients in the dual form (module docstring); same batches as the primal engine.

    The block is trained in tiles of clients (each tile all its steps, then the next) whose per-step tensors fit
    ``tile_mb`` (default :data:`DUAL_TILE_MB`); cache-sized tiles measured slower (CPU time of a round of 1,000
    clients at the iNat shape: 6.5-6.8 s with 16 MB tiles, 5.2-5.7 s with whole blocks, 11-13 s with 4 MB)."""
    X, dt = prob.X, prob.X.dtype
    K, n, _ = X.shape
    C = theta.shape[0]
    gram = torch.bmm(X, X.transpose(1, 2))  # [K, n, n]
    xt = rows_times_heads(X.reshape(K * n, -1), theta.to(dt)).view(K, n, C)  # X_k theta^T
    xd = torch.bmm(X, prob.d.transpose(1, 2)) if prob.d is not None else None  # X_k d_k^T
    st = DualState(
        a=torch.ones(K, dtype=dt, device=X.device),
        U=torch.zeros(K, n, C, dtype=dt, device=X.device),
        s=torch.zeros(K, dtype=dt, device=X.device),
        loss_sum=torch.zeros(K, dtype=torch.float64, device=X.device),
    )
    hyper = dict(lr=lr, momentum=momentum, lam=prox_mu + weight_decay, mu=prox_mu, one=float(prob.d is not None))
    T = max(1, int((tile_mb or DUAL_TILE_MB) * 2**20 // (plan.width * (2 * C + n) * X.element_size())))
    for j0 in range(0, K, T):
        j = slice(j0, min(K, j0 + T))
        _train_tile(st, j, xt[j], gram[j], xd[j] if xd is not None else None, prob, plan, head, rnd, closed_form, hyper)
    return st


def rows_times_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for rows ``x [N, D]`` and heads ``w [C, D]``, with ``w`` padded by zero rows to a multiple of 8
    on CPU: the BLAS product is slower when its output's width is not (measured on 2 AVX2 cores at N = 32,868,
    D = 1,281: 117 GFLOP/s at C = 1,203, 145 padded to 1,208 including the copy out)."""
    C = w.shape[0]
    pad = -C % 8
    if x.device.type != "cpu" or not pad or C < 64:
        return x @ w.T
    wp = torch.cat([w, w.new_zeros(pad, w.shape[1])])
    return (x @ wp.T)[:, :C].contiguous()


def _train_tile(st: DualState, j: slice, xt, gram, xd, prob, plan, head, rnd, closed_form, hyper) -> None:
    """All local steps of the clients ``j`` of the block (sorted by steps, longest first)."""
    k0, n, C = xt.shape
    a, s, U, loss_sum = st.a[j], st.s[j], st.U[j], st.loss_sum[j]
    am, sm = torch.zeros_like(a), torch.zeros_like(s)
    V = torch.zeros_like(U) if hyper["momentum"] else None
    steps = plan.steps[j]
    active = [sum(1 for v in steps if v > t) for t in range(max(steps, default=0))]
    B, bw = plan.batch, plan.width
    # rows of the flattened [k n, ...] stacks (gathered with index_select, added back with scatter_add_)
    flat = plan.pos[j] + torch.arange(k0, device=xt.device).view(k0, 1, 1) * n
    xt_f, gram_f, y_f = xt.reshape(k0 * n, C), gram.reshape(k0 * n, n), prob.y[j].reshape(-1)
    xd_f = xd.reshape(k0 * n, C) if xd is not None else None
    present, counts, mask, u = prob.present[j], prob.counts[j], plan.mask[j], plan.u[j]
    for e in range(plan.pos.shape[1]):
        for t, k in enumerate(active):
            sl = slice(t * B, t * B + bw)
            rows = flat[:k, e, sl].reshape(-1)  # [k bw]
            logits = xt_f.index_select(0, rows).view(k, bw, C).mul_(a[:k, None, None])
            logits.baddbmm_(gram_f.index_select(0, rows).view(k, bw, n), U[:k])
            if xd_f is not None:
                logits.add_(xd_f.index_select(0, rows).view(k, bw, C) * s[:k, None, None])
            yb = y_f.index_select(0, rows).view(k, bw)
            ctx = LossContext(round=rnd, present=present[:k], counts=counts[:k], u=u[:k, e, sl])
            lk, gl = _loss_and_grad(head, logits, yb, mask[:k, e, sl], ctx, closed_form)
            loss_sum[:k] += lk.detach()
            coef = (a[:k], s[:k], am[:k], sm[:k])
            _sgd_step(coef, U[:k], V[:k] if V is not None else None, rows, gl.to(U.dtype), **hyper)


def _loss_and_grad(head: Head, logits, y, mask, ctx, closed_form: bool):
    if closed_form:
        return head.loss_and_grad(logits, y, mask, ctx)
    logits.requires_grad_(True)
    with torch.enable_grad():
        lk = head.loss(logits, y, mask, ctx)
        (gl,) = torch.autograd.grad(lk.sum(), logits)
    return lk, gl


def _sgd_step(coef, U, V, rows, gl, lr, momentum, lam, mu, one) -> None:
    """torch.optim.SGD's step on the coefficients, in place: ``g = (lam a - mu, lam U + Gd, lam s + one)`` with
    ``Gd`` the batch's ``dloss/dlogits`` added at its rows (``rows`` of the flattened ``[k n, C]`` stack)."""
    a, s, am, sm = coef
    k, n, C = U.shape
    idx = rows[:, None].expand(-1, C)
    g = gl.reshape(-1, C)
    if V is not None:
        am.mul_(momentum).add_(a * lam - mu)
        sm.mul_(momentum).add_(s * lam + one)
        V.mul_(momentum)
        if lam:
            V.add_(U, alpha=lam)
        V.view(k * n, C).scatter_add_(0, idx, g)
        a.sub_(am, alpha=lr)
        s.sub_(sm, alpha=lr)
        U.sub_(V, alpha=lr)
        return
    ga, gs = a * lam - mu, s * lam + one
    a.sub_(ga, alpha=lr)
    s.sub_(gs, alpha=lr)
    if lam:
        U.mul_(1.0 - lr * lam)
    U.view(k * n, C).scatter_add_(0, idx, g.mul_(-lr))
