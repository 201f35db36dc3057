"""Personalisation (fedhead.core.personal, fedhead.core.personalize): each method against what it is by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhead.core.clientacc import local_test_sets
from fedhead.core.closedform import accumulate, ridge_solve
from fedhead.core.engine import OptimConfig
from fedhead.core.heads import create_head
from fedhead.core.partitions import class_counts
from fedhead.core.personal import (
    RidgeKernel,
    balanced_test_set,
    create_personalizer,
    personal_summary,
    prior_bias,
)
from fedhead.core.personalize import ClientData, Setting, personal_head, personal_heads, personalize_clients
from fedhead.federation.clients import holdout

C, D, K = 4, 6, 5


def _data(seed: int = 0, n: int = 400, nt: int = 200, val: float = 0.2) -> ClientData:
    """Gaussian classes, clients skewed to two classes each (90%), local test sets and a drift set."""
    rng = np.random.default_rng(seed)
    mu = rng.normal(size=(C, D)) * 1.5
    y = rng.integers(0, C, n)
    x = (mu[y] + rng.normal(size=(n, D))).astype(np.float32)
    yt = rng.integers(0, C, nt)
    xt = (mu[yt] + rng.normal(size=(nt, D))).astype(np.float32)
    home = np.where(rng.random(n) < 0.9, y % K, rng.integers(0, K, n))  # client k holds classes k, k+C mostly
    parts = [np.flatnonzero(home == k) for k in range(K)]
    vparts = None
    if val:
        parts, vparts = holdout(parts, y, val, seed)
    counts = class_counts(parts, y, C)
    ones = lambda a: torch.cat([torch.as_tensor(a), torch.ones(len(a), 1)], 1)  # noqa: E731
    return ClientData(
        x=ones(x), labels=torch.as_tensor(y), parts=parts, val_parts=vparts, counts=counts, totals=counts.sum(0),
        test_x=ones(xt), test_y=torch.as_tensor(yt), tests=local_test_sets(counts, yt, seed),
        drift=balanced_test_set(yt, 10, seed), raw=torch.as_tensor(x), raw_test=torch.as_tensor(xt), ids=list(range(K)),
    )  # fmt: skip


SETTING = Setting("softmax", {}, OptimConfig(name="sgd", lr=0.1, weight_decay=0.0, momentum=0.0), batch_size=16)


def _theta(seed: int = 1) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(seed).normal(size=(C, D + 1)), dtype=torch.float32)


def _count(scores: np.ndarray, y: np.ndarray) -> int:
    return int((scores.argmax(1) == y).sum())


def test_prior_is_the_bayes_correction_by_hand():
    data, theta = _data(), _theta()
    a = 0.3
    got = personalize_clients(create_personalizer("prior", prior_smoothing=a), theta, data, SETTING)
    logits = (data.test_x.double() @ theta.double().T).numpy()
    yt = data.test_y.numpy()
    n, tot = data.counts.astype(float), data.totals.astype(float)
    for k in range(K):
        shift = np.log((n[k] + a) / (n[k].sum() + a * C)) - np.log((tot + a) / (tot.sum() + a * C))
        idx = data.tests.of(k)
        assert got.correct[k] == _count(logits[idx] + shift, yt[idx])
        assert got.correct_global[k] == _count(logits[idx], yt[idx])
        assert got.drift[k] == _count(logits[data.drift] + shift, yt[data.drift])
    assert np.allclose(prior_bias(data.counts, data.totals, a)[2], np.log((n[2] + a) / (n[2].sum() + a * C))
                       - np.log((tot + a) / (tot.sum() + a * C)))  # fmt: skip
    # the personal model file's head: the shift in the bias column scores the same
    heads = personal_heads(create_personalizer("prior", prior_smoothing=a), theta, data, SETTING, [3])
    idx = data.tests.of(3)
    assert _count((data.test_x[idx] @ heads[3].T).numpy(), yt[idx]) == got.correct[3]


def test_none_and_zero_epochs_are_the_global_head():
    data, theta = _data(), _theta()
    for name in ("none", "finetune", "ditto"):
        got = personalize_clients(create_personalizer(name, personal_epochs=0), theta, data, SETTING)
        assert np.array_equal(got.correct, got.correct_global), name
        assert np.array_equal(got.drift, got.drift_global), name
    heads = personal_heads(create_personalizer("finetune", personal_epochs=0), theta, data, SETTING, [0, 4])
    assert all(torch.equal(h, theta) for h in heads.values())


def test_finetune_moves_towards_the_local_labels():
    data, theta = _data(), _theta()
    got = personalize_clients(create_personalizer("finetune", personal_epochs=5), theta, data, SETTING)
    s = personal_summary(got.sizes, got.correct, got.correct_global)
    assert s["pfl_accuracy"] > s["pfl_accuracy_global"] + 0.1  # a random global head, clients with two classes


def test_local_is_training_on_the_client_alone():
    """Client k's local head depends on its own rows only: the same head with every other client's data removed
    (and their features replaced), and the engine's vectorised form equals its plain torch loop."""
    data, theta = _data(), _theta()
    method = create_personalizer("local", personal_epochs=3)
    k = 2
    full = personal_heads(method, theta, data, SETTING, [k])[k]
    alone = _data()
    alone.parts = [p if j == k else p[:0] for j, p in enumerate(alone.parts)]
    others = np.setdiff1d(np.arange(len(alone.labels)), alone.parts[k])
    alone.x[others] = torch.randn(len(others), D + 1)
    alone.counts = class_counts(alone.parts, alone.labels.numpy(), C)
    assert torch.allclose(personal_heads(method, theta, alone, SETTING, [k])[k], full, atol=1e-6)
    loop = Setting(**{**SETTING.__dict__, "backend": "loop"})
    assert torch.allclose(personal_heads(method, theta, data, loop, [k])[k], full, atol=1e-5)
    # it starts from zero, not from the global head
    zero = personal_heads(create_personalizer("local", personal_epochs=0), theta, data, SETTING, [k])[k]
    assert not zero.any()
    got = personalize_clients(method, theta, data, SETTING)
    idx = data.tests.of(k)
    assert got.correct[k] == _count((data.test_x[idx] @ full.T).numpy(), data.test_y[idx].numpy())


