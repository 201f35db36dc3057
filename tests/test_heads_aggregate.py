"""Exact numbers on toy data for every loss and every aggregator (cases worked by hand)."""

import math

import pytest
import torch

from fedhead.core.aggregate import Accumulator, fedavg, grouped
from fedhead.core.heads import HEADS, LossContext, create_head, iterative_head_names
from fedhead.infra.errors import FedheadError


def ctx_for(counts, u=None, rnd=2):
    counts = torch.tensor(counts, dtype=torch.float32)[None]
    return LossContext(round=rnd, present=counts > 0, counts=counts, u=torch.tensor([[0.0 if u is None else u]]))


# one sample, C = 2, logits s = [0, ln 3], label 0: sigma(s) = [1/2, 3/4]
S = torch.tensor([[[0.0, math.log(3.0)]]])
Y = torch.tensor([[0]])
M = torch.ones(1, 1)


@pytest.mark.parametrize(
    "name,params,counts,rnd,u,expected",
    [
        ("softmax", {}, [2, 0], 2, None, math.log(4)),  # -log(1/(1+3))
        ("ova", {}, [2, 0], 2, None, math.log(2) + math.log(4)),  # BCE(0,1) + BCE(ln3,0)
        ("ova2", {}, [2, 0], 1, None, math.log(2)),  # stage 1: positive only
        ("ova2", {}, [2, 0], 2, None, math.log(8)),  # stage 2: plain OvA
        ("ova2", {"positive_keep": 0.5}, [2, 0], 2, 0.7, math.log(4)),  # positive term dropped (u >= rho)
        ("ova2", {"positive_keep": 0.5}, [2, 0], 2, 0.2, math.log(8)),  # positive term kept (u < rho)
        ("ova2", {"stage1_rounds": 3}, [2, 0], 3, None, math.log(2)),
        # FedABC: pos (q0=.5 < .85): (1-.5)^2 * log 2; class 1 absent, q1=.75 > .3: .75^2 * log 4
        ("fedabc", {}, [2, 0], 2, None, 0.25 * math.log(2) + 0.5625 * math.log(4)),
        ("fedabc", {"fedabc_margins": "0.4,0.2,0.3"}, [2, 0], 2, None, 0.5625 * math.log(4)),  # q0 >= mp: no pos
        ("fedabc", {"fedabc_margins": "0.85,0.8,0.3"}, [2, 1], 2, None, 0.25 * math.log(2)),  # present neg q1 < mn
        ("fedabc", {"fedabc_margins": "0.85,0.2,0.8"}, [2, 0], 2, None, 0.25 * math.log(2)),  # absent neg q1 < mnn
        # FedRS alpha .5: scale = [1, .5] -> logits [0, .5 ln 3] -> log(1 + sqrt 3)
        ("fedrs", {}, [2, 0], 2, None, math.log(1 + math.sqrt(3))),
        ("fedrs", {"fedrs_alpha": 1.0}, [2, 0], 2, None, math.log(4)),
    ],
)
def test_loss_exact(name, params, counts, rnd, u, expected):
    head = create_head(name, **params)
    got = head.loss(S, Y, M, ctx_for(counts, u, rnd))
    assert got.shape == (1,)
    assert float(got[0]) == pytest.approx(expected, rel=1e-6)


def test_loss_is_mean_over_valid_samples_per_client():
    head = create_head("ova")
    logits = torch.zeros(2, 3, 4)
    y = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logits[0, 2] = 100.0  # padding: must not count
    c = torch.ones(2, 4)
    ctx = LossContext(round=2, present=c > 0, counts=c, u=torch.zeros(2, 3))
    got = head.loss(logits, y, mask, ctx)
    assert torch.allclose(got, torch.full((2,), 4 * math.log(2)))


def test_every_registered_head_has_doc_and_gradient():
    assert all(HEADS[name].doc for name in HEADS)  # closed-form heads included
    for name in iterative_head_names():
        logits = torch.randn(3, 5, 4, requires_grad=True)
        y = torch.randint(0, 4, (3, 5))
        c = torch.ones(3, 4)
        loss = create_head(name).loss(logits, y, torch.ones(3, 5), LossContext(2, c > 0, c, torch.rand(3, 5)))
        loss.sum().backward()
        assert torch.isfinite(logits.grad).all()


def test_bad_head_params():
    with pytest.raises(FedheadError, match="--positive-keep"):
        create_head("ova2", positive_keep=1.5)
    with pytest.raises(FedheadError, match="--fedabc-margins"):
        create_head("fedabc", fedabc_margins="0.9,0.2")
    with pytest.raises(FedheadError, match="--head"):
        create_head("ovaa")


# 3 clients, 2 classes, 1 feature: W1 = [1, 2], W2 = [3, 4], W3 = [5, 6]
W = torch.tensor([[[1.0], [2.0]], [[3.0], [4.0]], [[5.0], [6.0]]])
SIZES = torch.tensor([1, 2, 1])
HOLDS = torch.tensor([[True, False], [True, True], [False, False]])


def test_fedavg_exact():
    # (1*W1 + 2*W2 + 1*W3) / 4 = [(1+6+5)/4, (2+8+6)/4]
    assert torch.equal(fedavg(W, SIZES), torch.tensor([[3.0], [4.0]]))


def test_grouped_exact():
    prev = torch.tensor([[0.0], [9.0]])
    # row 0: mean(W1, W2) = 2; row 1: W2 only = 4
    assert torch.equal(grouped(W, HOLDS, prev), torch.tensor([[2.0], [4.0]]))
    # a row nobody trained keeps its previous value
    holds = torch.tensor([[True, False], [False, False], [True, False]])
    assert torch.equal(grouped(W, holds, prev), torch.tensor([[3.0], [9.0]]))


@pytest.mark.parametrize("kind", ["fedavg", "grouped"])
def test_accumulator_in_blocks_equals_pure_function(kind):
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(7, 3, 5, generator=g)
    sizes = torch.randint(1, 9, (7,), generator=g)
    holds = torch.rand(7, 3, generator=g) > 0.5
    holds[:, 2] = False
    prev = torch.randn(3, 5, generator=g)
    acc = Accumulator(kind, prev)
    for b in range(0, 7, 3):
        acc.add(stacked[b : b + 3], sizes[b : b + 3], holds[b : b + 3])
    got = acc.finish()
    want = fedavg(stacked, sizes) if kind == "fedavg" else grouped(stacked, holds, prev)
    assert torch.allclose(got, want, atol=1e-6)


def test_store_writer_restarts_a_partial_killed_during_creation(tmp_path):
    import h5py
    import numpy as np

    from extract.store import FORMAT, StoreWriter, load_store, partial_path

    out = tmp_path / "s.h5"
    req = {"a": 1}
    with h5py.File(partial_path(out), "w") as f:  # header written, groups never created
        f.attrs["format"] = FORMAT
        f.attrs["request"] = '{"a": 1}'
    x = np.ones((3, 2), dtype=np.float32)
    y = np.arange(3)
    with StoreWriter(
        out,
        request=req,
        sizes={"train": 3, "test": 3},
        feature_dim=2,
        class_names=["a", "b", "c"],
        attrs={"dataset": "t"},
        dtype="float32",
    ) as w:
        w.append("train", x, y)
        w.append("test", x, y)
        w.finish()
    assert load_store(out).train_x.shape == (3, 2)
