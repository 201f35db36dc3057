"""Server optimisers: hand-worked numbers, FedAvg pass-through, equality with Flower, checkpoints, errors."""

import math
import random

import numpy as np
import pytest
import torch
from conftest import crash_at

from fedhead.core.aggregate import fedavg
from fedhead.core.serveropt import SERVER_OPTS, ServerOptConfig, ServerOptimizer
from fedhead.federation.rundir import CHECKPOINT, read_state
from fedhead.infra.errors import FedheadError

CPU = torch.device("cpu")
F64 = torch.float64


def t64(rows):
    return torch.tensor(rows, dtype=F64)


P0 = t64([[0, 1, 2], [-1, 0, 4]])  # the 2x3 toy head before round 1


def run(cfg, deltas, dtype=F64):
    """Rounds where the clients' aggregate moves the current global head by ``deltas[r]``."""
    opt = ServerOptimizer(cfg, (2, 3), CPU, dtype)
    w, outs = P0.to(dtype), []
    for d in deltas:
        w = opt.step(w, w + d.to(dtype))
        outs.append(w)
    return outs


def close(a, b):
    return torch.allclose(a, b, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ 1. hand-worked numbers


def test_fedavgm_momentum_by_hand():
    # lr .5, momentum .5; pseudo-gradient g = x - a = -D; u1 = g1; u_t = .5 u_{t-1} + g_t; x <- x - .5 u
    d1, d2, d3 = t64([[2, -4, 0], [1, 2, -2]]), t64([[2, 0, -4], [1, 1, 2]]), torch.zeros(2, 3, dtype=F64)
    w1, w2, w3 = run(ServerOptConfig("fedavgm", lr=0.5, momentum=0.5), [d1, d2, d3])
    # u1 = [[-2,4,0],[-1,-2,2]]             -> x1 = P0 - .5 u1
    assert torch.equal(w1, t64([[1, -1, 2], [-0.5, 1, 3]]))
    # u2 = .5 u1 - D2 = [[-3,2,4],[-1.5,-2,-1]] -> x2 = x1 - .5 u2
    assert torch.equal(w2, t64([[2.5, -2, 0], [0.25, 2, 3.5]]))
    # clients do not move (D3 = 0) but momentum carries on: u3 = .5 u2 = [[-1.5,1,2],[-.75,-1,-.5]]
    assert torch.equal(w3, t64([[3.25, -2.5, -1], [0.625, 2.5, 3.75]]))


def test_fedavgm_lr_without_momentum_by_hand():
    (w1,) = run(ServerOptConfig("fedavgm", lr=2.0), [t64([[2, -4, 0], [1, 2, -2]])])
    assert torch.equal(w1, t64([[4, -7, 2], [1, 4, 0]]))  # P0 + 2 D1


def test_fedadagrad_by_hand():
    # lr 2, tau 1: m = D, v += D^2, x <- x + 2 m / (sqrt v + 1); Pythagorean triples keep sqrt v whole
    d1, d2 = t64([[3, -4, 0], [1, 0, 12]]), t64([[4, 3, 2], [0, -1, 5]])
    w1, w2 = run(ServerOptConfig("fedadagrad", lr=2.0, tau=1.0), [d1, d2])
    # sqrt v1 + 1 = [[4,5,1],[2,1,13]]
    x1 = t64([[1.5, 1 - 1.6, 2], [-1 + 1, 0, 4 + 24 / 13]])
    assert close(w1, x1)
    # v2 = [[25,25,4],[1,1,169]] -> sqrt v2 + 1 = [[6,6,3],[2,2,14]]
    assert close(w2, x1 + 2 * t64([[4 / 6, 3 / 6, 2 / 3], [0, -1 / 2, 5 / 14]]))


def test_fedyogi_by_hand():
    # lr .5, betas (.5, .75), tau 1: m = .5 m + .5 D; v = v - .25 D^2 sign(v - D^2); x <- x + .5 m / (sqrt v + 1)
    d1, d2 = t64([[6, -2, 0], [26, -4, 8]]), t64([[8, 1, 0], [10, 0, 6]])
    w1, w2 = run(ServerOptConfig("fedyogi", lr=0.5, betas=(0.5, 0.75), tau=1.0), [d1, d2])
    # v1 = .25 D1^2 = [[9,1,0],[169,4,16]] (sqrt [[3,1,0],[13,2,4]]); m1 = [[3,-1,0],[13,-2,4]]
    x1 = P0 + 0.5 * t64([[3 / 4, -1 / 2, 0], [13 / 14, -2 / 3, 4 / 5]])
    assert close(w1, x1)
    # sign(v1 - D2^2) = [[-1,0,0],[1,1,-1]] -> v2 = [[25,1,0],[144,4,25]] (sqrt [[5,1,0],[12,2,5]])
    # m2 = [[5.5,0,0],[11.5,-1,5]]; element [0,2] never moves: m = v = 0 -> step 0
    assert close(w2, x1 + 0.5 * t64([[5.5 / 6, 0, 0], [11.5 / 13, -1 / 3, 5 / 6]]))


def test_fedadam_by_hand():
    # lr .75, betas (.5, .96), tau 1; Flower's step size eta_t = lr sqrt(1 - b2^(t+1)) / (1 - b1^(t+1))
    d1, d2 = t64([[5, -10, 0], [15, 20, -5]]), t64([[5, 0, 10], [-5, 0, 5]])
    w1, w2 = run(ServerOptConfig("fedadam", lr=0.75, betas=(0.5, 0.96), tau=1.0), [d1, d2])
    # eta_1 = .75 * sqrt(1 - .9216) / (1 - .25) = .28; m1 = .5 D1; v1 = .04 D1^2 = [[1,4,0],[9,16,1]]
    # update1 = .28 * m1 / (sqrt v1 + 1) = .28 * [[1.25, -5/3, 0],[1.875, 2, -1.25]]
    x1 = P0 + t64([[0.35, -7 / 15, 0], [0.525, 0.56, -0.35]])
    assert close(w1, x1)
    # m2 = .5 m1 + .5 D2; v2 = .96 v1 + .04 D2^2; eta_2 = .75 * sqrt(1 - .96^3) / (1 - .125)
    m2 = t64([[3.75, -2.5, 5], [1.25, 5, 1.25]])
    v2 = t64([[1.96, 3.84, 4], [9.64, 15.36, 1.96]])
    eta2 = 0.75 * math.sqrt(1 - 0.96**3) / (1 - 0.5**3)
    assert close(w2, x1 + eta2 * m2 / (v2.sqrt() + 1))


def test_flower_defaults():
    r = {n: ServerOptConfig(n).resolved() for n in SERVER_OPTS}
    assert (r["fedavg"].lr, r["fedavg"].momentum, r["fedavg"].betas, r["fedavg"].tau) == (None, None, None, None)
    assert (r["fedavgm"].lr, r["fedavgm"].momentum) == (1.0, 0.0)
    assert (r["fedadam"].lr, r["fedadam"].betas, r["fedadam"].tau) == (0.1, (0.9, 0.99), 1e-3)
    assert (r["fedyogi"].lr, r["fedyogi"].betas, r["fedyogi"].tau) == (0.01, (0.9, 0.99), 1e-3)
    assert (r["fedadagrad"].lr, r["fedadagrad"].betas, r["fedadagrad"].tau) == (0.1, None, 1e-3)
    # user values survive, normalised to floats
    c = ServerOptConfig("fedadam", lr=1, betas=[0, 0.5], tau=2).resolved()
    assert (c.lr, c.betas, c.tau) == (1.0, (0.0, 0.5), 2.0)


def test_output_keeps_head_dtype():
    opt = ServerOptimizer(ServerOptConfig("fedadam"), (2, 3), CPU)
    out = opt.step(P0.float(), P0.float() + 1)
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    assert opt.state_dict()["m"].dtype == F64


# ------------------------------------------------------------------ 2. fedavg passes the aggregate through


@pytest.mark.parametrize(
    "cfg", [ServerOptConfig("fedavg"), ServerOptConfig("fedavgm"), ServerOptConfig("fedavgm", lr=1.0, momentum=0.0)]
)
def test_inactive_returns_aggregate_bit_for_bit(cfg):
    g = torch.Generator().manual_seed(0)
    opt = ServerOptimizer(cfg, (4, 5), CPU)
    prev = torch.randn(4, 5, generator=g)
    for _ in range(3):
        agg = torch.randn(4, 5, generator=g) * 1e-3 + prev
        out = opt.step(prev, agg)
        assert out is agg and torch.equal(out, agg)
        prev = out
    assert opt.state_dict()["step"] == 3


def test_step_checks_shape():
    opt = ServerOptimizer(ServerOptConfig("fedyogi"), (2, 3), CPU)
    with pytest.raises(ValueError, match="shape"):
        opt.step(torch.zeros(3, 2), torch.zeros(3, 2))


# ------------------------------------------------------------------ 3. equality with Flower's strategies


ROUNDS, K, C, D1 = 3, 3, 4, 6
SIZES = [10, 35, 55]


def client_heads(dtype):
    """Initial global head and, per round, K absolute client heads (the same inputs for both sides)."""
    rng = np.random.default_rng(7)
    w0 = rng.normal(size=(C, D1))
    drift = 0.0
    rounds = []
    for _ in range(ROUNDS):
        drift = drift + rng.normal(scale=0.1, size=(C, D1))
        rounds.append([w0 + drift + rng.normal(scale=0.05, size=(C, D1)) for _ in range(K)])
    return w0.astype(dtype), [[h.astype(dtype) for h in r] for r in rounds]


FLOWER_CASES = [
    ("fedavgm", {}, {}),
    ("fedavgm", {"lr": 1.0, "momentum": 0.9}, {"server_learning_rate": 1.0, "server_momentum": 0.9}),
    ("fedavgm", {"lr": 0.5}, {"server_learning_rate": 0.5}),
    ("fedavgm", {"lr": 1.5, "momentum": 0.5}, {"server_learning_rate": 1.5, "server_momentum": 0.5}),
    ("fedadam", {}, {}),
    (
        "fedadam",
        {"lr": 0.05, "betas": (0.8, 0.95), "tau": 1e-2},
        {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-2},
    ),
    ("fedyogi", {}, {}),
    ("fedyogi", {"lr": 0.1, "betas": (0.5, 0.9), "tau": 1e-2}, {"eta": 0.1, "beta_1": 0.5, "beta_2": 0.9, "tau": 1e-2}),
    ("fedadagrad", {}, {}),
    ("fedadagrad", {"lr": 0.3, "tau": 1e-2}, {"eta": 0.3, "tau": 1e-2}),
]


@pytest.fixture
def flower_task_identity():
    """Flower's Message constructor reads the process's task identity (a SuperLink sets it; so do we)."""
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:  # older Flower: no task identity needed
        yield
        return
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def flower_rounds(name, flower_kwargs, w0, rounds):
    """Drive Flower's own strategy through configure_train / aggregate_train as its ``start`` loop does."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp import strategy as fs

    cls = {"fedavgm": fs.FedAvgM, "fedadam": fs.FedAdam, "fedyogi": fs.FedYogi, "fedadagrad": fs.FedAdagrad}[name]
    strat = cls(min_train_nodes=K, min_available_nodes=K, **flower_kwargs)
    nodes = [101 + k for k in range(K)]

    class Grid:  # only what configure_train reads
        def get_node_ids(self):
            return list(nodes)

    arrays = ArrayRecord({"head": Array(w0)})
    outs = []
    saved = random.getstate()
    random.seed(0)  # Flower samples nodes with `random`: fix the order of its float sums (state restored below)
    try:
        for rnd, heads in enumerate(rounds, start=1):
            instructions = list(strat.configure_train(rnd, arrays, ConfigRecord(), Grid()))
            assert len(instructions) == K
            replies = []
            for msg in instructions:
                k = nodes.index(msg.metadata.dst_node_id)
                content = RecordDict(
                    {
                        "arrays": ArrayRecord({"head": Array(heads[k])}),
                        "metrics": MetricRecord({"num-examples": SIZES[k]}),
                    }
                )
                replies.append(Message(content, reply_to=msg))
            arrays, _ = strat.aggregate_train(rnd, replies)
            outs.append(np.asarray(arrays["head"].numpy(), dtype=np.float64))
    finally:
        random.setstate(saved)
    return outs


def fedhead_rounds(name, kwargs, w0, rounds, dtype):
    opt = ServerOptimizer(ServerOptConfig(name, **kwargs), (C, D1), CPU, dtype)
    sizes = torch.tensor(SIZES)
    w = torch.from_numpy(w0)
    outs = []
    for heads in rounds:
        agg = fedavg(torch.from_numpy(np.stack(heads)), sizes)
        w = opt.step(w, agg)
        assert w.dtype == dtype
        outs.append(w.double().numpy())
    return outs


@pytest.mark.parametrize(
    "np_dtype,torch_dtype,rtol,atol",
    [(np.float64, torch.float64, 1e-9, 1e-12), (np.float32, torch.float32, 1e-5, 1e-6)],
    ids=["float64", "float32"],
)
@pytest.mark.parametrize(
    "name,kwargs,flower_kwargs",
    FLOWER_CASES,
    ids=[f"{n}-{'default' if not k else 'custom'}{i}" for i, (n, k, _) in enumerate(FLOWER_CASES)],
)
def test_equals_flower(name, kwargs, flower_kwargs, np_dtype, torch_dtype, rtol, atol, flower_task_identity):
    pytest.importorskip("flwr")
    pytest.importorskip("flwr.serverapp.strategy")
    if np_dtype == np.float32:
        # The FedOpt step x + lr m / (sqrt v + tau) amplifies an error in the pseudo-gradient by up to lr / tau
        # (an element whose delta is << tau); float32 aggregation differs by a few ulp between Flower's summation
        # and fedhead's, so the absolute tolerance scales with lr / tau (float64 above stays tight).
        r = ServerOptConfig(name, **kwargs).resolved()
        atol *= max(1.0, r.lr / r.tau) if r.tau else 1.0
    w0, rounds = client_heads(np_dtype)
    ours = fedhead_rounds(name, kwargs, w0, rounds, torch_dtype)
    theirs = flower_rounds(name, flower_kwargs, w0, rounds)
    prev = w0.astype(np.float64)
    for rnd, (a, b) in enumerate(zip(ours, theirs), start=1):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{name} round {rnd}")
        assert not np.allclose(a, prev, rtol=0, atol=1e-4)  # the head did move: not a vacuous comparison
        prev = a


# ------------------------------------------------------------------ 4. checkpoints


@pytest.mark.parametrize(
    "cfg",
    [
        ServerOptConfig("fedavg"),
        ServerOptConfig("fedavgm", lr=0.7, momentum=0.9),
        ServerOptConfig("fedavgm", lr=0.5),
        ServerOptConfig("fedadam"),
        ServerOptConfig("fedyogi"),
        ServerOptConfig("fedadagrad"),
    ],
    ids=lambda c: f"{c.name}-{c.momentum}",
)
def test_state_dict_round_trip(cfg, tmp_path):
    g = torch.Generator().manual_seed(1)
    prev0 = torch.randn(3, 5, generator=g)
    aggs = [torch.randn(3, 5, generator=g) * 0.1 for _ in range(4)]  # offsets from the current head

    full = ServerOptimizer(cfg, (3, 5), CPU)
    w = prev0
    for a in aggs:
        w = full.step(w, w + a)

    first = ServerOptimizer(cfg, (3, 5), CPU)
    v = prev0
    for a in aggs[:2]:
        v = first.step(v, v + a)
    torch.save(first.state_dict(), tmp_path / "opt.pt")
    del first
    resumed = ServerOptimizer(cfg, (3, 5), CPU)
    resumed.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert resumed.state_dict()["step"] == 2
    for a in aggs[2:]:
        v = resumed.step(v, v + a)
    assert torch.equal(v, w)
    sd_full, sd_res = full.state_dict(), resumed.state_dict()
    assert sd_full.keys() == sd_res.keys()
    for k in sd_full:
        assert torch.equal(sd_full[k], sd_res[k]) if torch.is_tensor(sd_full[k]) else sd_full[k] == sd_res[k]


def test_load_state_dict_rejects_other_optimiser():
    sd = ServerOptimizer(ServerOptConfig("fedadam"), (2, 3), CPU).state_dict()
    with pytest.raises(FedheadError, match="--server-opt"):
        ServerOptimizer(ServerOptConfig("fedyogi"), (2, 3), CPU).load_state_dict(sd)
    sd = ServerOptimizer(ServerOptConfig("fedadam"), (2, 4), CPU).state_dict()
    with pytest.raises(FedheadError, match="shape"):
        ServerOptimizer(ServerOptConfig("fedadam"), (2, 3), CPU).load_state_dict(sd)


# ------------------------------------------------------------------ 5. bad values


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"name": "fedsgd"}, "--server-opt"),
        ({"name": "FedAdam"}, "--server-opt"),
        ({"name": "fedadam", "lr": 0}, "--server-lr"),
        ({"name": "fedavgm", "lr": -0.1}, "--server-lr"),
        ({"name": "fedyogi", "lr": float("nan")}, "--server-lr"),
        ({"name": "fedavgm", "momentum": 1.0}, "--server-momentum"),
        ({"name": "fedavgm", "momentum": -0.5}, "--server-momentum"),
        ({"name": "fedadam", "betas": (1.0, 0.99)}, "--server-betas"),
        ({"name": "fedyogi", "betas": (0.9, -0.01)}, "--server-betas"),
        ({"name": "fedadam", "betas": (0.9,)}, "--server-betas"),
        ({"name": "fedadam", "betas": "0.9,0.99"}, "--server-betas"),
        ({"name": "fedadam", "tau": 0}, "--server-tau"),
        ({"name": "fedadagrad", "tau": -1e-3}, "--server-tau"),
        # a parameter the chosen optimiser has no use for is rejected, not silently ignored
        ({"name": "fedavg", "lr": 0.5}, "--server-lr"),
        ({"name": "fedadam", "momentum": 0.9}, "--server-momentum"),
        ({"name": "fedadagrad", "betas": (0.9, 0.99)}, "--server-betas"),
        ({"name": "fedavgm", "tau": 1e-3}, "--server-tau"),
    ],
)
def test_bad_values_name_the_flag(kwargs, flag):
    cfg = ServerOptConfig(**kwargs)
    with pytest.raises(FedheadError) as exc:
        cfg.resolved()
    msg = str(exc.value)
    assert flag in msg and "\n" not in msg
    with pytest.raises(FedheadError, match=flag):
        ServerOptimizer(cfg, (2, 3), CPU)


def test_unknown_name_lists_choices():
    with pytest.raises(FedheadError) as exc:
        ServerOptConfig("adam").resolved()
    assert all(n in str(exc.value) for n in SERVER_OPTS)


# ------------------------------------------------------------------ 6. a user's stateful server update (docs)


@pytest.fixture
def fedams():
    """The docs' example server optimiser (docs/extending.md), registered for one test (the registry is process-wide)."""
    import importlib

    from fedhead.core.serveropt import SERVER_OPTIMIZERS

    mod = importlib.import_module("fedhead.examples.custom_server")
    SERVER_OPTIMIZERS["fedams"] = mod.FedAMS
    yield mod.FedAMS
    SERVER_OPTIMIZERS.pop("fedams", None)


def test_user_server_optimizer_step_by_hand(fedams):
    # d1 = [2], d2 = [-1] from x = 0; beta (0.5, 0.5), lr 1, tau 1: v_max keeps the first round's larger v
    opt = ServerOptimizer(ServerOptConfig("fedams", lr=1.0, betas=(0.5, 0.5), tau=1.0), (1, 1), CPU)
    assert isinstance(opt, fedams)
    w1 = opt.step(torch.zeros(1, 1), torch.full((1, 1), 2.0))
    m1, v1 = 1.0, 2.0  # m = 0.5 * 2, v = 0.5 * 4
    assert float(w1) == pytest.approx(m1 / (math.sqrt(v1) + 1))
    w2 = opt.step(w1, w1 - 1.0)
    m2, v2 = 0.5 * m1 - 0.5, 0.5 * v1 + 0.5  # v falls to 1.5; v_max stays 2
    assert float(w2) == pytest.approx(float(w1) + m2 / (math.sqrt(max(v1, v2)) + 1))
    sd = opt.state_dict()
    assert sd["name"] == "fedams" and sd["step"] == 2 and float(sd["v_max"]) == pytest.approx(2.0)
    with pytest.raises(FedheadError, match="--server-momentum"):
        ServerOptConfig("fedams", momentum=0.9).resolved()  # a parameter it does not declare


def _cut_and_resume(store, tmp_path, monkeypatch, **kw):
    """A 4-round run, the same run cut at its 3rd evaluation and resumed: (uninterrupted, checkpoint, resumed)."""
    import fedhead.federation.job as job_module
    from fedhead.federation.config import TrainConfig
    from fedhead.federation.train import run_training

    def cfg():
        return TrainConfig(features=str(store), clients=8, rounds=4, local_epochs=1, batch_size=16, device="cpu", **kw)

    full = run_training(cfg(), out=tmp_path / "full", progress=False)
    restore = crash_at(monkeypatch, job_module, "evaluate", 3)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg(), out=tmp_path / "cut", progress=False)
    restore()
    ck = read_state(tmp_path / "cut" / CHECKPOINT)
    return full, ck, run_training(cfg(), out=tmp_path / "cut", resume=True, progress=False)


