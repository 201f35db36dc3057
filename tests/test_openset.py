"""Open-set rejection (issue 40, part 4): the scores of fedhead.core.openset against direct numpy computations, the
same scores from the run's own head and from the model file, ``fedhead predict --reject / --reject-rate`` and its
bad input, and model cards written before the open-set pieces existed."""

import csv
import hashlib
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import cli
import fedhead
from extract.store import load_store
from fedhead.core import openset
from fedhead.core.closedform import accumulate
from fedhead.core.heads import create_head
from fedhead.federation.clients import build_federation, prepare
from fedhead.federation.config import TrainConfig
from fedhead.federation.train import run_training, validate_config
from fedhead.infra.errors import FedheadError

runner = CliRunner()
HEADS = ("lda", "qda", "softmax", "ova2")


def _cfg(store, head):
    opts = {} if head in ("lda", "qda") else {"center": True, "scale": "rms", "rounds": 2}
    return TrainConfig(features=str(store), head=head, clients=4, partition="shard", device="cpu", **opts)


@pytest.fixture(scope="module")
def runs(tiny_store, tmp_path_factory):
    """One finished run per head on the tiny store (4 clients, shards; the default 10% validation part)."""
    root = tmp_path_factory.mktemp("openset")
    return {h: run_training(_cfg(tiny_store, h), out=root / h, progress=False).run_dir for h in HEADS}


def _one_line_error(res) -> str:
    assert res.exit_code != 0, res.output
    assert "Traceback" not in res.output, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def _predict(run, store, out, *args):
    return runner.invoke(cli.app, ["predict", "--model", str(run), "--features", str(store), "--out", str(out), *args])


# ---------------------------------------------------------------- the scores themselves


def test_logit_scores_equal_their_numpy_formulas():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(50, 7)) * 3
    t = torch.as_tensor(z)
    sig = 1 / (1 + np.exp(-z))
    soft = np.exp(z - z.max(1, keepdims=True))
    soft /= soft.sum(1, keepdims=True)
    want = {
        "max_sigmoid": 1 - sig.max(1),
        "msp": 1 - soft.max(1),
        "energy": -(z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))),
        "max_logit": -z.max(1),
    }
    for kind, w in want.items():
        got = openset.unknown_scores(kind, t, None, {}).numpy()
        assert np.allclose(got, w, rtol=1e-12, atol=1e-12), kind
    counts = torch.as_tensor([3.0, 1.0, 0.0, 2.0, 5.0, 1.0, 8.0])
    prior = np.log(np.maximum(counts.numpy(), 1) / counts.sum().item())
    got = openset.unknown_scores("neg_loglik", t, None, {"class_counts": counts}).numpy()
    assert np.allclose(got, -(z - prior).max(1))


def test_lda_statistics_and_mahalanobis_equal_the_explicit_distance(tiny_store):
    """The lda solve's open-set statistics are the class means and the (shrunk) pooled within-class covariance, and
    the score is the smallest squared Mahalanobis distance to a class mean."""
    s = load_store(tiny_store)
    x, y = torch.as_tensor(s.train_x, dtype=torch.float64), torch.as_tensor(s.train_y)
    head = create_head("lda", lda_shrinkage=1e-2)
    C, D = s.info.num_classes, x.shape[1]
    acc = accumulate(x, y, [np.arange(len(y))], C, cof=False, **head.message_kwargs(D))
    got = head.openset_statistics(acc)
    xn, yn = s.train_x.astype(np.float64), s.train_y
    mu = np.stack([xn[yn == c].mean(0) for c in range(C)])
    within = sum((xn[yn == c] - mu[c]).T @ (xn[yn == c] - mu[c]) for c in range(C)) / (len(yn) - C)
    sigma = within + 1e-2 * np.trace(within) / D * np.eye(D)
    assert np.allclose(got["class_means"].numpy(), mu)
    assert np.allclose(got["precision"].numpy(), np.linalg.inv(sigma), rtol=1e-8, atol=1e-10)
    xt = s.test_x.astype(np.float64)
    d = np.stack([((xt - mu[c]) * np.linalg.solve(sigma, (xt - mu[c]).T).T).sum(1) for c in range(C)], 1)
    score = openset.unknown_scores("mahalanobis", torch.zeros(len(xt), C), torch.as_tensor(xt), got).numpy()
    assert np.allclose(score, d.min(1), rtol=1e-8)
    # a class no client holds is left out of the minimum
    counts = got["class_counts"].clone()
    counts[int(d.argmin(1)[0])] = 0
    left = openset.mahalanobis(torch.as_tensor(xt[:1]), got["class_means"], got["precision"], counts).item()
    assert math.isclose(left, np.sort(d[0])[1], rel_tol=1e-8)


