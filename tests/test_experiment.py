"""The experiment definition (fedhead.federation.experiment): every field declared once, and spelled by one rule in
every surface that takes it (flags of train / flower simulate / the bench grids, the TOML experiment file,
TrainConfig and fedhead.run, Flower's run config and pyproject's [tool.flwr.app.config]); the experiment file
(--config, --print-config, config.toml in a run directory); the rule for options that do not apply; the renamed
options' aliases; and --help showing every default."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import warnings
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import cli
import fedhead
from fedhead.federation.config import TrainConfig, _toml_value, load_experiment
from fedhead.federation.experiment import (
    FIELD_LIST,
    FIELDS,
    FLWR,
    GIVEN,
    ITERATIVE,
    NOT_NONE,
    REQUIRED,
    Names,
    Pair,
    field_names,
)
from fedhead.infra.errors import FedheadError, Interval, OneOf, cli_names, python_spelling

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]
TIMING = ("client_ms", "server_ms", "wall_seconds")  # measured, not computed: differ between any two runs


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)
    monkeypatch.delenv("FEDHEAD_PLUGINS", raising=False)


def command(*path: str):
    cmd = typer.main.get_command(cli.app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def options_of(*path: str) -> dict:
    """flag -> click option of a command (hidden aliases included)."""
    return {opt: p for p in command(*path).params for opt in [*p.opts, *p.secondary_opts]}


# ---------------------------------------------------------------- one declaration, one spelling


def test_every_field_is_declared_once_and_trainconfig_is_its_dataclass():
    names = [f.name for f in FIELD_LIST]
    assert len(names) == len(set(names))
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert list(fields) == names + ["plugin_params"]  # the table, in order, and plugins' parameters
    for f in FIELD_LIST:
        dc = fields[f.name]
        default = dc.default_factory() if dc.default_factory is not dataclasses.MISSING else dc.default
        assert (default is dataclasses.MISSING) if f.required else default == f.default, f.name
        assert dc.metadata["experiment"] is f
    # the registries' parameters are fields, derived from their declarations (no second list)
    from fedhead.core.heads import HEADS
    from fedhead.core.partitions import PARTITIONS

    for registry, kind in ((HEADS, "head"), (PARTITIONS, "partition")):
        for spec in registry.values():
            for p in spec.params:
                assert FIELDS[p.name].kind == kind and FIELDS[p.name].flag == p.cli_flag


def _flag_name(f) -> str:
    return "--" + f.name.replace("_", "-")


@pytest.mark.parametrize("path", [("train",), ("flower", "simulate")])
def test_every_field_is_an_option_of_train_and_flower_simulate_with_its_default(path):
    opts = options_of(*path)
    shown = {p.name: p for p in command(*path).params}
    for f in FIELD_LIST:
        assert _flag_name(f) == f.flag and f.flag in opts, (path, f.name)
        p = opts[f.flag]
        assert p.name == f.name and not p.hidden
        assert p.rich_help_panel == f.group
        want = None if f.required or f.type in (list, tuple) else f.default
        if path == ("flower", "simulate") and f.name == "device":
            want = "cpu"  # simulated clients run on the CPU unless told (the command's own default, shown)
        assert shown[f.name].default == want, (path, f.name)
    for old in ("--seed",):  # renamed flags stay, hidden
        assert opts[old].hidden


def test_every_field_is_a_key_of_the_experiment_file_and_a_keyword_of_trainconfig_and_run(tmp_path):
    values = {f.name: _sample(f) for f in FIELD_LIST}
    text = "\n".join(f"{k} = {_toml_value(v)}" for k, v in values.items())  # as fedhead writes config.toml
    (tmp_path / "all.toml").write_text(text + "\n")
    loaded = load_experiment(tmp_path / "all.toml")
    assert set(loaded) == set(FIELDS)
    cfg = TrainConfig(**loaded)
    assert {f.name: getattr(cfg, f.name) for f in FIELD_LIST} == {
        k: tuple(v) if isinstance(v, list) and k != "seeds" else v for k, v in values.items()
    }
    # fedhead.run takes the same keywords (and a TrainConfig, and an experiment file)
    params = inspect.signature(fedhead.run).parameters
    assert "cfg" in params and "config" in params and params["fields"].kind is inspect.Parameter.VAR_KEYWORD


def _sample(f):
    """A valid value of ``f`` that is not its default (so the experiment file really sets it)."""
    special = {
        "features": "store.h5",
        "partition": "shard",
        "partition_arg": {"alpha": 0.5, "partition_sizes": [1, 2]},
        "head": "fedabc",
        "init": "ridge",
        "recipe": "paper",
        "optimizer": "sgd",
        "aggregate": "grouped",
        "scale": "rms",
        "server_opt": "fedadam",
        "server_betas": (0.8, 0.9),
        "calibrate": "ccvr",
        "noise": "asymmetric",
        "asym_map": "cyclic",
        "noise_dataset": "cifar10",
        "backend": "loop",
        "dual": "auto",
        "device": "cpu",
        "seeds": [0, 42],
        "fedabc_margins": "0.8,0.2,0.3",
        "log": "tensorboard",
        "log_dir": "tb",
        "early_stop_metric": "loss",
        "on_diverge": "continue",
        "personalize": "ditto",
        "personal_models": "0,1",
        "withdrawn_clients": "1",
        "async_rule": "fedbuff",
        "staleness": "poly",
        "straggler_slowdown": 4.0,
    }
    if f.name in special:
        return special[f.name]
    if f.type is bool:
        return not f.default
    if f.type is int:
        return 2 if f.default != 2 else 3
    return 0.5 if f.default != 0.5 else 0.25


def test_flower_run_config_keys_and_pyproject_defaults_follow_the_table():
    import tomllib

    pytest.importorskip("flwr")
    from fedhead.flower.common import RUN_CONFIG_FIELDS, app_config_defaults

    for f in FIELD_LIST:
        if "flower" in f.transports:
            assert RUN_CONFIG_FIELDS[f.name.replace("_", "-")] == f.name
        else:  # node-local resources and fedhead train's references are not run-config keys
            assert f.name not in RUN_CONFIG_FIELDS.values()
    app = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert app == app_config_defaults()  # same keys, same defaults ('' = not given)
    for key, name in RUN_CONFIG_FIELDS.items():
        f = FIELDS.get(name)
        if f is not None and not f.required:
            want = "" if f.default is None else f.default
            assert app[key] == (",".join(map(str, want)) if isinstance(want, list) else want), key
    assert app["wait-timeout"] == options_of("flower", "superlink")["--wait-timeout"].default == 300.0


def test_run_config_round_trip_with_flat_parameters(tmp_path):
    pytest.importorskip("flwr")
    from fedhead.flower.commands import run_config_of
    from fedhead.flower.common import config_from_run_config

    cfg = TrainConfig(
        features=str(tmp_path / "s.h5"),
        head="ridge",
        ridge_lambda=0.5,
        partition="dirichlet",
        alpha=0.3,
        min_size=2,
        seeds=[0, 7],
        clients=5,
    )
    rc = run_config_of(cfg, tmp_path / "run", False, 60, 60)
    assert rc["alpha"] == 0.3 and rc["ridge-lambda"] == 0.5 and rc["seeds"] == "0,7" and rc["out"].endswith("run")
    assert "rounds" not in rc or rc["rounds"] == 50
    back = config_from_run_config(rc)
    assert back.resolved().identity() == cfg.resolved().identity()


# ---------------------------------------------------------------- the experiment file


def _summary_numbers(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith(TIMING)}  # noqa: E731
    return {**strip(s), "per_seed": [strip(r) for r in s["per_seed"]]}


FLAGS = [
    "--head",
    "softmax",
    "--partition",
    "dirichlet",
    "--alpha",
    "0.5",
    "--min-size",
    "2",
    "--clients",
    "8",
    "--rounds",
    "2",
    "--local-epochs",
    "1",
    "--lr",
    "0.05",
    "--seeds",
    "0,3",
    "--device",
    "cpu",
]
TOML = """
head = "softmax"
partition = "dirichlet"
alpha = 0.5
min_size = 2
clients = 8
rounds = 2
local_epochs = 1
lr = 0.05
seeds = [0, 3]
device = "cpu"
"""


def _train(*args) -> str:
    r = runner.invoke(cli.app, ["train", *map(str, args)])
    assert r.exit_code == 0, r.output
    return r.stdout


def test_config_file_gives_the_numbers_of_the_same_flags_bit_for_bit(tiny_store, tmp_path):
    _train("--features", tiny_store, *FLAGS, "--out", tmp_path / "flags")
    (tmp_path / "exp.toml").write_text(f'features = "{tiny_store}"\n' + TOML)
    _train("--config", tmp_path / "exp.toml", "--out", tmp_path / "file")
    assert _summary_numbers(tmp_path / "file") == _summary_numbers(tmp_path / "flags")
    a, b = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("flags", "file"))
    assert a["identity"] == b["identity"] and a["config"] == b["config"]
    # the run directory's config.toml repeats the run
    _train("--config", tmp_path / "flags" / "config.toml", "--out", tmp_path / "again")
    assert _summary_numbers(tmp_path / "again") == _summary_numbers(tmp_path / "flags")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["identity"] == a["identity"]


def test_print_config_reloads_to_the_same_resolved_config_and_run(tiny_store, tmp_path):
    from fedhead.federation.train import validate_method

    printed = _train("--features", tiny_store, *FLAGS, "--print-config")
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing written
    (tmp_path / "printed.toml").write_text(printed)
    direct = TrainConfig.from_toml(tmp_path / "printed.toml").resolved()
    validate_method(direct)
    flags = TrainConfig(
        features=str(tiny_store),
        head="softmax",
        partition="dirichlet",
        alpha=0.5,
        min_size=2,
        clients=8,
        rounds=2,
        local_epochs=1,
        lr=0.05,
        seeds=[0, 3],
        device="cpu",
    ).resolved()
    validate_method(flags)
    assert direct == flags and direct.identity() == flags.identity()
    # printing the printed file prints it again, and it runs the same run
    assert _train("--config", tmp_path / "printed.toml", "--print-config") == printed
    _train("--features", tiny_store, *FLAGS, "--out", tmp_path / "flags")
    _train("--config", tmp_path / "printed.toml", "--out", tmp_path / "printed")
    assert _summary_numbers(tmp_path / "printed") == _summary_numbers(tmp_path / "flags")


def test_print_config_of_a_closed_form_head_leaves_out_what_does_not_apply(tiny_store, tmp_path):
    printed = _train("--features", tiny_store, "--head", "ridge", "--recipe", "fast", "--print-config")
    keys = {line.split(" = ")[0] for line in printed.splitlines() if line and not line.startswith("#")}
    assert {"head", "recipe", "features"} <= keys
    assert not keys & {"rounds", "local_steps", "local_epochs", "optimizer", "lr", "momentum", "center", "init"}
    assert "# ridge_lambda = 0.01  (ridge's default)" in printed
    (tmp_path / "r.toml").write_text(printed)
    assert _train("--config", tmp_path / "r.toml", "--print-config") == printed


def test_flags_override_the_file(tiny_store, tmp_path):
    (tmp_path / "exp.toml").write_text(f'features = "{tiny_store}"\n' + TOML)
    printed = _train("--config", tmp_path / "exp.toml", "--rounds", "1", "--seeds", "5", "--print-config")
    cfg = load_experiment(_write(tmp_path / "p.toml", printed))
    assert cfg["rounds"] == 1 and cfg["seeds"] == [5]  # the flags
    assert cfg["lr"] == 0.05 and cfg["alpha"] == 0.5 and cfg["head"] == "softmax"  # the file


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text,needle",
    [
        ("roundz = 3", "'roundz' key"),
        ("roundz = 3", "Did you mean rounds?"),
        ('rounds = "5"', "'rounds' key"),
        ("rounds = 0", "'rounds' key"),
        ("rounds = 2.5", "'rounds' key"),
        ("lr = -1.0", "'lr' key"),
        ('head = "bogus"', "'head' key"),
        ('partition = "dirichlet"\nalpha = -1', "'alpha' key"),
        ("seeds = [-1]", "'seeds'"),
        ('seeds = "a"', "'seeds'"),
        ("center = 1", "'center' key"),
        ("server_betas = [1.5, 0.9]", "'server_betas' key"),
        ('asym_rule = "cyclic"', "'asym_rule' key"),
        ('out = "runs/x"', "'out' key"),
        ("head_params = {stage1_rounds = 2}", "'head_params' key"),
        ("rounds = = 3", "not valid TOML"),
    ],
)
def test_a_bad_key_or_value_in_the_file_is_one_line_naming_it(tiny_store, tmp_path, monkeypatch, text, needle):
    monkeypatch.chdir(tmp_path)
    exp = _write(tmp_path / "exp.toml", f'features = "{tiny_store}"\n{text}\n')
    r = runner.invoke(cli.app, ["train", "--config", str(exp), "--out", str(tmp_path / "out")])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert needle in lines[0] and "Traceback" not in r.output
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["exp.toml"]


# ---------------------------------------------------------------- the declared constraints drive the bad inputs


def _context(f) -> dict:
    """The other fields that make ``f`` apply (its head, partition, noise, ...)."""
    if not f.applies:
        return {}
    w = f.applies[0]
    value = (
        {ITERATIVE: "softmax", GIVEN: "ridge", NOT_NONE: "symmetric", FLWR: "flwr:IidPartitioner"}.get(w.values)
        if isinstance(w.values, str)
        else w.choices[0]
    )
    ctx = {w.field: value, **_context(FIELDS[w.field])}
    if w.field == "noise":
        ctx["noise_rate"] = 0.2
    return ctx


def _bad_value(f):
    c = f.constraint
    if c is None and f.kind:  # declared differently by its owners: the owner the context chooses
        from fedhead.core.heads import HEADS
        from fedhead.core.partitions import PARTITIONS

        owner = (PARTITIONS if f.kind == "partition" else HEADS)[_context(f)[f.kind]]
        c = next(p.constraint for p in owner.params if p.name == f.name)
    if isinstance(c, Interval):
        if c.low is None:
            return c.high + 1
        if c.closed in ("right", "neither"):
            return c.low  # the excluded bound
        return c.low - (1 if c.integer or f.type is int else 0.5)
    if isinstance(c, (OneOf, Names)):
        return "bogus"
    if isinstance(c, Pair):
        return (1.5, 0.5)
    return None


BOUNDED = [f for f in FIELD_LIST if _bad_value(f) is not None]


@pytest.mark.parametrize("f", BOUNDED, ids=[f.name for f in BOUNDED])
def test_every_declared_constraint_refuses_an_out_of_range_value(f, tmp_path):
    bad = _bad_value(f)
    value = [bad] if f.name == "seeds" else bad
    kw = {"features": "x.h5", **_context(f), f.name: value}
    with cli_names(), pytest.raises(FedheadError, match=f"'{f.flag}'"):  # a command names the flag
        TrainConfig(**kw).resolved()
    with pytest.raises(FedheadError, match=f"'{f.name}'"):  # Python names the field
        TrainConfig(**kw).resolved()
    # the same value in an experiment file is one line naming the key
    text = "\n".join(f"{k} = {json.dumps(list(v) if isinstance(v, tuple) else v)}" for k, v in kw.items())
    with pytest.raises(FedheadError, match=f"'{f.name}'"):
        TrainConfig.from_toml(_write(tmp_path / "bad.toml", text + "\n")).resolved()


# ---------------------------------------------------------------- options that do not apply


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(head="ova2", fedlc_tau=1.0), "The '--fedlc-tau' option does not apply to --head ova2"),
        (dict(head="softmax", stage1_rounds=2), "'--stage1-rounds'"),
        (dict(head="ridge", rounds=30), "'--rounds'"),
        (dict(head="ridge", local_epochs=2, lr=0.1), "'--local-epochs' and '--lr' options"),
        (dict(partition="iid", shards_per_client=2), "'--shards-per-client'"),
        (dict(partition="shard", min_size=2), "'--min-size'"),
        (dict(recipe="paper", momentum=0.5), "--optimizer sgd"),
        (dict(init_scale=2.0), "'--init-scale'"),
        (dict(noise_rate=0.1), "'--noise-rate'"),
        (dict(ccvr_samples=10), "'--ccvr-samples'"),
        (dict(server_opt="fedadam", server_momentum=0.9), "'--server-momentum'"),
        (dict(head="softmax", ridge_lambda=1.0), "--head ridge or --init ridge"),
        (dict(recipe="paper", head="lda", center=True), "'--center'"),  # (the recipe's own value counts as unset)
    ],
)
def test_a_given_option_that_does_not_apply_is_refused(kw, needle):
    with cli_names(), pytest.raises(FedheadError, match=needle.replace("(", r"\(").replace("|", r"\|")):
        TrainConfig(features="x.h5", **kw).resolved()
    python = python_spelling(needle, field_names())  # the same message, the fields named as Python names them
    assert "--" not in python
    with pytest.raises(FedheadError, match=python.replace("(", r"\(").replace("|", r"\|")):
        TrainConfig(features="x.h5", **kw).resolved()


@pytest.mark.parametrize(
    "kw",
    [
        dict(head="ridge", rounds=50, center=False, scale="none"),  # defaults and inert values
        dict(head="softmax", init="ridge", ridge_lambda=2.0),  # a closed-form head's parameter shapes --init
        dict(head="ridge", recipe="fast"),  # the recipe's start does not count as given
        dict(recipe="paper", optimizer="adamw"),
        dict(partition="zipf", min_size=3, zipf_s=0.5),
    ],
)
def test_defaults_recipes_and_what_applies_pass(kw):
    cfg = TrainConfig(features="x.h5", **kw).resolved()
    assert cfg.resolved() == cfg  # a resolved configuration resolves to itself


def test_a_closed_form_run_does_not_trip_on_its_own_resolved_values(tiny_store, tmp_path):
    from extract.store import load_store
    from fedhead.federation.train import head_run_dir, validate_method

    res = fedhead.run(features=str(tiny_store), head="ridge", clients=4, out=tmp_path / "r")
    assert res.summary["rounds"] == 1
    cfg = TrainConfig.from_toml(tmp_path / "r" / "config.toml").resolved()
    validate_method(cfg)  # as the trainer does: its identity is config.json's
    ident = head_run_dir(cfg, load_store(tiny_store), tmp_path / "r", resume=True).hash
    assert ident == json.loads((tmp_path / "r" / "config.json").read_text())["identity"]


def test_bench_grid_passes_each_run_what_applies(tiny_store, tmp_path):
    out = tmp_path / "abl"
    r = runner.invoke(
        cli.app,
        ["bench", "ablation", "--features", str(tiny_store), "--head", "ova2,ncm", "--partition", "shard-1"]
        + ["--recipe", "default", "--init", "ridge", "--quick", "--rounds", "1", "--clients", "8", "--out", str(out)],
    )
    assert r.exit_code == 0, r.output
    import csv

    rows = list(csv.DictReader((out / "results.csv").open()))
    got = {(row["bench_head"], row["bench_partition"]): (row["cfg_init"], row["cfg_rounds"]) for row in rows}
    assert got == {
        ("ova2", "iid"): ("ridge", "1"),
        ("ova2", "shard-1"): ("ridge", "1"),
        ("ncm", "iid"): ("", "50"),  # a closed-form head: neither --init nor --rounds (its one exchange)
        ("ncm", "shard-1"): ("", "50"),
    }


def test_fedhead_run_takes_the_fields_as_keywords_and_refuses_another_transport(tiny_store, tmp_path):
    kw = dict(features=str(tiny_store), head="softmax", clients=4, rounds=1, local_epochs=1, device="cpu")
    a = fedhead.run(**kw, out=tmp_path / "kw")
    b = fedhead.run(TrainConfig(**kw), out=tmp_path / "cfg")
    assert _summary_numbers(a.run_dir) == _summary_numbers(b.run_dir)
    with pytest.raises(FedheadError, match="'secure_aggregation' option applies to Flower runs only"):
        fedhead.run(**{**kw, "clients": 6}, secure_aggregation=True, out=tmp_path / "sec")
    with pytest.raises(TypeError):
        fedhead.run(TrainConfig(**kw), rounds=2)


def test_partition_and_head_params_dicts_still_work_in_python():
    cfg = TrainConfig(features="x.h5", partition="dirichlet", partition_params={"alpha": 0.1}, head_params={"x": 1})
    assert cfg.alpha == 0.1 and cfg.partition_params == {"alpha": 0.1}
    assert cfg.head_params == {"x": 1} and cfg.plugin_params == {"x": 1}  # a plugin head's parameter
    flat = TrainConfig(features="x.h5", partition="dirichlet", alpha=0.1)
    assert flat.partition_params == cfg.partition_params
    assert dataclasses.replace(flat, alpha=0.2).partition_params == {"alpha": 0.2}
    assert TrainConfig.from_dict(flat.to_dict()) == flat
    with pytest.raises(FedheadError, match="'x' parameter is not declared"):
        cfg.resolved()


# ---------------------------------------------------------------- renamed options


def _one_warning(r, old: str, new: str) -> None:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"warning: '{old}' is deprecated; use '{new}'"), r.stderr


@pytest.mark.parametrize("path", [("train",), ("flower", "simulate")])
def test_seed_still_works_and_prints_one_deprecation_line(tiny_store, path):
    r = runner.invoke(cli.app, [*path, "--features", str(tiny_store), "--seed", "3", "--seed", "4", "--print-config"])
    assert r.exit_code == 0, r.output
    _one_warning(r, "--seed", "--seeds")
    assert "seeds = [3, 4]" in r.stdout


def test_asym_rule_keyword_still_works_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="asym_rule"):
        cfg = TrainConfig(features="x.h5", noise="asymmetric", noise_rate=0.1, asym_rule="cyclic")
    assert cfg.asym_map == "cyclic"


def test_old_flower_run_config_keys_still_work_with_one_log_line_each(tmp_path, caplog):
    pytest.importorskip("flwr")
    from fedhead.flower.common import config_from_run_config

    rc = {
        "feature-store": "s.h5",
        "run-dir": str(tmp_path / "r"),
        "partition": "dirichlet",
        "partition-params": '{"alpha": 0.2}',
        "head-params": '{"stage1_rounds": 2}',
    }
    with caplog.at_level(logging.WARNING):
        cfg = config_from_run_config(rc)
    assert cfg.features == "s.h5" and cfg.alpha == 0.2 and cfg.stage1_rounds == 2
    assert rc["out"] == rc["run-dir"] == str(tmp_path / "r")  # the ServerApp's settings read the run directory
    warned = [r.getMessage() for r in caplog.records if r.name == "flwr"]
    assert len(warned) == 4 and all("deprecated" in m for m in warned)
    assert any("'feature-store' is deprecated; use 'features'" in m for m in warned)


def test_scratch_seed_and_backend_vmap_still_work_with_one_line_each(tmp_path):
    out = tmp_path / "run"
    r = runner.invoke(
        cli.app,
        ["scratch", "fedavg", "--dataset", "digits", "--data-dir", str(tmp_path), "--clients", "2", "--rounds", "1"]
        + ["--local-epochs", "1", "--partition", "iid", "--seed", "1", "--backend", "vmap", "--out", str(out)],
    )
    assert r.exit_code == 0, r.output
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert warned == [
        "warning: '--seed' is deprecated; use '--seeds' (repeated or comma-separated).",
        "warning: '--backend vmap' is deprecated; use '--backend vectorized'.",
    ]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["seeds"] == [1] and cfg["backend"] == "vectorized"
    from fedhead.scratch.runner import ScratchConfig, resolve_config

    assert resolve_config(ScratchConfig("fedavg", "digits", str(tmp_path), backend="vmap")).backend == "vectorized"


def test_bench_partitions_and_privacy_delta_still_work_with_one_line_each(tiny_store, tmp_path):
    pytest.importorskip("dp_accounting")
    base = ["--features", str(tiny_store), "--quick", "--clients", "4", "--methods", "ncm"]
    r = runner.invoke(cli.app, ["bench", "baselines", *base, "--partitions", "iid", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert [line for line in r.stderr.splitlines() if line.startswith("warning: ")] == [
        "warning: '--partitions' is deprecated; use '--partition' (repeated or comma-separated)."
    ]
    assert json.loads((tmp_path / "b" / "bench.json").read_text())["config"]["partitions"] == ["iid"]
    r = runner.invoke(
        cli.app,
        ["bench", "privacy", *base, "--partition", "iid", "--epsilons", "8", "--secagg-clients", "0"]
        + ["--delta", "1e-4", "--out", str(tmp_path / "p")],
    )
    assert r.exit_code == 0, r.output
    assert [line for line in r.stderr.splitlines() if line.startswith("warning: ")] == [
        "warning: '--delta' is deprecated; use '--dp-delta'."
    ]
    assert json.loads((tmp_path / "p" / "bench.json").read_text())["config"]["delta"] == 1e-4


# ---------------------------------------------------------------- --help


@pytest.mark.parametrize("path", [("train",), ("flower", "simulate"), ("bench", "ablation"), ("bench", "baselines")])
def test_help_shows_every_default_in_panels(path):
    for p in command(*path).params:
        if p.hidden or p.name == "help" or not isinstance(p, typer.core.click.Option):
            continue
        if p.name in FIELDS or path[0] != "bench":
            assert "[default:" in (p.help or "") or p.show_default, (path, p.name)
    r = runner.invoke(cli.app, [*path, "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "SPEC" not in r.stdout
    for panel in ("Head", "Local training", "Server and aggregation", "Privacy", "Run and output"):
        assert f"─ {panel} ─" in r.stdout, panel


def test_train_help_shows_every_default(monkeypatch):
    r = runner.invoke(cli.app, ["train", "--help"], terminal_width=240, env={"COLUMNS": "240"})
    text = " ".join(r.stdout.replace("│", " ").split())
    visible = [p for p in command("train").params if not p.hidden and p.name != "help"]
    assert text.count("[default:") == len(visible)
    for f in FIELD_LIST:  # bracketed text survives rich markup: each default as declared
        assert f"[default: {f.shown_default()}]" in text, f.name
    assert "(fedhead train and bench only)" in text and "(Flower runs only)" in text


def test_required_default_marker_is_not_a_value():
    assert FIELDS["features"].default is REQUIRED and FIELDS["features"].shown_default() == "required"
    with pytest.raises(TypeError, match="features"):
        TrainConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainConfig("x.h5")  # positional features, as a dataclass takes it
