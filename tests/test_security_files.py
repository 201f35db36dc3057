"""Security of received files (issue 42, findings 3, 5's gzip bomb, 6's list names, 7's CSV formula): run
directories, CIFAR batches and node state files that would run code when read, an MNIST gzip bomb, TinyImageNet
annotation names outside their folder, a node's error text as a spreadsheet formula."""

from __future__ import annotations

import gzip
import json
import math
import pathlib
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import one_line_error
from typer.testing import CliRunner

import cli
from fedhead.federation.rundir import CHECKPOINT, FINAL_STATE, read_csv, write_csv
from fedhead.infra.errors import FedheadError

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


class Payload:
    """A pickle that, when loaded, creates ``marker`` (what a crafted file would do with a shell instead)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


# ---------------------------------------------------------------- finding 3: run directories that run code


def train_args(store, out, rounds):
    return ["train", "--features", str(store), "--clients", "8", "--local-epochs", "1", "--batch-size", "16",
            "--device", "cpu", "--out", str(out), "--rounds", str(rounds)]  # fmt: skip


def finished_run(store, out: Path, rounds: int = 2) -> None:
    res = runner.invoke(cli.app, train_args(store, out, rounds))
    assert res.exit_code == 0, res.output


def drop_states(out: Path) -> None:
    for name in ("checkpoint.pt", "final-state.pt", CHECKPOINT, FINAL_STATE):
        (out / name).unlink(missing_ok=True)


@pytest.mark.parametrize("trust", [False, True], ids=["refused", "opted-in"])
@pytest.mark.parametrize("kind", ["extension", "resume"])
def test_a_crafted_run_directory_does_not_run_its_payload(tiny_store, tmp_path, monkeypatch, kind, trust):
    """A finished run's final state (extension: --resume with more rounds) or an interrupted run's checkpoint
    (--resume) replaced by a pickle whose payload creates a file: refused in one line, the payload never runs,
    also with the opt-in for trusted old run directories (which loads with torch's weights-only unpickler)."""
    monkeypatch.delenv("FEDHEAD_TRUST_PICKLED_RUNS", raising=False)
    if trust:
        monkeypatch.setenv("FEDHEAD_TRUST_PICKLED_RUNS", "1")
    out, marker = tmp_path / "r", tmp_path / "r" / "PWNED"
    finished_run(tiny_store, out)
    drop_states(out)
    if kind == "resume":  # an interrupted run: no summary, a checkpoint
        (out / "summary.json").unlink()
        torch.save({"format": 3, "payload": Payload(marker)}, out / "checkpoint.pt")
        rounds = 2
    else:
        torch.save({"format": 3, "payload": Payload(marker)}, out / "final-state.pt")
        rounds = 3
    res = runner.invoke(cli.app, [*train_args(tiny_store, out, rounds), "--resume"])
    assert not marker.exists(), "the payload ran"
    line = one_line_error(res)
    name = "checkpoint.pt" if kind == "resume" else "final-state.pt"
    assert name in line
    if not trust:
        assert "pickle" in line and "FEDHEAD_TRUST_PICKLED_RUNS=1" in line


def legacy_copy(path: Path, legacy: Path) -> None:
    """A format-3 (pickled) file of the state in ``path``, as fedhead before format 4 wrote it."""
    from fedhead.infra.safestate import load_state

    state = load_state(path, "checkpoint", "--resume")
    torch.save({**state, "format": 3}, legacy)
    path.unlink()


def test_an_old_run_directory_continues_only_with_the_opt_in(tiny_store, tmp_path, monkeypatch):
    """A genuine format-3 run directory (pickled final state) extends, bit-identically, once the user trusts it."""
    monkeypatch.delenv("FEDHEAD_TRUST_PICKLED_RUNS", raising=False)
    ref, out = tmp_path / "ref", tmp_path / "old"
    finished_run(tiny_store, ref, rounds=3)
    finished_run(tiny_store, out, rounds=2)
    legacy_copy(out / FINAL_STATE, out / "final-state.pt")
    res = runner.invoke(cli.app, [*train_args(tiny_store, out, 3), "--resume"])
    line = one_line_error(res)
    assert "final-state.pt" in line and "FEDHEAD_TRUST_PICKLED_RUNS=1" in line
    monkeypatch.setenv("FEDHEAD_TRUST_PICKLED_RUNS", "1")
    res = runner.invoke(cli.app, [*train_args(tiny_store, out, 3), "--resume"])
    assert res.exit_code == 0, res.output
    assert torch.equal(torch.load(out / "head-seed0.pt"), torch.load(ref / "head-seed0.pt"))
    assert [r["accuracy"] for r in read_csv(out / "rounds.csv")] == [
        r["accuracy"] for r in read_csv(ref / "rounds.csv")
    ]
    assert (out / FINAL_STATE).exists() and not (out / "final-state.pt").exists()  # the new format replaced it


def test_an_old_interrupted_run_resumes_with_the_opt_in(tiny_store, tmp_path, monkeypatch):
    """A format-3 checkpoint (numpy arrays and a numpy RNG state in it) resumes, bit-identically, under the opt-in."""
    from conftest import crash_at

    import fedhead.federation.job as job_module
    from fedhead.federation.config import TrainConfig
    from fedhead.federation.train import run_training

    monkeypatch.setenv("FEDHEAD_TRUST_PICKLED_RUNS", "1")
    ref, out = tmp_path / "ref", tmp_path / "cut"
    finished_run(tiny_store, ref, rounds=3)
    cfg = TrainConfig(features=str(tiny_store), clients=8, rounds=3, local_epochs=1, batch_size=16, device="cpu")
    restore = crash_at(monkeypatch, job_module, "evaluate", 2)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, out=out, progress=False)
    restore()
    legacy_copy(out / CHECKPOINT, out / "checkpoint.pt")
    res = runner.invoke(cli.app, [*train_args(tiny_store, out, 3), "--resume"])
    assert res.exit_code == 0, res.output
    assert torch.equal(torch.load(out / "head-seed0.pt"), torch.load(ref / "head-seed0.pt"))
    assert not (out / "checkpoint.pt").exists() and not (out / CHECKPOINT).exists()


