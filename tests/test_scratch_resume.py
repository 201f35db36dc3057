"""Checkpoint and resume of ``fedhead scratch``: a resumed run equals an uninterrupted one bit for bit (in-process
crash, real SIGINT/SIGTERM to a real process), one writer per run directory, bad --resume cases, full disks.
Tiny subsets of the shared datasets, one intra-op thread."""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import cut_after, wait_for_pause
from typer.testing import CliRunner
from zygote import fedhead_popen

import cli
import fedhead.scratch.runner as R
from fedhead.federation.rundir import read_state
from fedhead.infra.safestate import save_state
from fedhead.scratch.runner import CHECKPOINT, ScratchConfig, run_scratch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path("/work/shared/datasets")
MNIST = SHARED / "mnist"
CIFAR = SHARED / "cifar10"
ENV = {"FEDHEAD_THREADS": "1", "FEDHEAD_NO_PROGRESS": "1", "PYTHONPATH": str(REPO)}
PAUSE = "FEDHEAD_TEST_PAUSE_AFTER_ROUNDS"
TIMING = ("client_ms", "server_ms")  # wall-clock columns: the only ones allowed to differ

needs_mnist = pytest.mark.skipif(not MNIST.exists(), reason="shared MNIST copy not present")
needs_cifar = pytest.mark.skipif(not CIFAR.exists(), reason="shared CIFAR-10 copy not present")
runner = CliRunner()


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)
    monkeypatch.delenv(PAUSE, raising=False)


# ---------------------------------------------------------------- helpers


def mnist_args(algo: str = "fedavg", rounds: int = 3, seeds=(0, 1)) -> list[str]:
    """By default two seeds of three rounds: a cut after row 4 is in the middle of the second seed."""
    return [
        "scratch",
        algo,
        "--dataset",
        "mnist",
        "--data-dir",
        str(MNIST),
        "--clients",
        "10",
        "--participation",
        "0.3",
        "--subset",
        "300",
        "--test-subset",
        "200",
        "--rounds",
        str(rounds),
        "--local-epochs",
        "1",
        *[a for s in seeds for a in ("--seeds", str(s))],
    ]


def mnist_cfg(algo: str = "fedavg", **kw) -> ScratchConfig:
    base = dict(
        algo=algo,
        dataset="mnist",
        data_dir=str(MNIST),
        clients=10,
        participation=0.3,
        subset=300,
        test_subset=200,
        rounds=3,
        local_epochs=1,
        seeds=[0, 1],
    )
    return ScratchConfig(**{**base, **kw})


def dnc_cfg() -> ScratchConfig:
    return ScratchConfig(
        algo="dnc",
        dataset="cifar10",
        data_dir=str(CIFAR),
        model="fedabc-convnet",
        subset=200,
        test_subset=100,
        prepass_rounds=2,
        rounds=2,
        feature_epochs=1,
        finetune_epochs=1,
        local_epochs=1,
        batch_size=32,
        seeds=[0],
    )


def rows(out: Path) -> list[dict]:
    with open(out / "rounds.csv") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def assert_same_run(a: Path, b: Path, seeds=(0, 1)) -> None:
    """The same rows (every column but the timings) and the same final models, bit for bit."""
    ra, rb = rows(a), rows(b)
    assert ra == rb
    assert len({r["accuracy"] for r in ra}) > 1 or len(ra) == 1  # something was learnt along the way
    for s in seeds:
        x, y = torch.load(a / f"model-seed{s}.pt"), torch.load(b / f"model-seed{s}.pt")
        assert list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x), s
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for key in ("final_accuracy", "last5_accuracy", "bytes_total", "per_seed"):
        assert sa.get(key) == sb.get(key), key
    assert (a / "clients.csv").read_text() == (b / "clients.csv").read_text()
    assert not (a / CHECKPOINT).exists() and not (b / CHECKPOINT).exists()


def _popen(args: list[str], env: dict | None = None, **kw):
    e = {**os.environ, **ENV}
    e.pop("FEDHEAD_DEBUG", None)
    e.pop(PAUSE, None)
    e.update(env or {})
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


