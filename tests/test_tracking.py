"""Plots and trackers of every run (curves.png, partition.png, --log tensorboard | mlflow) and ``fedhead compare``.

The rest of the suite builds every run's figure data without drawing (FEDHEAD_TEST_PLOTS=data, conftest.py); these
tests draw them, and read the trackers back."""

import csv
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import cli
import fedhead
from fedhead.federation import outputs, tracking
from fedhead.federation.config import TrainConfig
from fedhead.federation.plots import LabelCounts, write_label_counts
from fedhead.infra.errors import FedheadError

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def drawing(monkeypatch):
    """Draw the figures (the suite's default builds their data only)."""
    monkeypatch.delenv(outputs.DRAW_ENV, raising=False)


def is_png(path: Path) -> tuple[int, int]:
    """The PNG's width and height (a real PNG: signature, IHDR, decodable)."""
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR", path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0
    return struct.unpack(">II", data[16:24])


def rounds_csv(run_dir: Path) -> list[dict]:
    with open(run_dir / "rounds.csv") as f:
        return list(csv.DictReader(f))


def expected_scalars(run_dir: Path) -> dict:
    """(unit, column, round) -> value: every numeric cell of rounds.csv (what a tracker must hold)."""
    want = {}
    for r in rounds_csv(run_dir):
        unit = f"seed{r['seed']}" + ("" if r.get("run", "main") in ("main", "") else f"-{r['run']}")
        for k, v in r.items():
            if k in ("seed", "round"):
                continue
            try:
                x = float(v)
            except ValueError:
                continue
            if np.isfinite(x):
                want[(unit, k, int(r["round"]))] = x
    return want


def read_events(folder: Path) -> list:
    """Every event of the TFRecord files in ``folder`` (length, crc, data, crc per record)."""
    from tensorboardX.proto import event_pb2

    events = []
    for f in sorted(folder.glob("events.out.tfevents.*")):
        data, i = f.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            ev = event_pb2.Event()
            ev.ParseFromString(data[i + 12 : i + 12 + n])
            events.append(ev)
            i += 12 + n + 4
    return events


def tensorboard_scalars(root: Path) -> tuple[dict, list]:
    """(unit, tag, step) -> value of every scalar under ``root``/<unit>, and the (unit, tag, step) written twice."""
    got, twice = {}, []
    for unit_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for ev in read_events(unit_dir):
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    key = (unit_dir.name, v.tag, ev.step)
                    if key in got:
                        twice.append(key)
                    got[key] = v.simple_value
    return got, twice


def train(store, out, **kw):
    kw = {"head": "ova2", "partition": "dirichlet", "alpha": 0.3, "clients": 8, "rounds": 3, **kw}
    return fedhead.run(features=str(store), out=out, **kw)


# ---------------------------------------------------------------- the plots


def test_train_writes_curves_and_partition_pngs(tiny_store, tmp_path, drawing):
    res = train(tiny_store, tmp_path / "run", seeds=[0, 1], iid_reference=True, central_reference=True)
    for name in ("curves.png", "partition.png"):
        is_png(res.run_dir / name)
    panels = outputs.curve_panels(res.rows, {"0": {"accuracy": 0.9}})
    acc, loss = panels
    assert [ln.label.split(" (")[0] for ln in acc.lines] == ["run", "IID reference"]
    assert [ln.style for ln in acc.lines] == ["-", "--"] and acc.lines[0].err is not None  # two seeds: a band
    assert list(acc.lines[0].x) == [1, 2, 3] and acc.hlines == [(0.9, "central ceiling")]
    assert acc.vlines == [(1.5, "stage2")] == loss.vlines  # OvA-LP's stage 1 -> 2 after round 1


def test_no_plots_and_the_data_only_hook(tiny_store, tmp_path, monkeypatch):
    monkeypatch.delenv(outputs.DRAW_ENV, raising=False)
    args = ["train", "--features", str(tiny_store), "--clients", "4", "--rounds", "2", "--no-plots", "--out"]
    res = runner.invoke(cli.app, [*args, str(tmp_path / "off")])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "off" / "curves.png").exists() and not (tmp_path / "off" / "partition.png").exists()
    monkeypatch.setenv(outputs.DRAW_ENV, "data")  # the suite's setting: data built and checked, nothing drawn
    res = train(tiny_store, tmp_path / "data")
    assert not (res.run_dir / "curves.png").exists()
    monkeypatch.setattr(outputs, "curve_panels", lambda *a: (_ for _ in ()).throw(ValueError("bad curve")))
    with pytest.raises(ValueError, match="bad curve"):  # a bug in a figure's data fails every run of the suite
        train(tiny_store, tmp_path / "data2")


