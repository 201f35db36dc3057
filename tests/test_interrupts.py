"""SIGINT / SIGTERM to real `fedhead train` and `fedhead bench` processes, and one writer per run directory
and report folder: exit 130 / 143 with one line saying how to resume, a consistent checkpoint, the same
command continuing to the uninterrupted result."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_for_pause
from zygote import fedhead_popen

REPO = Path(__file__).resolve().parents[1]
ENV = {"FEDHEAD_THREADS": "1", "FEDHEAD_NO_PROGRESS": "1", "PYTHONPATH": str(REPO)}
PAUSE = "FEDHEAD_TEST_PAUSE_AFTER_ROUNDS"


def _popen(args, env=None):
    """A real `fedhead` process (forked from a pre-imported interpreter, tests/zygote.py); Flower's simulation in a
    fresh interpreter (Ray's clean-up runs at the interpreter's exit)."""
    e = {**os.environ, **ENV, **(env or {})}
    e.pop("FEDHEAD_DEBUG", None)
    if args[:2] != ["flower", "simulate"]:
        return fedhead_popen(args, e, REPO)
    return subprocess.Popen(
        [sys.executable, "-m", "cli", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e
    )


def _run(args, env=None):
    p = _popen(args, env)
    out, err = p.communicate(timeout=600)
    return p.returncode, out, err


def _wait_for(marker, proc, timeout=300):
    return wait_for_pause(marker, proc, timeout)


def _lines(text):
    return [ln for ln in text.splitlines() if ln.strip()]


def _accs(path):
    return [r["accuracy"] for r in csv.DictReader(open(path))]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_mid_training_then_resume(tiny_store, tmp_path, sig, code):
    args = [
        "train",
        "--features",
        str(tiny_store),
        "--head",
        "ova2",
        "--partition",
        "shard",
        "--clients",
        "8",
        "--rounds",
        "4",
        "--seeds",
        "0",
        "--seeds",
        "1",
        "--scaffold",
        "--server-opt",
        "fedadam",
    ]
    rc, _, err = _run(args + ["--out", str(tmp_path / "full")])
    assert rc == 0, err
    out, marker = tmp_path / "cut", tmp_path / "paused"
    p = _popen(args + ["--out", str(out)], env={PAUSE: f"5:{marker}"})  # mid second seed
    _wait_for(marker, p)
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == code, err
    lines = _lines(err)
    assert len(lines) == 1 and "interrupted" in lines[0] and f"--resume --out {out}" in lines[0], err
    assert (out / "checkpoint.safetensors").exists() and not (out / "summary.json").exists()
    assert len(_accs(out / "rounds.csv")) == 5  # checkpoint and csv agree
    assert not Path(str(out) + ".lock").exists()
    rc, _, err = _run(args + ["--out", str(out), "--resume"])
    assert rc == 0, err
    assert _accs(out / "rounds.csv") == _accs(tmp_path / "full" / "rounds.csv")


@pytest.mark.slow
def test_signal_mid_bench_then_same_command_continues(tiny_store, tmp_path):
    args = [
        "bench",
        "baselines",
        "--features",
        str(tiny_store),
        "--quick",
        "--rounds",
        "3",
        "--clients",
        "8",
        "--methods",
        "ova2,ridge+ft",
        "--partition",
        "iid,shard-1",
    ]
    rc, _, err = _run(args + ["--out", str(tmp_path / "full")])
    assert rc == 0, err
    out, marker = tmp_path / "cut", tmp_path / "paused"
    p = _popen(args + ["--out", str(out)], env={PAUSE: f"2:{marker}"})  # inside the first run
    _wait_for(marker, p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    lines = _lines(err)
    assert len(lines) == 2 and lines[0].startswith("report folder:"), err  # the folder line, then one line
    assert "interrupted" in lines[1] and f"--out {out}" in lines[1]
    rc, _, err = _run(args + ["--out", str(out)])
    assert rc == 0, err

    def finals(d):
        return {r["run_name"]: r["res_final_accuracy"] for r in csv.DictReader(open(d / "results.csv"))}

    assert finals(out) == finals(tmp_path / "full")


HOLD = """
import sys, time
from fedhead.infra.locks import exclusive_writer
with exclusive_writer(sys.argv[1], 'x'):
    print('held', flush=True)
    time.sleep(120)
