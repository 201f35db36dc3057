"""``fedhead bench tune``: every method tuned with the same budget, chosen on validation only, then measured on test.

The protocol, for each method of ``--methods`` and each partition of ``--partition`` (one *study*):

1. **Budget.** ``--trials`` trials (default 20), the same number for every method. A trial is one ``fedhead train``
   run with ``--rounds`` rounds on ``--clients`` clients and the one seed ``--tune-seed``, into
   ``OUT/trials/<method>-<partition>/<trial number>``. A closed-form method (ncm, ridge, ...) has no
   iterative parameter to search: it runs 0 trials, and the report says so.
2. **Space.** The fields of :data:`SPACE` (learning rate, weight decay, momentum, local epochs, FedProx's mu, the
   server's learning rate and momentum), each searched for a method only where the field *applies* to that method's
   configuration (the experiment table's own rule, :func:`fedhead.federation.experiment.applies`: ``momentum``
   needs SGD, ``server_lr`` a server optimiser that takes one) and where the method's own fields ask for it
   (``prox_mu`` for a FedProx-like method, one that sets ``prox_mu > 0``; ``local_steps`` instead of
   ``local_epochs`` for a method that sets local steps). ``--space lr,weight_decay`` restricts it.
3. **Selection on validation only.** A trial's value is its run's ``val_accuracy``: the accuracy on the clients'
   held-out validation parts (``val_fraction``, 0.1 in the default recipe) at the round the validation curve
   selects. The test split is read by the runs (they report it) but never by the search or the choice: the winner
   is the trial of highest validation accuracy (the earliest on a tie) among the first ``--trials`` finished.
4. **Sampler.** Trial 0 is the method's untuned default (the values of the searched fields in the default run, where
   they lie in the ranges), so tuning never ends below the default on validation; then Optuna's TPE (10 random
   start-up trials, then the tree-structured Parzen estimator), seeded for each trial by (``--tune-seed``, study,
   trial number): the same command gives the same trials, and an interrupted command continued gives the trials the
   uninterrupted one would have.
5. **Final runs.** The winner's values and the method's untuned defaults (the default recipe with the method's own
   fields), each re-run with ``--seeds`` (default 0,1,2) into ``OUT/final/<method>-<partition>/{tuned,default}``:
   test accuracy at the final round and at the selected round, mean ± std over seeds, and the ranking of the
   methods per partition (on the test accuracy at the selected round) before and after tuning.

Storage and resumption: the studies live in ``OUT/tune.db`` (SQLite, one Optuna study per method and partition; each
records its protocol, and a re-run with other options into the same ``--out`` is refused). SIGINT or SIGTERM stops
the command with one line; the same command with the same ``--out`` continues: finished trials are kept (their
numbers, values and run directories), a trial that was running resumes its run directory from its checkpoint
(``resume=True``) with the values it was given, then the sampler asks for the rest of the budget. Raising
``--trials`` on a re-run adds trials to every study.

Report: ``OUT/tune.md`` (the budget, the space, each method's chosen values, the winner's validation accuracy, test
before and after, the rankings, wall times), ``OUT/tune.csv`` (one row per method and partition) and
``OUT/trials.csv`` (one row per trial: its values, validation accuracy and state).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer
from rich.markdown import Markdown

from fedhead.bench.baselines import methods_and_partitions
from fedhead.bench.grid import FEATURES_OPT, report_writer
from fedhead.bench.report import Stat, StoreCache, command_line, md_table, run_status
from fedhead.core.closedform import is_closed_form
from fedhead.core.partitions import PARTITIONS
from fedhead.core.plugins import load_plugins
from fedhead.core.serveropt import SERVER_OPTIMIZERS
from fedhead.federation.config import TrainConfig, applicable
from fedhead.federation.experiment import FIELDS, applies, parse_seeds
from fedhead.federation.methods import METHODS
from fedhead.federation.rundir import write_csv
from fedhead.federation.train import run_training, validate_config
from fedhead.infra.console import make_progress, stdout_console
from fedhead.infra.errors import FedheadError, Interval, unknown_name, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_json, atomic_write_text, check_out
from fedhead.infra.signals import pause_hook, signals_deferred

DEFAULT_METHODS = ("ncm", "ridge", "softmax", "ova2", "ova2-fedprox", "ova2-fedadam")
DEFAULT_PARTITIONS = ("shard-1", "shard-2", "dirichlet-0.1")
DEFAULT_SEEDS = (0, 1, 2)
STARTUP_TRIALS = 10  # TPE's random start-up trials
TRIALS_PAUSE_ENV = "FEDHEAD_TEST_PAUSE_AFTER_TRIALS"  # test hook "k:FILE": after the k-th finished trial, pause
DB = "tune.db"


# ---------------------------------------------------------------- the search space


@dataclass(frozen=True)
class Dim:
    """One searched field: its range, log-uniform or uniform, integer or not, and (``only``) a condition on the
    method's own fields beyond the field's applicability (``only_text`` says it)."""

    low: float
    high: float
    log: bool = False
    integer: bool = False
    only: Optional[Callable[[dict], bool]] = None
    only_text: str = ""

    def distribution(self):
        import optuna

        if self.integer:
            return optuna.distributions.IntDistribution(int(self.low), int(self.high), log=self.log)
        return optuna.distributions.FloatDistribution(self.low, self.high, log=self.log)

    def describe(self) -> str:
        kind = ("log-uniform" if self.log else "uniform") + (" integer" if self.integer else "")
        return f"{kind} [{self.low:g}, {self.high:g}]"


# Field name -> its distribution: the one declaration of what ``fedhead bench tune`` searches. A field is searched
# for a method where it applies to the method's configuration (FIELDS[name].applies) and ``only`` holds.
SPACE: dict[str, Dim] = {
    "lr": Dim(1e-4, 1.0, log=True),
    "weight_decay": Dim(1e-6, 1e-2, log=True),
    "momentum": Dim(0.0, 0.95),
    "local_epochs": Dim(
        1, 5, integer=True, only=lambda m: m.get("local_steps") is None, only_text="methods without local steps"
    ),
    "local_steps": Dim(
        5,
        100,
        log=True,
        integer=True,
        only=lambda m: m.get("local_steps") is not None,
        only_text="methods that set local steps (fast)",
    ),
    "prox_mu": Dim(
        1e-4,
        1.0,
        log=True,
        only=lambda m: bool(m.get("prox_mu")),
        only_text="FedProx-like methods (those that set prox_mu > 0, e.g. ova2-fedprox)",
    ),
    "server_lr": Dim(1e-3, 10.0, log=True),
    "server_momentum": Dim(0.0, 0.95),
}


def where_searched(name: str) -> str:
    """Where a field of :data:`SPACE` is searched, as the report and the errors say it."""
    dim, f = SPACE[name], FIELDS[name]
    if dim.only_text:
        return dim.only_text
    wanted = " or ".join(w.wanted() for w in f.applies)
    if not wanted:
        return "every method"
    return f"runs with {wanted}" if wanted.startswith("--") else wanted


def parse_space(text: str | None) -> list[str]:
    """``--space`` (comma-separated field names of :data:`SPACE`), or every field of it."""
    if text is None:
        return list(SPACE)
    names = list(dict.fromkeys(t for t in str(text).replace(",", " ").split()))
    if not names:
        raise FedheadError(
            f"The '--space' parameter needs at least one field. Got {text!r} instead. Use e.g. --space lr,weight_decay."
        )
    for n in names:
        if n not in SPACE:
            raise unknown_name("--space", n, SPACE, "searched field")
    return names


# ---------------------------------------------------------------- the studies


@dataclass
class Study:
    """One method on one partition: its base configuration (the method's fields and the protocol), the fields
    searched, the trials run and the final runs."""

    method: str
    partition: str
    base: dict  # TrainConfig keywords (without seeds)
    space: list[str]
    closed_form: bool
    trials: list = field(default_factory=list)  # the finished trials of the budget, by number (FrozenTrial)
    best: Any = None  # the winning FrozenTrial (None: closed form)
    final: dict = field(default_factory=dict)  # "default" | "tuned" -> summary.json of the re-run
    tune_s: float = 0.0  # the trials' runs, wall seconds (as their summaries record)
    final_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.method}-{self.partition}"

    def cfg(self, seeds: list[int], params: dict | None = None) -> TrainConfig:
        """The method's run with ``seeds`` and the searched ``params`` on top (the untuned default without)."""
        kw = {**self.base, **(params or {}), "seeds": list(seeds)}
        return TrainConfig(**{**applicable(kw), **(params or {})})

    def defaults(self) -> dict:
        """The searched fields' values in the untuned run (the recipe's, the method's, the server optimiser's)."""
        c = self.cfg([0]).resolved()
        out = {}
        for n in self.space:
            v = getattr(c, n)
            if v is None and n.startswith("server_"):
                v = SERVER_OPTIMIZERS[c.server_opt].defaults.get(n.removeprefix("server_"))
            out[n] = v
        return out


@dataclass
class Setup:
    """What every study shares: the store, the folders, the budget and the seeds."""

    features: Path
    out: Path
    trials: int
    tune_seed: int
    seeds: list[int]
    store: Any
    central: dict = field(default_factory=dict)
    done: int = 0  # trials finished by this process (the pause hook counts them)


def searched_for(name: str, view: TrainConfig, method_fields: dict) -> bool:
    """Whether the field ``name`` of :data:`SPACE` is searched for the run ``view`` (its recipe filled in) of a method
    that sets ``method_fields``: the field applies there, and the method asks for it."""
    dim = SPACE[name]
    return applies(FIELDS[name], view) and (dim.only is None or dim.only(method_fields))


def build_studies(
    features: Path,
    names: list[str],
    plabels: list[str],
    parts: dict,
    protocol: dict,
    space: list[str],
    given_space: bool,
) -> list[Study]:
    """One study per method and partition, its searched fields decided by the experiment table; refuses a
    ``--space`` field that no method takes and an iterative method left with nothing to search."""
    studies = []
    for m in names:
        mkw = dict(METHODS[m][1])
        for p in plabels:
            pname, pparams = parts[p]
            base = {
                **protocol,
                **mkw,
                "features": str(features),
                "partition": pname,
                "partition_params": dict(pparams),
                "recipe": "default",
                "plots": False,
                "on_diverge": "continue",  # a diverged trial keeps its best validation round, and the search goes on
            }
            view = TrainConfig(**applicable({**base, "seeds": [0]})).recipe_view()
            closed = is_closed_form(view.head)
            searched = [] if closed else [n for n in space if searched_for(n, view, mkw)]
            if not closed and not searched:
                taken = [n for n in SPACE if searched_for(n, view, mkw)]
                raise FedheadError(
                    f"The '--space' parameter ({','.join(space)}) leaves nothing to search for the iterative method "
                    f"{m!r}, which needs its trials. Got --methods {','.join(names)}. Add a field it takes "
                    f"({','.join(taken)}), or drop {m} from --methods."
                )
            studies.append(Study(m, p, base, searched, closed))
    if given_space:
        used = {n for s in studies for n in s.space}
        for n in space:
            if n not in used:
                raise FedheadError(
                    f"The '--space' parameter names {n!r}, which no method of --methods {','.join(names)} takes: it is "
                    f"searched for {where_searched(n)} only. Drop {n} from --space, or add a method that takes it."
                )
    return studies


def check_studies(studies: list[Study], setup: Setup) -> None:
    """Every run the command may start, validated before anything is written: each method's default run and its
    runs at the low and the high ends of its space (one-line errors)."""
    for s in studies:
        runs = [s.cfg(setup.seeds)]
        if s.space:
            runs += [s.cfg([setup.tune_seed], {n: _end(SPACE[n], e) for n in s.space}) for e in ("low", "high")]
        for cfg in runs:
            resolved = validate_config(cfg, setup.store)
            if not resolved.val_fraction:
                raise FedheadError(
                    f"The method {s.method!r} runs without a validation part (val_fraction 0), and tuning selects on "
                    "validation only. Use a method of the default recipe."
                )


def _end(dim: Dim, which: str):
    v = dim.low if which == "low" else dim.high
    return int(v) if dim.integer else float(v)


def protocol_of(study: Study, setup: Setup) -> dict:
    """What a study's trials depend on: a re-run into the same --out must match it."""
    base = {k: v for k, v in study.base.items() if k != "device"}  # where it runs is not part of the protocol
    proto = {**base, "space": {n: SPACE[n].describe() for n in study.space}, "tune_seed": setup.tune_seed}
    return json.loads(json.dumps(proto, sort_keys=True, default=str))


# ---------------------------------------------------------------- trials


def open_storage(out: Path):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna.storages.RDBStorage(f"sqlite:///{out / DB}", engine_kwargs={"connect_args": {"timeout": 60}})


def open_study(storage, study: Study, setup: Setup):
    """The study in the storage (created on the first run), its protocol checked against this command's."""
    import optuna

    with signals_deferred():
        st = optuna.create_study(storage=storage, study_name=study.name, direction="maximize", load_if_exists=True)
        proto = protocol_of(study, setup)
        if "protocol" not in st.user_attrs:
            st.set_user_attr("protocol", proto)
    had = st.user_attrs["protocol"]
    if had != proto:
        key = next(k for k in sorted(set(proto) | set(had)) if proto.get(k) != had.get(k))
        raise FedheadError(
            f"The '--out' folder {str(setup.out)!r} holds the study {study.name} of another protocol ({key} "
            f"{had.get(key)!r}, not {proto.get(key)!r}). Re-run with the options it was made with, or give a new --out."
        )
    return st


def _trial_seed(setup: Setup, study: Study, number: int) -> int:
    key = f"{setup.tune_seed}:{study.name}:{number}".encode()
    return int(hashlib.sha256(key).hexdigest()[:8], 16)


def run_trial(st, study: Study, setup: Setup, number: int, params: dict) -> float:
    """One trial's run (reused when finished, resumed from its checkpoint when interrupted); tells the study its
    validation accuracy."""
    import optuna

    d = trial_dir(setup, study, number)
    status = run_status(d)
    if status == "stale":  # nothing finished in it: start again
        shutil.rmtree(d)
    res = run_training(
        study.cfg([setup.tune_seed], params),
        out=d,
        resume=status in ("reused", "resumed"),
        progress=False,
        store=setup.store,
        central_cache=setup.central,
    )
    value = res.summary.get("val_accuracy")
    with signals_deferred():
        if value is None or value != value:
            st.tell(number, state=optuna.trial.TrialState.FAIL)
        else:
            st.tell(number, float(value))
    setup.done += 1
    pause_hook(TRIALS_PAUSE_ENV, setup.done)
    return value


def tune_study(st, study: Study, setup: Setup, progress, task) -> None:
    """Run the study's budget: trials interrupted earlier first (same number, same values, their run resumed),
    then new ones asked from the seeded sampler; then pick the winner on validation."""
    import optuna

    if st is None:
        return
    dists = {n: SPACE[n].distribution() for n in study.space}
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    for t in st.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if finished_count(st) >= setup.trials:
            break
        progress.update(task, info=f"{study.name} trial {t.number} (resumed)")
        run_trial(st, study, setup, t.number, dict(t.params))
        progress.advance(task)
    while finished_count(st) < setup.trials:
        number = len(st.get_trials(deepcopy=False))
        st.sampler = optuna.samplers.TPESampler(seed=_trial_seed(setup, study, number), n_startup_trials=STARTUP_TRIALS)
        with signals_deferred():
            if number == 0:  # trial 0 is the untuned default: tuning never ends below it on validation
                st.enqueue_trial(default_point(study), skip_if_exists=True)
            trial = st.ask(dists)
        progress.update(task, info=f"{study.name} trial {trial.number}")
        run_trial(st, study, setup, trial.number, dict(trial.params))
        progress.advance(task)
    done = sorted(st.get_trials(deepcopy=False, states=finished), key=lambda t: t.number)[: setup.trials]
    study.trials = done
    complete = [t for t in done if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        raise FedheadError(
            f"Every trial of {study.name} ended without a validation accuracy (diverged from its first round). "
            "Narrow the space with --space, or check the store."
        )
    study.best = max(complete, key=lambda t: (t.value, -t.number))
    study.tune_s = sum(trial_seconds(setup, study, t.number) for t in done)


def default_point(study: Study) -> dict:
    """The untuned run's values of the searched fields that lie in their ranges (trial 0 of every study; a field
    whose default lies outside, or has none, is sampled)."""
    out = {}
    for n, v in study.defaults().items():
        dim = SPACE[n]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and dim.low <= v <= dim.high:
            out[n] = int(v) if dim.integer else float(v)
    return out


def trial_dir(setup: Setup, study: Study, number: int) -> Path:
    return setup.out / "trials" / study.name / str(number)


def trial_seconds(setup: Setup, study: Study, number: int) -> float:
    """A trial's run time as its summary.json records it."""
    path = trial_dir(setup, study, number) / "summary.json"
    return float(json.loads(path.read_text()).get("wall_seconds") or 0.0) if path.exists() else 0.0


def finished_count(st) -> int:
    """The trials of a study that ended (with a value, or failed): the ones the budget counts."""
    import optuna

    return len(st.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)))


