"""One-round heads from class moments (issue 25): each is one message of sums, solved once by the server.

- ``qda``: regularised quadratic discriminant analysis, Friedman's RDA (J. H. Friedman, "Regularized
  Discriminant Analysis", JASA 84(405), 1989). Clients add the per-class second moments ``sum x x^T`` to the
  class sums and counts. With the class scatter ``S_c = sum_{y=c} x x^T - N_c mu_c mu_c^T`` and the pooled
  scatter ``S = sum_c S_c``, the class covariance is blended with the pooled one,
  ``Sigma_c(lambda) = ((1 - lambda) S_c + lambda S) / ((1 - lambda) N_c + lambda N)``, then shrunk toward a
  scaled identity, ``Sigma_c(lambda, gamma) = (1 - gamma) Sigma_c(lambda) + gamma tr(Sigma_c(lambda)) / D I``
  (Friedman's eqs. 16 and 18). Score: ``-1/2 (x - mu_c)^T Sigma_c^-1 (x - mu_c) - 1/2 log det Sigma_c +
  log(N_c / N)`` (empirical prior). ``lambda = 1, gamma = 0`` is LDA with the pooled ML covariance; ``lambda = 0,
  gamma = 0`` plain QDA. Friedman chooses both by cross-validation; fedhead uses fixed defaults chosen before
  any measurement (``qda_lambda`` 0.5, ``qda_gamma`` 0.1: half-way between LDA and QDA, light shrinkage), never
  tuned on a test split; both are options. The head is the quadratic form of each class on ``z = [x, 1]``,
  ``theta [C, D+1, D+1]`` float64 with ``z^T theta_c z`` the score: not a linear head.
- ``fedpft``: FedPFT (Beitollahi et al., "Parametric Feature Transfer: One-shot Federated Learning with
  Foundation Models", 2024; the Flower baseline ``baselines/fedpft``) with one Gaussian component per class and a
  full covariance: the server pools the class moments, draws synthetic features from ``N(mu_c, Sigma_c)``
  (``Sigma_c`` the unbiased class covariance; as many draws per class as the class has real samples, as the Flower
  baseline draws ``num_samples`` per component, or ``fedpft_samples`` each) from ``default_rng(fedpft_seed)``, and
  fits a softmax linear head on them with the central trainer (:func:`fedhead.core.central.central_head`: full-batch
  L-BFGS, L2 weight ``fedpft_weight_decay``; the baseline trains one AdamW epoch instead). A linear head on raw
  features.
- ``ridge-rf``: Fed3R's ridge solve (Fanì et al., ICML 2024) on random features ``phi(x) = relu(x W)`` with
  ``W [D, F]`` drawn ``N(0, 1/D)`` from ``torch.Generator().manual_seed(rf_seed)`` (ReLU random features, the
  arc-cosine kernel of order 1 of Cho and Saul, NeurIPS 2009); the width ``rf_width`` 2048 is fedhead's default
  (Fed3R's paper reports a random-features variant; its public code, ``Erosinho13/Fed3R``, has none to take a
  default from). Every client draws the same ``W`` from the seed, so only the seed travels; the model card keeps
  ``rf_seed`` and ``rf_width`` and prediction draws ``W`` again. ``theta [C, F+1]`` acts on ``[phi(x), 1]``.
"""

from __future__ import annotations

import math

import numpy as np

from fedhead.core.central import central_head
from fedhead.core.closedform import SKETCH_PARAMS, ClosedFormHead, StatsAccumulator, _means, ridge_solve
from fedhead.core.heads import Param, create_head, register_head
from fedhead.infra.errors import FedheadError, Interval
from fedhead.infra.lazy import lazy_module, on_import

torch = lazy_module("torch")


def _bind_torch(t) -> None:
    """``F64 = torch.float64`` (closedform's), run once torch is imported, by whoever imports it."""
    global F64
    F64 = t.float64


on_import("torch", _bind_torch)

ABSENT_SCORE = -1e30  # the score of a class no client holds in a quadratic head (never the argmax)


