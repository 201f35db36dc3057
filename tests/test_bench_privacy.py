"""fedhead bench privacy: one run per (method, partition, target epsilon) with the smallest noise multiplier that
meets the target on the runs' own accountant, plus the runs without DP."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("dp_accounting", reason="the DP extra is not installed (pip install 'fedhead[dp]')")

import cli  # noqa: E402
from fedhead.bench.privacy import noise_for_epsilon  # noqa: E402
from fedhead.core.dp import epsilon_schedule  # noqa: E402
from fedhead.federation.config import TrainConfig, applicable  # noqa: E402


@pytest.mark.parametrize("head,rounds,part", [("softmax", 5, 0.5), ("ridge", 1, 1.0)])
def test_noise_for_epsilon_is_the_smallest_that_meets_the_target(head, rounds, part):
    cfg = TrainConfig(
        **applicable(  # no --rounds for a closed-form head
            dict(
                features="x.h5",
                head=head,
                rounds=rounds,
                participation=part,
                dp_noise_multiplier=1.0,
                dp_clip=1.0,
                dp_delta=1e-5,
                dp_feature_clip=None if head == "ridge" else 50.0,
                center=head != "ridge",
            )
        )
    ).resolved()
    last = 1 if head == "ridge" else rounds
    for target in (1.0, 3.0, 8.0):
        z = noise_for_epsilon(cfg, target)
        eps = epsilon_schedule(dataclasses.replace(cfg, dp_noise_multiplier=z), last)[last]["dp_epsilon"]
        below = epsilon_schedule(dataclasses.replace(cfg, dp_noise_multiplier=z / 1.01), last)[last]["dp_epsilon"]
        assert eps <= target < below  # meets it, and 1% less noise would not


@pytest.mark.slow
def test_quick_report(tiny_store, tmp_path):
    out = tmp_path / "pv"
    r = CliRunner().invoke(
        cli.app,
        [
            "bench",
            "privacy",
            "--features",
            str(tiny_store),
            "--quick",
            "--rounds",
            "2",
            "--clients",
            "4",
            "--partitions",
            "iid",
            "--epsilons",
            "2,8",
            "--secagg-clients",
            "3",
            "--secagg-rounds",
            "1",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    report = (out / "report.md").read_text()
    for section in (
        "Final test accuracy (%) against epsilon",
        "Noise multipliers",
        "What DP costs",
        "What SecAgg+ costs",
    ):
        assert section in report
    secagg = report[report.index("What SecAgg+ costs") :]
    assert secagg.count("| yes |") == 4  # secure == plain accuracy, each method
    assert (out / "privacy-accuracy.png").stat().st_size > 0
    runs = sorted(p.name for p in (out / "runs").iterdir() if p.is_dir())
    assert runs == sorted(
        f"{m}--iid--{e}" for m in ("ova2", "softmax", "ridge", "ncm") for e in ("eps2", "eps8", "none")
    )
    for m in ("ova2", "ridge"):
        s2 = json.loads((out / "runs" / f"{m}--iid--eps2" / "summary.json").read_text())
        s8 = json.loads((out / "runs" / f"{m}--iid--eps8" / "summary.json").read_text())
        assert 1.9 < s2["dp_epsilon"] <= 2.0 and 7.9 < s8["dp_epsilon"] <= 8.0
        plain = json.loads((out / "runs" / f"{m}--iid--none" / "summary.json").read_text())
        assert "dp_epsilon" not in plain
    # the same command again reuses every finished run
    r = CliRunner().invoke(
        cli.app,
        [
            "bench",
            "privacy",
            "--features",
            str(tiny_store),
            "--quick",
            "--rounds",
            "2",
            "--clients",
            "4",
            "--partitions",
            "iid",
            "--epsilons",
            "2,8",
            "--secagg-clients",
            "3",
            "--secagg-rounds",
            "1",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "| ran |" not in (out / "report.md").read_text()
