"""The server's side of a round, the same for every transport: the closed-form solve after the statistics exchange,
the server update after aggregation (server optimiser, SCAFFOLD's control variate), and CCVR's calibration."""

from __future__ import annotations

import time

from fedhead.core.aggregate import aggregator_of
from fedhead.core.ccvr import retrain_head, sample_virtual
from fedhead.core.closedform import is_closed_form, to_prepared
from fedhead.core.compress import Residuals
from fedhead.core.dp import enabled, privatize_statistics
from fedhead.core.engine import ScaffoldState, evaluate
from fedhead.core.serveropt import ServerOptConfig, ServerOptimizer
from fedhead.federation.clients import FeatureStats
from fedhead.federation.config import TrainConfig
from fedhead.infra.errors import FedheadError
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")


def solve_statistics(
    solver, acc, cfg: TrainConfig, stats: FeatureStats, device, seed: int | None = None
) -> torch.Tensor:
    """The server's solve after the statistics exchange: a closed-form head on raw features, or an ``--init``
    head mapped to the run's prepared features and multiplied by the init scale. With differential privacy the
    summed statistics get their noise here first (:func:`fedhead.core.dp.privatize_statistics`, keyed by ``seed``)."""
    if enabled(cfg):
        if seed is None:
            raise FedheadError("solve_statistics needs the run's seed to draw the DP noise of the statistics.")
        privatize_statistics(acc, cfg, seed)
    theta = solver.solve_statistics(acc)  # --stats-sketch: mapped back from the sketch's space
    if not is_closed_form(cfg.head):
        scale = cfg.init_scale if cfg.init_scale is not None else float(getattr(solver, "init_scale", 1.0))
        theta = to_prepared(theta, stats.mean, stats.scale) * scale
    # a quadratic head (qda) stays float64: its scores cancel large terms of the quadratic form
    return theta.to(device=device, dtype=torch.float32 if theta.ndim == 2 else torch.float64)


def statistics_row(
    acc,
    client_ms: float,
    server_s: float,
    cfg: TrainConfig,
    nsel: int,
    head_bytes: int,
    extra_up: int,
    stats_bytes: int,
) -> dict:
    """The round-1 row of a statistics exchange: ``client_ms`` per client, ``server_s`` in all."""
    # a closed-form head is sent back once; an --init head goes down with round 2
    down = nsel * head_bytes if is_closed_form(cfg.head) else 0
    return {
        "stage": "statistics",
        "train_loss": float("nan"),
        "client_ms": client_ms,
        "server_ms": 1000 * server_s,
        "bytes_up_per_client": acc.bytes_up / max(1, acc.clients) + extra_up,
        "bytes_total": acc.bytes_up + down + stats_bytes,
        "clients_trained": acc.clients,
    }


def server_opt_config(cfg: TrainConfig) -> ServerOptConfig:
    """The server optimiser a run's configuration names, its parameters resolved and validated."""
    return ServerOptConfig(
        name=cfg.server_opt, lr=cfg.server_lr, momentum=cfg.server_momentum, betas=cfg.server_betas, tau=cfg.server_tau
    ).resolved()


class ServerUpdate:
    """What the server does with a round's aggregate beyond FedAvg: a server optimiser (FedAvgM, FedAdam, ...)
    and SCAFFOLD's control variates; plus what the engine needs from it (FedProx's mu, the variates).
    ``scaffold``: the variates where a transport keeps them apart (a Flower server holds ``c`` only).
    ``residuals``: error feedback's per-client residuals where the transport keeps them here (in process: every
    client's, handed to the rule, whose messages read and update them, and checkpointed with the rest); None where
    the clients keep their own (Flower)."""

    def __init__(
        self,
        cfg: TrainConfig,
        shape: tuple,
        device,
        scaffold: ScaffoldState | None = None,
        residuals: Residuals | None = None,
    ):
        self.cfg = cfg
        self.rule = aggregator_of(cfg)  # the aggregation rule: its state (if any) is the server's, kept per seed
        self.residuals = residuals
        if residuals is not None:
            self.rule.residuals = residuals
        self.opt = None
        if cfg.server_opt != "fedavg":
            self.opt = ServerOptimizer(server_opt_config(cfg), shape, device)
        self.scaffold = None
        if cfg.scaffold:
            self.scaffold = scaffold if scaffold is not None else ScaffoldState.zeros(cfg.clients, *shape, device)

    def engine_kwargs(self) -> dict:
        kw = {}
        if self.cfg.prox_mu:
            kw["prox_mu"] = self.cfg.prox_mu
        if self.scaffold is not None:
            kw["scaffold"] = self.scaffold
        return kw

    def step(self, previous: torch.Tensor, aggregated: torch.Tensor) -> torch.Tensor:
        return aggregated if self.opt is None else self.opt.step(previous, aggregated)

    def transfer_multiplier(self) -> int:
        """Heads' worth of numbers each way per client and round (SCAFFOLD's variates travel with the head)."""
        return 2 if self.scaffold is not None else 1

    def state_dict(self) -> dict:
        return {
            "opt": self.opt.state_dict() if self.opt is not None else None,
            "scaffold": self.scaffold.state_dict() if self.scaffold is not None else None,
            "rule": self.rule.state_dict(),
            "residuals": self.residuals.state_dict() if self.residuals is not None else None,
        }

    def load_state_dict(self, d: dict, device) -> None:
        if self.opt is not None and d.get("opt") is not None:
            self.opt.load_state_dict(d["opt"])
        if self.scaffold is not None and d.get("scaffold") is not None:
            self.scaffold.load_state_dict(d["scaffold"])
        if d.get("rule"):
            self.rule.load_state_dict(d["rule"])
        if self.residuals is not None and d.get("residuals") is not None:
            self.residuals.load_state_dict(d["residuals"])


def ccvr_calibrate(
    head,
    theta: torch.Tensor,
    pooled,
    cfg: TrainConfig,
    seed: int,
    xt: torch.Tensor,
    y_test: torch.Tensor,
    rnd: int,
    num_clients: int,
    bytes_up: int,
    client_s: float,
):
    """CCVR's server half: ``pooled`` (a :class:`fedhead.core.ccvr.PooledStats` holding the statistics of all
    ``num_clients`` clients, ``bytes_up`` bytes in all, ``client_s`` seconds to compute them) gives the virtual
    features the head is retrained on; returns the new head and the ``ccvr`` row of rounds.csv (round ``rnd``)."""
    t1 = time.perf_counter()
    counts, means, covs = pooled.finish()
    xv, yv = sample_virtual(counts, means, covs, cfg.ccvr_samples, seed)
    xv_t = torch.cat([torch.as_tensor(xv), torch.ones(len(xv), 1)], 1).to(theta.device)
    new = retrain_head(theta, head, xv_t, torch.as_tensor(yv, device=theta.device), seed=seed)
    t2 = time.perf_counter()
    acc = evaluate(new, xt, y_test)
    k = num_clients
    return new, {
        "round": rnd,
        "stage": "ccvr",
        "accuracy": acc,
        "train_loss": float("nan"),
        "client_ms": 1000 * client_s / max(1, k),
        "server_ms": 1000 * (t2 - t1),
        "bytes_up_per_client": bytes_up / max(1, k),
        "bytes_total": bytes_up + k * theta.numel() * theta.element_size(),
        "ratio_to_iid": None,
        "clients_trained": 0,
    }
