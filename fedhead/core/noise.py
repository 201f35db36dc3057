"""Label noise applied per client after partitioning (SPEC section 6, FedLTF protocol; test set stays clean).

Noise models are registered by name (:data:`NOISE_KINDS`). Each client gets its own generator
``numpy.random.default_rng([seed, 7919, client_index])``, so a client's noise does not depend on the others.

- ``symmetric`` r: exactly floor(r*n) of a client's samples get a label drawn uniformly from the other C-1.
- ``asymmetric`` r: floor(r*n) samples, drawn from all classes, go through a fixed class map
  (:func:`asymmetric_map`); where the map is the identity the label stays, so the realised rate is lower.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from fedhead.infra.errors import FedheadError, Interval, unknown_name, validate

__all__ = ["NOISE", "NOISE_KINDS", "ASYM_RULES", "register_noise", "asymmetric_map", "apply_noise"]

# kind -> fn(labels, rate, num_classes, rng, amap) -> new labels (input untouched)
NOISE: dict[str, Callable] = {}
ASYM_RULES = ("auto", "cyclic")
_SEED_SALT = 7919


def register_noise(name: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        NOISE[name] = fn
        return fn

    return deco


# ---------------------------------------------------------------- class maps


def _cifar10(c: int) -> np.ndarray:
    m = np.arange(c)
    # truck -> automobile, bird -> airplane, deer -> horse, cat <-> dog
    m[9], m[2], m[4], m[3], m[5] = 1, 0, 7, 5, 3
    return m


def _cifar100(c: int) -> np.ndarray:
    y = np.arange(c)
    return (y // 5) * 5 + (y + 1) % 5  # next index inside each block of 5; 5k+4 -> 5k


def _mnist(c: int) -> np.ndarray:
    m = np.arange(c)
    m[2], m[3], m[5], m[6] = 7, 8, 6, 5
    return m


# normalised dataset name -> (number of classes, map builder)
_MAPS: dict[str, tuple[int, Callable[[int], np.ndarray]]] = {
    "cifar10": (10, _cifar10),
    "cifar100": (100, _cifar100),
    "mnist": (10, _mnist),
    "fashionmnist": (10, _mnist),
    "fmnist": (10, _mnist),
}


def _norm(dataset: str) -> str:
    return re.sub(r"[^a-z0-9]", "", str(dataset).lower())


def asymmetric_map(dataset: str, num_classes: int, rule: str = "auto") -> np.ndarray:
    """Target class per class, shape [C] int64, for asymmetric noise.

    ``rule="auto"`` picks the map by dataset name (cifar10, cifar100, mnist, fashion-mnist/fmnist);
    ``rule="cyclic"`` is y -> (y+1) mod C for any dataset.
    """
    validate("--num-classes", num_classes, Interval(2, None, integer=True))
    num_classes = int(num_classes)
    if rule == "cyclic":
        return (np.arange(num_classes, dtype=np.int64) + 1) % num_classes
    if rule != "auto":
        raise unknown_name("--asym-map", rule, ASYM_RULES, "asymmetric map rule")
    key = _norm(dataset)
    if key not in _MAPS:
        raise FedheadError(
            f"The '--noise' parameter asymmetric has no class map for dataset {dataset!r}. Maps exist for "
            f"cifar10, cifar100, mnist, fashion-mnist (fmnist). Use '--asym-map cyclic' to apply "
            f"y -> (y+1) mod C instead."
        )
    want, build = _MAPS[key]
    if num_classes != want:
        raise FedheadError(
            f"The asymmetric noise map for {dataset!r} needs {want} classes. Got {num_classes} instead. "
            f"Check the dataset name or use '--asym-map cyclic'."
        )
    return build(num_classes).astype(np.int64)


# ---------------------------------------------------------------- noise models


@register_noise("none")
def _none(labels, rate, num_classes, rng, amap):
    """No label noise: every label stays as it is."""
    return labels.copy()


def _chosen(labels, rate, rng) -> np.ndarray:
    """The floor(r*n) sample positions (drawn without replacement) whose labels go through the noise."""
    m = int(np.floor(rate * len(labels)))
    return rng.choice(len(labels), size=m, replace=False) if m else np.empty(0, dtype=np.int64)


@register_noise("symmetric")
def _symmetric(labels, rate, num_classes, rng, amap):
    """Exactly floor(r*n) samples flip to a label drawn uniformly from the other C-1."""
    out = labels.copy()
    idx = _chosen(labels, rate, rng)
    if len(idx):
        out[idx] = (labels[idx] + rng.integers(1, num_classes, size=len(idx))) % num_classes
    return out


@register_noise("asymmetric")
def _asymmetric(labels, rate, num_classes, rng, amap):
    """floor(r*n) samples drawn from all classes go through the class map."""
    out = labels.copy()
    idx = _chosen(labels, rate, rng)
    out[idx] = amap[labels[idx]]
    return out


NOISE_KINDS = tuple(NOISE)  # ("none", "symmetric", "asymmetric")


def apply_noise(
    kind: str,
    rate: float,
    client_labels: list[np.ndarray],
    num_classes: int,
    *,
    dataset: str,
    seed: int,
    asym_rule: str = "auto",
) -> tuple[list[np.ndarray], float]:
    """Noisy copies of each client's labels and the realised flip fraction over all clients.

    The realised fraction counts samples whose label actually changed (identity entries of the
    asymmetric map do not count).
    """
    if kind not in NOISE:
        raise unknown_name("--noise", kind, NOISE, "noise kind")
    validate("--noise-rate", rate, Interval(0, 1, closed="left"))
    validate("--seed", seed, Interval(0, None, integer=True))
    if kind == "none":
        return [np.array(y, copy=True) for y in client_labels], 0.0
    validate("--num-classes", num_classes, Interval(2, None, integer=True))
    num_classes = int(num_classes)
    amap = asymmetric_map(dataset, num_classes, asym_rule) if kind == "asymmetric" else None
    fn = NOISE[kind]
    out, changed, total = [], 0, 0
    for i, y in enumerate(client_labels):
        y = np.asarray(y)
        if y.size and (y.min() < 0 or y.max() >= num_classes):
            raise FedheadError(
                f"Client {i} has labels outside [0, {num_classes}); check --num-classes against the feature store."
            )
        rng = np.random.default_rng([int(seed), _SEED_SALT, i])
        new = fn(y, float(rate), num_classes, rng, amap)
        changed += int((new != y).sum())
        total += y.size
        out.append(new)
    return out, (changed / total if total else 0.0)
