"""A head trained over federated clients: what the round loop (:mod:`fedhead.federation.loop`) runs for
``fedhead train``, every bench grid and Flower, whatever the transport that reaches the clients.

For every seed (and, with ``iid_reference``, for the IID partition with everything else equal) the transport
describes the clients (partition, label noise, the federated feature statistics); round 1 of a closed-form head or
an ``--init`` start is the statistics exchange and the server's solve; every other round samples clients by
(seed, round), has the transport train them and return the aggregation rule's result, applies the server update
(server optimiser, SCAFFOLD's ``c``), evaluates the global head on the clean test set and writes the round's row.
CCVR calibrates the head after the last round. Everything random is keyed by seed, round and client, so the
checkpoint holds only the head, the server's state, the transport's and the rows.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import numpy as np

from extract.store import Features
from fedhead.core.aggregate import aggregator_of
from fedhead.core.clientacc import (
    class_correct,
    client_accuracy,
    client_summary,
    client_weights,
    local_accuracy,
    local_summary,
    local_test_sets,
    sample_correct,
    unseen_summary,
)
from fedhead.core.clock import TimingModel, sync_round
from fedhead.core.closedform import is_closed_form, to_prepared
from fedhead.core.compress import keeps_residuals
from fedhead.core.dp import enabled as dp_enabled
from fedhead.core.dp import epsilon_schedule
from fedhead.core.engine import evaluate as overall_accuracy
from fedhead.core.heads import HEADS, create_head
from fedhead.core.openset import default_score, validation_card
from fedhead.core.openset import to_prepared as openset_prepared
from fedhead.core.personal import (
    PERSONAL_FIELDS,
    balanced_test_set,
    create_personalizer,
    drift_per_class,
    personal_summary,
)
from fedhead.core.sampling import per_round, round_clients, sample_clients
from fedhead.federation import rundir
from fedhead.federation.asyncserver import AsyncServer
from fedhead.federation.clients import FeatureStats, prepare
from fedhead.federation.config import TrainConfig
from fedhead.federation.experiment import parse_client_ids
from fedhead.federation.loop import Job, writing
from fedhead.federation.model import model_stem, write_model
from fedhead.federation.outputs import SECURE_NOTE, RunReport
from fedhead.federation.rundir import ROUND_FIELDS, RunDir
from fedhead.federation.server import ServerUpdate, ccvr_calibrate, solve_statistics, statistics_row
from fedhead.federation.summary import ceiling_note, summarize, with_ratios
from fedhead.federation.transport import Census, PersonalTest, RoundResult, Transport
from fedhead.federation.versions import first_version, members
from fedhead.infra.console import make_progress, stderr_console
from fedhead.infra.devices import available_memory, resolve_device
from fedhead.infra.errors import FedheadError
from fedhead.infra.files import atomic_torch_save
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

VAL_FIELDS = ("val_accuracy", "val_loss", "diverged")  # rounds.csv columns after ROUND_FIELDS
CLOCK_FIELDS = ("sim_time_s",)  # the simulated clock (fedhead.core.clock), after ROUND_FIELDS
ASYNC_FIELDS = ("staleness_mean",)  # --async-rule fedbuff | fedasync: the updates' mean staleness, after the rest
DIVERGE_FACTOR = 1000  # a training loss this many times the first round's counts as diverged


def val_grid(cfg: TrainConfig) -> list[dict]:
    """The grid points ``--select-on-val`` tries: the product of the declared grids (:class:`Param` ``grid``) of the
    head's parameters the user left unset (a given value is kept); [] when there are none."""
    given = {k for k, v in cfg.head_params.items() if v is not None}
    axes = [(p.name, p.grid) for p in HEADS[cfg.head].params if p.grid and p.name not in given]
    if not axes:
        return []
    return [dict(zip([n for n, _ in axes], vals)) for vals in itertools.product(*[g for _, g in axes])]


def patience_spent(rows: list, patience: int, metric: str = "accuracy") -> bool:
    """Whether the last ``patience`` validation evaluations of ``rows`` (one unit's) brought no better value of
    ``metric`` (accuracy: higher; loss: lower) than the best before them."""
    vals = [float(r[f"val_{metric}"]) for r in rows if r.get(f"val_{metric}") is not None]
    vals = [v for v in vals if v == v]
    if len(vals) <= patience:
        return False
    sign = -1.0 if metric == "loss" else 1.0
    best_before = max(sign * v for v in vals[:-patience])
    return all(sign * v <= best_before for v in vals[-patience:])


def _stats_state(stats: FeatureStats) -> dict:
    return {"mean": stats.mean, "scale": stats.scale, "up": stats.bytes_up_per_client,
            "down": stats.bytes_down_per_client}  # fmt: skip


def _stats_of(state: dict) -> FeatureStats:
    mean = None if state["mean"] is None else np.asarray(state["mean"])
    return FeatureStats(mean, state["scale"], state["up"], state["down"])


