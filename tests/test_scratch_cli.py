"""End-to-end runs of ``fedhead scratch`` on tiny subsets of the shared datasets, and bad input."""

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cli

SHARED = Path("/work/shared/datasets")
MNIST = SHARED / "mnist"
CIFAR = SHARED / "cifar10"
KWS = SHARED / "speech_commands"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    # one intra-op thread: on a shared 2-core machine two threads spin against each other (much slower)
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)


def run(*args):
    return runner.invoke(cli.app, ["scratch", *map(str, args)])


def rows(out):
    with open(out / "rounds.csv") as f:
        return list(csv.DictReader(f))


def check_rundir(out, n_rows):
    for name in ("config.json", "rounds.csv", "summary.json", "clients.csv"):
        assert (out / name).exists(), name
    r = rows(out)
    assert len(r) == n_rows
    for row in r:
        assert 0.0 <= float(row["accuracy"]) <= 1.0
        assert int(float(row["bytes_total"])) > 0
    return r


needs_mnist = pytest.mark.skipif(not MNIST.exists(), reason="shared MNIST copy not present")


@needs_mnist
@pytest.mark.parametrize("algo", ["fedavg", "fedova"])
def test_fedavg_fedova_end_to_end(tmp_path, algo):
    out = tmp_path / algo
    res = run(
        algo,
        "--dataset",
        "mnist",
        "--data-dir",
        MNIST,
        "--clients",
        10,
        "--participation",
        0.3,
        "--subset",
        300,
        "--test-subset",
        200,
        "--rounds",
        2,
        "--local-epochs",
        1,
        "--out",
        out,
    )
    assert res.exit_code == 0, res.output
    r = check_rundir(out, 2)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["partition"] == "shard" and cfg["partition_params"]["distinct_labels"] is True
    with open(out / "clients.csv") as f:
        clients = list(csv.DictReader(f))
    assert len(clients) == 10 and all(c["num_classes"] == "2" for c in clients)
    if algo == "fedova":
        # 3 clients x 2 held labels: 6 binary networks, each sent up and down once
        assert r[0]["members"] == "6"
        assert clients[0]["fedova_trains"] == "1"
    s = json.loads((out / "summary.json").read_text())
    assert "last5_accuracy" in s


@needs_mnist
def test_fedova_single_label_clients(tmp_path):
    # zipf-like mix is hard to force; shard without distinct labels and 1 shard/client gives 1 label each
    res = run(
        "fedova",
        "--dataset",
        "mnist",
        "--data-dir",
        MNIST,
        "--clients",
        10,
        "--partition",
        "shard",
        "--distinct-labels",
        "--shards-per-client",
        1,
        "--subset",
        200,
        "--rounds",
        1,
        "--out",
        tmp_path / "x",
    )
    assert res.exit_code == 2
    assert "every client holds a single label" in res.output
    assert len(res.output.strip().splitlines()) == 1


@needs_mnist
def test_fedova_warns_about_one_label_clients(tmp_path):
    out = tmp_path / "warn"
    res = run(
        "fedova",
        "--dataset",
        "mnist",
        "--data-dir",
        MNIST,
        "--clients",
        10,
        "--partition",
        "dirichlet",
        "--alpha",
        0.05,
        "--min-size",
        2,
        "--participation",
        1.0,
        "--subset",
        200,
        "--test-subset",
        100,
        "--rounds",
        1,
        "--local-epochs",
        1,
        "--out",
        out,
    )
    assert res.exit_code == 0, res.output
    with open(out / "clients.csv") as f:
        clients = list(csv.DictReader(f))
    single = [c for c in clients if c["num_classes"] == "1"]
    for c in single:
        assert c["fedova_trains"] == "0"
        assert f"client {c['client']} holds one label" in res.output
    members = int(rows(out)[0]["members"])
    assert members == sum(int(c["num_classes"]) for c in clients if c["num_classes"] != "1")


@needs_mnist
def test_fedabc_reports_pfl_and_drift(tmp_path):
    for algo in ("fedabc", "fedavg"):
        out = tmp_path / algo
        extra = (
            [
                "--partition",
                "dirichlet",
                "--alpha",
                0.1,
                "--clients",
                20,
                "--participation",
                0.5,
                "--batch-size",
                64,
                "--optimizer",
                "sgd",
                "--lr",
                0.01,
                "--momentum",
                0.9,
                "--weight-decay",
                1e-5,
                "--model",
                "fedabc-mlp",
                "--local-test-size",
                50,
            ]
            if algo == "fedavg"
            else []
        )
        res = run(
            algo,
            "--dataset",
            "mnist",
            "--data-dir",
            MNIST,
            "--subset",
            1000,
            "--test-subset",
            300,
            "--rounds",
            2,
            "--local-epochs",
            1,
            "--min-size",
            5,
            *extra,
            "--out",
            out,
        )
        assert res.exit_code == 0, res.output
        r = check_rundir(out, 2)
        for row in r:
            assert 0 <= float(row["pfl_accuracy"]) <= 1 and 0 <= float(row["drift_accuracy"]) <= 1
        assert "last5_pfl_accuracy" in res.output


