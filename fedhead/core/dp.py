"""Differential privacy (docs/privacy.md): the Gaussian mechanism on what the server sums, and the
accountant that turns a run's configuration into epsilon at ``--dp-delta``.

DP is on when ``--dp-noise-multiplier z`` is given (with ``--dp-clip S`` and ``--dp-delta``); every piece is one
definition run by the simulator (both backends) and by the Flower strategy:

- **Iterative heads: DP-FedAvg, client level.** The aggregation rule :class:`fedhead.core.aggregate.DPFedAvg`
  (``aggregate = "dp-fedavg"``, set by :func:`validate_dp`): each client sends its update clipped to ``S``, the
  server adds ``N(0, (z S)^2 I)`` to the sum and divides by the ``m`` clients sampled that round.
- **Statistics: per-sample clipping, sample level.** A closed-form head's sums (``ncm``, ``ridge``, ``lda``), an
  ``--init`` start's and the feature sums of ``--center`` / ``--scale rms``: each client clips every raw feature
  vector to norm ``S_f`` (``--dp-clip`` for a closed-form head, ``--dp-feature-clip`` for an iterative one) before
  computing them (:func:`clip_rows`); the server adds noise to the summed statistics once
  (:func:`privatize_statistics`, :func:`noisy_feature_sums`), calibrated to the L2 sensitivity of one sample's
  contribution (:func:`statistics_vector`).
- **Accountant**: Google's ``dp-accounting`` RDP accountant (as Flower 1.41's own ``RdpAccountant``), the
  subsampled Gaussian mechanism with Poisson sampling at rate ``q = m / K`` (:func:`epsilon_schedule`).

Noise is drawn from ``numpy.random.default_rng([seed, round, tag])`` (:func:`gaussian`): reproducible, the same on
every runner and device, and the same after ``--resume``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import numpy as np

from fedhead.core.closedform import is_closed_form
from fedhead.core.heads import HEADS
from fedhead.core.linalg import psd_part
from fedhead.core.sampling import per_round
from fedhead.infra.errors import FedheadError, Interval, validate
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

INSTALL_HINT = "pip install 'fedhead[dp]'"
# one stream per kind of release, so the noises of a seed never share draws
_TAGS = {"dp-fedavg": 0xD1F0, "statistics": 0xD1F1, "features": 0xD1F2}


def enabled(cfg) -> bool:
    return getattr(cfg, "dp_noise_multiplier", None) is not None


# ---------------------------------------------------------------- validation


def _covered() -> str:
    """The closed-form heads whose statistics the mechanism covers (from what each head needs, a plugin's too)."""
    ok = [n for n, spec in HEADS.items() if getattr(spec.cls, "closed_form", False) and not _uncovered(spec.cls)]
    return ", ".join(sorted(ok))


def _uncovered(cls) -> str:
    """Why DP's Gaussian mechanism on the summed statistics does not cover a head's (a capability of the head:
    what its solve needs), or "" when it does."""
    if getattr(cls, "needs_client_means", False):
        return "its server needs each client's class counts and means, not only their sums, so noise on the sum " \
               "protects nothing"  # fmt: skip
    if getattr(cls, "needs_second", False):
        return "no sensitivity is derived for its per-class second moments yet"
    return ""


def _refuse_statistics(flag: str, name: str | None) -> None:
    """The closed-form heads whose statistics the Gaussian mechanism does not cover, refused in one line."""
    if name is None or name not in HEADS:
        return
    why = _uncovered(HEADS[name].cls)
    if why:
        raise FedheadError(
            f"The '{flag}' parameter {name} cannot be combined with --dp-noise-multiplier: {why}. Got {name}. Use "
            f"{_covered()}."
        )


def validate_dp(c) -> None:
    """The DP options of a config being resolved (``TrainConfig.resolved``): values, presence, and what DP can be
    combined with; sets ``c.aggregate = "dp-fedavg"`` for an iterative head."""
    z = c.dp_noise_multiplier
    given = [("--dp-clip", c.dp_clip), ("--dp-delta", c.dp_delta), ("--dp-feature-clip", c.dp_feature_clip)]
    if z is None:
        for flag, v in given:
            if v is not None:
                raise FedheadError(
                    f"The '{flag}' parameter needs --dp-noise-multiplier (differential privacy is on "
                    f"only with a noise multiplier). Got {flag} {v!r} alone. Add "
                    "--dp-noise-multiplier Z (e.g. 1.0), or drop it."
                )
        if c.aggregate == "dp-fedavg":
            raise FedheadError(
                "The '--aggregate' parameter dp-fedavg needs --dp-noise-multiplier, --dp-clip and "
                "--dp-delta. Got none of them. Give them (the rule is then chosen for you)."
            )
        return
    validate(
        "--dp-noise-multiplier",
        z,
        Interval(0, None),
        "Use 0 for clipping without noise (no privacy), e.g. 1.0 for privacy.",
    )
    if c.dp_clip is None:
        raise FedheadError(
            f"The '--dp-clip' parameter is required with --dp-noise-multiplier {z!r}: the noise is "
            "calibrated to it. Got none. Add --dp-clip S (an update norm bound, e.g. 0.5, or for a "
            "closed-form head a feature-norm bound)."
        )
    validate("--dp-clip", c.dp_clip, Interval(0, None, closed="neither"), "Use a positive norm bound, e.g. 0.5.")
    if c.dp_delta is None:
        raise FedheadError(
            f"The '--dp-delta' parameter is required with --dp-noise-multiplier {z!r}: epsilon is "
            "reported at it. Got none. Add --dp-delta D, below 1/(number of clients), e.g. 1e-5."
        )
    validate(
        "--dp-delta",
        c.dp_delta,
        Interval(0, 1, closed="neither"),
        "Use a delta below 1/(number of clients), e.g. 1e-5.",
    )
    if c.dp_feature_clip is not None:
        validate(
            "--dp-feature-clip",
            c.dp_feature_clip,
            Interval(0, None, closed="neither"),
            "Use a positive feature-norm bound, e.g. the median feature norm of the store.",
        )
    for flag, name in (("--head", c.head), ("--init", c.init)):
        _refuse_statistics(flag, name)
    if is_closed_form(c.head):
        if c.dp_feature_clip is not None:
            raise FedheadError(
                f"The '--dp-feature-clip' parameter does not apply to the closed-form head {c.head!r}: "
                f"its --dp-clip is the feature-norm clip. Got --dp-feature-clip {c.dp_feature_clip!r}. "
                "Drop it."
            )
        return
    if c.aggregate not in ("fedavg", "dp-fedavg"):
        raise FedheadError(
            f"The '--aggregate' parameter {c.aggregate} cannot be combined with "
            "--dp-noise-multiplier: DP-FedAvg is the rule (every client's clipped update counts "
            "alike), and a per-class or user rule has another sensitivity. Got "
            f"--aggregate {c.aggregate}. Drop --aggregate, or drop the DP options."
        )
    c.aggregate = "dp-fedavg"
    if c.scaffold:
        raise FedheadError(
            "The '--scaffold' option cannot be combined with --dp-noise-multiplier: the control "
            "variates go to the server without clipping or noise. Got --scaffold. Drop one of them "
            "(--prox-mu and --server-opt are fine with DP)."
        )
    if c.calibrate != "none":
        raise FedheadError(
            f"The '--calibrate' parameter {c.calibrate} cannot be combined with "
            "--dp-noise-multiplier: CCVR sends class means and covariances without noise. Got "
            f"--calibrate {c.calibrate}. Drop it."
        )
    stats = [
        f for f, on in (("--center", c.center), ("--scale rms", c.scale == "rms"), (f"--init {c.init}", c.init)) if on
    ]
    if stats and c.dp_feature_clip is None:
        raise FedheadError(
            f"The '--dp-feature-clip' parameter is required: this run also sends feature statistics "
            f"({', '.join(stats)}), whose noise is calibrated to a per-sample feature-norm bound. Got "
            "none. Add --dp-feature-clip S (e.g. the median feature norm), or drop them (--no-center: "
            "centring is on in the default recipe)."
        )
    if not stats and c.dp_feature_clip is not None:
        raise FedheadError(
            f"The '--dp-feature-clip' parameter has nothing to clip: this run sends no feature "
            f"statistics (no --center, --scale rms or --init). Got {c.dp_feature_clip!r}. Drop it."
        )


def feature_clip(cfg) -> float | None:
    """The per-sample feature-norm bound of the run's statistics (None without DP)."""
    if not enabled(cfg):
        return None

    return float(cfg.dp_clip if is_closed_form(cfg.head) else cfg.dp_feature_clip)


# ---------------------------------------------------------------- noise and clipping


def gaussian(shape: tuple, std: float, seed: int, rnd: int, what: str) -> torch.Tensor:
    """``N(0, std^2)`` of ``shape`` (float64, CPU), drawn from ``default_rng([seed, rnd, tag(what)])``."""
    rng = np.random.default_rng([int(seed), int(rnd), _TAGS[what]])
    return torch.from_numpy(rng.standard_normal(shape) * float(std))


# ---------------------------------------------------------------- the statistics: vector, sensitivity, noise
#
# One sample (x, y) with ||x|| <= S adds to the summed statistics (normalised by S, so every part has sensitivity
# of order 1): u = x / S (||u|| <= 1) to row y of the class sums, 1 to count y, and (ridge, lda) the upper
# triangle of phi phi^T, phi = [u, 1]. Under add/remove-one-sample the change is that contribution, of squared
# L2 norm ||u||^2 + 1 + (||phi||^4 + sum_i phi_i^4) / 2 <= 1 + 1 + (4 + 2) / 2 = 5 (ncm: 2), with equality for
# ||x|| = S along one axis. The feature sums of --center / --scale rms: (u, 1[, ||u||^2]): 2 (rms: 3).


def statistics_sensitivity(gram: bool) -> float:
    """L2 sensitivity of :func:`statistics_vector` to adding or removing one sample."""
    return math.sqrt(5.0) if gram else math.sqrt(2.0)


def feature_sums_sensitivity(rms: bool) -> float:
    """L2 sensitivity of the normalised feature sums ``(sum u, n[, sum ||u||^2])`` to one sample."""
    return math.sqrt(3.0) if rms else math.sqrt(2.0)


def _gram_scale(D: int, bound: float) -> torch.Tensor:
    """Entry (i, j) of the upper triangle of phi phi^T in units of the normalised phi = [x / S, 1]."""
    s = torch.cat([torch.full((D,), 1.0 / bound, dtype=torch.float64), torch.ones(1, dtype=torch.float64)])
    iu = torch.triu_indices(D + 1, D + 1)
    return s[iu[0]] * s[iu[1]], iu


def statistics_vector(acc, bound: float) -> torch.Tensor:
    """The released statistics of a :class:`fedhead.core.closedform.StatsAccumulator` as one float64 vector in units
    of the clip ``bound``: class sums / S, counts, and the Gram's upper triangle of ``[x / S, 1]``."""
    parts = [acc.sums.reshape(-1) / bound, acc.counts.reshape(-1)]
    if acc.gram is not None:
        scale, iu = _gram_scale(acc.D, bound)
        parts.append(acc.gram[iu[0], iu[1]] * scale)
    return torch.cat(parts)


def _set_statistics_vector(acc, v: torch.Tensor, bound: float) -> None:
    C, D = acc.C, acc.D
    acc.sums = (v[: C * D] * bound).reshape(C, D)
    acc.counts = v[C * D : C * D + C].clone()
    if acc.gram is not None:
        scale, iu = _gram_scale(D, bound)
        g = torch.zeros(D + 1, D + 1, dtype=torch.float64)
        g[iu[0], iu[1]] = v[C * D + C :] / scale
        acc.gram = g + torch.triu(g, 1).T


def privatize_statistics(acc, cfg, seed: int):
    """The Gaussian mechanism on the summed statistics of a closed-form head or ``--init`` start (the server, once
    per seed, after the sum; both runners call it through :func:`fedhead.federation.server.solve_statistics`). The noisy Gram
    is projected onto the positive semidefinite cone (post-processing: no privacy cost) so that ``ridge``'s
    ``G + lambda I`` stays invertible (and ``lda`` projects its covariance estimate). No-op without DP."""
    if not enabled(cfg):
        return acc
    if getattr(acc, "cof_w", None) is not None:
        raise FedheadError(
            "The 'cof' statistics cannot be privatised (FedCOF needs per-client means). Use ncm, "
            "ridge or lda with --dp-noise-multiplier."
        )
    if getattr(acc, "second", None) is not None:
        raise FedheadError(
            "The per-class second moments of 'qda' and 'fedpft' cannot be privatised yet (no sensitivity is "
            "derived for them). Use ncm, ridge, ridge-rf or lda with --dp-noise-multiplier."
        )
    bound = feature_clip(cfg)
    v = statistics_vector(acc, bound)
    std = cfg.dp_noise_multiplier * statistics_sensitivity(acc.gram is not None)
    _set_statistics_vector(acc, v + gaussian((v.numel(),), std, seed, 1, "statistics"), bound)
    if acc.gram is not None:
        acc.gram = psd_part(acc.gram)
    acc.noisy = True  # lda projects its covariance estimate too
    return acc


def noisy_feature_sums(total: np.ndarray, sq: float, n, cfg, seed: int):
    """The Gaussian mechanism on the summed feature statistics of ``--center`` / ``--scale rms`` (the server, once
    per seed, after the sum; :func:`fedhead.federation.clients.federated_feature_stats` and the Flower strategy's
    ``combine_stats``): returns noisy ``(total [D], sq, n)``; the clients clipped their features to
    ``--dp-feature-clip`` before summing. No-op without DP."""
    if not enabled(cfg):
        return total, sq, n
    bound = feature_clip(cfg)
    rms = cfg.scale == "rms"
    D = len(total)
    g = gaussian((D + 2,), cfg.dp_noise_multiplier * feature_sums_sensitivity(rms), seed, 0, "features").numpy()
    total = np.asarray(total, dtype=np.float64) + g[:D] * bound
    n = float(n) + g[D]
    if rms:  # the squared norms are released only when the scale uses them
        sq = float(sq) + g[D + 1] * bound * bound
    return total, sq, n


# ---------------------------------------------------------------- the accountant


def _accounting():
    try:
        import dp_accounting
        from dp_accounting import dp_event, rdp
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "dp_accounting":
            raise FedheadError(
                "The '--dp-noise-multiplier' option needs the dp-accounting package for its "
                f"accountant, which is not installed. Install the extra: {INSTALL_HINT}"
            ) from None
        raise
    return dp_accounting, dp_event, rdp


@contextlib.contextmanager
def _quiet_absl():
    """dp-accounting logs (via absl) every fractional RDP order it skips; keep stderr for fedhead's progress."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def sampling_rate(cfg) -> float:
    """``q = m / K``: the clients fedhead samples per round (without replacement, ``m`` fixed), modelled as Poisson
    sampling at the same rate, as Flower's and TensorFlow Federated's DP documentation do."""
    return per_round(cfg) / cfg.clients


def dp_event_of(q: float, z: float):
    """One release: the Gaussian mechanism of noise multiplier ``z`` on a Poisson sample at rate ``q``."""
    _, dp_event, _ = _accounting()
    g = dp_event.GaussianDpEvent(z)
    return g if q >= 1.0 else dp_event.PoissonSampledDpEvent(q, g)


@functools.lru_cache(maxsize=32)
def _rdp_of(q: float, z: float) -> tuple[np.ndarray, np.ndarray]:
    """The RDP orders and curve of one :func:`dp_event_of` (memoised: a pure function of ``q`` and ``z``)."""
    _, _, rdp = _accounting()
    acc = rdp.RdpAccountant()
    with _quiet_absl():
        acc.compose(dp_event_of(q, z))
    return np.asarray(acc.orders), np.asarray(acc.rdp)


def _epsilon(orders: np.ndarray, rdp_vec: np.ndarray, delta: float) -> float:
    _, _, rdp = _accounting()
    if not np.any(rdp_vec):
        return 0.0  # nothing released yet
    with _quiet_absl():
        return float(rdp.compute_epsilon(orders, rdp_vec, delta)[0])


def epsilon_schedule(cfg, last_round: int) -> dict[int, dict]:
    """Per round ``1..last_round`` of a resolved DP config, the columns rounds.csv gets (``{}`` without DP):

    - ``dp_epsilon``: epsilon at ``--dp-delta`` of everything released up to that round, in the run's unit of
      privacy: an iterative head's head updates, client level (``t`` DP-FedAvg rounds: the Poisson-subsampled
      Gaussian at ``q`` composed ``t`` times); a closed-form head's statistics, sample level;
    - ``dp_epsilon_statistics`` (when the run sends statistics): the sample-level epsilon of them (the feature sums
      of --center / --scale rms from every client once, an ``--init`` or closed-form exchange from the round-1
      sample of clients), composed.

    RDP accounting of dp-accounting (add-or-remove-one neighbours); ``t`` rounds compose as ``t`` times one
    round's RDP curve, what ``RdpAccountant.compose(event, t)`` computes."""
    if not enabled(cfg):
        return {}

    z, delta, q = float(cfg.dp_noise_multiplier), float(cfg.dp_delta), sampling_rate(cfg)
    closed = is_closed_form(cfg.head)
    orders, one_round = _rdp_of(q, z)
    stats_rdp = np.zeros_like(one_round)
    if not closed and (cfg.center or cfg.scale == "rms"):
        stats_rdp = stats_rdp + _rdp_of(1.0, z)[1]  # every client, once, before round 1
    if closed or cfg.init:
        stats_rdp = stats_rdp + one_round  # the round-1 sample of clients
    eps_stats = _epsilon(orders, stats_rdp, delta) if np.any(stats_rdp) else None
    out = {}
    for rnd in range(1, last_round + 1):
        if closed:
            row = {"dp_epsilon": eps_stats}
        else:
            trained = rnd - (1 if cfg.init else 0)  # round 1 of an --init run is the exchange
            row = {"dp_epsilon": _epsilon(orders, trained * one_round, delta) if trained else 0.0}
        if eps_stats is not None:
            row["dp_epsilon_statistics"] = eps_stats
        out[rnd] = row
    return out


def summary_fields(cfg, schedule: dict[int, dict]) -> dict:
    """What summary.json records about DP (``{}`` without it): the final epsilon, its delta and how it was got."""
    if not enabled(cfg) or not schedule:
        return {}
    from importlib.metadata import version

    _accounting()
    last = schedule[max(schedule)]
    closed = is_closed_form(cfg.head)
    out = {
        "dp_epsilon": last["dp_epsilon"],
        "dp_delta": float(cfg.dp_delta),
        "dp_level": "sample" if closed else "client",
        "dp_noise_multiplier": float(cfg.dp_noise_multiplier),
        "dp_clip": float(cfg.dp_clip),
        "dp_sampling_rate": sampling_rate(cfg),
        "dp_accountant": f"RDP, dp-accounting {version('dp-accounting')}: Poisson-subsampled Gaussian at the "
        "sampling rate, add-or-remove-one neighbours",
    }
    if "dp_epsilon_statistics" in last:
        out["dp_epsilon_statistics"] = last["dp_epsilon_statistics"]
        out["dp_feature_clip"] = feature_clip(cfg)
    return out
