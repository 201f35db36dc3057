"""The dual form of local SGD (fedhead.core.dual) equals the loop backend in float64, for every iterative head and
every SGD option it covers; AdamW keeps the primal engine."""

import numpy as np
import pytest
import torch

from fedhead.core.aggregate import DPFedAvg
from fedhead.core.dual import dual_pays, rows_times_heads
from fedhead.core.engine import ClientSet, Engine, LocalConfig, OptimConfig, ScaffoldState
from fedhead.core.heads import create_head, iterative_head_names
from fedhead.infra.errors import FedheadError

SIZES = (1, 1, 3, 8, 17, 20, 33)  # one-sample clients, one batch exactly, short last batches (batch 8)


def toy(d=6, c=4, seed=0, dtype=torch.float64) -> ClientSet:
    rng = np.random.default_rng(seed)
    n = sum(SIZES)
    x = np.abs(rng.normal(size=(n, d)))
    y = rng.integers(0, c, n)
    parts = np.split(rng.permutation(n), np.cumsum(SIZES)[:-1])
    counts = np.stack([np.bincount(y[p], minlength=c) for p in parts])
    xt = torch.cat([torch.tensor(x, dtype=dtype), torch.ones(n, 1, dtype=dtype)], 1)
    return ClientSet(x=xt, y=torch.tensor(y), parts=parts, counts=counts, num_classes=c)


OPTIONS = {
    "plain": dict(optim=dict(momentum=0.0, weight_decay=0.0)),
    "momentum": dict(optim=dict(momentum=0.9, weight_decay=0.0)),
    "weight_decay": dict(optim=dict(momentum=0.0, weight_decay=0.05)),
    "recipe": dict(optim=dict(momentum=0.9, weight_decay=1e-4), aggregate="grouped"),
    "fedprox": dict(optim=dict(momentum=0.9, weight_decay=1e-3), prox_mu=0.3),
    "scaffold": dict(optim=dict(momentum=0.5, weight_decay=1e-3), scaffold=True),
    "local_steps": dict(optim=dict(momentum=0.9, weight_decay=1e-4), local=dict(steps=5), prox_mu=0.1),
    "one_epoch_dp": dict(optim=dict(momentum=0.9), local=dict(epochs=1), aggregate="dp"),
}


def theta0(data):
    shape = (data.num_classes, data.x.shape[1])
    return 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=data.x.dtype)


def run(data, head, backend, opt, rounds=2, **engine_kw):
    o = OPTIONS[opt]
    local = dict(epochs=3, batch_size=8) | o.get("local", {})
    optim = OptimConfig(name="sgd", lr=0.2, **o["optim"])
    eng = Engine(data, head, optim, LocalConfig(**local), backend=backend, **engine_kw)
    C, D1 = data.num_classes, data.x.shape[1]
    theta = theta0(data)
    scaffold = ScaffoldState.zeros(len(data.parts), C, D1, "cpu", dtype=data.x.dtype) if o.get("scaffold") else None
    agg = o.get("aggregate", "fedavg")
    stats = []
    for rnd in range(1, rounds + 1):
        rule = DPFedAvg(clip=0.5, noise_multiplier=0.0) if agg == "dp" else agg
        theta, st = eng.run_round(
            theta, np.arange(len(data.parts)), 7, rnd, rule, prox_mu=o.get("prox_mu", 0.0), scaffold=scaffold
        )
        stats.append(st)
    return theta, stats, scaffold


