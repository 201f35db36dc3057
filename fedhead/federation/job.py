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
from fedhead.core.closedform import is_closed_form
from fedhead.core.compress import keeps_residuals
from fedhead.core.dp import enabled as dp_enabled
from fedhead.core.dp import epsilon_schedule
from fedhead.core.engine import evaluate as overall_accuracy
from fedhead.core.heads import HEADS, create_head
from fedhead.core.sampling import round_clients
from fedhead.federation import rundir
from fedhead.federation.clients import FeatureStats, prepare
from fedhead.federation.config import TrainConfig
from fedhead.federation.loop import Job, writing
from fedhead.federation.model import model_stem, write_model
from fedhead.federation.outputs import SECURE_NOTE, RunReport
from fedhead.federation.rundir import ROUND_FIELDS, RunDir
from fedhead.federation.server import ServerUpdate, ccvr_calibrate, solve_statistics, statistics_row
from fedhead.federation.summary import ceiling_note, summarize, with_ratios
from fedhead.federation.transport import Census, Transport
from fedhead.infra.console import stderr_console
from fedhead.infra.devices import resolve_device
from fedhead.infra.errors import FedheadError
from fedhead.infra.files import atomic_torch_save
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

VAL_FIELDS = ("val_accuracy", "val_loss", "diverged")  # rounds.csv columns after ROUND_FIELDS
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
        self.fields = ROUND_FIELDS + list(VAL_FIELDS) + list(transport.extra_fields)
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
            if counts is not None and cfg.client_test
            else None
        )
        # --eval-unseen-clients: which clients a round has sampled so far (None: not asked for, or no label counts)
        self.trained = np.zeros(len(counts), dtype=bool) if counts is not None and cfg.eval_unseen_clients else None
        self.stats = census.stats
        self.xt = prepare(self.store.test_x, census.stats, self.device)
        self.chosen: dict = {}  # --select-on-val: the grid point this unit's validation chose
        C, D1 = self.store.info.num_classes, self.store.test_x.shape[1] + 1
        scaffold = self.transport.scaffold_state((C, D1), self.device) if cfg.scaffold else None
        residuals = self.transport.residual_state((C, D1), self.device) if keeps_residuals(cfg) else None
        self.server = ServerUpdate(cfg, (C, D1), self.device, scaffold=scaffold, residuals=residuals)
        self.theta = torch.zeros(C, D1, device=self.device)
        self.head_bytes = self.theta.numel() * self.theta.element_size()
        self.msg_bytes = aggregator_of(cfg).nbytes(self.theta)
        if saved is None:
            return 1, []
        self.theta = saved["theta"].to(self.device)
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
        sel = round_clients(cfg, seed, rnd)
        if self.trained is not None:
            self.trained[sel] = True
        first = rnd == 1
        extra_up = self.stats.bytes_up_per_client if first else 0
        stats_bytes = cfg.clients * (extra_up + self.stats.bytes_down_per_client) if first else 0
        if self.solver is not None and first:
            row = self._exchange(sel, seed, extra_up, stats_bytes)
        else:
            row = self._train(sel, seed, rnd, extra_up, stats_bytes)
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
        chosen = self._select_on_val(ex.acc) if is_closed_form(self.cfg.head) else {}
        if is_closed_form(self.cfg.head):  # the solved head goes down: qda's and ridge-rf's are not [C, D+1]
            self.head_bytes = self.theta.numel() * self.theta.element_size()
        server_s = ex.server_s + time.perf_counter() - t0
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
                best = (score, values, theta, scorer)
        if best is None:  # no grid
            return {}
        _, values, self.theta, self.scorer = best
        self.chosen = dict(values)
        return {"selected_params": " ".join(f"{k}={v:g}" for k, v in values.items())}

    def _train(self, sel, seed: int, rnd: int, extra_up: int, stats_bytes: int) -> dict:
        previous = self.theta
        res = self.transport.train_round(previous, sel, seed, rnd, self.server)
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
            "bytes_total": len(sel) * (up + down) + stats_bytes,
            "clients_trained": res.clients,
            **res.extra,
        }

    def unit_state(self) -> dict:
        return {"theta": self.theta.detach().cpu().clone(), "server": self.server.state_dict(),
                "census": _stats_state(self.stats), "transport": self.transport.unit_state()}  # fmt: skip

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
        kept = {"head": self.theta.detach().cpu().clone(), "stats": _stats_state(self.stats), "correct": correct}
        return extra, kept

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
                with writing(run, path.with_name(model_stem(seed, name) + ".json")):
                    write_model(run.path, (seed, name), d["head"], _stats_of(d["stats"]), self.cfg, self.store, metrics)
        if self.client_rows:  # none with secure aggregation: the server never sees a client's counts
            with writing(run, run.path / "clients.csv"):
                rundir.write_clients_per_seed(run.path, self.client_rows)
        with writing(run, run.path / "summary.json"):
            rundir.write_summary(run.path, summary)
        return summary

    def report(self, done: list, summary: dict) -> RunReport:
        """The plots' and trackers' data: the first seed's label counts (none with secure aggregation: the server
        never sees them), the central ceiling, the configuration."""
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


def head_path(run_dir: Path, seed: int, name: str = "main") -> Path:
    """The file a unit's final head is written to."""
    return Path(run_dir) / (f"head-seed{seed}.pt" if name == "main" else f"head-seed{seed}-iid.pt")
