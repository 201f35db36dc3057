"""FedABC's comparison set and FedOVA's data-sharing baseline on the scratch path: hand-checked aggregation
(FedPer, LG-FedAvg, FedRep, local), SCAFFOLD's control variates and FedProx's term against hand computations,
FedRoD's loss and heads, FedProx at mu 0 == FedAvg, --share-fraction (bytes and mixing), every new algorithm
through the real CLI, and resume of a personalised run. Tiny data; one intra-op thread."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import cut_after
from torch import nn
from typer.testing import CliRunner

import cli
import fedhead.scratch.runner as R
from fedhead.federation.rundir import read_state
from fedhead.scratch import algorithms as A
from fedhead.scratch import engine as E
from fedhead.scratch.models import DualHead, create_model, weight_layers
from fedhead.scratch.runner import CHECKPOINT, ScratchConfig, run_scratch

MNIST = Path("/work/shared/datasets/mnist")
needs_mnist = pytest.mark.skipif(not MNIST.exists(), reason="shared MNIST copy not present")
TIMING = ("client_ms", "server_ms")
runner = CliRunner()


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)


# ---------------------------------------------------------------- a two-layer toy federation


class Tiny(nn.Module):
    """body: Linear 2 -> 2 (6 values), head: Linear 2 -> 3 (9 values)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.head = nn.Linear(2, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x.flatten(1))))


def toy_ctx(sizes=(1, 2, 3), **cfg):
    """Three clients holding ``sizes`` samples of a 2-feature, 3-class toy set (inputs [N, 1, 1, 2])."""
    model = Tiny()
    n = sum(sizes)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 1, 2, generator=g)
    y = torch.tensor([i % 3 for i in range(n)])
    bounds = np.cumsum((0,) + tuple(sizes))
    parts = [np.arange(bounds[k], bounds[k + 1]) for k in range(len(sizes))]
    base = dict(
        clients=len(sizes),
        head_layers=1,
        body_epochs=1,
        local_epochs=3,
        batch_size=64,
        optimizer="sgd",
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,
        backend="vmap",
        prox_mu=0.0,
        eval_batch=4,
    )
    return SimpleNamespace(
        cfg=SimpleNamespace(**{**base, **cfg}),
        model=model,
        layers=weight_layers(model),
        parts=parts,
        device=torch.device("cpu"),
        gen=torch.Generator().manual_seed(1),
        x_train=x,
        y_train=y,
        data=SimpleNamespace(to_float=lambda b: b.float()),
        rng=np.random.default_rng(0),
        local_test=None,
        client_counts=None,
    )


def filled(shape, start):
    return torch.arange(start, start + math.prod(shape), dtype=torch.float32).reshape(shape)


def toy_state():
    return {
        "body.weight": filled((2, 2), 0),
        "body.bias": filled((2,), 10),
        "head.weight": filled((3, 2), 20),
        "head.bias": filled((3,), 30),
    }


def personal_of(names, k=3):
    """Client k's personal tensors: the global value + 100 (k + 1), so every client's differ."""
    st = toy_state()
    return {n: torch.stack([st[n] + 100 * (j + 1) for j in range(k)]) for n in names}


def trained_for(owner):
    """Hand-made results of local training: member m's tensors are its start state x (m + 2)."""
    st = toy_state()
    return E.TrainResult(
        {n: torch.stack([-(m + 2) * st[n] for m in range(len(owner))]) for n in st},
        torch.zeros(len(owner)),
        np.array([4, 2]),
    )


BODY = {"body.weight", "body.bias"}
HEAD = {"head.weight", "head.bias"}


