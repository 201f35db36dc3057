"""Aggregation rules as protocol objects (fedhead.core.aggregate): one message + update per rule, summed the same way by
the simulator (client blocks) and a Flower server (one message at a time); a user's rule registered from outside
fedhead runs in `train`, the CLI, `bench baselines` and Flower."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import fedhead
from fedhead.core.aggregate import AGGREGATORS, Accumulator, Aggregator, fedavg, grouped
from fedhead.federation.config import TrainConfig
from fedhead.infra.errors import FedheadError, cli_names

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fedexp():
    """The docs' example rule (docs/extending.md), registered for one test (the registry is process-wide)."""
    import importlib

    mod = importlib.import_module("fedhead.examples.custom_method")
    AGGREGATORS["fedexp"] = mod.FedExP
    yield mod.FedExP
    AGGREGATORS.pop("fedexp", None)


def _random_round(seed=0, k=7, c=3, d=5):
    g = torch.Generator().manual_seed(seed)
    stacked = torch.randn(k, c, d, generator=g)
    sizes = torch.randint(1, 9, (k,), generator=g)
    holds = torch.rand(k, c, generator=g) > 0.5
    holds[:, 2] = False
    prev = torch.randn(c, d, generator=g)
    return stacked, sizes, holds, prev


@pytest.mark.parametrize("kind", ["fedavg", "grouped", "fedexp"])
def test_blocks_and_single_messages_give_the_same_head(kind, fedexp):
    stacked, sizes, holds, prev = _random_round()
    blocks = Accumulator(kind, prev)
    for b in range(0, 7, 3):
        blocks.add(stacked[b : b + 3], sizes[b : b + 3], holds[b : b + 3])
    one = Accumulator(kind, prev)  # a Flower server: one client's message at a time
    for k in reversed(range(7)):  # in any order
        msg = one.message(stacked[k : k + 1], sizes[k : k + 1], holds[k : k + 1])
        one.add_message(msg, sizes[k : k + 1], holds[k : k + 1])
    torch.testing.assert_close(blocks.finish(), one.finish(), atol=1e-6, rtol=1e-6)
    if kind != "fedexp":
        want = fedavg(stacked, sizes) if kind == "fedavg" else grouped(stacked, holds, prev)
        torch.testing.assert_close(blocks.finish(), want, atol=1e-6, rtol=1e-6)


def test_fedexp_step_by_hand(fedexp):
    # two clients moved by d1 = [2, 0], d2 = [0, 2] from theta = 0: mean [1, 1], sum ||d||^2 = 8,
    # step = max(1, 8 / (2 * 2 * (2 + 1e-4))) = 0.99995... -> 1: the plain mean; with d2 = -d1 the mean is 0
    theta = torch.zeros(1, 2)
    acc = Accumulator("fedexp", theta)
    acc.add(torch.tensor([[[2.0, 0.0]], [[0.0, 2.0]]]), torch.tensor([1, 1]), torch.ones(2, 1, dtype=torch.bool))
    torch.testing.assert_close(acc.finish(), torch.tensor([[1.0, 1.0]]))
    # d1 = [3, 1], d2 = [1, 3]: mean [2, 2] (||.||^2 = 8), sum ||d||^2 = 20: step max(1, 20 / (4 * 8.0001)) = 1
    # d1 = [4, 0], d2 = [0, 1]: mean [2, .5] (4.25), sum 17: step 17 / (4 * 4.2501) = 0.99998 -> 1
    # d1 = [1, 0], d2 = [-1, 0.5]: mean [0, .25] (0.0625), sum 2.25: step 2.25 / (4 * 0.0626) = 8.9856...
    acc = Accumulator("fedexp", theta)
    acc.add(torch.tensor([[[1.0, 0.0]], [[-1.0, 0.5]]]), torch.tensor([1, 1]), torch.ones(2, 1, dtype=torch.bool))
    step = 2.25 / (4 * (0.0625 + 1e-4))
    torch.testing.assert_close(acc.finish(), torch.tensor([[0.0, 0.25 * step]]))


def test_message_bytes_are_counted(fedexp, tiny_store, tmp_path):
    theta = torch.zeros(4, 9)
    assert Accumulator("fedavg", theta).agg.nbytes(theta) == 4 * 9 * 4  # the head's bytes
    assert fedexp().nbytes(theta) == 4 * 9 * 4 + 4  # the update and one float
    a = fedhead.run(TrainConfig(features=str(tiny_store), clients=3, rounds=2), out=tmp_path / "a")
    b = fedhead.run(TrainConfig(features=str(tiny_store), clients=3, rounds=2, aggregate="fedexp"), out=tmp_path / "b")
    assert b.rows[-1]["bytes_up_per_client"] == a.rows[-1]["bytes_up_per_client"] + 4


def test_unknown_or_malformed_rules_are_one_line_errors():
    with cli_names(), pytest.raises(FedheadError, match="--aggregate"):
        TrainConfig(features="x.h5", aggregate="nope").resolved()
    with pytest.raises(FedheadError, match="The 'aggregate' parameter"):
        TrainConfig(features="x.h5", aggregate="nope").resolved()
    with pytest.raises(FedheadError, match="subclass of fedhead.Aggregator"):
        fedhead.register_aggregator("bad")(object)

    class Shifty(Aggregator):
        def message(self, theta, trained, sizes, holds):
            return {"a" if len(sizes) > 1 else "b": trained}

        def update(self, previous, totals):
            return previous

    acc = Accumulator(Shifty(), torch.zeros(2, 2))
    acc.add(torch.zeros(2, 2, 2), torch.ones(2), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(FedheadError, match="same keys"):
        acc.add(torch.zeros(1, 2, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool))


@pytest.mark.slow
def test_readme_method_example_runs_as_written(tiny_store, tmp_path):
    """The aggregation-rule example of docs/extending.md, executed as a user would, then through the CLI and bench baselines
    with FEDHEAD_PLUGINS."""
    from conftest import run_example_with_plugin

    example = "fedhead/examples/custom_method.py"
    assert (REPO / example).read_text().rstrip("\n") in (REPO / "docs" / "extending.md").read_text()
    out = run_example_with_plugin(
        example, "fedhead.examples.custom_method", tiny_store, tmp_path, ["--aggregate", "fedexp"], "ova2-fedexp"
    )
    assert "ratio to central:" in out
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())["config"]
    assert cfg["aggregate"] == "fedexp"


def test_user_rule_on_flower_equals_train(fedexp, tmp_path):
    """The Flower client sends the rule's message, the server sums and updates: the simulator's numbers."""
    pytest.importorskip("flwr")
    from test_flower_sim import accs, cfg_of

    from fedhead.core.synthetic import write_synthetic
    from fedhead.federation.train import run_training
    from fedhead.flower.inprocess import run_in_process

    store = write_synthetic(tmp_path / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16)
    cfg = cfg_of(store, aggregate="fedexp", head="softmax")
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    res = run_in_process(cfg, tmp_path / "flower")  # the wire format: messages serialised
    np.testing.assert_allclose(accs(res.rows), accs(ref.rows), atol=1e-9)
    assert [r["bytes_total"] for r in res.rows] == [r["bytes_total"] for r in ref.rows]
    torch.testing.assert_close(
        torch.load(tmp_path / "flower" / "head-seed0.pt"),
        torch.load(tmp_path / "train" / "head-seed0.pt"),
        atol=1e-5,
        rtol=1e-5,
    )