def _global(data: ClientData, solver) -> object:
    raw = data.raw
    everyone = [np.concatenate(data.parts)]
    return accumulate(raw, data.labels, everyone, C, cof=False, **solver.message_kwargs(D))


@pytest.mark.parametrize("rows", [None, 5])  # clients larger than D+1 (the primal form), smaller (the dual form)
def test_closed_form_ridge_equals_the_pooled_float64_solve(rows):
    data = _data()
    if rows:
        data.parts = [p[:rows] for p in data.parts]
        data.counts = class_counts(data.parts, data.labels.numpy(), C)
    lam, beta = 0.5, 2.0
    solver = create_head("ridge", ridge_lambda=lam)
    glob = _global(data, solver)
    phi = np.c_[data.raw.double().numpy(), np.ones(len(data.labels))]
    Y = np.eye(C)[data.labels.numpy()]
    every = np.concatenate(data.parts)
    G, B = phi[every].T @ phi[every], phi[every].T @ Y[every]
    kernel = RidgeKernel(glob, lam)
    phit = torch.as_tensor(np.c_[data.raw_test.double().numpy(), np.ones(len(data.test_y))])
    total = float(len(every))
    idx = [torch.as_tensor(p) for p in data.parts]
    n = max(len(p) for p in data.parts)
    pad = torch.stack([torch.cat([i, i.new_zeros(n - len(i))]) for i in idx])
    mask = torch.stack([torch.arange(n) < len(i) for i in idx])
    sp = kernel.spectrum(torch.as_tensor(phi)[pad], data.labels[pad], mask)
    assert (sp.glob is None) == bool(rows)
    bs = torch.tensor([beta * len(p) / total for p in data.parts], dtype=torch.float64)
    r, base = kernel.both(phit)
    got = sp.scores(sp.project(r), base[None], bs).numpy()
    for k, p in enumerate(data.parts):
        b = float(bs[k])
        A = phi[p].T @ phi[p] + b * (G + lam * np.eye(D + 1))
        theta = np.linalg.solve(A, phi[p].T @ Y[p] + b * B)  # [D+1, C]
        assert np.allclose(got[k], phit.numpy() @ theta, rtol=1e-8, atol=1e-8)
        # the explicit solve the model file uses
        assert np.allclose(personal_head(solver, glob, data, k, b).numpy(), theta.T, rtol=1e-9, atol=1e-9)


