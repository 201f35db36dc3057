"""Security of the readers and writers (issue 42, findings 4-7): lock files and temporary files through planted
symlinks, stores and model cards that claim more than they hold (memory bombs), names from a card outside its
folder, a card without its weights' sha256, absolute paths in cards and exports."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import one_line_error
from typer.testing import CliRunner

import cli
from fedhead.infra.errors import FedheadError

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
SYNTH = ["synth", "--num-classes", "2", "--train-per-class", "2", "--test-per-class", "2", "--dim", "2", "--no-probe"]
VICTIM = "precious data, not a lock\n" * 40


# ---------------------------------------------------------------- finding 4: writes through symlinks


def test_a_planted_lock_symlink_does_not_truncate_its_target(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    out = tmp_path / "out.h5"
    Path(f"{out}.lock").symlink_to(victim)
    res = runner.invoke(cli.app, [*SYNTH, "--out", str(out)])
    line = one_line_error(res)
    assert f"{out}.lock" in line and "symlink" in line
    assert victim.read_text() == VICTIM and not out.exists()
    assert Path(f"{out}.lock").is_symlink()  # not ours: left as it was


def test_a_lock_file_that_is_not_a_lock_is_not_truncated(tmp_path):
    from fedhead.infra.locks import exclusive_writer

    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    out = tmp_path / "out.h5"
    os.link(victim, f"{out}.lock")  # a hard link: a regular file, but another name's content
    with pytest.raises(FedheadError, match="lock"):
        with exclusive_writer(out):
            pass
    assert victim.read_text() == VICTIM
    big = tmp_path / "big.h5"
    Path(f"{big}.lock").write_text(VICTIM)  # a regular file that holds more than a pid
    with pytest.raises(FedheadError, match="not a fedhead lock"):
        with exclusive_writer(big):
            pass
    assert Path(f"{big}.lock").read_text() == VICTIM
    fifo = tmp_path / "fifo.h5"
    os.mkfifo(f"{fifo}.lock")  # would block an open without O_NONBLOCK
    with pytest.raises(FedheadError, match="not a regular file"):
        with exclusive_writer(fifo):
            pass


def test_a_stale_lock_file_is_still_taken_over(tmp_path):
    from fedhead.infra.locks import exclusive_writer

    out = tmp_path / "out.h5"
    Path(f"{out}.lock").write_text("12345\n")
    with exclusive_writer(out) as lock:
        assert lock.read_text().strip() == str(os.getpid())
    assert not lock.exists()


def test_atomic_writers_do_not_follow_a_symlink_at_their_temporary_name(tmp_path, monkeypatch):
    """The temporary file is created O_EXCL|O_NOFOLLOW and written through its own descriptor: a symlink planted at
    its name (a guessed or raced name) is neither followed nor written through."""
    import tempfile

    from fedhead.infra import files

    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    real = tempfile.mkstemp

    def planted(prefix="", suffix="", dir=None, **kw):  # the attacker swaps the fresh name for a symlink
        fd, name = real(prefix=prefix, suffix=suffix, dir=dir, **kw)
        os.unlink(name)
        os.symlink(victim, name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", planted)
    with pytest.raises((FedheadError, OSError)):
        files.atomic_write_text(tmp_path / "out.txt", "new content\n")
    assert victim.read_text() == VICTIM


def test_a_name_from_a_file_stays_inside_its_folder(tmp_path):
    from fedhead.infra.files import name_inside

    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "link").symlink_to(tmp_path)
    assert name_inside(tmp_path / "d", "sub/x.png", "w") == tmp_path / "d" / "sub" / "x.png"
    for bad in ("/etc/passwd", "../x", "sub/../../x", "link/x", "", "a\x00b", None, 3):
        with pytest.raises(FedheadError, match="outside its folder") as e:
            name_inside(tmp_path / "d", bad, "The list 'l.txt'")
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- finding 5: stores that claim more than they hold

BOMB_ROWS, BOMB_DIM = 32_000_000, 16


def small_store(path: Path, **kw) -> Path:
    from extract.store import write_store

    rng = np.random.default_rng(0)
    n, d = kw.pop("n", 12), kw.pop("dim", 4)
    train = (rng.standard_normal((n, d)).astype(np.float32), rng.integers(0, 3, n))
    test = (rng.standard_normal((n // 2, d)).astype(np.float32), rng.integers(0, 3, n // 2))
    return write_store(path, train=train, test=test, class_names=["a", "b", "c"], attrs={"dataset": "t"}, **kw)


def store_bomb(path: Path, rows: int = BOMB_ROWS, dim: int = BOMB_DIM, **create) -> Path:
    """A valid store whose splits are replaced by datasets claiming ``rows x dim`` with no chunk written."""
    small_store(path)
    with h5py.File(path, "r+") as f:
        f.attrs["feature_dim"] = dim
        for s in ("train", "test"):
            del f[s]["features"], f[s]["labels"]
            f[s].create_dataset("features", shape=(rows, dim), dtype="float32", chunks=(1024, dim), **create)
            f[s].create_dataset("labels", shape=(rows,), dtype="int64", chunks=(1024,), **create)
    h5py.File(path, "r").close()
    return path


BOMB_PROBE = """
import sys, time
t = time.perf_counter()
from extract.store import load_store
from fedhead.infra.errors import FedheadError
t = time.perf_counter()
try:
    load_store(sys.argv[1])
    print("LOADED")
