"""A model's life after training (issue 40, parts 1-2): --keep-statistics, fedhead update and fedhead forget are exact
for closed-form heads (equal to the runs over the union / without the clients), the card keeps a version history,
a removal leaves no file of the old version behind, an iterative head is retrained without the clients, and bad
input is one line with nothing half-written."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import one_line_error
from typer.testing import CliRunner

from cli import app
from extract.store import load_store, write_store
from fedhead.core.synthetic import write_synthetic
from fedhead.federation import versions
from fedhead.federation.clients import build_federation
from fedhead.federation.config import TrainConfig
from fedhead.federation.model import load_model
from fedhead.federation.train import run_training
from fedhead.infra.errors import FedheadError
from fedhead.lifecycle import retrain_without

runner = CliRunner()
HEADS = ["ridge", "lda", "qda", "ncm", "ridge-rf"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A union store U and its training rows split into A (two thirds) and B, every store with U's test split."""
    d = tmp_path_factory.mktemp("lifecycle")
    u = write_synthetic(d / "u.h5", num_classes=6, train_per_class=30, test_per_class=10, dim=12, seed=3)
    U = load_store(u)
    perm = np.random.default_rng(0).permutation(len(U.train_y))
    cut = 2 * len(perm) // 3

    def part(name, idx):
        idx = np.sort(idx)
        return write_store(d / name, train=(U.train_x[idx], U.train_y[idx]), test=(U.test_x, U.test_y),
                           class_names=list(U.info.class_names), attrs=dict(U.info.attrs))  # fmt: skip

    return {"U": u, "A": part("a.h5", perm[:cut]), "B": part("b.h5", perm[cut:]), "dir": d}


def train(store, out, head, **kw):
    base = dict(features=str(store), head=head, clients=5, partition="dirichlet", alpha=0.5, device="cpu",
                val_fraction=0.0)  # fmt: skip
    if kw.get("partition", "dirichlet") != "dirichlet":
        base.pop("alpha")
    return run_training(TrainConfig(**{**base, **kw}), out=out, progress=False)


def kept(run) -> dict:
    card = json.loads((Path(run) / "model-seed0.json").read_text())
    return versions.read_statistics(card, Path(run) / "model-seed0.json").tensors()


def same_stats(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-9)


def scores(run, store):
    return load_model(run).decision_function(load_store(store).test_x)


