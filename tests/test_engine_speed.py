"""The engine's fast paths (cache tiles, fused optimizer kernels, step-count groups, closed-form loss hook)
give the loop backend's result to float tolerance. Not timed: speed is measured by ``fedhead bench speed``."""

import json
import os

import numpy as np
import pytest
import torch

from fedhead.core.engine import ClientSet, Engine, LocalConfig, OptimConfig, StackedAdamW, StackedSGD, _fused_available
from fedhead.core.heads import HEADS, create_head, iterative_head_names


def clients(n=260, d=10, c=6, k=9, seed=1):
    """Unequal client sizes (some one batch, some several, one empty-step short one)."""
    rng = np.random.default_rng(seed)
    x = np.abs(rng.normal(size=(n, d))).astype(np.float32)
    y = rng.integers(0, c, n)
    cuts = np.sort(rng.choice(np.arange(1, n), k - 1, replace=False))
    parts = [np.sort(p) for p in np.split(rng.permutation(n), cuts)]
    counts = np.stack([np.bincount(y[p], minlength=c) for p in parts])
    xt = torch.cat([torch.tensor(x), torch.ones(n, 1)], 1)
    return ClientSet(x=xt, y=torch.tensor(y), parts=parts, counts=counts, num_classes=c)


def train(data, head, optim, backend, rounds=(1, 2, 3), aggregate="fedavg", theta=None, **kw):
    eng = Engine(data, head, OptimConfig(name=optim), LocalConfig(epochs=2, batch_size=12), backend=backend, **kw)
    if theta is None:
        # a small random head: from zero init AdamW turns rounding noise on coordinates whose exact gradient is
        # zero (e.g. a balanced batch's softmax bias) into lr-sized steps, which no two summation orders share
        g = torch.Generator().manual_seed(3)
        theta = 0.1 * torch.randn(data.num_classes, data.x.shape[1], generator=g)
    for rnd in rounds:
        theta, stats = eng.run_round(theta, np.arange(len(data.parts)), 7, rnd, aggregate)
    return theta, eng


FUSED = [True, False] if _fused_available("adamw", torch.device("cpu")) else [False]


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("head", iterative_head_names())
def test_tiles_and_fused_kernels_equal_loop(head, optim, fused):
    data = clients()
    h = create_head(head, positive_keep=0.6)
    want, _ = train(data, h, optim, "loop")
    # several blocks, several tiles per block, tiles mixing clients with different step counts
    got, eng = train(data, h, optim, "vectorized", block_clients=5, tile_clients=2, fused=fused)
    assert eng.tile_clients == 2 and eng.block_clients == 5
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tile", [1, 3, 100])
def test_tile_size_does_not_change_the_result(tile):
    data = clients()
    h = create_head("ova2", positive_keep=0.5)
    ref, _ = train(data, h, "adamw", "vectorized", aggregate="grouped", tile_clients=9)
    got, _ = train(data, h, "adamw", "vectorized", aggregate="grouped", tile_clients=tile)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


def test_global_head_is_not_modified_in_place():
    data = clients()
    for block, tile in ((1, 1), (3, 1), (9, 9)):
        eng = Engine(
            data, create_head("ova"), OptimConfig(), LocalConfig(1, 16), block_clients=block, tile_clients=tile
        )
        theta = torch.full((data.num_classes, data.x.shape[1]), 0.25)
        before = theta.clone()
        eng.run_round(theta, np.arange(9), 0, 1, "fedavg")
        assert torch.equal(theta, before)


