"""'fedhead bench tune': the same budget for every method, selection on validation only (the test split chooses
nothing), closed-form methods without trials, the same choice from the same command, a SIGTERM'd command continued
without repeating finished trials, and bad input refused in one line."""

import csv
import hashlib
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import one_line_error, wait_for_pause
from typer.testing import CliRunner
from zygote import fedhead_popen

import cli

optuna = pytest.importorskip("optuna")

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
ENV = {"FEDHEAD_THREADS": "1", "FEDHEAD_NO_PROGRESS": "1", "PYTHONPATH": str(REPO)}
TRIALS = 3


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)
    for hook in ("FEDHEAD_TEST_PAUSE_AFTER_TRIALS", "FEDHEAD_TEST_PAUSE_AFTER_ROUNDS"):
        monkeypatch.delenv(hook, raising=False)


def args(store, out) -> list[str]:
    """A small tuning: softmax (iterative) and ncm (closed form) on shard-2, 8 clients, 3 rounds, 3 trials."""
    return ["bench", "tune", "--features", str(store), "--methods", "softmax,ncm", "--partition", "shard-2",
            "--clients", "8", "--rounds", "3", "--trials", str(TRIALS), "--seeds", "0,1", "--out", str(out)]  # fmt: skip


def tune(store, out):
    res = runner.invoke(cli.app, args(store, out))
    assert res.exit_code == 0, (res.output, res.exception)
    return res


def rows(path: Path) -> list[dict]:
    return list(csv.DictReader(open(path)))


def by_method(out: Path) -> dict[str, dict]:
    return {r["method"]: r for r in rows(out / "tune.csv")}


def trial_table(out: Path) -> list[dict]:
    """trials.csv without the wall times (what a repeated command must give again)."""
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows(out / "trials.csv")]


def study(out: Path, name: str = "softmax-shard-2"):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'tune.db'}")


@pytest.fixture(scope="module")
def tuned(tiny_store, tmp_path_factory):
    """The command once, uninterrupted (the reference of the other tests)."""
    out = tmp_path_factory.mktemp("tune") / "clean"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDHEAD_NO_PROGRESS", "1")
        mp.setenv("FEDHEAD_THREADS", "1")
        res = tune(tiny_store, out)
    return out, res


def test_report_states_the_budget_and_each_methods_chosen_values(tuned):
    out, res = tuned
    md = (out / "tune.md").read_text()
    assert f"{TRIALS} trials per method and partition" in md and "3 rounds on 8 clients" in md
    assert "fedhead bench tune" in md and "--trials 3" in md  # the exact command
    assert "## Search space" in md and "log-uniform [0.0001, 1]" in md
    t = by_method(out)
    soft = t["softmax"]
    assert int(soft["trials"]) == TRIALS and soft["searched"].split() == [
        "lr",
        "weight_decay",
        "momentum",
        "local_epochs",
    ]
    for name in soft["searched"].split():  # each chosen value is in the report
        assert float(soft[f"param_{name}"]) == pytest.approx(study(out).best_trial.params[name], rel=1e-5)
        assert name in md
    for kind in ("default", "tuned"):  # test accuracy before and after, final and at the selected round
        for key in ("final", "selected"):
            assert 0 <= float(soft[f"{kind}_{key}_mean"]) <= 1
    assert sorted([int(t["softmax"]["rank_before"]), int(t["ncm"]["rank_before"])]) == [1, 2]
    assert "Ranking before and after tuning" in md and "report: " in res.stdout
    assert (out / "final" / "softmax-shard-2" / "tuned" / "summary.json").exists()
    assert (out / "final" / "softmax-shard-2" / "default" / "summary.json").exists()
    assert not list((out / "trials").rglob("*.png"))  # trials are kept small: no plots