# ---------------------------------------------------------------- the safe state format


def test_safe_state_round_trips_every_skeleton_type(tmp_path):
    from fedhead.infra.safestate import load_state, save_state

    w = torch.arange(12.0).reshape(3, 4)
    big = 2**127 + 12345  # numpy's PCG64 state is a 128-bit int
    state = {
        "format": 4,
        1: "int key",
        "s": {"state": {"state": big, "inc": -big}, "has_uint32": 0},
        "floats": [0.1, -0.0, math.inf, -math.inf, 1e-310],
        "t": (1, "a", None, True, False),
        "np": [np.float32(0.1), np.int64(-3), np.bool_(True), np.float64(2.5), np.uint8(7)],
        "arr": np.arange(6, dtype=np.int32).reshape(2, 3),
        "u64": np.array([2**64 - 1], dtype=np.uint64),
        "tensor": torch.arange(4, dtype=torch.float32)[::2],  # a non-contiguous view
        "bf16": torch.ones(2, dtype=torch.bfloat16),
        "gen": torch.Generator().manual_seed(3).get_state(),
        "dtype": torch.float64,
        "empty": ({}, [], (), np.zeros((0, 4))),
        (0, "iid"): "tuple key",
        "shared": [w, w, w[1:], w.t()],  # tensors sharing memory (safetensors refuses them as they are)
    }
    path = tmp_path / "s.safetensors"
    save_state({**state, "nan": math.nan}, path)
    back = load_state(path, "state", "--x")
    assert math.isnan(back.pop("nan"))
    assert set(back) == set(state) and back[1] == "int key" and back[(0, "iid")] == "tuple key"
    assert back["s"] == state["s"] and back["t"] == state["t"] and isinstance(back["t"], tuple)
    assert [str(x) for x in back["floats"]] == [str(x) for x in state["floats"]]
    for a, b in zip(back["np"], state["np"]):
        assert type(a) is type(b) and a == b
    for k in ("arr", "u64"):
        assert type(back[k]) is np.ndarray and back[k].dtype == state[k].dtype and np.array_equal(back[k], state[k])
    for k in ("tensor", "bf16", "gen"):
        assert torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype
    assert all(torch.equal(a, b) for a, b in zip(back["shared"], state["shared"]))
    assert back["dtype"] is torch.float64
    assert back["empty"][:3] == ({}, [], ()) and back["empty"][3].shape == (0, 4)


