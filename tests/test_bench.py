"""``fedhead bench ...`` end to end on tiny synthetic stores: reports, numbers from the runs, resume, PNGs,
bad input; geometry metrics on hand-computed toy data."""

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import cli

runner = CliRunner()
PNG_SIG = b"\x89PNG\r\n\x1a\n"
SMALL = ["--quick", "--rounds", "2", "--clients", "10"]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)


@pytest.fixture(scope="session")
def stores(tmp_path_factory):
    from fedhead.core.synthetic import write_synthetic

    d = tmp_path_factory.mktemp("bench-stores")
    a = write_synthetic(
        d / "a.h5", num_classes=10, train_per_class=30, test_per_class=10, dim=16, latent=8, spread=1.0, seed=0
    )
    b = write_synthetic(
        d / "b.h5", num_classes=10, train_per_class=30, test_per_class=10, dim=24, latent=8, spread=1.5, seed=1
    )
    c = write_synthetic(
        d / "c.h5", num_classes=12, train_per_class=20, test_per_class=5, dim=16, latent=8, spread=1.0, seed=2
    )
    return {"a": a, "b": b, "c": c}


def bench(*args):
    res = runner.invoke(cli.app, ["bench", *map(str, args)])
    return res


def ok(res):
    assert res.exit_code == 0, (res.output, res.exception)
    return res


def results(out):
    with open(Path(out) / "results.csv") as f:
        return list(csv.DictReader(f))


def summary(run_dir):
    return json.loads((Path(run_dir) / "summary.json").read_text())


def assert_pngs(out, at_least):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    pngs = sorted(Path(out).glob("*.png"))
    assert len(pngs) >= at_least, pngs
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_SIG, p
        img = mpimg.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    return pngs


def table_rows(md: str, heading: str) -> list[list[str]]:
    """Rows of the first markdown table after the line containing ``heading``."""
    lines = md.splitlines()
    i = next(k for k, line in enumerate(lines) if heading in line)
    rows, started = [], False
    for line in lines[i + 1 :]:
        if line.startswith("|"):
            started = True
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif started:
            break
    return rows[2:]  # skip header and separator


# ---------------------------------------------------------------- ablation, resume


def test_ablation_report_numbers_come_from_runs(stores, tmp_path):
    out = tmp_path / "abl"
    ok(
        bench(
            "ablation",
            "--features",
            stores["a"],
            "--head",
            "softmax",
            "--head",
            "ova2",
            "--partition",
            "shard-1",
            *SMALL,
            "--out",
            out,
        )
    )
    rows = results(out)
    # 2 recipes x 2 heads x (IID + 1 partition)
    assert len(rows) == 8
    assert {(r["bench_recipe"], r["cfg_optimizer"]) for r in rows} == {("paper", "adamw"), ("default", "sgd")}
    assert {r["bench_partition"] for r in rows} == {"iid", "shard-1"}
    for r in rows:
        assert r["run_status"] == "ran"
        s = summary(r["run_dir"])
        assert math.isclose(float(r["res_final_accuracy"]), s["final_accuracy"], rel_tol=1e-5)
        iid = summary(out / "runs" / r["res_iid_run"])
        assert iid["partition"] == "iid" and iid["head"] == r["bench_head"]
        assert math.isclose(
            float(r["res_final_ratio_to_iid"]), s["final_accuracy"] / iid["final_accuracy"], rel_tol=1e-4
        )
        assert r["cfg_rounds"] == "2" and r["cfg_clients"] == "10" and r["cfg_seeds"] == "0"
    shard1 = [r for r in rows if r["bench_partition"] == "shard-1"]
    assert {r["cfg_partition_params_shards_per_client"] for r in shard1} == {"1"}

    md = (out / "report.md").read_text()
    assert f"fedhead bench ablation --features {stores['a']} --head softmax --head ova2 --partition shard-1" in md
    assert "--quick --rounds 2 --clients 10" in md and "--recipe" not in md.split("```")[1]
    for recipe in ("paper", "default"):
        t = table_rows(md, f"## recipe {recipe}")
        assert [(c[0], c[1]) for c in t] == [(h, p) for h in ("softmax", "ova2") for p in ("iid", "shard-1")]
        for c in t:
            r = next(
                x
                for x in rows
                if x["bench_recipe"] == recipe and x["bench_head"] == c[0] and x["bench_partition"] == c[1]
            )
            assert c[2] == f"{100 * summary(r['run_dir'])['final_accuracy']:.2f}"
        mean = table_rows(md, "Mean final ratio to IID over shard-1 (%)")
        assert [m[0] for m in mean][:2] == ["softmax", "ova2"]
        assert mean[1][2] == "95.9"  # the paper's OvA-LP value printed for reference
    # per-round ratio curves exist for every non-IID run
    with open(out / "curves.csv") as f:
        curves = list(csv.DictReader(f))
    assert len(curves) == 8 * 2
    assert all(c["ratio_to_iid_mean"] for c in curves)
    assert_pngs(out, 6)


