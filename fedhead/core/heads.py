"""Head registry (SPEC sections 1 and 3): every head is a local loss over client-stacked logits.

The engine computes ``logits[k, i, c] = w_c . z_i + b_c`` for a block of clients ``k`` at once and asks the
head for the loss of each client (mean over that client's valid samples of the per-sample loss). Heads
differ only in that function; nothing else in the trainer knows which head runs.

Shapes: ``logits [K, B, C]``, ``y [K, B]`` (int64), ``mask [K, B]`` (1.0 valid, 0.0 padding), context
tensors ``present [K, C]`` (classes with local positives), ``counts [K, C]`` (local class counts) and
``u [K, B]`` (uniform numbers drawn per sample from the client's own seeded generator).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhead.core.plugins import load_plugins
from fedhead.infra.errors import FedheadError, Interval, unknown_name
from fedhead.infra.lazy import lazy_module
from fedhead.infra.params import Param, doc_line, resolve_params

torch = lazy_module("torch")
F = lazy_module("torch.nn.functional")


@dataclass
class LossContext:
    """What a head's loss may use besides logits and labels: the round, the classes each client holds and their
    counts (FedRS, FedLC, FedABC), and one uniform number per sample (OvA-LP's ``positive_keep``)."""

    round: int  # 1-based round number
    present: torch.Tensor  # [K, C] bool
    counts: torch.Tensor  # [K, C] float
    u: torch.Tensor  # [K, B] uniform in [0, 1)


class Head:
    """Base head: subclasses implement :meth:`per_sample` (or :meth:`loss`)."""

    name = ""
    # how a saved model (fedhead.federation.model) turns logits into class probabilities: "softmax", or
    # "sigmoid" (one-vs-all: each class's sigmoid, normalised to sum to 1 as scikit-learn's OneVsRestClassifier)
    probabilities = "softmax"
    # the open-set score a saved model reports by default (fedhead.core.openset.SCORES; None: "max_sigmoid" for a
    # one-vs-all head, "energy" otherwise)
    unknown_score: str | None = None

    def __init__(self, **params):
        self.params = params

    def stage(self, round: int) -> str:
        return "train"

    def per_sample(self, logits: torch.Tensor, y: torch.Tensor, ctx: LossContext) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
        """Per-client mean loss ``[K]`` over valid samples."""
        per = self.per_sample(logits, y, ctx)
        return (per * mask).sum(1) / mask.sum(1).clamp_min(1.0)

    def predict(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)

    def logits(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Scores ``[N, C]`` of the head ``theta`` on features ``x [N, D+1]`` (trailing 1): ``x @ theta^T`` for a
        linear head; a head that is not linear in ``x`` (``qda``, ``ridge-rf``) overrides it."""
        return x @ theta.T.to(x.dtype)

    linear = True  # whether theta [C, D+1] acts linearly on x (an exported or --init head must)
    # whether the scores are log-probabilities up to a per-sample constant (softmax and one-vs-all logits, LDA's and
    # QDA's log densities), so that adding a log prior is Bayes' rule (--personalize prior); regression scores
    # (ridge, ncm's cosines) are not
    log_scores = True

    # Optional fast path: ``loss_and_grad(logits, y, mask, ctx) -> (loss [K], d sum(loss) / d logits [K, B, C])``
    # in closed form. The engine uses it when a head defines it and autograd on :meth:`loss` otherwise.


@dataclass
class HeadSpec:
    name: str
    cls: type
    params: list[Param]
    doc: str


HEADS: dict[str, HeadSpec] = {}


def register_head(name: str, *params: Param):
    """A class decorator: register a :class:`Head` subclass as the head ``name`` with its declared parameters
    (``--head NAME`` and its flags, ``TrainConfig(head=NAME, ...)``, every bench command and Flower). The first
    paragraph of the class's docstring, if it has one, describes it in the documentation."""

    def deco(cls):
        cls.name = name
        HEADS[name] = HeadSpec(name, cls, list(params), doc_line(cls))
        return cls

    return deco


def head_names() -> list[str]:
    """Every registered head: the iterative ones here, the closed-form ones of :mod:`fedhead.core.closedform`."""
    return sorted(HEADS)


def iterative_head_names() -> list[str]:
    """The heads with a local loss (trained by the engine), i.e. all but the closed-form ones."""
    return sorted(n for n in HEADS if not getattr(HEADS[n].cls, "closed_form", False))


def resolve_head_params(name: str, **params) -> dict:
    if name not in HEADS:
        load_plugins()  # a user's head registered in FEDHEAD_PLUGINS or a fedhead.methods entry point
    if name not in HEADS:
        raise unknown_name("--head", name, HEADS, "head")
    spec = HEADS[name]
    mine = {p.name for p in spec.params}
    return resolve_params(spec.params, {k: v for k, v in params.items() if k in mine}, f"head {name}")


def create_head(name: str, **params) -> Head:
    """Look a head up by name; parameters of other heads are ignored, missing ones take defaults."""
    resolved = resolve_head_params(name, **params)
    return HEADS[name].cls(**resolved)


# ---------------------------------------------------------------- losses


def _onehot(y: torch.Tensor, C: int, dtype) -> torch.Tensor:
    return F.one_hot(y, C).to(dtype)


SOFTPLUS_LINEAR = 40.0  # softplus(s) = s past this: log1p(e^-40) = 4e-18, below float64's rounding of 40


def softplus(s: torch.Tensor) -> torch.Tensor:
    """``log(1 + e^s)`` in one pass of torch's vectorized kernel, exact to float64 rounding (its default threshold,
    20, drops ``2e-9``). Measured on 2 AVX2 cores, [1000, 16, 1203] float32: 64 ms, against 179 ms for the stable
    form ``max(s, 0) + log1p(e^-|s|)`` written from separate ops (six passes over the logits)."""
    return F.softplus(s, threshold=SOFTPLUS_LINEAR)


def _mean_weights(mask: torch.Tensor) -> torch.Tensor:
    """``mask / n_valid`` per client: the per-client mean as weights ``[K, B]``."""
    return mask / mask.sum(1, keepdim=True).clamp_min(1.0)


@register_head("softmax")
class SoftmaxHead(Head):
    """LP-softmax: cross-entropy over the C logits."""

    def per_sample(self, logits, y, ctx):
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none")

    def loss_and_grad(self, logits, y, mask, ctx):
        # one log-softmax pass serves the loss (-log p_y) and the gradient (p - onehot(y)); 1.9 s of a 12.5 s
        # round at 10,000 clients x 1,203 classes went to computing logsumexp and softmax separately
        wgt, yi = _mean_weights(mask), y.unsqueeze(2)
        g = torch.log_softmax(logits, -1)
        per = -g.gather(2, yi).squeeze(2)
        g.exp_()
        g.scatter_add_(2, yi, torch.full_like(yi, -1.0, dtype=g.dtype))
        return (per * wgt).sum(1), g.mul_(wgt.unsqueeze(2))


def ova_terms(logits: torch.Tensor, y: torch.Tensor):
    """Per-class BCE terms split into the positive term (y=c) and the negative terms (y!=c)."""
    t = _onehot(y, logits.shape[-1], logits.dtype)
    pos = F.softplus(-logits) * t  # -log sigma(s_y)
    neg = F.softplus(logits) * (1.0 - t)  # -log (1 - sigma(s_c)), c != y
    return pos, neg


@register_head("ova")
class OvAHead(Head):
    """OvA: sum over classes of BCE(s_c, 1[y=c]) (one positive, C-1 negative terms per sample)."""

    probabilities = "sigmoid"

    def per_sample(self, logits, y, ctx):
        pos, neg = ova_terms(logits, y)
        return (pos + neg).sum(-1)

    def loss_and_grad(self, logits, y, mask, ctx):
        # per sample: sum_c softplus(s_c) - s_y; gradient sigmoid(s) - onehot(y)
        wgt, yi = _mean_weights(mask), y.unsqueeze(2)
        per = softplus(logits).sum(-1) - logits.gather(2, yi).squeeze(2)
        g = torch.sigmoid(logits)
        g.scatter_add_(2, yi, torch.full_like(yi, -1.0, dtype=g.dtype))
        return (per * wgt).sum(1), g.mul_(wgt.unsqueeze(2))


@register_head(
    "ova2",
    Param("stage1_rounds", 1, Interval(0, None, integer=True), "rounds of the positive-only stage 1"),
    Param(
        "positive_keep",
        1.0,
        Interval(0, 1, closed="right"),
        "stage 2: probability of keeping each sample's positive term (1.0 = plain OvA BCE)",
    ),
)
class OvA2Head(Head):
    """OvA-LP: positive-only stage 1, then OvA BCE (positive terms kept with probability rho)."""

    probabilities = "sigmoid"

    def stage(self, round):
        return "stage1" if round <= self.params["stage1_rounds"] else "stage2"

    def per_sample(self, logits, y, ctx):
        pos, neg = ova_terms(logits, y)
        if self.stage(ctx.round) == "stage1":
            return pos.sum(-1)
        keep = self.params["positive_keep"]
        pos_s = pos.sum(-1)
        if keep < 1.0:
            pos_s = pos_s * (ctx.u < keep).to(pos_s.dtype)
        return pos_s + neg.sum(-1)

    def loss_and_grad(self, logits, y, mask, ctx):
        # stage 1: softplus(-s_y), gradient (sigmoid(s_y) - 1) at y only; stage 2: r * softplus(-s_y) +
        # sum_{c != y} softplus(s_c), gradient sigmoid(s_c) off y and r * (sigmoid(s_y) - 1) at y
        wgt, yi = _mean_weights(mask), y.unsqueeze(2)
        sy = logits.gather(2, yi)  # [K, B, 1]
        if self.stage(ctx.round) == "stage1":
            per = softplus(-sy).squeeze(2)
            g = torch.zeros_like(logits).scatter_(2, yi, (torch.sigmoid(sy) - 1.0) * wgt.unsqueeze(2))
            return (per * wgt).sum(1), g
        keep = self.params["positive_keep"]
        r = (ctx.u < keep).to(logits.dtype) if keep < 1.0 else None
        sp = softplus(logits)
        spy = sp.gather(2, yi).squeeze(2)
        pos = spy - sy.squeeze(2)  # softplus(-s_y)
        per = (pos * r if r is not None else pos) + sp.sum(-1) - spy
        g = torch.sigmoid(logits)
        gy = g.gather(2, yi) - 1.0
        g.scatter_(2, yi, gy * r.unsqueeze(2) if r is not None else gy)
        return (per * wgt).sum(1), g.mul_(wgt.unsqueeze(2))


def _margins_or_none(v) -> tuple | None:
    """``mp,mn,mnn`` (text or a sequence) as three floats in (0, 1), else None."""
    if isinstance(v, str):
        try:
            v = tuple(float(x) for x in v.replace(" ", "").split(","))
        except ValueError:
            return None
    if not isinstance(v, (tuple, list)) or len(v) != 3:
        return None
    try:
        m = tuple(float(x) for x in v)
    except (TypeError, ValueError):
        return None
    return m if all(0 < x < 1 for x in m) else None


@dataclass(frozen=True)
class Margins:
    """The declared constraint of ``--fedabc-margins`` (checked with the other head parameters, so a bad
    value is refused before anything is written, and the message shows the text given)."""

    def ok(self, v) -> bool:
        return _margins_or_none(v) is not None

    def describe(self) -> str:
        return "must be three numbers in (0, 1) as mp,mn,mnn, e.g. 0.85,0.2,0.3"


def _parse_margins(v) -> tuple:
    m = _margins_or_none(v)
    if m is None:
        raise FedheadError(f"The '--fedabc-margins' parameter {Margins().describe()}. Got {v!r} instead.")
    return m


@register_head(
    "fedabc",
    Param(
        "fedabc_margins", "0.85,0.2,0.3", Margins(), "FedABC margins mp,mn,mnn (CIFAR-10 defaults; MNIST 0.75,0.25,0.3)"
    ),
    Param("focal_gamma", 2.0, Interval(0, None), "FedABC focal exponent gamma"),
)
class FedABCHead(Head):
    """FedABC binary loss with local-class margins and focal weights (SPEC section 3)."""

    probabilities = "sigmoid"

    def __init__(self, **params):
        super().__init__(**params)
        self.mp, self.mn, self.mnn = _parse_margins(params["fedabc_margins"])

    def per_sample(self, logits, y, ctx):
        g = self.params["focal_gamma"]
        q = torch.sigmoid(logits)
        t = _onehot(y, logits.shape[-1], logits.dtype)
        qd = q.detach()
        P = ctx.present[:, None, :].to(logits.dtype)  # [K, 1, C]
        pos_mask = t * P * (qd < self.mp)
        negp_mask = (1 - t) * P * (qd > self.mn)
        negn_mask = (1 - t) * (1 - P) * (qd > self.mnn)
        log_q = -F.softplus(-logits)  # log sigma(s)
        log_1mq = -F.softplus(logits)  # log (1 - sigma(s))
        pos = -((1 - q) ** g) * log_q
        neg = -(q**g) * log_1mq
        return (pos_mask * pos + (negp_mask + negn_mask) * neg).sum(-1)


@register_head(
    "fedrs",
    Param("fedrs_alpha", 0.5, Interval(0, 1), "FedRS scaling of absent-class logits"),
)
class FedRSHead(Head):
    """FedRS: softmax CE with logits scaled by alpha + (1 - alpha) n_c / max_j n_j (absent classes: alpha)."""

    def per_sample(self, logits, y, ctx):
        a = self.params["fedrs_alpha"]
        cnt = ctx.counts
        scale = a + (1 - a) * cnt / cnt.amax(-1, keepdim=True).clamp_min(1.0)  # [K, C]
        return F.cross_entropy((logits * scale[:, None, :]).transpose(1, 2), y, reduction="none")


FEDLC_MIN_COUNT = 1e-8  # FedLC: counts are clamped here (FL-bench's value), so an absent class shifts by tau * 100


@register_head(
    "fedlc",
    Param("fedlc_tau", 1.0, Interval(0, None), "FedLC calibration strength tau (FL-bench's default 1.0)"),
)
class FedLCHead(SoftmaxHead):
    """FedLC: softmax CE on calibrated logits z_j - tau * n_j^(-1/4), the true class kept in the denominator.

    Zhang et al., ICML 2022 (logit calibration for label skew). ``n_j`` is the client's local count of class
    ``j`` (``ctx.counts``). The paper's literal form drops the true class from the denominator; that form
    collapses (FL-bench issue 5) and public implementations (FL-bench ``src/client/fedlc.py``, fluke) keep it,
    as here. A class with ``n_j = 0`` is clamped to ``n_j = 1e-8`` as FL-bench does, so its logit is lowered by
    ``tau * 100``: the class practically leaves the local softmax (its gradient is ~exp(-100 tau), like FedRS
    with alpha = 0), instead of being pushed down as a one-sample class would be. With ``tau = 0`` the head is
    ``softmax`` exactly. Training only: prediction is the argmax of the raw logits.
    """

    def shift(self, ctx: LossContext) -> torch.Tensor:
        """``tau * max(n_j, 1e-8)^(-1/4)`` as ``[K, 1, C]``."""
        n = ctx.counts.clamp_min(FEDLC_MIN_COUNT)
        return (self.params["fedlc_tau"] * n.pow(-0.25))[:, None, :]

    def per_sample(self, logits, y, ctx):
        return super().per_sample(logits - self.shift(ctx).to(logits.dtype), y, ctx)

    def loss_and_grad(self, logits, y, mask, ctx):
        # the shift is a constant: d loss / d logits = d loss / d calibrated logits (softmax's closed form)
        return super().loss_and_grad(logits - self.shift(ctx).to(logits.dtype), y, mask, ctx)


@register_head("bsm")
class BalancedSoftmaxHead(FedLCHead):
    """Balanced softmax: softmax CE on logits z_j + log n_j, the client's label prior added (FedRoD's generic head).

    Ren et al., NeurIPS 2020; FedRoD (Chen and Chao, ICLR 2022) trains its generic head with it so that the
    aggregated head estimates the class-balanced posterior. ``n_j`` is the client's local count of class ``j``; an
    absent class is clamped to ``1e-8`` (as FedLC's counts), so its logit drops by 18.4 and it practically leaves the
    local softmax. Training only: prediction is the argmax of the raw logits (the balanced posterior).
    """

    def shift(self, ctx: LossContext) -> torch.Tensor:
        """``-log max(n_j, 1e-8)`` as ``[K, 1, C]`` (the base class subtracts the shift)."""
        return -torch.log(ctx.counts.clamp_min(FEDLC_MIN_COUNT))[:, None, :]