@pytest.mark.skipif(not CIFAR.exists(), reason="shared CIFAR-10 copy not present")
def test_dnc_color_skew_end_to_end(tmp_path):
    out = tmp_path / "dnc"
    res = run(
        "dnc",
        "--dataset",
        "cifar10",
        "--data-dir",
        CIFAR,
        "--model",
        "fedabc-convnet",
        "--subset",
        200,
        "--test-subset",
        100,
        "--prepass-rounds",
        2,
        "--rounds",
        2,
        "--feature-epochs",
        1,
        "--finetune-epochs",
        1,
        "--local-epochs",
        1,
        "--batch-size",
        32,
        "--out",
        out,
    )
    assert res.exit_code == 0, res.output
    r = check_rundir(out, 4)
    assert [x["stage"] for x in r] == ["prepass", "prepass", "feature", "finetune"]
    s = json.loads((out / "summary.json").read_text())
    split = s["split_layer"]
    assert 1 <= split <= 4 and "split layer" in res.output
    with open(out / "divergence.csv") as f:
        div = list(csv.DictReader(f))
    assert len(div) == 2 * 5 and (out / "divergence.png").stat().st_size > 0
    full, feat, fine = (int(float(r[i]["bytes_total"])) for i in (0, 2, 3))
    assert feat + fine == full  # every layer travels exactly once over a feature + fine-tune pair
    assert 0 < feat < full and float(r[3]["lr"]) == pytest.approx(1e-3 * 0.9 * 0.5)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["data_info"]["gray_fraction_per_client"] == pytest.approx([0.95, 0.05], abs=0.01)
    # given split layer
    res = run(
        "dnc",
        "--dataset",
        "cifar10",
        "--data-dir",
        CIFAR,
        "--model",
        "fedabc-convnet",
        "--subset",
        60,
        "--test-subset",
        20,
        "--prepass-rounds",
        0,
        "--split-layer",
        2,
        "--rounds",
        1,
        "--feature-epochs",
        1,
        "--finetune-epochs",
        1,
        "--out",
        tmp_path / "dnc2",
    )
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "dnc2" / "summary.json").read_text())["split_layer"] == 2


@pytest.mark.skipif(not KWS.exists(), reason="shared Speech Commands copy not present")
def test_kws_end_to_end(tmp_path):
    out = tmp_path / "kws"
    res = run(
        "fedova",
        "--dataset",
        "speech-commands",
        "--data-dir",
        KWS,
        "--clients",
        10,
        "--participation",
        0.2,
        "--subset",
        200,
        "--test-subset",
        50,
        "--rounds",
        2,
        "--local-epochs",
        1,
        "--out",
        out,
    )
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"] == "kws-cnn" and cfg["in_shape"] == [1, 50, 16]
    check_rundir(out, 2)


@pytest.mark.skipif(not KWS.exists(), reason="shared Speech Commands copy not present")
def test_kws_speakers_are_the_natural_clients(tmp_path):
    """--partition natural on Speech Commands: one client per training speaker (the file-name prefix)."""
    import re

    from fedhead.scratch.data import load_dataset, subsample

    base = ["fedavg", "--dataset", "speech-commands", "--data-dir", KWS, "--partition", "natural", "--subset", 200,
            "--test-subset", 50, "--participation", 0.1, "--rounds", 1, "--local-epochs", 1]  # fmt: skip
    data = load_dataset("speech-commands", KWS)
    kept = subsample(data.train_y, 200, __import__("numpy").random.default_rng(0))
    speakers = {data.client_names[i] for i in data.train_clients[kept]}
    assert all(re.fullmatch("[0-9a-f]{8}", s) for s in speakers) and len(data.client_names) == 139
    res = run(*base, "--clients", 1, "--out", tmp_path / "bad")
    assert res.exit_code != 0 and f"Use --clients {len(speakers)}." in res.output, res.output
    res = run(*base, "--clients", len(speakers), "--seeds", "0,1", "--out", tmp_path / "bad")  # 2 subsets
    assert res.exit_code != 0 and "'--subset' parameter" in res.output and "for seed 1" in res.output, res.output
    out = tmp_path / "kws"
    res = run(*base, "--clients", len(speakers), "--out", out)
    assert res.exit_code == 0, res.output
    sizes = sorted(int(r["size"]) for r in rows_of(out / "clients.csv"))
    want = __import__("numpy").unique(data.train_clients[kept], return_counts=True)[1]
    assert sizes == sorted(want.tolist())


def rows_of(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["bogus", "--dataset", "mnist", "--data-dir", "/tmp"], "'ALGO' parameter"),
        (["fedavg", "--dataset", "mnst", "--data-dir", "/tmp"], "Did you mean mnist"),
        (["fedavg", "--dataset", "mnist", "--data-dir", "/tmp", "--model", "vgg"], "'--model' parameter"),
        (["fedavg", "--dataset", "mnist", "--data-dir", "/nonexistent/x"], "'--data-dir' parameter"),
        (["fedavg", "--dataset", "mnist", "--data-dir", "/tmp", "--participation", "0"], "'--participation'"),
        (["fedavg", "--dataset", "mnist", "--data-dir", "/tmp", "--alpha", "0.3"], "does not apply"),
        (["dnc", "--dataset", "mnist", "--data-dir", "/tmp", "--clients", "3"], "'--clients' parameter"),
        (["fedavg", "--dataset", "mnist", "--data-dir", str(MNIST), "--model", "kws-cnn"], "mfcc input"),
    ],
)
def test_bad_input_one_line(args, needle):
    res = run(*args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.output


def test_extract_registry_dataset_digits(tmp_path):
    """Datasets other than the shared copies come through extract.datasets (sklearn digits needs no files)."""
    out = tmp_path / "digits"
    res = run(
        "fedavg",
        "--dataset",
        "digits",
        "--data-dir",
        tmp_path,
        "--clients",
        5,
        "--participation",
        1.0,
        "--partition",
        "iid",
        "--rounds",
        2,
        "--local-epochs",
        1,
        "--batch-size",
        32,
        "--out",
        out,
    )
    assert res.exit_code == 0, res.output
    r = check_rundir(out, 2)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["in_shape"] == [1, 8, 8] and cfg["data_info"]["loader"] == "extract.datasets"
    assert float(r[-1]["accuracy"]) > 0.2  # 10 classes; two rounds of Adam on 8x8 digits beat chance