def test_resume_reruns_only_missing_and_continues_checkpoint(stores, tmp_path, monkeypatch):
    import fedhead.federation.rundir as T  # the round loop writes rounds.csv through it

    out = tmp_path / "parts"
    args = [
        "partitions",
        "--features",
        stores["a"],
        "--partition",
        "shard-2",
        "--partition",
        "zipf",
        "--quick",
        "--rounds",
        "3",
        "--clients",
        "10",
        "--out",
        out,
    ]
    ok(bench(*args))
    first = {r["run_name"]: r for r in results(out)}
    assert set(first) == {"ova2-iid-default", "ova2-shard-2-default", "ova2-zipf-default"}

    # a finished report re-run reuses everything
    ok(bench(*args))
    assert {r["run_status"] for r in results(out)} == {"reused"}

    # a run whose summary is gone is run again, the others reused
    (out / "runs" / "ova2-zipf-default" / "summary.json").unlink()
    ok(bench(*args))
    st = {r["run_name"]: r["run_status"] for r in results(out)}
    assert st == {"ova2-iid-default": "reused", "ova2-shard-2-default": "reused", "ova2-zipf-default": "ran"}

    # interruption inside a run after its first round: the checkpoint is resumed, results unchanged
    import shutil

    shutil.rmtree(out / "runs" / "ova2-shard-2-default")
    real = T.write_rounds
    calls = {"n": 0}

    def boom(run_dir, rows, *fields):
        if Path(run_dir).name == "ova2-shard-2-default":
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyboardInterrupt
        return real(run_dir, rows, *fields)

    monkeypatch.setattr(T, "write_rounds", boom)
    res = bench(*args)
    assert res.exit_code == 130
    assert (out / "runs" / "ova2-shard-2-default" / "checkpoint.safetensors").exists()
    monkeypatch.setattr(T, "write_rounds", real)
    ok(bench(*args))
    again = {r["run_name"]: r for r in results(out)}
    assert again["ova2-shard-2-default"]["run_status"] == "resumed"
    assert again["ova2-iid-default"]["run_status"] == "reused"
    for name in first:
        assert again[name]["res_final_accuracy"] == first[name]["res_final_accuracy"], name


def test_grid_interrupted_between_runs_resumes_rest(stores, tmp_path):
    from fedhead.bench.report import Cell, StoreCache, run_grid
    from fedhead.federation.config import TrainConfig
    from fedhead.federation.train import run_training

    cells = [
        Cell(f"r{i}", {"head": h}, TrainConfig(features=str(stores["a"]), head=h, clients=5, rounds=1))
        for i, h in enumerate(["softmax", "ova", "ova2"])
    ]
    ran = []

    def flaky(cfg, out, resume, progress, store):
        if cfg.head == "ova2" and not ran.count("stop"):
            ran.append("stop")
            raise KeyboardInterrupt
        ran.append(cfg.head)
        return run_training(cfg, out=out, resume=resume, progress=progress, store=store)

    with pytest.raises(KeyboardInterrupt):
        run_grid(cells, tmp_path, StoreCache(), progress=False, runner=flaky)
    res = run_grid(cells, tmp_path, StoreCache(), progress=False, runner=flaky)
    assert [r.status for r in res] == ["reused", "reused", "ran"]
    assert ran == ["softmax", "ova", "stop", "softmax", "ova", "ova2"]


