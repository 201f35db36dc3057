"""Named methods: a set of training options under one name (``fedhead bench baselines --methods NAME``), the built-in
ones and those users register with :func:`register_method` (in a module named by ``FEDHEAD_PLUGINS`` or a
``fedhead.methods`` entry point, :func:`fedhead.core.plugins.load_plugins`)."""

from __future__ import annotations

import dataclasses

from fedhead.federation.config import TrainConfig
from fedhead.infra.errors import FedheadError

# name -> (what it is, TrainConfig fields). FedProx mu 0.01 and FedAvgM momentum 0.9 are the values their
# papers' head-to-head comparisons use most; FedAdam keeps Flower's defaults.
METHODS: dict[str, tuple[str, dict]] = {
    "ncm": ("FedNCM: normalised class means, one exchange", {"head": "ncm"}),
    "ridge": ("Fed3R: ridge regression from Phi^T Phi, Phi^T Y, one exchange", {"head": "ridge"}),
    "cof": ("FedCOF: class means + covariances from their spread, one exchange", {"head": "cof"}),
    "lda": ("shared-covariance Gaussian classifier, one exchange", {"head": "lda"}),
    "qda": ("regularised QDA (Friedman's RDA) from per-class second moments, one exchange", {"head": "qda"}),
    "fedpft": ("FedPFT: class Gaussians, server samples and fits a softmax head, one exchange", {"head": "fedpft"}),
    "ridge-rf": ("Fed3R on seeded random ReLU features, one exchange", {"head": "ridge-rf"}),
    "ncm+ft": ("FedNCM start, then softmax FedAvg", {"head": "softmax", "init": "ncm"}),
    "ridge+ft": ("Fed3R start, then softmax FedAvg", {"head": "softmax", "init": "ridge"}),
    "fast": (
        "--recipe fast: Fed3R start, then softmax FedAvg, 30 local steps a round",
        {"head": "softmax", "init": "ridge", "local_steps": 30},
    ),
    "ridge+ova2": ("Fed3R start, then OvA FedAvg", {"head": "ova2", "init": "ridge"}),
    "softmax": ("softmax head, FedAvg", {"head": "softmax"}),
    "ova2": ("OvA-LP (two-stage OvA), FedAvg", {"head": "ova2"}),
    "ova2-fedprox": ("OvA-LP with FedProx, mu 0.01", {"head": "ova2", "prox_mu": 0.01}),
    "ova2-scaffold": ("OvA-LP with SCAFFOLD (option II)", {"head": "ova2", "scaffold": True}),
    "ova2-fedadam": ("OvA-LP with FedAdam (Flower's defaults)", {"head": "ova2", "server_opt": "fedadam"}),
    "ova2-fedavgm": (
        "OvA-LP with FedAvgM, server momentum 0.9",
        {"head": "ova2", "server_opt": "fedavgm", "server_momentum": 0.9},
    ),
    "ova2-int8": (
        "OvA-LP, updates int8-quantised with error feedback (a quarter of the bytes)",
        {"head": "ova2", "aggregate": "fedavg-int8"},
    ),
    "ova2-topk": (
        "OvA-LP, top-1% updates with error feedback (values + int32 indices: 2% of the bytes)",
        {"head": "ova2", "aggregate": "fedavg-topk"},
    ),
    "ova2-topk-noef": (
        "OvA-LP, top-1% updates without error feedback (what error feedback buys)",
        {"head": "ova2", "aggregate": "fedavg-topk", "error_feedback": False},
    ),
    "fedlc": ("FedLC: logits calibrated by local class counts", {"head": "fedlc"}),
    "fedrs": ("FedRS: restricted softmax", {"head": "fedrs"}),
    "fedabc": ("FedABC binary loss", {"head": "fedabc"}),
    "softmax-ccvr": ("softmax FedAvg, then CCVR calibration", {"head": "softmax", "calibrate": "ccvr"}),
}


def register_method(name: str, description: str, **fields) -> None:
    """A named method for ``fedhead bench baselines --methods NAME``: ``fields`` are TrainConfig fields
    (``head``, ``init``, ``prox_mu``, ``server_opt``, ``head_params``, ...)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    bad = sorted(set(fields) - known)
    if bad:
        raise FedheadError(
            f"The method {name!r} sets {bad[0]!r}, which is not a training option. "
            f"Use TrainConfig field names, e.g. head, init, prox_mu, server_opt."
        )
    if "head" not in fields:
        raise FedheadError(f"The method {name!r} must name its head (head='...'). Got {sorted(fields)} instead.")
    METHODS[name] = (description, dict(fields))