except FedheadError as exc:
    print("REFUSED", exc)
print(f"SECONDS {time.perf_counter() - t:.3f}")
# this process image's own peak (VmHWM): getrusage's ru_maxrss keeps the parent's peak across fork and exec
print("MAXRSS_KB", next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


def test_a_store_bomb_is_refused_fast_in_little_memory(tmp_path):
    """Finding 5: a ~10 kB store claiming 32M x 16 per split; before, load_store allocated 5.4 GB. The probe runs
    under a 3 GB address-space limit (it imports no torch), so the old code fails with MemoryError there."""
    bomb = store_bomb(tmp_path / "bomb.h5")
    assert bomb.stat().st_size < 64_000
    code = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n" + BOMB_PROBE
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code, str(bomb)], capture_output=True, text=True, env=env, cwd=REPO)
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines() if " " in line)
    assert res.returncode == 0 and "REFUSED" in out, (res.stdout, res.stderr[-800:])
    assert "train/features" in out["REFUSED"] and str(bomb) in out["REFUSED"], out["REFUSED"]
    assert float(out["SECONDS"]) < 1.0 and int(out["MAXRSS_KB"]) < 1 << 20, out


def test_open_store_refuses_the_bomb_from_metadata(tmp_path):
    from extract.store import open_store

    bomb = store_bomb(tmp_path / "bomb.h5")
    with pytest.raises(FedheadError, match=r"claims .* holds"):
        open_store(bomb)


def test_a_compressed_store_must_hold_every_chunk(tmp_path):
    """Compressed datasets may be smaller than their shape, but every chunk must be there (a missing chunk reads as
    fill values that cost memory and were never data)."""
    from extract.store import load_store

    bomb = store_bomb(tmp_path / "gz.h5", rows=4_000_000, compression="gzip")
    with pytest.raises(FedheadError, match="train/features"):
        load_store(bomb)
    ok = tmp_path / "ok.h5"
    small_store(ok)
    with h5py.File(ok, "r+") as f:  # a legitimately compressed store still loads
        for s in ("train", "test"):
            x = f[s]["features"][()]
            del f[s]["features"]
            f[s].create_dataset("features", data=x, chunks=(2, x.shape[1]), compression="gzip")
    assert load_store(ok).train_x.shape == (12, 4)


def test_a_chunk_larger_than_its_dataset_is_refused(tmp_path):
    """One compressed chunk of 5M x 4 zeros (80 MB when read) behind a dataset of 12 rows."""
    from extract.store import open_store

    p = tmp_path / "chunk.h5"
    small_store(p)
    with h5py.File(p, "r+") as f:
        del f["train"]["features"]
        d = f["train"].create_dataset("features", shape=(12, 4), maxshape=(None, 4), chunks=(5_000_000, 4),
                                      dtype="float32", compression="gzip")  # fmt: skip
        d[...] = 0.0
    with pytest.raises(FedheadError, match="chunk"):
        open_store(p)