@pytest.mark.parametrize(
    "name,personal", [("fedper", HEAD), ("fedrep", HEAD), ("lg-fedavg", BODY), ("local", BODY | HEAD)]
)
def test_personalised_aggregation_hand_numbers(name, personal):
    """Clients 0 and 2 (1 and 3 samples) of 3 train; shared tensors become (1 w_0 + 3 w_2) / 4, personal ones
    stay with their client (client 1's untouched), the global copy of a personal tensor is never changed."""
    ctx = toy_ctx()
    algo = A.create_algorithm(name)
    algo.setup(ctx)
    assert algo.names == personal
    state = toy_state()
    algo.personal = personal_of(sorted(personal))
    before = {n: p.clone() for n, p in algo.personal.items()}
    plan = algo.configure(ctx, state, 1, np.array([0, 2]))
    for n in state:  # the start: personal tensors from the client, shared ones from the server
        want = torch.stack([before[n][0], before[n][2]]) if n in personal else torch.stack([state[n], state[n]])
        assert torch.equal(plan.start[n], want), n
    trained = trained_for(plan.owner)  # member 0 (client 0): -2 x state; member 1 (client 2): -3 x state
    new = algo.aggregate(ctx, state, plan, trained)
    for n in state:
        if n in personal:
            assert torch.equal(new[n], state[n]), n
            assert torch.equal(algo.personal[n][0], -2 * state[n]) and torch.equal(algo.personal[n][2], -3 * state[n])
            assert torch.equal(algo.personal[n][1], before[n][1]), n
        else:  # (1 x -2 s + 3 x -3 s) / 4 = -11/4 s
            assert torch.allclose(new[n], -2.75 * state[n]), n
    shared_values = sum(state[n].numel() for n in state if n not in personal)
    assert algo.member_bytes(ctx, plan, trained) == 4 * shared_values  # only shared tensors travel (fp32)
    assert {"fedper": 24, "fedrep": 24, "lg-fedavg": 36, "local": 0}[name] == 4 * shared_values


def test_personal_accuracy_scores_sample_i_with_client_i_mod_k():
    ctx = toy_ctx()
    algo = A.create_algorithm("fedper")
    algo.setup(ctx)
    state = {n: p / 10 for n, p in toy_state().items()}
    algo.personal = {n: torch.randn(3, *state[n].shape, generator=torch.Generator().manual_seed(2)) for n in HEAD}
    x = torch.randn(7, 1, 1, 2, generator=torch.Generator().manual_seed(3))
    got = algo.predict(ctx, state, x)
    for i in range(7):
        k = i % 3
        own = {**state, **{n: algo.personal[n][k] for n in HEAD}}
        want = torch.func.functional_call(ctx.model, own, (x[i : i + 1],))[0]
        assert torch.allclose(got[i], want, atol=1e-6), i


def test_fedrep_trains_the_head_then_the_body():
    """local_epochs 3, body_epochs 1, one full batch per epoch: two SGD steps on the head with the body frozen,
    then one on the body with the new head frozen (plain torch autograd as the reference)."""
    ctx = toy_ctx(local_epochs=3, body_epochs=1)
    algo = A.create_algorithm("fedrep")
    algo.setup(ctx)
    state = {n: p / 50 for n, p in toy_state().items()}
    algo.personal = {n: torch.stack([state[n] * (1 + j) for j in range(3)]) for n in HEAD}
    plan = algo.configure(ctx, state, 1, np.array([1, 2]))
    res = algo.train(ctx, plan)
    assert list(res.steps) == [3, 3]
    for m, k in enumerate((1, 2)):
        p = {n: plan.start[n][m].clone().requires_grad_(True) for n in state}
        x, y = ctx.x_train[ctx.parts[k]], ctx.y_train[ctx.parts[k]]
        for phase in (HEAD, HEAD, BODY):
            loss = F.cross_entropy(torch.func.functional_call(ctx.model, p, (x,)), y)
            grads = torch.autograd.grad(loss, [p[n] for n in sorted(phase)])
            with torch.no_grad():
                for n, g in zip(sorted(phase), grads):
                    p[n] -= 0.1 * g
        for n in state:
            assert torch.allclose(res.params[n][m], p[n].detach(), atol=1e-6), (k, n)
        assert not torch.equal(res.params["body.weight"][m], plan.start["body.weight"][m])
        assert not torch.equal(res.params["head.weight"][m], plan.start["head.weight"][m])


# ---------------------------------------------------------------- SCAFFOLD and FedProx


