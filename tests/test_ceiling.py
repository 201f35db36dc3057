"""Time to the ceiling (`fedhead bench speed`, issue 24 item 4): the rounds found against the run's own central
ceiling, the timed command repeating that round, and the record's keys and table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedhead.bench import ceiling as C
from fedhead.federation.train import run_training

REPO = Path(__file__).resolve().parents[1]


def test_rounds_to_the_ceiling_and_the_timed_command(tiny_store, tmp_path):
    """ridge (one exchange) and softmax over 4 rounds: the round found is the first of the in-process run at or
    above 99% of the ceiling; the timed command is a whole fresh process (longer than the run inside it) whose last
    accuracy is that round's; the best ceiling is the larger of the two."""
    rec = C.measure_store(tiny_store, "t", clients=4, rounds=4, flower=False, methods=("ridge", "softmax"))
    best = rec["ceiling_t_best_central"]
    own = {m: rec[f"ceiling_t_{m}_central"] for m in ("ridge", "softmax")}
    assert best == max(own.values()) > 0
    ref = run_training(C._config(tiny_store, "softmax", 4, 4, central=True), out=tmp_path / "ref", progress=False)
    accs = [r["accuracy"] for r in ref.rows]
    want = next((i + 1 for i, a in enumerate(accs) if a >= 0.99 * own["softmax"]), None)
    assert rec["ceiling_t_softmax_rounds_to_99_own"] == want
    assert rec["ceiling_t_ridge_rounds_to_99_own"] == 1  # a closed-form head is its own pooled solve
    for m in ("ridge", "softmax"):
        r = rec[f"ceiling_t_{m}_rounds_to_99_own"]
        if r is None:
            assert f"ceiling_t_{m}_seconds_to_99_own" not in rec
            continue
        whole, inside = rec[f"ceiling_t_{m}_seconds_to_99_own"], rec[f"ceiling_t_{m}_run_seconds_to_99_own"]
        assert whole > inside > 0  # the command includes the interpreter, imports and loading the store


def test_a_run_that_does_not_repeat_its_round_is_an_error(tiny_store, monkeypatch):
    """The timed command must end at the accuracy the search found: a different one is refused, not reported."""

    def other_accuracy(argv, cwd, timeout):  # the command, had it ended elsewhere
        return 1.0, {"final_accuracy": -1.0, "wall_seconds": 0.5}

    monkeypatch.setattr(C, "_timed", other_accuracy)
    with pytest.raises(Exception, match="did not repeat the first run's round"):
        C.measure_store(tiny_store, "t", clients=4, rounds=2, flower=False, methods=("ridge",))


@pytest.mark.slow
def test_bench_speed_prints_the_ceiling_table(tmp_path):
    out = tmp_path / "speed.json"
    argv = ["bench", "speed", "--quick", "--no-heads", "--no-extraction", "--no-scratch", "--no-ceiling-flower"]
    argv += ["--ceiling-method", "ridge", "--ceiling-method", "softmax"]
    p = subprocess.run(
        [sys.executable, "-m", "cli", *argv, "--ceiling-rounds", "2", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    rec = json.loads(out.read_text())
    assert rec["ceiling_stores"] == ["quick"] and rec["ceiling_max_rounds"] == 2
    for m in ("ridge", "softmax"):
        assert 0 < rec[f"ceiling_quick_{m}_central"] <= 1
    assert "ceiling_quick_ova2_central" not in rec
    assert "time to 99% of the central ceiling" in p.stdout


def test_closed_form_bound_counts_the_exchange():
    """bench speed's ratio of the statistics exchange to its FLOP bound, by hand: 2 clients of 3 samples, D = 4
    (D+1 = 5), 5 classes, at 100 GFLOP/s: Grams 2 * (2*3*25) + sums 2 * 3*4 + the server's sum 2 * 25 + Cholesky
    125/3 + right-hand sides 2*25*5."""
    from fedhead.bench.speed import closed_form_bound

    rec = {"machine_matmul_gflops": 100.0, "closedform_clients": 2, "closedform_samples_per_client": 3,
           "closedform_dim": 4, "closedform_classes": 5, "closedform_client_s": 1.0, "closedform_stream_s": 0.5,
           "closedform_ridge_solve_s": 0.5}  # fmt: skip
    flops = 2 * (2 * 3 * 25 + 3 * 4 + 25) + 125 / 3 + 2 * 25 * 5
    got = closed_form_bound(rec)
    assert got["closedform_gflop"] == pytest.approx(flops / 1e9, rel=1e-12)
    assert got["closedform_vs_bound"] == pytest.approx(2.0 / (flops / 100e9), rel=1e-12)
    assert closed_form_bound({"closedform_client_s": 1.0}) == {}  # no machine measurement: no ratio


def test_simulator_exchange_bound_counts_one_blocked_product():
    """The simulator's exchange (one machine, the clients' Grams as one blocked product) against the same count
    without the server's per-client additions, at the float32 and at the float64 rate, by hand."""
    from fedhead.bench.speed import closed_form_bound

    rec = {"machine_matmul_gflops": 100.0, "machine_matmul64_gflops": 50.0, "closedform_clients": 2,
           "closedform_samples_per_client": 3, "closedform_dim": 4, "closedform_classes": 5,
           "closedform_client_s": 1.0, "closedform_stream_s": 0.5, "closedform_ridge_solve_s": 0.5,
           "closedform_sim_s": 0.25}  # fmt: skip
    flops = 2 * (2 * 3 * 25 + 3 * 4) + 125 / 3 + 2 * 25 * 5
    got = closed_form_bound(rec)
    assert got["closedform_sim_bound_s"] == pytest.approx(flops / 100e9, rel=1e-12)
    assert got["closedform_sim_vs_bound"] == pytest.approx(0.25 / (flops / 100e9), rel=1e-12)
    assert got["closedform_sim_vs_bound64"] == pytest.approx(0.25 / (flops / 50e9), rel=1e-12)
    del rec["machine_matmul64_gflops"]
    assert "closedform_sim_vs_bound64" not in closed_form_bound(rec)
