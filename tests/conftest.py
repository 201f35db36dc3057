"""Shared fixtures: tiny synthetic feature stores (the trainer's tests never need a real encoder)."""

import os

import pytest

os.environ.setdefault("FEDHEAD_NO_PROGRESS", "1")


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    """10 classes, 40 train / 10 test samples per class, 16-dim non-negative features."""
    from fedhead.synthetic import write_synthetic

    path = tmp_path_factory.mktemp("stores") / "tiny.h5"
    return write_synthetic(path, num_classes=10, train_per_class=40, test_per_class=10, dim=16, latent=8,
                           spread=1.0, seed=0)


def wait_for_pause(marker, proc, timeout: float = 300) -> int:
    """Wait until a subprocess paused by a ``FEDHEAD_TEST_PAUSE_AFTER_*`` hook wrote its pid into ``marker``;
    return that pid (the subprocess helpers of the hardening, interrupt and scratch-resume tests)."""
    import time

    t = time.monotonic()
    while not (marker.exists() and marker.read_text().strip()):
        if proc.poll() is not None:
            raise AssertionError(f"exited early ({proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() - t > timeout:
            proc.kill()
            raise AssertionError("never reached the pause")
        time.sleep(0.1)
    return int(marker.read_text())