def evaluate(
    theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, num_classes: int | None = None, head=None,
    samples: bool = False,
):  # fmt: skip
    """The one evaluation of a head on the test split: its accuracy, or with ``num_classes`` the per-class correct
    and total counts (:func:`fedhead.core.clientacc.class_correct`, one pass: the accuracy and the per-client
    accuracy both come from them), and with ``samples`` each sample's correctness too (bool [N]: the local test
    sets read it). ``head``: a head not linear in the features scores through ``head.logits``."""
    if num_classes is None:
        return overall_accuracy(theta, x, y, head=head)
    if samples:
        ok = sample_correct(theta, x, y, head=head)
        yc = y.cpu().numpy()
        totals = np.bincount(yc, minlength=num_classes)[:num_classes].astype(np.int64)
        return np.bincount(yc[ok], minlength=num_classes)[:num_classes].astype(np.int64), totals, ok
    return class_correct(theta, x, y, num_classes, head=head)


class HeadJob(Job):
    """See the module docstring. ``store`` is the server's store (its test split is evaluated); ``transport``
    reaches the clients."""

    def __init__(self, cfg: TrainConfig, store: Features, transport: Transport):
        self.cfg, self.store, self.transport = cfg, store, transport
        self.device = resolve_device(cfg.device)
        self.head = create_head(cfg.head, **cfg.head_params)
        closed = is_closed_form(cfg.head)
        self.solver = create_head(cfg.head if closed else cfg.init, **cfg.head_params) if closed or cfg.init else None
        self.rounds = 1 if closed else cfg.rounds
        self.scorer = None if self.head.linear else self.head  # qda, ridge-rf: scores not linear in the features
        self.privacy = epsilon_schedule(cfg, self.rounds)  # DP: epsilon per round ({} without DP)
        self.personal = create_personalizer(cfg.personalize, **cfg.personal_params) if cfg.personalize else None
        self.fields = ROUND_FIELDS + list(CLOCK_FIELDS) + list(VAL_FIELDS) + list(transport.extra_fields)
        if cfg.async_rule != "none":
            self.fields += list(ASYNC_FIELDS)
        self.timing = TimingModel.from_config(cfg)
        self.sim_now, self.asyncs = 0.0, None  # a unit's simulated seconds; its asynchronous server (AsyncServer)
        if self.personal is not None:
            self.fields += list(PERSONAL_FIELDS)
        self.global_acc = None  # the summed statistics of round 1 (closed-form personal heads)
        self.extendable = not closed and transport.extendable
        self.y_test = torch.as_tensor(store.test_y, device=self.device)
        self.test_totals = np.bincount(store.test_y, minlength=store.info.num_classes)[: store.info.num_classes]
        self.client_w = None  # the unit's clients' label proportions (per-client accuracy), None if unknown
        variants = [("main", cfg.partition, cfg.partition_params)]
        if cfg.iid_reference:
            variants = variants + [("iid", "iid", {})] if cfg.partition != "iid" else [("main", "iid", {})]
        self.variants = {name: (part, params) for name, part, params in variants}
        self.realised: dict = {}
        self.client_rows: list = []
        self.central: dict = {}

    # ---------------------------------------------------------------- units

    def units(self) -> list[tuple]:
        return [(seed, name) for seed in self.cfg.seeds for name in self.variants]

    def label(self, unit: tuple) -> str:
        return f"seed {unit[0]} {unit[1]} {self.variants[unit[1]][0]}"

    def last_round(self, unit: tuple) -> int:
        return self.rounds

    def start(self, unit: tuple, saved: dict | None) -> tuple[int, list]:
        cfg, (seed, name) = self.cfg, unit
        part, params = self.variants[name]
        census = self.transport.begin(seed, part, params, _stats_of(saved["census"]) if saved else None)
        self._census(unit, census)
        counts = census.counts  # none with secure aggregation: no per-client accuracy then
        self.client_w = None if counts is None else client_weights(np.asarray(counts), self.test_totals)
        # --client-test: each client's local test set drawn from the test split in its training label proportions
        self.local = (
            local_test_sets(np.asarray(counts), self.store.test_y, seed)
            if counts is not None and (cfg.client_test or self.personal is not None)
            else None
        )
        self.global_acc = None
        self.kept_acc = None  # --keep-statistics: the summed statistics of round 1
        # --eval-unseen-clients: which clients a round has sampled so far (None: not asked for, or no label counts)
        self.trained = np.zeros(len(counts), dtype=bool) if counts is not None and cfg.eval_unseen_clients else None
        self.stats = census.stats
        self.xt = prepare(self.store.test_x, census.stats, self.device)
        self.chosen: dict = {}  # --select-on-val: the grid point this unit's validation chose
        self.openset: dict = {}  # the solved closed-form head's open-set statistics (raw features; lda, qda)
        C, D1 = self.store.info.num_classes, self.store.test_x.shape[1] + 1
        scaffold = self.transport.scaffold_state((C, D1), self.device) if cfg.scaffold else None
        residuals = self.transport.residual_state((C, D1), self.device) if keeps_residuals(cfg) else None
        self.server = ServerUpdate(cfg, (C, D1), self.device, scaffold=scaffold, residuals=residuals)
        self.theta = torch.zeros(C, D1, device=self.device)
        self.head_bytes = self.theta.numel() * self.theta.element_size()
        self.msg_bytes = aggregator_of(cfg).nbytes(self.theta)
        n = len(self.store.train_y) / max(1, cfg.clients)  # each client's size where secure aggregation hides them
        self.sizes = np.asarray(census.sizes, dtype=np.float64) if census.sizes is not None else np.full(cfg.clients, n)
        self.sim_now = 0.0
        self.asyncs = AsyncServer(cfg, self.timing, seed, self.sizes) if cfg.async_rule != "none" else None
        if saved is None:
            return 1, []
        self.theta = saved["theta"].to(self.device)
        clock = saved.get("clock") or {}
        self.sim_now = float(clock.get("now", 0.0))
        if self.asyncs is not None and clock.get("async") is not None:
            self.asyncs.load_state_dict(clock["async"], self.device)
        self.openset = dict(saved.get("openset") or {})  # a resumed closed-form unit: its solve's statistics
        self.server.load_state_dict(saved.get("server", {}), self.device)
        self.transport.load_unit_state(saved.get("transport", {}))
        done = int(saved["round"])
        if self.trained is not None:  # the clients sampled before the checkpoint: the draws are keyed by (seed, round)
            for r in range(1, done + 1):
                self.trained[round_clients(cfg, seed, r)] = True
        rows = [dict(r) for r in saved["rows"] if r.get("stage") != "ccvr" and int(r["round"]) <= done]
        if rows and done % cfg.eval_every != 0:  # an extended run: its old last round is no evaluation round now
            rows[-1]["accuracy"] = float("nan")
        return done + 1, rows

    def _census(self, unit: tuple, census: Census) -> None:
        seed, name = unit
        if census.realised_noise is not None:
            self.realised[f"{seed}:{name}"] = census.realised_noise
        if name == "main" and census.counts is not None:
            self.client_rows = [r for r in self.client_rows if r["seed"] != seed]
            sizes, counts = np.asarray(census.sizes, dtype=np.int64), np.asarray(census.counts, dtype=np.int64)
            self.client_rows.append({"seed": seed, "sizes": sizes, "counts": counts})  # arrays: a cheap checkpoint

    # ---------------------------------------------------------------- rounds

    def round(self, unit: tuple, rnd: int) -> dict:
        cfg, (seed, name) = self.cfg, unit
        first = rnd == 1
        exchange = self.solver is not None and first
        sel = round_clients(cfg, seed, rnd)
        if not exchange and cfg.over_selection and self.asyncs is None:  # Bonawitz et al.: ceil((1 + F) m) selected
            picked = math.ceil((1 + cfg.over_selection) * per_round(cfg) - 1e-9)
            sel = sample_clients(cfg.clients, cfg.participation, seed, rnd, count=picked)
        if self.trained is not None:
            self.trained[sel] = True
        extra_up = self.stats.bytes_up_per_client if first else 0
        stats_bytes = cfg.clients * (extra_up + self.stats.bytes_down_per_client) if first else 0
        if exchange:
            row = self._exchange(sel, seed, extra_up, stats_bytes)
        else:
            row = self._train(sel, seed, rnd, extra_up, stats_bytes)
        row["sim_time_s"] = self.sim_now
        evaluated = rnd % cfg.eval_every == 0 or rnd == self.rounds
        acc, clients = self._evaluate() if evaluated else (float("nan"), {})
        val = (self.transport.validate(self.theta, self.scorer) if evaluated else None) or {}
        part = self.variants[name][0]
        return {"seed": seed, "round": rnd, "accuracy": acc, **row, "ratio_to_iid": None, "run": name,
                "partition": part, "val_accuracy": val.get("val_accuracy", float("nan")),
                "val_loss": val.get("val_loss", float("nan")), "diverged": 0, **self.privacy.get(rnd, {}),
                **clients}  # fmt: skip

    def _evaluate(self) -> tuple[float, dict]:
        """The global head's test accuracy and, when the clients' label counts are known, the per-client accuracy
        fields (:mod:`fedhead.core.clientacc`), from one pass over the test split."""
        C = self.store.info.num_classes
        if self.local is not None:  # one pass: per-sample correctness gives the class counts and the local sets
            correct, totals, ok = evaluate(self.theta, self.xt, self.y_test, C, head=self.scorer, samples=True)
        else:
            correct, totals = evaluate(self.theta, self.xt, self.y_test, C, head=self.scorer)
        acc = int(correct.sum()) / max(1, len(self.y_test))
        if self.client_w is None:
            return acc, {}
        clients = client_summary(client_accuracy(self.client_w, correct, totals))
        if self.local is not None:
            clients.update(local_summary(local_accuracy(self.local, ok)))
        if self.trained is not None:
            clients.update(unseen_summary(self.client_w, correct, totals, self.trained))
        return acc, clients

    def _exchange(self, sel, seed: int, extra_up: int, stats_bytes: int) -> dict:
        """Round 1 of a closed-form head or an --init start: the clients' statistics summed, the server's solve."""
        ex = self.transport.statistics(sel, self.solver, seed)
        t0 = time.perf_counter()
        self.theta = solve_statistics(self.solver, ex.acc, self.cfg, self.stats, self.device, seed=seed)
        if is_closed_form(self.cfg.head):
            self.openset = self.solver.openset_statistics(ex.acc)
        chosen = self._select_on_val(ex.acc) if is_closed_form(self.cfg.head) else {}
        if self.personal is not None and self.personal.needs_statistics:
            self.global_acc = ex.acc  # with DP: the noisy sums, as the server solved them
        if self.cfg.keep_statistics:  # --keep-statistics (never with DP): the sums beside the model
            self.kept_acc = ex.acc
        if is_closed_form(self.cfg.head):  # the solved head goes down: qda's and ridge-rf's are not [C, D+1]
            self.head_bytes = self.theta.numel() * self.theta.element_size()
        server_s = ex.server_s + time.perf_counter() - t0
        up = ex.acc.bytes_up / max(1, ex.acc.clients) + extra_up  # one pass over its data, its statistics up
        took = self.timing.durations(seed, self.sizes, 0.0, up)[np.asarray(sel, dtype=np.int64)]
        self.sim_now += float(took.max(initial=0.0))
        row = statistics_row(ex.acc, ex.client_ms, server_s, self.cfg, len(sel), self.head_bytes, extra_up, stats_bytes)
        return {**row, **ex.extra, **chosen}

    def _select_on_val(self, acc) -> dict:
        """``--select-on-val``: each grid point of the head's unset grid parameters (:func:`val_grid`) solved from
        the same summed statistics and scored on the validation part; the most accurate one (the first in grid
        order on a tie) becomes the head. Returns the row's ``selected_params`` (empty when nothing was chosen:
        no grid, no validation part, or DP, whose accounting does not cover a choice made on the clients' data)."""
        cfg = self.cfg
        grid = val_grid(cfg) if cfg.select_on_val and not dp_enabled(cfg) else []
        best = None
        for values in grid:
            head = create_head(cfg.head, **{**cfg.head_params, **values})
            head.message_kwargs(self.store.test_x.shape[1])  # the same lift and sketch the clients' statistics used
            theta = head.solve_statistics(acc)
            theta = theta.to(device=self.device, dtype=torch.float32 if theta.ndim == 2 else torch.float64)
            scorer = None if head.linear else head
            val = self.transport.validate(theta, scorer)
            if val is None:  # no validation part: the solved head stays, nothing is chosen
                return {}
            score = val["val_accuracy"]
            if best is None or score > best[0]:
                best = (score, values, theta, scorer, head)
        if best is None:  # no grid
            return {}
        _, values, self.theta, self.scorer, head = best
        self.openset = head.openset_statistics(acc)
        self.chosen = dict(values)
        return {"selected_params": " ".join(f"{k}={v:g}" for k, v in values.items())}

    def _durations(self, seed: int) -> np.ndarray:
        """Every client's seconds for one dispatch of local training (:class:`fedhead.core.clock.TimingModel`)."""
        cfg = self.cfg
        work = (
            np.full(cfg.clients, float(cfg.local_steps * cfg.batch_size))
            if cfg.local_steps
            else self.sizes * (cfg.local_epochs or 1)
        )
        down = self.server.transfer_multiplier() * self.head_bytes
        return self.timing.durations(seed, work, down, down - self.head_bytes + self.msg_bytes)

    def _clocked_round(self, sel, seed: int, rnd: int, previous: torch.Tensor) -> RoundResult:
        """A round on the simulated clock: the asynchronous rule's server update, or the synchronous round's clients
        that are back in time (dropouts, --deadline, --over-selection) trained; the clock advanced."""
        durations = self._durations(seed)
        if self.asyncs is not None:
            res = self.asyncs.step(previous, rnd, self.transport, self.server, durations)
            self.sim_now = self.asyncs.now
            return res
        sel = np.asarray(sel, dtype=np.int64)
        lost = np.array([self.timing.dropped(seed, rnd, int(k)) for k in sel], dtype=bool)
        kept, took = sync_round(sel, durations[sel], lost, per_round(self.cfg), self.cfg.deadline)
        self.sim_now += took
        if len(kept) == 0:
            return RoundResult(None, 0, 0.0, 0.0, 0.0)
        return self.transport.train_round(previous, kept, seed, rnd, self.server)

    def _train(self, sel, seed: int, rnd: int, extra_up: int, stats_bytes: int) -> dict:
        previous = self.theta
        res = self._clocked_round(sel, seed, rnd, previous)
        t0 = time.perf_counter()
        if res.aggregate is not None:
            self.theta = self.server.step(previous, res.aggregate)
        server_s = res.server_s + time.perf_counter() - t0
        down = self.server.transfer_multiplier() * self.head_bytes  # SCAFFOLD's c travels too
        up = down - self.head_bytes + self.msg_bytes  # the rule's message (+ the c_k delta)
        return {
            "stage": self.head.stage(rnd),
            "train_loss": res.loss_sum / max(1, res.clients),
            "client_ms": res.client_ms,
            "server_ms": 1000 * server_s,
            "bytes_up_per_client": up + extra_up,
            "bytes_total": (len(sel) if self.asyncs is None else res.clients) * (up + down) + stats_bytes,
            "clients_trained": res.clients,
            **res.extra,
        }

    def unit_state(self) -> dict:
        clock = {"now": self.sim_now, "async": self.asyncs.state_dict() if self.asyncs is not None else None}
        return {"theta": self.theta.detach().cpu().clone(), "server": self.server.state_dict(),
                "census": _stats_state(self.stats), "transport": self.transport.unit_state(), "clock": clock,
                "openset": dict(self.openset)}  # fmt: skip

    def progress_info(self, row: dict) -> str:
        return f"acc {row['accuracy']:.4f}" if not math.isnan(row["accuracy"]) else ""

    def after_checkpoint(self, unit: tuple, rnd: int, row: dict) -> None:
        self.transport.after_round(unit[0], rnd, self.rounds, row)

    def diverged(self, unit: tuple, rows: list) -> str | None:
        """Why the unit's last round diverged (None if it did not): its training loss not finite, or more than
        DIVERGE_FACTOR times the unit's first finite training loss of the same stage."""
        last = rows[-1]
        if self.solver is not None and int(last["round"]) == 1 or last.get("stage") in ("statistics", "ccvr"):
            return None
        loss = float(last["train_loss"])
        same = [r for r in rows if r.get("stage") == last.get("stage")]  # a two-stage head's losses differ in scale
        first = next((float(r["train_loss"]) for r in same if math.isfinite(float(r["train_loss"]))), None)
        if not math.isfinite(loss):
            return f"its training loss is {loss}"
        if first is not None and first > 0 and loss > DIVERGE_FACTOR * first:
            return f"its training loss {loss:.3g} is over {DIVERGE_FACTOR}x the first round's ({first:.3g})"
        return None

    def annotate(self, unit: tuple, rows: list) -> None:
        """Flag the last row when its round diverged (``diverged`` = 1 in rounds.csv)."""
        why = self.diverged(unit, rows)
        if why is not None:
            rows[-1]["diverged"] = 1
            self.divergence = (int(rows[-1]["round"]), why)

    def stop_after(self, unit: tuple, rows: list) -> bool:
        """Whether the unit stops before its last round: a diverged round (--on-diverge stop), or --early-stop's
        patience spent (read off the rows, so a resumed run stops where the interrupted one would have)."""
        cfg = self.cfg
        if rows and rows[-1].get("diverged") and cfg.on_diverge == "stop":
            rnd, why = getattr(self, "divergence", None) or (int(rows[-1]["round"]), "it diverged")
            raise FedheadError(
                f"Round {rnd} of seed {unit[0]} ({unit[1]}) diverged: {why}. Lower --lr (now {cfg.lr:g}) and run "
                "again in a new --out, or pass --on-diverge continue to keep going; rounds.csv holds the rounds "
                "so far, the diverged one marked."
            )
        return bool(cfg.early_stop) and patience_spent(rows, cfg.early_stop, cfg.early_stop_metric)

    def finish_unit(self, unit: tuple, rows: list) -> tuple[list, dict]:
        """CCVR after the last round (when asked); the unit's head, feature statistics and count of correct test
        predictions are kept for ``head-seed<S>[-iid].pt`` and the model (:mod:`fedhead.federation.model`)."""
        cfg, (seed, name) = self.cfg, unit
        extra = []
        if cfg.calibrate == "ccvr":
            rnd = self.rounds + 1
            cal = self.transport.ccvr(self.theta, seed, rnd)
            self.theta, row = ccvr_calibrate(
                self.head, self.theta, cal.pooled, cfg, seed, self.xt, self.y_test, rnd, cfg.clients, cal.bytes_up,
                cal.client_s,
            )  # fmt: skip
            extra.append({"seed": seed, **row, "run": name, "partition": self.variants[name][0], **cal.extra,
                          **self._evaluate()[1]})  # fmt: skip
            self.transport.after_round(seed, rnd, self.rounds, extra[-1])
        if cfg.central_reference and name == "main" and str(seed) not in self.central:
            # the ceiling after the rounds: a closed-form head's own candidate uses the parameters it ended with
            head = create_head(cfg.head, **{**cfg.head_params, **self.chosen}) if self.chosen else self.head
            found = self.transport.central(head, seed)
            if found is not None:
                self.central[str(seed)] = found
        correct = int(round(evaluate(self.theta, self.xt, self.y_test, head=self.scorer) * len(self.y_test)))
        kept = {"head": self.theta.detach().cpu().clone(), "stats": _stats_state(self.stats), "correct": correct,
                "members": members(cfg, seed, self.rounds), "openset": self._openset()}  # fmt: skip
        if cfg.keep_statistics:
            kept["statistics"] = self._kept_statistics(seed)
        if self.personal is not None and name == "main" and self.local is not None:
            got, kept["personal"], models = self._personalize(seed)
            (extra[-1] if extra else rows[-1]).update(got)  # the row of the head the clients start from
            if models:  # --personal-models: the listed clients' heads, written by finish
                kept["personal_models"] = models
        return extra, kept

    def _kept_statistics(self, seed: int) -> dict:
        """``--keep-statistics``: round 1's summed statistics as tensors, and the head parameters the solve used (a
        value chosen on validation included). A run resumed after round 1 sums them again (keyed by seed)."""
        acc = self.kept_acc
        if acc is None:
            acc = self.transport.statistics(round_clients(self.cfg, seed, 1), self.solver, seed).acc
            self._select_on_val(acc)  # the same choice as before (self.chosen)
        params = {**self.cfg.head_params, **self.chosen}
        return {"tensors": acc.tensors(), "clients": int(acc.clients), "head_params": params}

    def _openset(self) -> dict:
        """The model's open-set part (:mod:`fedhead.core.openset`): the solved head's statistics mapped to the
        prepared features (``tensors``) and, where the transport holds a validation part, the card's entry with the
        validation quantiles of every score the model can compute (``card``)."""
        tensors = openset_prepared(self.openset, self.stats.mean, self.stats.scale) if self.openset else {}
        out: dict = {"tensors": tensors}
        val = self.transport.validation_part()
        if val is not None and self.cfg.head in HEADS:
            x = val[0].to("cpu")
            theta = self.theta.detach().to("cpu")
            with torch.no_grad():
                logits = self.scorer.logits(theta, x) if self.scorer is not None else x @ theta.T.to(x.dtype)
            out["card"] = validation_card(default_score(HEADS[self.cfg.head].cls), logits, x[:, :-1], tensors)
        return out

    def _personalize(self, seed: int) -> tuple[dict, dict, dict]:
        """``--personalize``: every client's personal head from the final global head, scored on its local test set
        and the drift set; returns the row fields (:data:`PERSONAL_FIELDS`), the per-client counts and the personal
        heads of the clients ``--personal-models`` lists (:meth:`_personal_models`)."""
        cfg, C = self.cfg, self.store.info.num_classes
        per_class = drift_per_class(cfg.personal_drift, C, cfg.clients)
        if not per_class and cfg.personal_drift is None:
            stderr_console().print(
                f"note: no drift measure by default at {cfg.clients:,} clients x {C:,} classes (each client's head "
                "scored on every class); --personal-drift 1 asks for it.", markup=False, highlight=False, soft_wrap=True,
            )  # fmt: skip
        drift = balanced_test_set(self.store.test_y, per_class, seed) if per_class else np.zeros(0, dtype=np.int64)
        statistics = solver = None
        if self.personal.needs_statistics:
            statistics = self.global_acc
            if statistics is None:  # resumed after round 1: the exchange again (deterministic, keyed by seed)
                statistics = self.transport.statistics(round_clients(cfg, seed, 1), self.solver, seed).acc
                solve_statistics(self.solver, statistics, cfg, self.stats, self.device, seed=seed)  # DP noise again
                if is_closed_form(cfg.head):
                    self._select_on_val(statistics)  # the same choice as before (self.chosen)
            name = cfg.head if is_closed_form(cfg.head) else cfg.init
            solver = create_head(name, **{**cfg.head_params, **self.chosen})
        test = PersonalTest(self.xt, self.y_test, self.local, drift)
        with make_progress() as prog:
            task = prog.add_task(f"personalize {self.personal.name}", total=cfg.clients, info="")
            got = self.transport.personalize(
                self.personal, self.theta, self.scorer, seed, self.rounds, test, statistics, solver,
                progress=lambda n: prog.advance(task, n),
            )  # fmt: skip
        fields = personal_summary(got.sizes, got.correct, got.correct_global, got.drift, got.drift_global,
                                  got.drift_size, got.seconds)  # fmt: skip
        per_client = {"sizes": got.sizes, "correct": got.correct, "correct_global": got.correct_global,
                      "drift": got.drift, "drift_size": got.drift_size, "beta": got.beta}  # fmt: skip
        return fields, per_client, self._personal_models(seed, statistics, solver, got.beta)

    def _personal_models(self, seed: int, statistics, solver, beta) -> dict:
        """``--personal-models``: the listed clients' personal heads (the ones :meth:`_personalize` scored), on the
        CPU and on the run's prepared features (a closed-form personal head is solved on raw features): ``{k:
        {"theta": head, "shift": a qda head's log-prior [C] or None}}``; {} when none is asked for."""
        cfg = self.cfg
        ids = parse_client_ids(cfg.personal_models) if cfg.personal_models is not None else None
        if not ids:
            return {}
        ids = list(range(cfg.clients)) if ids == "all" else ids
        need, free = len(ids) * len(cfg.seeds) * self.theta.numel() * 8, available_memory()
        if free is not None and need > free:
            raise FedheadError(
                f"The '--personal-models' parameter {cfg.personal_models} keeps {len(ids):,} personal heads x "
                f"{len(cfg.seeds)} seeds in memory until the run writes them ({need / 1e9:.1f} GB), but this machine "
                f"has {free / 1e9:.1f} GB free. List fewer clients, e.g. --personal-models 0,1,2."
            )
        try:
            heads = self.transport.personal_heads(self.personal, self.theta, seed, self.rounds, ids, statistics,
                                                  solver, beta)  # fmt: skip
        except NotImplementedError:
            raise FedheadError(
                f"The '--personal-models' option needs the clients' personal heads, and the {self.transport.name} "
                "transport keeps each on its client (only counts come back). Got --personal-models "
                f"{cfg.personal_models}. Drop it, or run with fedhead train (in process)."
            ) from None
        raw = self.personal.needs_statistics and (self.stats.mean is not None or self.stats.scale != 1.0)
        out = {}
        for k in ids:
            theta, shift = heads[k] if isinstance(heads[k], tuple) else (heads[k], None)
            theta = theta.detach().cpu()
            if raw and theta.ndim == 2:  # --init's closed form on raw features: the same scores on prepared ones
                theta = to_prepared(theta, self.stats.mean, self.stats.scale)
            out[int(k)] = {"theta": theta.clone(), "shift": None if shift is None else shift.detach().cpu().clone()}
        return out

    # ---------------------------------------------------------------- the run

    def run_state(self) -> dict:
        return {"realised": dict(self.realised), "client_rows": [_sparse_counts(r) for r in self.client_rows],
                "central": dict(self.central), "transport": self.transport.run_state()}  # fmt: skip

    def load_run_state(self, state: dict) -> None:
        self.realised = dict(state.get("realised", {}))
        self.client_rows = [_dense_counts(r) for r in state.get("client_rows", [])]
        self.central = dict(state.get("central", {}))
        self.transport.load_run_state(state.get("transport", {}))

    def table(self, rows: list) -> list:
        return with_ratios(rows, self.central)

    def finish(self, run: RunDir, done: list, rows: list, wall_s: float) -> dict:
        """The heads and models of every unit, clients.csv and summary.json."""
        summary = summarize(with_ratios(rows, self.central), self.cfg, self.realised, wall_s, self.central)
        summary.update(self.transport.summary_fields(rows))
        note = ceiling_note(summary)
        if note is not None:
            stderr_console().print(note, markup=False, highlight=False, soft_wrap=True)
        per_seed = {r["seed"]: r for r in summary["per_seed"]}
        for d in done:
            path = head_path(run.path, *d["unit"])
            with writing(run, path):
                atomic_torch_save(d["head"], path)
            if "stats" in d:  # a unit finished by an earlier fedhead kept no statistics: it has no model
                seed, name = d["unit"]
                metrics = model_metrics(d, len(self.store.test_y), per_seed.get(seed) if name == "main" else None)
                card = path.with_name(model_stem(seed, name) + ".json")
                with writing(run, card):
                    extra = first_version(run.path, (seed, name), self.cfg, self.store, d, metrics)
                    write_model(run.path, (seed, name), d["head"], _stats_of(d["stats"]), self.cfg, self.store, metrics,
                                openset=d.get("openset"), extra=extra)  # fmt: skip
        if self.client_rows:  # none with secure aggregation: the server never sees a client's counts
            with writing(run, run.path / "clients.csv"):
                rundir.write_clients_per_seed(run.path, self.client_rows)
        personal = [(d["unit"][0], d["personal"]) for d in done if "personal" in d]
        if personal:
            with writing(run, run.path / PERSONAL_CSV):
                write_personal(run.path / PERSONAL_CSV, personal, self.personal.name)
        for d in done:  # --personal-models: model-seed<S>-client<K>.json + .safetensors
            for k, m in sorted(d.get("personal_models", {}).items()):
                seed = d["unit"][0]
                card = run.path / (model_stem(seed, client=k) + ".json")
                metrics, personal_card = personal_model_card(d["personal"], k, self.personal)
                with writing(run, card):
                    write_model(run.path, (seed, "main"), m["theta"], _stats_of(d["stats"]), self.cfg, self.store,
                                metrics, client=k, personal=personal_card, shift=m["shift"])  # fmt: skip
        with writing(run, run.path / "summary.json"):
            rundir.write_summary(run.path, summary)
        return summary

    def report(self, done: list, summary: dict) -> RunReport:
        """The plots' and trackers' data: the first seed's label counts (none with secure aggregation: the server
        never sees them), the central ceiling, the configuration, each seed's per-client gains of --personalize."""
        cfg = self.cfg
        first = [r for r in self.client_rows if r["seed"] == cfg.seeds[0]] or self.client_rows
        counts = np.asarray(first[0]["counts"]) if first else None
        note = SECURE_NOTE if counts is None and cfg.secure_aggregation else ""
        return RunReport(
            plots=cfg.plots,
            log=cfg.log,
            log_dir=cfg.log_dir,
            title=f"{cfg.head} on {cfg.partition}, {cfg.clients} clients",
            seed=first[0]["seed"] if first and len(cfg.seeds) > 1 else None,
            central=self.central,
            counts=counts,
            labels=list(self.store.info.class_names),
            note=note,
            params=cfg.to_dict(),
            gains=[(d["unit"][0], personal_gains(d["personal"])) for d in done if "personal" in d],
            personalize=cfg.personalize or "",
        )