def final_runs(study: Study, setup: Setup, progress, task) -> None:
    """The winner and the untuned default, each with --seeds (a closed-form method: its one default run)."""
    kinds = {"default": None} if study.best is None else {"default": None, "tuned": dict(study.best.params)}
    for kind, params in kinds.items():
        d = setup.out / "final" / study.name / kind
        status = run_status(d)
        if status == "stale":
            shutil.rmtree(d)
        progress.update(task, info=f"{study.name} {kind}, seeds {','.join(map(str, setup.seeds))}")
        res = run_training(
            study.cfg(setup.seeds, params),
            out=d,
            resume=status in ("reused", "resumed"),
            progress=False,
            store=setup.store,
            central_cache=setup.central,
        )
        study.final[kind] = res.summary
        study.final_s += float(res.summary.get("wall_seconds") or 0.0)
        progress.advance(task)
    if study.best is None:
        study.final["tuned"] = study.final["default"]


# ---------------------------------------------------------------- the report


def _stat(summary: dict, key: str) -> Stat:
    return Stat.of(r.get(key) for r in summary["per_seed"])


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "–" if v is None else str(v)


def rankings(studies: list[Study], plabels: list[str], kind: str) -> dict[str, list[str]]:
    """Per partition, the methods from best to worst test accuracy at the selected round (``kind``: default |
    tuned), mean over the final seeds."""
    out = {}
    for p in plabels:
        here = [s for s in studies if s.partition == p]
        out[p] = [s.method for s in sorted(here, key=lambda s: -_stat(s.final[kind], "test_accuracy_at_selected").mean)]
    return out