def test_every_registered_head_declares_a_known_default_score():
    from fedhead.core.heads import HEADS as REGISTRY

    for name, spec in REGISTRY.items():
        assert openset.default_score(spec.cls) in openset.SCORES, name
    assert openset.default_score(REGISTRY["ova2"].cls) == "max_sigmoid"
    assert openset.default_score(REGISTRY["softmax"].cls) == "energy"
    assert openset.default_score(REGISTRY["lda"].cls) == "mahalanobis"
    assert openset.default_score(REGISTRY["qda"].cls) == "neg_loglik"


# ---------------------------------------------------------------- the model file


@pytest.mark.parametrize("head", HEADS)
def test_scores_from_the_run_head_equal_the_model_files(head, runs, tiny_store):
    """The run's own head (head-seed0.pt) on the run's prepared features gives the scores the loaded model gives."""
    run = runs[head]
    m = fedhead.load_model(run)
    s = load_store(tiny_store)
    theta = torch.load(run / "head-seed0.pt")
    z = prepare(s.test_x, m.stats, "cpu")
    logits = create_head(head).logits(theta, z) if theta.ndim == 3 else z @ theta.T
    for kind in openset.applicable(m.openset_tensors):
        own = openset.unknown_scores(kind, logits, z[:, :-1], m.openset_tensors).numpy()
        assert np.allclose(m.unknown_score(s.test_x, kind), own, rtol=1e-6, atol=1e-6), kind
    assert m.default_score == openset.default_score(create_head(head).__class__)
    if head == "lda":  # the file's statistics: the distance computed from its class means and covariance
        mu, sigma = m.openset_tensors["class_means"].numpy(), np.linalg.inv(m.openset_tensors["precision"].numpy())
        xt = z[:, :-1].double().numpy()
        d = np.stack([((xt - c) * np.linalg.solve(sigma, (xt - c).T).T).sum(1) for c in mu], 1).min(1)
        assert np.allclose(m.unknown_score(s.test_x), d, rtol=1e-6)


def _validation_scores(run, store, head):
    """The unknown scores of the run's validation part (known classes), recomputed from the store."""
    s = load_store(store)
    cfg = validate_config(_cfg(store, head), s)
    fed = build_federation(s, cfg, 0, cfg.partition, cfg.partition_params)
    m = fedhead.load_model(run)
    return m.unknown_score(s.train_x[np.concatenate(fed.val_parts)])


@pytest.mark.parametrize("head", ["lda", "ova2"])
def test_reject_rate_rejects_that_fraction_of_the_validation_part(head, runs, tiny_store):
    val = _validation_scores(runs[head], tiny_store, head)
    card = json.loads((runs[head] / "model-seed0.json").read_text())
    assert card["openset"]["validation_samples"] == len(val)
    m = fedhead.load_model(runs[head])
    for rate in (0.0, 0.1, 0.25, 0.5):
        share = float((val > m.reject_threshold(rate)).mean())
        assert abs(share - rate) <= 0.01 + 1.0 / len(val), (rate, share)


