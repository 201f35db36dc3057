"""The four scratch algorithms as a few hooks around one round loop (Flower ``Strategy`` style).

``configure`` says what the selected clients train this round (members, start parameters, loss,
trainable tensors, epochs, optimizer); ``aggregate`` is one of the pure aggregators in :mod:`.engine`;
``after_round`` adds per-round metrics (PFL accuracy / drift, layer divergence); ``predict`` gives the
global model's class scores on the test set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import FedheadError, unknown_name
from . import engine as E


@dataclass
class Plan:
    """What one round trains: member m belongs to client ``owner[m]`` and starts from ``start`` [M, ...]."""

    owner: np.ndarray             # [M] client id of each member
    member_idx: list[np.ndarray]  # [M] training indices of each member
    start: E.Params               # [M, ...] start parameters (all tensors of the model)
    aux: dict                     # loss-function extras, tensors are [M, ...]
    loss_fn: Callable
    epochs: int
    optim: E.OptimSpec
    trainable: set[str] | None = None  # None = every tensor
    stage: str = "train"
    group: torch.Tensor | None = None   # FedOVA: class of each member


class Algorithm:
    name = ""
    out_per_class = False  # FedOVA: one single-output network per class

    def init(self, ctx) -> E.Params:
        return E.init_params(ctx.model, ctx.gen)

    def setup(self, ctx) -> None:
        """Checks and warnings before the first round."""

    def configure(self, ctx, state, rnd: int, selected: np.ndarray) -> Plan | None:
        raise NotImplementedError

    def aggregate(self, ctx, state, plan: Plan, trained: E.TrainResult) -> E.Params:
        w = torch.tensor([len(i) for i in plan.member_idx], dtype=torch.float64)
        return E.partial_average(state, trained.params, w)

    def after_round(self, ctx, state, plan: Plan, trained: E.TrainResult) -> dict:
        return {}

    def predict(self, ctx, state, x) -> torch.Tensor:
        return E.predict_logits(ctx.model, state, x, ctx.data.to_float)

    def state_dict(self) -> dict:
        """The algorithm's own state beyond the global parameters (checkpointed after every round)."""
        return {}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` (after :meth:`setup`, on resume)."""


def _optim(ctx, lr=None) -> E.OptimSpec:
    c = ctx.cfg
    return E.OptimSpec(c.optimizer, c.lr if lr is None else lr, momentum=c.momentum, weight_decay=c.weight_decay)


# ---------------------------------------------------------------- FedAvg / FedABC


class FedAvg(Algorithm):
    name = "fedavg"

    def loss(self, ctx, clients: np.ndarray):
        return E.softmax_ce, {}

    def configure(self, ctx, state, rnd, selected):
        idx = [ctx.parts[k] for k in selected]
        fn, aux = self.loss(ctx, selected)
        return Plan(np.asarray(selected), idx, E.stack_copies(state, len(selected)), aux, fn,
                    ctx.cfg.local_epochs, _optim(ctx))

    def after_round(self, ctx, state, plan, trained):
        if ctx.local_test is None:
            return {}
        params = {**plan.start, **trained.params}
        own, bal = ctx.local_test
        out = {}
        for key, sets in (("pfl_accuracy", own), ("drift_accuracy", bal)):
            idx = np.stack([sets[k] for k in plan.owner])
            logits = E.predict_stacked_own(ctx.model, params, ctx.test_x, idx, ctx.data.to_float)
            pred = logits.argmax(-1).cpu()
            out[key] = float((pred == ctx.test_y_cpu[torch.from_numpy(idx)]).float().mean())
        return out


class FedABC(FedAvg):
    name = "fedabc"

    def loss(self, ctx, clients):
        present = torch.from_numpy(ctx.client_counts[clients] > 0).to(ctx.device)
        return E.fedabc_loss, {"present": present, "margins": ctx.cfg.fedabc_margins}


# ---------------------------------------------------------------- FedOVA


class FedOVA(Algorithm):
    name = "fedova"
    out_per_class = True

    def init(self, ctx):
        return E.init_params(ctx.model, ctx.gen, count=ctx.data.num_classes)

    def setup(self, ctx):
        held = (ctx.client_counts > 0).sum(1)
        ones = np.flatnonzero(held == 1)
        if len(ones) == np.count_nonzero(held):
            raise FedheadError("FedOVA cannot train: every client holds a single label, so no binary network "
                               "has negatives. Use a partition with >= 2 labels per client, e.g. "
                               "--partition shard --distinct-labels --shards-per-client 2.")
        for k in ones:
            c = int(np.flatnonzero(ctx.client_counts[k])[0])
            ctx.log(f"warning: FedOVA client {k} holds one label ({c}) and has no negatives; it trains nothing "
                    f"and sends nothing.")
        ctx.client_extra["fedova_trains"] = (held >= 2).astype(int).tolist()

    def configure(self, ctx, state, rnd, selected):
        owner, cls, idx = [], [], []
        for k in selected:
            labels = np.flatnonzero(ctx.client_counts[k])
            if len(labels) < 2:
                continue
            for c in labels:  # every held label's network, trained on the whole local set
                owner.append(k)
                cls.append(c)
                idx.append(ctx.parts[k])
        if not owner:
            return None
        group = torch.tensor(cls, dtype=torch.long)
        start = {n: p[group].clone() for n, p in state.items()}
        return Plan(np.array(owner), idx, start, {"cls": group.to(ctx.device)}, E.binary_bce,
                    ctx.cfg.local_epochs, _optim(ctx), group=group)

    def aggregate(self, ctx, state, plan, trained):
        return E.grouped_average(state, trained.params, plan.group.to(next(iter(state.values())).device))

    def predict(self, ctx, state, x):
        out = E.predict_stacked_shared(ctx.model, state, x, ctx.data.to_float)  # [C, N, 1]
        return out[..., 0].T


# ---------------------------------------------------------------- Divide and Conquer


class DivideAndConquer(FedAvg):
    """Pre-pass of full FedAvg rounds with layer divergence, then alternating feature-learning
    (layers 1..s) and fine-tuning (s+1..L) rounds; only the trained layers travel."""

    name = "dnc"

    def setup(self, ctx):
        self.layers = ctx.layers
        self.split = ctx.cfg.split_layer
        if self.split is not None and not 1 <= self.split < len(self.layers):
            raise FedheadError(f"The '--split-layer' parameter must be an integer in [1, {len(self.layers) - 1}] "
                               f"for model {ctx.cfg.model} ({len(self.layers)} weight layers). Got "
                               f"{self.split} instead.")
        self.div_rows: list[dict] = []

    def configure(self, ctx, state, rnd, selected):
        c = ctx.cfg
        plan = super().configure(ctx, state, rnd, selected)
        if rnd <= c.prepass_rounds:
            plan.stage = "prepass"
            return plan
        if self.split is None:
            self.split = self._auto_split(ctx)
        j = rnd - c.prepass_rounds  # 1-based round after the pre-pass
        lr = c.lr * (c.lr_decay ** (j - 1))
        if j % 2 == 1:
            layers, plan.epochs, plan.stage = self.layers[:self.split], c.feature_epochs, "feature"
        else:
            layers, plan.epochs, plan.stage = self.layers[self.split:], c.finetune_epochs, "finetune"
            lr *= c.finetune_lr_factor
        plan.trainable = {n for names in layers for n in names}
        plan.optim = dataclasses.replace(plan.optim, lr=lr)
        return plan

    def state_dict(self) -> dict:
        return {"split": self.split, "div_rows": [dict(r) for r in self.div_rows]}

    def load_state_dict(self, d: dict) -> None:
        self.split = d["split"]
        self.div_rows = [dict(r) for r in d["div_rows"]]

    def _auto_split(self, ctx) -> int:
        if not self.div_rows:
            raise FedheadError("The '--split-layer' parameter is needed when --prepass-rounds is 0 "
                               "(no divergence to choose from). Got None instead.")
        last = max(r["round"] for r in self.div_rows)
        d = np.array([r["divergence"] for r in self.div_rows if r["round"] == last])
        return E.choose_split(d, ctx.cfg.split_threshold)

    def after_round(self, ctx, state, plan, trained):
        out = super().after_round(ctx, state, plan, trained)
        if plan.stage == "prepass":
            # divergence of each collaborator's local weights from the aggregated global of this round
            ref = state if ctx.cfg.divergence == "local-vs-global" else None
            d = E.cosine_divergence(ref, trained.params, self.layers, ctx.cfg.divergence)
            rnd = (max((r["round"] for r in self.div_rows), default=0)) + 1
            for l, v in enumerate(d):
                self.div_rows.append({"seed": ctx.seed, "round": rnd, "layer": l + 1,
                                      "name": self.layers[l][0].rsplit(".", 1)[0], "divergence": float(v)})
        return out


ALGORITHMS: dict[str, type[Algorithm]] = {a.name: a for a in (FedAvg, FedOVA, FedABC, DivideAndConquer)}


def create_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise unknown_name("ALGO", name, ALGORITHMS, "algorithm")
    return ALGORITHMS[name]()
