"""Statistics heads (SPEC section 8): each client sends sufficient statistics once, the server solves.

One message type serves all four heads: the client's per-class feature sums and counts (only the classes it
holds) and, for ``ridge`` and ``lda``, its Gram matrix ``Phi^T Phi`` of the features with a bias column (sent as
the upper triangle). FedCOF's class means are the sums divided by the counts, so ``cof`` and ``ncm`` send the
same numbers. Everything is accumulated in float64 on the server by :class:`StatsAccumulator`, which takes
either one client's :class:`ClientStats` (what a Flower client sends) or a whole block of clients at once (the
simulator: the block's Gram is one matrix product); both give the same sums to float64 rounding, in any order.

The solved head ``theta [C, D+1]`` acts on RAW features with a trailing 1 (``[x, 1]``); :func:`to_prepared`
maps it exactly to features that a run centred and scaled, ``x' = (x - m) / s``:
``W x + b = (s W) x' + (W m + b)``.

- ``ncm`` (FedNCM): rows ``mu_c / ||mu_c||``, zero bias: argmax of the cosine (the norm of ``x`` does not
  change the argmax).
- ``ridge`` (Fed3R): ``W = (sum Phi^T Phi + lambda I)^-1 sum Phi^T Y``, ``Phi = [x, 1]``, ``Y`` one-hot; Cholesky,
  ``solve`` if that fails. ``ridge_normalize`` L2-normalises each row ``[w_c, b_c]`` as Fed3R's code does.
- ``cof`` (FedCOF, the estimator of dipamgoswami/FedCOF ``server_aggregate``/``FedCOFServer``): class means
  ``mu_c``; class covariances from the spread of the clients' class means,
  ``Delta_c = sum_k n_kc (mu_kc - mu_c)(mu_kc - mu_c)^T / max(1, K_c - 1)`` (``K_c`` = clients holding c),
  shrunk ``Delta_c + gamma I``; the Gram estimate ``G = sum_c (N_c - 1)(Delta_c + gamma I) + N g g^T`` with ``g``
  the global mean; ``W = G^+ S`` with ``S`` the class sums, rows L2-normalised, no bias (as that code).
  Streamed as ``sum_k M_k^T diag(a * n_k) M_k - sum_c a_c N_c mu_c mu_c^T`` with ``a_c = (N_c - 1)/max(1, K_c - 1)``,
  so the server holds one ``D x D`` matrix, never one per class or per client.
- ``lda``: shared covariance ``Sigma = (sum x x^T - sum_c N_c mu_c mu_c^T) / (N - C')`` (``C'`` classes present)
  plus ``lda_shrinkage * trace(Sigma)/D * I``; rows ``Sigma^-1 mu_c``, bias ``-1/2 mu_c^T Sigma^-1 mu_c + log(N_c/N)``
  (the empirical class prior of the training set).

A class no client holds gets a zero row and zero bias in every head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedhead.core.heads import HEADS, Head, register_head
from fedhead.core.linalg import clip_rows, psd_part
from fedhead.infra.devices import BUDGET_ENV, keep_freed_memory, memory_budget, size_text
from fedhead.infra.errors import FedheadError, Interval
from fedhead.infra.lazy import lazy_module, on_import
from fedhead.infra.params import Param

torch = lazy_module("torch")


def _bind_torch(t) -> None:
    """``F64 = torch.float64``, run once torch is imported, by whoever imports it (no tensor exists before)."""
    global F64
    F64 = t.float64


on_import("torch", _bind_torch)


# ---------------------------------------------------------------- the client's message


@dataclass
class ClientStats:
    """What one client sends once: the classes it holds, their counts and feature sums, and (``ridge``,
    ``lda``) its Gram matrix of ``[x, 1]``."""

    classes: np.ndarray  # [m] int
    counts: np.ndarray  # [m] int64
    sums: np.ndarray  # [m, D] float64
    gram: np.ndarray | None  # [D+1, D+1] float64 (symmetric; sent as the upper triangle)
    second: np.ndarray | None = None  # [m, D, D] float64: sum of x x^T per held class (qda, fedpft; upper triangles)

    def nbytes(self) -> int:
        dim = self.sums.shape[1] if self.sums.ndim == 2 else 0
        return message_bytes(len(self.classes), dim, self.gram is not None, self.second is not None)


def message_bytes(num_classes_held: int, dim: int, gram: bool, second: bool = False) -> int:
    """Bytes on the wire: class ids int32, counts int64, sums float64, the Gram's upper triangle float64 and (``second``)
    one upper triangle of ``sum x x^T`` per held class, float64."""
    b = num_classes_held * (4 + 8 + 8 * dim)
    if gram:
        d1 = dim + 1
        b += 8 * d1 * (d1 + 1) // 2
    if second:
        b += num_classes_held * 8 * dim * (dim + 1) // 2
    return b


def client_stats(
    x: np.ndarray | torch.Tensor,
    y: np.ndarray,
    num_classes: int,
    gram: bool,
    clip: float | None = None,
    *,
    second: bool = False,
    lift=None,
) -> ClientStats:
    """One client's message from its raw features ``x [n, D]`` and labels ``y [n]``; ``lift``: a head's feature map
    applied first (``ridge-rf``'s random features); ``clip``: every (lifted) feature vector then scaled to L2 norm at
    most ``clip`` (differential privacy, :func:`fedhead.core.linalg.clip_rows`); ``second``: the per-class sums of
    ``x x^T`` join the message (``qda``, ``fedpft``)."""
    xt = torch.as_tensor(np.asarray(x), dtype=F64)
    if lift is not None:
        xt = lift(xt)
    if clip is not None:
        xt = clip_rows(xt, clip)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.int64)
    sums = torch.zeros(num_classes, xt.shape[1], dtype=F64).index_add_(0, yt, xt)
    counts = torch.bincount(yt, minlength=num_classes)
    held = torch.nonzero(counts > 0).flatten()
    g = None
    if gram:
        phi = torch.cat([xt, torch.ones(len(xt), 1, dtype=F64)], 1)
        g = torch.zeros(phi.shape[1], phi.shape[1], dtype=F64)
        add_gram(g, phi)
        g = g.numpy()
    sec = None
    if second:
        sec = np.stack([(xt[yt == c].T @ xt[yt == c]).numpy() for c in held.tolist()]) if len(held) else None
        sec = sec if sec is not None else np.zeros((0, xt.shape[1], xt.shape[1]))
    return ClientStats(held.numpy().astype(np.int64), counts[held].numpy().astype(np.int64), sums[held].numpy(), g, sec)


def pack_upper(a: np.ndarray) -> np.ndarray:
    """The upper triangle of a symmetric matrix, row by row (what travels)."""
    return a[np.triu_indices(a.shape[0])]


def unpack_upper(v: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((n, n), dtype=v.dtype)
    iu = np.triu_indices(n)
    out[iu] = v
    out.T[iu] = v
    return out


# ---------------------------------------------------------------- the server's sums


def check_moments_size(num_classes: int, dim: int) -> None:
    """Refuse, in one line with the numbers, per-class second moments (C x D x D float64, about as much again for
    the solve) beyond the memory this machine can give (:func:`fedhead.infra.devices.memory_budget`: what is
    available, or ``FEDHEAD_MEMORY_BUDGET``), not a fixed size: a 24 GB machine holds 200 classes at D = 1280."""
    need = 2 * num_classes * dim * dim * 8
    budget, source = memory_budget()
    if need > budget:
        raise FedheadError(
            f"The '--head' parameter needs one {dim}x{dim} second-moment matrix per class, twice (the sums and the "
            f"solve): 2 x {num_classes} classes x {dim}^2 x 8 bytes = {size_text(need)}, more than {source}. Use "
            f"--head lda (one shared matrix), a --stats-sketch below {dim}, or a machine with more memory (or raise "
            f"{BUDGET_ENV} if the memory is there)."
        )


def add_gram(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out += x^T x`` for float64 ``x [n, D]``, from the upper triangle of column blocks (a Gram is symmetric):
    with two blocks three of the four products, 3/4 of the full product's FLOPs, each entry the same dot product."""
    D = x.shape[1]
    if D < 256:  # small products: one call costs less than the blocks' bookkeeping
        out += x.T @ x
        return
    h = D // 2
    a, b = x[:, :h].contiguous(), x[:, h:].contiguous()
    out[:h, :h] += a.T @ a
    out[h:, h:] += b.T @ b
    ab = a.T @ b
    out[:h, h:] += ab
    out[h:, :h] += ab.T


class StatsAccumulator:
    """Server-side float64 sums of the clients' messages (any order, client by client or block by block): what a
    closed-form head's :meth:`ClosedFormHead.solve` receives once every client's message is in (and, with
    differential privacy, its noise). A head reads the attributes below and returns ``theta [C, D+1]``; what a
    message holds beyond the class sums and counts follows the head's ``needs_gram`` / ``needs_second`` /
    ``needs_client_means`` (None where not asked for).

    ``cof_counts [K, C]``: the clients' class counts (every message carries them; the server reads them
    before the means) give FedCOF's per-class weights, so the spread of the class means streams into one
    ``D x D`` matrix.

    Attributes:
        C: The number of classes: the rows of ``theta``.
        D: The dimension of the summed features: the raw features', or the output of the head's
            :meth:`ClosedFormHead.stats_map` (its lift, then the ``--stats-sketch`` projection).
        sums: ``[C, D]``: per class, the sum of the clients' (clipped, mapped) feature vectors.
        counts: ``[C]``: per class, the number of samples; 0 for a class no client holds (its row of ``theta``
            should stay zero).
        gram: ``[D+1, D+1]``: ``sum Phi^T Phi`` over every sample, ``Phi = [x, 1]`` (its last row and column
            hold the feature sums and the sample count); None unless the head sets ``needs_gram``.
        second: ``[C, D, D]``: per class, the sum of ``x x^T``; None unless the head sets ``needs_second``.
        cof_w: ``[C]``: FedCOF's class weights ``a_c`` (:meth:`set_cof_weights`); None unless the head sets
            ``needs_client_means``.
        cof_k: ``[C]``: the number of clients holding each class (set with ``cof_w``).
        spread: ``[D, D]``: ``sum_k sum_c a_c n_kc mu_kc mu_kc^T``, the weighted spread of the clients' class
            means (set with ``cof_w``).
        bytes_up: The bytes of the clients' messages on the wire, summed.
        clients: The number of clients whose messages were added.
        noisy: True once differential privacy added its noise to the sums
            (:func:`fedhead.core.dp.privatize_statistics`; the Gram is then projected to the positive semidefinite
            cone, and a head's own estimates may need the same).

    Every tensor is float64 on the CPU."""

    def __init__(
        self,
        num_classes: int,
        dim: int,
        *,
        gram: bool = False,
        cof_counts: np.ndarray | None = None,
        second: bool = False,
    ):
        C, D = num_classes, dim
        self.C, self.D = C, D
        self.sums = torch.zeros(C, D, dtype=F64)
        self.counts = torch.zeros(C, dtype=F64)
        self.gram = torch.zeros(D + 1, D + 1, dtype=F64) if gram else None
        self.second = None  # [C, D, D]: per-class sums of x x^T (qda, fedpft)
        if second:
            check_moments_size(C, D)
            self.second = torch.zeros(C, D, D, dtype=F64)
        self.cof_w = None
        if cof_counts is not None:
            cc = np.asarray(cof_counts)
            self.set_cof_weights(cc.sum(0), (cc > 0).sum(0))
        self.bytes_up = 0
        self.clients = 0
        self.noisy = False  # differential privacy added noise to the sums (fedhead.core.dp.privatize_statistics)

    def set_cof_weights(self, n_c: np.ndarray, k_c: np.ndarray) -> None:
        """FedCOF's class weights ``a_c = (N_c - 1) / max(1, K_c - 1)`` from the class counts ``N_c`` and the numbers
        of clients holding each class ``K_c`` (both sums over clients: secure aggregation gives them too), and an
        empty spread."""
        n_c = np.asarray(n_c, dtype=np.float64)
        k_c = np.asarray(k_c, dtype=np.float64)
        self.cof_w = torch.as_tensor((n_c - 1.0).clip(0) / np.maximum(1.0, k_c - 1.0), dtype=F64)  # a_c
        self.cof_k = torch.as_tensor(k_c, dtype=F64)
        self.spread = torch.zeros(self.D, self.D, dtype=F64)

    def add(self, m: ClientStats) -> None:
        """One client's message (the Flower server, the loop backend)."""
        cls = torch.as_tensor(m.classes, dtype=torch.int64)
        s = torch.as_tensor(m.sums, dtype=F64)
        n = torch.as_tensor(m.counts, dtype=F64)
        self.sums.index_add_(0, cls, s)
        self.counts.index_add_(0, cls, n)
        if self.gram is not None:
            self.gram += torch.as_tensor(m.gram, dtype=F64)
        if self.second is not None and len(cls):
            self.second.index_add_(0, cls, torch.as_tensor(m.second, dtype=F64))
        if self.cof_w is not None and len(cls):
            # n mu mu^T = s s^T / n, weighted by a_c
            w = self.cof_w[cls] / n
            self.spread += (s * w[:, None]).T @ s
        self.bytes_up += m.nbytes()
        self.clients += 1

    def merge(self, other: StatsAccumulator, sign: float = 1.0) -> None:
        """Add (``sign`` 1) or subtract (-1) the summed messages of other clients, ``other`` (the same classes,
        dimension and kinds of statistics): a kept sum taking new clients in (``fedhead update``) or withdrawn ones
        out (``fedhead forget``)."""
        if (other.C, other.D) != (self.C, self.D) or [t is None for t in (self.gram, self.second)] != [
            t is None for t in (other.gram, other.second)
        ]:
            raise FedheadError(
                f"Statistics of {other.C} classes x {other.D} features cannot be merged into statistics of {self.C} "
                f"x {self.D} (or of other kinds): they come from another head or store."
            )
        self.sums += sign * other.sums
        self.counts += sign * other.counts
        if self.gram is not None:
            self.gram += sign * other.gram
        if self.second is not None:
            self.second += sign * other.second
        self.clients += int(sign) * other.clients
        self.bytes_up += other.bytes_up

    def tensors(self) -> dict[str, torch.Tensor]:
        """The sums as named float64 tensors (``sums``, ``counts``, ``gram``, ``second`` where kept): what
        ``--keep-statistics`` writes and :meth:`from_tensors` reads back."""
        out = {"sums": self.sums, "counts": self.counts, "gram": self.gram, "second": self.second}
        return {k: v.detach().cpu().to(F64).contiguous() for k, v in out.items() if v is not None}

    @classmethod
    def from_tensors(cls, tensors: dict, clients: int = 0) -> StatsAccumulator:
        """The accumulator :meth:`tensors` wrote (shapes checked by the reader, :mod:`fedhead.federation.versions`)."""
        C, D = tensors["sums"].shape
        acc = cls(int(C), int(D), gram="gram" in tensors, second=False)
        acc.sums = tensors["sums"].to(F64).clone()
        acc.counts = tensors["counts"].to(F64).clone()
        if "gram" in tensors:
            acc.gram = tensors["gram"].to(F64).clone()
        if "second" in tensors:
            acc.second = tensors["second"].to(F64).clone()
        acc.clients = int(clients)
        return acc

    def add_block(
        self, x: torch.Tensor, y: torch.Tensor, parts: list[np.ndarray], clip: float | None = None, lift=None
    ) -> None:
        """The messages of a block of clients at once: ``x [N, D]`` raw features, ``y [N]`` labels, ``parts``
        the block's clients' sample indices, ``clip`` and ``lift`` as in :func:`client_stats`. Sums equal adding
        each client's :func:`client_stats`."""
        C, D = self.C, self.D
        idx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        owner = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
        it = torch.as_tensor(idx, dtype=torch.int64)
        xb = x.index_select(0, it).to(F64)
        if lift is not None:
            xb = lift(xb)
        if clip is not None:
            xb = clip_rows(xb, clip)
        yb = y.index_select(0, it).to(torch.int64)
        key = torch.as_tensor(owner, dtype=torch.int64) * C + yb
        cnt = torch.bincount(key, minlength=len(parts) * C).to(F64)  # per client and class
        self.sums.index_add_(0, yb, xb)
        self.counts += cnt.view(len(parts), C).sum(0)
        if self.gram is not None:
            add_gram(self.gram[:D, :D], xb)
            colsum = xb.sum(0)
            self.gram[:D, D] += colsum
            self.gram[D, :D] += colsum
            self.gram[D, D] += float(len(xb))
        if self.second is not None:
            for c in torch.unique(yb).tolist():
                xc = xb[yb == c]
                self.second[c] += xc.T @ xc
        if self.cof_w is not None:
            # the clients' class sums, one row per (client, class) present in the block: a client holds few of
            # the C classes, and the absent ones' zero rows would cost a [D, clients x C] product (at 10,000
            # clients x 1,203 classes: 83 GFLOP a block of 21 clients instead of about one Gram's)
            held, inv = torch.unique(key, return_inverse=True)
            per = torch.zeros(len(held), D, dtype=F64).index_add_(0, inv, xb)
            w = self.cof_w.repeat(len(parts))[held] / cnt[held]
            self.spread += (per * w[:, None]).T @ per
        held = (cnt.view(len(parts), C) > 0).sum(1)
        self.bytes_up += sum(message_bytes(int(h), D, self.gram is not None, self.second is not None) for h in held)
        self.clients += len(parts)


def accumulate(
    x: torch.Tensor,
    y: torch.Tensor,
    parts: list[np.ndarray],
    num_classes: int,
    *,
    gram: bool,
    cof: bool,
    block_rows: int = 8192,
    per_client: bool = False,
    clip: float | None = None,
    second: bool = False,
    lift=None,
) -> StatsAccumulator:
    """Stream every client's message into a :class:`StatsAccumulator`, in blocks of about ``block_rows``
    samples (``per_client``: one :func:`client_stats` message at a time, as a Flower server receives them);
    ``clip``: the clients' per-sample feature-norm clip (differential privacy); ``second``, ``lift``: as in
    :func:`client_stats` (a head's :meth:`ClosedFormHead.message_kwargs` gives them)."""
    counts = None
    if cof:
        yn = y.cpu().numpy()
        counts = np.stack([np.bincount(yn[p], minlength=num_classes) for p in parts]) if parts else None
    dim = x.shape[1] if lift is None else lift.dim
    keep_freed_memory()  # each block's Gram and gathered rows reuse the last block's memory
    acc = StatsAccumulator(num_classes, dim, gram=gram, cof_counts=counts, second=second)
    if per_client:
        xn, yn = x.cpu().numpy(), y.cpu().numpy()
        for p in parts:
            acc.add(client_stats(xn[p], yn[p], num_classes, gram, clip, second=second, lift=lift))
        return acc
    x, y = x.cpu(), y.cpu()
    block, rows = [], 0
    for p in parts:
        block.append(p)
        rows += len(p)
        if rows >= block_rows:
            acc.add_block(x, y, block, clip, lift)
            block, rows = [], 0
    if block:
        acc.add_block(x, y, block, clip, lift)
    return acc


# ---------------------------------------------------------------- solvers


def _spd_solve(a: torch.Tensor, b: torch.Tensor, param: str, fix: str) -> torch.Tensor:
    """``a^-1 b`` for a symmetric positive (semi)definite ``a``: Cholesky, else LU solve, else a one-line error."""
    L, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        d = L.diagonal().abs()
        if float(d.min()) > 0 and float(d.max() / d.min()) ** 2 < 1e14:  # condition number under 1e14
            return torch.cholesky_solve(b, L)
    ev = torch.linalg.eigvalsh(a)
    if float(ev.min()) <= 1e-14 * float(ev.abs().max().clamp_min(1e-300)):
        raise FedheadError(
            f"The '{param}' parameter leaves the statistics too ill-conditioned to solve "
            f"(condition number over 1e14). {fix}"
        )
    return torch.linalg.solve(a, b)


def _normalize_rows(t: torch.Tensor) -> torch.Tensor:
    return t / t.norm(dim=1, keepdim=True).clamp_min(1e-300)


def to_prepared(theta_raw: torch.Tensor, mean: np.ndarray | None, scale: float) -> torch.Tensor:
    """Map a head on ``[x, 1]`` to the same scores on ``[(x - mean) / scale, 1]`` (exact)."""
    W, b = theta_raw[:, :-1].to(F64), theta_raw[:, -1].to(F64)
    if mean is not None:
        b = b + W @ torch.as_tensor(mean, dtype=F64)
    return torch.cat([W * scale, b[:, None]], 1)


class ClosedFormHead(Head):
    """A head solved once from statistics (no local training; :attr:`closed_form` tells the trainer)."""

    closed_form = True
    needs_gram = False
    needs_client_means = False  # cof: the spread of the clients' class means
    needs_second = False  # qda, fedpft: per-class sums of x x^T
    init_capable = True  # a linear head on raw features that --init can map to prepared features
    init_scale = 1.0  # what an --init start is multiplied by unless --init-scale says (docs: "Baselines")
    # the solve is a function of the summed statistics alone, so a kept sum plus (minus) more clients' messages
    # solves to the head of a run over the union (without them): fedhead update / forget (docs/lifecycle.md)
    updatable = True

    def lift(self, dim: int):
        """The head's own feature map the clients apply before their statistics (None: the raw features); it has
        ``.dim``. ``ridge-rf``: the random features."""
        return None

    def sketch(self, dim: int):
        """``--stats-sketch r``: the shared seeded projection of the (lifted) features to ``r`` dimensions, or None."""
        r = int(self.params.get("stats_sketch", 0) or 0)
        if not r:
            return None
        key = (dim, r)
        if getattr(self, "_sketch", None) is None or self._sketch[0] != key:
            self._sketch = (key, Sketch(dim, r, int(self.params.get("stats_sketch_seed", 0))))
        return self._sketch[1]

    def stats_map(self, dim: int):
        """What the clients apply to their raw features ``[n, dim]`` before summing: the head's lift, then the
        sketch (None: nothing)."""
        own = self.lift(dim)
        sk = self.sketch(own.dim if own is not None else dim)
        if sk is None:
            return own
        return sk if own is None else Composed(own, sk)

    def message_kwargs(self, dim: int) -> dict:
        """What a client's message holds beyond the class sums: keywords of :func:`accumulate` / :func:`client_stats`."""
        return {"gram": self.needs_gram, "second": self.needs_second, "lift": self.stats_map(dim)}

    def unsketch(self, theta: torch.Tensor) -> torch.Tensor:
        """A head solved in the sketch's space mapped exactly back to the (lifted) features: ``W P^T`` for a linear
        head, ``M Q M^T`` with ``M = diag(P, 1)`` for a quadratic one (no sketch: ``theta`` itself)."""
        sk = getattr(self, "_sketch", None)
        if not int(self.params.get("stats_sketch", 0) or 0) or sk is None:
            return theta
        P = sk[1].p
        m = torch.zeros(P.shape[0] + 1, P.shape[1] + 1, dtype=F64)
        m[:-1, :-1] = P
        m[-1, -1] = 1.0
        t = theta.to(F64)
        return t @ m.T if t.ndim == 2 else m @ t @ m.T

    def solve_statistics(self, acc: StatsAccumulator) -> torch.Tensor:
        """:meth:`solve`, mapped back from the sketch's space when ``--stats-sketch`` is given."""
        theta = self.solve(acc)
        if not isinstance(theta, torch.Tensor) or theta.ndim < 2 or tuple(theta.shape[:2]) != (acc.C, acc.D + 1):
            shape = tuple(theta.shape) if isinstance(theta, torch.Tensor) else type(theta).__name__
            raise FedheadError(
                f"The '--head' parameter {self.name!r} solved to a head of shape {shape}, not ({acc.C}, {acc.D + 1}): "
                "solve(acc) must return one row per class over the features and a trailing bias column (see "
                "fedhead.StatsAccumulator)."
            )
        return self.unsketch(theta)

    def per_sample(self, logits, y, ctx):
        raise FedheadError(
            f"The '--head' parameter {self.name!r} is solved in closed form and has no local loss. "
            "Use it as --head, or as --init for an iterative head."
        )

    def solve(self, acc: StatsAccumulator) -> torch.Tensor:
        """``theta [C, D+1]`` (float64) on raw features with a trailing 1."""
        raise NotImplementedError

    def openset_statistics(self, acc: StatsAccumulator) -> dict:
        """What the head's open-set score needs beyond its logits (:mod:`fedhead.core.openset`), from the same
        summed statistics, on raw features: ``{name: tensor}`` of :data:`fedhead.core.openset.OPENSET_TENSORS`
        (none: the score reads the logits alone)."""
        return {}

    def solve_central(self, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        """The same solve on the pooled training set held by one party (the head's centralised reference)."""
        kw = self.message_kwargs(x.shape[1])
        acc = accumulate(x, y, [np.arange(len(y))], num_classes, cof=False, **kw)
        return self.solve_statistics(acc)


class Sketch:
    """``x -> x P``, ``P [D, r]`` drawn ``N(0, 1/r)`` from ``torch.Generator().manual_seed(seed)`` (a Johnson-
    Lindenstrauss projection, shared by every client through the seed)."""

    def __init__(self, in_dim: int, r: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        self.p = torch.randn(in_dim, r, generator=g, dtype=F64) / float(np.sqrt(r))
        self.dim = r

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(F64) @ self.p


class Composed:
    """Two feature maps, one after the other (``ridge-rf``'s random features, then the sketch)."""

    def __init__(self, first, then):
        self.first, self.then, self.dim = first, then, then.dim

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.then(self.first(x))


SKETCH_PARAMS = (
    Param("stats_sketch", 0, Interval(0, None, integer=True),
          "project the features to this dimension with a shared seeded random matrix before the statistics (0: no "
          "sketch); the server solves there and maps the head back"),
    Param("stats_sketch_seed", 0, Interval(0, None, integer=True), "seed of the --stats-sketch projection"),
)  # fmt: skip


def _means(acc: StatsAccumulator) -> tuple[torch.Tensor, torch.Tensor]:
    held = acc.counts > 0
    mu = torch.zeros_like(acc.sums)
    mu[held] = acc.sums[held] / acc.counts[held, None]
    return mu, held


@register_head("ncm", *SKETCH_PARAMS)
class NCMHead(ClosedFormHead):
    """FedNCM: L2-normalised class means from per-class sums and counts; cosine scoring (closed form)."""

    log_scores = False  # regression scores / cosines: no log prior can be added (--personalize prior)
    unknown_score = "max_logit"  # open-set: the largest score is no log-probability

    def solve(self, acc):
        mu, held = _means(acc)
        rows = torch.zeros_like(mu)
        rows[held] = _normalize_rows(mu[held])
        return torch.cat([rows, torch.zeros(acc.C, 1, dtype=F64)], 1)


@register_head(
    "ridge",
    Param(
        "ridge_lambda",
        0.01,
        Interval(0, None, closed="neither"),
        "ridge: regulariser lambda (Fed3R: 0.01)",
        grid=(1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0),
    ),  # fmt: skip
    Param("ridge_normalize", False, None, "ridge: L2-normalise each solved row as Fed3R's code does"),
    *SKETCH_PARAMS,
)
class RidgeHead(ClosedFormHead):
    """Fed3R: ridge regression on one-hot targets from the clients' Phi^T Phi and Phi^T Y (closed form)."""

    log_scores = False  # regression scores / cosines: no log prior can be added (--personalize prior)
    unknown_score = "max_logit"  # open-set: the largest score is no log-probability

    needs_gram = True
    init_scale = 10.0  # measured: ridge's start is too flat for softmax fine-tuning at 1 (docs "Baselines")

    def solve(self, acc):
        return ridge_solve(acc, float(self.params["ridge_lambda"]), bool(self.params["ridge_normalize"]))


def ridge_solve(acc: StatsAccumulator, lam: float, normalize: bool, flag: str = "--ridge-lambda") -> torch.Tensor:
    """``(sum Phi^T Phi + lambda I)^-1 sum Phi^T Y`` from summed statistics (rows of absent classes zero)."""
    D = acc.D
    a = acc.gram + lam * torch.eye(D + 1, dtype=F64)
    b = torch.cat([acc.sums, acc.counts[:, None]], 1).T  # Phi^T Y  [D+1, C]
    w = _spd_solve(a, b, flag, f"Got {lam!r}; raise it, e.g. {flag} 1.").T.contiguous()
    w[acc.counts == 0] = 0.0
    return _normalize_rows(w) if normalize else w


@register_head(
    "cof",
    Param(
        "cof_gamma",
        1.0,
        Interval(0, None),
        "cof: shrinkage gamma of the class covariances (FedCOF: 1)",
        grid=(0.01, 0.1, 1.0, 10.0),
    ),  # fmt: skip
)
class COFHead(ClosedFormHead):
    """FedCOF: class covariances estimated from the spread of client class means; ridge-like solve (closed form)."""

    log_scores = False  # regression scores / cosines: no log prior can be added (--personalize prior)
    unknown_score = "max_logit"  # open-set: the largest score is no log-probability

    needs_client_means = True
    # FedCOF's class weights a_c = (N_c - 1) / max(1, K_c - 1) depend on the totals, so the kept spread cannot take a
    # client in or out: the per-class sums of s s^T / n it would need are [C, D, D]
    updatable = False

    def solve(self, acc):
        D = acc.D
        gamma = float(self.params["cof_gamma"])
        mu, held = _means(acc)
        n = acc.counts
        a_c = acc.cof_w
        # sum_c (N_c - 1) Delta_c = spread - sum_c a_c N_c mu_c mu_c^T ; shrinkage adds gamma (N_c - 1) I per class
        scatter = acc.spread - (mu * (a_c * n)[:, None]).T @ mu
        N = float(n.sum())
        g = acc.sums.sum(0) / max(N, 1.0)
        G = scatter + gamma * float((n[held] - 1).sum()) * torch.eye(D, dtype=F64) + N * torch.outer(g, g)
        L, info = torch.linalg.cholesky_ex(G)
        if int(info) == 0:
            w = torch.cholesky_solve(acc.sums.T, L).T
        else:  # the reference code's pseudo-inverse (gamma = 0 with few clients per class)
            w = (torch.linalg.pinv(G, hermitian=True) @ acc.sums.T).T
        w = w.contiguous()
        w[~held] = 0.0
        w = _normalize_rows(w)
        return torch.cat([w, torch.zeros(acc.C, 1, dtype=F64)], 1)

    def solve_central(self, x, y, num_classes):
        # The estimator with the true class covariances: every sample its own "client", so K_c = N_c, the
        # weights a_c are 1 (N_c >= 2) and the spread is sum_i x_i x_i^T over classes with N_c >= 2.
        yn = y.cpu().numpy()
        n_c = np.bincount(yn, minlength=num_classes)
        acc = StatsAccumulator(num_classes, x.shape[1], cof_counts=np.diag(n_c))  # a_c from counts only
        acc.cof_w = torch.as_tensor((n_c >= 2).astype(np.float64))
        x64 = x.cpu().to(F64)
        acc.sums.index_add_(0, y.cpu().to(torch.int64), x64)
        acc.counts += torch.as_tensor(n_c, dtype=F64)
        keep = torch.as_tensor(n_c[yn] >= 2)
        for i in range(0, len(yn), 8192):
            xb = x64[i : i + 8192][keep[i : i + 8192]]
            acc.spread += xb.T @ xb
        return self.solve(acc)


@register_head(
    "lda",
    Param(
        "lda_shrinkage",
        1e-4,
        Interval(0, None),
        "lda: ridge on the shared covariance, times trace/D",
        grid=(1e-6, 1e-4, 1e-2, 1e-1, 1.0),
    ),  # fmt: skip
    *SKETCH_PARAMS,
)
class LDAHead(ClosedFormHead):
    """Shared-covariance Gaussian classifier (LDA) from class sums, counts and the pooled second moment (closed form)."""

    needs_gram = True
    unknown_score = "mahalanobis"  # open-set: the distance to the nearest class mean (fedhead.core.openset)

    def _gaussians(self, acc) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The class means ``[C, D]``, the shrunk shared covariance ``[D, D]`` and the held mask ``[C]``."""
        D = acc.D
        mu, held = _means(acc)
        n = acc.counts
        N = float(n.sum())
        second = acc.gram[:D, :D]
        within = (second - (mu * n[:, None]).T @ mu) / max(1.0, N - float(held.sum()))
        if acc.noisy:  # DP noise can make the estimate indefinite: project it (post-processing)
            within = psd_part(within)
        shrink = float(self.params["lda_shrinkage"]) * float(torch.trace(within)) / D
        return mu, within + shrink * torch.eye(D, dtype=F64), held

    def solve(self, acc):
        mu, sigma, held = self._gaussians(acc)
        n = acc.counts
        N = float(n.sum())
        w = _spd_solve(sigma, mu.T, "--lda-shrinkage", "Raise it, e.g. --lda-shrinkage 0.01.").T.contiguous()
        bias = -0.5 * (w * mu).sum(1) + torch.log(n.clamp_min(1.0) / max(N, 1.0))
        w[~held] = 0.0
        bias[~held] = 0.0
        return torch.cat([w, bias[:, None]], 1)

    def openset_statistics(self, acc) -> dict:
        """The class means, the precision ``Sigma^-1`` of the same solve and the class counts (raw features): what
        the Mahalanobis score needs, from the statistics the server already summed; none under ``--stats-sketch``
        (the solve's space is the sketch's)."""
        if int(self.params.get("stats_sketch", 0) or 0):
            return {}
        mu, sigma, _ = self._gaussians(acc)
        eye = torch.eye(acc.D, dtype=F64)
        prec = _spd_solve(sigma, eye, "--lda-shrinkage", "Raise it, e.g. --lda-shrinkage 0.01.")
        return {"class_means": mu, "precision": (prec + prec.T) / 2, "class_counts": acc.counts.clone()}


def is_closed_form(name: str) -> bool:
    return name in HEADS and bool(getattr(HEADS[name].cls, "closed_form", False))


def closed_form_names() -> list[str]:
    return sorted(n for n in HEADS if is_closed_form(n))