def result_rows(studies: list[Study], before: dict, after: dict) -> list[dict]:
    """One flat row per method and partition (tune.csv)."""
    rows = []
    for s in studies:
        row: dict = {
            "method": s.method,
            "partition": s.partition,
            "closed_form": int(s.closed_form),
            "trials": len(s.trials),
            "searched": " ".join(s.space),
            "best_trial": s.best.number if s.best is not None else "",
            "val_accuracy": s.best.value if s.best is not None else "",
        }
        for n in SPACE:
            row[f"param_{n}"] = s.best.params.get(n, "") if s.best is not None else ""
        for kind in ("default", "tuned"):
            for key, short in (("final_accuracy", "final"), ("test_accuracy_at_selected", "selected")):
                st = _stat(s.final[kind], key)
                row[f"{kind}_{short}_mean"], row[f"{kind}_{short}_std"] = st.mean, st.std
        row["rank_before"] = before[s.partition].index(s.method) + 1
        row["rank_after"] = after[s.partition].index(s.method) + 1
        row["tune_seconds"] = round(s.tune_s, 2)
        row["final_seconds"] = round(s.final_s, 2)
        rows.append(row)
    return rows


def trial_rows(studies: list[Study], setup: Setup) -> list[dict]:
    """One row per trial of the budget (trials.csv): its values, validation accuracy and state."""
    rows = []
    for s in studies:
        for t in s.trials:
            row = {"method": s.method, "partition": s.partition, "trial": t.number, "state": t.state.name}
            row["val_accuracy"] = t.value if t.value is not None else ""
            row["chosen"] = int(s.best is not None and t.number == s.best.number)
            for n in s.space:
                row[f"param_{n}"] = t.params.get(n, "")
            row["wall_seconds"] = round(trial_seconds(setup, s, t.number), 2)
            rows.append(row)
    return rows