def test_user_server_optimizer_resumes_with_its_state(fedams, tiny_store, tmp_path, monkeypatch):
    """A run with the user's optimiser, cut after round 2 and resumed, equals the uninterrupted one (its v_max is
    in the checkpoint)."""
    full, ck, res = _cut_and_resume(tiny_store, tmp_path, monkeypatch, server_opt="fedams", server_lr=0.05)
    assert ck["current"]["server"]["opt"]["name"] == "fedams" and "v_max" in ck["current"]["server"]["opt"]
    assert [r["accuracy"] for r in res.rows] == [r["accuracy"] for r in full.rows]


@pytest.mark.slow
def test_readme_server_example_runs_as_written(tiny_store, tmp_path):
    """The server-optimiser example of docs/extending.md, executed as a user would, then through the CLI and bench baselines
    with FEDHEAD_PLUGINS."""
    from pathlib import Path

    from conftest import run_example_with_plugin

    repo = Path(__file__).resolve().parents[1]
    example = "fedhead/examples/custom_server.py"
    assert (repo / example).read_text().rstrip("\n") in (repo / "docs" / "extending.md").read_text()
    out = run_example_with_plugin(
        example, "fedhead.examples.custom_server", tiny_store, tmp_path, ["--server-opt", "fedams"], "ova2-fedams"
    )
    assert "ratio to central:" in out


