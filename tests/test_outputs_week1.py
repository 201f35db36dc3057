"""What a new user reported in a run's outputs: ``fedhead compare`` writes its table (CSV, JSON) beside compare.png,
partition.png's neighbouring labels get distant colours, and curves.png's loss breaks at a stage boundary (OvA-LP's
stage 1 and 2 losses differ in scale). The trackers' rows as they come: tests/test_tracking.py."""

import csv
import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

import cli
from fedhead.federation import compare, outputs, plots

runner = CliRunner()


# ---------------------------------------------------------------- compare: the table as CSV and JSON


def fake_run(path, rounds, lr, summary=None):
    """A run directory as compare reads it: rounds.csv, summary.json and config.json."""
    path.mkdir()
    with open(path / "rounds.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seed", "round", "accuracy", "train_loss", "run"])
        for rnd in range(1, rounds + 1):
            w.writerow([0, rnd, 0.1 * rnd, 1.0 / rnd, "main"])
    base = {"head": "ova2", "partition": "dirichlet", "selected_round": rounds,
            "test_accuracy_at_selected": 0.1 * rounds, "bytes_total": 2.5e6, "wall_seconds": 1.5}  # fmt: skip
    (path / "summary.json").write_text(json.dumps({**base, **(summary or {})}))
    (path / "config.json").write_text(json.dumps({"config": {"head": "ova2", "lr": lr, "rounds": rounds}}))
    return path


def test_compare_writes_the_table_as_csv_and_json_beside_the_png(tmp_path):
    a = fake_run(tmp_path / "a", 3, 0.01)
    b = fake_run(tmp_path / "b", 4, 0.05, {"final_ratio_to_iid": float("nan")})  # NaN: null in JSON, empty in CSV
    out = tmp_path / "cmp"
    res = runner.invoke(cli.app, ["compare", str(a), str(b), "--out", str(out)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    wrote = [line.split(" ", 1)[1] for line in res.output.splitlines() if line.startswith("wrote ")]
    assert wrote == [str(out / n) for n in (compare.COMPARE_PNG, compare.COMPARE_CSV, compare.COMPARE_JSON)]
    want = compare.table_rows([compare.load_run(a), compare.load_run(b)], "accuracy")
    with open(out / "compare.csv", newline="") as f:
        reader = csv.DictReader(f)
        got = list(reader)
    assert reader.fieldnames == list(want[0])  # the columns of table_rows, in its order
    assert [r["run"] for r in got] == ["a", "b"] and [r["rounds"] for r in got] == ["3", "4"]
    assert float(got[1]["final"]) == pytest.approx(0.4) and got[1]["differs"] == "lr=0.05; rounds=4"
    assert got[1]["ratio_to_iid"] == "" and got[0]["ratio_to_central"] == ""
    doc = json.loads((out / "compare.json").read_text())  # strict JSON: no NaN
    assert doc["metric"] == "accuracy" and [list(r) for r in doc["rows"]] == [list(w) for w in want]
    assert doc["rows"][1]["ratio_to_iid"] is None and doc["rows"][0]["mb_total"] == pytest.approx(2.5)
    assert doc["rows"][0]["final"] == pytest.approx(want[0]["final"])
    assert not list(out.glob(".*.tmp"))  # written atomically: no temporary file left
    # another metric: the same three files again, the table of that metric
    res = runner.invoke(cli.app, ["compare", str(a), str(b), "--out", str(out), "--metric", "train_loss"])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "compare.json").read_text())
    assert doc["metric"] == "train_loss" and doc["rows"][0]["final"] == pytest.approx(1 / 3)


def test_compare_table_refuses_a_folder_in_the_way_in_one_line(tmp_path):
    a = fake_run(tmp_path / "a", 2, 0.01)
    (tmp_path / "cmp" / compare.COMPARE_CSV).mkdir(parents=True)
    res = runner.invoke(cli.app, ["compare", str(a), "--out", str(tmp_path / "cmp")])
    assert res.exit_code != 0 and "is a folder" in res.output


# ---------------------------------------------------------------- partition.png: a colour per label


def rgb(colors) -> np.ndarray:
    return np.asarray(colors, float)[:, :3]


def neighbour_distances(colors) -> np.ndarray:
    """The RGB distance (0..sqrt(3)) between the colours of label j and label j + 1."""
    return np.linalg.norm(np.diff(rgb(colors), axis=0), axis=1)


MARGIN = 0.35  # tab10's closest neighbours (purple, brown) are 0.45 apart; RdYlGn's at 10 labels were 0.1-0.2


@pytest.mark.parametrize("c", [10, 20, 100])
def test_neighbouring_labels_get_clearly_different_colours(c):
    colors = plots.label_colors(c)
    assert len(colors) == c and len({tuple(x) for x in colors}) == c  # every label its own colour
    assert neighbour_distances(colors).min() > MARGIN, neighbour_distances(colors).round(2)