def test_scaffold_control_variates_hand_numbers():
    """Option II with SGD momentum 0.5 (step size lr / (1 - m) = 0.2): c_k+ = c_k - c + (theta - w_k) / (steps_k
    x 0.2), c += sum_k (c_k+ - c_k) / K, and the next round's members get c - c_k."""
    ctx = toy_ctx(momentum=0.5)
    algo = A.create_algorithm("scaffold")
    algo.setup(ctx)
    assert algo.step_size == pytest.approx(0.2)
    theta = toy_state()
    names = list(theta)
    plan = algo.configure(ctx, theta, 1, np.array([0, 2]))
    assert all(torch.equal(plan.grad_offset[n], torch.zeros(2, *theta[n].shape)) for n in names)  # c = c_k = 0
    trained = trained_for(plan.owner)  # w_0 = -2 theta after 4 steps, w_2 = -3 theta after 2
    new = algo.aggregate(ctx, theta, plan, trained)
    assert all(torch.allclose(new[n], -2.75 * theta[n]) for n in names)  # the model: plain FedAvg
    flat = torch.cat([theta[n].reshape(-1) for n in names])
    c0 = (flat + 2 * flat) / (4 * 0.2)  # (theta - w_0) / (4 x 0.2)
    c2 = (flat + 3 * flat) / (2 * 0.2)
    c = (c0 + c2) / 3  # K = 3 clients, one of them idle
    assert torch.allclose(algo.var.ck[0, 0], c0) and torch.allclose(algo.var.ck[2, 0], c2)
    assert torch.equal(algo.var.ck[1], torch.zeros_like(algo.var.ck[1]))
    assert torch.allclose(algo.var.c[0], c)
    assert algo.member_bytes(ctx, plan, trained) == 2 * 4 * flat.numel()  # the model and a variate, fp32
    plan2 = algo.configure(ctx, new, 2, np.array([0, 1]))
    got = torch.cat([plan2.grad_offset[n].reshape(2, -1) for n in names], dim=1)
    assert torch.allclose(got[0], c - c0) and torch.allclose(got[1], c)
    # round 2: client 0 again (3 steps), client 1 for the first time (5 steps)
    trained2 = E.TrainResult(
        {n: torch.stack([new[n] - 1.0, new[n] + 2.0]) for n in names}, torch.zeros(2), np.array([3, 5])
    )
    algo.aggregate(ctx, new, plan2, trained2)
    c0b = c0 - c + 1.0 / (3 * 0.2)
    c1b = 0 - c - 2.0 / (5 * 0.2)
    assert torch.allclose(algo.var.ck[0, 0], c0b, atol=1e-5) and torch.allclose(algo.var.ck[1, 0], c1b, atol=1e-5)
    assert torch.allclose(algo.var.c[0], c + ((c0b - c0) + c1b) / 3, atol=1e-5)
    # the checkpointed state restores the variates exactly
    again = A.create_algorithm("scaffold")
    again.setup(ctx)
    again.load_state_dict(algo.state_dict())
    assert torch.equal(again.var.c, algo.var.c) and torch.equal(again.var.ck, algo.var.ck)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_gradient_terms_hand_numbers(backend):
    """With a zero loss the only gradient is FedProx's mu (w - w0) plus SCAFFOLD's offset o: plain SGD (lr 0.1)
    gives w1 = w0 - 0.1 o, w2 = w1 - 0.1 (mu (w1 - w0) + o) = w0 - 0.2 o + mu 0.01 o."""
    model = Tiny()
    params = E.stack_copies(toy_state(), 2)
    off = {n: torch.stack([torch.full_like(p, 1.0), torch.full_like(p, -2.0)]) for n, p in toy_state().items()}
    zero = lambda out, y, valid, aux: out.float().sum(dim=(1, 2)) * 0.0  # noqa: E731
    x = torch.randn(4, 1, 1, 2)
    for mu in (0.0, 0.5):
        r = E.train_members(
            model,
            params,
            [np.arange(2), np.arange(2, 4)],
            {},
            zero,
            x_all=x,
            y_all=torch.zeros(4, dtype=torch.long),
            to_float=lambda b: b.float(),
            epochs=2,
            batch_size=2,
            optim=E.OptimSpec("sgd", 0.1),
            rng=np.random.default_rng(0),
            backend=backend,
            prox_mu=mu,
            grad_offset=off,
        )
        for n in params:
            want = params[n] - 0.2 * off[n] + mu * 0.01 * off[n]
            assert torch.allclose(r.params[n], want, atol=1e-5), (mu, n)