def _budget_section(studies: list[Study], setup: Setup, protocol: dict, wall_s: float) -> str:
    tuned = [s for s in studies if s.space]
    closed = sorted({s.method for s in studies if s.closed_form})
    rounds = protocol.get("rounds")
    text = [
        "## Budget",
        "",
        f"**{setup.trials} trials per method and partition** (the same for every iterative method), each one "
        f"`fedhead train` run of {rounds} rounds on {protocol['clients']} clients"
        + (f" ({protocol['clients_per_round']} a round)" if protocol.get("clients_per_round") else "")
        + f" with seed {setup.tune_seed}; {len(tuned)} {'study' if len(tuned) == 1 else 'studies'}, {sum(len(s.trials) for s in tuned)} trials. "
        f"Sampler: Optuna TPE ({STARTUP_TRIALS} random start-up trials), seeded per trial. Selection: the trial of "
        "highest validation accuracy at its selected round (the clients' held-out validation parts); the test split "
        f"chooses nothing. Final: the winner and the untuned default re-run with seeds "
        f"{', '.join(map(str, setup.seeds))}.",
        "",
    ]
    if closed:
        text += [f"Closed-form methods ({', '.join(closed)}): nothing iterative to search, 0 trials, one run.", ""]
    tune_s = sum(s.tune_s for s in studies)
    final_s = sum(s.final_s for s in studies)
    text += [
        f"Wall time: trials {tune_s:.1f} s, final runs {final_s:.1f} s (the runs' own times, summed over every "
        f"invocation); this invocation {wall_s:.1f} s.",
        "",
    ]
    return "\n".join(text)