def _run(args: list[str], env: dict | None = None, **kw) -> tuple[int, str, str]:
    p = _popen(args, env, **kw)
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def _wait_for(marker, proc, timeout=240):
    return wait_for_pause(marker, proc, timeout)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _fsize_limit(n: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))

    return pre


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs of ``mnist_args(algo)`` by the real command (one thread), per algorithm."""
    root = tmp_path_factory.mktemp("ref")
    done = {}

    def get(algo: str) -> Path:
        if algo not in done:
            out = root / algo
            rc, _, err = _run(mnist_args(algo) + ["--out", str(out)])
            assert rc == 0, err
            done[algo] = out
        return done[algo]

    return get


# ---------------------------------------------------------------- resume equals uninterrupted (in-process crash)


@needs_mnist
@pytest.mark.parametrize("algo", ["fedavg", "fedova"])
def test_resume_after_a_crash_equals_uninterrupted(tmp_path, monkeypatch, algo):
    full = tmp_path / "full"
    run_scratch(mnist_cfg(algo), full)
    cut = tmp_path / "cut"
    restore = cut_after(monkeypatch, 4)  # dies in round 2 of the second seed
    with pytest.raises(KeyboardInterrupt):
        run_scratch(mnist_cfg(algo), cut)
    restore()
    assert (cut / CHECKPOINT).exists() and not (cut / "summary.json").exists()
    assert len(rows(cut)) == 4 and (cut / "model-seed0.pt").exists() and not (cut / "model-seed1.pt").exists()
    ckpt = read_state(cut / CHECKPOINT)
    assert (ckpt["index"], ckpt["seed"], ckpt["current"]["round"]) == (1, 1, 1)
    assert [r["round"] for r in ckpt["done"][0]["rows"]] == [1, 2, 3]
    assert set(ckpt["current"]["rng"]) >= {"bit_generator", "state"}  # the numpy Generator's state
    if algo == "fedova":  # the per-class networks: one stacked network per class
        assert all(t.shape[0] == 10 for t in ckpt["current"]["state"].values())
    monkeypatch.setenv("FEDHEAD_THREADS", "2")  # the resumed run keeps the recorded count
    summary = run_scratch(mnist_cfg(algo), cut, resume=True)
    assert json.loads((cut / "config.json").read_text())["cpu_threads"] == 1
    assert_same_run(full, cut)
    assert run_scratch(mnist_cfg(algo), cut, resume=True) == summary  # a finished run is reported again


@needs_cifar
def test_dnc_resume_keeps_split_and_prepass_state(tmp_path, monkeypatch):
    full = tmp_path / "full"
    s_full = run_scratch(dnc_cfg(), full)
    cut = tmp_path / "cut"
    restore = cut_after(monkeypatch, 2)  # after the pre-pass, before the split is chosen
    with pytest.raises(KeyboardInterrupt):
        run_scratch(dnc_cfg(), cut)
    restore()
    ckpt = read_state(cut / CHECKPOINT)
    algo_state = ckpt["current"]["algo"]
    assert algo_state["split"] is None and {r["round"] for r in algo_state["div_rows"]} == {1, 2}
    restore = cut_after(monkeypatch, 1)  # resumes, chooses the split, dies after round 3
    with pytest.raises(KeyboardInterrupt):
        run_scratch(dnc_cfg(), cut, resume=True)
    restore()
    assert read_state(cut / CHECKPOINT)["current"]["algo"]["split"] == s_full["split_layer"]
    s_cut = run_scratch(dnc_cfg(), cut, resume=True)
    assert_same_run(full, cut, seeds=(0,))
    assert s_cut["split_layer"] == s_full["split_layer"]
    assert s_cut["divergence_last_prepass"] == s_full["divergence_last_prepass"]
    assert (full / "divergence.csv").read_text() == (cut / "divergence.csv").read_text()


# ---------------------------------------------------------------- real signals to a real process


@pytest.mark.slow
@needs_mnist
@pytest.mark.parametrize("algo,sig,code", [("fedavg", signal.SIGINT, 130), ("fedova", signal.SIGTERM, 143)])
def test_signal_mid_run_then_resume_equals_uninterrupted(tmp_path, reference, algo, sig, code):
    out, marker = tmp_path / "cut", tmp_path / "paused"
    p = _popen(mnist_args(algo) + ["--out", str(out)], env={PAUSE: f"4:{marker}"})  # mid second seed
    _wait_for(marker, p)
    p.send_signal(sig)
    stdout, err = p.communicate(timeout=120)
    assert p.returncode == code, err
    assert _lines(err) == [
        f"interrupted; the checkpoint in {str(out)!r} is consistent: re-run the same command "
        f"with --resume --out {out} to continue"
    ], err
    assert stdout == ""
    assert (out / CHECKPOINT).exists() and not (out / "summary.json").exists()
    assert len(rows(out)) == 4  # the checkpoint and rounds.csv agree
    assert read_state(out / CHECKPOINT)["current"]["round"] == 1
    assert not Path(str(out) + ".lock").exists()
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    rc, stdout, err = _run(mnist_args(algo) + ["--out", str(out), "--resume"])
    assert rc == 0, err
    assert f"run directory: {out}" in stdout
    assert_same_run(reference(algo), out)


# ---------------------------------------------------------------- one writer per run directory


HOLD = """
import sys, time
from fedhead.infra.locks import exclusive_writer
with exclusive_writer(sys.argv[1], 'x'):
    print('held', flush=True)
    time.sleep(120)