# ---------------------------------------------------------------- partitions, encoders, participation


def test_partitions_five_patterns(stores, tmp_path):
    out = tmp_path / "p"
    ok(bench("partitions", "--features", stores["a"], *SMALL, "--out", out))
    rows = results(out)
    assert [r["bench_partition"] for r in rows] == [
        "iid",
        "shard-1",
        "shard-2",
        "bernoulli-dirichlet",
        "zipf",
        "kmeans",
    ]
    assert {r["cfg_head"] for r in rows} == {"ova2"}
    assert {r["cfg_partition"] for r in rows} == {"iid", "shard", "bernoulli-dirichlet", "zipf", "kmeans"}
    md = (out / "report.md").read_text()
    t = table_rows(md, "## recipe default")
    assert [c[1] for c in t] == ["iid", "shard-1", "shard-2", "bernoulli-dirichlet", "zipf", "kmeans"]
    assert_pngs(out, 3)


def test_encoders_side_by_side_and_dataset_mismatch(stores, tmp_path):
    out = tmp_path / "enc"
    ok(
        bench(
            "encoders",
            "--features",
            stores["a"],
            "--features",
            stores["b"],
            "--partition",
            "shard-2",
            *SMALL,
            "--out",
            out,
        )
    )
    rows = results(out)
    assert len(rows) == 4 and {r["bench_store"] for r in rows} == {"a", "b"}
    md = (out / "report.md").read_text()
    t = table_rows(md, "## Encoders side by side: head ova2, recipe default")
    assert [c[0] for c in t] == ["iid", "shard-2"] and len(t[0]) == 5
    for r in rows:
        row = next(c for c in t if c[0] == r["bench_partition"])
        col = 1 if r["bench_store"] == "a" else 3
        assert row[col] == f"{100 * summary(r['run_dir'])['final_accuracy']:.2f}"
    assert_pngs(out, 4)

    res = bench("encoders", "--features", stores["a"], "--features", stores["c"], *SMALL, "--out", tmp_path / "x")
    assert res.exit_code == 2
    assert "c.h5" in res.output and "synthetic-12" in res.output and "synthetic-10" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_participation_sweep(stores, tmp_path):
    out = tmp_path / "part"
    ok(bench("participation", "--features", stores["a"], "--rates", "0.5,1.0", *SMALL, "--out", out))
    rows = results(out)
    assert [(r["bench_partition"], float(r["cfg_participation"])) for r in rows] == [
        ("iid", 1.0),
        ("bernoulli-dirichlet", 1.0),
        ("bernoulli-dirichlet", 0.5),
    ]
    half = next(r for r in rows if float(r["cfg_participation"]) == 0.5)
    with open(Path(half["run_dir"]) / "rounds.csv") as f:
        assert {int(r["clients_trained"]) for r in csv.DictReader(f)} == {5}
    assert_pngs(out, 2)


# ---------------------------------------------------------------- noise


