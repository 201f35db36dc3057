"""``fedhead bench fft`` end to end on a random-init tiny CNN and scikit-learn's digits: a row per method and
partition, the retention computed from the runs' own summaries, a re-run that reuses every finished run without
training or loading anything, and bad ``--methods`` values refused in one line."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cli
from fedhead.bench import fft

runner = CliRunner()
TINY = ["--dataset", "digits", "--encoder", "test_efficientnet", "--no-pretrained", "--weights", "hub",
        "--image-size", "32", "--limit", "120", "--clients", "4", "--rounds", "2"]  # fmt: skip
GRID = ["--methods", "head,lora", "--partitions", "iid,shard-1"]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)


def bench(*args):
    return runner.invoke(cli.app, ["bench", "fft", *map(str, args)])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One tiny bench (the head path's feature store goes to ./cache: the test's own folder)."""
    root = tmp_path_factory.mktemp("fft")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("FEDHEAD_NO_PROGRESS", "1")
        mp.setenv("FEDHEAD_THREADS", "1")
        res = bench(*TINY, *GRID, "--out", root / "rep")
    assert res.exit_code == 0, (res.output, res.exception)
    return root, res.output


def md_rows(md: str, heading: str) -> list[list[str]]:
    lines = md.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[i + 1 :]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


@pytest.mark.slow
def test_every_method_and_partition_with_retention_from_the_runs_summaries(made):
    root, output = made
    out = root / "rep"
    for name in ("fft.csv", "fft.md", "fft.json", "fft.png", "bench.json", "times.json"):
        assert (out / name).is_file(), name
    md = (out / "fft.md").read_text()
    assert "## OvA-LP beside federated fine-tuning" in output and "| OvA-LP | shard-1 |" in output  # stdout
    cells = [(r[0], r[1]) for r in md_rows(md, "## OvA-LP beside")]
    assert cells == [("OvA-LP", "iid"), ("OvA-LP", "shard-1"), ("LoRA", "iid"), ("LoRA", "shard-1")]
    paper = md_rows(md, "## Beside the paper")
    assert [r[0] for r in paper] == ["OvA-LP", "LoRA"] and paper[0][2] == "95.9" and paper[0][6] == "0.3918"
    assert "## What is comparable" in md and "not comparable" in md.lower()

    saved = json.loads((out / "fft.json").read_text())
    rows = {(r["method"], r["partition"]): r for r in saved["rows"]}
    assert set(rows) == {(m, p) for m in ("head", "lora") for p in ("iid", "shard-1")}
    for m in ("head", "lora"):
        iid = json.loads((Path(rows[(m, "iid")]["run_dir"]) / "summary.json").read_text())
        non = json.loads((Path(rows[(m, "shard-1")]["run_dir"]) / "summary.json").read_text())
        want = non["per_seed"][0]["final_accuracy"] / iid["per_seed"][0]["final_accuracy"]
        assert rows[(m, "shard-1")]["retention"] == pytest.approx(want)
        assert rows[(m, "iid")]["retention"] == pytest.approx(1.0)
        assert rows[(m, "shard-1")]["final_accuracy"] == pytest.approx(non["final_accuracy"])
        assert rows[(m, "iid")]["acc95_round"] == iid["acc95_round"]
        method = next(x for x in saved["methods"] if x["method"] == m)
        assert method["retention_noniid_mean"] == pytest.approx(want)  # one non-IID partition run
    # bytes up per round: fine-tuning's trainable vector in float32; the head's from its own rounds.csv
    lora = rows[("lora", "iid")]
    assert lora["bytes_up_per_client"] == 4 * lora["trainable_parameters"]
    assert rows[("head", "iid")]["trainable_parameters"] == 10 * (256 + 1)  # test_efficientnet: 256 features


@pytest.mark.slow
def test_rerun_reuses_finished_runs_without_training(made, monkeypatch):
    root, _ = made
    out = root / "rep"
    monkeypatch.chdir(root)
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    assert len(stamps) == 4

    def boom(*a, **k):
        raise AssertionError("a finished run was trained or its encoder loaded again")

    monkeypatch.setattr(fft, "run_finetune", boom)
    monkeypatch.setattr(fft, "load_encoder", boom)
    res = bench(*TINY, *GRID, "--out", out)
    assert res.exit_code == 0, (res.output, res.exception)
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")} == stamps
    assert len(json.loads((out / "fft.json").read_text())["rows"]) == 4


def test_bad_methods_are_one_line_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value, words in (("head,bogus", "bogus"), ("", "needs a value")):
        res = bench(*TINY, "--methods", value, "--out", tmp_path / "rep")
        assert res.exit_code != 0
        lines = [x for x in res.output.splitlines() if x.strip()]
        assert len(lines) == 1 and "'--methods'" in lines[0] and words in lines[0], res.output
    res = bench(*TINY, "--partitions", "iid,shard-3", "--out", tmp_path / "rep")
    assert res.exit_code != 0 and "'--partitions'" in res.output
    assert not (tmp_path / "rep").exists()


def test_a_kind_this_install_lacks_is_left_out_by_default_and_refused_when_named(monkeypatch):
    monkeypatch.setattr(fft, "tuning_names", lambda: ["head", "lora", "prompt", "full"])
    names, missing = fft.parse_methods(None, fft.DEFAULT)
    assert names == ["head", "lora", "prompt", "full"] and missing == ["moe", "pfpt"]
    with pytest.raises(fft.FedheadError, match="'--methods' parameter .*--peft pfpt"):
        fft.parse_methods(["head,pfpt"], fft.DEFAULT)
    assert fft.parse_partitions(["shard-2"], fft.DEFAULT) == ["iid", "shard-2"]  # IID always: the reference