@pytest.mark.parametrize(
    "value", [object(), {1.5: 1}, Path("x"), np.array(["a"]), torch.ones(2).to_sparse(), {"f": lambda: 0}]
)
def test_safe_state_refuses_what_it_cannot_store(tmp_path, value):
    from fedhead.infra.safestate import save_state

    with pytest.raises(TypeError, match="cannot store"):
        save_state({"x": value}, tmp_path / "s.safetensors")
    assert not list(tmp_path.iterdir())


def _safetensors(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00" * 7,
        struct.pack("<Q", 2**60) + b"{}",  # a header longer than the file
        _safetensors({"__metadata__": {"other": "x"}}),  # no skeleton
        _safetensors({"__metadata__": {"fedhead.state": "[1, 2"}}),  # not JSON
        _safetensors({"__metadata__": {"fedhead.state": json.dumps({"py/object": "os.system"})}}),
        _safetensors({"__metadata__": {"fedhead.state": json.dumps({"T": "t0"})}}),  # a tensor that is not there
        _safetensors({"__metadata__": {"fedhead.state": json.dumps({"dt": "Tensor"})}}),
        _safetensors({"__metadata__": {"fedhead.state": json.dumps({"n": ["object", 1]})}}),
        _safetensors({"__metadata__": {"fedhead.state": json.dumps({"d": [[{"l": []}, 1]]})}}),  # a list as a key
        _safetensors({"__metadata__": {"fedhead.state": '{"l": ' * 5000 + "1" + "}" * 5000}}),
        _safetensors({"t0": {"dtype": "F32", "shape": [10**9, 10**9], "data_offsets": [0, 8]}}, b"\x00" * 8),
    ],
    ids=[
        "empty",
        "short",
        "long-header",
        "no-skeleton",
        "bad-json",
        "unknown-tag",
        "missing-tensor",
        "bad-dtype",
        "bad-np-dtype",
        "list-key",
        "deep",
        "huge-shape",
    ],  # fmt: skip
)
def test_safe_state_refuses_a_malformed_file_in_one_line(tmp_path, data):
    from fedhead.infra.safestate import load_state

    path = tmp_path / "s.safetensors"
    path.write_bytes(data)
    with pytest.raises(FedheadError) as exc:
        load_state(path, "checkpoint", "--resume")
    assert "\n" not in str(exc.value) and "--resume" in str(exc.value) and str(path) in str(exc.value)


# ---------------------------------------------------------------- finding 3: a CIFAR folder that runs code


def crafted_cifar(root: Path, marker: Path, name: str = "cifar10") -> Path:
    if name == "cifar10":
        d = root / "cifar-10-batches-py"
        files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    else:
        d = root / "cifar-100-python"
        files = ["train", "test", "meta"]
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_bytes(pickle.dumps({"data": Payload(marker), "labels": [0]}, protocol=2))
    return root


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_a_crafted_cifar_folder_does_not_run_its_payload(tmp_path, name):
    marker = tmp_path / "PWNED"
    root = crafted_cifar(tmp_path / "data", marker, name)
    res = runner.invoke(cli.app, ["extract", "--dataset", name, "--data-dir", str(root), "--encoder",
                                  "test_efficientnet", "--no-pretrained", "--out", str(tmp_path / "a.h5")])  # fmt: skip
    assert not marker.exists(), "the payload ran"
    line = one_line_error(res)
    assert "not a readable CIFAR batch" in line and "which a CIFAR batch never does" in line


