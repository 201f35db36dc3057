"""The validation protocol (issue 36): each client's held-out validation part, everything that chooses read off it
and never off the test split, early stopping, the divergence guard."""

import json

import numpy as np
import pytest
from conftest import one_line_error
from typer.testing import CliRunner

from cli import app
from extract.store import load_store, write_store
from fedhead.federation.clients import holdout
from fedhead.federation.config import TrainConfig, applicable
from fedhead.federation.job import patience_spent
from fedhead.federation.rundir import read_csv
from fedhead.federation.train import run_training

runner = CliRunner()

# every summary field that chooses a round or a value (per seed and over seeds): its source must be validation
SELECTING = ("selected_round", "val_accuracy", "val_loss", "final_val_accuracy", "acc95_round", "stopped_round",
             "acc95_round_vs_iid", "rounds_to_99_central", "central_val_accuracy")  # fmt: skip


# the figures read off the test split (reported, never choosing): every other field must not move with the test labels
TEST_REPORTED = {"final_accuracy", "test_accuracy_at_selected", "accuracy", "iid_final_accuracy", "final_ratio_to_iid",
                 "ratio_to_iid", "central_accuracy", "central_own_accuracy", "final_ratio_to_central",
                 "ratio_to_central", "exceeds_ceiling", "uncalibrated_accuracy",
                 *(f"{p}_{s}" for p in ("client_accuracy", "local_accuracy", "unseen_client_accuracy")
                   for s in ("mean", "worst10", "best10", "std"))}  # fmt: skip


def cfg_for(store, **kw):
    base = dict(features=str(store), clients=8, rounds=6, local_epochs=1, batch_size=16, device="cpu")
    return TrainConfig(**{**applicable({**base, **kw}), **kw})


# ---------------------------------------------------------------- the held-out parts


def test_holdout_is_seeded_stratified_and_disjoint():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 1000)
    parts = [np.arange(k * 100, (k + 1) * 100) for k in range(10)]
    train, val = holdout(parts, labels, 0.2, seed=3)
    again, val_again = holdout(parts, labels, 0.2, seed=3)
    other = holdout(parts, labels, 0.2, seed=4)[1]
    assert all(np.array_equal(a, b) for a, b in zip(val, val_again))
    assert all(np.array_equal(a, b) for a, b in zip(train, again))
    assert any(not np.array_equal(a, b) for a, b in zip(val, other))
    for p, t, v in zip(parts, train, val):
        assert len(v) == 20 and len(t) == 80  # floor(0.2 * 100)
        assert not set(t) & set(v) and set(t) | set(v) == set(p)
        # stratified: each class gives the floor or the ceiling of its share
        for c in range(5):
            share = 0.2 * np.sum(labels[p] == c)
            assert np.floor(share) - 1e-9 <= np.sum(labels[v] == c) <= np.ceil(share) + 1e-9


def test_small_clients_hold_out_their_share_in_expectation_and_keep_a_training_sample():
    labels = np.zeros(20000, dtype=np.int64)
    parts = [np.arange(5 * k, 5 * k + 5) for k in range(4000)]
    train, val = holdout(parts, labels, 0.1, seed=0)
    held = np.array([len(v) for v in val])
    assert set(held) <= {0, 1} and abs(held.mean() - 0.5) < 0.05  # floor(0.5 + u): 0 or 1, half of them
    assert min(len(t) for t in train) >= 4
    ones = [np.array([k]) for k in range(50)]
    train, val = holdout(ones, labels, 0.5, seed=0)  # a client keeps at least one training sample
    assert val is None and all(np.array_equal(a, b) for a, b in zip(train, ones))


# ---------------------------------------------------------------- no selection on the test split


def _with_test_labels(src, dst, y_test):
    s = load_store(src)
    write_store(
        dst, train=(s.train_x, s.train_y), test=(s.test_x, y_test), class_names=list(s.info.class_names),
        attrs={"dataset": "synthetic", "encoder": "none"},
    )  # fmt: skip
    return dst