def test_the_memory_budget_names_itself_and_how_to_raise_it(tmp_path, monkeypatch):
    from extract.store import load_store

    p = small_store(tmp_path / "s.h5", n=4000, dim=64)  # about 1.5 MB as float32
    monkeypatch.setenv("FEDHEAD_MEMORY_BUDGET", "1M")
    with pytest.raises(FedheadError, match="FEDHEAD_MEMORY_BUDGET") as e:
        load_store(p)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("FEDHEAD_MEMORY_BUDGET", "lots")
    with pytest.raises(FedheadError, match="FEDHEAD_MEMORY_BUDGET.*'lots'"):
        load_store(p)
    monkeypatch.setenv("FEDHEAD_MEMORY_BUDGET", "64M")
    assert load_store(p).train_x.shape == (4000, 64)


def test_a_store_that_reads_other_files_is_refused(tmp_path):
    """HDF5 can keep a dataset's bytes in another file (external storage, virtual datasets) or link to an object in
    another file: a store names no file outside itself."""
    from extract.store import open_store

    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(48, dtype="<f4").tobytes())
    ext = small_store(tmp_path / "ext.h5")
    with h5py.File(ext, "r+") as f:
        del f["train"]["features"]
        f["train"].create_dataset("features", shape=(12, 4), dtype="<f4", external=[(str(secret), 0, 192)])
    with pytest.raises(FedheadError, match="outside"):
        open_store(ext)
    other = small_store(tmp_path / "other.h5")
    link = small_store(tmp_path / "link.h5")
    with h5py.File(link, "r+") as f:
        del f["test"]
        f["test"] = h5py.ExternalLink(str(other), "/test")
    with pytest.raises(FedheadError, match="outside"):
        open_store(link)


# ---------------------------------------------------------------- findings 5-7: model cards


@pytest.fixture(scope="module")
def card_store(tmp_path_factory):
    return small_store(tmp_path_factory.mktemp("cards") / "store.h5", n=30, dim=8)


def write_card(run_dir: Path, store_path: Path, head: str = "softmax", centered: bool = True, **head_params) -> Path:
    """A model as a run writes it (:func:`write_model`), without the run: a random head on ``store_path``."""
    import torch

    from extract.store import load_store
    from fedhead.federation.clients import FeatureStats
    from fedhead.federation.config import TrainConfig
    from fedhead.federation.model import write_model

    store = load_store(store_path)
    d = store.train_x.shape[1]
    width = int(head_params.get("rf_width", d)) if head == "ridge-rf" else d
    theta = torch.randn(3, width + 1, generator=torch.Generator().manual_seed(0))
    stats = FeatureStats(store.train_x.mean(0) if centered else None, 1.0, 0, 0)
    cfg = TrainConfig(features=str(store_path), head=head, clients=2, head_params=head_params)
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_model(run_dir, (0, "main"), theta, stats, cfg, store, {"test_accuracy": 0.5})


def edit_card(card: Path, edit) -> Path:
    import json

    data = json.loads(card.read_text())
    edit(data)
    card.write_text(json.dumps(data))
    return card


