"""Natural client splits (client ids recorded at extraction, ``--partition natural``) and per-client accuracy."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fedhead
from extract.run import extract_features
from extract.store import load_store, open_store, write_store
from fedhead.core.clientacc import CLIENT_FIELDS, class_correct, client_accuracy, client_summary, client_weights
from fedhead.core.partitions import create_partition
from fedhead.federation.rundir import read_csv
from fedhead.infra.errors import FedheadError

TINY, SIZE = "test_efficientnet", 32
CLASSES = ("ant", "bee", "cat")
# client -> images per class (ant, bee, cat): unequal on purpose
HOLDINGS = {"alice": (3, 2, 0), "bob": (0, 2, 1), "carol": (1, 0, 3)}


def _img(rng, c: int) -> Image.Image:
    base = np.array([c * 90 % 256, (c * 40 + 60) % 256, (255 - c * 70) % 256], dtype=np.float64)
    return Image.fromarray(np.clip(base + rng.normal(0, 25, (16, 16, 3)), 0, 255).astype(np.uint8))


def _test_split(root: Path, rng) -> None:
    for c, cls in enumerate(CLASSES):
        (root / "test" / cls).mkdir(parents=True)
        for i in range(2):
            _img(rng, c).save(root / "test" / cls / f"t{i}.png")


def client_tree(root: Path) -> Path:
    """train/<client>/<class>/<client>_<i>.png (so the same images also carry their client in the file name)."""
    rng = np.random.default_rng(0)
    for client, per in HOLDINGS.items():
        for c, (cls, n) in enumerate(zip(CLASSES, per)):
            if n:
                (root / "train" / client / cls).mkdir(parents=True)
            for i in range(n):
                _img(rng, c).save(root / "train" / client / cls / f"{client}_{i}.png")
    _test_split(root, rng)
    return root


def flat_tree(root: Path) -> Path:
    """The plain layout train/<class>/<client>_<i>.png with the same holdings."""
    rng = np.random.default_rng(0)
    for client, per in HOLDINGS.items():
        for c, (cls, n) in enumerate(zip(CLASSES, per)):
            (root / "train" / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                _img(rng, c).save(root / "train" / cls / f"{client}_{i}.png")
    _test_split(root, rng)
    return root


def _extract(data: Path, out: Path, **kw) -> Path:
    return extract_features(
        "imagefolder", data, TINY, pretrained=False, image_size=SIZE, out=out, progress=False, batch_size=4, **kw
    )


def _expected_counts() -> dict[str, list[int]]:
    return {k: list(v) for k, v in HOLDINGS.items()}


def _check_store(path: Path) -> None:
    """The store records alice, bob, carol with each training row's client matching its file's holdings."""
    s = load_store(path)
    assert s.info.client_names == sorted(HOLDINGS)
    assert s.train_clients is not None and s.train_clients.shape == s.train_y.shape
    got = {name: np.bincount(s.train_y[s.train_clients == k], minlength=3).tolist()
           for k, name in enumerate(s.info.client_names)}  # fmt: skip
    assert got == _expected_counts()


def _check_natural_run(path: Path, out: Path) -> None:
    """--partition natural trains one client per recorded id: clients.csv shows the holdings."""
    # no validation part: clients.csv then counts each client's whole data
    res = fedhead.run(features=str(path), head="ridge", partition="natural", clients=3, out=str(out), plots=False,
                      val_fraction=0.0)  # fmt: skip
    rows = read_csv(out / "clients.csv")  # client k = the k-th name in sorted order: alice, bob, carol
    got = [{int(c): int(n) for c, n in (kv.split(":") for kv in r["class_counts"].split())} for r in rows]
    assert got == [{c: n for c, n in enumerate(v) if n} for v in HOLDINGS.values()]
    assert res.summary["partition"] == "natural" and res.summary["clients"] == 3


def test_natural_clients_from_folders(tmp_path):
    path = _extract(client_tree(tmp_path / "data"), tmp_path / "s.h5", client_folders=True)
    _check_store(path)
    assert open_store(path).class_names == list(CLASSES)
    _check_natural_run(path, tmp_path / "run")


def test_natural_clients_from_csv(tmp_path):
    data = flat_tree(tmp_path / "data")
    table = tmp_path / "clients.csv"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "client"])
        for p in sorted((data / "train").rglob("*.png")):  # keys relative to --data-dir
            w.writerow([p.relative_to(data).as_posix(), p.name.split("_")[0]])
    path = _extract(data, tmp_path / "s.h5", clients_csv=table)
    _check_store(path)
    _check_natural_run(path, tmp_path / "run")


def test_natural_clients_from_pattern(tmp_path):
    path = _extract(flat_tree(tmp_path / "data"), tmp_path / "s.h5", client_pattern=r"^(?P<client>[^_]+)_")
    _check_store(path)
    from typer.testing import CliRunner

    import cli

    shown = CliRunner().invoke(cli.app, ["info", str(path)])
    assert shown.exit_code == 0 and "3: alice, bob, carol" in shown.output and "train/clients" in shown.output
    _check_natural_run(path, tmp_path / "run")
    plain = _extract(tmp_path / "data", tmp_path / "plain.h5")  # the same images without clients: another store
    assert load_store(plain).train_clients is None and open_store(plain).client_names == []


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(client_pattern=r"^(?P<who>[^_]+)_"), "'--client-pattern' parameter must have a named group"),
        (dict(client_pattern=r"(unclosed"), "'--client-pattern' parameter must be a regular expression"),
        (dict(client_pattern=r"^zzz(?P<client>.)"), "'--client-pattern' parameter '^zzz(?P<client>.)' does not match"),
        (dict(clients_csv="missing.csv"), "'--clients-csv' parameter names"),
        (dict(client_folders=True, client_pattern="(?P<client>.)"), "'--client-pattern' parameter cannot be combined"),
        (dict(client_folders=True), "does not hold client folders"),  # a flat tree is no client tree
    ],
)
def test_client_sources_refused_in_one_line(tmp_path, kw, needle):
    data = flat_tree(tmp_path / "data")
    if kw.get("clients_csv"):
        kw = dict(clients_csv=tmp_path / kw["clients_csv"])
    with pytest.raises(FedheadError) as e:
        _extract(data, tmp_path / "s.h5", **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "s.h5").exists()


def test_csv_without_a_row_for_every_image_is_refused(tmp_path):
    data = flat_tree(tmp_path / "data")
    table = tmp_path / "c.csv"
    table.write_text("file,client\ntrain/ant/alice_0.png,alice\n")
    with pytest.raises(FedheadError, match=r"no row for the training file .* Add a row"):
        _extract(data, tmp_path / "s.h5", clients_csv=table)


def _store(tmp_path, clients: np.ndarray | None, n_test_per_class=(3, 2, 5)) -> Path:
    rng = np.random.default_rng(0)
    mu = rng.normal(0, 1.2, (3, 6))
    y = np.repeat(np.arange(3), 20)
    yt = np.repeat(np.arange(3), n_test_per_class)
    x, xt = mu[y] + rng.normal(0, 1, (60, 6)), mu[yt] + rng.normal(0, 1, (len(yt), 6))
    return write_store(tmp_path / "t.h5", train=(x.astype("f4"), y), test=(xt.astype("f4"), yt),
                       class_names=list(CLASSES), attrs={"dataset": "toy"}, train_clients=clients)  # fmt: skip


def test_natural_partition_refusals(tmp_path):
    with pytest.raises(FedheadError, match="does not record.*--client-folders, --clients-csv or --client-pattern"):
        create_partition("natural", np.zeros(6, dtype=np.int64), 2, seed=0)
    ids = np.array([0, 0, 1, 2, 2, 2])
    with pytest.raises(
        FedheadError, match=r"'--clients' parameter must be the number of clients .* \(3\).*--clients 3"
    ):
        create_partition("natural", np.zeros(6, dtype=np.int64), 4, seed=0, client_ids=ids)
    parts = create_partition("natural", np.zeros(6, dtype=np.int64), 3, seed=5, client_ids=ids)
    assert [p.tolist() for p in parts] == [[0, 1], [2], [3, 4, 5]]
    plain = _store(tmp_path, None)
    with pytest.raises(FedheadError, match="'partition' parameter natural needs the client of each training sample"):
        fedhead.run(features=str(plain), partition="natural", clients=3, out=str(tmp_path / "r"), plots=False)
    assert not (tmp_path / "r").exists()


def test_per_client_accuracy_by_hand(tmp_path):
    """rounds.csv and summary.json carry each client's accuracy on its own label mix, computed here by hand."""
    clients = np.concatenate([np.full(20, 0), np.full(20, 1), np.full(20, 2)])  # client k holds class k only...
    clients[[0, 1, 2, 3, 20, 45]] = [1, 1, 2, 2, 0, 1]  # ...but for a few samples
    path = _store(tmp_path, clients)
    out = tmp_path / "run"
    # no validation part: the hand computation reads each client's whole data (and ridge keeps its lambda)
    res = fedhead.run(features=str(path), head="ridge", partition="natural", clients=3, out=str(out), plots=False,
                      val_fraction=0.0)  # fmt: skip
    s = load_store(path)
    theta = torch.load(out / "head-seed0.pt").numpy()
    pred = (np.c_[s.test_x, np.ones(len(s.test_y))] @ theta.T).argmax(1)
    acc_c = [float(np.mean(pred[s.test_y == c] == c)) for c in range(3)]
    per_client = []
    for k in range(3):  # sum_c p_k(c) acc_c, one client at a time
        y_k = s.train_y[s.train_clients == k]
        per_client.append(sum(np.mean(y_k == c) * acc_c[c] for c in range(3)))
    per_client = sorted(per_client)
    want = {"client_accuracy_mean": np.mean(per_client), "client_accuracy_worst10": per_client[0],
            "client_accuracy_best10": per_client[-1], "client_accuracy_std": np.std(per_client)}  # fmt: skip
    assert len(set(np.round(per_client, 9))) == 3  # the three clients differ: worst, best and mean say something
    row = read_csv(out / "rounds.csv")[-1]
    summary = json.loads((out / "summary.json").read_text())
    for k, v in want.items():
        assert float(row[k]) == pytest.approx(v, abs=1e-5), k
        assert summary[k] == pytest.approx(v, abs=1e-12), k
        assert res.rows[-1][k] == pytest.approx(v, abs=1e-12), k
    assert summary[k + "_std"] == 0.0  # one seed


