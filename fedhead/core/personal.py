"""Personalisation (``--personalize``): every client ends with its own head, scored on its own local test set.

FedABC's protocol (SPEC sections 3 and 10): client k's personal model is scored on a local test set drawn from the
global test split in k's training label proportions (:func:`fedhead.core.clientacc.local_test_sets`). PFL accuracy
is the pooled one, sum_k correct_k / sum_k |test_k| (FedABC's equation 7); the drift measure is the same personal
models on class-balanced test samples (its equation 8; here one balanced draw shared by every client, see
:func:`balanced_test_set`).

Each method is declared once with its parameters (:func:`register_personal`, like heads) and says what it needs as
attributes (``how``, ``needs_statistics``, ``needs_hidden``, ``generic_head``), so the checks in
:meth:`fedhead.federation.config.TrainConfig.resolved` read the class, never a table of names. The arithmetic lives
here and works on blocks of clients (stacked tensors); the transports bring the clients' data to it (in process:
block by block from the store; on Flower: each node its own client, only metrics travel).

``none``
    The global head on each client's local test set (the reference every gain is measured against).
``prior``
    The global head's scores plus ``log p_k(c) - log p(c)``: Bayes' rule under label shift, with p_k the client's
    training label frequencies and p the federation's, each smoothed by ``prior_smoothing`` pseudo-counts per class
    (:func:`prior_bias`). No training, nothing sent beyond the class totals every run already has.
``finetune``
    ``personal_epochs`` local epochs from the global head with the run's loss (softmax for a closed-form head): Chen
    and Chao's generic FL plus local adaptation, the FedAvg / FedProx / SCAFFOLD columns of FedABC's Table 1.
``ditto``
    The same local epochs with Ditto's proximal term ``personal_lambda / 2 ||v - w||^2`` pulling the personal head
    v towards the global w (Li et al., ICML 2021). Ditto updates v in every round a client is sampled; on a convex
    head over frozen features fedhead runs the personal steps once, from the final global head, which is the point
    Ditto's personal solve tends to as w settles (stated in docs/personalization.md).
``apfl``
    APFL (Deng et al. 2020): a personal head v and a mixing weight alpha learnt together, the model
    ``alpha v + (1 - alpha) w`` (:func:`train_apfl`); alpha starts at ``apfl_alpha`` and stays in [0, 1].
``fedrod``
    FedRoD's linear mode (Chen and Chao, ICLR 2022): a generic head trained with the balanced softmax (``--head
    bsm``) and a personal head whose logits add to it, trained with cross-entropy and weight decay
    ``personal_lambda``. On a linear head the sum is one linear head and weight decay on the personal part is a
    proximal pull towards the generic head, so fedhead trains it as ditto's form with the softmax loss.
``fedabc``
    FedABC's personalised one-vs-all heads: local epochs of FedABC's binary loss (SPEC section 3) from the global
    head, whatever head the federation trained.
``local``
    Local-only training: the same loss from a zero head, ``personal_epochs`` epochs, no federation at all.
``closed-form``
    The client's own statistics plus beta times the global ones, solved on the client: for ridge
    ``(Phi_k^T Phi_k + b_k (G + lambda I))^-1 (Phi_k^T Y_k + b_k Phi^T Y)`` with ``b_k = beta n_k / N`` (beta 1: the
    global statistics weigh as much as the client's own samples), exact and without iteration
    (:class:`RidgeKernel`); any other closed-form head solves ``own + b_k global`` with its own solve
    (:func:`mixed_statistics`). Beta is chosen per client on its validation part from ``BETA_GRID`` unless given.
``fedper``, ``fedrep``, ``lg``
    Need a head with a hidden layer (a shared layer and a personal one); fedhead's heads are linear on the frozen
    features, so these are refused in one line that names what to use instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedhead.core.closedform import StatsAccumulator
from fedhead.infra.errors import FedheadError, Interval, unknown_name
from fedhead.infra.lazy import lazy_module
from fedhead.infra.params import Param, doc_line, resolve_params

torch = lazy_module("torch")

BETA_GRID = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)  # closed-form: tried on each client's validation part
BETA_DEFAULT = 1.0  # closed-form without a validation part: the global statistics weigh as the client's own
DRIFT_SAMPLES = 1000  # the balanced drift set's size when --personal-drift is left unset (per class: 1000 // C)
DRIFT_AUTO_SCORES = 2e9  # left unset, drift is skipped past this many scores (about 10 s here); given, it runs
PERSONAL_FIELDS = (
    "pfl_accuracy",
    "pfl_accuracy_global",
    "pfl_gain",
    "personal_accuracy_mean",
    "personal_accuracy_worst10",
    "personal_accuracy_best10",
    "personal_accuracy_std",
    "personal_gain_mean",
    "personal_gain_worst10",
    "personal_improved",
    "drift_accuracy",
    "drift_accuracy_global",
    "personal_s",
)


@dataclass
class PersonalSpec:
    name: str
    cls: type
    params: list[Param]
    doc: str


PERSONAL: dict[str, PersonalSpec] = {}


def register_personal(name: str, *params: Param):
    """A class decorator: register a :class:`Personalizer` subclass as ``--personalize NAME`` with its parameters."""

    def deco(cls):
        cls.name = name
        PERSONAL[name] = PersonalSpec(name, cls, list(params), doc_line(cls))
        return cls

    return deco


def create_personalizer(name: str, **params) -> "Personalizer":
    """The method ``name`` with its parameters (others' ignored, missing ones at their defaults)."""
    if name not in PERSONAL:
        raise unknown_name("--personalize", name, PERSONAL, "personalisation method")
    spec = PERSONAL[name]
    mine = {p.name for p in spec.params}
    return spec.cls(
        **resolve_params(spec.params, {k: v for k, v in params.items() if k in mine}, f"--personalize {name}")
    )


class Personalizer:
    """A personalisation method: its parameters and what it needs (class attributes read by the checks)."""

    name = ""
    # how the personal heads are made (fedhead.core.personalize runs each kind): "global" (the global head itself),
    # "shift" (the global scores plus the log-prior shift), "epochs" (the engine's local epochs from `start` with
    # `loss` and `prox`), "mix" (APFL's learnt mix), "statistics" (the closed-form solve of mixed statistics)
    how = "epochs"
    start = "global"  # where the trained personal head starts: "global" | "zero"
    loss = None  # the loss head of the local epochs: None: the run's (softmax for a closed-form head)
    needs_statistics = False  # the global statistics of a closed-form head or --init (closed-form)
    needs_hidden = False  # a head with a hidden layer (fedper, fedrep, lg)
    needs_linear = False  # a head linear in the features (every trained method)
    generic_head = None  # the --head the method's generic model is trained with (fedrod: bsm)
    needs_log_scores = False  # the head's scores must be log-probabilities (prior: Head.log_scores)
    instead = ""  # needs_hidden: what to use on a linear head

    def __init__(self, **params):
        self.params = params

    @property
    def epochs(self) -> int:
        return int(self.params.get("personal_epochs", 0) or 0)

    @property
    def prox(self) -> float:
        return float(self.params.get("personal_lambda", 0.0) or 0.0)


_EPOCHS = Interval(0, None, integer=True)
_LAMBDA = Interval(0, None, closed="neither")


def _epochs(default: int) -> Param:
    return Param(
        "personal_epochs", default, _EPOCHS, "local epochs of the personal head (0: it starts and ends at its start)"
    )


_LR = Param("personal_lr", None, _LAMBDA, "learning rate of the personal epochs (none: the run's --lr)")
_PROX = Param(
    "personal_lambda", 0.1, _LAMBDA, "proximal weight lambda pulling the personal head towards the global one"
)


@register_personal("none")
class NoPersonal(Personalizer):
    """The global head on every client's local test set (today's model; the reference of every gain)."""

    how = "global"


@register_personal(
    "prior",
    Param("prior_smoothing", 0.1, _LAMBDA, "pseudo-counts per class added to the client's and the global label counts"),
)
class PriorPersonal(Personalizer):
    """The global head's scores plus log p_k(c) - log p(c): Bayes' correction for the client's label prior."""

    how = "shift"

    needs_log_scores = True


@register_personal("finetune", _epochs(5), _LR)
class FinetunePersonal(Personalizer):
    """Local epochs from the global head (generic FL plus local adaptation, Chen and Chao 2021)."""

    needs_linear = True


@register_personal("ditto", _epochs(5), _LR, _PROX)
class DittoPersonal(Personalizer):
    """Ditto: local epochs with a proximal pull lambda/2 ||v - w||^2 towards the global head."""

    needs_linear = True


@register_personal(
    "apfl",
    _epochs(5),
    _LR,
    Param("apfl_alpha", 0.5, Interval(0, 1), "the mixing weight alpha the personal head starts from (learnt)"),
)
class APFLPersonal(Personalizer):
    """APFL: a personal head v and a learnt mix alpha; the client's model is alpha v + (1 - alpha) w."""

    how = "mix"

    needs_linear = True


@register_personal("fedrod", _epochs(5), _LR, Param("personal_lambda", 0.1, _LAMBDA, _PROX.help))
class FedRoDPersonal(Personalizer):
    """FedRoD (linear mode): a balanced-softmax generic head plus an additive personal head (softmax CE)."""

    needs_linear = True
    generic_head = "bsm"
    loss = "softmax"


@register_personal("fedabc", _epochs(5), _LR)
class FedABCPersonal(Personalizer):
    """FedABC's personalised one-vs-all heads: local epochs of FedABC's binary loss from the global head."""

    needs_linear = True
    loss = "fedabc"


@register_personal("local", _epochs(50), _LR)
class LocalPersonal(Personalizer):
    """Local-only training: each client's head from zero on its own data, no federation."""

    needs_linear = True
    start = "zero"


@register_personal(
    "closed-form",
    Param(
        "personal_beta",
        None,
        _LAMBDA,
        "weight of the global statistics against the client's own (1: as much as its samples); none: chosen per "
        "client on its validation part",
    ),
)
class ClosedFormPersonal(Personalizer):
    """The client's own statistics plus beta times the global ones, solved on the client (ridge, LDA, ...)."""

    how = "statistics"

    needs_statistics = True


class _HiddenLayer(Personalizer):
    how = "global"  # never run: refused by the checks (needs_hidden)
    needs_hidden = True


@register_personal("fedper")
class FedPerPersonal(_HiddenLayer):
    """FedPer: shared base layers, personal last layer (needs a head with a hidden layer)."""

    instead = "finetune (a linear head is all personal layer: FedPer's personal part)"


@register_personal("fedrep")
class FedRepPersonal(_HiddenLayer):
    """FedRep: a shared representation, personal heads trained first each round (needs a hidden layer)."""

    instead = "finetune (on frozen features the shared representation is the encoder itself)"


@register_personal("lg")
class LGPersonal(_HiddenLayer):
    """LG-FedAvg: personal lower layers, a shared top layer (needs a hidden layer)."""

    instead = "none or prior (the shared top layer alone is the global head)"


# ---------------------------------------------------------------- the arithmetic


def prior_bias(counts: np.ndarray, totals: np.ndarray, smoothing: float) -> np.ndarray:
    """``log p_k(c) - log p(c)`` per client (float64 [K, C]): ``p_k(c) = (n_kc + a) / (n_k + a C)``, ``p(c) = (N_c + a)
    / (N + a C)``, ``a = smoothing``; ``counts`` [K, C] the clients' training label counts, ``totals`` [C] the
    federation's (their sum)."""
    n = np.asarray(counts, dtype=np.float64)
    t = np.asarray(totals, dtype=np.float64)
    C = t.size
    a = float(smoothing)
    own = np.log(n + a) - np.log(n.sum(1, keepdims=True) + a * C)
    glob = np.log(t + a) - math.log(float(t.sum()) + a * C)
    return own - glob[None, :]


def balanced_test_set(test_y: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """FedABC's drift set: ``per_class`` test samples of every class the test split has (fewer where it has
    fewer), drawn without replacement by a generator keyed by ``seed``; sorted indices into the test split."""
    y = np.asarray(test_y, dtype=np.int64)
    rng = np.random.default_rng([int(seed), 0xD41F7])
    out = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        out.append(rng.choice(idx, size=min(per_class, idx.size), replace=False))
    return np.sort(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)


def drift_per_class(given: int | None, num_classes: int, num_clients: int = 1) -> int:
    """``--personal-drift``: the given samples per class; left unset, ``max(1, DRIFT_SAMPLES // C)``, or 0 (no
    drift) where scoring every client's head on the whole set would exceed ``DRIFT_AUTO_SCORES`` scores (clients x
    drift samples x classes: 10,000 clients x 1,203 classes would score 14.5e9)."""
    if given is not None:
        return int(given)
    per = max(1, DRIFT_SAMPLES // max(1, num_classes))
    return per if num_clients * per * num_classes * num_classes <= DRIFT_AUTO_SCORES else 0


def correct_counts(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Correct predictions per client (int64 [B]) of ``logits [B, m, C]`` against ``y [B, m]`` where ``mask``."""
    return ((logits.argmax(-1) == y) & mask).sum(1)


def mixed_statistics(own: StatsAccumulator, glob: StatsAccumulator, weight: float) -> StatsAccumulator:
    """``own + weight * glob``: a client's statistics plus the weighted global ones (sums, counts, Gram, second
    moments), what the closed-form personal head solves."""
    out = StatsAccumulator(glob.C, glob.D)
    out.sums = own.sums + weight * glob.sums
    out.counts = own.counts + weight * glob.counts
    for name in ("gram", "second"):
        a, b = getattr(own, name), getattr(glob, name)
        if b is not None:
            setattr(out, name, (a if a is not None else torch.zeros_like(b)) + weight * b)
    out.noisy = glob.noisy
    return out


class RidgeKernel:
    """The ridge personal head without a ``D x D`` solve per client.

    With ``M = G + lambda I`` (the global statistics and regulariser, Cholesky ``M = L L^T`` once) and the global
    head ``theta_g = M^-1 Phi^T Y``, Woodbury's identity turns client k's personal head
    ``(Phi_k^T Phi_k + b M)^-1 (Phi_k^T Y_k + b Phi^T Y)`` into a kernel correction of the global scores:
    ``E theta_k = E theta_g + (E M^-1 Phi_k^T) (b I + Phi_k M^-1 Phi_k^T)^-1 (Y_k - Phi_k theta_g)``
    for any rows ``E``. With ``R = L^-1 Phi^T`` each row costs one product with ``[L^-T | theta_g]`` (its whitened
    form and its global score together), and a block of clients one eigendecomposition (:meth:`spectrum`) after
    which every beta is a batched product: at 10,000 clients of 12 samples nothing ``D x D`` is formed per client."""

    def __init__(self, acc: StatsAccumulator, lam: float):
        D1 = acc.D + 1
        m = acc.gram.to(torch.float64) + lam * torch.eye(D1, dtype=torch.float64)
        L, info = torch.linalg.cholesky_ex(m)
        if int(info) != 0:
            raise FedheadError(
                f"The '--ridge-lambda' parameter ({lam:g}) leaves the global statistics singular for the closed-form "
                "personal head; raise it, e.g. --ridge-lambda 1."
            )
        self.L = L
        rhs = torch.cat([acc.sums, acc.counts[:, None]], 1).T.to(torch.float64)  # Phi^T Y [D+1, C]
        self.theta = torch.cholesky_solve(rhs, L)  # [D+1, C]
        self.theta[:, acc.counts == 0] = 0.0
        # rows -> [whitened rows | global scores] in one product (a GEMM runs about twice a triangular solve's speed)
        eye = torch.eye(D1, dtype=torch.float64)
        self.map = torch.cat([torch.linalg.solve_triangular(L, eye, upper=False).T, self.theta], 1)

    def both(self, phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``phi [..., n, D+1]`` whitened (``L^-1 phi^T`` as rows, ``[..., n, D+1]``) and their global scores
        ``phi theta_g``, from one product."""
        out = phi.to(torch.float64) @ self.map
        D1 = phi.shape[-1]
        return out[..., :D1], out[..., D1:]

    def spectrum(self, phi: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> "Spectrum":
        """A block of clients' training rows ``phi [B, n, D+1]`` (labels, ``mask``) diagonalised once, so that every
        beta costs one batched product: the ``n x n`` kernel ``K = R R^T`` where clients hold at most ``D+1`` rows
        (the dual form), else the ``(D+1) x (D+1)`` matrix ``S = R^T R`` (the primal form), ``R = Phi_k L^-T``."""
        m = mask.to(torch.float64)[:, :, None]
        r, base = self.both(phi)
        r = r * m  # padded rows zero
        Y = torch.nn.functional.one_hot(y.clamp_min(0), self.theta.shape[1]).to(torch.float64) * m
        if r.shape[1] <= r.shape[2]:
            lam, V = torch.linalg.eigh(torch.bmm(r, r.transpose(1, 2)))
            resid = Y - base * m
            return Spectrum(lam.clamp_min(0.0), V, torch.bmm(V.transpose(1, 2), resid), None, r)
        lam, U = torch.linalg.eigh(torch.bmm(r.transpose(1, 2), r))
        Ut = U.transpose(1, 2)
        g = self.L.T @ self.theta  # L^-1 Phi^T Y = L^T theta_g
        return Spectrum(lam.clamp_min(0.0), U, torch.bmm(Ut, torch.bmm(r.transpose(1, 2), Y)), torch.matmul(Ut, g), r)


@dataclass
class Spectrum:
    """:meth:`RidgeKernel.spectrum` of a block of clients: eigenvalues ``lam [B, k]`` and vectors ``V``, the
    right-hand side's beta-free part ``fixed [B, k, C]`` and (primal form) its part per unit of beta ``glob``;
    ``r``: the whitened training rows."""

    lam: torch.Tensor
    V: torch.Tensor
    fixed: torch.Tensor
    glob: torch.Tensor | None
    r: torch.Tensor

    def project(self, r_eval: torch.Tensor) -> torch.Tensor:
        """Whitened rows to evaluate (``[B, m, D+1]``, or ``[m, D+1]`` shared by the block) in the eigenbasis."""
        if self.glob is not None:
            return torch.matmul(r_eval, self.V)
        return torch.bmm(torch.matmul(r_eval, self.r.transpose(1, 2)), self.V)

    def scores(self, proj: torch.Tensor, base: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The personal heads' scores ``[B, m, C]`` on rows ``proj`` (:meth:`project`) whose global scores are
        ``base``, each client with its own ``b [B]``: ``E theta_k``. (A client without rows has b = 0: kept
        finite, and it adds nothing.)"""
        b = torch.as_tensor(b, dtype=torch.float64).reshape(-1)
        w = 1.0 / (self.lam + b[:, None]).clamp_min(1e-300)
        if self.glob is None:
            return torch.baddbmm(base.expand(len(w), -1, -1), proj * w[:, None, :], self.fixed)
        return torch.bmm(proj * w[:, None, :], self.fixed + b[:, None, None] * self.glob)


def train_apfl(
    theta: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    head,
    ctx_of,
    epochs: int,
    lr: float,
    batch_size: int,
    alpha0: float,
    seeds: list[int],
) -> torch.Tensor:
    """APFL's personal heads for a block of clients: ``v`` (from the global ``theta``) and ``alpha`` (from
    ``alpha0``) by SGD on the client's loss of ``alpha v + (1 - alpha) theta`` (``head.loss``), ``alpha`` clipped
    to [0, 1] after each step as APFL does; ``x [B, n, D+1]``, ``y [B, n]``, ``mask [B, n]`` (padding 0), batches
    from a generator per client (``seeds``). Returns the mixed heads ``[B, C, D+1]``."""
    Bk, n = y.shape
    w = theta.detach().to(x.dtype)
    v = w.expand(Bk, *w.shape).clone().requires_grad_(True)
    alpha = torch.full((Bk,), float(alpha0), dtype=x.dtype, requires_grad=True)
    gens = [np.random.default_rng([int(s), 0xA9F1]) for s in seeds]
    sizes = mask.sum(1).to(torch.int64).tolist()
    steps = max(1, -(-max(sizes, default=1) // batch_size))
    for _ in range(epochs):
        perm = np.zeros((Bk, steps * batch_size), dtype=np.int64)
        valid = np.zeros((Bk, steps * batch_size), dtype=np.float32)
        for j, g in enumerate(gens):
            if sizes[j]:
                order = g.permutation(sizes[j])
                perm[j, : sizes[j]], valid[j, : sizes[j]] = order, 1.0
        pt, vt = torch.as_tensor(perm), torch.as_tensor(valid, dtype=x.dtype)
        for s in range(steps):
            sl = slice(s * batch_size, (s + 1) * batch_size)
            idx, mk = pt[:, sl], vt[:, sl]
            if not bool(mk.any()):
                continue
            xb = torch.gather(x, 1, idx[:, :, None].expand(-1, -1, x.shape[2]))
            yb = torch.gather(y, 1, idx)
            with torch.enable_grad():
                a = alpha[:, None, None]
                mixed = a * v + (1 - a) * w
                logits = torch.bmm(xb, mixed.transpose(1, 2))
                loss = head.loss(logits, yb, mk, ctx_of(xb.shape[1]))
                gv, ga = torch.autograd.grad(loss.sum(), (v, alpha))
            with torch.no_grad():
                v -= lr * gv
                alpha -= lr * ga
                alpha.clamp_(0.0, 1.0)
    with torch.no_grad():
        a = alpha[:, None, None]
        return (a * v + (1 - a) * w).detach()


# ---------------------------------------------------------------- metrics


def personal_summary(
    sizes: np.ndarray, correct: np.ndarray, correct_global: np.ndarray, drift: np.ndarray | None = None,
    drift_global: np.ndarray | None = None, drift_size: int = 0, seconds: float = float("nan"),
) -> dict:  # fmt: skip
    """:data:`PERSONAL_FIELDS` from each client's local test size, its personal and global correct counts and (with
    a drift set of ``drift_size`` samples) their correct counts there. Clients without a local test set count
    nowhere; the per-client statistics weigh every client once, PFL accuracy pools (FedABC's equation 7)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    ok = sizes > 0
    n = sizes[ok].astype(np.float64)
    acc_p = np.asarray(correct, dtype=np.float64)[ok] / n if ok.any() else np.zeros(0)
    acc_g = np.asarray(correct_global, dtype=np.float64)[ok] / n if ok.any() else np.zeros(0)
    gain = acc_p - acc_g
    total = float(n.sum())
    nan = float("nan")
    out = {
        "pfl_accuracy": float(np.asarray(correct)[ok].sum()) / total if total else nan,
        "pfl_accuracy_global": float(np.asarray(correct_global)[ok].sum()) / total if total else nan,
    }
    out["pfl_gain"] = out["pfl_accuracy"] - out["pfl_accuracy_global"]
    s = np.sort(acc_p)
    m = max(1, math.ceil(s.size / 10)) if s.size else 0
    out.update({
        "personal_accuracy_mean": float(s.mean()) if s.size else nan,
        "personal_accuracy_worst10": float(s[:m].mean()) if s.size else nan,
        "personal_accuracy_best10": float(s[-m:].mean()) if s.size else nan,
        "personal_accuracy_std": float(s.std()) if s.size else nan,
        "personal_gain_mean": float(gain.mean()) if gain.size else nan,
        "personal_gain_worst10": float(np.sort(gain)[:m].mean()) if gain.size else nan,
        "personal_improved": float((gain > 0).mean()) if gain.size else nan,
    })  # fmt: skip
    if drift is not None and drift_size and ok.any():
        out["drift_accuracy"] = float(np.asarray(drift)[ok].sum()) / (drift_size * ok.sum())
        out["drift_accuracy_global"] = float(np.asarray(drift_global)[ok].sum()) / (drift_size * ok.sum())
    else:
        out["drift_accuracy"] = out["drift_accuracy_global"] = nan
    out["personal_s"] = seconds
    return out