def test_nothing_is_chosen_on_the_test_split(tiny_store, tmp_path):
    """The same run on two stores that differ only in their test labels: every selecting field is the same (they
    read validation), the test fields differ; and nothing in summary.json is named best."""
    s = load_store(tiny_store)
    scrambled = np.random.default_rng(1).permutation(s.test_y)
    other = _with_test_labels(tiny_store, tmp_path / "scrambled.h5", scrambled)
    kw = dict(head="ova2", partition="dirichlet", partition_params={"alpha": 0.5}, central_reference=True,
              iid_reference=True, seeds=[0, 1])  # fmt: skip
    a = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "a", progress=False).summary
    b = run_training(cfg_for(str(other), **kw), out=tmp_path / "b", progress=False).summary
    assert "validation" in a["selection"]
    for key in ("selected_round", "val_accuracy", "val_loss", "final_val_accuracy", "central_val_accuracy"):
        assert key in a, key
    assert any("acc95_round_vs_iid" in r for r in a["per_seed"])
    for key in SELECTING:
        assert a.get(key) == b.get(key), key
        for pa, pb in zip(a["per_seed"], b["per_seed"]):
            assert pa.get(key) == pb.get(key), key
    assert a["final_accuracy"] != b["final_accuracy"]
    assert a["test_accuracy_at_selected"] != b["test_accuracy_at_selected"]

    def names(d):
        return [k for k in d] + [k for r in d.get("per_seed", []) for k in r]

    # the walk: every field of summary.json (and of each seed's record) is either a test figure (reported) or the
    # same on both stores; a field that chose anything on the test split would move with the test labels
    for x, y in [(a, b), *zip(a["per_seed"], b["per_seed"])]:
        times = {"per_seed", "wall_seconds", "client_ms", "server_ms"}  # measured times, not figures
        moved = {k for k in set(x) | set(y) if k.removesuffix("_std") not in times and x.get(k) != y.get(k)}
        assert moved, "the stores' test labels differ: the test figures must move"
        bad = {k for k in moved if k not in TEST_REPORTED and k.removesuffix("_std") not in TEST_REPORTED}
        assert not bad, bad
    # the same for rounds.csv's columns, row by row
    ra, rb = read_csv(tmp_path / "a" / "rounds.csv"), read_csv(tmp_path / "b" / "rounds.csv")
    skip = {"client_ms", "server_ms"}  # times
    moved_cols = {k for x, y in zip(ra, rb) for k in x if k not in skip and x[k] != y[k]}
    assert moved_cols and moved_cols <= TEST_REPORTED, moved_cols - TEST_REPORTED

    assert not [k for k in names(a) if "best" in k.replace("best10", "")]  # best10: the best 10% of clients
    # the selected round is the best validation round of rounds.csv, and the test accuracy there is that row's
    rows = [r for r in read_csv(tmp_path / "a" / "rounds.csv") if r["run"] == "main" and int(r["seed"]) == 0]
    vals = [float(r["val_accuracy"]) for r in rows]
    sel = a["per_seed"][0]["selected_round"]
    assert sel == int(rows[int(np.argmax(vals))]["round"])
    assert a["per_seed"][0]["test_accuracy_at_selected"] == pytest.approx(float(rows[sel - 1]["accuracy"]), abs=1e-6)
    assert "val_accuracy" in read_csv(tmp_path / "a" / "rounds.csv")[0]


def test_val_fraction_zero_selects_nothing_and_says_so(tiny_store, tmp_path):
    res = run_training(cfg_for(tiny_store, val_fraction=0.0), out=tmp_path / "r", progress=False)
    s = res.summary
    assert s["selection"].startswith("none")
    assert "selected_round" not in s and "val_accuracy" not in s
    assert s["acc95_round"] is not None  # on the test curve: the paper's protocol, as the selection text says
    paper = TrainConfig(features=str(tiny_store), recipe="paper").resolved()
    assert paper.val_fraction == 0.0 and TrainConfig(features=str(tiny_store)).resolved().val_fraction == 0.1


def test_the_training_parts_exclude_the_validation_parts(tiny_store, tmp_path):
    full = run_training(cfg_for(tiny_store, val_fraction=0.0, partition="iid"), out=tmp_path / "a", progress=False)
    held = run_training(cfg_for(tiny_store, val_fraction=0.25, partition="iid"), out=tmp_path / "b", progress=False)
    sizes = [[int(c["size"]) for c in read_csv(r.run_dir / "clients.csv")] for r in (full, held)]
    assert sizes[0] == [50] * 8 and set(sizes[1]) <= {37, 38}  # floor(0.25 * 50 + u) = 12 or 13 held out each


# ---------------------------------------------------------------- early stopping