def test_client_accuracy_exact_toy():
    """3 clients, 3 classes, the test split lacks class 2: p_k is renormalised over classes 0 and 1."""
    counts = np.array([[2, 2, 0], [0, 1, 3], [0, 0, 5], [0, 0, 0]])  # client 2 only holds the absent class; 3 none
    correct, totals = np.array([3, 1, 0]), np.array([4, 2, 0])  # acc_0 = 0.75, acc_1 = 0.5
    w = client_weights(counts, totals)
    acc = client_accuracy(w, correct, totals)
    assert acc.tolist() == [0.5 * 0.75 + 0.5 * 0.5, 0.5]  # clients 2 and 3 have no test class: left out
    got = client_summary(acc)
    assert got == {"client_accuracy_mean": 0.5625, "client_accuracy_worst10": 0.5, "client_accuracy_best10": 0.625,
                   "client_accuracy_std": 0.0625}  # fmt: skip
    many = client_summary(np.arange(20) / 20)  # 20 clients: the deciles are 2 clients each
    assert many["client_accuracy_worst10"] == pytest.approx(0.025) and many["client_accuracy_best10"] == 0.925
    assert all(np.isnan(v) for v in client_summary(np.zeros(0)).values()) and set(CLIENT_FIELDS) == set(got)


def test_class_correct_matches_evaluate():
    from fedhead.core.engine import evaluate

    g = torch.Generator().manual_seed(0)
    x, theta = torch.randn(50, 5, generator=g), torch.randn(4, 5, generator=g)
    y = torch.randint(0, 4, (50,), generator=g)
    correct, totals = class_correct(theta, x, y, 4, chunk=7)
    assert totals.tolist() == np.bincount(y.numpy(), minlength=4).tolist()
    pred = (x @ theta.T).argmax(1)
    assert correct.tolist() == [int(((pred == c) & (y == c)).sum()) for c in range(4)]
    assert correct.sum() / 50 == evaluate(theta, x, y)


