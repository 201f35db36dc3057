"""A client uses its own head (``--personal-models``): ``fedhead train --personalize METHOD --personal-models K``
writes ``model-seed<S>-client<K>.json`` (+ weights) for the listed clients, whose head scores on the client's local
test set exactly what personal.csv reports; ``fedhead.load_model(run, client=K)`` and ``fedhead predict --client K``
read it; personal.png is the histogram of the per-client gains."""

import csv
import json

import numpy as np
import pytest
from typer.testing import CliRunner

import cli
import fedhead
from extract.store import load_store
from fedhead.core.clientacc import local_test_sets
from fedhead.federation import outputs
from fedhead.federation.config import TrainConfig
from fedhead.federation.train import run_training
from fedhead.infra.errors import FedheadError

runner = CliRunner()


def _train(store, out, head, personalize, models="0,2", **kw):
    opts = {"rounds": 2} if head in ("ova2", "softmax") else {}
    cfg = TrainConfig(features=str(store), head=head, clients=6, partition="dirichlet", personalize=personalize,
                      personal_models=models, **opts, **kw)  # fmt: skip
    return run_training(cfg, out=out, progress=False)


def _local_tests(run_dir, store, seed: int = 0):
    """Each client's local test set, drawn again from clients.csv's training label counts (as the run drew it)."""
    C = store.info.num_classes
    rows = [r for r in csv.DictReader(open(run_dir / "clients.csv")) if int(r.get("seed", seed)) == seed]
    counts = np.zeros((len(rows), C), dtype=np.int64)
    for r in rows:
        for kv in r["class_counts"].split():
            c, n = kv.split(":")
            counts[int(r["client"]), int(c)] = int(n)
    return local_test_sets(counts, store.test_y, seed)


def _personal_rows(run_dir) -> dict:
    return {int(r["client"]): r for r in csv.DictReader(open(run_dir / "personal.csv")) if int(r["seed"]) == 0}


def _check_scores(run_dir, store_path, clients=(0, 2)) -> None:
    """Each written client's model scores exactly personal.csv's count on the client's local test set."""
    s = load_store(store_path)
    tests, rows = _local_tests(run_dir, s), _personal_rows(run_dir)
    for k in clients:
        m = fedhead.load_model(run_dir, client=k)
        idx = tests.of(k)
        assert len(idx) == int(rows[k]["test_samples"])
        got = int((m.predict(s.test_x[idx]) == m.classes_[s.test_y[idx]]).sum())
        assert got == int(rows[k]["personal_correct"]), (k, got, rows[k])
        card = json.loads((run_dir / f"model-seed0-client{k}.json").read_text())
        assert card["client"] == k and card["personalize"] == rows[k]["method"]
        assert card["metrics"]["local_test_correct"] == got
        assert card["metrics"]["local_test_accuracy"] == pytest.approx(float(rows[k]["personal_accuracy"]), abs=1e-5)


def test_finetune_writes_the_listed_clients_models_that_score_personal_csv(tiny_store, tmp_path, monkeypatch):
    monkeypatch.setenv(outputs.DRAW_ENV, "")  # draw the figures: personal.png among them
    res = _train(tiny_store, tmp_path / "run", "ova2", "finetune")
    run = res.run_dir
    written = sorted(p.name for p in run.glob("model-seed0-client*"))
    assert written == ["model-seed0-client0.json", "model-seed0-client0.safetensors", "model-seed0-client2.json",
                       "model-seed0-client2.safetensors"]  # fmt: skip
    _check_scores(run, tiny_store)
    card = json.loads((run / "model-seed0-client2.json").read_text())
    assert card["personal"]["method"] == "finetune" and card["personal"]["params"]["personal_epochs"] == 5
    assert "beta" not in card["personal"]
    glob = json.loads((run / "model-seed0.json").read_text())  # the global model's card is as before
    assert "client" not in glob and "personalize" not in glob
    assert "client=2" in repr(fedhead.load_model(run, client=2))
    assert (run / "personal.png").stat().st_size > 0

    # predict --client: the client's model; a client whose model was not written: one line, non-zero exit
    r = runner.invoke(cli.app, ["predict", "--model", str(run), "--client", "2", "--features", str(tiny_store),
                                "--out", str(tmp_path / "p.csv")])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "client 2's personal head (finetune)" in " ".join(r.stdout.split())  # the console wraps its lines
    r = runner.invoke(cli.app, ["predict", "--model", str(run), "--client", "3", "--features", str(tiny_store),
                                "--out", str(tmp_path / "p.csv")])  # fmt: skip
    assert r.exit_code != 0 and "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "'--client'" in lines[0] and "Got 3" in lines[0], r.stderr
    assert "--personal-models 3" in lines[0]
    r = runner.invoke(cli.app, ["export", "--model", str(run), "--client", "5", "--out", str(tmp_path / "m.onnx")])
    assert r.exit_code != 0 and "'--client'" in r.stderr and "Got 5" in r.stderr, r.output


def test_closed_form_ridge_models_carry_the_chosen_beta(tiny_store, tmp_path):
    res = _train(tiny_store, tmp_path / "run", "ridge", "closed-form")
    _check_scores(res.run_dir, tiny_store)
    rows = _personal_rows(res.run_dir)
    card = json.loads((res.run_dir / "model-seed0-client0.json").read_text())
    assert card["personal"]["beta"] == pytest.approx(float(rows[0]["beta"]))


@pytest.mark.parametrize("head", ["ova2", "qda"])  # the prior in the bias column; a qda head's as logit_shift
def test_prior_models_score_personal_csv(head, tiny_store, tmp_path):
    res = _train(tiny_store, tmp_path / "run", head, "prior", models="all")
    assert len(list(res.run_dir.glob("model-seed0-client*.json"))) == 6
    _check_scores(res.run_dir, tiny_store, clients=range(6))


def test_personal_models_are_checked_in_one_line(tiny_store):
    def refused(**kw) -> str:
        with pytest.raises(FedheadError) as e:
            TrainConfig(features=str(tiny_store), **{"clients": 6, **kw}).resolved()
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "client 6" in refused(personalize="finetune", personal_models="0,6")
    assert "1,000" in refused(personalize="prior", head="lda", clients=1001, personal_models="all")
    assert "personalize" in refused(personal_models="0")  # the Python API names the keyword
    assert "'personal_models'" in refused(personalize="finetune", personal_models="0,0")
    TrainConfig(features=str(tiny_store), clients=6, personalize="finetune", personal_models="all").resolved()
