"""Hardening of the extraction stage: unreadable images (--skip-corrupt), one writer per store (lock),
stores that are wrong inside, full disks, SIGINT/SIGTERM mid-extraction. Real files, real subprocesses."""

from __future__ import annotations

import contextlib
import io
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import wait_for_pause
from PIL import Image
from test_extract import REPO, SIZE, TINY, make_imagefolder
from typer.testing import CliRunner
from zygote import fedhead_popen

from extract import datasets as D
from extract.run import KILL_ENV, PAUSE_ENV, extract_features
from extract.store import (
    StoreWriter,
    hdf5_io,
    load_store,
    open_store,
    partial_path,
    store_bytes,
    write_error,
    write_store,
)
from fedhead.infra.errors import FedheadError
from fedhead.infra.exits import cli_errors
from fedhead.infra.locks import exclusive_writer
from fedhead.infra.signals import Interrupted, signals_deferred, signals_raise

ENV = {"FEDHEAD_NO_PROGRESS": "1", "FEDHEAD_THREADS": "1"}  # one thread: resumed stores equal bit for bit


# ---------------------------------------------------------------- fixtures


def truncated_jpeg(path: Path, seed: int = 0) -> Path:
    """A real JPEG cut short: PIL opens it, and decoding fails with "image file is truncated"."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buf, format="JPEG")
    path.write_bytes(buf.getvalue()[:-60])
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hard")
    clean = make_imagefolder(root / "clean")  # 18 train, 9 test PNGs, 3 classes
    corrupt = make_imagefolder(root / "corrupt")
    bad_train = truncated_jpeg(corrupt / "train" / "bee" / "002b.jpg")  # train image 9 of 19
    bad_test = corrupt / "test" / "cat" / "bad.png"  # test image 9 of 10
    bad_test.write_text("not an image at all\n")
    return {"clean": clean, "corrupt": corrupt, "bad_train": bad_train, "bad_test": bad_test}


def _extract_args(data_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "extract",
        "--dataset",
        "imagefolder",
        "--data-dir",
        str(data_dir),
        "--encoder",
        TINY,
        "--no-pretrained",
        "--image-size",
        str(SIZE),
        "--batch-size",
        "4",
        "--out",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(folders, tmp_path_factory):
    """Uninterrupted stores (one thread, batch 4) of the clean folder and of the corrupt one with skipping."""
    d = tmp_path_factory.mktemp("ref")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDHEAD_THREADS", "1")
        kw = dict(pretrained=False, image_size=SIZE, batch_size=4, progress=False)
        return {
            "clean": extract_features("imagefolder", folders["clean"], TINY, out=d / "clean.h5", **kw),
            "corrupt": extract_features(
                "imagefolder", folders["corrupt"], TINY, out=d / "corrupt.h5", skip_corrupt=True, **kw
            ),
        }


def _popen(args: list[str], env: dict | None = None, **kw):
    e = {**os.environ, **ENV, **(env or {})}
    if not kw:  # a real process forked from a pre-imported interpreter (tests/zygote.py); preexec_fn: a fresh one
        return fedhead_popen(args, e, REPO)
    return subprocess.Popen(
        [sys.executable, "-m", "cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=e,
        **kw,
    )


def _run(args: list[str], env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    p = _popen(args, env, **kw)
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _invoke(args: list[str], monkeypatch):
    """The same command in this process (the CLI's own wrapper and exit codes)."""
    from cli import app

    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)
    return CliRunner().invoke(app, args)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _wait_for(marker, proc, timeout=240):
    return wait_for_pause(marker, proc, timeout)


def assert_same_store(a: Path, b: Path) -> None:
    x, y = load_store(a), load_store(b)
    for k in ("train_x", "train_y", "test_x", "test_y"):
        assert np.array_equal(getattr(x, k), getattr(y, k)), k
    assert x.info.attrs["request"] == y.info.attrs["request"]
    assert x.info.skipped == y.info.skipped


# ---------------------------------------------------------------- 1. unreadable images


@pytest.mark.parametrize("workers", ["0", "1"])
def test_unreadable_image_stops_with_one_line_naming_the_file(tmp_path, folders, monkeypatch, workers):
    out = tmp_path / "s.h5"
    r = _invoke(_extract_args(folders["corrupt"], out, "--num-workers", workers), monkeypatch)
    lines = _lines(r.stderr)
    assert r.exit_code == 2 and len(lines) == 1, r.stderr
    assert str(folders["bad_train"]) in lines[0] and "truncated" in lines[0] and "--skip-corrupt" in lines[0]
    assert "Traceback" not in r.output and not out.exists()
    with h5py.File(partial_path(out), "r") as h:  # the two batches before the bad one are kept for a resume
        assert int(h["train"].attrs["n_done"]) == 8 and int(h["train"].attrs["n_read"]) == 8