def _class_covariances(acc: StatsAccumulator, unbiased: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Class means ``[C, D]``, held mask ``[C]`` and class scatters ``S_c`` (``unbiased``: divided by
    ``N_c - 1``, zero for ``N_c = 1``) ``[C, D, D]``, in place of ``acc.second``'s memory where possible."""
    mu, held = _means(acc)
    n = acc.counts
    scat = acc.second - n[:, None, None] * mu[:, :, None] * mu[:, None, :]
    scat = (scat + scat.transpose(1, 2)) / 2
    if unbiased:
        scat = scat / (n - 1).clamp_min(1.0)[:, None, None]
    return mu, held, scat


@register_head(
    "qda",
    Param(
        "qda_lambda",
        0.5,
        Interval(0, 1),
        "qda: weight of the pooled covariance in each class's (Friedman's lambda)",
        grid=(0.0, 0.5, 1.0),
    ),
    Param(
        "qda_gamma", 0.1, Interval(0, 1), "qda: shrinkage toward trace/D * I (Friedman's gamma)", grid=(0.01, 0.1, 0.5)
    ),  # fmt: skip
    *SKETCH_PARAMS,
)
class QDAHead(ClosedFormHead):
    """Regularised QDA (Friedman's RDA) from class sums, counts and per-class second moments (closed form)."""

    needs_second = True
    init_capable = False
    linear = False
    unknown_score = "neg_loglik"  # open-set: the largest class log-likelihood, its prior taken out

    def solve(self, acc):
        lam, gam = float(self.params["qda_lambda"]), float(self.params["qda_gamma"])
        C, D = acc.C, acc.D
        mu, held, scat = _class_covariances(acc, unbiased=False)
        n = acc.counts
        N = float(n.sum())
        pooled = scat[held].sum(0)
        theta = torch.zeros(C, D + 1, D + 1, dtype=F64)
        theta[:, D, D] = ABSENT_SCORE
        eye = torch.eye(D, dtype=F64)
        for c in torch.nonzero(held).flatten().tolist():
            sig = ((1 - lam) * scat[c] + lam * pooled) / ((1 - lam) * float(n[c]) + lam * N)
            sig = (1 - gam) * sig + gam * float(torch.trace(sig)) / D * eye
            L, info = torch.linalg.cholesky_ex(sig)
            if int(info) != 0 or float(L.diagonal().min()) <= 0:
                raise FedheadError(
                    f"The '--qda-gamma' parameter leaves the covariance of class {c} ({int(n[c])} samples, D = {D}) "
                    f"singular (lambda {lam!r}, gamma {gam!r}). Raise --qda-gamma (e.g. 0.1) or --qda-lambda."
                )
            prec = torch.cholesky_inverse(L)
            pm = prec @ mu[c]
            logdet = 2.0 * float(torch.log(L.diagonal()).sum())
            theta[c, :D, :D] = -0.5 * prec
            theta[c, :D, D] = 0.5 * pm
            theta[c, D, :D] = 0.5 * pm
            theta[c, D, D] = -0.5 * float(mu[c] @ pm) - 0.5 * logdet + math.log(float(n[c]) / N)
        return theta

    def openset_statistics(self, acc):
        """The class counts (the prior the ``neg_loglik`` score takes out of the scores)."""
        return {"class_counts": acc.counts.clone()}

    def logits(self, theta, x):
        z = x.to(F64)
        q = theta.to(F64)
        return torch.stack([((z @ q[c]) * z).sum(1) for c in range(q.shape[0])], 1)


@register_head(
    "fedpft",
    Param("fedpft_samples", 0, Interval(0, None, integer=True),
          "fedpft: synthetic features drawn per class (0: as many as the class's real samples, as FedPFT)"),
    Param("fedpft_seed", 0, Interval(0, None, integer=True), "fedpft: seed of the server's draws"),
    Param("fedpft_weight_decay", 1e-4, Interval(0, None), "fedpft: L2 weight of the server's softmax fit"),
)  # fmt: skip
class FedPFTHead(ClosedFormHead):
    """FedPFT: per-class Gaussians from class moments; the server samples features and fits a softmax head."""

    needs_second = True
    init_capable = False

    def sample(self, acc: StatsAccumulator) -> tuple[np.ndarray, np.ndarray]:
        """The synthetic features ``[M, D]`` float32 and labels ``[M]``, class by class from one seeded generator."""
        mu, held, cov = _class_covariances(acc, unbiased=True)
        per = int(self.params["fedpft_samples"])
        rng = np.random.default_rng(int(self.params["fedpft_seed"]))
        xs, ys = [], []
        for c in torch.nonzero(held).flatten().tolist():
            s = per or int(acc.counts[c])
            lam, vec = np.linalg.eigh(cov[c].numpy())
            a = vec * np.sqrt(np.clip(lam, 0.0, None))  # Sigma = A A^T (rounding below 0 clipped)
            xs.append((rng.standard_normal((s, acc.D)) @ a.T + mu[c].numpy()).astype(np.float32))
            ys.append(np.full(s, c, dtype=np.int64))
        if not xs:
            raise FedheadError("The 'fedpft' head got no class statistics (no client held a sample).")
        return np.concatenate(xs), np.concatenate(ys)

    def solve(self, acc):
        """The softmax fit over the held classes only: a class no client holds keeps a zero row."""
        xv, yv = self.sample(acc)
        held = torch.nonzero(acc.counts > 0).flatten()
        local = torch.full((acc.C,), -1, dtype=torch.int64)
        local[held] = torch.arange(len(held))
        x = torch.cat([torch.as_tensor(xv), torch.ones(len(xv), 1)], 1)
        fit, _ = central_head(create_head("softmax"), x, local[torch.as_tensor(yv)], len(held),
                              float(self.params["fedpft_weight_decay"]))  # fmt: skip
        theta = torch.zeros(acc.C, acc.D + 1, dtype=F64)
        theta[held] = fit.to(F64)
        return theta


class RandomFeatures:
    """``phi(x) = relu(x W)``, ``W [D, F]`` from ``N(0, 1/D)`` seeded (see the module docstring)."""

    def __init__(self, in_dim: int, width: int, seed: int):
        g = torch.Generator().manual_seed(int(seed))
        self.w = torch.randn(in_dim, width, generator=g, dtype=F64) / math.sqrt(in_dim)
        self.dim = width

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.to(F64) @ self.w)


