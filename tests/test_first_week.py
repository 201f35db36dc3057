"""A researcher's first week (issue 37): sweeps whose automatic run directories never collide, a failed run that says
how to retry, resuming from the run's own config, plugin heads as first-class as built-ins, limits that follow the
machine, values consistent with the method accepted, nonsense refused, and messages that name what the user typed.
Each test failed on the code before it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import one_line_error
from typer.testing import CliRunner

import fedhead
from cli import app
from extract.store import open_store
from fedhead.core.closedform import check_moments_size
from fedhead.core.heads import HEADS, register_head
from fedhead.federation.config import TrainConfig, load_experiment
from fedhead.flower.common import config_from_run_config
from fedhead.infra.errors import FedheadError, Interval
from fedhead.infra.params import Param

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]
FAST = ["--clients", "4", "--device", "cpu", "--no-plots"]


# ---------------------------------------------------------------- 1. sweeps and --overwrite


def test_a_python_sweep_gets_one_run_directory_per_run(tiny_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dirs = []
    for a in (0.1, 0.5, 1.0):
        res = fedhead.run(features=str(tiny_store), head="ncm", partition="dirichlet", alpha=a, min_size=0, clients=4,
                          device="cpu", plots=False)  # fmt: skip
        dirs.append(res.run_dir)
    assert len(set(dirs)) == 3 and all((d / "summary.json").exists() for d in dirs)
    alphas = [json.loads((d / "config.json").read_text())["config"]["partition_params"]["alpha"] for d in dirs]
    assert alphas == [0.1, 0.5, 1.0]


def test_overwrite_replaces_a_run_and_refuses_a_folder_no_run_wrote(tiny_store, tmp_path):
    out = tmp_path / "r"
    args = ["train", "--features", str(tiny_store), "--head", "ncm", *FAST, "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    again = one_line_error(runner.invoke(app, [*args, "--seeds", "1"]))
    assert "--overwrite" in again and "--resume" in again
    res = runner.invoke(app, [*args, "--seeds", "1", "--overwrite"])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "summary.json").read_text())["seeds"] == [1]
    assert not list(tmp_path.glob(".r.replaced-*"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "precious.txt").write_text("keep")
    line = one_line_error(runner.invoke(app, [*args[:-1], str(data), "--overwrite"]))
    assert "--overwrite" in line and "never empties" in line
    assert (data / "precious.txt").read_text() == "keep"
    assert "--resume" in one_line_error(runner.invoke(app, [*args, "--overwrite", "--resume"]))


# ---------------------------------------------------------------- 2. a failed run and its retry


def test_a_partition_no_seed_can_draw_is_refused_before_anything_is_written(tiny_store, tmp_path):
    # seed 0 meets the floor, seed 2 does not: found before seed 0's runs, nothing written
    assert not _draw_fails(tiny_store, 0) and _draw_fails(tiny_store, 2)
    out = tmp_path / "r"
    res = runner.invoke(app, ["train", "--features", str(tiny_store), "--head", "ncm", "--partition", "dirichlet",
                              "--alpha", "0.1", "--min-size", "40", "--clients", "8", "--seeds", "0,2",
                              "--device", "cpu", "--out", str(out)])  # fmt: skip
    line = one_line_error(res)
    assert "--min-size" in line and "Got 40 instead" not in line
    assert not out.exists() or not any(out.iterdir())


def _draw_fails(store, seed: int) -> bool:
    from extract.store import load_store
    from fedhead.core.partitions import create_partition

    y = load_store(store).train_y
    try:
        create_partition("dirichlet", y, 8, seed=seed, alpha=0.1, min_size=40)
    except FedheadError:
        return True
    return False


def test_a_run_that_fails_after_writing_says_how_to_retry(tiny_store, tmp_path):
    out = tmp_path / "r"
    args = ["train", "--features", str(tiny_store), "--rounds", "20", "--lr", "1e6", *FAST, "--out", str(out)]
    line = one_line_error(runner.invoke(app, args))
    assert "diverged" in line and "--overwrite" in line and str(out) in line
    res = runner.invoke(app, [*args[:-2], "--lr", "0.01", "--rounds", "2", "--out", str(out), "--overwrite"])
    assert res.exit_code == 0, res.output


# ---------------------------------------------------------------- 3. resume from the run's own config


def test_resume_with_only_out_from_another_directory(tiny_store, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "s.h5").write_bytes(Path(tiny_store).read_bytes())
    monkeypatch.chdir(work)
    res = runner.invoke(app, ["train", "--features", "s.h5", "--head", "ncm", *FAST, "--out", "run"])
    assert res.exit_code == 0, res.output
    recorded = load_experiment(work / "run" / "config.toml")["features"]
    assert Path(recorded).is_absolute() and Path(recorded) == work / "s.h5"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    again = runner.invoke(app, ["train", "--resume", "--out", str(work / "run")])
    assert again.exit_code == 0, again.output  # a finished run, reported again
    res = fedhead.run(out=work / "run", resume=True)
    assert res.summary["final_accuracy"] == json.loads((work / "run" / "summary.json").read_text())["final_accuracy"]
    line = one_line_error(runner.invoke(app, ["train", "--resume", "--out", str(tmp_path / "none")]))
    assert "config.toml" in line


def test_a_resume_refusal_names_flags_not_internal_fields(tiny_store, tmp_path):
    out = tmp_path / "r"
    base = ["train", "--features", str(tiny_store), "--head", "ncm", "--partition", "dirichlet", "--min-size", "0",
            *FAST, "--out", str(out)]  # fmt: skip
    assert runner.invoke(app, [*base, "--alpha", "0.5"]).exit_code == 0
    line = one_line_error(runner.invoke(app, [*base, "--alpha", "0.7", "--resume"]))
    assert "--alpha 0.5 (the run) -> 0.7" in line and "partition_params" not in line


# ---------------------------------------------------------------- 4. plugin heads


PLUGIN = '''
import torch
import torch.nn.functional as F
import fedhead
from fedhead import ClosedFormHead, Interval, Param
from fedhead.core.closedform import _means


@fedhead.register_head("focal37", Param("gamma37", 2.0, Interval(0, None), "focal loss exponent"))
class Focal(fedhead.Head):
    """Softmax with a focal loss."""

    def per_sample(self, logits, y, ctx):
        ce = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        return (1 - (-ce).exp()) ** self.params["gamma37"] * ce


@fedhead.register_head("means37")
class Means(ClosedFormHead):
    """Class means as weights (a plugin closed-form head)."""

    def solve(self, acc):
        return torch.cat([_means(acc)[0], torch.zeros(acc.C, 1, dtype=torch.float64)], 1)
'''


@pytest.fixture()
def plugin_env(tmp_path, monkeypatch):
    (tmp_path / "plug37.py").write_text(PLUGIN)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", FEDHEAD_PLUGINS="plug37")
    return env


def test_a_plugin_parameter_is_a_flag_a_toml_key_and_listed_in_help(tiny_store, tmp_path, plugin_env):
    def fedhead_cli(*args):
        code = "import sys, cli; sys.argv = ['fedhead', *sys.argv[1:]]; cli.main()"
        return subprocess.run([sys.executable, "-c", code, *args], env=plugin_env, capture_output=True, text=True,
                              cwd=tmp_path, timeout=600)  # fmt: skip

    help_ = fedhead_cli("train", "--help")
    assert help_.returncode == 0, help_.stderr
    text = " ".join(help_.stdout.split())
    assert "--gamma37" in text and "focal37" in text and "means37" in text
    for name in ("qda", "fedpft", "ridge-rf"):
        assert name in text
    out = fedhead_cli("train", "--features", str(tiny_store), "--head", "focal37", "--gamma37", "0.5", "--rounds", "2",
                      *FAST, "--out", "a")  # fmt: skip
    assert out.returncode == 0, out.stderr
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["head_params"]["gamma37"] == 0.5
    (tmp_path / "e.toml").write_text(f'features = "{tiny_store}"\nhead = "focal37"\ngamma37 = 1.5\nrounds = 2\n')
    out = fedhead_cli("train", "--config", "e.toml", *FAST, "--out", "b")
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "b" / "config.json").read_text())["head_params"]["gamma37"] == 1.5
    bad = fedhead_cli("train", "--features", str(tiny_store), "--head", "focal37", "--gamma37", "-1", "--out", "c")
    assert bad.returncode != 0 and "--gamma37" in bad.stderr and "Traceback" not in bad.stderr
    init = fedhead_cli("train", "--features", str(tiny_store), "--head", "softmax", "--init", "means37", "--rounds",
                       "2", *FAST, "--out", "d")  # fmt: skip
    assert init.returncode == 0, init.stderr


def test_a_plugin_parameter_is_a_python_keyword_and_a_run_config_key(tiny_store, tmp_path):
    @register_head("smooth37", Param("smooth37", 0.1, Interval(0, 1, closed="left"), "label smoothing"))
    class Smooth(fedhead.Head):
        def per_sample(self, logits, y, ctx):
            import torch.nn.functional as F

            return F.cross_entropy(logits.transpose(1, 2), y, reduction="none", label_smoothing=self.params["smooth37"])

    try:
        cfg = TrainConfig(features=str(tiny_store), head="smooth37", smooth37=0.2)
        assert cfg.head_params == {"smooth37": 0.2}
        with pytest.raises(FedheadError, match="smooth37"):
            TrainConfig(features=str(tiny_store), head="smooth37", smooth37=2.0).resolved()
        rc = config_from_run_config({"features": str(tiny_store), "head": "smooth37", "smooth37": "0.3"})
        assert rc.head_params == {"smooth37": 0.3}
        res = fedhead.run(features=str(tiny_store), head="smooth37", smooth37=0.05, rounds=2, clients=4, device="cpu",
                          plots=False, out=tmp_path / "r")  # fmt: skip
        assert res.summary["final_accuracy"] > 0
        with pytest.raises(TypeError, match="nonsense37"):
            TrainConfig(features=str(tiny_store), nonsense37=1)
    finally:
        HEADS.pop("smooth37", None)


def test_a_plugin_closed_form_head_starts_an_iterative_head(tiny_store, tmp_path):
    import torch

    from fedhead.core.closedform import ClosedFormHead, _means

    @register_head("means37b")
    class Means(ClosedFormHead):
        def solve(self, acc):
            return _means(acc)[0]  # no bias column: refused in one line, naming the head

    try:
        with pytest.raises(FedheadError, match="means37b.*bias column"):
            fedhead.run(features=str(tiny_store), head="means37b", clients=4, device="cpu", plots=False,
                        out=tmp_path / "bad")  # fmt: skip
        Means.solve = lambda self, acc: torch.cat([_means(acc)[0], torch.zeros(acc.C, 1, dtype=torch.float64)], 1)
        res = fedhead.run(features=str(tiny_store), head="softmax", init="means37b", rounds=2, clients=4,
                          device="cpu", plots=False, out=tmp_path / "r")  # fmt: skip
        assert res.rows[0]["stage"] == "statistics"
    finally:
        HEADS.pop("means37b", None)


def test_constraints_for_plugin_params_are_exported():
    assert fedhead.Interval is Interval and fedhead.OneOf is not None and fedhead.StatsAccumulator is not None


# ---------------------------------------------------------------- 5. limits follow the machine


def test_second_moments_follow_the_memory_budget(monkeypatch):
    monkeypatch.setenv("FEDHEAD_MEMORY_BUDGET", "24G")
    check_moments_size(200, 1280)  # 5.2 GB with the solve: fits a 24 GB machine (refused before at 2.1 GB)
    monkeypatch.setenv("FEDHEAD_MEMORY_BUDGET", "4G")
    with pytest.raises(FedheadError, match="FEDHEAD_MEMORY_BUDGET=4G"):
        check_moments_size(200, 1280)


def test_qda_over_the_budget_is_refused_before_writing(tiny_store, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHEAD_MEMORY_BUDGET", "10K")
    out = tmp_path / "r"
    line = one_line_error(runner.invoke(app, ["train", "--features", str(tiny_store), "--head", "qda", *FAST,
                                              "--out", str(out)]))  # fmt: skip
    assert "--head" in line and "FEDHEAD_MEMORY_BUDGET" in line
    assert not out.exists()


# ---------------------------------------------------------------- 6. a value consistent with the method


def test_rounds_1_passes_for_a_closed_form_head_and_other_values_do_not(tiny_store, tmp_path):
    base = ["train", "--features", str(tiny_store), "--head", "ridge", *FAST]
    res = runner.invoke(app, [*base, "--rounds", "1", "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    plain = runner.invoke(app, [*base, "--out", str(tmp_path / "b")])
    a, b = (json.loads((tmp_path / d / "config.json").read_text()) for d in "ab")
    assert plain.exit_code == 0 and a["identity"] == b["identity"]  # the same run
    line = one_line_error(runner.invoke(app, [*base, "--rounds", "5"]))
    assert "--rounds" in line and "--rounds 1" in line


# ---------------------------------------------------------------- 7. nonsense refused


def test_a_sketch_no_smaller_than_the_features_is_refused(tiny_store):
    line = one_line_error(runner.invoke(app, ["train", "--features", str(tiny_store), "--head", "ncm",
                                              "--stats-sketch", "16", *FAST]))  # fmt: skip
    assert "--stats-sketch" in line and "(16)" in line


def test_a_seed_named_twice_is_refused(tiny_store):
    line = one_line_error(runner.invoke(app, ["train", "--features", str(tiny_store), "--seeds", "0,0"]))
    assert "--seeds" in line and "twice" in line
    with pytest.raises(FedheadError, match="more than once"):
        TrainConfig(features=str(tiny_store), seeds=[3, 3]).resolved()


# ---------------------------------------------------------------- 10. messages


def test_a_folder_or_a_partial_store_gets_a_plain_message(tiny_store, tmp_path):
    folder = tmp_path / "stores"
    folder.mkdir()
    (folder / "a.h5").write_bytes(Path(tiny_store).read_bytes())
    with pytest.raises(FedheadError, match="a folder, not a feature store.*a.h5") as exc:
        open_store(folder)
    assert "HDF5" not in str(exc.value) and "Errno" not in str(exc.value)
    import h5py

    partial = tmp_path / "x.h5.partial"
    with h5py.File(partial, "w") as f:
        f.attrs["format"] = open_store(tiny_store).attrs.get("format", "fedhead-features")
        f.attrs["complete"] = False
    with pytest.raises(FedheadError, match="resumes") as exc:
        open_store(partial)
    assert "--overwrite" not in str(exc.value)


def test_the_dirichlet_floor_message_names_the_floor_and_what_was_reached():
    from fedhead.core.partitions import create_partition

    y = np.repeat(np.arange(10), 30)
    with pytest.raises(FedheadError) as exc:
        create_partition("dirichlet", y, 30, seed=0, alpha=0.3, min_size=10)
    text = str(exc.value)
    assert "(10)" in text and "Got 10 instead" not in text and "--min-size" in text


def test_offline_hub_weights_fail_fast_and_suggest_the_registry(monkeypatch):
    import extract.encoders as E

    monkeypatch.setattr(E, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(E, "registry_weights", lambda name: Path("/x.pth"))
    from types import SimpleNamespace

    err = E._hub_error(SimpleNamespace(name="tf_efficientnet_lite0"), OSError("no network"))
    assert "--weights registry" in str(err) and "cannot be reached" in str(err)
    hub = pytest.importorskip("huggingface_hub.constants")
    seen = []
    with E._hub_or_cache("hub"):
        seen.append(hub.HF_HUB_OFFLINE)
    assert seen == [True] and hub.HF_HUB_OFFLINE is False


def test_the_cli_names_every_head_in_help():
    res = runner.invoke(app, ["train", "--help"])
    text = " ".join(res.stdout.split())
    for name in HEADS:
        assert name in text, name