def test_try_image_names_what_is_wrong(folders, tmp_path):
    (tmp_path / "empty.jpg").write_bytes(b"")
    split = D.ImageSplit(
        "x",
        "train",
        np.zeros(4, np.int64),
        ["a"],
        paths=[
            str(folders["bad_train"]),
            str(folders["bad_test"]),
            str(tmp_path / "empty.jpg"),
            str(tmp_path / "gone.jpg"),
        ],
    )
    reasons = [D.try_image(split, i).reason for i in range(4)]
    assert reasons[0].startswith("truncated") and reasons[1].startswith("not an image")
    assert reasons[2].startswith("not an image") and reasons[3].startswith("missing")
    good = D.ImageSplit(
        "x", "train", np.zeros(1, np.int64), ["a"], paths=[str(folders["clean"] / "train" / "ant" / "000.png")]
    )
    assert D.try_image(good, 0).shape == (16, 16, 3)


def test_skip_corrupt_rows_labels_listing_and_reuse(tmp_path, folders, reference, monkeypatch):
    out = tmp_path / "s.h5"
    args = _extract_args(folders["corrupt"], out, "--skip-corrupt")
    r = _invoke(args, monkeypatch)
    assert r.exit_code == 0, r.output
    assert "skipped 2 unreadable images (1 in train, 1 in test)" in r.stderr
    s = load_store(out)
    assert s.info.skipped == {"train": [str(folders["bad_train"])], "test": [str(folders["bad_test"])]}
    assert s.info.attrs["n_skipped"] == 2 and s.info.shapes["train/features"] == (18, 256)
    for split, bad in (("train", 9), ("test", 9)):  # rows: the readable images in order, with their labels
        src = D.load_dataset("imagefolder", folders["corrupt"], split)
        keep = np.delete(np.arange(len(src)), bad)
        assert np.array_equal(getattr(s, f"{split}_y"), src.labels[keep])
    # same images as the clean folder: same features but for the last bits (batches hold other images)
    clean = load_store(reference["clean"])
    np.testing.assert_allclose(s.train_x, clean.train_x, rtol=1e-2, atol=1e-2)
    assert_same_store(out, reference["corrupt"])
    # reuse: only with --skip-corrupt; without it the store's gap is an error; 'info' lists the gap
    mtime = out.stat().st_mtime_ns
    r = _invoke(args, monkeypatch)
    assert r.exit_code == 0 and "reusing" in r.stderr and out.stat().st_mtime_ns == mtime, r.output
    r = _invoke(_extract_args(folders["corrupt"], out), monkeypatch)
    assert r.exit_code == 2 and "lacks 2 unreadable images" in r.stderr and "--skip-corrupt" in r.stderr, r.stderr
    assert out.stat().st_mtime_ns == mtime
    r = _invoke(["info", str(out)], monkeypatch)
    assert r.exit_code == 0 and "skipped/train" in r.stdout and "002b.jpg" in r.stdout


def test_skip_corrupt_resume_is_bit_for_bit(tmp_path, folders, reference, monkeypatch):
    out = tmp_path / "r.h5"
    args = _extract_args(folders["corrupt"], out, "--skip-corrupt")
    r = _run(args, env={KILL_ENV: "3"})  # killed after the batch that skipped train image 9
    assert r.returncode == -signal.SIGKILL, r.stderr
    with h5py.File(partial_path(out), "r") as h:
        a = h["train"].attrs
        assert (int(a["n_done"]), int(a["n_read"]), int(a["n_skipped"])) == (11, 12, 1)
    r = _invoke(_extract_args(folders["corrupt"], out), monkeypatch)  # continuing needs --skip-corrupt
    assert r.exit_code == 2 and "left out 1 unreadable image" in r.stderr and not out.exists(), r.stderr
    r = _invoke(args, monkeypatch)
    assert r.exit_code == 0, r.output
    assert_same_store(out, reference["corrupt"])


# ---------------------------------------------------------------- 2. one writer per store


def test_exclusive_writer_in_process(tmp_path):
    target = tmp_path / "sub" / "x.h5"
    with exclusive_writer(target, "X") as lock:
        assert lock == Path(str(target) + ".lock") and lock.read_text().strip() == str(os.getpid())
        with pytest.raises(
            FedheadError,
            match=rf"^another fedhead process \(pid {os.getpid()}\) is writing X; "
            r"wait for it or choose another --out$",
        ):
            with exclusive_writer(target, "X"):
                pass
    assert not lock.exists()
    lock.write_text("999999\n")  # a stale lock file whose process is gone: not held
    with exclusive_writer(target, param="--run-dir"):
        assert lock.read_text().strip() == str(os.getpid())


