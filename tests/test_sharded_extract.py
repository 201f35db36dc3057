"""Sharded extraction (extract/shards.py, extract/engines.py): 2 processes and 2 Ray workers give the store of one
process (features bit-equal on the CPU with the same thread count, same content hash); a killed rank loses only
its shard in flight and a re-run encodes only the missing shards; a foreign part, a Ray address that does not
answer and contradictory options are one line each, with nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_extract import SIZE, TINY, make_imagefolder
from typer.testing import CliRunner

from cli import app
from extract import engines, shards
from extract.engines import KILL_ENV, KILL_RANK_ENV, Job, run_rank
from extract.run import extract_features
from extract.store import load_store, open_store

REPO = Path(__file__).resolve().parents[1]
KW = dict(pretrained=False, image_size=SIZE, batch_size=4, threads=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("shards") / "img")


@pytest.fixture(scope="module")
def single(folder, tmp_path_factory):
    """The one-process store (1 thread), the reference of every sharded run."""
    out = tmp_path_factory.mktemp("single") / "one.h5"
    return extract_features("imagefolder", folder, TINY, out=out, progress=False, **KW)


def _same_store(a: Path, b: Path) -> None:
    x, y = load_store(a), load_store(b)
    for s in ("train", "test"):
        assert np.array_equal(getattr(x, f"{s}_x"), getattr(y, f"{s}_x")), s
        assert np.array_equal(getattr(x, f"{s}_y"), getattr(y, f"{s}_y")), s
    assert x.info.class_names == y.info.class_names
    assert open_store(a).attrs["content_sha256"] == open_store(b).attrs["content_sha256"]
    assert open_store(a).attrs["request"] == open_store(b).attrs["request"]


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "cli", "extract", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "FEDHEAD_NO_PROGRESS": "1", **(env or {})},
        timeout=600,
    )


def _args(folder, out, *more):
    return ["--dataset", "imagefolder", "--data-dir", str(folder), "--encoder", TINY, "--no-pretrained",
            "--image-size", str(SIZE), "--batch-size", "4", "--out", str(out), "--shard-images", "4", *more]  # fmt: skip


def test_shards_are_whole_batches_in_source_order():
    got = shards.plan_shards({"train": 18, "test": 9}, batch_size=4, shard_images=5)
    assert [tuple(s) for s in got] == [("train", 0, 8), ("train", 8, 16), ("train", 16, 18), ("test", 0, 8),
                                       ("test", 8, 9)]  # fmt: skip


def test_one_rank_in_process_equals_one_process(folder, single, tmp_path):
    """The shard/part/merge path alone (one rank, no launcher): the same store, and the parts folder is gone."""
    out = tmp_path / "w1.h5"
    run_rank(Job("imagefolder", folder, TINY, KW, out=out, shard_images=4, progress=False), 0, 1)
    _same_store(single, out)
    assert not shards.parts_dir(out).exists()


def test_two_processes_equal_one_process(folder, single, tmp_path):
    out = tmp_path / "p2.h5"
    r = _cli(*_args(folder, out, "--processes", "2", "--threads", "1"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    _same_store(single, out)
    how = open_store(out).attrs["extraction"]
    assert {k: how[k] for k in ("engine", "workers", "shard_images")} == {"engine": "local", "workers": 2,
                                                                          "shard_images": 4}  # fmt: skip
    assert how["worker_images"] == {"rank0": 14, "rank1": 13}  # shards 0, 2, 4, 6 and 1, 3, 5, 7 of 18 + 9
    assert set(how["worker_seconds"]) == {"rank0", "rank1"} and how["images_per_sec"] > 0
    r = _cli(*_args(folder, out, "--processes", "2", "--threads", "1"))  # a finished store is reused
    assert r.returncode == 0 and "reusing" in r.stderr


def test_two_ray_workers_equal_one_process(folder, single, tmp_path):
    pytest.importorskip("ray.data")
    out = tmp_path / "ray.h5"
    r = _cli(*_args(folder, out, "--engine", "ray", "--processes", "2", "--threads", "1"))
    assert r.returncode == 0, r.stderr[-2000:]
    _same_store(single, out)
    assert open_store(out).attrs["extraction"]["engine"] == "ray"


def test_killed_rank_then_rerun_encodes_only_the_missing_shards(folder, single, tmp_path, monkeypatch):
    """Rank 1 is SIGKILLed in its third batch (its shards are 1, 3, 5, 7 of 8, one batch each): its first two parts
    are kept whatever rank 0 had done when the launcher stopped it, and a re-run (here one rank, in-process)
    encodes exactly the shards without a part."""
    out = tmp_path / "k.h5"
    r = _cli(*_args(folder, out, "--processes", "2", "--threads", "1"), env={KILL_ENV: "3", KILL_RANK_ENV: "1"})
    assert r.returncode != 0
    line = r.stderr.strip().splitlines()
    assert len(line) == 1 and "process 1 of 2 was killed by SIGKILL" in line[0] and "re-run" in line[0], r.stderr
    assert not out.exists()
    parts = shards.parts_dir(out)
    kept = {p.name for p in parts.glob("*.h5")}
    plan = shards.plan_shards({"train": 18, "test": 9}, 4, 4)
    assert {plan[1].name, plan[3].name} <= kept and plan[5].name not in kept
    encoded = []
    real = engines.encode_shard
    monkeypatch.setattr(engines, "encode_shard", lambda p, s, *a: encoded.append(s.name) or real(p, s, *a))
    run_rank(Job("imagefolder", folder, TINY, KW, out=out, shard_images=4, progress=False), 0, 1)
    assert sorted(encoded) == sorted(s.name for s in plan if s.name not in kept)
    _same_store(single, out)


def test_a_part_of_another_request_is_refused(folder, tmp_path):
    """A part left by another request (here: other labels for the same images) stops the run in one line naming
    it and what differs; nothing is written; --overwrite encodes that shard again."""
    out = tmp_path / "f.h5"
    job = Job("imagefolder", folder, TINY, KW, out=out, shard_images=4, progress=False)
    run_rank(job, 0, 1)
    parts = shards.parts_dir(out)
    parts.mkdir()
    with h5py.File(out, "r") as f:
        req = f.attrs["request"]
    foreign = req.replace('"labels_sha256": {"test": "', '"labels_sha256": {"test": "0')
    first = shards.plan_shards({"train": 18}, 4, 4)[0]
    part = shards.Part(np.zeros((4, 8), np.float32), np.zeros(4, np.int64), np.zeros(0, np.int64))
    shards.write_part(parts, first, part, foreign)
    out.unlink()
    r = _cli(*_args(folder, out, "--threads", "1"))
    line = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(line) == 1, r.stderr
    assert first.name in line[0] and "differs in: labels_sha256" in line[0] and "--overwrite" in line[0]
    assert not out.exists() and not Path(str(out) + ".partial").exists()
    r = _cli(*_args(folder, out, "--threads", "1", "--overwrite"))
    assert r.returncode == 0, r.stderr
    assert out.exists() and not parts.exists()


@pytest.mark.parametrize(
    "more, expect",
    [
        (["--engine", "ray", "--ray-address", "127.0.0.1:{port}"], "nothing answered there within 10 s"),
        (["--ray-address", "127.0.0.1:1"], "needs --engine ray"),
        (["--engine", "ray", "--ray-address", "nohost"], "must be HOST:PORT"),
        (["--processes", "0"], "'--processes' parameter"),
        (["--engine", "spark"], "'--engine' parameter"),
        (["--shard-images", "0"], "'--shard-images' parameter"),
        (["--threads", "0"], "'--threads' parameter"),
    ],
)
def test_bad_engine_options_are_one_line(folder, tmp_path, more, expect):
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        out = tmp_path / "bad.h5"
        r = CliRunner().invoke(app, ["extract", *_args(folder, out, *[m.format(port=port) for m in more])])
    line = r.output.strip().splitlines()
    assert r.exit_code != 0 and len(line) == 1 and expect in line[0], r.output
    assert not out.exists() and not shards.parts_dir(out).exists()


def test_a_ray_address_that_does_not_answer_fails_within_the_stated_timeout():
    """A port that accepts the connection and stays silent (a firewall, a proxy) fails after the stated timeout, and
    a server that answers but not as gRPC is not taken for a Ray head either (where ray.init would wait)."""
    import socket
    import threading
    import time

    from fedhead.infra.errors import FedheadError

    def serve(srv, reply):
        conn, _ = srv.accept()
        conn.recv(100)
        if reply:
            conn.sendall(reply)
        time.sleep(2)
        conn.close()

    for reply, expect in ((b"", r"nothing answered there within 0.5 s \(no answer\)"),
                          (b"HTTP/1.1 400 Bad Request\r\n\r\n", "is not a Ray cluster")):  # fmt: skip
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen()
            threading.Thread(target=serve, args=(srv, reply), daemon=True).start()
            t0 = time.perf_counter()
            with pytest.raises(FedheadError, match=expect):
                engines.check_ray_address(f"127.0.0.1:{srv.getsockname()[1]}", timeout=0.5)
            assert time.perf_counter() - t0 < 5
