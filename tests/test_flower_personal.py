"""Personalisation on Flower (``--personalize``): after the last round every node personalises its own client on its
own data and sends back only counts; the run's personal.csv and pfl_* fields equal the in-process run's.

The runs use the real ServerApp strategy and ClientApp over the in-process grid with Flower's wire format
(:func:`fedhead.flower.inprocess.run_in_process`: every message serialised and parsed, as a network carries it)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")

from flwr.app import MetricRecord  # noqa: E402
from test_flower_replies import TamperGrid, rebuilt  # noqa: E402
from test_flower_sim import task_identity  # noqa: E402,F401 (autouse: Flower's task identity)

from extract.store import load_store, write_store  # noqa: E402
from fedhead.core.synthetic import write_synthetic  # noqa: E402
from fedhead.federation.config import TrainConfig, applicable  # noqa: E402
from fedhead.federation.rundir import read_csv  # noqa: E402
from fedhead.federation.train import run_training  # noqa: E402
from fedhead.flower.client_app import make_client_app  # noqa: E402
from fedhead.flower.commands import run_config_of  # noqa: E402
from fedhead.flower.common import PERSONAL_KIND, config_from_run_config  # noqa: E402
from fedhead.flower.inprocess import InProcessGrid, run_in_process, sim_nodes  # noqa: E402
from fedhead.flower.server_app import run_server  # noqa: E402
from fedhead.flower.strategy import ServerSettings  # noqa: E402
from fedhead.infra.errors import FedheadError  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic(
        tmp_path_factory.mktemp("flower-personal") / "s.h5", num_classes=6, train_per_class=20, test_per_class=10,
        dim=16,
    )  # fmt: skip


def cfg_of(store, **kw) -> TrainConfig:
    base = dict(features=str(store), head="softmax", partition="dirichlet", partition_params={"alpha": 0.5},
                clients=5, rounds=2, local_epochs=1, batch_size=10, device="cpu", plots=False)  # fmt: skip
    return TrainConfig(**applicable({**base, **kw}))


PERSONAL_SUMMARY = ("pfl_accuracy", "pfl_accuracy_global", "personal_accuracy_mean", "drift_accuracy")


@pytest.mark.parametrize(
    "kw",
    [
        {"personalize": "finetune"},
        {"personalize": "prior"},
        # closed-form: beta chosen on validation; at 3% some clients hold no validation part, and their nodes are
        # asked again with the beta the others' pooled counts chose
        {"head": "ridge", "personalize": "closed-form", "val_fraction": 0.03, "clients": 8},
    ],
    ids=["finetune", "prior", "closed-form"],
)
def test_flower_personalisation_equals_the_in_process_run(store, tmp_path, kw, monkeypatch):
    """Each node's counts are its client's in the in-process run: personal.csv is the same file, row by row."""
    cfg = cfg_of(store, **kw)
    ref = run_training(cfg, out=tmp_path / "train", progress=False)
    sent = []  # every personalize message's size on the wire, and what the nodes answered
    real = InProcessGrid.send_and_receive

    def spy(self, messages, *, timeout=None):
        replies = real(self, messages, timeout=timeout)
        sent.extend((m, r) for m, r in zip(messages, replies) if m.metadata.message_type == PERSONAL_KIND)
        return replies

    monkeypatch.setattr(InProcessGrid, "send_and_receive", spy)
    flower = run_in_process(cfg, tmp_path / "flower")
    rows = read_csv(tmp_path / "flower" / "personal.csv")
    assert rows == read_csv(ref.run_dir / "personal.csv") and len(rows) == cfg.clients
    for key in PERSONAL_SUMMARY:
        assert flower.summary[key] == ref.summary[key], key
    assert "personal_failures" not in flower.summary
    # only counts come back: no array but closed-form's validation counts per beta
    for _, r in sent:
        assert set(r.content["arrays"].keys()) <= {"val-correct"}
        assert set(r.content["metrics"].keys()) <= {"partition-id", "test-samples", "correct", "drift", "beta",
                                                    "client-ms"}  # fmt: skip
    groups = [m.metadata.group_id for m, _ in sent]
    assert groups.count("personalize") == cfg.clients
    if kw["personalize"] == "closed-form":  # some clients without validation: asked again with the pooled beta
        again = [m for m, _ in sent if m.metadata.group_id == "personalize-beta"]
        beta = {r["client"]: float(r["beta"]) for r in rows}
        assert again and {beta[str(m.metadata.dst_node_id - 1000)] for m in again} == {
            float(again[0].content["config"]["personal-beta"])
        }  # InProcessGrid's node 1000 + k holds partition k


def test_a_server_cut_before_personalising_resumes_to_the_same_counts(store, tmp_path, monkeypatch):
    """A server stopped after the last round's checkpoint, before personalising: the resumed server (a new Flower run,
    whose query asks for no statistics) learns the clients' counts again, asks the nodes for the closed-form
    statistics it needs, and writes the in-process run's personal.csv."""
    from fedhead.flower.strategy import FedheadStrategy

    cfg = cfg_of(store, head="ova2", init="ridge", personalize="closed-form")
    ref = run_training(cfg, out=tmp_path / "train", progress=False)

    def cut(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(FedheadStrategy, "personalize", cut)
    with pytest.raises(KeyboardInterrupt):
        run_in_process(cfg, tmp_path / "flower")
    monkeypatch.undo()
    grid = InProcessGrid(make_client_app(str(cfg.features)), sim_nodes(cfg.clients), wire=True)
    res = run_server(grid, cfg, ServerSettings(out=str(tmp_path / "flower"), resume=True, wait_timeout=3))
    assert read_csv(tmp_path / "flower" / "personal.csv") == read_csv(ref.run_dir / "personal.csv")
    assert res.summary["pfl_accuracy"] == ref.summary["pfl_accuracy"]


def test_a_bad_personalize_reply_leaves_its_client_out(store, tmp_path):
    """A node claiming more correct predictions than its local test set has is that partition's failure: it counts
    nowhere (personal.csv, pfl_accuracy), summary.json names it, the other clients' counts stand."""
    cfg = cfg_of(store, personalize="finetune")
    ref = read_csv(run_training(cfg, out=tmp_path / "train", progress=False).run_dir / "personal.csv")

    def tamper(kind, group, pid, m, r):
        if kind == PERSONAL_KIND and pid == 1:
            return rebuilt(r, metrics=lambda d: {**d, "correct": d["test-samples"] + 1}, request=m)
        return r

    grid = TamperGrid(make_client_app(str(cfg.features)), sim_nodes(cfg.clients), tamper)
    res = run_server(grid, cfg, ServerSettings(out=str(tmp_path / "flower"), wait_timeout=3))
    rows = read_csv(tmp_path / "flower" / "personal.csv")
    assert rows == [r for r in ref if r["client"] != "1"]
    (failed,) = res.summary["personal_failures"]
    assert failed["partition"] == 1 and "bad personalize reply refused" in failed["reason"]
    n = sum(int(r["test_samples"]) for r in rows)
    assert res.summary["pfl_accuracy"] == pytest.approx(sum(int(r["personal_correct"]) for r in rows) / n)


def test_a_node_without_the_servers_test_split_is_left_out_with_the_reason(store, tmp_path):
    """The local test sets index into the server's test split: a node whose store holds another one (here: the same
    training split, the test rows in another order) refuses, in one line, and is that partition's failure."""
    s = load_store(store)
    keys = ("dataset", "encoder", "weights_source", "weights_sha256", "preprocessing", "image_size")
    order = np.random.default_rng(0).permutation(len(s.test_y))
    other = write_store(tmp_path / "other.h5", train=(s.train_x, s.train_y), test=(s.test_x[order], s.test_y[order]),
                        class_names=s.info.class_names, attrs={k: s.info.attrs[k] for k in keys})  # fmt: skip
    cfg = cfg_of(store, personalize="prior")
    nodes = sim_nodes(cfg.clients)
    nodes[2] = {**nodes[2], "feature-store": str(other)}
    grid = InProcessGrid(make_client_app(str(cfg.features)), nodes, wire=True)
    res = run_server(grid, cfg, ServerSettings(out=str(tmp_path / "flower"), wait_timeout=3))
    (failed,) = res.summary["personal_failures"]
    assert failed["partition"] == 2 and "another test split" in failed["reason"]
    assert "2" not in [r["client"] for r in read_csv(tmp_path / "flower" / "personal.csv")]


def test_the_personal_options_travel_in_the_run_config_and_secagg_is_refused(store, tmp_path):
    """`fedhead flower superlink` hands the job to `flwr run` as a run config: the personal options survive it;
    secure aggregation with --personalize is refused before any node is asked."""
    cfg = cfg_of(store, personalize="ditto", personal_epochs=3, personal_lambda=0.5, personal_drift=4)
    back = config_from_run_config(run_config_of(cfg, tmp_path, False, 60, 60))
    assert (back.personalize, back.personal_params, back.personal_drift) == ("ditto", cfg.personal_params, 4)
    assert back.personal_params["personal_epochs"] == 3
    grid = InProcessGrid(make_client_app(str(cfg.features)), sim_nodes(cfg.clients))
    with pytest.raises(FedheadError, match="secure-aggregation"):
        run_server(grid, cfg_of(store, personalize="prior", secure_aggregation=True),
                   ServerSettings(out=str(tmp_path / "secure"), wait_timeout=3))  # fmt: skip
    assert not (tmp_path / "secure").exists() or not any((tmp_path / "secure").iterdir())


def test_the_personalize_reply_check_names_what_is_wrong():
    """The reply check accepts a well-formed personalize reply and names the field of a bad one (never raising)."""
    from flwr.app import Array, ArrayRecord, RecordDict

    from fedhead.flower.replies import Expect, check_reply

    class R:
        def __init__(self, m, arrays=None):
            content = {"metrics": MetricRecord(m)}
            if arrays is not None:
                content["arrays"] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
            self.content = RecordDict(content)

    good = {"partition-id": 0, "test-samples": 5, "correct": 3, "drift": 2, "client-ms": 1.0}
    e, picks = Expect(6, 16, 5, pid=0, tests=5, drift=6), Expect(6, 16, 5, pid=0, tests=5, drift=6, betas=7)
    assert check_reply("personalize", R(good), e) is None
    assert check_reply("personalize", R({**good, "beta": 3.0}, {"val-correct": np.full(7, -1)}), picks) is None
    assert check_reply("personalize", R(good, {"val-correct": np.arange(7)}), picks) is None
    for bad, arrays, what in [
        ({**good, "partition-id": 1}, None, "partition-id"),
        ({**good, "test-samples": 6}, None, "test-samples"),
        ({**good, "correct": 6}, None, "correct"),
        ({**good, "drift": 7}, None, "drift"),
        ({**good, "beta": 0.0}, None, "beta"),
        ({**good, "client-ms": float("nan")}, None, "client-ms"),
        ({k: v for k, v in good.items() if k != "correct"}, None, "correct"),
        (good, {"head": np.zeros((6, 17), dtype=np.float32)}, "arrays"),
    ]:
        assert what in check_reply("personalize", R(bad, arrays), e), what
    for arrays, what in [(None, "val-correct"), ({"val-correct": np.arange(6)}, "val-correct"),
                         ({"val-correct": np.array([-1, 0, 1, 2, 3, 4, 5])}, "val-correct"),
                         ({"val-correct": np.arange(7, dtype=np.float64)}, "dtype")]:  # fmt: skip
        assert what in check_reply("personalize", R(good, arrays), picks), arrays