def test_a_card_claiming_more_random_features_than_its_weights_is_refused(card_store, tmp_path):
    """Finding 5: rf_width 4,000,000 with weights for 8 made predict draw a [D, 4M] float64 projection (4.2 GB)."""
    from fedhead.federation.model import load_model

    card = write_card(tmp_path / "run", card_store, head="ridge-rf", centered=False, rf_width=8)
    assert load_model(card).predict(np.zeros((2, 8), np.float32)).shape == (2,)
    edit_card(card, lambda c: c["head"]["params"].update(rf_width=4_000_000))
    with pytest.raises(FedheadError, match="rf_width") as e:
        load_model(card)
    assert "\n" not in str(e.value) and str(card) in str(e.value)
    res = runner.invoke(cli.app, ["predict", "--model", str(card), "--features", str(card_store), "--out",
                                  str(tmp_path / "p.csv")])  # fmt: skip
    assert "rf_width" in one_line_error(res) and not (tmp_path / "p.csv").exists()


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda c: c["classes"].append("d"), "classes"),
        (lambda c: c["store"].update(feature_dim=4_000_000), "feature_dim"),
        (lambda c: c["features"].update(centered=False), "feature_mean"),
        (lambda c: c["features"].update(scale=float("nan")), "scale"),
        (lambda c: c["head"].update(probabilities="exp"), "probabilities"),
        (lambda c: c["head"].update(linear=False, kind="no-such-head"), "no-such-head"),
        (lambda c: c["store"].update(batch_size=10**12), "batch_size"),
        (lambda c: c.update(classes="abc"), "classes"),
        (lambda c: c.update(features=[]), "features"),
    ],
)
def test_card_parameters_are_checked_against_the_weights(edit, expect, card_store, tmp_path):
    from fedhead.federation.model import load_model

    card = edit_card(write_card(tmp_path / "run", card_store), edit)
    with pytest.raises(FedheadError, match=expect) as e:
        load_model(card)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside.safetensors", "sub/../../outside.safetensors", 7])
def test_a_cards_weights_file_stays_inside_its_folder(name, card_store, tmp_path):
    """Finding 6: an absolute or ``../`` weights_file was read from anywhere."""
    import shutil

    from fedhead.federation.model import load_model

    card = write_card(tmp_path / "run", card_store)
    shutil.copy(tmp_path / "run" / "model-seed0.safetensors", tmp_path / "outside.safetensors")
    edit_card(card, lambda c: c.update(weights_file=name))
    with pytest.raises(FedheadError, match=r"\(weights_file\) names .* outside its folder") as e:
        load_model(card)
    assert "\n" not in str(e.value)


def test_a_weights_file_symlinked_out_of_the_folder_is_refused(card_store, tmp_path):
    from fedhead.federation.model import load_model

    card = write_card(tmp_path / "run", card_store)
    w = tmp_path / "run" / "model-seed0.safetensors"
    w.rename(tmp_path / "elsewhere.safetensors")
    w.symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(FedheadError, match="outside"):
        load_model(card)


def test_a_card_without_its_weights_sha256_is_refused(card_store, tmp_path):
    """Finding 6: the sha was checked only when the card had one."""
    from fedhead.federation.model import load_model

    card = edit_card(write_card(tmp_path / "run", card_store), lambda c: c.pop("weights_file_sha256"))
    with pytest.raises(FedheadError, match="weights_file_sha256") as e:
        load_model(card)
    assert "\n" not in str(e.value)