def _space_section(studies: list[Study]) -> str:
    names = [n for n in SPACE if any(n in s.space for s in studies)]
    rows = [[n, SPACE[n].describe(), where_searched(n)] for n in names]
    return "\n".join(["## Search space", "", md_table(["field", "distribution", "searched for"], rows), ""])


def _results_section(studies: list[Study], p: str, before: dict, after: dict, setup: Setup) -> str:
    rows = []
    for s in [s for s in studies if s.partition == p]:
        if s.best is None:
            chosen = "closed form: 0 trials"
        else:
            dflt = s.defaults()
            chosen = ", ".join(f"{n} {_value(s.best.params[n])} (default {_value(dflt[n])})" for n in s.space)
        cells = [
            _stat(s.final[k], key).fmt(100, 2)
            for key in ("final_accuracy", "test_accuracy_at_selected")
            for k in ("default", "tuned")
        ]
        val = f"{100 * s.best.value:.2f} (trial {s.best.number})" if s.best is not None else "–"
        rows.append(
            [s.method, len(s.trials), chosen, val, *cells, before[p].index(s.method) + 1, after[p].index(s.method) + 1]
        )
    hdr = ["method", "trials", "chosen values", "val acc of the winner (%)", "test final, default (%)",
           "test final, tuned (%)", "test at selected, default (%)", "test at selected, tuned (%)", "rank before",
           "rank after"]  # fmt: skip
    seeds = ",".join(map(str, setup.seeds))
    return "\n".join([f"## {p}: chosen values and test accuracy (seeds {seeds})", "", md_table(hdr, rows), ""])