def test_partition_png_bars_heatmap_and_secure_note(tmp_path, drawing):
    rng = np.random.default_rng(0)
    few, many = rng.integers(0, 9, (10, 5)), rng.integers(0, 9, (1000, 100))
    assert LabelCounts(few).kind == "bars" and LabelCounts(many).kind == "heatmap"
    assert LabelCounts(rng.integers(0, 9, (200, 10))).kind == "heatmap"  # many clients, few labels
    assert LabelCounts(rng.integers(0, 9, (10, 30))).kind == "heatmap"  # few clients, many labels
    w_bars, _ = is_png(write_label_counts(tmp_path / "bars.png", LabelCounts(few, list("abcde"))))
    w_heat, h_heat = is_png(write_label_counts(tmp_path / "heat.png", LabelCounts(many)))
    assert w_heat <= 14 * 110 and h_heat <= 9 * 110  # 1000 clients x 100 labels stay one readable figure
    report = outputs.RunReport(counts=None, note=outputs.SECURE_NOTE)
    assert outputs.label_counts(report).kind == "note"
    is_png(write_label_counts(tmp_path / "note.png", outputs.label_counts(report)))
    with pytest.raises(ValueError):
        LabelCounts(None).check()  # no counts and no reason: refused, not drawn empty


def test_secure_aggregation_report_says_why_there_are_no_counts(tiny_store):
    from fedhead.federation.job import HeadJob

    job = HeadJob.__new__(HeadJob)  # the report of a Flower run whose nodes sent no counts (SecAgg+)
    job.cfg = TrainConfig(features=str(tiny_store), secure_aggregation=True, clients=4)
    job.client_rows, job.central = [], {}
    job.store = type("S", (), {"info": type("I", (), {"class_names": ["a", "b"]})()})()
    report = job.report([], {})
    assert report.counts is None and "Secure aggregation" in report.note


def test_scratch_writes_plots_and_tensorboard(tmp_path, monkeypatch, drawing):
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    out = tmp_path / "scratch"
    args = ["scratch", "fedavg", "--dataset", "digits", "--data-dir", str(tmp_path), "--clients", "4",
            "--participation", "1.0", "--partition", "iid", "--rounds", "2", "--local-epochs", "1",
            "--batch-size", "64", "--out", str(out), "--log", "tensorboard"]  # fmt: skip
    res = runner.invoke(cli.app, args)
    assert res.exit_code == 0, res.output
    is_png(out / "curves.png")
    is_png(out / "partition.png")
    got, twice = tensorboard_scalars(out / "tensorboard")
    want = expected_scalars(out)
    assert want and not twice and all(got[k] == pytest.approx(v, rel=1e-5) for k, v in want.items())


# ---------------------------------------------------------------- the trackers


def test_tensorboard_records_every_row_and_an_extension_replaces_them(tiny_store, tmp_path):
    run_dir = tmp_path / "tb"
    train(tiny_store, run_dir, seeds=[0, 1], iid_reference=True, log="tensorboard")
    got, twice = tensorboard_scalars(run_dir / "tensorboard")
    want = expected_scalars(run_dir)
    assert {k[0] for k in want} == {"seed0", "seed1", "seed0-iid", "seed1-iid"}
    assert not twice and set(want) <= set(got)
    assert all(got[k] == pytest.approx(v, rel=1e-5) for k, v in want.items())
    hp = [ev for ev in read_events(run_dir / "tensorboard" / "seed0") if ev.summary.value[:1]
          and ev.summary.value[0].tag.startswith("_hparams_")]  # fmt: skip
    assert hp, "the configuration as hyper-parameters"
    # more rounds on the finished run: the tracker is rewritten whole, no row twice
    train(tiny_store, run_dir, seeds=[0, 1], iid_reference=True, log="tensorboard", rounds=5, resume=True)
    got, twice = tensorboard_scalars(run_dir / "tensorboard")
    want = expected_scalars(run_dir)
    assert max(k[2] for k in want) == 5 and not twice and set(want) <= set(got)