MODEL_SUMMARY_KEYS = ("final_accuracy", "selected_round", "val_accuracy", "test_accuracy_at_selected", "acc95_round", "iid_final_accuracy", "final_ratio_to_iid",
                      "central_accuracy", "final_ratio_to_central", "realised_noise_rate", "mb_per_client")  # fmt: skip


def model_metrics(done: dict, test_samples: int, seed_summary: dict | None) -> dict:
    """A model's key metrics: the run's own evaluation of its head on the test split (accuracy and count of correct
    predictions) and, for a seed's main run, that seed's summary."""
    rows = [r for r in done["rows"] if r["accuracy"] == r["accuracy"]]
    out = {"test_accuracy": done["correct"] / test_samples if test_samples else float("nan"),
           "test_correct": done["correct"], "test_samples": test_samples,
           "evaluated_round": rows[-1]["round"] if rows else 0}  # fmt: skip
    for k in MODEL_SUMMARY_KEYS:
        if seed_summary is not None and seed_summary.get(k) is not None:
            out[k] = seed_summary[k]
    return out


def _sparse_counts(row: dict) -> dict:
    """A seed's clients as the checkpoint keeps them: the non-zero class counts only (10,000 clients x 1,203 classes
    are 96 MB dense, written every round; their non-zeros are at most the training set)."""
    sizes = np.asarray(row["sizes"], dtype=np.int64)
    counts = np.asarray(row["counts"], dtype=np.int64).reshape(len(sizes), -1)
    k, c = np.nonzero(counts)
    return {"seed": row["seed"], "sizes": sizes, "shape": counts.shape, "nonzero": (k, c, counts[k, c])}