@register_head(
    "ridge-rf",
    Param(
        "rf_lambda",
        0.01,
        Interval(0, None, closed="neither"),
        "ridge-rf: ridge regulariser lambda (Fed3R's 0.01)",
        grid=(1e-3, 1e-2, 1e-1, 1.0, 10.0),
    ),  # fmt: skip
    Param("rf_width", 2048, Interval(1, None, integer=True), "ridge-rf: number of random ReLU features"),
    Param("rf_seed", 0, Interval(0, None, integer=True), "ridge-rf: seed of the shared random projection"),
    *SKETCH_PARAMS,
)
class RidgeRFHead(ClosedFormHead):
    """Fed3R's ridge on seeded random ReLU features of the raw features (closed form; not linear in x)."""

    log_scores = False  # regression scores / cosines: no log prior can be added (--personalize prior)
    unknown_score = "max_logit"  # open-set: the largest score is no log-probability

    needs_gram = True
    init_capable = False
    linear = False

    def __init__(self, **params):
        super().__init__(**params)
        self._maps: dict[int, RandomFeatures] = {}

    def lift(self, dim: int) -> RandomFeatures:
        if dim not in self._maps:
            self._maps[dim] = RandomFeatures(dim, int(self.params["rf_width"]), int(self.params["rf_seed"]))
        return self._maps[dim]

    def solve(self, acc):
        return ridge_solve(acc, float(self.params["rf_lambda"]), False, "--rf-lambda")

    def logits(self, theta, x):
        phi = self.lift(x.shape[1] - 1)(x[:, :-1])
        return torch.cat([phi, torch.ones(len(phi), 1, dtype=F64)], 1) @ theta.T.to(F64)