@pytest.mark.parametrize("head", HEADS)
def test_update_equals_a_run_on_the_union_and_forget_equals_a_run_without(stores, tmp_path, head):
    a = tmp_path / "a"
    train(stores["A"], a, head, keep_statistics=True)
    versions.update_model(a, stores["B"], partition="iid", clients=3)
    train(stores["U"], tmp_path / "u", head, keep_statistics=True, partition="iid", clients=4)
    same_stats(kept(a), kept(tmp_path / "u"))  # update(A, B) = a run on A and B, to float64 rounding
    np.testing.assert_allclose(scores(a, stores["U"]), scores(tmp_path / "u", stores["U"]), rtol=1e-5, atol=1e-5)
    x = load_store(stores["U"]).test_x  # the open-set score (lda: Mahalanobis from the new sums) follows the update
    np.testing.assert_allclose(load_model(a).unknown_score(x), load_model(tmp_path / "u").unknown_score(x), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    # forget(A+B, B) = the run on A alone: B's clients got ids 5, 6, 7
    versions.forget_model(a, "5,6,7", stores["B"])
    train(stores["A"], tmp_path / "a-only", head, keep_statistics=True)
    same_stats(kept(a), kept(tmp_path / "a-only"))
    np.testing.assert_allclose(scores(a, stores["U"]), scores(tmp_path / "a-only", stores["U"]), rtol=1e-5, atol=1e-5)


def test_forget_equals_the_run_that_never_had_the_clients_and_scrubs_the_old_version(stores, tmp_path):
    run = tmp_path / "run"
    train(stores["U"], run, "lda", keep_statistics=True, clients=8, noise="symmetric", noise_rate=0.2)
    before = json.loads((run / "model-seed0.json").read_text())
    old_files = [before["weights_file"], before["statistics"]["file"]]
    change = versions.forget_model(run, "2,5", stores["U"])
    never = tmp_path / "never"
    train(stores["U"], never, "lda", keep_statistics=True, clients=8, noise="symmetric", noise_rate=0.2,
          withdrawn_clients="2,5")  # fmt: skip
    same_stats(kept(run), kept(never))
    card = json.loads((run / "model-seed0.json").read_text())
    assert [v["action"] for v in card["versions"]] == ["train", "forget"] and change.version == 2
    assert card["versions"][1]["clients"] == [[2, 2], [5, 5]] and card["versions"][1]["recomputed"] is True
    assert card["versions"][1]["weights_sha256"] == card["weights_file_sha256"]
    assert card["statistics"]["members"] == [[0, 1], [3, 4], [6, 7]]
    assert not any((run / f).exists() for f in old_files)  # no file of version 1 (which holds their data) stays
    assert (os.stat(run / card["statistics"]["file"]).st_mode & 0o777) == 0o600
    rows = (run / "clients.csv").read_text().splitlines()
    assert rows[3].startswith("2,0,0,") and rows[6].startswith("5,0,0,")  # their label counts emptied
    torch.testing.assert_close(torch.load(run / "head-seed0.pt"), torch.load(never / "head-seed0.pt"), atol=1e-6,
                               rtol=1e-6)  # fmt: skip


def test_withdrawn_clients_keep_every_other_clients_samples(stores):
    store = load_store(stores["U"])
    cfg = TrainConfig(features=str(stores["U"]), clients=6, partition="dirichlet", alpha=0.3, val_fraction=0.2,
                      noise="symmetric", noise_rate=0.3).resolved()  # fmt: skip
    cut = TrainConfig(**{**cfg.to_dict(), "withdrawn_clients": "1,4"}).resolved()
    a = build_federation(store, cfg, 0, cfg.partition, cfg.partition_params)
    b = build_federation(store, cut, 0, cut.partition, cut.partition_params)
    for k in range(6):
        want = 0 if k in (1, 4) else len(a.parts[k])
        assert len(b.parts[k]) == want and len(b.val_parts[k]) == (0 if k in (1, 4) else len(a.val_parts[k]))
        if k not in (1, 4):
            np.testing.assert_array_equal(a.parts[k], b.parts[k])
    np.testing.assert_array_equal(a.labels, b.labels)


def test_statistics_sent_again_equal_the_recomputed_ones(stores, tmp_path):
    run, again = tmp_path / "run", tmp_path / "again"
    train(stores["U"], run, "ridge", keep_statistics=True)
    shutil.copytree(run, again)
    store = load_store(stores["U"])
    cfg = TrainConfig.from_toml(run / "config.toml").resolved()
    fed = build_federation(store, cfg, 0, cfg.partition, cfg.partition_params)
    files = []
    for k in (1, 3):  # each withdrawing client writes its own message again from its own data
        p = fed.parts[k]
        files.append(versions.client_statistics_file(again, store.train_x[p], fed.labels[p], tmp_path / f"c{k}.st"))
    versions.forget_model(run, "1,3", stores["U"])
    versions.forget_model(again, "1,3", statistics_files=files)
    same_stats(kept(run), kept(again))
    card = json.loads((again / "model-seed0.json").read_text())
    assert card["versions"][-1]["recomputed"] is False


def test_iterative_forget_retrains_without_the_clients(stores, tmp_path):
    run = tmp_path / "run"
    train(stores["U"], run, "ova2", rounds=2, local_epochs=1, init="ridge")
    change = retrain_without(run, "0,3", tmp_path / "forgot", progress=False)
    never = tmp_path / "never"
    train(stores["U"], never, "ova2", rounds=2, local_epochs=1, init="ridge", withdrawn_clients="0,3")
    torch.testing.assert_close(torch.load(tmp_path / "forgot" / "head-seed0.pt"), torch.load(never / "head-seed0.pt"))
    card = json.loads((tmp_path / "forgot" / "model-seed0.json").read_text())
    assert [v["action"] for v in card["versions"]] == ["train", "forget"] and change.version == 2
    assert card["versions"][1]["method"] == "retrain" and card["versions"][1]["seconds"] > 0
    assert card["versions"][0]["clients"] == [[0, 4]]


def test_a_crash_mid_change_leaves_the_old_version_whole(stores, tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(stores["A"], run, "ridge", keep_statistics=True)
    card_before = (run / "model-seed0.json").read_bytes()
    x = load_store(stores["U"]).test_x
    want = load_model(run).decision_function(x)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(versions, "write_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        versions.update_model(run, stores["B"], clients=2)
    assert (run / "model-seed0.json").read_bytes() == card_before
    np.testing.assert_array_equal(load_model(run).decision_function(x), want)
    monkeypatch.undo()
    versions.update_model(run, stores["B"], clients=2)  # the next change goes through (the orphan is replaced)
    assert json.loads((run / "model-seed0.json").read_text())["versions"][-1]["version"] == 2


def test_cli_update_and_forget(stores, tmp_path):
    run = tmp_path / "run"
    res = runner.invoke(app, ["train", "--features", str(stores["A"]), "--head", "ridge", "--clients", "4",
                              "--keep-statistics", "--device", "cpu", "--out", str(run)])  # fmt: skip
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["update", "--model", str(run), "--features", str(stores["B"]), "--partition",
                              "dirichlet", "--alpha", "0.5", "--clients", "2"])  # fmt: skip
    assert res.exit_code == 0 and "took in clients 4-5: version 2" in res.stdout, res.output
    res = runner.invoke(app, ["forget", "--model", str(run), "--clients", "4", "--features", str(stores["B"])])
    assert res.exit_code == 0 and "forgot clients 4: version 3" in res.stdout, res.output
    card = json.loads((run / "model-seed0.json").read_text())
    assert [v["action"] for v in card["versions"]] == ["train", "update", "forget"]
    assert card["versions"][1]["config"]["partition"] == "dirichlet" and card["versions"][1]["first_client"] == 4


def test_bad_input_is_one_line_and_changes_nothing(stores, tmp_path):
    run, plain = tmp_path / "run", tmp_path / "plain"
    train(stores["A"], run, "ridge", keep_statistics=True)
    train(stores["A"], plain, "ridge")
    other = tmp_path / "other.h5"
    S = load_store(stores["B"])
    write_store(other, train=(S.train_x, S.train_y), test=(S.test_x, S.test_y), class_names=list(S.info.class_names),
                attrs={**S.info.attrs, "encoder": "another-encoder"})  # fmt: skip
    snapshot = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    cases = [
        (["update", "--model", str(plain), "--features", str(stores["B"])], "kept its statistics"),
        (["forget", "--model", str(run), "--clients", "9", "--features", str(stores["A"])], "client 9 is not in it"),
        (["update", "--model", str(run), "--features", str(other)], "encoder 'another-encoder'"),
        (["forget", "--model", str(run), "--clients", "1", "--features", str(stores["B"])], "must be the store"),
        (["forget", "--model", str(run), "--clients", "1"], "'--features' parameter"),
        (["update", "--model", str(run), "--features", str(stores["B"]), "--clients", "0"], "'--clients'"),
        (["forget", "--model", str(run), "--clients", "0,1,2,3,4", "--features", str(stores["A"])], "leave the model"),
    ]
    for args, text in cases:
        line = one_line_error(runner.invoke(app, args))
        assert text in line, (args, line)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == snapshot
    for kw, text in [
        (dict(head="cof", keep_statistics=True), "does not apply to head cof"),
        (dict(head="ridge", keep_statistics=True, dp_noise_multiplier=1.0, dp_clip=1.0, dp_delta=1e-5), "differential"),
        (dict(head="ridge", clients=4, withdrawn_clients="0,1,2,3"), "not all of them"),
        (dict(head="ridge", clients=4, withdrawn_clients="4"), "0 .. 3"),
    ]:
        with pytest.raises(FedheadError, match=text):
            TrainConfig(features=str(stores["A"]), **kw).resolved()


def test_bench_lifecycle_quick(tmp_path):
    """The bench's changed models equal the runs it times them against (its own difference columns)."""
    res = runner.invoke(app, ["bench", "lifecycle", "--out", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "b" / "lifecycle.json").read_text())["rows"]
    assert [r["head"] for r in rows][:2] == ["ridge", "lda"] and rows[2]["head"].startswith("ova2")
    for r in rows[:2]:
        assert r["update_max_logit_diff"] < 1e-4 and r["forget_max_logit_diff"] < 1e-4, r
        assert r["update_s"] > 0 and r["forget_s"] > 0 and r["union_run_s"] > 0
    assert "| ridge |" in (tmp_path / "b" / "lifecycle.md").read_text()
