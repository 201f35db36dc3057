"""FedProx and SCAFFOLD in the engine (both backends), and the FedLC head: toy cases, some by hand."""

import math

import numpy as np
import pytest
import torch

from fedhead.core.engine import BACKENDS, ClientSet, Engine, LocalConfig, OptimConfig, ScaffoldState
from fedhead.core.heads import LossContext, create_head
from fedhead.infra.errors import FedheadError


def toy(n=150, d=6, c=4, k=5, seed=0):
    """Unequal client sizes, so clients have different step counts (sorted order != client order)."""
    rng = np.random.default_rng(seed)
    x = np.abs(rng.normal(size=(n, d))).astype(np.float32)
    y = rng.integers(0, c, n)
    cuts = np.sort(rng.choice(np.arange(1, n), k - 1, replace=False))
    parts = [np.sort(p) for p in np.split(rng.permutation(n), cuts)]
    counts = np.stack([np.bincount(y[p], minlength=c) for p in parts])
    xt = torch.cat([torch.tensor(x), torch.ones(n, 1)], 1)
    return ClientSet(x=xt, y=torch.tensor(y), parts=parts, counts=counts, num_classes=c)


def theta0(data, seed=3):
    # a small random head (see test_engine_speed.train: AdamW amplifies rounding where a gradient is exactly 0)
    g = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(data.num_classes, data.x.shape[1], generator=g)


def engine(data, backend, optim="adamw", head="softmax", epochs=2, batch=12, **kw):
    return Engine(
        data,
        create_head(head),
        OptimConfig(name=optim),
        LocalConfig(epochs=epochs, batch_size=batch),
        backend=backend,
        **kw,
    )


VEC = dict(block_clients=3, tile_clients=2)  # several blocks and tiles mixing step counts


def rounds(eng, theta, n_rounds=2, sel=None, **kw):
    sel = np.arange(len(eng.data.parts)) if sel is None else sel
    for rnd in range(1, n_rounds + 1):
        theta, _ = eng.run_round(theta, sel, 7, rnd, "fedavg", **kw)
    return theta


# ---------------------------------------------------------------- FedProx