def test_predict_reject_writes_unknown_where_the_score_is_above_the_threshold(runs, tiny_store, tmp_path):
    run = runs["ova2"]
    m = fedhead.load_model(run)
    s = load_store(tiny_store)
    score = m.unknown_score(s.test_x)
    t = float(np.median(score))
    assert _predict(run, tiny_store, tmp_path / "all.csv").exit_code == 0
    r = _predict(run, tiny_store, tmp_path / "rej.csv", "--reject", repr(t))
    assert r.exit_code == 0, r.output
    plain = list(csv.DictReader(open(tmp_path / "all.csv")))
    rows = list(csv.DictReader(open(tmp_path / "rej.csv")))
    assert [r_["class_1"] == "unknown" for r_ in rows] == list(score > t)
    for a, b in zip(plain, rows):  # the probability columns and the other classes are kept
        assert a["probability_1"] == b["probability_1"] and a["class_2"] == b["class_2"]
        assert b["class_1"] in ("unknown", a["class_1"])
    assert np.allclose([float(r_["unknown_score"]) for r_ in rows], score, rtol=1e-5)
    n_rej = int((score > t).sum())
    assert f"rejected {n_rej} of {len(rows)}" in r.stdout and "a rejected input counts as wrong" in r.stdout
    r = _predict(run, tiny_store, tmp_path / "rate.csv", "--reject-rate", "0.2")
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(tmp_path / "rate.csv")))
    want = score > m.reject_threshold(0.2)
    assert [r_["class_1"] == "unknown" for r_ in rows] == list(want)


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--reject", "1.5"], "'--reject' parameter must be a finite number in the range of the 'max_sigmoid' score"),
        (["--reject", "nan"], "'--reject'"),
        (["--reject", "0.5", "--reject-rate", "0.1"], "at most one of --reject"),
        (["--reject-rate", "1"], "'--reject-rate'"),
        (["--reject-rate", "-0.1"], "'--reject-rate'"),
        (["--score", "maha"], "'--score'"),
        (["--score", "mahalanobis", "--reject", "3"], "needs the model's class_means"),
    ],
)
def test_bad_reject_inputs_are_one_line_and_write_no_csv(args, expect, runs, tiny_store, tmp_path):
    r = _predict(runs["ova2"], tiny_store, tmp_path / "p.csv", *args)
    assert expect in _one_line_error(r)
    assert not (tmp_path / "p.csv").exists()


def _old_card(run, tmp_path, drop_tensors: bool):
    """A copy of ``run``'s model as an earlier fedhead wrote it: no card 'openset' and (``drop_tensors``) no
    open-set tensors in the weights file."""
    card = json.loads((run / "model-seed0.json").read_text())
    card.pop("openset")
    tensors = load_file(str(run / "model-seed0.safetensors"))
    if drop_tensors:
        tensors = {k: v for k, v in tensors.items() if k not in openset.OPENSET_TENSORS}
    save_file(tensors, str(tmp_path / "model-seed0.safetensors"), metadata={"format": "fedhead-model"})
    card["weights_file_sha256"] = hashlib.sha256((tmp_path / "model-seed0.safetensors").read_bytes()).hexdigest()
    (tmp_path / "model-seed0.json").write_text(json.dumps(card))
    return tmp_path / "model-seed0.json"


def test_an_old_card_loads_and_its_missing_pieces_are_one_line(runs, tiny_store, tmp_path):
    card = _old_card(runs["lda"], tmp_path, drop_tensors=True)
    m = fedhead.load_model(card)
    s = load_store(tiny_store)
    assert m.default_score == "mahalanobis" and m.openset_tensors == {}
    assert np.array_equal(m.predict(s.test_x), fedhead.load_model(runs["lda"]).predict(s.test_x))
    assert m.unknown_score(s.test_x, "energy").shape == (len(s.test_y),)
    r = _predict(card, tiny_store, tmp_path / "p.csv", "--reject", "3")
    assert "needs the model's class_means, precision, class_counts" in _one_line_error(r)
    r = _predict(card, tiny_store, tmp_path / "p.csv", "--reject-rate", "0.1", "--score", "energy")
    line = _one_line_error(r)
    assert "'--reject-rate'" in line and "validation quantiles" in line and "--reject instead" in line
    assert not (tmp_path / "p.csv").exists()
    assert _predict(card, tiny_store, tmp_path / "p.csv", "--reject", "3", "--score", "energy").exit_code == 0


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda c: c["openset"].update(score="nope"), "'openset' is an object whose 'score'"),
        (lambda c: c["openset"]["validation_quantiles"].update(energy=[1.0, 0.0]), "validation_quantiles"),
        (lambda c: c.update(openset=[1]), "'openset' is an object"),
    ],
)
def test_a_hostile_openset_card_is_refused_in_one_line(edit, expect, runs, tmp_path):
    card = json.loads((runs["softmax"] / "model-seed0.json").read_text())
    edit(card)
    (tmp_path / "model-seed0.json").write_text(json.dumps(card))
    (tmp_path / "model-seed0.safetensors").write_bytes((runs["softmax"] / "model-seed0.safetensors").read_bytes())
    with pytest.raises(FedheadError, match=expect):
        fedhead.load_model(tmp_path)


