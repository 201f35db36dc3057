"""The method options every training command shares (``train``, each grid ``bench`` command, ``flower
simulate``), declared once: closed-form start, classic baselines, the central ceiling, differential privacy,
and the closed-form and FedLC heads' parameters. :func:`with_method_options` adds them to a typer command and
hands the command one dict of :class:`fedhead.federation.config.TrainConfig` fields (``head_params`` holds the head
parameters given)."""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import typer

from fedhead.infra.errors import FedheadError

# name -> (annotation, typer option); head parameters are marked by HEAD_PARAMS
METHOD_OPTIONS = {
    "local_steps": (
        Optional[int],
        typer.Option(None, "--local-steps", help="local steps (batches) per round for every client, instead of epochs"),
    ),
    "init": (
        Optional[str],
        typer.Option(
            None,
            "--init",
            help="closed-form start for an iterative head: ncm | ridge | cof | lda (round 1 exchanges statistics)",
        ),
    ),
    "init_scale": (
        Optional[float],
        typer.Option(None, "--init-scale", help="temperature of the --init head [measured per head]"),
    ),
    "central_reference": (
        bool,
        typer.Option(
            False, "--central-reference", help="also train the head centrally on the pooled data (the ceiling)"
        ),
    ),
    "prox_mu": (float, typer.Option(0.0, "--prox-mu", help="FedProx proximal term mu [0 = FedAvg]")),
    "scaffold": (bool, typer.Option(False, "--scaffold", help="SCAFFOLD control variates (option II)")),
    "server_opt": (
        str,
        typer.Option("fedavg", "--server-opt", help="fedavg | fedavgm | fedadam | fedyogi | fedadagrad"),
    ),
    "server_lr": (Optional[float], typer.Option(None, "--server-lr", help="server learning rate [Flower's]")),
    "server_momentum": (Optional[float], typer.Option(None, "--server-momentum", help="fedavgm momentum [Flower's]")),
    "server_betas": (
        Optional[str],
        typer.Option(None, "--server-betas", help="fedadam/fedyogi beta1,beta2 [Flower's]"),
    ),
    "server_tau": (Optional[float], typer.Option(None, "--server-tau", help="server adaptivity tau [Flower's]")),
    "calibrate": (str, typer.Option("none", "--calibrate", help="none | ccvr (after the last round)")),
    "ccvr_samples": (int, typer.Option(200, "--ccvr-samples", help="ccvr: virtual features per class")),
    "dp_noise_multiplier": (
        Optional[float],
        typer.Option(
            None,
            "--dp-noise-multiplier",
            help="differential privacy: Gaussian noise z x sensitivity "
            "(needs --dp-clip, --dp-delta; 0 = clipping only)",
        ),
    ),
    "dp_clip": (
        Optional[float],
        typer.Option(
            None,
            "--dp-clip",
            help="DP: client update L2 clip (DP-FedAvg), or the feature-norm clip of a closed-form head",
        ),
    ),
    "dp_delta": (Optional[float], typer.Option(None, "--dp-delta", help="DP: delta of the reported (epsilon, delta)")),
    "dp_feature_clip": (
        Optional[float],
        typer.Option(
            None,
            "--dp-feature-clip",
            help="DP, iterative head: feature-norm clip of its statistics (--center, --scale rms, --init)",
        ),
    ),
    "ridge_lambda": (Optional[float], typer.Option(None, "--ridge-lambda", help="ridge: lambda [0.01]")),
    "ridge_normalize": (
        Optional[bool],
        typer.Option(
            None, "--ridge-normalize/--no-ridge-normalize", help="ridge: L2-normalise solved rows (Fed3R's code) [no]"
        ),
    ),
    "cof_gamma": (Optional[float], typer.Option(None, "--cof-gamma", help="cof: covariance shrinkage gamma [1]")),
    "lda_shrinkage": (
        Optional[float],
        typer.Option(None, "--lda-shrinkage", help="lda: covariance ridge x trace/D [1e-4]"),
    ),
    "fedlc_tau": (Optional[float], typer.Option(None, "--fedlc-tau", help="fedlc: calibration strength tau")),
}
HEAD_PARAMS = ("ridge_lambda", "ridge_normalize", "cof_gamma", "lda_shrinkage", "fedlc_tau")


def parse_betas(text: str | None):
    if text is None:
        return None
    try:
        b = tuple(float(t) for t in str(text).replace(" ", "").split(","))
    except ValueError:
        b = ()
    if len(b) != 2:
        raise FedheadError(
            f"The '--server-betas' parameter must be two numbers beta1,beta2. Got {text!r} instead. "
            "Example: --server-betas 0.9,0.99"
        )
    return b


def method_fields(values: dict) -> dict:
    """TrainConfig fields from the parsed options; head parameters go under ``head_params``."""
    out = {k: v for k, v in values.items() if k not in HEAD_PARAMS}
    out["server_betas"] = parse_betas(out.get("server_betas"))
    out["head_params"] = {k: values[k] for k in HEAD_PARAMS if values.get(k) is not None}
    return out


def with_method_options(fn):
    """Add :data:`METHOD_OPTIONS` to a typer command ``fn(..., method: dict)``."""
    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "method"]
    params = own + [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=t)
        for n, (t, opt) in METHOD_OPTIONS.items()
    ]

    @functools.wraps(fn)
    def wrapper(**kw):
        method = method_fields({n: kw.pop(n) for n in METHOD_OPTIONS})
        return fn(**kw, method=method)

    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
