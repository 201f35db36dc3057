"""Open-set scores (issue 40): how far an input is from every class a head knows ("none of these classes").

Every score is higher for an input that looks *unknown*; a threshold ``t`` rejects the inputs whose score is above
it. All are computed from what a run's model file holds (no extra communication: the logits, and for the Gaussian
heads the statistics the server already summed):

- ``max_sigmoid``: ``1 - max_c sigmoid(z_c)`` (one-vs-all heads; in [0, 1]).
- ``msp``: ``1 - max_c softmax(z)_c``, the maximum softmax probability baseline (Hendrycks and Gimpel, ICLR 2017;
  in [0, 1]).
- ``energy``: ``-T logsumexp(z / T)`` with ``T = 1``, the energy score (Liu et al., "Energy-based Out-of-distribution
  Detection", NeurIPS 2020; any real number).
- ``max_logit``: ``-max_c z_c`` (the maximum logit, Hendrycks et al., ICML 2022); the default of heads whose scores
  are not log-probabilities (ridge's regression outputs, ncm's and cof's cosines).
- ``mahalanobis``: ``min_c (x - mu_c)^T Sigma^-1 (x - mu_c)``, the squared Mahalanobis distance to the nearest class
  mean under LDA's shared (shrunk) covariance (Lee et al., NeurIPS 2018, with the class-conditional Gaussians of
  LDA); in [0, inf). Needs the model's ``class_means [C, D]``, ``precision [D, D]`` and ``class_counts [C]`` (a class
  no client holds is left out), which the ``lda`` solve hands back.
- ``neg_loglik``: ``-max_c (s_c(x) - log pi_c)``, the negative largest class log-likelihood of a quadratic Gaussian
  head (``qda``: ``s_c`` its score, the log-joint density, ``pi_c = N_c / N`` its empirical prior, from
  ``class_counts``); any real number.

A head declares its default score as its ``unknown_score`` attribute (None: ``max_sigmoid`` for a one-vs-all head,
``energy`` otherwise). The logit scores apply to every head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from fedhead.infra.errors import FedheadError, unknown_name
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

QUANTILES = 101  # validation quantiles a model card keeps per score (0%, 1%, ..., 100%)
OPENSET_TENSORS = ("class_means", "precision", "class_counts")  # what the Gaussian scores read from a model file
BLOCK = 4096  # rows per block of the Mahalanobis distances (a [block, D] product at a time)


@dataclass(frozen=True)
class ScoreKind:
    """One open-set score: its range (``low``, ``high``; inf where unbounded), the model tensors it needs beyond the
    logits, and ``fn(logits [N, C], x [N, D] prepared features, tensors) -> [N]`` float64."""

    name: str
    low: float
    high: float
    needs: tuple
    fn: Callable

    def range_text(self) -> str:
        lo = "-inf" if self.low == -math.inf else f"{self.low:g}"
        hi = "inf" if self.high == math.inf else f"{self.high:g}"
        return f"[{lo}, {hi}]" if math.isfinite(self.low) and math.isfinite(self.high) else f"({lo}, {hi})"

    def check(self, threshold: float, param: str = "--reject") -> float:
        """``threshold`` if it is a finite number in the score's range, else one line naming the range."""
        ok = isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and math.isfinite(threshold)
        if not ok or not (self.low <= threshold <= self.high):
            raise FedheadError(
                f"The '{param}' parameter must be a finite number in the range of the {self.name!r} score "
                f"{self.range_text()} (higher: more unknown). Got {threshold!r} instead."
            )
        return float(threshold)


def _max_sigmoid(z, x, t):
    return 1.0 - torch.sigmoid(z.double()).amax(1)


def _msp(z, x, t):
    return 1.0 - torch.softmax(z.double(), 1).amax(1)


def _energy(z, x, t):
    return -torch.logsumexp(z.double(), 1)


def _max_logit(z, x, t):
    return -z.double().amax(1)


