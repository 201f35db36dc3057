"""The scratch algorithms as a few hooks around one round loop (Flower ``Strategy`` style).

``configure`` says what the selected clients train this round (members, start parameters, loss,
trainable tensors, epochs, optimizer, FedProx / SCAFFOLD gradient terms); ``train`` runs the engine (once, or
FedRep's two phases); ``aggregate`` is one of the pure aggregators in :mod:`.engine` (and keeps personal
state); ``member_bytes`` is what one member sends each way; ``after_round`` adds per-round metrics (PFL
accuracy / drift, layer divergence); ``predict`` gives the class scores behind the ``accuracy`` column on the
global test set: the global model's, or for the personalised algorithms the personal models' (see
:class:`Personalised`).

Algorithms: ``fedavg``, ``fedabc``, ``fedova``, ``dnc`` and FedABC's comparison set: ``local`` (no
communication), ``fedprox``, ``scaffold`` (option II), ``fedper`` (shared body, personal head), ``fedrep``
(head epochs then body epochs, body shared), ``fedrod`` (linear mode: shared body and balanced-softmax generic
head, personal linear head), ``lg-fedavg`` (personal body, shared head). The head is the last
``--head-layers`` weight layers (default 1, FL-bench's ``classifier``).

Shared with the head trainer (:mod:`fedhead.core.engine`): SCAFFOLD's control variates are a
:class:`fedhead.core.engine.ScaffoldState` over the flattened model (``c [1, P]``, ``c_k [K, 1, P]``: its update
rules, checkpoint state and byte count) with option II's step size :attr:`fedhead.core.engine.OptimConfig.step_size`
(``lr / (1 - momentum)`` for SGD); FedProx adds the same gradient term ``mu (w - w_start)`` before the optimizer
step (:func:`.engine.train_members`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fedhead.core.engine import OptimConfig, ScaffoldState
from fedhead.infra.errors import FedheadError, unknown_name
from fedhead.scratch import engine as E
from fedhead.scratch.models import DualHead


@dataclass
class Plan:
    """What one round trains: member m belongs to client ``owner[m]`` and starts from ``start`` [M, ...]."""

    owner: np.ndarray  # [M] client id of each member
    member_idx: list[np.ndarray]  # [M] training indices of each member
    start: E.Params  # [M, ...] start parameters (all tensors of the model)
    aux: dict  # loss-function extras, tensors are [M, ...]
    loss_fn: Callable
    epochs: int
    optim: E.OptimSpec
    trainable: set[str] | None = None  # None = every tensor
    stage: str = "train"
    group: torch.Tensor | None = None  # FedOVA: class of each member
    prox_mu: float = 0.0  # FedProx: mu of (mu/2)||w - w_start||^2 (0 = off)
    grad_offset: E.Params | None = None  # SCAFFOLD: c - c_k per member, [M, ...] per tensor


class Algorithm:
    name = ""
    out_per_class = False  # FedOVA: one single-output network per class
    accuracy_of = "the global model"  # what the 'accuracy' column scores (recorded in config.json)

    @staticmethod
    def wrap_model(model: torch.nn.Module) -> torch.nn.Module:
        """The network this algorithm trains, built around the registered model (FedRoD: two heads)."""
        return model

    def init(self, ctx) -> E.Params:
        return E.init_params(ctx.model, ctx.gen)

    def setup(self, ctx) -> None:
        """Checks and warnings before the first round."""

    def configure(self, ctx, state, rnd: int, selected: np.ndarray) -> Plan | None:
        raise NotImplementedError

    def train(self, ctx, plan: Plan) -> E.TrainResult:
        """Local training of the plan's members (one engine call; FedRep makes two)."""
        return _train(ctx, plan, plan.start, plan.trainable, plan.epochs)

    def aggregate(self, ctx, state, plan: Plan, trained: E.TrainResult) -> E.Params:
        w = torch.tensor([len(i) for i in plan.member_idx], dtype=torch.float64)
        return E.partial_average(state, trained.params, w)

    def member_bytes(self, ctx, plan: Plan, trained: E.TrainResult) -> int:
        """Bytes one member carries each way (down and up): exactly the tensors it trained, fp32."""
        return E.nbytes({n: p[0] for n, p in trained.params.items()})

    def after_round(self, ctx, state, plan: Plan, trained: E.TrainResult) -> dict:
        return {}

    def personal_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The class scores of a member's own prediction from the network's output (FedRoD: g + p)."""
        return out

    def predict(self, ctx, state, x) -> torch.Tensor:
        return E.predict_logits(ctx.model, state, x, ctx.data.to_float)

    def export(self, state: E.Params) -> E.Params:
        """The tensors saved as the seed's final model (``model-seed<S>.pt``)."""
        return state

    def state_dict(self) -> dict:
        """The algorithm's own state beyond the global parameters (checkpointed after every round)."""
        return {}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` (after :meth:`setup`, on resume)."""


def _optim(ctx, lr=None) -> E.OptimSpec:
    c = ctx.cfg
    return E.OptimSpec(c.optimizer, c.lr if lr is None else lr, momentum=c.momentum, weight_decay=c.weight_decay)


def _train(ctx, plan: Plan, start: E.Params, trainable, epochs: int) -> E.TrainResult:
    return E.train_members(
        ctx.model,
        start,
        plan.member_idx,
        plan.aux,
        plan.loss_fn,
        x_all=ctx.x_train,
        y_all=ctx.y_train,
        to_float=ctx.data.to_float,
        epochs=epochs,
        batch_size=ctx.cfg.batch_size,
        optim=plan.optim,
        rng=ctx.rng,
        trainable=trainable,
        backend=ctx.cfg.backend,
        prox_mu=plan.prox_mu,
        grad_offset=plan.grad_offset,
    )


# ---------------------------------------------------------------- FedAvg / FedABC


class FedAvg(Algorithm):
    name = "fedavg"

    def loss(self, ctx, clients: np.ndarray):
        return E.softmax_ce, {}

    def configure(self, ctx, state, rnd, selected):
        idx = [ctx.parts[k] for k in selected]
        fn, aux = self.loss(ctx, selected)
        return Plan(
            np.asarray(selected), idx, E.stack_copies(state, len(selected)), aux, fn, ctx.cfg.local_epochs, _optim(ctx)
        )

    def after_round(self, ctx, state, plan, trained):
        if ctx.local_test is None:
            return {}
        params = {**plan.start, **trained.params}
        own, bal = ctx.local_test
        out = {}
        for key, sets in (("pfl_accuracy", own), ("drift_accuracy", bal)):
            idx = np.stack([sets[k] for k in plan.owner])
            logits = E.predict_stacked_own(ctx.model, params, ctx.test_x, idx, ctx.data.to_float)
            pred = self.personal_logits(logits).argmax(-1).cpu()
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
            raise FedheadError(
                "FedOVA cannot train: every client holds a single label, so no binary network "
                "has negatives. Use a partition with >= 2 labels per client, e.g. "
                "--partition shard --distinct-labels --shards-per-client 2."
            )
        for k in ones:
            c = int(np.flatnonzero(ctx.client_counts[k])[0])
            ctx.log(
                f"warning: FedOVA client {k} holds one label ({c}) and has no negatives; it trains nothing "
                f"and sends nothing."
            )
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
        return Plan(
            np.array(owner),
            idx,
            start,
            {"cls": group.to(ctx.device)},
            E.binary_bce,
            ctx.cfg.local_epochs,
            _optim(ctx),
            group=group,
        )

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
            raise FedheadError(
                f"The '--split-layer' parameter must be an integer in [1, {len(self.layers) - 1}] "
                f"for model {ctx.cfg.model} ({len(self.layers)} weight layers). Got "
                f"{self.split} instead."
            )
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
            layers, plan.epochs, plan.stage = self.layers[: self.split], c.feature_epochs, "feature"
        else:
            layers, plan.epochs, plan.stage = self.layers[self.split :], c.finetune_epochs, "finetune"
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
            raise FedheadError(
                "The '--split-layer' parameter is needed when --prepass-rounds is 0 "
                "(no divergence to choose from). Got None instead."
            )
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
            for layer, v in enumerate(d):
                self.div_rows.append(
                    {
                        "seed": ctx.seed,
                        "round": rnd,
                        "layer": layer + 1,
                        "name": self.layers[layer][0].rsplit(".", 1)[0],
                        "divergence": float(v),
                    }
                )
        return out


# ---------------------------------------------------------------- FedProx / SCAFFOLD (generic FL, FedABC's baselines)


class FedProx(FedAvg):
    """FedAvg whose local objective adds ``(mu/2) ||w - w_global||^2`` (Li et al. 2020), ``--prox-mu``."""

    name = "fedprox"

    def configure(self, ctx, state, rnd, selected):
        plan = super().configure(ctx, state, rnd, selected)
        plan.prox_mu = float(ctx.cfg.prox_mu)
        return plan


class Scaffold(FedAvg):
    """SCAFFOLD option II (Karimireddy et al. 2020) on the whole network, with the head trainer's
    :class:`fedhead.core.engine.ScaffoldState`: every local step uses ``g + c - c_k``; after training
    ``c_k+ = c_k - c + (w_global - w_k) / (steps_k * lr / (1 - momentum))``; the server adds
    ``sum_k (c_k+ - c_k) / K`` to ``c`` (K = all clients) and averages the model as FedAvg does (global lr 1).
    Both variates travel: twice FedAvg's bytes each way."""

    name = "scaffold"

    def setup(self, ctx):
        self.names = [n for n, _ in ctx.model.named_parameters()]
        size = sum(p.numel() for _, p in ctx.model.named_parameters())
        self.var = ScaffoldState.zeros(ctx.cfg.clients, 1, size, device=ctx.device)
        c = ctx.cfg
        self.step_size = OptimConfig("sgd", lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay).step_size

    def configure(self, ctx, state, rnd, selected):
        plan = super().configure(ctx, state, rnd, selected)
        ids = torch.as_tensor(plan.owner, dtype=torch.long, device=self.var.ck.device)
        corr = self.var.correction(ids)[:, 0]  # [M, P]: c - c_k
        plan.grad_offset = E.unflatten(corr, plan.start, self.names)
        return plan

    def aggregate(self, ctx, state, plan, trained):
        ids = torch.as_tensor(plan.owner, dtype=torch.long, device=self.var.ck.device)
        theta = E.flatten({n: state[n].unsqueeze(0) for n in self.names}, self.names)  # [1, P]
        w = E.flatten(trained.params, self.names).unsqueeze(1)  # [M, 1, P]
        self.var.client_update(ids, theta, w, trained.steps, self.step_size)
        self.var.server_update()
        return super().aggregate(ctx, state, plan, trained)

    def member_bytes(self, ctx, plan, trained):
        return super().member_bytes(ctx, plan, trained) + self.var.nbytes  # the model and one variate

    def state_dict(self) -> dict:
        return {"scaffold": self.var.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.var.load_state_dict(d["scaffold"])


# ---------------------------------------------------------------- personalised: local, FedPer, FedRep, LG, FedRoD


class Personalised(FedAvg):
    """Every client keeps some tensors of its own (``personal_names``; ``self.personal[name]`` is ``[K, ...]``,
    all clients starting from the same initialisation); the others are shared: a selected client starts from
    the global shared tensors and its own personal ones, trains, keeps its personal tensors and sends the shared
    ones, which are size-weighted averaged over the round's clients. Only shared tensors travel.

    ``accuracy`` (the global test set): test sample ``i`` is classified by client ``i mod K``'s current personal
    model (global shared tensors + its personal ones), so every client's model scores an equal share of the test
    set in one pass. ``pfl_accuracy`` / ``drift_accuracy`` (FedABC's protocol) score each selected client's model
    after its local training on its own non-IID / balanced local test set, as for FedAvg."""

    accuracy_of = "the personal models: test sample i by client (i mod K)'s model"

    def personal_names(self, ctx) -> set[str]:
        raise NotImplementedError

    def head_names(self, ctx) -> set[str]:
        """The last ``--head-layers`` weight layers."""
        return {n for names in ctx.layers[-ctx.cfg.head_layers :] for n in names}

    def setup(self, ctx):
        super().setup(ctx)
        self.names = set(self.personal_names(ctx))
        self.K = ctx.cfg.clients
        self.device = ctx.device
        self.personal: E.Params = {}

    def init(self, ctx):
        state = super().init(ctx)
        self.personal = {
            n: p.to(ctx.device) for n, p in E.stack_copies({m: state[m] for m in sorted(self.names)}, self.K).items()
        }
        return state

    def configure(self, ctx, state, rnd, selected):
        plan = super().configure(ctx, state, rnd, selected)
        own = torch.as_tensor(plan.owner, dtype=torch.long, device=self.device)
        for n in self.names:
            plan.start[n] = self.personal[n].index_select(0, own)
        return plan

    def aggregate(self, ctx, state, plan, trained):
        own = torch.as_tensor(plan.owner, dtype=torch.long, device=self.device)
        for n in self.names & set(trained.params):
            self.personal[n].index_copy_(0, own, trained.params[n].to(self.device))
        shared = {n: p for n, p in trained.params.items() if n not in self.names}
        if not shared:
            return state
        w = torch.tensor([len(i) for i in plan.member_idx], dtype=torch.float64)
        return E.partial_average(state, shared, w)

    def member_bytes(self, ctx, plan, trained):
        return E.nbytes({n: p[0] for n, p in trained.params.items() if n not in self.names})

    def predict(self, ctx, state, x):
        k, n = self.K, len(x)
        per = -(-n // k)
        idx = np.arange(per * k).reshape(per, k).T  # client j scores samples j, j + K, j + 2K, ...
        valid = idx < n
        group = max(1, ctx.cfg.eval_batch // per)  # clients per forward: about eval_batch images
        outs = []
        for j in range(0, k, group):
            sl = slice(j, min(k, j + group))
            params = {
                m: (self.personal[m][sl] if m in self.names else p.unsqueeze(0).expand(sl.stop - j, *p.shape))
                for m, p in state.items()
            }
            outs.append(
                E.predict_stacked_own(
                    ctx.model, params, x, np.where(valid, idx, 0)[sl], ctx.data.to_float, batch_size=per
                )
            )
        out = self.personal_logits(torch.cat(outs))
        logits = torch.empty(n, out.shape[-1], dtype=out.dtype, device=out.device)
        v = torch.from_numpy(valid).to(out.device)
        logits[torch.from_numpy(idx[valid]).to(out.device)] = out[v]
        return logits

    def export(self, state):
        return {**state, **{f"personal.{n}": p.detach().cpu() for n, p in sorted(self.personal.items())}}

    def state_dict(self) -> dict:
        return {"personal": {n: p.detach().cpu().clone() for n, p in self.personal.items()}}

    def load_state_dict(self, d: dict) -> None:
        got = d["personal"]
        if set(got) != self.names:
            raise FedheadError(
                f"The checkpoint's personal tensors {sorted(got)} are not this run's "
                f"{sorted(self.names)}. Resume with the same options, or start a fresh --out."
            )
        self.personal = {n: p.to(self.device).clone() for n, p in got.items()}


class Local(Personalised):
    """Local training only: every tensor is personal, nothing is sent, the server does nothing."""

    name = "local"

    def personal_names(self, ctx):
        return {n for names in ctx.layers for n in names}


class FedPer(Personalised):
    """FedPer (Arivazhagan et al. 2019): the body is shared (FedAvg), the head personal; all of it trains."""

    name = "fedper"

    def personal_names(self, ctx):
        return self.head_names(ctx)


class LGFedAvg(Personalised):
    """LG-FedAvg (Liang et al. 2020): local representation (the body personal), global head (shared)."""

    name = "lg-fedavg"

    def personal_names(self, ctx):
        all_names = {n for names in ctx.layers for n in names}
        return all_names - self.head_names(ctx)


class FedRep(FedPer):
    """FedRep (Collins et al. 2021): per round, the personal head trains ``local_epochs - body_epochs`` epochs
    with the body frozen, then the body ``--body-epochs`` epochs with the head frozen (FL-bench's split of the
    local epochs); only the body is shared. Each phase has a fresh optimizer (torch skips frozen parameters, so
    one optimizer over both phases is the same for SGD)."""

    name = "fedrep"

    def train(self, ctx, plan):
        head = self.names
        body = {n for n in plan.start if n not in head}
        e_body = ctx.cfg.body_epochs
        r1 = _train(ctx, plan, plan.start, head, plan.epochs - e_body)
        r2 = _train(ctx, plan, {**plan.start, **r1.params}, body, e_body)
        steps = r1.steps + r2.steps
        s1, s2 = torch.from_numpy(r1.steps).double(), torch.from_numpy(r2.steps).double()
        loss = ((r1.loss.double() * s1 + r2.loss.double() * s2) / (s1 + s2).clamp(min=1)).float()
        return E.TrainResult({**r1.params, **r2.params}, loss, steps)


class FedRoD(Personalised):
    """FedRoD, linear mode (Chen & Chao, ICLR 2022): body and generic head G shared and trained with the
    balanced-softmax loss on the client's class counts; a personal linear head P on the detached representation,
    trained with CE on ``G(z).detach() + P(z)`` (:class:`.models.DualHead`, :func:`.engine.fedrod_loss`). Personal
    prediction: ``G(z) + P(z)``; ``generic_accuracy``: the global generic model G on the global test set. P starts
    at zero (so the personalised prediction starts as the generic one)."""

    name = "fedrod"

    @staticmethod
    def wrap_model(model):
        return DualHead(model)

    def personal_names(self, ctx):
        return {"p_head.weight", "p_head.bias"}

    def init(self, ctx):
        state = super().init(ctx)
        for n in self.names:
            state[n].zero_()
            self.personal[n].zero_()
        return state

    def loss(self, ctx, clients):
        counts = torch.as_tensor(ctx.client_counts[clients], dtype=torch.float32, device=ctx.device)
        return E.fedrod_loss, {"log_counts": counts.log()}

    def personal_logits(self, out):
        return out[..., out.shape[-1] // 2 :]

    def after_round(self, ctx, state, plan, trained):
        out = super().after_round(ctx, state, plan, trained)
        g = E.predict_logits(ctx.model, state, ctx.test_x, ctx.data.to_float)
        pred = g[:, : g.shape[1] // 2].argmax(1).cpu()
        out["generic_accuracy"] = float((pred == ctx.test_y_cpu).float().mean())
        return out


ALGORITHMS: dict[str, type[Algorithm]] = {
    a.name: a
    for a in (FedAvg, FedOVA, FedABC, DivideAndConquer, Local, FedProx, Scaffold, FedPer, FedRep, FedRoD, LGFedAvg)
}
HEAD_SPLIT = ("fedper", "fedrep", "lg-fedavg")  # algorithms that take --head-layers


def create_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise unknown_name("ALGO", name, ALGORITHMS, "algorithm")
    return ALGORITHMS[name]()
