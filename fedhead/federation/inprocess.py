"""The in-process transport: every client of the federation simulated on this machine, from one feature store.

A seed's clients are the store's training split partitioned and given label noise by
:func:`fedhead.federation.clients.build_federation`; their local training is the engine's (``vectorized`` over
client-stacked tensors, or the ``loop`` backend that checks it), their statistics are summed in blocks, and SCAFFOLD's
client variates and error feedback's residuals are kept here, in memory. It also holds the pooled data the central ceiling is trained on.
"""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np

from extract.store import Features
from fedhead.core.ccvr import PooledStats
from fedhead.core.central import Split, tuned_ceiling
from fedhead.core.closedform import accumulate, is_closed_form
from fedhead.core.compress import Residuals
from fedhead.core.dp import feature_clip
from fedhead.core.engine import ClientSet, Engine, LocalConfig, OptimConfig, ScaffoldState, accuracy_and_loss
from fedhead.core.heads import create_head, resolve_head_params
from fedhead.core.personalize import ClientData, Setting, personal_heads, personalize_clients
from fedhead.federation.clients import (
    FeatureStats,
    Federation,
    build_federation,
    ccvr_client_stats,
    prepare,
    with_ones,
)
from fedhead.federation.config import TrainConfig
from fedhead.federation.transport import Calibration, Census, Exchange, PersonalTest, RoundResult, Transport
from fedhead.infra.console import stderr_console
from fedhead.infra.devices import available_memory
from fedhead.infra.errors import FedheadError
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")


def central_key(store: Features, cfg: TrainConfig, fed: Federation, head=None) -> str:
    """What the centralised ceiling depends on: store, head and its parameters (``head``'s when given: the grid
    point --select-on-val chose), feature preparation, regularisation and the (possibly noisy) training labels."""
    h = hashlib.sha256(np.ascontiguousarray(fed.labels).tobytes())
    for p in fed.parts:  # the training parts: which samples the validation holds out
        h.update(np.ascontiguousarray(p, dtype=np.int64).tobytes())
    params = dict(head.params) if head is not None else resolve_head_params(cfg.head, **cfg.head_params)
    key = [str(store.info.path), cfg.head, params, cfg.center, cfg.scale, cfg.weight_decay]
    h.update(json.dumps(key, sort_keys=True, default=str).encode())
    return h.hexdigest()


def shared_key(store: Features, cfg: TrainConfig, fed: Federation) -> str:
    """What the ceiling's head-independent candidates (probe, ridge, LDA) depend on: the store, the feature
    preparation, the training labels and parts, whether there is a validation part."""
    h = hashlib.sha256(np.ascontiguousarray(fed.labels).tobytes())
    for p in fed.parts:
        h.update(np.ascontiguousarray(p, dtype=np.int64).tobytes())
    key = ["shared", str(store.info.path), cfg.center, cfg.scale, fed.val_parts is not None]
    h.update(json.dumps(key, default=str).encode())
    return "shared:" + h.hexdigest()