@pytest.mark.parametrize("fused", FUSED)
def test_stacked_adamw_per_client_step_counts_equal_torch(fused):
    # clients in different step groups: the groups must keep their own bias corrections
    torch.manual_seed(0)
    K, shape = 5, (4, 3)
    w0 = torch.randn(K, *shape)
    grads = torch.randn(6, K, *shape)
    active = [5, 5, 3, 3, 1, 1]  # prefix sizes per step: runs end at 1, 3, 5
    cfg = OptimConfig(name="adamw", lr=0.05, weight_decay=0.1)
    opt = StackedAdamW(cfg, (K, *shape), "cpu", fused=fused)
    w, g = w0.clone(), torch.empty(K, *shape)
    opt.bind(w, g, runs=[1, 3, 5])
    for t, k in enumerate(active):
        g[:k] = grads[t, :k]
        opt.step(k)
    for c in range(K):
        p = torch.nn.Parameter(w0[c].clone())
        o = torch.optim.AdamW([p], lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
        for t, k in enumerate(active):
            if c < k:
                p.grad = grads[t, c].clone()
                o.step()
        torch.testing.assert_close(w[c], p.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("fused", FUSED)
def test_stacked_sgd_equals_torch(fused, momentum):
    torch.manual_seed(1)
    K = 4
    w0, grads = torch.randn(K, 3), torch.randn(5, K, 3)
    active = [4, 4, 2, 2, 1]
    cfg = OptimConfig(name="sgd", lr=0.1, weight_decay=0.01, momentum=momentum)
    opt = StackedSGD(cfg, (K, 3), "cpu", fused=fused)
    w, g = w0.clone(), torch.empty(K, 3)
    opt.bind(w, g)
    for t, k in enumerate(active):
        g[:k] = grads[t, :k]
        opt.step(k)
    for c in range(K):
        p = torch.nn.Parameter(w0[c].clone())
        o = torch.optim.SGD([p], lr=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay, foreach=False)
        for t, k in enumerate(active):
            if c < k:
                p.grad = grads[t, c].clone()
                o.step()
        torch.testing.assert_close(w[c], p.detach(), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- closed-form loss hook


# the heads that define ``loss_and_grad`` in closed form (the engine's fast path)
CLOSED = [n for n in iterative_head_names() if callable(getattr(HEADS[n].cls, "loss_and_grad", None))]


def test_the_common_heads_have_a_closed_form():
    assert {"softmax", "ova", "ova2"} <= set(CLOSED)


def closed_form_head(name, **params):
    h = create_head(name, **params)
    assert callable(getattr(h, "loss_and_grad", None))
    return h


def _ctx(K, B, C, rnd, seed=0):
    from fedhead.core.heads import LossContext

    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 3, (K, C), generator=g).float()
    return LossContext(round=rnd, present=counts > 0, counts=counts, u=torch.rand(K, B, generator=g))


@pytest.mark.parametrize("rnd", [1, 2])
@pytest.mark.parametrize("name,params", [("ova2", {}), ("ova2", {"positive_keep": 0.5}), ("ova", {}), ("softmax", {})])
def test_closed_form_loss_and_grad_equal_autograd(name, params, rnd):
    torch.manual_seed(rnd)
    K, B, C = 3, 7, 5
    logits = (torch.randn(K, B, C) * 6).requires_grad_(True)  # large logits: stability matters
    y = torch.randint(0, C, (K, B))
    mask = torch.ones(K, B)
    mask[1, 4:] = 0.0
    mask[2] = 0.0  # a client with no valid sample
    ctx = _ctx(K, B, C, rnd)
    h = closed_form_head(name, **params)
    want = h.loss(logits, y, mask, ctx)
    (gw,) = torch.autograd.grad(want.sum(), logits)
    got, gg = h.loss_and_grad(logits.detach(), y, mask, ctx)
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gg, gw, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("name", CLOSED)
def test_engine_closed_form_path_equals_loop(name, optim):
    # a random start: from zero, softmax gradients of class-balanced clients cancel exactly on the bias
    # column, and AdamW turns rounding-level differences of a zero gradient into lr-sized steps
    data = clients()
    h = closed_form_head(name, positive_keep=0.6)
    th = 0.1 * torch.randn(data.num_classes, data.x.shape[1], generator=torch.Generator().manual_seed(3))
    want, _ = train(data, h, optim, "loop", theta=th)
    got, eng = train(data, h, optim, "vectorized", block_clients=4, tile_clients=3, theta=th)
    assert eng.closed_form
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    off, eng = train(data, h, optim, "vectorized", block_clients=4, tile_clients=3, closed_form=False, theta=th)
    assert not eng.closed_form
    torch.testing.assert_close(off, want, atol=1e-5, rtol=1e-4)


def test_speed_bench_child_smoke():
    """One tiny configuration of ``fedhead bench speed`` in-process: the record has the counted keys."""
    from fedhead.bench.speed import run_config

    rec = run_config(
        dict(
            clients=4,
            samples=200,
            dim=8,
            classes=4,
            epochs=1,
            batch=50,
            device="cpu",
            threads=1,
            rounds=1,
            machine=True,
            quick=True,
            profile=True,
            loop_rounds=1,
        )
    )
    assert rec["client_steps"] == 4 and rec["samples"] == 200
    assert rec["matmul_gflop_per_round"] == pytest.approx(4 * 4 * 9 * 200 / 1e9)
    for k in ("s_per_round", "loop_s_per_round", "machine_matmul_gflops", "machine_copy_gb_per_s", "peak_mb"):
        assert rec[k] > 0, k
    assert abs(sum(rec[f"profile_{p}_fraction"] for p in ("matmul", "optimizer", "gather", "loss_other")) - 1) < 1e-6
    json.dumps(rec)


def test_scratch_speed_child_smoke():
    """One tiny scratch configuration of ``fedhead bench speed`` in-process: engine and loop rows with positive
    rates, and FlopCounterMode's count equal to the MLP's hand count."""
    from fedhead.bench.speed import scratch_protocol, scratch_speed

    cfg = dict(scratch_protocol("fedabc-mlp", quick=True), threads=1, quick=True, repeat=1, nets=["vmap"])
    rec = scratch_speed(cfg)
    # 784-260-200-10 per sample: forward and weight gradient 2*in*out each for every layer, input gradient for
    # all but the first (the images need none)
    layers = [(784, 260), (260, 200), (200, 10)]
    want = sum(2 * i * o * (2 if k == 0 else 3) for k, (i, o) in enumerate(layers))
    assert rec["gflop_per_sample"] * 1e9 == pytest.approx(want)
    assert rec["samples_per_call"] == cfg["members"] * cfg["steps"] * cfg["batch"]
    for k in ("engine", "loop", "net_vmap"):
        assert rec[f"{k}_samples_per_s"] > 0 and rec[f"{k}_gflops"] > 0, k
    assert rec["machine_matmul_gflops"] > 0 and rec["speedup_vs_loop"] > 0
    assert rec["engine_formulation"].startswith("StackedNet")
    json.dumps(rec)


def test_scratch_protocols_follow_the_runner():
    """The scratch rows are timed at the runner's defaults: members per round, batch size and optimizer."""
    from fedhead.bench.speed import SCRATCH_PROTOCOLS, scratch_protocol
    from fedhead.scratch.models import MODELS

    assert set(SCRATCH_PROTOCOLS) == {"cnn", "fedabc-mlp", "fedabc-convnet", "vgg9", "kws-cnn"} <= set(MODELS)
    assert {
        m: (scratch_protocol(m)["members"], scratch_protocol(m)["batch"], scratch_protocol(m)["optimizer"])
        for m in SCRATCH_PROTOCOLS
    } == {
        "cnn": (20, 15, "adam"),
        "fedabc-mlp": (10, 64, "sgd"),
        "fedabc-convnet": (10, 64, "sgd"),
        "vgg9": (2, 64, "sgd"),
        "kws-cnn": (20, 15, "adam"),
    }


@pytest.mark.slow
def test_bench_speed_scratch_cli(tmp_path):
    """The real command with one scratch model: the table on stdout, the flat record in --out; bad scratch options
    are one line and exit 2 before any measurement."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "FEDHEAD_NO_PROGRESS": "1"}
    out = tmp_path / "speed.json"
    base = [sys.executable, "-m", "cli", "bench", "speed", "--quick", "--no-heads", "--no-extraction", "--no-ceiling"]
    base += ["--threads", "1"]
    r = subprocess.run(
        base + ["--scratch-model", "cnn", "--scratch-repeat", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=repo,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "scratch engine vs loop" in r.stdout and "cnn" in r.stdout
    rec = json.loads(out.read_text())
    assert rec["scratch_cnn_engine_samples_per_s"] > 0 and rec["scratch_cnn_loop_samples_per_s"] > 0
    assert not any(k.startswith(("trainer_", "scale_", "closedform_")) for k in rec)
    md = (tmp_path / "speed.md").read_text()
    assert "| cnn | fedavg mnist: 2 x 8 adam |" in md and "FlopCounterMode" in md
    for bad in (["--scratch-model", "resnet"], ["--scratch-repeat", "0"], ["--scratch-net", "fast"]):
        r = subprocess.run(
            base + bad + ["--out", str(tmp_path / "bad.json")],
            capture_output=True,
            text=True,
            cwd=repo,
            env=env,
            timeout=600,
        )
        assert r.returncode == 2 and bad[0] in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "bad.json").exists()