def test_label_colors_every_count_and_the_old_map_fails_the_margin():
    from matplotlib import colormaps

    for c in range(2, 130):
        assert neighbour_distances(plots.label_colors(c)).min() > MARGIN, c
    assert plots.label_colors(1) and len(plots.label_colors(0)) == 0
    assert rgb(plots.label_colors(10)).tolist() == rgb(colormaps["tab10"].colors).tolist()  # tab10 as it is
    old = [colormaps["RdYlGn"](j / 9) for j in range(10)]  # the map partition.png used before
    assert neighbour_distances(old).min() < MARGIN  # the margin tells the two apart


def test_partition_bars_use_label_colors(tmp_path, monkeypatch):
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    counts = np.random.default_rng(0).integers(0, 9, (6, 12))
    plots.write_label_counts(tmp_path / "p.png", plots.LabelCounts(counts))
    (ax,) = figs[0].axes
    bars = ax.patches  # label by label, each label's bar for every client
    assert len(bars) == 6 * 12
    got = [tuple(bars[6 * j].get_facecolor()) for j in range(12)]
    assert np.allclose(got, plots.label_colors(12))


# ---------------------------------------------------------------- curves.png: the loss breaks at a stage boundary


def ova_rows(seeds=(0, 1), iid=True) -> list[dict]:
    """Rows as an ova2 run writes them: stage1 for rounds 1-2, stage2 for rounds 3-5 (a loss ten times smaller)."""
    rows = []
    for run in ("main", "iid") if iid else ("main",):
        for seed in seeds:
            for rnd in range(1, 6):
                stage = "stage1" if rnd <= 2 else "stage2"
                loss = (2.0 if stage == "stage1" else 0.2) / rnd + 0.01 * seed
                acc = 0.1 * rnd + 0.01 * seed
                rows.append(
                    {"seed": seed, "round": rnd, "stage": stage, "run": run, "accuracy": acc, "train_loss": loss}
                )
    return rows


def stages_of(line, rows) -> set:
    stage = {int(r["round"]): r["stage"] for r in rows}
    return {stage[int(x)] for x in line.x}


def test_loss_panel_has_no_line_across_a_stage_boundary():
    rows = ova_rows()
    acc, loss = outputs.curve_panels(rows)
    for ln in loss.lines:
        assert len(stages_of(ln, rows)) == 1, (ln.label, list(ln.x))
    five = [1, 2, 3, 4, 5]
    assert [(ln.label.split(" (")[0], list(ln.x)) for ln in acc.lines] == [("run", five), ("IID reference", five)]
    assert [list(ln.x) for ln in loss.lines] == [[1, 2], [3, 4, 5], [1, 2], [3, 4, 5]]
    assert [ln.label.rsplit(", ", 1)[1] for ln in loss.lines] == ["stage1", "stage2"] * 2
    assert [ln.style for ln in loss.lines] == ["-", "-", "--", "--"]
    assert [ln.color for ln in loss.lines] == [acc.lines[0].color] * 2 + [acc.lines[1].color] * 2  # a run's colour
    assert all(ln.err is not None and len(ln.err) == len(ln.x) for ln in loss.lines)  # two seeds: a band each
    assert loss.lines[0].y[0] == pytest.approx(2.005) and loss.lines[1].y[0] == pytest.approx(0.2 / 3 + 0.005)
    assert loss.vlines == [(2.5, "stage2")] == acc.vlines


def test_loss_panel_one_stage_one_line_and_a_stage_without_loss_none():
    one = [{**r, "stage": "train"} for r in ova_rows(seeds=(0,), iid=False)]
    _, loss = outputs.curve_panels(one)
    assert [(ln.label, list(ln.x)) for ln in loss.lines] == [("run", [1, 2, 3, 4, 5])]  # as before
    stats = ova_rows(seeds=(0,), iid=False)
    stats[0] = {**stats[0], "stage": "statistics", "train_loss": float("nan")}  # a closed-form start's first round
    _, loss = outputs.curve_panels(stats)
    assert [(ln.label, list(ln.x)) for ln in loss.lines] == [("run, stage1", [2]), ("run, stage2", [3, 4, 5])]
    back = ova_rows(seeds=(0,), iid=False) + [{"seed": 0, "round": 6, "stage": "stage1", "run": "main",
                                               "accuracy": 0.6, "train_loss": 0.3}]  # fmt: skip
    _, loss = outputs.curve_panels(back)  # a stage that comes back is a segment of its own
    assert [list(ln.x) for ln in loss.lines] == [[1, 2], [3, 4, 5], [6]]


def test_curves_png_draws_the_stage_segments(tmp_path, monkeypatch):
    monkeypatch.delenv(outputs.DRAW_ENV, raising=False)
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    outputs.write_plots(tmp_path, ova_rows(), outputs.RunReport(counts=np.ones((3, 4), int)))
    ax_acc, ax_loss = figs[0].axes[:2]
    drawn = [ln for ln in ax_loss.get_lines() if len(ln.get_xdata()) > 0 and ln.get_linestyle() != ":"]
    xs = [list(map(float, ln.get_xdata())) for ln in drawn]
    assert [1.0, 2.0] in xs and [3.0, 4.0, 5.0] in xs and all(not (2.0 in x and 3.0 in x) for x in xs)
    assert all(math.isfinite(v) for ln in drawn for v in ln.get_ydata())
