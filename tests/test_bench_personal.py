"""``fedhead bench personal`` end to end on a tiny synthetic store: every requested method and column in the
table, the table's numbers are the runs' summary.json numbers, the paper's numbers beside; bad input in one line."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cli
from fedhead.bench.papers import PAPER_FEDABC_T1, PAPER_FEDABC_T2
from fedhead.bench.personal import DEFAULT_METHODS, HIDDEN

runner = CliRunner()


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from fedhead.core.synthetic import write_synthetic

    # 200 samples a class: 20 Dirichlet(0.1) clients of at least 10 samples are drawn at once
    path = tmp_path_factory.mktemp("personal-store") / "s.h5"
    return write_synthetic(
        path, num_classes=10, train_per_class=200, test_per_class=20, dim=16, latent=8, spread=1.0, seed=0
    )


def bench(*args):
    return runner.invoke(cli.app, ["bench", "personal", *map(str, args)])


def table(md: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the first markdown table after the line starting with ``heading``."""
    lines = md.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[i + 1 :]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    return rows[0], rows[2:]


def test_quick_table_holds_every_method_and_alpha_with_the_runs_numbers(store, tmp_path):
    out = tmp_path / "rep"
    res = bench("--features", store, "--quick", "--rounds", "2", "--alphas", "0.1,1.0", "--out", out)
    assert res.exit_code == 0, (res.output, res.exception)
    md = (out / "report.md").read_text()
    hdr, rows = table(md, "## Personalised heads")
    assert [r[0] for r in rows] == list(DEFAULT_METHODS)
    assert hdr[:2] == ["method", "global head"] and hdr[-2:] == ["personal s", "wall s"]
    for a in ("Dir(0.1)", "Dir(1)"):
        assert [f"{a} PFL", f"{a} global", f"{a} gain", f"{a} drift"] == hdr[hdr.index(f"{a} PFL") :][:4]
    heads = {r[0]: r[1] for r in rows}
    assert heads["fedrod"] == "bsm" and heads["closed-form"] == "ridge" and heads["finetune"] == "ova2"

    saved = json.loads((out / "table.json").read_text())["rows"]
    assert {(r["method"], r["column"]) for r in saved} == {
        (m, a) for m in DEFAULT_METHODS for a in ("Dir(0.1)", "Dir(1)")
    }
    for r in saved:
        run = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert run["personalize"] == r["personalize"] and run["head"] == r["global_head"]
        assert run["seeds"] == [0] and run["rounds"] == (1 if r["method"] == "closed-form" else 2)
        for k in ("pfl_accuracy", "pfl_accuracy_global", "pfl_gain", "drift_accuracy", "personal_s"):
            assert r[k] == run[k], (r["run_name"], k)
        assert r["wall_seconds"] == run["wall_seconds"]
        # ... and the markdown shows them
        row = next(x for x in rows if x[0] == r["method"])
        at = hdr.index(f"{r['column']} PFL")
        assert row[at : at + 4] == [
            f"{100 * run['pfl_accuracy']:.1f}",
            f"{100 * run['pfl_accuracy_global']:.1f}",
            f"{100 * run['pfl_gain']:+.1f}",
            f"{100 * run['drift_accuracy']:.1f}",
        ]
        assert run["pfl_gain"] == pytest.approx(run["pfl_accuracy"] - run["pfl_accuracy_global"])
    none = [r for r in saved if r["method"] == "none"]
    assert all(r["pfl_gain"] == 0 for r in none)

    # the paper's CIFAR-10 numbers beside the rows that stand for them, and the plain caveat
    for heading, paper in (
        ("## Beside FedABC Table 1", PAPER_FEDABC_T1),
        ("## Beside FedABC Table 2", PAPER_FEDABC_T2),
    ):
        hdr2, prow = table(md, heading)
        by = {r[0]: r for r in prow}
        assert by["FedAvg"][1] == "finetune" and by["FedRod"][1] == "fedrod" and by["Local only"][1] == "local"
        assert by["FedABC"][hdr2.index("Dir(0.1) paper")] == f"{paper[('CIFAR-10', 0.1)][-1]:.1f}"
        assert by["FedPer"][hdr2.index("Dir(1) ours")] == HIDDEN
        assert "not run" in by["FedProx"][hdr2.index("Dir(0.1) ours")]
    assert "not comparable in level, only in shape" in md and "not comparable in level" in res.output
    for name in ("table.csv", "results.csv", "bench.json", "personal-pfl.png"):
        assert (out / name).exists(), name


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--methods", "finetune,bogus"], "'--methods'"),
        (["--methods", "fedper"], "hidden layer"),
        (["--preset", "cross-continent"], "'--preset'"),
        (["--alphas", "0"], "'--alphas'"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(store, tmp_path, args, needle):
    out = tmp_path / "bad"
    res = bench("--features", store, "--quick", "--out", out, *args)
    assert res.exit_code != 0
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.output
    assert not out.exists()


def test_presets_shape_the_federation_and_the_command_line_wins(tmp_path):
    from fedhead.bench.grid import Common
    from fedhead.bench.personal import PRESETS, columns_of, personal_cells

    def cells(preset, given=(), train=None, participation=None, alphas=None, quick=False, methods=("finetune",)):
        common = Common("personal", [0], 2, PRESETS[preset].clients, tmp_path, dict(train or {}), set(given))
        cols = columns_of(PRESETS[preset], alphas, quick)
        return personal_cells(common, "s.h5", PRESETS[preset], cols, list(methods), "ova2", participation)

    got, fed = cells("table1", methods=("finetune", "fedrod", "closed-form", "finetune+fedprox"))
    assert fed == {"clients": 20, "participation": 0.5}
    assert [c.labels["column"] for c in got][::4] == ["Dir(0.1)", "Dir(0.3)", "Dir(0.5)", "Dir(1)"]
    heads = {c.labels["method"]: c.cfg.head for c in got}
    assert heads == {"finetune": "ova2", "fedrod": "bsm", "closed-form": "ridge", "finetune+fedprox": "ova2"}
    assert {c.cfg.personalize for c in got} == {"finetune", "fedrod", "closed-form"}
    assert {c.cfg.prox_mu for c in got if c.labels["method"] == "finetune+fedprox"} == {0.01}
    assert [c.labels["column"] for c in cells("table1", quick=True)[0]] == ["Dir(0.1)"]

    got, fed = cells("cross-device")
    assert fed == {"clients": 1000, "participation": 1.0, "clients_per_round": 10}
    assert all(c.cfg.clients_per_round == 10 and c.cfg.partition_params["min_size"] == 0 for c in got)
    got, _ = cells("cross-silo", alphas="0.5")
    assert [c.labels["column"] for c in got] == ["shard-1", "shard-2", "Dir(0.5)"]
    assert got[0].cfg.partition == "shard" and got[0].cfg.partition_params["shards_per_client"] == 1

    # an option given on the command line wins over the preset's and the row's
    got, fed = cells("table1", given={"clients_per_round"}, train={"clients_per_round": 5})
    assert fed == {"clients": 20, "participation": 1.0, "clients_per_round": 5}
    assert all(c.cfg.clients_per_round == 5 and c.cfg.participation == 1.0 for c in got)
    got, _ = cells("table1", given={"prox_mu"}, train={"prox_mu": 0.1}, methods=("finetune+fedprox",))
    assert {c.cfg.prox_mu for c in got} == {0.1}