def test_closed_form_counts_with_a_given_beta_and_the_chosen_one():
    data = _data()
    solver = create_head("ridge", ridge_lambda=0.5)
    glob = _global(data, solver)
    theta = ridge_solve(glob, 0.5, False).float()
    got = personalize_clients(create_personalizer("closed-form", personal_beta=2.0), theta, data, SETTING,
                              statistics=glob, solver=solver)  # fmt: skip
    yt = data.test_y.numpy()
    total = float(glob.counts.sum())
    for k in range(K):
        head = personal_head(solver, glob, data, k, 2.0 * len(data.parts[k]) / total).numpy()
        idx = data.tests.of(k)
        phit = np.c_[data.raw_test.double().numpy()[idx], np.ones(len(idx))]
        assert got.correct[k] == _count(phit @ head.T, yt[idx])
    assert np.all(got.beta == 2.0)
    chosen = personalize_clients(create_personalizer("closed-form"), theta, data, SETTING, statistics=glob,
                                 solver=solver)  # fmt: skip
    assert set(chosen.beta.tolist()) <= {0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0}


def test_closed_form_lda_equals_a_pooled_solve_over_weighted_data():
    """Beta weight 2 on the global statistics = the global rows counted twice: LDA's own solve of the client's rows
    plus every row twice is the personal head."""
    data = _data()
    solver = create_head("lda")
    glob = _global(data, solver)
    k = 1
    every = np.concatenate(data.parts)
    pooled = np.concatenate([data.parts[k], every, every])
    acc = accumulate(data.raw, data.labels, [pooled], C, cof=False, **solver.message_kwargs(D))
    want = solver.solve_statistics(acc)
    got = personal_head(solver, glob, data, k, 2.0)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def test_apfl_mixes_and_stays_within_its_range():
    data, theta = _data(), _theta()
    m = create_personalizer("apfl", personal_epochs=0, apfl_alpha=0.3)
    heads = personal_heads(m, theta, data, SETTING, [0])
    assert torch.allclose(heads[0], theta, atol=1e-6)  # v starts at the global head: any alpha mixes w with w
    got = personalize_clients(create_personalizer("apfl", personal_epochs=3), theta, data, SETTING)
    assert (got.correct <= got.sizes).all() and got.sizes.sum() > 0


def test_summary_pools_and_weighs_clients_once():
    s = personal_summary(np.array([10, 0, 30]), np.array([5, 0, 30]), np.array([5, 0, 15]), np.array([7, 0, 9]),
                         np.array([8, 0, 8]), 10)  # fmt: skip
    assert s["pfl_accuracy"] == pytest.approx(35 / 40)
    assert s["pfl_accuracy_global"] == pytest.approx(20 / 40)
    assert s["personal_accuracy_mean"] == pytest.approx(0.75)
    assert s["personal_gain_mean"] == pytest.approx(0.25)
    assert s["personal_improved"] == pytest.approx(0.5)
    assert s["drift_accuracy"] == pytest.approx(16 / 20)


def test_balanced_drift_set_has_every_class_equally():
    y = np.repeat(np.arange(5), [30, 30, 3, 30, 30])
    idx = balanced_test_set(y, 10, seed=4)
    assert np.array_equal(np.bincount(y[idx]), [10, 10, 3, 10, 10])
    assert np.array_equal(idx, balanced_test_set(y, 10, seed=4)) and len(set(idx)) == len(idx)


# ---------------------------------------------------------------- a run