"""


@needs_mnist
def test_second_writer_is_refused_and_a_killed_holder_does_not_block(tmp_path):
    out = tmp_path / "run"
    args = mnist_args(rounds=1, seeds=(0,)) + ["--out", str(out)]
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV}
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        rc, _, err = _run(args)
        assert rc == 2 and time.monotonic() - t0 < 60, err
        assert _lines(err) == [
            f"error: another fedhead process (pid {holder.pid}) is writing the run directory "
            f"{str(out)!r}; wait for it or choose another --out"
        ], err
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    assert Path(str(out) + ".lock").exists()  # the killed holder's lock file is left behind...
    rc, _, err = _run(args)  # ...and does not block
    assert rc == 0, err
    assert len(rows(out)) == 1 and not Path(str(out) + ".lock").exists()


@needs_mnist
def test_a_paused_run_holds_the_lock_and_a_killed_one_resumes(tmp_path, reference):
    out, marker = tmp_path / "cut", tmp_path / "paused"
    first = _popen(mnist_args() + ["--out", str(out)], env={PAUSE: f"2:{marker}"})
    try:
        pid = _wait_for(marker, first)
        rc, _, err = _run(mnist_args() + ["--out", str(out), "--resume"])
        assert rc == 2 and _lines(err) == [
            f"error: another fedhead process (pid {pid}) is writing the run "
            f"directory {str(out)!r}; wait for it or choose another --out"
        ], err
        first.kill()  # SIGKILL: no cleanup at all
        first.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            first.kill()
    assert Path(str(out) + ".lock").exists() and len(rows(out)) == 2
    rc, _, err = _run(mnist_args() + ["--out", str(out), "--resume"])
    assert rc == 0, err
    assert_same_run(reference("fedavg"), out)


# ---------------------------------------------------------------- bad --resume and --out


def _invoke(args: list[str]):
    r = runner.invoke(cli.app, args)
    return r.exit_code, _lines(r.output)


@needs_mnist
def test_bad_resume_and_out_are_one_line(tmp_path):
    out = tmp_path / "run"
    short = mnist_args(rounds=1, seeds=(0,))
    code, lines = _invoke(short + ["--resume"])
    assert code == 2 and len(lines) == 1 and "'--resume' option needs the run directory" in lines[0], lines
    code, lines = _invoke(short + ["--resume", "--out", str(out)])
    assert code == 2 and len(lines) == 1, lines
    assert (
        lines[0].startswith("error: The '--resume' option needs a run to continue in")
        and "without --resume" in lines[0]
    )
    assert not out.exists()
    code, finished = _invoke(short + ["--out", str(out)])
    assert code == 0 and finished[-1] == f"run directory: {out}", finished
    summary = (out / "summary.json").read_text()
    # a finished run re-run with --resume is reported again, nothing rewritten
    code, lines = _invoke(short + ["--resume", "--out", str(out)])
    assert code == 0 and lines == finished and (out / "summary.json").read_text() == summary
    # without --resume, a run directory holding files is refused
    code, lines = _invoke(short + ["--out", str(out)])
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        f"error: The '--out' parameter names {str(out)!r}, which already holds files. Use --resume "
        "to continue that run, or choose another --out."
    )
    # a different configuration is refused, finished or not
    for other in (
        mnist_args(rounds=2, seeds=(0,)),
        mnist_args(rounds=1, seeds=(1,)),
        short + ["--lr", "0.01"],
        short + ["--subset", "400"],
    ):
        code, lines = _invoke(other + ["--resume", "--out", str(out)])
        assert code == 2 and len(lines) == 1 and "different configuration" in lines[0], (other, lines)
    # an --out that is a file
    f = tmp_path / "file"
    f.write_text("x")
    code, lines = _invoke(short + ["--out", str(f)])
    assert code == 2 and len(lines) == 1 and "which is a file" in lines[0], lines


@needs_mnist
def test_resume_before_the_first_round_was_saved_starts_over(tmp_path, monkeypatch, reference):
    out = tmp_path / "cut"
    restore = cut_after(monkeypatch, 0)  # dies in round 1: config.json only
    with pytest.raises(KeyboardInterrupt):
        run_scratch(mnist_cfg(), out)
    restore()
    assert sorted(os.listdir(out)) == ["config.json"]
    code, lines = _invoke(mnist_args() + ["--out", str(out)])
    assert code == 2 and "already holds files" in lines[0]
    code, lines = _invoke(mnist_args() + ["--out", str(out), "--resume"])
    assert code == 0, lines
    assert_same_run(reference("fedavg"), out)


@needs_mnist
def test_resume_with_a_changed_checkpoint_configuration_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "cut"
    restore = cut_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_scratch(mnist_cfg(), out)
    restore()
    ck = read_state(out / CHECKPOINT)
    ck["identity"] = "0" * 16  # a checkpoint of another configuration
    save_state(ck, out / CHECKPOINT)
    code, lines = _invoke(mnist_args() + ["--out", str(out), "--resume"])
    assert code == 2 and len(lines) == 1 and "checkpoint" in lines[0] and "different configuration" in lines[0]
    (out / CHECKPOINT).write_bytes(b"not a checkpoint")
    code, lines = _invoke(mnist_args() + ["--out", str(out), "--resume"])
    assert code == 2 and len(lines) == 1 and "cannot read the checkpoint" in lines[0], lines


# ---------------------------------------------------------------- full disk


@needs_mnist
def test_full_disk_at_the_checkpoint_is_one_line_and_leaves_no_partial_file(tmp_path, reference):
    out = tmp_path / "cut"
    args = mnist_args() + ["--out", str(out)]
    rc, stdout, err = _run(args, preexec_fn=_fsize_limit(50_000))  # config.json fits, the checkpoint does not
    lines = _lines(err)
    assert rc == 2 and len(lines) == 1, err
    assert lines[0] == (
        f"error: No space left while writing {str(out / CHECKPOINT)!r} (File too large); free "
        f"space (or raise the file size limit) and re-run the same command with --resume --out "
        f"{out} to continue."
    ), err
    assert sorted(os.listdir(out)) == ["config.json"]  # no temporary file, nothing half-written
    assert not Path(str(out) + ".lock").exists()
    rc, _, err = _run(args + ["--resume"])
    assert rc == 0, err
    assert_same_run(reference("fedavg"), out)


@needs_mnist
def test_full_disk_at_a_final_file_keeps_the_checkpoint(tmp_path, monkeypatch, reference):
    from fedhead.infra.files import atomic_path

    out = tmp_path / "cut"

    def full(run_dir, summary):  # the real atomic helper, a half-written temporary, then ENOSPC
        with atomic_path(Path(run_dir) / "summary.json") as tmp:
            tmp.write_text('{"half": ')
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(R, "write_summary", full)
    code, lines = _invoke(mnist_args() + ["--out", str(out)])
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        f"error: No space left while writing {str(out / 'summary.json')!r} (No space left on "
        f"device); free space (or raise the file size limit) and re-run the same command with "
        f"--resume --out {out} to continue."
    )
    assert (out / CHECKPOINT).exists() and not (out / "summary.json").exists()
    assert not [f for f in os.listdir(out) if f.startswith(".")]
    monkeypatch.undo()
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    code, lines = _invoke(mnist_args() + ["--out", str(out), "--resume"])
    assert code == 0, lines
    assert_same_run(reference("fedavg"), out)


def test_save_torch_raises_the_oserror_and_leaves_nothing(tmp_path):
    """torch.save reports a failed write as a RuntimeError; save_torch raises the OSError itself."""
    script = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); import torch\n"
        "from fedhead.scratch.runner import save_torch\n"
        "try:\n"
        f"    save_torch({{'x': torch.zeros(100000)}}, {str(tmp_path / 'c.pt')!r})\n"
        "except OSError as e:\n"
        "    print(e.errno)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, preexec_fn=_fsize_limit(20_000)
    )
    assert p.stdout.strip() == str(errno.EFBIG), p.stderr
    assert os.listdir(tmp_path) == []
