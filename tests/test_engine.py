"""The vectorized engine equals the per-client loop backend; one SGD step checked by hand."""

import numpy as np
import pytest
import torch

from fedhead.core.engine import BACKENDS, ClientSet, Engine, LocalConfig, OptimConfig, client_plan
from fedhead.core.heads import create_head, iterative_head_names


def toy_clients(n=300, d=12, c=5, k=6, seed=0):
    rng = np.random.default_rng(seed)
    x = np.abs(rng.normal(size=(n, d))).astype(np.float32)
    y = rng.integers(0, c, n)
    cuts = np.sort(rng.choice(np.arange(1, n), k - 1, replace=False))  # unequal client sizes
    parts = [np.sort(p) for p in np.split(rng.permutation(n), cuts)]
    counts = np.stack([np.bincount(y[p], minlength=c) for p in parts])
    xt = torch.cat([torch.tensor(x), torch.ones(n, 1)], 1)
    return ClientSet(x=xt, y=torch.tensor(y), parts=parts, counts=counts, num_classes=c)


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("head", iterative_head_names())
def test_vectorized_equals_loop(head, optim):
    data = toy_clients()
    h = create_head(head, positive_keep=0.6)
    out = {}
    for backend in BACKENDS:
        eng = Engine(
            data, h, OptimConfig(name=optim), LocalConfig(epochs=2, batch_size=16), backend=backend, block_clients=4
        )
        # small random init (see test_engine_speed.train: AdamW amplifies rounding where a gradient is exactly 0)
        theta = 0.1 * torch.randn(data.num_classes, data.x.shape[1], generator=torch.Generator().manual_seed(3))
        for rnd in (1, 2):
            theta, stats = eng.run_round(theta, np.arange(len(data.parts)), 0, rnd, "fedavg")
        out[backend] = theta
    assert out["loop"].abs().max() > 1e-3  # something was learnt
    torch.testing.assert_close(out["vectorized"], out["loop"], atol=1e-5, rtol=1e-4)


def test_blocks_do_not_change_the_result():
    data = toy_clients()
    h = create_head("ova2")
    res = []
    for block in (1, 4, 100):
        eng = Engine(data, h, OptimConfig(), LocalConfig(epochs=1, batch_size=20), block_clients=block)
        res.append(eng.run_round(torch.zeros(5, 13), np.arange(6), 3, 2, "grouped")[0])
    torch.testing.assert_close(res[0], res[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(res[0], res[2], atol=1e-6, rtol=1e-5)


def test_one_sgd_step_by_hand():
    # one client, one sample x = [1, 2] (+ bias 1), label 0, C = 2, zero init, softmax, lr 0.1:
    # p = [.5, .5], dL/ds = p - e0 = [-.5, .5], dW = G^T x = [[-.5, -1, -.5], [.5, 1, .5]], W = -0.1 dW
    data = ClientSet(
        x=torch.tensor([[1.0, 2.0, 1.0]]),
        y=torch.tensor([0]),
        parts=[np.array([0])],
        counts=np.array([[1, 0]]),
        num_classes=2,
    )
    for backend in BACKENDS:
        eng = Engine(
            data,
            create_head("softmax"),
            OptimConfig(name="sgd", lr=0.1, weight_decay=0.0, momentum=0.0),
            LocalConfig(epochs=1, batch_size=4),
            backend=backend,
        )
        theta, _ = eng.run_round(torch.zeros(2, 3), np.array([0]), 0, 1, "fedavg")
        want = torch.tensor([[0.05, 0.1, 0.05], [-0.05, -0.1, -0.05]])
        torch.testing.assert_close(theta, want)


def test_client_plan_is_keyed_by_client_and_round():
    part = np.arange(10, 30)
    a = client_plan(part, 0, 1, 5, 2)
    assert np.array_equal(a[0], client_plan(part, 0, 1, 5, 2)[0])
    assert not np.array_equal(a[0], client_plan(part, 0, 2, 5, 2)[0])
    assert not np.array_equal(a[0], client_plan(part, 0, 1, 6, 2)[0])
    assert all(sorted(row) == list(part) for row in a[0])


# ---------------------------------------------------------------- --local-steps: the same steps for every client


@pytest.mark.parametrize("head", ["softmax", "ova2"])
def test_local_steps_vectorized_equals_loop(head):
    data = toy_clients()
    data.parts[0] = data.parts[0][:7]  # a client smaller than one batch: 7-sample batches
    data.counts[0] = np.bincount(data.y[data.parts[0]].numpy(), minlength=data.num_classes)
    h = create_head(head, positive_keep=0.6)
    out = {}
    for backend in BACKENDS:
        eng = Engine(
            data,
            h,
            OptimConfig(name="sgd", lr=0.05),
            LocalConfig(batch_size=16, steps=9),
            backend=backend,
            block_clients=4,
        )
        theta = 0.1 * torch.randn(data.num_classes, data.x.shape[1], generator=torch.Generator().manual_seed(3))
        for rnd in (1, 2):
            theta, _ = eng.run_round(theta, np.arange(len(data.parts)), 0, rnd, "fedavg")
        out[backend] = theta
    assert out["loop"].abs().max() > 1e-3
    torch.testing.assert_close(out["vectorized"], out["loop"], atol=1e-5, rtol=1e-4)


def test_step_plan_cycles_epochs_and_gives_every_client_the_same_steps():
    from fedhead.core.engine import step_plan

    part = np.arange(100, 130)  # 30 samples, batches of 8, 10 steps = 80 samples
    idx, u = step_plan(part, 0, 1, 4, steps=10, batch=8)
    assert idx.shape == u.shape == (10, 8)
    epochs, _ = client_plan(part, 0, 1, 4, 3)  # the same shuffles as the epoch plan, end to end
    np.testing.assert_array_equal(idx.reshape(-1), epochs.reshape(-1)[:80])
    assert sorted(idx.reshape(-1)[:30]) == list(part)  # each epoch visits every sample once
    small, _ = step_plan(np.array([5, 6, 7]), 0, 1, 0, steps=4, batch=8)
    assert small.shape == (4, 3) and all(sorted(r) == [5, 6, 7] for r in small)


def test_local_steps_count_in_scaffold():
    # SCAFFOLD's option II divides the drift by the client's step count: with --local-steps every client made
    # exactly `steps` steps, whatever its size
    from fedhead.core.engine import ScaffoldState

    data = toy_clients()
    eng = Engine(
        data,
        create_head("softmax"),
        OptimConfig(name="sgd", lr=0.05, momentum=0.0),
        LocalConfig(batch_size=16, steps=5),
        block_clients=6,
    )
    sc = ScaffoldState.zeros(len(data.parts), data.num_classes, data.x.shape[1], "cpu")
    theta = torch.zeros(data.num_classes, data.x.shape[1])
    w, *_ = eng.train_block(theta, list(range(6)), 0, 1, scaffold=sc)
    want = (theta - w) / (5 * 0.05)  # c = 0 before: c_k+ = (theta - w_k) / (K eta)
    torch.testing.assert_close(sc.ck, want, atol=1e-5, rtol=1e-4)