def _py2_cifar_batch(n: int) -> bytes:
    """A batch as the genuine CIFAR-10 python files are pickled (Python 2 cPickle, protocol 2, numpy 1):
    ``numpy.core.multiarray._reconstruct`` / ``numpy.ndarray`` / ``numpy.dtype`` and byte strings."""
    data = bytes(range(256)) * (n * 3072 // 256)
    dtype = b"cnumpy\ndtype\nU\x02u1K\x00K\x01\x87R(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
    arr = (
        b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85U\x01b\x87R(K\x01"
        + b"M" + struct.pack("<H", n) + b"M\x00\x0c\x86" + dtype + b"\x89T" + struct.pack("<I", len(data)) + data
        + b"tb"
    )  # fmt: skip
    labels = b"]" + b"(" + b"".join(b"K" + bytes([i % 10]) for i in range(n)) + b"e"
    return b"\x80\x02}(U\x04data" + arr + b"U\x06labels" + labels + b"U\x0bbatch_labelU\x05batchu."


def test_the_genuine_cifar_pickle_format_still_loads(tmp_path):
    import extract.datasets as D

    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (d / f).write_bytes(_py2_cifar_batch(4))
    meta = b"\x80\x02}(U\x0blabel_names]q\x01(" + b"".join(b"U\x02c" + bytes([48 + i]) for i in range(10))
    (d / "batches.meta").write_bytes(meta + b"eU\x13num_cases_per_batchM\x10'u.")
    split = D.load_dataset("cifar10", tmp_path, "train")
    assert split.images.shape == (20, 32, 32, 3) and split.class_names[3] == "c3"
    assert list(split.labels[:5]) == [0, 1, 2, 3, 0]
    assert np.array_equal(
        split.images[0].transpose(2, 0, 1).reshape(-1), np.frombuffer(bytes(range(256)) * 12, np.uint8)
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ\x00\xe1\xf5\x05\x85U\x01b\x87R.",
        b"\x80\x02cnumpy\nndarray\nJ\x00\xe1\xf5\x05\x85\x85R.",
        b"\x80\x02cnumpy\ndtype\nU\x02O8K\x00K\x01\x87R.",
        b"\x80\x02c_codecs\nencode\nC\x01xU\x04zlib\x86R.",  # zlib-compresses bytes (a codec call, not latin-1)
        b"\x80\x02cbuiltins\neval\nU\x011\x85R.",
    ],
    ids=["reconstruct-shape", "ndarray-call", "object-dtype", "codec", "eval"],
)
def test_the_cifar_unpickler_refuses_all_but_plain_arrays(tmp_path, payload):
    import extract.datasets as D

    d = tmp_path / "cifar-100-python"
    d.mkdir()
    for f in ("train", "test", "meta"):
        (d / f).write_bytes(payload)
    with pytest.raises(FedheadError, match="not a readable CIFAR batch"):
        D.load_dataset("cifar100", tmp_path, "train")


# ---------------------------------------------------------------- finding 5: an MNIST gzip bomb


def gzip_bomb(path: Path, header: bytes, mib: int) -> None:
    member = gzip.compress(b"\x00" * 2**20, compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(header))
        for _ in range(mib):
            f.write(member)  # a multi-member gzip stream: one MiB of zeros per member


@pytest.mark.parametrize("claim", [(10, 28, 28), (2**31, 2**31, 28)], ids=["small-header", "huge-header"])
def test_an_mnist_gzip_bomb_is_refused_quickly_with_bounded_memory(tmp_path, claim):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    header = b"\x00\x00\x08\x03" + b"".join(struct.pack(">I", min(c, 2**32 - 1)) for c in claim)
    gzip_bomb(raw / "train-images-idx3-ubyte.gz", header, 600)
    (raw / "train-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(b"\x00\x00\x08\x01" + struct.pack(">I", 10) + bytes(10))
    )
    assert (raw / "train-images-idx3-ubyte.gz").stat().st_size < 1_000_000  # 600 MiB once decompressed
    code = (
        "import resource, sys, time\n"
        "import extract.datasets as D\n"
        "from fedhead.infra.errors import FedheadError\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "t0 = time.perf_counter()\n"
        "try:\n"
        f"    D.load_dataset('mnist', {str(tmp_path)!r}, 'train')\n"
        "except FedheadError as exc:\n"
        "    print(str(exc))\n"
        "print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    message, numbers = res.stdout.strip().splitlines()
    seconds, grown_kib = float(numbers.split()[0]), int(numbers.split()[1])
    assert seconds < 0.5 and grown_kib < 100 * 1024, (seconds, grown_kib)
    assert "--data-dir" in message and "train-images-idx3-ubyte.gz" in message


def test_an_idx_file_with_more_or_less_data_than_its_header_is_refused(tmp_path):
    import extract.datasets as D

    good = b"\x00\x00\x08\x01" + struct.pack(">I", 3) + b"\x01\x02\x03"
    assert list(D.read_idx(_write(tmp_path / "a", good))) == [1, 2, 3]
    assert list(D.read_idx(_write(tmp_path / "a.gz", gzip.compress(good)))) == [1, 2, 3]
    for data in (good + b"\x00", good[:-1], b"\x00\x00\x09\x01" + good[4:], b"\x00\x00\x08\x00", good[:6]):
        for name, blob in (("b", data), ("b.gz", gzip.compress(data))):
            with pytest.raises(ValueError):
                D.read_idx(_write(tmp_path / name, blob))


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------- finding 6: TinyImageNet names outside the folder


@pytest.mark.parametrize("entry", ["../../../../victim.JPEG", "ABS", "sub/../../../../../victim.JPEG"])
def test_tinyimagenet_annotations_stay_in_their_folder(tmp_path, entry):
    from PIL import Image

    import extract.datasets as D

    outside = tmp_path / "victim.JPEG"
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(outside, format="JPEG")
    d = tmp_path / "data" / "tiny-imagenet-200"
    (d / "val" / "images" / "sub").mkdir(parents=True)
    (d / "wnids.txt").write_text("n01\n")
    entry = str(outside) if entry == "ABS" else entry
    (d / "val" / "val_annotations.txt").write_text(f"{entry}\tn01\t0\t0\t63\t63\n")
    assert (d / "val" / "images" / entry).resolve() == outside.resolve()  # the name does reach the file
    with pytest.raises(FedheadError, match="val_annotations.txt.* outside its folder"):
        D.load_dataset("tinyimagenet", tmp_path / "data", "test")


def test_tinyimagenet_class_names_stay_in_their_folder(tmp_path):
    from PIL import Image

    import extract.datasets as D

    d = tmp_path / "data" / "tiny-imagenet-200"
    (d / "train" / "n01" / "images").mkdir(parents=True)
    (tmp_path / "data" / "images").mkdir()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(tmp_path / "data" / "images" / "x.JPEG", format="JPEG")
    (d / "wnids.txt").write_text("../..\n")  # train/../../images: the folder beside tiny-imagenet-200
    with pytest.raises(FedheadError, match="wnids.txt.* outside its folder"):
        D.load_dataset("tinyimagenet", tmp_path / "data", "train")


# ---------------------------------------------------------------- finding 7: a formula in rounds.csv


def test_a_string_cell_that_is_a_formula_is_quoted(tmp_path):
    rows = [{"seed": 0, "accuracy": -0.5, "loss": -1e-9, "n": -3, "failure_reason": "=HYPERLINK(\"http://x\",\"y\")"},
            {"seed": 1, "accuracy": 0.25, "failure_reason": "+1"}, {"seed": 2, "failure_reason": "-2+3"},
            {"seed": 3, "failure_reason": "@SUM(A1)"}, {"seed": 4, "failure_reason": "\tx"},
            {"seed": 5, "failure_reason": "\r=1"}, {"seed": 6, "failure_reason": "node 3 timed out"},
            {"seed": 7, "failure_reason": "a\rb,c\r\n1,2"}]  # fmt: skip
    write_csv(tmp_path / "rounds.csv", rows)
    back = read_csv(tmp_path / "rounds.csv")
    assert [r["failure_reason"] for r in back] == ["'=HYPERLINK(\"http://x\",\"y\")", "'+1", "'-2+3", "'@SUM(A1)",
                                                   "'\tx", "'\n=1", "node 3 timed out",
                                                   "a\nb,c\n1,2"]  # fmt: skip
    assert [r["seed"] for r in back] == [str(i) for i in range(8)]  # a CR in a cell breaks no row
    assert back[0]["accuracy"] == "-0.5" and back[0]["loss"] == "-1e-09" and back[0]["n"] == "-3"