def test_closed_form_methods_run_no_trials(tuned):
    out, _ = tuned
    t = by_method(out)["ncm"]
    assert t["closed_form"] == "1" and t["trials"] == "0" and t["best_trial"] == "" and t["searched"] == ""
    assert not (out / "trials" / "ncm-shard-2").exists()
    assert not (out / "final" / "ncm-shard-2" / "tuned").exists()  # its one run is its default
    assert (out / "final" / "ncm-shard-2" / "default" / "summary.json").exists()
    names = {s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{out / 'tune.db'}")}
    assert names == {"softmax-shard-2"}
    assert "ncm): nothing iterative to search, 0 trials" in (out / "tune.md").read_text()


def test_the_winner_is_the_argmax_of_validation_accuracy(tuned):
    out, _ = tuned
    import json

    trials = study(out).get_trials()
    assert [t.number for t in trials] == list(range(TRIALS))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    for t in trials:  # each trial's value is its run's validation accuracy (never a test number)
        summary = json.loads((out / "trials" / "softmax-shard-2" / str(t.number) / "summary.json").read_text())
        assert t.value == summary["val_accuracy"]
        assert summary["seeds"] == [0]
    best = max(trials, key=lambda t: (t.value, -t.number))
    assert int(by_method(out)["softmax"]["best_trial"]) == best.number
    chosen = [r for r in rows(out / "trials.csv") if r["chosen"] == "1"]
    assert len(chosen) == 1 and int(chosen[0]["trial"]) == best.number
    assert len({tuple(sorted(t.params.items())) for t in trials}) == len(trials)  # each trial tries other values
    # trial 0 is the untuned default (so tuning never ends below it on validation): the recipe's lr, momentum, ...
    assert trials[0].params["lr"] == pytest.approx(0.01) and trials[0].params["weight_decay"] == pytest.approx(1e-4)
    assert best.value >= trials[0].value


def test_test_labels_choose_nothing(tuned, tiny_store, tmp_path):
    """The same command on a copy of the store whose test labels are permuted: the same trials, values and choice;
    only the test accuracies move."""
    import h5py

    from extract.store import content_hash, load_store

    out, _ = tuned
    store = tmp_path / "permuted.h5"
    shutil.copy(tiny_store, store)
    with h5py.File(store, "r+") as f:
        f["test/labels"][:] = np.random.default_rng(1).permutation(f["test/labels"][:])
    s = load_store(store)
    with h5py.File(store, "r+") as f:  # the store's recorded content follows its new labels
        splits = {"train": (s.train_x, s.train_y), "test": (s.test_x, s.test_y)}
        f.attrs["content_sha256"] = content_hash(splits, s.info.class_names)
    tune(store, tmp_path / "permuted")
    assert trial_table(tmp_path / "permuted") == trial_table(out)
    a, b = by_method(out)["softmax"], by_method(tmp_path / "permuted")["softmax"]
    assert a["best_trial"] == b["best_trial"] and a["val_accuracy"] == b["val_accuracy"]
    assert a["tuned_final_mean"] != b["tuned_final_mean"]  # the test split did change


def test_same_command_twice_chooses_the_same(tuned, tiny_store, tmp_path):
    out, _ = tuned
    tune(tiny_store, tmp_path / "again")
    assert trial_table(tmp_path / "again") == trial_table(out)
    keep = ("best_trial", "val_accuracy", "param_lr", "param_weight_decay", "param_momentum", "param_local_epochs")
    assert [{k: r[k] for k in keep} for r in rows(tmp_path / "again" / "tune.csv")] == [
        {k: r[k] for k in keep} for r in rows(out / "tune.csv")
    ]


def _files(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: its content hash and modification time."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _signalled(argv: list[str], hook: str, k: int, marker: Path) -> str:
    """Run the command as a process until ``hook`` pauses it (after its ``k``-th trial or round), SIGTERM it;
    returns its one stderr line."""
    p = fedhead_popen(argv, {**os.environ, **ENV, hook: f"{k}:{marker}"}, REPO)
    wait_for_pause(marker, p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0], err
    return lines[0]


def test_sigterm_then_the_same_command_continues_without_repeating_trials(tuned, tiny_store, tmp_path):
    clean, _ = tuned
    out = tmp_path / "cut"
    argv = args(tiny_store, out)
    # 1: stopped between trials, after the first one finished
    line = _signalled(argv, "FEDHEAD_TEST_PAUSE_AFTER_TRIALS", 1, tmp_path / "m1")
    assert f"--out {out}" in line and "finished trials are kept" in line
    first = study(out).get_trials()
    assert [t.state for t in first] == [optuna.trial.TrialState.COMPLETE]
    kept = _files(out / "trials" / "softmax-shard-2" / "0")
    # 2: stopped inside the second trial's run, at its second round
    _signalled(argv, "FEDHEAD_TEST_PAUSE_AFTER_ROUNDS", 2, tmp_path / "m2")
    mid = study(out).get_trials()
    assert [t.state for t in mid] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING]
    assert (out / "trials" / "softmax-shard-2" / "1" / "checkpoint.safetensors").exists()
    # 3: the same command again, to the end
    p = fedhead_popen(argv, {**os.environ, **ENV}, REPO)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    done = study(out).get_trials()
    assert [t.number for t in done] == list(range(TRIALS))  # the budget, no trial run twice
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in done)
    assert done[0].params == first[0].params and done[0].value == first[0].value
    assert done[1].params == mid[1].params  # the interrupted trial kept its values and resumed its run
    assert _files(out / "trials" / "softmax-shard-2" / "0") == kept  # the finished trial was not run again
    # ... and the result is the uninterrupted command's
    assert trial_table(out) == trial_table(clean)
    assert _curve(out) == _curve(clean)  # the resumed run's rounds are the uninterrupted run's