def test_fedprox_and_scaffold_terms_agree_across_backends():
    model = create_model("cnn", (1, 8, 8), 3)
    params = E.init_params(model, torch.Generator().manual_seed(1), count=2)
    off = {n: 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) for n, p in params.items()}
    x = torch.randint(0, 256, (20, 1, 8, 8), dtype=torch.uint8)
    y = torch.randint(0, 3, (20,))
    res = {}
    for backend in ("vmap", "loop"):
        res[backend] = E.train_members(
            model,
            params,
            [np.arange(0, 7), np.arange(7, 20)],
            {},
            E.softmax_ce,
            x_all=x,
            y_all=y,
            to_float=lambda b: b.float() / 255,
            epochs=2,
            batch_size=4,
            optim=E.OptimSpec("sgd", 0.05, momentum=0.9),
            rng=np.random.default_rng(0),
            backend=backend,
            prox_mu=0.3,
            grad_offset=off,
        )
    for n in params:
        assert torch.allclose(res["vmap"].params[n], res["loop"].params[n], atol=1e-5), n


# ---------------------------------------------------------------- FedRoD


def test_fedrod_loss_hand_numbers():
    # one member, C = 2, counts (3, 1): log counts added to the generic logits
    g, p = torch.tensor([0.5, -0.5]), torch.tensor([1.0, 0.0])
    out = torch.cat([g, p]).view(1, 1, 4)
    aux = {"log_counts": torch.log(torch.tensor([[3.0, 1.0]]))}
    y, valid = torch.tensor([[1]]), torch.tensor([[True]])
    bsm = -math.log(math.exp(-0.5) * 1 / (math.exp(0.5) * 3 + math.exp(-0.5) * 1))
    ce = -math.log(math.exp(0.0) / (math.exp(1.0) + math.exp(0.0)))
    assert E.fedrod_loss(out, y, valid, aux).item() == pytest.approx(bsm + ce, rel=1e-6)
    # an absent class (count 0) gets probability 0 in the generic term; padding that hits it is dropped, not NaN
    aux0 = {"log_counts": torch.log(torch.tensor([[3.0, 0.0]]))}
    out2 = out.expand(1, 2, 4).clone()
    l2 = E.fedrod_loss(out2, torch.tensor([[0, 1]]), torch.tensor([[True, False]]), aux0)
    ce0 = -math.log(math.exp(1.0) / (math.exp(1.0) + 1.0))
    assert l2.item() == pytest.approx(0.0 + ce0, abs=1e-6)


def test_dual_head_personal_loss_reaches_only_the_personal_head():
    m = DualHead(create_model("fedabc-mlp", (1, 4, 4), 3))
    x = torch.randn(5, 1, 4, 4)
    out = m(x)
    g, pers = out[:, :3], out[:, 3:]
    z = torch.relu(m.classifier[2](torch.relu(m.classifier[0](x.flatten(1)))))  # the input of the last layer
    assert torch.allclose(g, m.classifier[4](z)) and torch.allclose(pers, g + m.p_head(z))
    pers.sum().backward()
    assert m.p_head.weight.grad is not None and m.p_head.weight.grad.abs().sum() > 0
    assert all(p.grad is None or not p.grad.any() for n, p in m.named_parameters() if not n.startswith("p_head"))
    m.zero_grad()
    m(x)[:, :3].sum().backward()  # the generic logits train the body and G, never P
    assert not m.p_head.weight.grad.any() and m.classifier[0].weight.grad.any() and m.classifier[4].weight.grad.any()


# ---------------------------------------------------------------- runs on tiny MNIST


def cfg_for(algo, **kw):
    base = dict(
        algo=algo,
        dataset="mnist",
        data_dir=str(MNIST),
        model="fedabc-mlp",
        partition="dirichlet",
        partition_params={"alpha": 0.5, "min_size": 5},
        clients=6,
        participation=0.5,
        rounds=3,
        local_epochs=2,
        batch_size=32,
        optimizer="sgd",
        lr=0.05,
        momentum=0.9,
        weight_decay=1e-5,
        subset=300,
        test_subset=150,
        local_test_size=20,
        seeds=[0],
    )
    return ScratchConfig(**{**base, **kw})


def rows(out: Path) -> list[dict]:
    with open(out / "rounds.csv") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def same_model(a: Path, b: Path, seed=0) -> bool:
    x, y = torch.load(a / f"model-seed{seed}.pt"), torch.load(b / f"model-seed{seed}.pt")
    return list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)