def test_noise_table_declines_from_runs(stores, tmp_path):
    out = tmp_path / "noise"
    ok(
        bench(
            "noise",
            "--features",
            stores["a"],
            "--head",
            "softmax",
            "--head",
            "ova2",
            "--sym-rates",
            "0.3,0.5",
            "--asym-rates",
            "0.2,0.4",
            "--asym-map",
            "cyclic",
            *SMALL,
            "--out",
            out,
        )
    )
    rows = results(out)
    assert len(rows) == 10 and {r["cfg_clients"] for r in rows} == {"10"}  # 2 heads x (4 rates + clean)
    # the map (the field asym_rule renamed asym_map) reaches the asymmetric runs, the only ones it applies to: a
    # grid passes each run only the options that apply to it
    assert {r["cfg_asym_map"] for r in rows if r["bench_noise"] == "asymmetric"} == {"cyclic"}
    assert {r["cfg_asym_map"] for r in rows if r["bench_noise"] != "asymmetric"} == {"auto"}
    acc = {
        (r["bench_head"], r["bench_noise"], float(r["bench_rate"])): summary(r["run_dir"])["final_accuracy"]
        for r in rows
    }
    assert {(r["cfg_noise"], float(r["cfg_noise_rate"])) for r in rows if r["bench_noise"] == "none"} == {("none", 0)}
    md = (out / "report.md").read_text()
    sym_pts = table_rows(md, "## symmetric noise")
    # first table after the heading is accuracy; find the declines table explicitly
    pts = table_rows(md[md.index("## symmetric noise") :], "absolute (percentage points)")
    rel = table_rows(md[md.index("## symmetric noise") :], "relative (% of the lowest-rate accuracy)")
    share = table_rows(md[md.index("## symmetric noise") :], "Share of accuracy retained")
    assert [p[0] for p in pts] == ["softmax", "ova2", "OvA-LP (paper, CIFAR-100)"]
    assert pts[2][1] == "88.78"
    for i, h in enumerate(["softmax", "ova2"]):
        a0, a1 = acc[(h, "symmetric", 0.3)], acc[(h, "symmetric", 0.5)]
        assert pts[i][1] == f"{100 * a0:.2f}"
        assert pts[i][2] == f"{100 * (a0 - a1):.2f}"
        assert rel[i][2] == f"{100 * (a0 - a1) / a0:.2f}"
        assert share[i][1] == f"{100 * a1 / a0:.1f}"
    kept = table_rows(md[md.index("## symmetric noise") :], "Share of the noise-free accuracy retained")
    assert [k[0] for k in kept] == ["softmax", "ova2"]
    for i, h in enumerate(["softmax", "ova2"]):
        c = acc[(h, "none", 0.0)]
        assert kept[i][1:] == [
            f"{100 * c:.2f}",
            f"{100 * acc[(h, 'symmetric', 0.3)] / c:.1f}",
            f"{100 * acc[(h, 'symmetric', 0.5)] / c:.1f}",
        ]
    for what in ("relative to rate 0.3", "relative to no noise"):
        assert re.search(rf"ova2 retains a higher share than softmax at every rate \({what}\): \*\*(yes|no)\*\*", md)
    # the paired gap at 0.5 relative to 0.3, in points of share, from the same runs
    gap = 100 * (
        acc[("ova2", "symmetric", 0.5)] / acc[("ova2", "symmetric", 0.3)]
        - acc[("softmax", "symmetric", 0.5)] / acc[("softmax", "symmetric", 0.3)]
    )
    line = next(x for x in md.splitlines() if x.startswith("Paired gap"))
    assert f"0.5: {gap:.2f} ({int(gap > 0)}/1 seeds)" in line
    asym = table_rows(md[md.index("## asymmetric noise") :], "absolute (percentage points)")
    assert [p[0] for p in asym][:2] == ["softmax", "ova2"] and asym[2][1] == "89.28"
    assert_pngs(out, 3)
    assert sym_pts  # the accuracy table exists


def test_noise_rate_zero_is_the_clean_run_and_no_clean_skips_it(stores, tmp_path):
    ok(
        bench(
            "noise",
            "--features",
            stores["a"],
            "--head",
            "ova2",
            "--sym-rates",
            "0,0.3",
            "--asym-rates",
            "",
            "--no-clean",
            *SMALL,
            "--out",
            tmp_path / "z",
        )
    )
    assert sorted((r["bench_noise"], float(r["bench_rate"])) for r in results(tmp_path / "z")) == [
        ("none", 0.0),
        ("symmetric", 0.3),
    ]
    ok(
        bench(
            "noise",
            "--features",
            stores["a"],
            "--head",
            "ova2",
            "--sym-rates",
            "0.3",
            "--asym-rates",
            "",
            "--no-clean",
            *SMALL,
            "--out",
            tmp_path / "n",
        )
    )
    assert [r["bench_noise"] for r in results(tmp_path / "n")] == ["symmetric"]
    assert "noise-free" not in (tmp_path / "n" / "report.md").read_text()