@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("head", iterative_head_names())
def test_dual_equals_loop_in_float64(head, opt):
    data = toy()
    h = create_head(head, positive_keep=0.6)
    ref, _, sc_ref = run(data, h, "loop", opt)
    got, stats, sc_got = run(data, h, "vectorized", opt, dual="on", block_clients=3)
    assert all(s.dual_clients == len(SIZES) for s in stats)  # the dual form ran for every client
    assert (ref - theta0(data)).abs().max() > 1e-2  # something was learnt
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    if sc_ref is not None:
        assert sc_ref.c.abs().max() > 1e-3
        torch.testing.assert_close(sc_got.c, sc_ref.c, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(sc_got.ck, sc_ref.ck, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("C", [5, 64, 67, 203])
def test_rows_times_heads_is_the_plain_product(C):
    # 67 and 203 take the padded product (C >= 64, not a multiple of 8); 5 and 64 the plain one
    g = torch.Generator().manual_seed(C)
    x, w = torch.randn(40, 33, generator=g, dtype=torch.float64), torch.randn(C, 33, generator=g, dtype=torch.float64)
    got = rows_times_heads(x, w)
    assert got.shape == (40, C) and got.is_contiguous()
    torch.testing.assert_close(got, x @ w.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("head", ["ova2", "softmax"])
def test_dual_equals_loop_with_many_classes(head):
    # 67 classes: the block's X theta^T goes through the padded product
    data = toy(d=9, c=67, seed=4)
    h = create_head(head)
    ref, _, _ = run(data, h, "loop", "recipe")
    got, stats, _ = run(data, h, "vectorized", "recipe", dual="on")
    assert all(s.dual_clients == len(SIZES) for s in stats)
    assert (ref - theta0(data)).abs().max() > 1e-2
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_losses_match_the_loop():
    data = toy()
    h = create_head("ova2")
    _, ref, _ = run(data, h, "loop", "recipe")
    _, got, _ = run(data, h, "vectorized", "recipe", dual="on")
    for a, b in zip(ref, got):
        assert a.clients == b.clients == len(SIZES)
        assert abs(a.loss_sum - b.loss_sum) < 1e-10 * abs(a.loss_sum)


def test_memory_budget_blocks_do_not_change_the_result():
    data = toy()
    h = create_head("softmax")
    one, _, _ = run(data, h, "vectorized", "fedprox", dual="on")
    eng = Engine(data, h, OptimConfig(name="sgd"), LocalConfig(), dual="on", memory_budget_mb=1e-3)
    assert [len(b) for b in eng.dual_blocks(list(range(len(SIZES))))] == [1] * len(SIZES)  # smallest first
    many, _, _ = run(data, h, "vectorized", "fedprox", dual="on", memory_budget_mb=1e-3)
    torch.testing.assert_close(one, many, rtol=1e-10, atol=1e-12)


def test_which_path_runs():
    data = toy(dtype=torch.float32)  # the primal vectorized engine runs float32
    h = create_head("ova2")
    sel = np.arange(len(SIZES))
    theta = torch.zeros(data.num_classes, data.x.shape[1])

    def dual_count(optim, **kw):
        eng = Engine(data, h, OptimConfig(name=optim), LocalConfig(batch_size=8), **kw)
        return eng.run_round(theta, sel, 0, 1, "fedavg")[1].dual_clients

    assert dual_count("adamw", dual="on") == 0  # AdamW is not closed under the dual form
    assert dual_count("sgd", dual="on") == len(SIZES)
    assert dual_count("sgd", dual="off") == 0
    assert dual_count("sgd", dual="on", backend="loop") == 0  # the loop backend stays the reference
    # auto: 2 n <= D+1 (D+1 = 7 here): the clients of 1, 1 and 3 samples
    assert dual_count("sgd") == sum(1 for n in SIZES if dual_pays(n, 7)) == 3


def test_auto_mixes_dual_and_primal_clients_in_one_round():
    data = toy(dtype=torch.float32)
    h = create_head("ova2")
    sel = np.arange(len(SIZES))
    theta = 0.1 * torch.randn(data.num_classes, data.x.shape[1], generator=torch.Generator().manual_seed(3))
    out = {}
    for mode in ("auto", "off"):
        eng = Engine(data, h, OptimConfig(name="sgd", lr=0.2), LocalConfig(batch_size=8), dual=mode)
        out[mode], st = eng.run_round(theta, sel, 0, 2, "fedavg")
        assert st.dual_clients == (3 if mode == "auto" else 0)
    torch.testing.assert_close(out["auto"], out["off"], rtol=1e-5, atol=1e-6)


def test_bad_dual_mode_is_refused():
    data = toy()
    with pytest.raises(FedheadError, match="--dual"):
        Engine(data, create_head("ova2"), OptimConfig(name="sgd"), LocalConfig(), dual="always")


def test_cross_device_bench_child_smoke():
    """``fedhead bench speed``'s cross-device row on a tiny shape, in-process: both heads' rounds ran, mostly in the
    dual form, and the statistics exchange was timed; the table prints the row."""
    import json

    from fedhead.bench.speed import cross_device_speed, speed_table

    shape = dict(classes=6, per_class=5, dim=8, clients=10, alpha=0.1, threads=1)
    it = cross_device_speed(dict(shape, part="iterative"))
    cf = cross_device_speed(dict(shape, part="closedform"))
    assert it["crossdevice_samples"] == 30
    for head in ("ova2", "softmax"):
        assert it[f"crossdevice_{head}_s_per_round"] > 0
        assert 0 < it[f"crossdevice_{head}_dual_clients"] <= 10  # clients of at most 4 samples (2 n <= D+1 = 9)
    assert it["crossdevice_ova2_round1_s"] > 0 and it["crossdevice_peak_mb"] > 0
    assert cf["crossdevice_closedform_s"] > 0 and cf["crossdevice_closedform_peak_mb"] > 0
    rec = dict(it, **cf, bench_quick=True, bench_device="cpu", bench_load_before="0")
    rec["crossdevice_ova2_vs_closedform"] = rec["crossdevice_ova2_s_per_round"] / rec["crossdevice_closedform_s"]
    json.dumps(rec)
    from rich.console import Console

    con = Console(record=True, width=250)
    con.print(speed_table(rec))
    assert "cross-device: ova2 s/round" in con.export_text()