@needs_mnist
def test_fedprox_at_mu_zero_is_fedavg_bit_for_bit(tmp_path):
    run_scratch(cfg_for("fedavg"), tmp_path / "avg")
    run_scratch(cfg_for("fedprox", prox_mu=0.0), tmp_path / "prox0")
    run_scratch(cfg_for("fedprox", prox_mu=1.0), tmp_path / "prox1")
    assert rows(tmp_path / "avg") == rows(tmp_path / "prox0")
    assert same_model(tmp_path / "avg", tmp_path / "prox0")
    assert not same_model(tmp_path / "avg", tmp_path / "prox1")
    assert json.loads((tmp_path / "prox1" / "config.json").read_text())["prox_mu"] == 1.0


@needs_mnist
def test_local_sends_nothing_and_keeps_the_init(tmp_path):
    out = tmp_path / "local"
    run_scratch(cfg_for("local", participation=0.34), out)
    r = rows(out)
    assert all(float(x["bytes_total"]) == 0 and float(x["bytes_up_per_client"]) == 0 for x in r)
    assert all(float(x["pfl_accuracy"]) > 0 for x in r)
    final = torch.load(out / "model-seed0.pt")
    names = [n for n in final if not n.startswith("personal.")]
    model = create_model("fedabc-mlp", (1, 28, 28), 10)
    init = E.init_params(model, torch.Generator().manual_seed(0))
    assert all(torch.equal(final[n], init[n]) for n in names)  # the server's copy never moves
    trained_any = [any(not torch.equal(final[f"personal.{n}"][k], init[n]) for n in names) for k in range(6)]
    assert 0 < sum(trained_any) < 6  # 2 clients a round, 3 rounds: not all
    for k in range(6):  # an untrained client is still the init
        if not trained_any[k]:
            assert all(torch.equal(final[f"personal.{n}"][k], init[n]) for n in names)
    assert json.loads((out / "config.json").read_text())["accuracy_of"].startswith("the personal models")


@needs_mnist
def test_share_fraction_mixes_the_shared_set_and_counts_its_bytes_once(tmp_path):
    cfg = R.resolve_config(cfg_for("fedavg", share_fraction=0.1, noise="symmetric", noise_rate=0.5))
    data = R.load_dataset(cfg.dataset, cfg.data_dir)
    ctx = R._setup(cfg, data, 0, torch.device("cpu"), lambda m: None)
    plain = R._setup(
        R.resolve_config(cfg_for("fedavg", noise="symmetric", noise_rate=0.5)),
        data,
        0,
        torch.device("cpu"),
        lambda m: None,
    )
    sizes = [len(p) for p in plain.parts]
    s = round(0.1 * np.mean(sizes))
    assert ctx.info["share_size"] == s and s == 5
    shared = R.draw_shared(300, sizes, 0.1, 0)
    assert len(shared) == s and len(set(shared.tolist())) == s
    assert np.array_equal(shared, R.draw_shared(300, sizes, 0.1, 0))  # once per seed, reproducible
    rows_ = np.arange(300, 300 + s)
    clean = data.train_y[R.subsample(data.train_y, 300, np.random.default_rng(0))][shared]
    for k, (p, q) in enumerate(zip(ctx.parts, plain.parts)):
        assert np.array_equal(p, np.concatenate([q, rows_])), k  # own samples, then D_s
    assert torch.equal(ctx.x_train[300:], ctx.x_train[torch.from_numpy(shared)])
    assert np.array_equal(ctx.y_train[300:].numpy(), clean)  # clean labels despite the noise
    assert not np.array_equal(ctx.y_train[torch.from_numpy(shared)].numpy(), clean)  # the clients' copies are noisy
    assert ctx.share_bytes == s * (28 * 28 + 8)
    assert ctx.client_extra["private_size"] == sizes
    assert np.array_equal(ctx.local_test[0], plain.local_test[0])  # local test sets: private proportions

    run_scratch(cfg_for("fedavg", share_fraction=0.1), tmp_path / "share")
    run_scratch(cfg_for("fedavg"), tmp_path / "plain")
    a, b = rows(tmp_path / "share"), rows(tmp_path / "plain")
    extra = 6 * s * (28 * 28 + 8)  # every client, once
    assert [int(float(x["bytes_shared_data"])) for x in a] == [extra, 0, 0]
    plain_bytes = [int(float(x["bytes_total"])) for x in b]
    assert [int(float(x["bytes_total"])) for x in a] == [plain_bytes[0] + extra, plain_bytes[1], plain_bytes[2]]
    summary = json.loads((tmp_path / "share" / "summary.json").read_text())
    assert summary["per_seed"][0]["bytes_shared_data"] == extra
    with open(tmp_path / "share" / "clients.csv") as f:
        clients = list(csv.DictReader(f))
    assert [int(c["size"]) - int(c["private_size"]) for c in clients] == [s] * 6