"""


def test_second_writer_is_refused_and_a_killed_holder_does_not_block(tiny_store, tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV}
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        args = ["train", "--features", str(tiny_store), "--clients", "4", "--rounds", "1", "--out", str(out)]
        t0 = time.monotonic()
        rc, _, err = _run(args)
        assert rc == 2 and time.monotonic() - t0 < 60
        assert _lines(err) == [
            f"error: another fedhead process (pid {holder.pid}) is writing the run directory "
            f"'{out}'; wait for it or choose another --out"
        ], err
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    rc, _, err = _run(args)  # the killed holder's lock file does not block
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1


@pytest.mark.slow
def test_signal_mid_flower_simulate_then_resume(tmp_path):
    """Ray's driver aborts on SIGTERM; fedhead's handler stops the strategy after a round's checkpoint. With
    SCAFFOLD: the resumed run is a new Flower run, whose virtual nodes find their variates in the run folder."""
    pytest.importorskip("flwr")
    from fedhead.core.synthetic import write_synthetic

    store = write_synthetic(tmp_path / "s.h5", num_classes=6, train_per_class=20, test_per_class=10, dim=16)
    args = [
        "flower",
        "simulate",
        "--features",
        str(store),
        "--clients",
        "3",
        "--rounds",
        "3",
        "--partition",
        "shard",
        "--num-cpus",  # one Ray actor: the virtual nodes take turns (each actor imports torch and fedhead)
        "1",
        "--scaffold",
    ]
    out, marker = tmp_path / "cut", tmp_path / "paused"
    p = _popen(args + ["--out", str(out)], env={PAUSE: f"2:{marker}"})
    _wait_for(marker, p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 143, err
    last = _lines(err)[-1]
    assert last.startswith("interrupted") and f"--resume --out {out}" in last, err
    assert "Traceback" not in err and len(_accs(out / "rounds.csv")) == 2
    rc, _, err = _run(args + ["--out", str(out), "--resume"])
    assert rc == 0, err
    # the uninterrupted run: `fedhead train` of the same options (Flower's engine gives train's rows, as the parity
    # tests of test_flower_sim show; a third Ray start would only cost time)
    i = args.index("--num-cpus")
    train = args[2:i] + args[i + 2 :]
    rc, _, err = _run(["train", *train, "--out", str(tmp_path / "full")])
    assert rc == 0, err
    assert _accs(out / "rounds.csv") == _accs(tmp_path / "full" / "rounds.csv")
    assert json.loads((out / "summary.json").read_text())["scaffold_restarts"] == []


def test_full_disk_during_training_is_one_line_and_resumes(tiny_store, tmp_path):
    """RLIMIT_FSIZE (SIGXFSZ ignored) makes the checkpoint write fail with EFBIG: one line, exit 2, no file
    half-written under its name; once the limit is gone, --resume continues to the uninterrupted result."""
    args = ["train", "--features", str(tiny_store), "--clients", "8", "--rounds", "6", "--partition", "shard"]
    rc, _, err = _run(args + ["--out", str(tmp_path / "full")])
    assert rc == 0, err
    out = tmp_path / "cut"
    # every file written before the first checkpoint fits (config.json, the largest, holds the run's paths: its size
    # depends on the folder); a checkpoint grows with its rows (about 2.5 KB + 0.5 KB a round): the fourth round's
    # does not
    cap = (tmp_path / "full" / "config.json").stat().st_size + 1024
    limit = (
        "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({cap}, {cap})); sys.argv = ['cli'] + sys.argv[1:]; "
        "runpy.run_module('cli', run_name='__main__')"
    )
    e = {**os.environ, **ENV}
    p = subprocess.run(
        [sys.executable, "-c", limit, *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=e,
        timeout=600,
    )
    assert p.returncode == 2, p.stderr
    lines = _lines(p.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: No space left while writing") and "--resume" in lines[0]
    assert "checkpoint" in lines[0], lines[0]
    assert not any(f.name.endswith(".tmp") for f in out.iterdir()) and not (out / "summary.json").exists()
    rc, _, err = _run(args + ["--out", str(out), "--resume"])
    assert rc == 0, err
    assert _accs(out / "rounds.csv") == _accs(tmp_path / "full" / "rounds.csv")


def test_any_write_that_runs_out_of_space_is_one_line(capsys):
    """A report, a plot or a CSV failing for want of space anywhere: one line naming the file, exit code 2."""
    import errno

    from fedhead.infra.exits import report

    for code in (errno.ENOSPC, errno.EFBIG):
        assert report(OSError(code, os.strerror(code), "/r/report.md")) == 2
        err = capsys.readouterr().err
        assert _lines(err) == [
            f"error: No space left while writing '/r/report.md' ({os.strerror(code)}); free space "
            "(or raise the file size limit) and re-run the same command: finished work is reused"
        ]


def _bench_cases(store, tmp):
    grid = ["--quick", "--rounds", "2", "--clients", "8"]
    return {
        "ablation": ["bench", "ablation", "--features", str(store), *grid, "--recipe", "default", "--head", "ova2"],
        "partitions": ["bench", "partitions", "--features", str(store), *grid, "--partition", "shard-1"],
        "encoders": ["bench", "encoders", "--features", str(store), "--features", str(store), *grid],
        "noise": [
            "bench",
            "noise",
            "--features",
            str(store),
            *grid,
            "--sym-rates",
            "0.3",
            "--asym-rates",
            "0.2",
            "--asym-map",
            "cyclic",
            "--no-clean",
        ],
        "participation": ["bench", "participation", "--features", str(store), *grid, "--rates", "0.5"],
        "baselines": [
            "bench",
            "baselines",
            "--features",
            str(store),
            *grid,
            "--methods",
            "ova2",
            "--partition",
            "iid,shard-1",
        ],
        "geometry": ["bench", "geometry", "--features", str(store), "--features", str(store), "--quick"],
        "speed": [
            "bench",
            "speed",
            "--quick",
            "--no-extraction",
            "--no-ceiling",
            "--rounds",
            "1",
            "--loop-rounds",
            "0",
            "--no-scratch",
        ],  # the pause is in the heads part; the scratch part is test_engine_speed's
        "extract": [
            "bench",
            "extract",
            "--dataset",
            "digits",
            "--encoder",
            "test_efficientnet",
            "--no-pretrained",
            "--image-size",
            "32",
            "--num-images",
            "16",
            "--repeats",
            "3",
            "--batch-size",
            "8",
        ],
    }


@pytest.mark.parametrize(
    "command",
    [
        "ablation",
        "partitions",
        "encoders",
        "noise",
        "participation",
        pytest.param("baselines", marks=pytest.mark.slow),
        "geometry",
        pytest.param("speed", marks=pytest.mark.slow),
        "extract",
    ],
)
def test_sigterm_during_every_bench_command(tiny_store, tmp_path, command):
    """Each bench command, paused mid-way by the test hook, then SIGTERM: exit 143, one line saying how to go
    on, no traceback, nothing half-written under the output name; the same command then finishes."""
    args = _bench_cases(tiny_store, tmp_path)[command]
    out = tmp_path / ("out.json" if command in ("speed", "extract") else "report")
    marker = tmp_path / "paused"
    p = _popen(args + ["--out", str(out)], env={PAUSE: f"1:{marker}"})
    _wait_for(marker, p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 143, err
    last = _lines(err)[-1]
    assert last.startswith("interrupted") and "re-run the same command" in last and "Traceback" not in err, err
    assert not Path(str(out) + ".lock").exists()
    if command in ("speed", "extract", "geometry"):
        assert not out.exists()  # written only at the end, atomically
    else:
        assert not (out / "report.md").exists()  # the report comes last; finished runs are kept
    rc, _, err = _run(args + ["--out", str(out)])
    assert rc == 0, err
    assert out.exists()