def test_noise_asymmetric_without_map_is_the_trainers_error(stores, tmp_path):
    res = bench(
        "noise", "--features", stores["a"], "--head", "ova2", "--sym-rates", "0.3", *SMALL, "--out", tmp_path / "n"
    )
    assert res.exit_code == 2
    assert "asym-map" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "n").exists()  # validated before anything was written


# ---------------------------------------------------------------- geometry


def test_geometry_metrics_exact_on_toy():
    from fedhead.bench.geometry import geometry_metrics

    # already unit norm: class 0 = e1, e2 ; class 1 = -e1, -e1
    x = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [-1.0, 0.0]])
    y = np.array([0, 0, 1, 1])
    m = geometry_metrics(x, y)
    # positive pairs: (e1,e2) twice with ||.||^2 = 2, (-e1,-e1) twice with 0 -> mean 1
    assert m["alignment"] == pytest.approx(1.0)
    # centroid 0 = (.5,.5): distances sqrt(.5) each; centroid 1 = (-1, 0): 0 -> mean sqrt(.5)/2
    assert m["intra"] == pytest.approx(math.sqrt(0.5) / 2)
    # ||(.5,.5) - (-1,0)|| = sqrt(2.25 + .25)
    assert m["inter"] == pytest.approx(math.sqrt(2.5))
    assert m["ratio"] == pytest.approx(m["intra"] / m["inter"])
    # global mean (-.25, .25): distances to it sqrt(1.625), sqrt(.625), sqrt(.625), sqrt(.625)
    assert m["spread"] == pytest.approx((math.sqrt(1.625) + 3 * math.sqrt(0.625)) / 4)
    # scale invariance: features are L2-normalised first
    assert geometry_metrics(3 * x, y)["ratio"] == pytest.approx(m["ratio"])


def test_geometry_command(stores, tmp_path):
    out = tmp_path / "geo"
    ok(
        bench(
            "geometry",
            "--features",
            stores["a"],
            "--features",
            stores["b"],
            "--seeds",
            "0,1",
            "--samples-per-class",
            "20",
            "--out",
            out,
        )
    )
    rows = results(out)
    assert [r["bench_store"] for r in rows] == ["a", "b"]
    from extract.store import load_store
    from fedhead.bench.geometry import store_geometry

    s = load_store(stores["a"])
    per = store_geometry(s.train_x, s.train_y, [0, 1], 20)
    assert float(rows[0]["res_ratio"]) == pytest.approx(np.mean([p["ratio"] for p in per]), rel=1e-5)
    assert rows[0]["res_num_samples"] == "200"
    md = (out / "report.md").read_text()
    t = table_rows(md, "## Feature geometry")
    assert [c[0] for c in t] == ["a", "b", "paper (pretrained)", "paper (random-init)"]
    assert float(t[0][-1].split(" ± ")[0]) == pytest.approx(np.mean([p["spread"] for p in per]), abs=1e-3)
    assert_pngs(out, 1)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args, needle",
    [
        (["ablation", "--features", "/nonexistent/x.h5"], "does not exist"),
        (["ablation", "--features", "{a}", "--partition", "shard-3"], "--partition"),
        (["partitions", "--features", "{a}", "--head", "ova3"], "--head"),
        (["noise", "--features", "{a}", "--sym-rates", "0.3,1.0"], "--sym-rates"),
        (["noise", "--features", "{a}", "--asym-rates", "-0.1"], "--asym-rates"),
        (["noise", "--features", "{a}", "--sym-rates", "0", "--asym-rates", ""], "--sym-rates"),
        (["participation", "--features", "{a}", "--rates", "0"], "--rates"),
        (["ablation", "--features", "{a}", "--recipe", "fancy"], "--recipe"),
        (["ablation", "--features", "{a}", "--seeds", "x"], "--seeds"),
        (["geometry", "--features", "/nonexistent/x.h5"], "does not exist"),
    ],
)
def test_bad_input_one_line(stores, tmp_path, args, needle):
    args = [a.replace("{a}", str(stores["a"])) for a in args]
    res = bench(*args, "--out", tmp_path / "bad")
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert "Traceback" not in res.output