def test_patience_counts_evaluations_without_improvement():
    rows = [{"val_accuracy": v, "val_loss": 1 - v} for v in (0.5, 0.6, 0.6, 0.59)]
    assert patience_spent(rows, 2) and not patience_spent(rows, 3)
    assert patience_spent(rows, 2, "loss") and not patience_spent(rows[:3], 2)
    nan = [{"val_accuracy": float("nan")}] * 5
    assert not patience_spent(nan, 2)


def test_early_stop_ends_the_run_patience_evaluations_after_the_selected_round(tiny_store, tmp_path):
    res = run_training(
        cfg_for(tiny_store, rounds=60, early_stop=2, lr=0.3), out=tmp_path / "r", progress=False
    )  # a large step: the validation accuracy stalls well before round 60
    seed = res.summary["per_seed"][0]
    rows = read_csv(res.run_dir / "rounds.csv")
    assert seed["stopped_round"] == int(rows[-1]["round"]) < 60
    assert patience_spent([{k: float(v) for k, v in r.items() if k.startswith("val_")} for r in rows], 2)
    assert seed["selected_round"] <= seed["stopped_round"] - 2


def test_early_stop_needs_a_validation_part(tiny_store):
    res = runner.invoke(app, ["train", "--features", str(tiny_store), "--early-stop", "3", "--val-fraction", "0"])
    assert "--early-stop" in one_line_error(res) and "--val-fraction" in res.stderr


# ---------------------------------------------------------------- divergence


def test_a_diverging_run_stops_with_one_line_and_marks_the_round(tiny_store, tmp_path):
    args = ["train", "--features", str(tiny_store), "--clients", "4", "--rounds", "20", "--lr", "1e6", "--device",
            "cpu", "--no-plots"]  # fmt: skip
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "r")])
    line = one_line_error(res)
    assert "diverged" in line and "--lr" in line and "Round" in line
    rows = read_csv(tmp_path / "r" / "rounds.csv")
    assert int(rows[-1]["diverged"]) == 1 and all(int(r["diverged"]) == 0 for r in rows[:-1])
    assert int(rows[-1]["round"]) < 20
    go = runner.invoke(app, [*args, "--on-diverge", "continue", "--out", str(tmp_path / "c")])
    assert go.exit_code == 0, go.output
    rows = read_csv(tmp_path / "c" / "rounds.csv")
    assert len(rows) == 20 and any(int(r["diverged"]) for r in rows)
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["rounds"] == 20


@pytest.mark.parametrize("value", ["-0.1", "1", "1.5", "nan"])
def test_bad_val_fraction_is_one_line(tiny_store, value):
    res = runner.invoke(app, ["train", "--features", str(tiny_store), "--val-fraction", value])
    assert "--val-fraction" in one_line_error(res)


# ---------------------------------------------------------------- closed-form regularisation chosen on validation


def test_closed_form_regularisation_is_chosen_on_validation(tiny_store, tmp_path):
    from fedhead.core.heads import HEADS

    kw = dict(head="ridge", partition="dirichlet", partition_params={"alpha": 0.5})
    chosen = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "sel", progress=False).summary
    picked = chosen["per_seed"][0]["selected_params"]
    grid = next(p.grid for p in HEADS["ridge"].params if p.name == "ridge_lambda")
    val = {}
    for lam in grid:
        one = cfg_for(tiny_store, **kw, head_params={"ridge_lambda": lam})
        s = run_training(one, out=tmp_path / f"l{lam:g}", progress=False).summary
        assert "selected_params" not in s  # a given value is kept, nothing chosen
        val[lam] = s["val_accuracy"]
    best = next(lam for lam in grid if val[lam] == max(val.values()))  # the first in grid order on a tie
    assert picked == f"ridge_lambda={best:g}"
    assert chosen["val_accuracy"] == pytest.approx(val[best])
    # on a store whose test labels are scrambled the same value is chosen
    s = load_store(tiny_store)
    other = _with_test_labels(tiny_store, tmp_path / "scr.h5", np.random.default_rng(2).permutation(s.test_y))
    again = run_training(cfg_for(str(other), **kw), out=tmp_path / "scr", progress=False).summary
    assert again["per_seed"][0]["selected_params"] == picked
    off = run_training(cfg_for(tiny_store, **kw, select_on_val=False), out=tmp_path / "off", progress=False)
    assert "selected_params" not in off.summary