@pytest.mark.parametrize("backend", BACKENDS)
def test_prox_mu_zero_is_fedavg_bit_for_bit(backend):
    data = toy()
    kw = VEC if backend == "vectorized" else {}
    a = rounds(engine(data, backend, **kw), theta0(data))
    b = rounds(engine(data, backend, **kw), theta0(data), prox_mu=0.0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_prox_vectorized_equals_loop(optim):
    data = toy()
    want = rounds(engine(data, "loop", optim), theta0(data), prox_mu=0.5)
    got = rounds(engine(data, "vectorized", optim, **VEC), theta0(data), prox_mu=0.5)
    plain = rounds(engine(data, "loop", optim), theta0(data))
    assert (want - plain).abs().max() > 1e-4  # the term does something
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_mu_keeps_local_heads_near_theta(backend):
    data = toy()
    th = theta0(data)
    block = list(range(len(data.parts)))
    eng = engine(data, backend, "sgd", epochs=3)
    dist = {}
    for mu in (0.0, 1.0, 10.0):
        w = eng.train_block(th, block, 7, 1, prox_mu=mu)[0]
        dist[mu] = (w - th).flatten(1).norm(dim=1)  # per client
    assert (dist[1.0] < dist[0.0]).all() and (dist[10.0] < dist[1.0]).all()


def test_one_prox_sgd_step_by_hand():
    # test_engine's single sample x = [1, 2, 1], label 0, C = 2, softmax, plain SGD lr 0.1, from theta:
    # dW = (p - e0) x^T, plus mu (W - theta) = 0 on the first step; so one step is FedAvg's. Two epochs:
    # the second step adds mu (W1 - theta) = mu * (-lr dW0).
    data = ClientSet(
        x=torch.tensor([[1.0, 2.0, 1.0]]),
        y=torch.tensor([0]),
        parts=[np.array([0])],
        counts=np.array([[1, 0]]),
        num_classes=2,
    )
    lr, mu = 0.1, 2.0
    x = torch.tensor([1.0, 2.0, 1.0])
    w = torch.zeros(2, 3)
    for _ in range(2):
        p = torch.softmax(w @ x, 0)
        g = torch.outer(p - torch.tensor([1.0, 0.0]), x) + mu * w  # theta = 0
        w = w - lr * g
    for backend in BACKENDS:
        eng = Engine(
            data,
            create_head("softmax"),
            OptimConfig(name="sgd", lr=lr, weight_decay=0.0, momentum=0.0),
            LocalConfig(epochs=2, batch_size=4),
            backend=backend,
        )
        got, _ = eng.run_round(torch.zeros(2, 3), np.array([0]), 0, 1, "fedavg", prox_mu=mu)
        torch.testing.assert_close(got, w)


# ---------------------------------------------------------------- SCAFFOLD


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_scaffold_vectorized_equals_loop(optim):
    data = toy()
    C, D1 = data.num_classes, data.x.shape[1]
    out = {}
    for backend in BACKENDS:
        st = ScaffoldState.zeros(len(data.parts), C, D1, "cpu")
        kw = VEC if backend == "vectorized" else {}
        eng = engine(data, backend, optim, **kw)
        th = theta0(data)
        for rnd, sel in ((1, [0, 1, 2, 3, 4]), (2, [4, 1, 3]), (3, [0, 2, 4])):
            th, _ = eng.run_round(th, np.array(sel), 7, rnd, "fedavg", scaffold=st, prox_mu=0.1)
        out[backend] = (th, st)
    (tv, sv), (tl, sl) = out["vectorized"], out["loop"]
    assert sl.c.abs().max() > 1e-3 and sl.ck.abs().max() > 1e-3
    torch.testing.assert_close(tv, tl, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sv.c, sl.c, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sv.ck, sl.ck, atol=1e-4, rtol=1e-4)
    assert sv.pending.abs().max() == 0 and sl.pending.abs().max() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaffold_one_client_is_plain_local_training(backend):
    # round 1: c = c_1 = 0; after it c_1+ = (theta - w)/(K eta) and c = 0 + (1/1) c_1+ = c_1+, so c - c_1 stays 0
    data = toy(k=1)
    C, D1 = data.num_classes, data.x.shape[1]
    st = ScaffoldState.zeros(1, C, D1, "cpu")
    a = rounds(engine(data, backend), theta0(data), n_rounds=3)
    b = rounds(engine(data, backend), theta0(data), n_rounds=3, scaffold=st)
    assert torch.equal(a, b)
    assert torch.equal(st.c, st.ck[0]) and st.c.abs().max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaffold_control_variates_by_hand(backend):
    # 2 clients (N = 3, client 2 not sampled), plain SGD, one step each (one batch, one epoch):
    # round 1 (c = c_k = 0): w_k = theta - lr g_k, c_k+ = (theta - w_k)/(1 * lr) = g_k, c = (g_0 + g_1)/3.
    # round 2 from theta' = mean of w_k: w_k = theta' - lr (g_k' + c - c_k), c_k++ = c_k+ - c + (theta' - w_k)/lr
    # = g_k' (the correction cancels), so Delta c_k = g_k' - g_k and c' = c + ((g_0' - g_0) + (g_1' - g_1))/3.
    x = torch.tensor([[1.0, 2.0, 1.0], [0.5, -1.0, 1.0], [2.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    y = torch.tensor([0, 1, 1, 0])
    parts = [np.array([0, 1]), np.array([2]), np.array([3])]
    counts = np.stack([np.bincount(y[p].numpy(), minlength=2) for p in parts])
    data = ClientSet(x=x, y=y, parts=parts, counts=counts, num_classes=2)
    lr = 0.1

    def grad(w, k):  # mean softmax CE gradient of client k at w
        xs, ys = x[parts[k]], y[parts[k]]
        p = torch.softmax(xs @ w.T, 1) - torch.nn.functional.one_hot(ys, 2).float()
        return p.T @ xs / len(ys)

    th = torch.tensor([[0.1, -0.2, 0.0], [0.0, 0.3, 0.1]])
    g = [grad(th, k) for k in (0, 1)]
    w1 = [th - lr * g[k] for k in (0, 1)]
    c1 = (g[0] + g[1]) / 3
    th2 = (2 * w1[0] + 1 * w1[1]) / 3  # fedavg by sizes 2 and 1
    g2 = [grad(th2, k) for k in (0, 1)]
    c2 = c1 + ((g2[0] - g[0]) + (g2[1] - g[1])) / 3
    w2 = [th2 - lr * (g2[k] + c1 - g[k]) for k in (0, 1)]
    th3 = (2 * w2[0] + 1 * w2[1]) / 3

    st = ScaffoldState.zeros(3, 2, 3, "cpu")
    eng = Engine(
        data,
        create_head("softmax"),
        OptimConfig(name="sgd", lr=lr, weight_decay=0.0, momentum=0.0),
        LocalConfig(epochs=1, batch_size=4),
        backend=backend,
    )
    got, _ = eng.run_round(th, np.array([0, 1]), 0, 1, "fedavg", scaffold=st)
    torch.testing.assert_close(got, th2)
    torch.testing.assert_close(st.ck[0], g[0])
    torch.testing.assert_close(st.ck[1], g[1])
    assert torch.equal(st.ck[2], torch.zeros(2, 3))
    torch.testing.assert_close(st.c, c1)
    got, _ = eng.run_round(got, np.array([0, 1]), 0, 2, "fedavg", scaffold=st)
    torch.testing.assert_close(got, th3)
    torch.testing.assert_close(st.ck[0], g2[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(st.ck[1], g2[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(st.c, c2, atol=1e-6, rtol=1e-5)


def test_scaffold_steps_count_epochs_and_batches():
    # one client of 5 samples, batch 2 -> 3 batches, 2 epochs: K = 6, so c_k+ = (theta - w)/(6 lr / (1 - momentum))
    data = toy(n=5, k=1)
    th = theta0(data)
    eng = engine(data, "vectorized", "sgd", epochs=2, batch=2)
    assert eng.optim.momentum == 0.9
    st = ScaffoldState.zeros(1, data.num_classes, data.x.shape[1], "cpu")
    w = eng.train_block(th, [0], 0, 1, scaffold=st)[0][0]
    torch.testing.assert_close(st.ck[0], (th - w) / (6 * 0.01 / (1 - 0.9)))
    assert torch.equal(st.c, torch.zeros_like(st.c))  # train_block leaves the server's c pending
    st.server_update()
    torch.testing.assert_close(st.c, st.ck[0])


def test_scaffold_state_dict_round_trip_and_shape_check():
    data = toy()
    st = ScaffoldState.zeros(len(data.parts), data.num_classes, data.x.shape[1], "cpu")
    rounds(engine(data, "vectorized", **VEC), theta0(data), scaffold=st)
    d = st.state_dict()
    other = ScaffoldState.zeros(len(data.parts), data.num_classes, data.x.shape[1], "cpu")
    other.load_state_dict(d)
    assert torch.equal(other.c, st.c) and torch.equal(other.ck, st.ck)
    assert st.nbytes == data.num_classes * data.x.shape[1] * 4
    with pytest.raises(FedheadError, match="SCAFFOLD"):
        ScaffoldState.zeros(2, data.num_classes, data.x.shape[1], "cpu").load_state_dict(d)
    with pytest.raises(FedheadError, match="SCAFFOLD"):
        engine(data, "loop").run_round(
            theta0(data),
            np.arange(5),
            0,
            1,
            "fedavg",
            scaffold=ScaffoldState.zeros(2, data.num_classes, data.x.shape[1], "cpu"),
        )


# ---------------------------------------------------------------- FedLC


def fedlc_case(seed=0, K=3, B=7, C=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(K, B, C, generator=g) * 6
    y = torch.randint(0, C, (K, B), generator=g)
    counts = torch.randint(0, 4, (K, C), generator=g).float()
    counts[0, 0] = 0.0
    mask = torch.ones(K, B)
    mask[1, 4:] = 0.0
    mask[2] = 0.0
    return logits, y, mask, LossContext(round=2, present=counts > 0, counts=counts, u=torch.rand(K, B, generator=g))


@pytest.mark.parametrize("tau", [0.0, 0.5, 1.0, 3.0])
def test_fedlc_closed_form_equals_autograd(tau):
    logits, y, mask, ctx = fedlc_case()
    h = create_head("fedlc", fedlc_tau=tau)
    lg = logits.clone().requires_grad_(True)
    want = h.loss(lg, y, mask, ctx)
    (gw,) = torch.autograd.grad(want.sum(), lg)
    got, gg = h.loss_and_grad(logits, y, mask, ctx)
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gg, gw, atol=1e-6, rtol=1e-5)


def test_fedlc_tau_zero_is_softmax():
    logits, y, mask, ctx = fedlc_case(1)
    a, s = create_head("fedlc", fedlc_tau=0.0), create_head("softmax")
    assert torch.equal(a.loss(logits, y, mask, ctx), s.loss(logits, y, mask, ctx))
    la, ga = a.loss_and_grad(logits, y, mask, ctx)
    ls, gs = s.loss_and_grad(logits, y, mask, ctx)
    assert torch.equal(la, ls) and torch.equal(ga, gs)


def test_fedlc_exact_and_absent_class():
    # one sample, C = 2, logits [0, ln 3], label 0, tau 1
    S, Y, M = torch.tensor([[[0.0, math.log(3.0)]]]), torch.tensor([[0]]), torch.ones(1, 1)
    h = create_head("fedlc")
    assert h.params["fedlc_tau"] == 1.0

    def ctx(c):
        c = torch.tensor([c], dtype=torch.float32)
        return LossContext(round=1, present=c > 0, counts=c, u=torch.zeros(1, 1))

    # counts [16, 1]: calibrated [0 - 1/2, ln 3 - 1]; loss = -log softmax_0, true class in the denominator
    z0, z1 = -0.5, math.log(3.0) - 1.0
    want = -z0 + math.log(math.exp(z0) + math.exp(z1))
    assert float(h.loss(S, Y, M, ctx([16, 1]))[0]) == pytest.approx(want, rel=1e-6)
    # absent class: counts clamped at 1e-8 -> shifted by tau * 100, it drops out of the softmax
    z1 = math.log(3.0) - 100.0
    want = -z0 + math.log(math.exp(z0) + math.exp(z1))
    assert float(h.loss(S, Y, M, ctx([16, 0]))[0]) == pytest.approx(want, rel=1e-6)
    # in float64: the push-down (about e^-100) is a normal number there; in float32 it is subnormal, which the
    # engines flush to zero (fedhead.infra.devices.flush_denormals) once any of them has run in this process
    _, g = h.loss_and_grad(S.double(), Y, M.double(), ctx([16, 0]))
    assert 0 < float(g[0, 0, 1]) < 1e-40  # practically no push-down of the absent class


def test_fedlc_rare_classes_get_larger_shifts():
    h = create_head("fedlc", fedlc_tau=2.0)
    c = torch.tensor([[1.0, 16.0, 0.0]])
    sh = h.shift(LossContext(1, c > 0, c, torch.zeros(1, 1)))
    torch.testing.assert_close(sh, torch.tensor([[[2.0, 1.0, 200.0]]]), rtol=1e-5, atol=1e-4)


def test_bad_fedlc_tau():
    with pytest.raises(FedheadError, match="--fedlc-tau"):
        create_head("fedlc", fedlc_tau=-1.0)