def _curve(out: Path) -> list[dict]:
    keep = ("seed", "round", "stage", "accuracy", "train_loss", "val_accuracy", "val_loss")
    return [{k: r[k] for k in keep} for r in rows(out / "trials" / "softmax-shard-2" / "1" / "rounds.csv")]


@pytest.mark.parametrize(
    "extra,expect",
    [
        (["--methods", "nosuch,ncm"], "'--methods'"),
        (["--trials", "0"], "'--trials'"),
        (["--trials", "-2"], "'--trials'"),
        (["--space", "lr,nosuch"], "'--space' parameter must be a known searched field"),
        (["--space", "lr,prox_mu"], "'prox_mu', which no method"),
        (["--methods", "softmax,ova2-fedprox", "--space", "prox_mu"], "leaves nothing to search"),
        (["--partition", "nosuch"], "'--partition'"),
        (["--seeds", "x"], "'--seeds'"),
        (["--min-size", "0"], "'--min-size' option applies to partitions with a size floor"),
    ],
)
def test_bad_input_is_refused_in_one_line(tiny_store, tmp_path, extra, expect):
    out = tmp_path / "bad"
    res = runner.invoke(cli.app, args(tiny_store, out) + extra)
    line = one_line_error(res)
    assert expect in line, line
    assert not out.exists() and not Path(f"{out}.lock").exists()  # nothing written


def test_the_docs_table_is_the_declared_space():
    from fedhead.bench.tune import SPACE

    text = (REPO / "docs" / "tune.md").read_text()
    for name, dim in SPACE.items():
        assert f"| `{name}` | {dim.describe()} |" in text, name


def test_a_folder_of_another_protocol_is_refused(tuned, tiny_store, tmp_path):
    """Trials of another protocol are never mixed into a study: a re-run with other rounds into the same --out."""
    out = tmp_path / "other"
    shutil.copytree(tuned[0], out)
    argv = args(tiny_store, out)
    argv[argv.index("--rounds") + 1] = "2"
    line = one_line_error(runner.invoke(cli.app, argv))
    assert "another protocol (rounds 3, not 2)" in line and "new --out" in line, line
    assert len(study(out).get_trials()) == TRIALS