def _dense_counts(row: dict) -> dict:
    """The inverse of :func:`_sparse_counts` (a checkpoint of an earlier version holds the dense counts)."""
    if "nonzero" not in row:
        return dict(row)
    counts = np.zeros(row["shape"], dtype=np.int64)
    k, c, v = row["nonzero"]
    counts[k, c] = v
    return {"seed": row["seed"], "sizes": row["sizes"], "counts": counts}


PERSONAL_CSV = "personal.csv"
PERSONAL_COLUMNS = ["seed", "client", "method", "test_samples", "global_correct", "personal_correct",
                    "global_accuracy", "personal_accuracy", "gain", "drift_accuracy", "beta"]  # fmt: skip


def write_personal(path: Path, per_seed: list, method: str) -> None:
    """personal.csv: one row per seed and client with a local test set: its local test size, the correct
    predictions and accuracies of the global and of its personal head there, the gain, the personal head's accuracy
    on the drift set, and the closed-form head's beta (empty for other methods)."""
    rows = []
    for seed, p in per_seed:
        sizes = np.asarray(p["sizes"])
        for k in np.flatnonzero(sizes > 0).tolist():
            n, cp, cg = int(sizes[k]), int(p["correct"][k]), int(p["correct_global"][k])
            ds = int(p["drift_size"])
            b = float(p["beta"][k])
            rows.append({"seed": seed, "client": k, "method": method, "test_samples": n, "global_correct": cg,
                         "personal_correct": cp, "global_accuracy": cg / n, "personal_accuracy": cp / n,
                         "gain": (cp - cg) / n, "drift_accuracy": int(p["drift"][k]) / ds if ds else "",
                         "beta": b if b == b else ""})  # fmt: skip
    rundir.write_csv(path, rows, PERSONAL_COLUMNS)