def mahalanobis(x: torch.Tensor, means: torch.Tensor, precision: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[N]``: ``min_c (x - mu_c)^T P (x - mu_c)`` over the classes with ``counts > 0`` (float64, in blocks)."""
    held = counts > 0
    if not bool(held.any()):
        raise FedheadError(
            "The 'mahalanobis' score needs at least one class with training samples; the model has none."
        )
    mu = means[held].double()
    p = precision.double()
    pm = mu @ p  # [C, D]
    mpm = (pm * mu).sum(1)  # [C]
    out = []
    for i in range(0, len(x), BLOCK):
        xb = x[i : i + BLOCK].double()
        d = (xb @ p * xb).sum(1, keepdim=True) - 2.0 * xb @ pm.T + mpm
        out.append(d.amin(1).clamp_min(0.0))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def _mahalanobis(z, x, t):
    return mahalanobis(x, t["class_means"], t["precision"], t["class_counts"])


def _neg_loglik(z, x, t):
    n = t["class_counts"].double()
    log_prior = torch.log(n.clamp_min(1.0) / n.sum().clamp_min(1.0))
    return -(z.double() - log_prior).amax(1)


SCORES = {
    s.name: s
    for s in (
        ScoreKind("max_sigmoid", 0.0, 1.0, (), _max_sigmoid),
        ScoreKind("msp", 0.0, 1.0, (), _msp),
        ScoreKind("energy", -math.inf, math.inf, (), _energy),
        ScoreKind("max_logit", -math.inf, math.inf, (), _max_logit),
        ScoreKind("mahalanobis", 0.0, math.inf, ("class_means", "precision", "class_counts"), _mahalanobis),
        ScoreKind("neg_loglik", -math.inf, math.inf, ("class_counts",), _neg_loglik),
    )
}


def score_kind(name: str, param: str = "--score") -> ScoreKind:
    """The registered score ``name``; one line listing them otherwise."""
    if name not in SCORES:
        raise unknown_name(param, name, list(SCORES))
    return SCORES[name]


def default_score(head_cls: type) -> str:
    """A head class's default open-set score: its ``unknown_score``, else by how it forms probabilities."""
    own = getattr(head_cls, "unknown_score", None)
    if own:
        return str(own)
    return "max_sigmoid" if getattr(head_cls, "probabilities", "softmax") == "sigmoid" else "energy"


def applicable(tensors: dict) -> list[str]:
    """The scores a model with the open-set ``tensors`` can compute (the logit scores always)."""
    return [n for n, s in SCORES.items() if all(k in tensors for k in s.needs)]


def unknown_scores(kind: str, logits: torch.Tensor, x: torch.Tensor, tensors: dict) -> torch.Tensor:
    """``[N]`` float64: the score ``kind`` of logits ``[N, C]`` and prepared features ``x [N, D]`` (no bias column);
    a score whose tensors the model lacks is refused in one line."""
    s = score_kind(kind)
    missing = [k for k in s.needs if k not in tensors]
    if missing:
        raise FedheadError(
            f"The '--score' parameter {kind!r} needs the model's {', '.join(missing)}, which this model file does not "
            f"hold (written before fedhead kept them, or by a head that has none). Use one of: "
            f"{', '.join(applicable(tensors))}."
        )
    with torch.no_grad():
        return s.fn(logits, x, tensors).double()


def to_prepared(tensors: dict, mean: np.ndarray | None, scale: float) -> dict:
    """Open-set tensors of raw features mapped to features prepared as ``(x - mean) / scale``: class means
    ``(mu - mean) / scale``, precision ``scale^2 P`` (the distances are unchanged); float64."""
    out = {k: v.detach().to("cpu", torch.float64) for k, v in tensors.items()}
    if "class_means" in out:
        mu = out["class_means"]
        if mean is not None:
            mu = mu - torch.as_tensor(mean, dtype=torch.float64)
        out["class_means"] = (mu / scale).contiguous()
    if "precision" in out:
        out["precision"] = (out["precision"] * scale**2).contiguous()
    return out


def quantiles(scores: torch.Tensor | np.ndarray) -> list[float]:
    """The :data:`QUANTILES` quantiles (0%, 1%, ..., 100%; linear interpolation) of ``scores``."""
    s = np.asarray(scores, dtype=np.float64)
    return [float(v) for v in np.quantile(s, np.linspace(0.0, 1.0, QUANTILES))]


def threshold_for_rate(q: list[float], rate: float) -> float:
    """The threshold above which a fraction ``rate`` of the inputs the quantiles ``q`` describe lies: the
    ``1 - rate`` quantile, interpolated between the kept ones (resolution 1%)."""
    return float(np.interp(1.0 - rate, np.linspace(0.0, 1.0, len(q)), np.asarray(q, dtype=np.float64)))


def check_quantiles(q) -> bool:
    """Whether ``q`` is a card's list of :data:`QUANTILES` finite, non-decreasing numbers."""
    if not isinstance(q, list) or len(q) != QUANTILES:
        return False
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in q):
        return False
    return all(a <= b for a, b in zip(q, q[1:]))


def validation_card(kind: str, logits: torch.Tensor, x: torch.Tensor, tensors: dict) -> dict:
    """The card's ``openset`` entry: the default score and, for every score the model can compute, the quantiles
    of its values on the run's validation part (known classes; ``--reject-rate`` reads them)."""
    q = {n: quantiles(unknown_scores(n, logits, x, tensors)) for n in applicable(tensors)}
    return {"score": kind, "validation_samples": int(len(logits)), "validation_quantiles": q}