def _ranking_section(before: dict, after: dict) -> str:
    lines = ["## Ranking before and after tuning (test accuracy at the selected round)", ""]
    for p in before:
        changed = "changed" if before[p] != after[p] else "unchanged"
        lines.append(f"- {p}: before {' > '.join(before[p])}; after {' > '.join(after[p])} (**{changed}**)")
    return "\n".join(lines + [""])


def write_tune_report(
    studies: list[Study], plabels: list[str], setup: Setup, protocol: dict, cmd: str, wall_s: float
) -> tuple[Path, list[str]]:
    """tune.md, tune.csv, trials.csv and tune.json; returns tune.md and its sections."""
    before, after = rankings(studies, plabels, "default"), rankings(studies, plabels, "tuned")
    sections = [
        _budget_section(studies, setup, protocol, wall_s),
        _space_section(studies),
        *[_results_section(studies, p, before, after, setup) for p in plabels],
        _ranking_section(before, after),
    ]
    rows = result_rows(studies, before, after)
    write_csv(setup.out / "tune.csv", rows)
    write_csv(setup.out / "trials.csv", trial_rows(studies, setup))
    atomic_write_json(
        setup.out / "tune.json",
        {"command": cmd, "protocol": protocol, "trials": setup.trials, "tune_seed": setup.tune_seed,
         "seeds": setup.seeds, "features": str(setup.features), "results": rows,
         "ranking_before": before, "ranking_after": after, "wall_seconds": wall_s},
    )  # fmt: skip
    parts = ["# fedhead bench tune: every method tuned with the same budget, chosen on validation", "", "Command:", ""]
    parts += ["```", cmd, "```", "", *[s.rstrip() + "\n" for s in sections]]
    path = setup.out / "tune.md"
    atomic_write_text(path, "\n".join(parts) + "\n")
    return path, sections


# ---------------------------------------------------------------- the command