# ---------------------------------------------------------------- every new algorithm through the CLI


@pytest.mark.parametrize("algo", R.FEDABC_BASELINES)
def test_new_algorithms_end_to_end_on_digits(tmp_path, algo):
    out = tmp_path / algo
    extra = {
        "fedprox": ["--prox-mu", "0.1"],
        "fedrep": ["--local-epochs", "2", "--body-epochs", "1"],
        "fedper": ["--head-layers", "2"],
    }.get(algo, [])
    res = runner.invoke(
        cli.app,
        [
            "scratch",
            algo,
            "--dataset",
            "digits",
            "--data-dir",
            str(tmp_path),
            "--clients",
            "4",
            "--participation",
            "0.5",
            "--rounds",
            "2",
            "--local-epochs",
            "1",
            "--batch-size",
            "32",
            "--lr",
            "0.05",
            "--alpha",
            "0.5",
            "--local-test-size",
            "20",
            *extra,
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    r = rows(out)
    assert len(r) == 2 and all(0 <= float(x["pfl_accuracy"]) <= 1 and 0 <= float(x["drift_accuracy"]) <= 1 for x in r)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["partition"] == "dirichlet" and cfg["optimizer"] == "sgd" and cfg["model"] == "cnn"
    final = torch.load(out / "model-seed0.pt")
    model = create_model("cnn", (1, 8, 8), 10)
    layers = weight_layers(model)
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    shared = {
        "local": [],
        "fedprox": list(sizes),
        "scaffold": list(sizes),
        "fedper": [n for g in layers[:-2] for n in g],
        "fedrep": [n for g in layers[:-1] for n in g],
        "lg-fedavg": layers[-1],
        "fedrod": list(sizes),
    }[algo]
    per_client = sum(sizes[n] for n in shared) * (2 if algo == "scaffold" else 1)
    assert {int(float(x["bytes_up_per_client"])) for x in r} == {per_client}
    assert all(int(float(x["bytes_total"])) == 2 * 2 * per_client for x in r)  # 2 clients, down + up
    personal = sorted(n[len("personal.") :] for n in final if n.startswith("personal."))
    want = {"fedprox": [], "scaffold": [], "fedrod": ["p_head.bias", "p_head.weight"]}.get(
        algo, sorted(set(sizes) - set(shared))
    )
    assert personal == want
    if algo == "fedrod":
        assert all(0 <= float(x["generic_accuracy"]) <= 1 for x in r)
        assert "last5_generic_accuracy" in res.output


# ---------------------------------------------------------------- resume of personalised state


@needs_mnist
@pytest.mark.parametrize("algo", ["fedrep", "scaffold"])
def test_resume_of_personal_state_equals_uninterrupted(tmp_path, monkeypatch, algo):
    kw = {"body_epochs": 1} if algo == "fedrep" else {}
    full = tmp_path / "full"
    run_scratch(cfg_for(algo, seeds=[0, 1], **kw), full)
    cut = tmp_path / "cut"
    restore = cut_after(monkeypatch, 4)  # dies in round 2 of the second seed
    with pytest.raises(KeyboardInterrupt):
        run_scratch(cfg_for(algo, seeds=[0, 1], **kw), cut)
    restore()
    ck = read_state(cut / CHECKPOINT)["current"]["algo"]
    if algo == "fedrep":
        assert set(ck["personal"]) == {"classifier.4.weight", "classifier.4.bias"}
        assert ck["personal"]["classifier.4.weight"].shape == (6, 10, 200)
    else:
        assert ck["scaffold"]["ck"].shape[0] == 6 and ck["scaffold"]["c"].abs().sum() > 0
    run_scratch(cfg_for(algo, seeds=[0, 1], **kw), cut, resume=True)
    assert rows(full) == rows(cut)
    assert same_model(full, cut, 0) and same_model(full, cut, 1)