def test_select_on_val_does_not_apply_to_an_iterative_head(tiny_store):
    res = runner.invoke(app, ["train", "--features", str(tiny_store), "--head", "ova2", "--no-select-on-val"])
    assert "--select-on-val" in one_line_error(res)


# ---------------------------------------------------------------- per-client local test sets


def test_local_test_accuracy_is_reported_and_deterministic(tiny_store, tmp_path):
    kw = dict(partition="dirichlet", partition_params={"alpha": 0.3}, rounds=2)
    a = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "a", progress=False).summary
    b = run_training(cfg_for(tiny_store, **kw), out=tmp_path / "b", progress=False).summary
    keys = ("local_accuracy_mean", "local_accuracy_worst10", "local_accuracy_best10", "local_accuracy_std")
    assert all(0 <= a[k] <= 1 for k in keys) and all(a[k] == b[k] for k in keys)
    assert a["local_accuracy_worst10"] <= a["local_accuracy_mean"] <= a["local_accuracy_best10"]
    off = run_training(cfg_for(tiny_store, **kw, client_test=False), out=tmp_path / "c", progress=False).summary
    assert not any(k in off for k in keys) and "client_accuracy_mean" in off


# ---------------------------------------------------------------- Flower: each node validates on its own part


@pytest.mark.parametrize("head", ["ova2", "qda"])
def test_flower_nodes_report_the_same_validation_as_the_simulation(tiny_store, tmp_path, head):
    """Over Flower (the in-process grid) each node holds out its own validation part and answers a validate query;
    the sums give the simulator's validation rows, selected round and chosen regularisation."""
    pytest.importorskip("flwr")
    from fedhead.flower.client_app import make_client_app
    from fedhead.flower.inprocess import InProcessGrid, sim_nodes, task_identity
    from fedhead.flower.server_app import run_server
    from fedhead.flower.strategy import ServerSettings

    cfg = cfg_for(tiny_store, head=head, clients=6, partition="dirichlet", partition_params={"alpha": 0.5},
                  plots=False, **({"rounds": 3} if head == "ova2" else {}))  # fmt: skip
    with task_identity():
        grid = InProcessGrid(make_client_app(str(tiny_store)), sim_nodes(cfg.clients))
        run_server(grid, cfg, ServerSettings(out=str(tmp_path / "flower"), resume=False, wait_timeout=5))
    sim = run_training(cfg, out=tmp_path / "sim", progress=False)
    flower = read_csv(tmp_path / "flower" / "rounds.csv")
    rows = read_csv(sim.run_dir / "rounds.csv")
    for key in ("accuracy", "val_accuracy", "val_loss"):
        assert [float(r[key]) for r in flower] == pytest.approx([float(r[key]) for r in rows], abs=1e-5), key
    s = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert s["selection"].startswith("validation")
    assert s["selected_round"] == sim.summary["selected_round"]
    assert s["test_accuracy_at_selected"] == pytest.approx(sim.summary["test_accuracy_at_selected"], abs=1e-6)
    assert s.get("selected_params") == sim.summary.get("selected_params")
    assert (head == "qda") == ("selected_params" in s)


def test_the_ceilings_head_independent_candidates_are_computed_once_per_data(tiny_store, tmp_path, monkeypatch):
    """A bench grid's runs share the probe, ridge and LDA of the ceiling (they do not depend on the run's head)."""
    from fedhead.core import central

    calls = []
    real = central.central_head
    monkeypatch.setattr(central, "central_head", lambda head, *a, **k: calls.append(head.name) or real(head, *a, **k))
    cache: dict = {}
    kw = dict(central_reference=True, rounds=2)
    a = run_training(cfg_for(tiny_store, head="ova2", **kw), out=tmp_path / "a", progress=False, central_cache=cache)
    probe_fits = calls.count("softmax")
    assert probe_fits >= 6  # the grid of five weights (or more) and the refit
    b = run_training(cfg_for(tiny_store, head="ova", **kw), out=tmp_path / "b", progress=False, central_cache=cache)
    assert calls.count("softmax") == probe_fits  # reused
    assert calls.count("ova") == 1  # the run's own head, trained centrally once
    assert a.summary["central_method"] in ("own", "probe", "ridge", "lda")
    fresh = run_training(cfg_for(tiny_store, head="ova", **kw), out=tmp_path / "c", progress=False)
    assert fresh.summary["central_accuracy"] == b.summary["central_accuracy"]