def with_min_size(parts: dict, min_size: int) -> dict:
    """``--min-size`` into the parameters of every partition that declares it (a cross-device Dirichlet split of
    10,000 clients needs 0); refused when none of them does."""
    takes = {label for label, (name, _) in parts.items() if any(q.name == "min_size" for q in PARTITIONS[name].params)}
    if not takes:
        raise FedheadError(
            f"The '--min-size' option applies to partitions with a size floor (dirichlet, ...) only. Got --partition "
            f"{','.join(parts)}. Drop --min-size, or add such a partition."
        )
    return {
        label: (name, {**pp, "min_size": min_size} if label in takes else pp) for label, (name, pp) in parts.items()
    }


def _optuna_or_error() -> None:
    try:
        import optuna  # noqa: F401
    except ModuleNotFoundError:
        raise FedheadError(
            "fedhead bench tune needs Optuna, which is not installed. Install it with pip install 'fedhead[tune]'."
        ) from None


@cli_errors
def tune_cmd(
    features: Path = FEATURES_OPT,
    methods: str = typer.Option(",".join(DEFAULT_METHODS), "--methods", help="comma-separated methods to tune"),
    partition: List[str] = typer.Option(
        [",".join(DEFAULT_PARTITIONS)],
        "--partition",
        "--partitions",
        help="partitions, repeated or comma-separated (presets, registry names, dirichlet-ALPHA)",
    ),
    clients: int = typer.Option(100, "--clients", help="number of clients K"),
    clients_per_round: Optional[int] = typer.Option(
        None, "--clients-per-round", help="clients sampled each round (cross-device); default: every client"
    ),
    min_size: Optional[int] = typer.Option(
        None,
        "--min-size",
        help="fewest samples per client of the partitions that take it (dirichlet; 0 at 10,000 clients)",
    ),
    rounds: int = typer.Option(20, "--rounds", help="communication rounds of every trial and final run"),
    trials: int = typer.Option(20, "--trials", help="trials per method and partition: the equal budget"),
    seeds: str = typer.Option(
        ",".join(map(str, DEFAULT_SEEDS)), "--seeds", help="seeds of the final runs (winner and default)"
    ),
    tune_seed: int = typer.Option(0, "--tune-seed", help="the seed every trial runs with, and the sampler's"),
    space: Optional[str] = typer.Option(
        None, "--space", help=f"comma-separated fields to search \\[default: every applicable one of {','.join(SPACE)}]"
    ),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    out: Optional[Path] = typer.Option(
        None, "--out", help="folder (default reports/tune-<timestamp>); re-run with the same --out to continue"
    ),
):
    """Tune every method with the same number of trials, choose on validation, re-run the winner with --seeds."""
    t0 = time.perf_counter()
    load_plugins()
    names, plabels, parts = methods_and_partitions(methods, partition, METHODS)
    validate("--trials", trials, Interval(1, None, integer=True), "Give every method at least one trial, e.g. 20.")
    validate("--tune-seed", tune_seed, Interval(0, None, integer=True))
    final_seeds = parse_seeds(seeds)
    searched = parse_space(space)
    if min_size is not None:
        parts = with_min_size(parts, min_size)
    protocol = {"clients": clients, "rounds": rounds, "device": device}
    if clients_per_round is not None:
        protocol["clients_per_round"] = clients_per_round
    out = Path(out) if out else Path("reports") / f"tune-{time.strftime('%Y%m%d-%H%M%S')}"
    check_out(out, kind="dir")
    _optuna_or_error()
    studies = build_studies(features, names, plabels, parts, protocol, searched, space is not None)
    setup = Setup(Path(features), out, trials, tune_seed, final_seeds, StoreCache().get(str(features)))
    check_studies(studies, setup)
    cmd = command_line()
    with report_writer(out, "the tuning folder", "finished trials are kept, the interrupted one resumes"):
        out.mkdir(parents=True, exist_ok=True)
        storage = open_storage(out)
        handles = {s.name: open_study(storage, s, setup) if s.space else None for s in studies}  # protocols checked
        total = sum(max(trials - finished_count(h), 0) for h in handles.values() if h is not None)
        total += sum(2 if s.space else 1 for s in studies)  # the final runs
        with make_progress() as prog:
            task = prog.add_task("tune", total=total, info="")
            for s in studies:
                tune_study(handles[s.name], s, setup, prog, task)
            for s in studies:
                final_runs(s, setup, prog, task)
        path, sections = write_tune_report(studies, plabels, setup, protocol, cmd, time.perf_counter() - t0)
    con = stdout_console()
    con.print(Markdown("\n\n".join(sections)))
    con.print(f"report: {path}")