def test_cards_and_exports_carry_no_absolute_paths(card_store, tmp_path, monkeypatch):
    """Finding 7: the card held the run folder, the store and the encoder checkpoint as absolute paths, and export
    copied the card into the ONNX/TorchScript metadata."""
    import json

    import torch

    from fedhead.federation import export
    from fedhead.federation.model import load_model

    run = tmp_path / "deep" / "run"
    card = write_card(run, card_store)
    text = card.read_text()
    assert str(tmp_path) not in text and str(card_store.parent) not in text, text
    # an older card (absolute paths) is exported without them
    edit_card(card, lambda c: (c["run"].update(dir=str(run)), c["store"].update(path=str(card_store),
              weights_source=f"file:{tmp_path}/ckpt.pt")))  # fmt: skip
    model = load_model(card)

    class Stub(torch.nn.Module):
        def forward(self, images):
            z = images.float().mean((1, 2, 3))[:, None].repeat(1, 3)
            return z, torch.softmax(z, 1)

    monkeypatch.setattr(export, "build_classifier", lambda m, size: Stub())
    out = tmp_path / "m.pt"
    export.export_model(model, "torchscript", out, (4, 4))
    extra = {"fedhead_model": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        torch.jit.load(str(out), _extra_files=extra)
    meta = json.loads(extra["fedhead_model"])
    assert str(tmp_path) not in extra["fedhead_model"].decode(), meta
    assert meta["store"]["path"] == card_store.name and meta["run"]["dir"] == "run"
    assert meta["store"]["weights_source"] == "file:ckpt.pt"


def test_a_cards_encoder_checkpoint_is_read_from_the_models_folder_only(card_store, tmp_path):
    """Finding 6: ``weights_source: file:<absolute path>`` made predict read (torch.load) any file the card named;
    now only the checkpoint's file name is looked up, beside the card."""
    import shutil

    import torch

    from extract.encoders import load_encoder
    from fedhead.federation.model import load_model

    enc = load_encoder("test_efficientnet", pretrained=False, image_size=32)
    elsewhere = tmp_path / "elsewhere" / "ck.pth"
    elsewhere.parent.mkdir()
    torch.save(enc.model.state_dict(), elsewhere)
    card = write_card(tmp_path / "run", card_store)
    edit_card(card, lambda c: c["store"].update(encoder="test_efficientnet", weights_source=f"file:{elsewhere}",
              weights_sha256=enc.weights_sha256, preprocessing=enc.preprocessing.as_dict(), image_size=32))  # fmt: skip
    with pytest.raises(FedheadError, match="'ck.pth' is missing. Copy it beside the model card"):
        load_model(card).load_encoder()
    shutil.copy(elsewhere, card.parent / "ck.pth")
    assert load_model(card).load_encoder().weights_sha256 == enc.weights_sha256


# ---------------------------------------------------------------- what the fuzz pass found (tests/test_fuzz_readers.py)


def _edited_store(tmp_path: Path, edit) -> Path:
    p = small_store(tmp_path / "s.h5")
    with h5py.File(p, "r+") as f:
        edit(f)
    return p


def _soft_loop(f):
    del f["train"]["features"]
    f["train"]["features"] = h5py.SoftLink("/train/features")


def _group_for_features(f):
    del f["test"]["features"]
    f["test"].create_group("features")


def _number_skipped(f):
    del f["skipped"]
    f.create_dataset("skipped", data=np.float16(0))


@pytest.mark.parametrize(
    "edit",
    [
        lambda f: f.attrs.__setitem__("format", np.array([0, 0])),  # was: ValueError (truth value of an array)
        _soft_loop,  # was: RuntimeError (too many links)
        _group_for_features,  # was: AttributeError ('Group' object has no attribute 'ndim')
        _number_skipped,  # was: TypeError (not iterable)
    ],
    ids=["array-attribute", "soft-link-loop", "group-for-array", "scalar-skipped"],
)
def test_damaged_stores_found_by_the_fuzzer_are_one_line_errors(edit, tmp_path):
    from extract.store import load_store

    p = _edited_store(tmp_path, edit)
    with pytest.raises(FedheadError) as e:
        load_store(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


@pytest.mark.parametrize(
    "data",
    [b"\x80file,client\n", b"train/cat/0.png,a\x00\n", b"train/cat/0.png," + b"x" * 200_000 + b"\n"],
    ids=["not-utf8", "nul-byte", "field-over-csv-limit"],
)
def test_a_clients_csv_that_is_not_csv_text_is_one_line(data, tmp_path):
    """Found by the fuzz pass: UnicodeDecodeError and csv.Error leaked from ``--clients-csv``."""
    from extract.clients import from_csv

    (tmp_path / "train" / "cat").mkdir(parents=True)
    p = tmp_path / "c.csv"
    p.write_bytes(data)
    with pytest.raises(FedheadError, match="--clients-csv") as e:
        from_csv([str(tmp_path / "train" / "cat" / "0.png")], p, tmp_path)
    assert "\n" not in str(e.value)


def test_a_card_without_classes_is_one_line(card_store, tmp_path):
    """Found by the fuzz pass: KeyError 'classes' leaked from load_model."""
    from fedhead.federation.model import load_model

    card = edit_card(write_card(tmp_path / "run", card_store), lambda c: c.pop("classes"))
    with pytest.raises(FedheadError, match="classes"):
        load_model(card)


def test_an_experiment_file_key_with_a_newline_is_one_line(tmp_path):
    """Found by the fuzz pass: an unknown key was printed as it is, newline included."""
    from fedhead.federation.config import load_experiment

    p = tmp_path / "x.toml"
    p.write_text('"a\\nb" = 1\n')
    with pytest.raises(FedheadError, match="not an experiment field") as e:
        load_experiment(p)
    assert "\n" not in str(e.value)