def test_mlflow_records_every_row_and_a_rewrite_keeps_one_run_per_unit(tiny_store, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run_dir, store = tmp_path / "ml", tmp_path / "store"
    train(tiny_store, run_dir, seeds=[0, 1], log="mlflow", log_dir=str(store), lr=0.05)
    train(tiny_store, run_dir, seeds=[0, 1], log="mlflow", log_dir=str(store), lr=0.05, rounds=4, resume=True)
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    eid = client.get_experiment_by_name(tracking.EXPERIMENT).experiment_id
    runs = client.search_runs([eid])
    assert sorted(r.data.tags["fedhead.unit"] for r in runs) == ["seed0", "seed1"]  # the first write replaced
    assert runs[0].data.params["lr"] == "0.05" and runs[0].data.params["partition_params.alpha"] == "0.3"
    want = expected_scalars(run_dir)
    for r in runs:
        unit = r.data.tags["fedhead.unit"]
        for key in {k[1] for k in want if k[0] == unit}:
            hist = client.get_metric_history(r.info.run_id, key)
            steps = [m.step for m in hist]
            assert len(steps) == len(set(steps)), (unit, key)  # no row twice
            assert {(unit, key, m.step): m.value for m in hist} == pytest.approx(
                {k: v for k, v in want.items() if k[:2] == (unit, key)}, rel=1e-5
            )


def checked_rows(run_dir: Path) -> dict:
    """(unit, round) -> accuracy of every row of rounds.csv so far (what a tracker must hold as the run goes)."""
    return {(u, rnd): v for (u, k, rnd), v in expected_scalars(run_dir).items() if k == "accuracy"}


def interrupt_after(monkeypatch, k: int, check) -> list:
    """The loop's pause hook (after each round's checkpoint and tracker row) calls ``check`` and stops the run with
    SIGTERM's Interrupted after its ``k``-th row (``k`` = 0: never); returns the row counts it saw."""
    import signal

    from fedhead.federation import loop
    from fedhead.infra.signals import Interrupted

    seen = []

    def hook(env, count):
        seen.append(count)
        check()
        if count == k:
            raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(loop, "pause_hook", hook)
    return seen


def test_tensorboard_gets_each_row_as_it_comes_and_a_resume_writes_each_once(tiny_store, tmp_path, monkeypatch):
    run_dir = tmp_path / "live"
    root = run_dir / "tensorboard"

    def check():  # while the run trains: every checkpointed row is in the event files already, none twice
        got, twice = tensorboard_scalars(root)
        want = checked_rows(run_dir)
        assert not twice and want and all(got[(u, "accuracy", rnd)] == pytest.approx(v) for (u, rnd), v in want.items())

    seen = interrupt_after(monkeypatch, 6, check)  # seed 0: 4 rows, its IID reference: 2 of 4 when interrupted
    kw = dict(seeds=[0], iid_reference=True, log="tensorboard", rounds=4)
    with pytest.raises(FedheadError, match="interrupted"):  # Interrupted
        train(tiny_store, run_dir, **kw)
    assert seen == [1, 2, 3, 4, 5, 6] and not (run_dir / "summary.json").exists()
    got, twice = tensorboard_scalars(root)  # what the interrupted run leaves: its rows so far, once each
    assert not twice and {(u, rnd) for (u, k, rnd) in got if k == "accuracy"} == set(checked_rows(run_dir))
    seen = interrupt_after(monkeypatch, 0, check)
    train(tiny_store, run_dir, resume=True, **kw)
    assert seen == [7, 8]  # the resumed run's rounds, each seen live with the earlier rows once
    got, twice = tensorboard_scalars(root)
    want = expected_scalars(run_dir)
    assert not twice and all(got[k] == pytest.approx(v, rel=1e-5) for k, v in want.items())
    assert {k for k in got if k[1] == "accuracy"} == {k for k in want if k[1] == "accuracy"}
    assert not [p for p in root.parent.iterdir() if p.name.endswith(".partial")]  # no folder left half-written


def test_live_tracker_rewrites_a_continued_unit_and_never_doubles_a_row(tmp_path):
    pytest.importorskip("tensorboardX")
    rows = [{"seed": 0, "round": r, "run": "main", "accuracy": r / 10, "stage": "stage1"} for r in range(1, 6)]
    with tracking.live("tensorboard", tmp_path, None) as live:  # an interrupted run: rounds 1-3 written
        live.begin([])
        for n in range(1, 4):
            live.add(rows[n - 1 : n], rows[:n])
        got, twice = tensorboard_scalars(tmp_path / "tensorboard")
        assert sorted(k[2] for k in got) == [1, 2, 3] and not twice  # on disk before the writer closes
    with tracking.live("tensorboard", tmp_path, None) as live:  # its resume: checkpointed up to round 2 only
        live.begin(rows[:2])
        for n in range(3, 6):
            live.add(rows[n - 1 : n], rows[:n])
    got, twice = tensorboard_scalars(tmp_path / "tensorboard")
    assert not twice and got == {("seed0", "accuracy", r): pytest.approx(r / 10) for r in range(1, 6)}
    with tracking.live("none", tmp_path, None) as live:  # --log none: nothing written, nothing imported
        live.begin(rows)
        live.add(rows[:1], rows[:1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tensorboard"]


def test_mlflow_gets_each_row_as_it_comes_and_a_resume_writes_each_once(tiny_store, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run_dir, store = tmp_path / "ml", tmp_path / "store"

    def history() -> tuple[dict, list]:
        """(unit, round) -> accuracy of the live runs of the store, and the (unit, round) logged twice."""
        client = MlflowClient(tracking_uri=store.resolve().as_uri())
        exp = client.get_experiment_by_name(tracking.EXPERIMENT)
        got, twice = {}, []
        for r in client.search_runs([exp.experiment_id]) if exp else []:
            unit = r.data.tags["fedhead.unit"]
            for m in client.get_metric_history(r.info.run_id, "accuracy"):
                twice += [(unit, m.step)] if (unit, m.step) in got else []
                got[(unit, m.step)] = m.value
        return got, twice

    def check():
        got, twice = history()
        want = checked_rows(run_dir)
        assert not twice and want and all(got[k] == pytest.approx(v) for k, v in want.items())

    kw = dict(seeds=[0, 1], log="mlflow", log_dir=str(store), rounds=3)
    seen = interrupt_after(monkeypatch, 4, check)  # seed 0's 3 rows and seed 1's first
    with pytest.raises(FedheadError, match="interrupted"):  # Interrupted
        train(tiny_store, run_dir, **kw)
    assert seen == [1, 2, 3, 4] and set(history()[0]) == set(checked_rows(run_dir))
    seen = interrupt_after(monkeypatch, 0, check)
    train(tiny_store, run_dir, resume=True, **kw)
    assert seen == [5, 6]
    got, twice = history()
    assert not twice and got == pytest.approx(checked_rows(run_dir))
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name(tracking.EXPERIMENT).experiment_id])
    assert sorted(r.data.tags["fedhead.unit"] for r in runs) == ["seed0", "seed1"]  # the end's rewrite, one each
    assert all(r.info.status == "FINISHED" and r.data.params.get("rounds") == "3" for r in runs)


def test_missing_extra_and_log_dir_without_log_are_one_line(tiny_store, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if the extra were not installed
    with pytest.raises(FedheadError, match=r"pip install 'fedhead\[tensorboard\]'"):
        train(tiny_store, tmp_path / "a", log="tensorboard")
    assert not (tmp_path / "a").exists()  # refused before the run starts
    with pytest.raises(FedheadError, match="'log_dir' option does not apply to log none"):
        train(tiny_store, tmp_path / "b", log_dir=str(tmp_path / "x"))
    res = runner.invoke(cli.app, ["train", "--features", str(tiny_store), "--log", "wandb", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "'--log' parameter" in res.output and len(res.output.strip().splitlines()) == 1


def test_tracker_options_are_not_part_of_the_identity(tiny_store, tmp_path):
    run_dir = tmp_path / "id"
    train(tiny_store, run_dir, plots=False)
    res = train(tiny_store, run_dir, plots=True, log="tensorboard", resume=True)  # reported again, not refused
    assert res.summary["head"] == "ova2"


# ---------------------------------------------------------------- compare


def test_compare_prints_and_plots_runs_side_by_side(tiny_store, tmp_path, drawing):
    a = train(tiny_store, tmp_path / "a", plots=False).run_dir
    b = train(tiny_store, tmp_path / "b", plots=False, lr=0.05, rounds=4).run_dir
    res = runner.invoke(cli.app, ["compare", str(a), str(b), "--out", str(tmp_path / "cmp")], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "lr=0.01" in res.output and "lr=0.05" in res.output and "rounds=4" in res.output
    assert "partition=" not in res.output  # equal settings are not listed
    is_png(tmp_path / "cmp" / "compare.png")
    assert f"wrote {tmp_path / 'cmp' / 'compare.csv'}" in res.output and (tmp_path / "cmp" / "compare.json").is_file()
    final_b = float(rounds_csv(b)[-1]["accuracy"])
    assert f"{final_b:.4f}" in res.output
    for args, needle in (
        ([str(a), str(tmp_path / "nope")], "does not exist"),
        ([str(a), str(tmp_path)], "not a run directory"),
        ([str(a), "--metric", "nope"], "'--metric' parameter"),
    ):
        res = runner.invoke(cli.app, ["compare", *args, "--out", str(tmp_path / "cmp")])
        assert res.exit_code != 0 and needle in res.output and len(res.output.strip().splitlines()) == 1, res.output
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "rounds.csv").write_text("seed,round,accuracy\n")
    res = runner.invoke(cli.app, ["compare", str(tmp_path / "empty")])
    assert res.exit_code != 0 and "an empty run" in res.output


def test_rounds_csv_columns_and_summary_keys_are_documented(tiny_store, tmp_path):
    """Every column the runs write, and every key of a head run's summary.json, is in docs/tracking.md."""
    pytest.importorskip("flwr")
    from fedhead.core.clientacc import CLIENT_FIELDS, LOCAL_FIELDS
    from fedhead.federation.job import ASYNC_FIELDS, CLOCK_FIELDS, VAL_FIELDS
    from fedhead.federation.rundir import ROUND_FIELDS
    from fedhead.flower.strategy import FedheadStrategy

    doc = (Path(__file__).resolve().parents[1] / "docs" / "tracking.md").read_text()
    extra = ["ratio_to_central", "dp_epsilon", "dp_epsilon_statistics", "clients", "members", "lr", "epochs",
             "bytes_shared_data", "pfl_accuracy", "drift_accuracy", "generic_accuracy", *CLIENT_FIELDS, *LOCAL_FIELDS,
             *VAL_FIELDS, "selected_params", *CLOCK_FIELDS, *ASYNC_FIELDS]  # fmt: skip
    for col in [*ROUND_FIELDS, *FedheadStrategy.extra_fields, *extra]:
        assert f"| `{col}` |" in doc, col
    res = train(tiny_store, tmp_path / "doc", iid_reference=True, central_reference=True, plots=False)
    assert set(rounds_csv(res.run_dir)[0]) <= set(ROUND_FIELDS) | set(FedheadStrategy.extra_fields) | set(extra)
    for key in res.summary:
        if not key.endswith("_std") and key not in ("per_seed", "fedhead_version"):
            assert f"`{key}`" in doc, key


# ---------------------------------------------------------------- Flower


def test_flower_run_writes_plots_and_tensorboard(tiny_store, tmp_path, monkeypatch, drawing):
    """The ServerApp's run (over the in-process grid: Flower's messages, no Ray) draws both figures and logs every
    row (with secure aggregation: tests/test_flower_secure.py)."""
    pytest.importorskip("flwr")
    from fedhead.flower.client_app import make_client_app
    from fedhead.flower.inprocess import InProcessGrid, sim_nodes, task_identity
    from fedhead.flower.server_app import run_server
    from fedhead.flower.strategy import ServerSettings

    specs = []
    real = outputs.label_counts
    monkeypatch.setattr(outputs, "label_counts", lambda report: specs.append(real(report)) or specs[-1])
    cfg = TrainConfig(features=str(tiny_store), partition="shard", clients=4, rounds=2, local_epochs=1,
                      log="tensorboard", device="cpu")  # fmt: skip
    out = tmp_path / "flower"
    with task_identity():
        grid = InProcessGrid(make_client_app(str(tiny_store)), sim_nodes(cfg.clients))
        run_server(grid, cfg, ServerSettings(out=str(out), resume=False, wait_timeout=5))
    is_png(out / "curves.png")
    is_png(out / "partition.png")
    assert [s.kind for s in specs] == ["bars"] and (out / "clients.csv").exists()
    got, twice = tensorboard_scalars(out / "tensorboard")
    want = expected_scalars(out)
    assert want and not twice and all(got[k] == pytest.approx(v, rel=1e-5) for k, v in want.items())