def personal_gains(p: dict) -> np.ndarray:
    """Each client's gain of its personal head over the global head on its local test set (personal.csv's
    ``gain``), for the clients that have one, in client order."""
    sizes = np.asarray(p["sizes"], dtype=np.int64)
    has = sizes > 0
    diff = np.asarray(p["correct"], dtype=np.int64)[has] - np.asarray(p["correct_global"], dtype=np.int64)[has]
    return diff / sizes[has]


def personal_model_card(p: dict, k: int, method) -> tuple[dict, dict]:
    """Client ``k``'s personal model's ``metrics`` (its head and the global head on the client's local test set, as
    personal.csv has them, and on the drift set) and its card's ``personal`` entry (method, parameters, the
    closed-form beta), from the unit's per-client counts ``p`` (:meth:`HeadJob._personalize`)."""
    n, cp, cg = int(p["sizes"][k]), int(p["correct"][k]), int(p["correct_global"][k])
    ds = int(p["drift_size"])
    metrics = {"local_test_samples": n, "local_test_correct": cp, "global_local_test_correct": cg,
               "local_test_accuracy": cp / n if n else None, "global_local_test_accuracy": cg / n if n else None,
               "gain": (cp - cg) / n if n else None, "drift_accuracy": int(p["drift"][k]) / ds if ds else None,
               "drift_samples": ds}  # fmt: skip
    card = {"method": method.name, "params": dict(method.params),
            "scored_on": "the client's local test set: test samples drawn in its training label proportions"}  # fmt: skip
    b = float(p["beta"][k])
    if b == b:  # closed-form: the beta the client chose on its validation part (or the one given)
        card["beta"] = b
    return metrics, card


def head_path(run_dir: Path, seed: int, name: str = "main") -> Path:
    """The file a unit's final head is written to."""
    return Path(run_dir) / (f"head-seed{seed}.pt" if name == "main" else f"head-seed{seed}-iid.pt")