def test_natural_partition_on_flower_matches_the_simulator(tiny_store, tmp_path):
    """Flower's ServerApp (over the in-process grid) runs --partition natural: SuperNode k holds natural client k,
    and its rows (accuracy and the per-client accuracy) equal the simulator's."""
    pytest.importorskip("flwr")
    from fedhead.federation.config import TrainConfig
    from fedhead.flower.client_app import make_client_app
    from fedhead.flower.inprocess import InProcessGrid, sim_nodes, task_identity
    from fedhead.flower.server_app import run_server
    from fedhead.flower.strategy import ServerSettings

    kw = dict(features=str(tiny_store), partition="natural", clients=8, rounds=2, local_epochs=1, device="cpu",
              plots=False)  # fmt: skip
    cfg = TrainConfig(**kw)
    out = tmp_path / "flower"
    with task_identity():
        grid = InProcessGrid(make_client_app(str(tiny_store)), sim_nodes(cfg.clients))
        run_server(grid, cfg, ServerSettings(out=str(out), resume=False, wait_timeout=5))
    sim = fedhead.run(**kw, out=str(tmp_path / "sim"))
    flower_rows, sim_rows = read_csv(out / "rounds.csv"), read_csv(tmp_path / "sim" / "rounds.csv")
    for key in ("accuracy", *CLIENT_FIELDS):
        assert [float(r[key]) for r in flower_rows] == pytest.approx([float(r[key]) for r in sim_rows], abs=1e-5)
    ids = load_store(tiny_store).train_clients
    sizes = np.bincount(ids, minlength=8)  # each natural client, less the validation part it held out (10%)
    got = np.array([int(r["size"]) for r in read_csv(out / "clients.csv")])
    assert (got <= sizes - np.floor(0.1 * sizes)).all() and (got >= sizes - np.ceil(0.1 * sizes)).all()
    assert [int(r["size"]) for r in read_csv(tmp_path / "sim" / "clients.csv")] == got.tolist()
    assert sim.summary["client_accuracy_worst10"] <= sim.summary["client_accuracy_mean"]


def test_bench_baselines_runs_natural_and_reports_per_client_accuracy(tiny_store, tmp_path):
    """`bench baselines --partition natural`: the report's per-client table holds each run's summary values."""
    from typer.testing import CliRunner

    import cli

    out = tmp_path / "bl"
    args = ["bench", "baselines", "--features", str(tiny_store), "--quick", "--clients", "8", "--methods", "ridge",
            "--partition", "natural", "--out", str(out)]  # fmt: skip
    r = CliRunner().invoke(cli.app, args)
    assert r.exit_code == 0, r.output
    rep = (out / "report.md").read_text()
    section = rep.split("## Per-client accuracy (%)")[1].split("\n## ")[0]
    for method in ("ridge",):
        run = next(p for p in out.rglob("summary.json") if f"{method}--natural" in str(p))
        s = json.loads(run.read_text())
        want = " / ".join(f"{100 * s[k]:.1f}" for k in CLIENT_FIELDS[:3])
        assert f"| {method} | {want} |" in section, (want, section)