class InProcessTransport(Transport):
    """See the module docstring. ``central_cache``: a dict shared by several runs (a bench report) that keeps each
    central ceiling, computed once per head, feature preparation and training labels."""

    name = "simulation"
    extendable = True  # the clients are the store's slices: a finished run continues with more rounds

    def __init__(self, cfg: TrainConfig, store: Features, device, central_cache: dict | None = None):
        self.cfg, self.store, self.device, self.central_cache = cfg, store, device, central_cache
        self.head = create_head(cfg.head, **cfg.head_params)
        self.optim = OptimConfig(name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
        self.local = LocalConfig(epochs=cfg.local_epochs, batch_size=cfg.batch_size, steps=cfg.local_steps)
        self.raw_train = torch.as_tensor(store.train_x, dtype=torch.float32)
        self.num_classes = store.info.num_classes

    def begin(self, seed: int, partition: str, partition_params: dict, saved: FeatureStats | None) -> Census:
        cfg = self.cfg
        self.fed = fed = build_federation(self.store, cfg, seed, partition, partition_params)
        self.x = prepare(self.store.train_x, fed.stats, self.device)
        self.labels = torch.as_tensor(fed.labels, device=self.device)
        data = ClientSet(x=self.x, y=self.labels, parts=fed.parts, counts=fed.counts, num_classes=self.num_classes)
        self.engine = None
        if not is_closed_form(cfg.head):
            self.engine = Engine(
                data, self.head, self.optim, self.local, backend=cfg.backend, block_clients=cfg.block_clients,
                memory_budget_mb=cfg.memory_budget_mb, dual=cfg.dual,
            )  # fmt: skip
        self.val = None
        if fed.val_parts is None and cfg.val_fraction:
            stderr_console().print(
                f"note: --val-fraction {cfg.val_fraction:g} held out no sample (no client could spare one): nothing "
                "is selected on validation in this run.", markup=False, highlight=False, soft_wrap=True,
            )  # fmt: skip
        if fed.val_parts is not None:
            idx = torch.as_tensor(np.concatenate(fed.val_parts), device=self.device)
            self.val = (self.x.index_select(0, idx), self.labels.index_select(0, idx))
        return Census(fed.stats, fed.realised_noise, fed.counts.sum(1), fed.counts)

    def validation_part(self) -> tuple | None:
        return self.val

    def validate(self, theta: torch.Tensor, scorer=None) -> dict | None:
        if self.val is None:
            return None
        acc, loss = accuracy_and_loss(theta, *self.val, head=scorer)
        return {"val_accuracy": acc, "val_loss": loss, "val_samples": len(self.val[1])}

    def scaffold_state(self, shape: tuple, device) -> ScaffoldState:
        """Every client's SCAFFOLD variate, in memory (refused in one line when they cannot fit)."""
        self._check_per_client_state(shape, "The '--scaffold' option keeps every client's control variate", "variate")
        return ScaffoldState.zeros(self.cfg.clients, shape[0], shape[1], device)

    def residual_state(self, shape: tuple, device) -> Residuals:
        """Every client's error-feedback residual, in memory (refused in one line when they cannot fit)."""
        what = f"The '--aggregate {self.cfg.aggregate}' rule keeps every client's error-feedback residual"
        self._check_per_client_state(shape, what, "residual", "--no-error-feedback or ")
        return Residuals.zeros(self.cfg.clients, shape[0], shape[1], device)

    def _check_per_client_state(self, shape: tuple, what: str, kept: str, other_fix: str = "") -> None:
        """Refuse, in one line, per-client state of ``shape`` (float32, every client's) that exceeds free memory."""
        need, free = self.cfg.clients * shape[0] * shape[1] * 4, available_memory()
        if free is not None and need > free:
            raise FedheadError(
                f"{what} in memory: {self.cfg.clients} clients x {shape[0]} x {shape[1]} floats = {need / 1e9:.1f} GB, "
                f"but this machine has {free / 1e9:.1f} GB free. Use {other_fix}fewer --clients, or run on Flower "
                f"(each node keeps its own {kept})."
            )

    def statistics(self, selected, solver, seed: int) -> Exchange:
        t0 = time.perf_counter()
        acc = accumulate(
            self.raw_train, torch.as_tensor(self.fed.labels), [self.fed.parts[k] for k in selected], self.num_classes,
            cof=solver.needs_client_means, per_client=self.cfg.backend == "loop", clip=feature_clip(self.cfg),
            **solver.message_kwargs(self.raw_train.shape[1]),
        )  # fmt: skip
        return Exchange(acc, 1000 * (time.perf_counter() - t0) / max(1, acc.clients))

    def train_round(self, theta: torch.Tensor, selected, seed: int, rnd: int, server) -> RoundResult:
        out, st = self.engine.run_round(theta, selected, seed, rnd, server.rule, **server.engine_kwargs())
        return RoundResult(out, st.clients, st.loss_sum, 1000 * st.compute_s / max(1, st.clients), st.server_s)

    def ccvr(self, theta: torch.Tensor, seed: int, rnd: int) -> Calibration:
        """Every client's class statistics of its prepared features, pooled in client order."""
        t0 = time.perf_counter()
        pooled = PooledStats(self.num_classes, self.x.shape[1] - 1)
        up = 0
        for p in self.fed.parts:
            if len(p):
                cs = ccvr_client_stats(self.x, self.fed.labels, p, self.num_classes)
                up += cs.nbytes()
                pooled.add(cs)
        return Calibration(pooled, up, time.perf_counter() - t0)

    def _personal_data(self, method, test, seed: int, rnd: int) -> tuple[ClientData, Setting]:
        """Every client of the federation as personalisation reads them, and the run's side (one construction for
        :meth:`personalize` and :meth:`personal_heads`)."""
        cfg, fed = self.cfg, self.fed
        test = test if test is not None else PersonalTest(None, None, None, np.zeros(0, dtype=np.int64))  # no scoring
        data = ClientData(
            x=self.x, labels=self.labels, parts=fed.parts, val_parts=fed.val_parts, counts=fed.counts,
            totals=fed.counts.sum(0), test_x=test.x, test_y=test.y, tests=test.tests, drift=test.drift,
            raw=self.raw_train if method.needs_statistics else None,
            raw_test=torch.as_tensor(self.store.test_x, dtype=torch.float32) if method.needs_statistics else None,
            ids=list(range(len(fed.parts))),
        )  # fmt: skip
        setting = Setting(cfg.head, cfg.head_params, self.optim, cfg.batch_size, cfg.backend, cfg.memory_budget_mb,
                          seed, rnd)  # fmt: skip
        return data, setting

    def personalize(self, method, theta: torch.Tensor, scorer, seed: int, rnd: int, test, statistics=None,
                    solver=None, progress=None):  # fmt: skip
        """Every client of the federation, block by block (:func:`fedhead.core.personalize.personalize_clients`)."""
        data, setting = self._personal_data(method, test, seed, rnd)
        note = lambda m: stderr_console().print(m, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
        return personalize_clients(method, theta, data, setting, scorer, statistics, solver, progress, note)

    def personal_heads(self, method, theta: torch.Tensor, seed: int, rnd: int, clients: list, statistics=None,
                       solver=None, beta=None) -> dict:  # fmt: skip
        """The personal heads of ``clients`` (:func:`fedhead.core.personalize.personal_heads`), from the same
        clients' data as :meth:`personalize`."""
        data, setting = self._personal_data(method, None, seed, rnd)
        return personal_heads(method, theta, data, setting, list(clients), statistics, solver, beta)

    def central(self, head, seed: int) -> dict | None:
        """The tuned ceiling (:func:`fedhead.core.central.tuned_ceiling`) on the pooled training parts (the
        validation parts held out, as for the federation), chosen on the pooled validation parts when there are
        some, reported on the test split."""
        key = central_key(self.store, self.cfg, self.fed, head)
        if self.central_cache is not None and key in self.central_cache:
            return dict(self.central_cache[key])

        def split(x_raw: np.ndarray, idx, y: torch.Tensor) -> Split:
            raw = torch.as_tensor(x_raw if idx is None else x_raw[idx], dtype=torch.float32)
            return Split(prepare(raw.numpy(), self.fed.stats, self.device), with_ones(raw, self.device), y)

        fit = np.sort(np.concatenate([np.asarray(p, dtype=np.int64) for p in self.fed.parts]))
        val = None
        if self.fed.val_parts is not None:
            vi = np.concatenate(self.fed.val_parts)
            val = split(self.store.train_x, vi, self.labels[torch.as_tensor(vi, device=self.device)])
        shared = None
        if self.central_cache is not None:  # the candidates that do not depend on the head: once per data
            shared = self.central_cache.setdefault(shared_key(self.store, self.cfg, self.fed), {})
        found = tuned_ceiling(
            head, split(self.store.train_x, fit, self.labels[torch.as_tensor(fit, device=self.device)]), val,
            split(self.store.test_x, None, torch.as_tensor(self.store.test_y, device=self.device)), self.num_classes,
            self.cfg.weight_decay, seed, shared=shared,
        )  # fmt: skip
        if self.central_cache is not None:
            self.central_cache[key] = found
        return dict(found)