def test_user_server_optimizer_on_flower_equals_train(fedams, tmp_path):
    pytest.importorskip("flwr")
    from test_flower_sim import accs, cfg_of

    from fedhead.core.synthetic import write_synthetic
    from fedhead.federation.train import run_training
    from fedhead.flower.inprocess import run_in_process

    store = write_synthetic(tmp_path / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16)
    cfg = cfg_of(store, server_opt="fedams", server_lr=0.05)
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    res = run_in_process(cfg, tmp_path / "flower")
    np.testing.assert_allclose(accs(res.rows), accs(ref.rows), atol=1e-9)


def test_a_stateful_aggregation_rule_is_checkpointed(tiny_store, tmp_path, monkeypatch):
    """An aggregation rule that keeps server state (here: how many rounds it has aggregated, used in its update)
    resumes with it."""
    from fedhead.core.aggregate import AGGREGATORS, FedAvg

    class Counting(FedAvg):
        """FedAvg whose update damps the step by 1 / (rounds aggregated so far), a state across rounds."""

        def __init__(self):
            self.seen = 0

        def update(self, previous, totals):
            self.seen += 1
            new = super().update(previous, totals)
            return previous + (new - previous) / self.seen

        def state_dict(self):
            return {"seen": self.seen}

        def load_state_dict(self, state):
            self.seen = int(state["seen"])

    AGGREGATORS["counting"] = Counting
    try:
        full, ck, res = _cut_and_resume(tiny_store, tmp_path, monkeypatch, aggregate="counting")
        assert ck["current"]["server"]["rule"] == {"seen": 2}
        assert [r["accuracy"] for r in res.rows] == [r["accuracy"] for r in full.rows]
    finally:
        AGGREGATORS.pop("counting", None)