HOLD = """
import os, sys, time
from fedhead.infra.locks import exclusive_writer
with exclusive_writer(sys.argv[1], "the test target"):
    child = os.fork()  # like a DataLoader worker: it must not keep the lock after its parent dies
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print("locked", child, flush=True)
    time.sleep(120)
"""
TRY = """
import sys
from fedhead.infra.errors import FedheadError
from fedhead.infra.locks import exclusive_writer
try:
    with exclusive_writer(sys.argv[1], "the test target"):
        print("acquired")
except FedheadError as exc:
    print(exc)
    sys.exit(3)
"""


def test_exclusive_writer_two_processes_and_a_killed_holder(tmp_path):
    target = tmp_path / "x.h5"
    run = dict(cwd=REPO, capture_output=True, text=True, timeout=60)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(target)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        word, child = holder.stdout.readline().split()
        child = int(child)
        assert word == "locked"
        r = subprocess.run([sys.executable, "-c", TRY, str(target)], **run)
        assert r.returncode == 3, r.stderr
        assert r.stdout.strip() == (
            f"another fedhead process (pid {holder.pid}) is writing the test target; "
            "wait for it or choose another --out"
        )
        holder.kill()
        holder.wait()
        os.kill(child, 0)  # the forked child still lives...
        assert Path(str(target) + ".lock").exists()  # ...and the killed holder's lock file is left behind
        r = subprocess.run([sys.executable, "-c", TRY, str(target)], **run)
        assert r.returncode == 0 and r.stdout.strip() == "acquired", (r.stdout, r.stderr)  # but nothing holds it
    finally:
        holder.kill()
        holder.wait()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_extract_is_exclusive_and_a_killed_writer_does_not_block(tmp_path, folders, reference, monkeypatch):
    out, marker = tmp_path / "s.h5", tmp_path / "paused"
    args = _extract_args(folders["clean"], out)
    first = _popen(args, env={PAUSE_ENV: f"2:{marker}"})
    try:
        pid = _wait_for(marker, first)
        r = _invoke(args, monkeypatch)
        lines = _lines(r.stderr)
        assert r.exit_code == 2 and len(lines) == 1, r.stderr
        assert lines[0] == (
            f"error: another fedhead process (pid {pid}) is writing {str(out)!r}; wait for it or choose another --out"
        )
    finally:
        first.kill()  # SIGKILL while it holds the lock (its DataLoader worker may outlive it for a while)
        first.wait()
    assert Path(str(out) + ".lock").exists() and partial_path(out).exists()
    r = _invoke(args, monkeypatch)  # takes the stale lock over and resumes the partial
    assert r.exit_code == 0, r.output
    assert not Path(str(out) + ".lock").exists() and not partial_path(out).exists()
    assert_same_store(out, reference["clean"])


# ---------------------------------------------------------------- 3. stores that are wrong inside


def _good_store(path: Path) -> Path:
    rng = np.random.default_rng(0)
    tr = (rng.normal(size=(12, 4)).astype(np.float32), np.arange(12) % 3)
    te = (rng.normal(size=(6, 4)).astype(np.float32), np.arange(6) % 3)
    return write_store(path, train=tr, test=te, class_names=["a", "b", "c"], attrs={"dataset": "t"}, dtype="float16")


def _replace(h, name, data):
    del h[name]
    h[name] = data