def test_open_set_tensors_of_the_wrong_shape_are_refused_in_one_line(runs, tmp_path):
    tensors = load_file(str(runs["lda"] / "model-seed0.safetensors"))
    tensors["precision"] = tensors["precision"][:-1]
    save_file(tensors, str(tmp_path / "model-seed0.safetensors"), metadata={"format": "fedhead-model"})
    card = json.loads((runs["lda"] / "model-seed0.json").read_text())
    card["weights_file_sha256"] = hashlib.sha256((tmp_path / "model-seed0.safetensors").read_bytes()).hexdigest()
    (tmp_path / "model-seed0.json").write_text(json.dumps(card))
    with pytest.raises(FedheadError, match="precision"):
        fedhead.load_model(tmp_path)


# ---------------------------------------------------------------- fedhead bench openset


def test_bench_openset_scores_the_model_files_of_its_runs(tiny_store, tmp_path):
    """Half the classes known; the report's figures are the loaded model files' scores on the whole test split."""
    from fedhead.bench.openset import fpr_at_tpr, open_set_metrics

    out = tmp_path / "bench"
    r = runner.invoke(cli.app, ["bench", "openset", "--features", str(tiny_store), "--heads", "softmax,lda",
                                "--partitions", "iid", "--seeds", "0", "--clients", "4", "--rounds", "2",
                                "--out", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert {(x["head"], x["score"]) for x in rows} == {("softmax", "energy"), ("softmax", "msp"), ("lda", "mahalanobis"),
                                                       ("lda", "msp"), ("lda", "energy")}  # fmt: skip
    s = load_store(tiny_store)
    m = fedhead.load_model(out / "runs" / "lda-iid", seed=0)
    assert list(m.classes_) == list(s.info.class_names[:5])
    got = open_set_metrics(m, s.test_x, s.test_y, 5, "mahalanobis")
    row = next(x for x in rows if x["head"] == "lda" and x["score"] == "mahalanobis")
    assert math.isclose(float(row["auroc"]), got["auroc"]) and math.isclose(float(row["fpr95"]), got["fpr95"])
    assert "AUROC %" in (out / "report.md").read_text()
    # FPR at 95% TPR by hand: 20 known scores 0..19, unknown 10..29 -> the threshold 18 accepts 19 of 20 known
    # (95%) and the unknown 10..18: 9 of 20
    assert fpr_at_tpr(np.arange(20.0), np.arange(10.0, 30.0)) == pytest.approx(9 / 20)


def test_bench_openset_refuses_bad_input_in_one_line(tiny_store, tmp_path):
    for args, expect in ((["--known-fraction", "1"], "'--known-fraction'"), (["--heads", "nope"], "'--heads'"),
                         (["--partitions", "natural"], "'--partitions'")):  # fmt: skip
        r = runner.invoke(cli.app, ["bench", "openset", "--features", str(tiny_store), "--out", str(tmp_path / "o"),
                                    *args])  # fmt: skip
        assert expect in _one_line_error(r)


def test_a_resumed_closed_form_run_keeps_its_open_set_statistics(tiny_store, tmp_path, monkeypatch):
    """Cut after seed 0's solve (its checkpoint holds the solved unit): the resumed run's model of seed 0 still has
    the statistics the Mahalanobis score needs."""
    import fedhead.federation.job as J

    real, calls = J.HeadJob.round, {"n": 0}

    def dying(self, unit, rnd):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, unit, rnd)

    monkeypatch.setattr(J.HeadJob, "round", dying)
    cfg = TrainConfig(features=str(tiny_store), head="lda", clients=4, partition="shard", device="cpu", seeds=[0, 1])
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, out=tmp_path / "run", progress=False)
    monkeypatch.setattr(J.HeadJob, "round", real)
    res = run_training(cfg, out=tmp_path / "run", resume=True, progress=False)
    for seed in (0, 1):
        assert sorted(fedhead.load_model(res.run_dir, seed=seed).openset_tensors) == sorted(openset.OPENSET_TENSORS)