def _run(tiny_store, out, **kw):
    import fedhead

    base = dict(features=str(tiny_store), clients=6, partition="dirichlet", alpha=0.3, min_size=5, rounds=3,
                out=str(out), plots=False)  # fmt: skip
    return fedhead.run(**{**base, **kw})


def test_a_run_reports_personal_fields_in_rounds_summary_and_personal_csv(tiny_store, tmp_path):
    import csv
    import json

    _run(tiny_store, tmp_path / "r", personalize="finetune", seeds=[0, 1])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["personalize"] == "finetune"
    rows = list(csv.DictReader(open(tmp_path / "r" / "rounds.csv")))
    per_client = list(csv.DictReader(open(tmp_path / "r" / "personal.csv")))
    for seed in (0, 1):
        last = [r for r in rows if int(r["seed"]) == seed][-1]
        mine = [r for r in per_client if int(r["seed"]) == seed]
        pooled = sum(int(r["personal_correct"]) for r in mine) / sum(int(r["test_samples"]) for r in mine)
        seed_summary = next(s for s in summary["per_seed"] if s["seed"] == seed)
        assert float(last["pfl_accuracy"]) == pytest.approx(pooled, abs=1e-6)
        assert seed_summary["pfl_accuracy"] == pytest.approx(pooled)
        glob = sum(int(r["global_correct"]) for r in mine) / sum(int(r["test_samples"]) for r in mine)
        assert seed_summary["pfl_accuracy_global"] == pytest.approx(glob)
        # the global head's pooled accuracy on the local test sets: the per-client protocol the run reports
        assert float(last["local_accuracy_mean"]) == pytest.approx(
            np.mean([int(r["global_correct"]) / int(r["test_samples"]) for r in mine]), abs=1e-6
        )
    assert summary["pfl_accuracy"] == pytest.approx(np.mean([s["pfl_accuracy"] for s in summary["per_seed"]]))


def test_personalisation_is_redone_the_same_on_resume(tiny_store, tmp_path, monkeypatch):
    """A run stopped after its last round's checkpoint (in the personalisation) personalises on --resume, with the
    closed-form statistics exchanged again and the same beta chosen."""
    import json

    from fedhead.federation.job import HeadJob

    first = tmp_path / "a"
    _run(tiny_store, first, head="ridge", rounds=1, personalize="closed-form")
    again = tmp_path / "b"
    real = HeadJob._personalize

    def stop(self, seed):
        raise KeyboardInterrupt  # as a SIGINT there

    monkeypatch.setattr(HeadJob, "_personalize", stop)
    with pytest.raises(KeyboardInterrupt):
        _run(tiny_store, again, head="ridge", rounds=1, personalize="closed-form")
    assert not (again / "summary.json").exists()
    monkeypatch.setattr(HeadJob, "_personalize", real)
    _run(tiny_store, again, head="ridge", rounds=1, personalize="closed-form", resume=True)
    a = json.loads((first / "summary.json").read_text())
    b = json.loads((again / "summary.json").read_text())
    assert a["pfl_accuracy"] == b["pfl_accuracy"] and a["drift_accuracy"] == b["drift_accuracy"]
    assert (first / "personal.csv").read_text() == (again / "personal.csv").read_text()


def test_a_plugin_method_runs_with_its_own_parameter(tiny_store, tmp_path):
    import json

    from fedhead import Param, Personalizer, register_personal
    from fedhead.core.personal import PERSONAL
    from fedhead.infra.errors import Interval

    @register_personal("test-twice", Param("twice_epochs", 2, Interval(0, None, integer=True), "epochs"))
    class Twice(Personalizer):
        """Local epochs from the global head, twice_epochs of them."""

        needs_linear = True

        @property
        def epochs(self) -> int:
            return int(self.params["twice_epochs"])

    try:
        _run(tiny_store, tmp_path / "p", personalize="test-twice", twice_epochs=0)
        s = json.loads((tmp_path / "p" / "summary.json").read_text())
        assert s["pfl_accuracy"] == s["pfl_accuracy_global"]  # 0 epochs: the global head
    finally:
        PERSONAL.pop("test-twice", None)