BAD = {  # case -> (mutation, found by open_store's metadata checks?, words in the message)
    "nan": (
        lambda h: h["train/features"].__setitem__((2, 1), np.nan),
        False,
        "train/features hold NaN or inf (first at row 2)",
    ),
    "inf": (
        lambda h: h["test/features"].__setitem__((5, 0), np.inf),
        False,
        "test/features hold NaN or inf (first at row 5)",
    ),
    "label too big": (
        lambda h: h["train/labels"].__setitem__(4, 3),
        False,
        "train/labels hold 3 at row 4, outside [0, 3)",
    ),
    "negative label": (lambda h: h["test/labels"].__setitem__(0, -1), False, "test/labels hold -1 at row 0"),
    "no test split": (lambda h: h.__delitem__("test"), True, "test split is missing"),
    "newer version": (
        lambda h: h.attrs.__setitem__("format_version", 2),
        True,
        "format version is 2, newer than the 1 this fedhead reads",
    ),
    "dims differ": (
        lambda h: _replace(h, "test/features", np.zeros((6, 5), np.float16)),
        True,
        "feature dimension differs",
    ),
    "dim attribute": (lambda h: h.attrs.__setitem__("feature_dim", 7), True, "feature_dim 7"),
    "rows differ": (
        lambda h: _replace(h, "test/labels", np.zeros(5, np.int64)),
        True,
        "test split has features (6, 4) and labels (5,)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_wrong_store_is_refused_in_one_line(tmp_path, case):
    mutate, structural, words = BAD[case]
    path = _good_store(tmp_path / "s.h5")
    load_store(path)
    with h5py.File(path, "r+") as h:
        mutate(h)
    for fn in ([open_store] if structural else []) + [load_store, lambda p: open_store(p, check_values=True)]:
        with pytest.raises(FedheadError) as e:
            fn(path)
        msg = str(e.value)
        assert words in msg and str(path) in msg and "\n" not in msg, msg
        assert "fedhead extract --overwrite" in msg
    if not structural:
        open_store(path)  # metadata only: the values are load_store's (or check_values=True)


def test_info_refuses_a_newer_format_in_one_line(tmp_path, monkeypatch):
    path = _good_store(tmp_path / "s.h5")
    with h5py.File(path, "r+") as h:
        h.attrs["format_version"] = 9
    r = _invoke(["info", str(path)], monkeypatch)
    assert r.exit_code == 2 and len(_lines(r.stderr)) == 1 and "Upgrade fedhead" in r.stderr, r.stderr


# ---------------------------------------------------------------- 4. full disk


def _fsize_limit(n: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))

    return pre


def test_partial_of_the_previous_layout_still_resumes(tmp_path):
    """A .partial written before this change (fixed-size arrays, no n_read, no skipped_mask) resumes, with
    skipping, and finishes."""
    import json

    from extract.store import FORMAT

    out, req = tmp_path / "o.h5", {"a": 1}
    with h5py.File(partial_path(out), "w") as f:
        f.attrs.update(
            format=FORMAT,
            format_version=1,
            request=json.dumps(req, sort_keys=True),
            complete=False,
            dtype="float16",
            feature_dim=2,
            num_classes=2,
        )
        f.create_dataset("class_names", data=np.array(["a", "b"], dtype=object), dtype=h5py.string_dtype("utf-8"))
        for split, n in (("train", 6), ("test", 3)):
            g = f.create_group(split)
            g.attrs["n_done"] = 2
            g.create_dataset("features", data=np.ones((n, 2), np.float16), chunks=(n, 2))
            g.create_dataset("labels", data=np.ones(n, np.int64))
    with StoreWriter(
        out, request=req, sizes={"train": 6, "test": 3}, feature_dim=2, class_names=["a", "b"], attrs={}
    ) as w:
        assert (w.n_read("train"), w.size("train")) == (2, 6)
        w.append("train", np.zeros((3, 2)), np.array([0, 1, 0]), skipped=[3])
        w.append("test", np.zeros((0, 2)), np.zeros(0, np.int64), skipped=[2])
        w.finish({"train": [f"t{i}" for i in range(6)], "test": ["x", "y", "z"]})
    s = load_store(out)
    assert s.train_y.tolist() == [1, 1, 0, 1, 0] and s.test_x.shape == (2, 2)
    assert s.info.skipped == {"train": ["t3"], "test": ["z"]}


def test_store_size_estimate_is_an_upper_bound(tmp_path):
    for c, n, dim in ((3, 18, 256), (1000, 3000, 64), (10, 5000, 96)):
        names = [f"class-{i:04d}-name" for i in range(c)]
        req = {"class_names": names, "x": "y" * 300}
        with StoreWriter(
            tmp_path / f"{c}.h5",
            request=req,
            sizes={"train": n, "test": n // 3},
            feature_dim=dim,
            class_names=names,
            attrs={"dataset": "t"},
        ) as w:
            size = w.tmp.stat().st_size
        text = len(str(req)) + 20 + sum(len(x) + 16 for x in names)
        assert size <= store_bytes({"train": n, "test": n // 3}, dim, "float16", text) <= 1.5 * size + 65536


def test_full_disk_is_found_before_encoding(tmp_path, folders, reference, monkeypatch):
    out = tmp_path / "s.h5"
    args = _extract_args(folders["clean"], out)
    r = _run(args, preexec_fn=_fsize_limit(20_000))
    lines = _lines(r.stderr)
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(
        f"error: No space left while writing {str(partial_path(out))!r} (the file size limit ('ulimit -f') allows 20 kB"
    )
    assert lines[0].endswith("Free space (or raise the file size limit) and re-run the same command: it resumes.")
    assert not out.exists() and not partial_path(out).exists()
    r = _invoke(args, monkeypatch)  # the limit is gone
    assert r.exit_code == 0, r.output
    assert_same_store(out, reference["clean"])


@pytest.mark.slow
def test_partial_has_its_space_so_a_resume_never_grows_it(tmp_path, folders, reference):
    """The whole store is allocated and reserved when the .partial is created: resuming it under a file size
    limit equal to its size (no byte of growth allowed) still finishes."""
    out = tmp_path / "s.h5"
    args = _extract_args(folders["clean"], out)
    r = _run(args, env={KILL_ENV: "2"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    size = partial_path(out).stat().st_size
    assert size >= (18 + 9) * 256 * 2  # every row is there already
    r = _run(args, preexec_fn=_fsize_limit(size))
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size <= size
    assert_same_store(out, reference["clean"])


NO_CHECK = """
import runpy, sys
import extract.store as S
S.check_room = lambda path, need: None  # as if the disk filled up between the check and HDF5's writes
sys.argv = ["cli", *sys.argv[1:]]
runpy.run_module("cli", run_name="__main__")
"""


def test_hdf5_write_failure_is_an_oserror_and_the_next_run_recovers(tmp_path, folders, reference, monkeypatch):
    """If HDF5 itself hits the full disk (the space check bypassed), the failure still reads as the one-line
    space error and nothing appears under the final name. HDF5 cannot recover inside that process (it may
    even crash at exit, after the message): the next run restarts the unreadable .partial and finishes."""
    out = tmp_path / "s.h5"
    args = _extract_args(folders["clean"], out)
    p = subprocess.run(
        [sys.executable, "-c", NO_CHECK, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=300,
        preexec_fn=_fsize_limit(20_000),
    )
    assert p.returncode != 0
    assert _lines(p.stderr)[0].startswith(
        f"error: No space left while writing {str(partial_path(out))!r} (File too large"
    ), p.stderr
    assert not out.exists()
    r = _invoke(args, monkeypatch)
    assert r.exit_code == 0, r.output
    assert_same_store(out, reference["clean"])


def test_hdf5_io_and_write_error_messages(tmp_path):
    with pytest.raises(OSError) as e:
        with hdf5_io():
            raise RuntimeError("Unable to flush (file write failed: errno = 28, error message = 'No space')")
    assert e.value.errno == 28 and "No space left on device" in e.value.strerror
    with pytest.raises(ValueError, match="shape"):
        with hdf5_io():
            raise ValueError("shape mismatch")  # not I/O: unchanged
    msg = str(write_error(tmp_path / "x.partial", OSError(5, "Input/output error")))
    assert msg.startswith("Writing ") and msg.endswith("re-run the same command: it resumes.")


# ---------------------------------------------------------------- 5. signals


def test_signals_raise_and_defer_in_process():
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or what an earlier test's library installed (Ray)
    with signals_raise():
        with pytest.raises(Interrupted) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert e.value.exit_code == 143 and e.value.prefix == ""
        reached = False
        with pytest.raises(Interrupted) as e:
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                reached = True  # the critical section finishes first
        assert reached and e.value.exit_code == 130
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back

    @cli_errors
    def cmd():
        raise Interrupted(signal.SIGTERM, "interrupted; re-run the same command to resume from 3 of 9 images")

    with pytest.raises(SystemExit) as e:
        cmd()
    assert e.value.code == 143


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_mid_extraction_leaves_a_resumable_partial(tmp_path, folders, reference, monkeypatch, sig, code):
    out, marker = tmp_path / "s.h5", tmp_path / "paused"
    args = _extract_args(folders["clean"], out)
    p = _popen(args, env={PAUSE_ENV: f"2:{marker}"})
    _wait_for(marker, p)
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == code, err
    assert _lines(err) == ["interrupted; re-run the same command to resume from 8 of 27 images"], err
    assert not out.exists() and not Path(str(out) + ".lock").exists()
    with h5py.File(partial_path(out), "r") as h:  # consistent: the two batches, nothing half-written
        assert int(h["train"].attrs["n_done"]) == 8 and int(h["test"].attrs["n_done"]) == 0
        assert not h.attrs["complete"] and int(h.attrs["cpu_threads"]) == 1
    r = _invoke(args, monkeypatch)
    assert r.exit_code == 0, r.output
    assert_same_store(out, reference["clean"])
