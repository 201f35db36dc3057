"""Shared fixtures: tiny synthetic feature stores (the trainer's tests never need a real encoder)."""

import os

import pytest

os.environ.setdefault("FEDHEAD_NO_PROGRESS", "1")
# One intra-op thread unless a test says otherwise: a run's last bits follow the thread count, and fedhead's default
# (the cores other processes leave free) would make a test's result depend on the machine's load and on the other
# test worker (pytest-xdist runs the suite in one process per core).
os.environ.setdefault("FEDHEAD_THREADS", "1")
# Every run builds and checks its figures' data (curves.png, partition.png) but draws them only in the tests of the
# plots (tests/test_tracking.py): drawing costs about half a second a run, and the suite runs hundreds of runs.
os.environ.setdefault("FEDHEAD_TEST_PLOTS", "data")


if os.environ.get("FEDHEAD_TEST_CPU"):  # where the suite's time goes: wall and CPU seconds per test, one line each

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import time

        t0, c0 = time.perf_counter(), os.times()
        yield
        t1, c1 = time.perf_counter(), os.times()
        own = c1.user + c1.system - c0.user - c0.system
        kids = c1.children_user + c1.children_system - c0.children_user - c0.children_system
        with open(os.environ["FEDHEAD_TEST_CPU"], "a") as f:
            f.write(f"{t1 - t0:.2f}\t{own:.2f}\t{kids:.2f}\t{item.nodeid}\n")


# ---------------------------------------------------------------- how `make test` spreads the suite over its workers

# Tests that one worker runs one after another, by node-id prefix: the tests of a module that share an expensive
# module-scoped fixture (built once, not once per worker that runs one of them), and the in-process Flower
# simulations that share one Ray (shared_ray). xdist's controller sees node ids only, and its xdist_group marker does
# not group under pytest 9 (xdist 3.8 renames ``item._nodeid``, which pytest 9 no longer reads).
SAME_WORKER = {
    "papers": ("tests/test_bench_papers.py::",),  # quick_reports: each paper's --quick run
    "hardening": ("tests/test_hardening.py::",),  # folders, reference: image folders and their uninterrupted stores
    "scratch-resume": ("tests/test_scratch_resume.py::",),  # reference: the uninterrupted runs
    "extract": ("tests/test_extract.py::",),  # data_root, tiny_clip
    "model": ("tests/test_model.py::",),  # image_run: an extracted store and a run on it
    "ray": (
        "tests/test_flower_sim.py::test_simulation_engine_",
        "tests/test_flower_scaffold_ccvr.py::test_simulation_engine_",
        "tests/test_finetune_flower.py::test_simulation_engine_",
    ),
}


def unit_of(nodeid: str) -> str:
    """The scheduling unit of a test: its SAME_WORKER group, or the test alone."""
    return next((name for name, prefixes in SAME_WORKER.items() if nodeid.startswith(prefixes)), nodeid)


def pytest_xdist_make_scheduler(config, log):
    """`--dist load`: units (:func:`unit_of`) go to the next free worker in collection order, which the workers'
    :func:`pytest_collection_modifyitems` starts with the slow tests: the long ones start first, and the short ones
    fill the cores around them instead of one long test ending the run on its own."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # collection order, not the largest unit first
    return Units(config, log)


# ---------------------------------------------------------------- the long tests, which `make test-fast` leaves out

# Marked ``slow`` here, besides the tests decorated with it: `make test-fast` runs ``-m "not slow"`` (about 3 minutes
# on 2 cores), `make test` runs everything. Chosen from a timed run of the whole suite (``--durations``,
# FEDHEAD_TEST_CPU): each took over about 10 s, or shares a module fixture that does. An entry is a module
# (``...py::``), a test with all its parameters, or the start of a parameter id (``...[ridge-rf-``).
SLOW = {
    "a Flower deployment: a SuperLink and SuperNodes as processes": (
        "tests/test_flower_deploy.py::",
        "tests/test_flower_secure.py::test_secure_aggregation_on_a_loopback_deployment",
        "tests/test_robust_aggregate.py::test_one_lying_node_moves_fedavg_not_the_trimmed_mean_over_flower",
        "tests/test_deploy_async.py::test_bench_deploy_async_on_three_nodes_one_slow",
    ),
    "Flower runs over in-process grids: SecAgg+, SCAFFOLD / CCVR, the simulation's parity checks": (
        "tests/test_flower_secure.py::",
        "tests/test_flower_scaffold_ccvr.py::",
        "tests/test_flower_sim.py::",
        "tests/test_validation.py::test_flower_nodes_report_the_same_validation_as_the_simulation",
        "tests/test_flower_personal.py::test_flower_personalisation_equals_the_in_process_run",
        "tests/test_flower_personal.py::test_a_server_cut_before_personalising_resumes_to_the_same_counts",
    ),
    "a command signalled, killed or out of disk mid-way, and resumed (subprocesses)": (
        "tests/test_interrupts.py::",
        "tests/test_hardening.py::",
        "tests/test_scratch_resume.py::",
        "tests/test_extract.py::test_resume_after_kill_gives_same_store",
        "tests/test_compress.py::test_flower_resume_finds_the_residuals_in_the_node_state_folder",
        "tests/test_loop.py::test_resume_with_more_rounds_extends_a_finished_run",
        "tests/test_scratch_baselines.py::test_resume_of_personal_state_equals_uninterrupted",
        "tests/test_personal.py::test_personalisation_is_redone_the_same_on_resume",
    ),
    "personalised heads: runs with per-client model files, the engine's plain-torch loop": (
        "tests/test_personal_models.py::",
        "tests/test_personal.py::test_local_is_training_on_the_client_alone",
    ),
    "a documented example or a bench command run end to end": (
        "tests/test_docs.py::test_readme_quickstart_runs_as_written",
        "tests/test_aggregators.py::test_readme_method_example_runs_as_written",
        "tests/test_baselines.py::test_readme_example_runs_as_written",
        "tests/test_serveropt.py::test_readme_server_example_runs_as_written",
        "tests/test_baselines.py::test_bench_baselines_quick",
        "tests/test_moments.py::test_bench_baselines_ranks_the_new_heads_beside_the_tuned_probe",
        "tests/test_natural_clients.py::test_bench_baselines_runs_natural_and_reports_per_client_accuracy",
        "tests/test_bench.py::test_ablation_report_numbers_come_from_runs",
        "tests/test_bench.py::test_resume_reruns_only_missing_and_continues_checkpoint",
        "tests/test_bench.py::test_partitions_five_patterns",
        "tests/test_bench.py::test_encoders_side_by_side_and_dataset_mismatch",
        "tests/test_bench.py::test_noise_table_declines_from_runs",
        "tests/test_bench.py::test_noise_rate_zero_is_the_clean_run_and_no_clean_skips_it",
        "tests/test_bench_privacy.py::",
        "tests/test_lifecycle.py::test_bench_lifecycle_quick",
        "tests/test_bench_personal.py::test_quick_table_holds_every_method_and_alpha_with_the_runs_numbers",
        "tests/test_ceiling.py::",
        "tests/test_engine_speed.py::test_bench_speed_scratch_cli",
        "tests/test_experiment.py::test_bench_partitions_and_privacy_delta_still_work_with_one_line_each",
        "tests/test_experiment.py::test_bench_grid_passes_each_run_what_applies",
        "tests/test_scratch_cli.py::test_dnc_color_skew_end_to_end",
        "tests/test_scratch_cli.py::test_kws_end_to_end",
        "tests/test_extract.py::test_cifar10_probe_with_pretrained_lite0",
        "tests/test_bench.py::test_participation_sweep",
        "tests/test_first_week.py::test_a_plugin_parameter_is_a_flag_a_toml_key_and_listed_in_help",
    ),
    "many training runs, or a long one": (
        "tests/test_validation.py::test_the_ceilings_head_independent_candidates_are_computed_once_per_data",
        "tests/test_validation.py::test_nothing_is_chosen_on_the_test_split",
        "tests/test_validation.py::test_closed_form_regularisation_is_chosen_on_validation",
        "tests/test_train.py::test_contract_every_head_and_partition[ridge-rf-",
        "tests/test_compress.py::test_backends_and_forms_agree",
        "tests/test_baselines.py::test_closed_form_head_is_one_exchange_with_exact_bytes",
        "tests/test_robust_aggregate.py::test_one_poisoning_client_moves_fedavg_not_the_trimmed_mean_in_the_simulator",
        "tests/test_model.py::test_train_then_predict_features_gives_the_summarys_count_of_correct[ridge-rf]",
        "tests/test_model.py::test_predict_images_equals_the_runs_evaluation_and_the_stores_features",
        "tests/test_tracking.py::test_train_writes_curves_and_partition_pngs",
        "tests/test_tracking.py::test_mlflow_records_every_row_and_a_rewrite_keeps_one_run_per_unit",
        "tests/test_denormals.py::",
        "tests/test_fuzz_readers.py::",
    ),
}
# ... and every test that uses one of these fixtures
SLOW_FIXTURES = {
    "shared_ray": "a Ray simulation (Flower's simulation engine)",
    "quick_reports": "each paper's `bench papers --quick` run (tests/test_bench_papers.py)",
    "tuned": "a `bench tune` search (tests/test_tune.py)",
}


def _names(nodeid: str, entry: str) -> bool:
    """Whether a SLOW entry names the test ``nodeid``: a module or a parameter prefix by prefix, a test by name."""
    if entry.endswith(("::", "[", "-")):
        return nodeid.startswith(entry)
    return nodeid == entry or nodeid.startswith(entry + "[")


# The bad-input table (tests/test_bad_inputs.py, 545 cases, about 30% of the fast tier's time): the fast tier keeps the
# cases of these commands (train's 151 among them); the other commands' cases run in `make test` only.
BAD_INPUTS = "tests/test_bad_inputs.py::test_bad_input_is_refused_in_one_line["
FAST_BAD_INPUTS = ("train: ", "synth: ", "info: ")


def slow_reason(nodeid: str, fixtures=()) -> str | None:
    """Why the test ``nodeid`` (using ``fixtures``) is one of the long ones (SLOW, SLOW_FIXTURES, the bad-input
    cases of commands other than FAST_BAD_INPUTS'), or None."""
    reason = next((why for why, entries in SLOW.items() if any(_names(nodeid, e) for e in entries)), None)
    if reason is None and nodeid.startswith(BAD_INPUTS) and not nodeid[len(BAD_INPUTS) :].startswith(FAST_BAD_INPUTS):
        reason = "a bad-input case of a command other than train, synth and info (make test runs every one)"
    return reason or next((why for name, why in SLOW_FIXTURES.items() if name in fixtures), None)


@pytest.hookimpl(tryfirst=True)  # before pytest's -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects the same order (xdist checks it)
        # the decorated slow tests first (the order of `make test`; the ones SLOW marks keep their place)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        reason = slow_reason(item.nodeid, getattr(item, "fixturenames", ()))
        if reason and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow(reason=reason))


@pytest.fixture(scope="session")
def shared_ray():
    """One Ray for a worker's in-process ``flower simulate`` tests (the ``ray`` unit of SAME_WORKER: one worker). Flower's
    backend shuts Ray down after every run, and each start costs seconds of CPU; here the runs after the first reuse
    it (fedhead and Flower start Ray only where none runs), and the worker shuts it down at the end."""
    ray = pytest.importorskip("ray")
    real = ray.shutdown
    ray.shutdown = lambda *a, **k: None
    try:
        yield
    finally:
        ray.shutdown = real
        if ray.is_initialized():
            real()


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    """10 classes, 40 train / 10 test samples per class, 16-dim non-negative features; 8 natural clients recorded
    (``--partition natural --clients 8``; every other partition reads the store as if it had none)."""
    from fedhead.core.synthetic import write_synthetic

    path = tmp_path_factory.mktemp("stores") / "tiny.h5"
    return write_synthetic(
        path,
        num_classes=10,
        train_per_class=40,
        test_per_class=10,
        dim=16,
        latent=8,
        spread=1.0,
        seed=0,
        natural_clients=8,
    )


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


def cut_after(monkeypatch, n_rounds: int):
    """Make the ``n_rounds + 1``-th scratch round of this process die with KeyboardInterrupt (as a crash would);
    returns a function that puts the real round back (the scratch resume tests)."""
    import fedhead.scratch.runner as R

    real, calls = R._round, {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == n_rounds + 1:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(R, "_round", dying)
    return lambda: monkeypatch.setattr(R, "_round", real)


def run_example_with_plugin(example: str, plugin: str, store, tmp_path, cli_args: list[str], bench_method: str) -> str:
    """An example file of docs/extending.md run as a user runs it, then its registrations through the CLI (``train``) and
    ``bench baselines`` via FEDHEAD_PLUGINS; each must exit 0. Returns the example's stdout."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "FEDHEAD_THREADS": "1", "FEDHEAD_NO_PROGRESS": "1", "PYTHONPATH": str(repo)}

    def run(args):
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=repo, timeout=600)
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = run([str(repo / example), str(store), str(tmp_path / "ex")])
    env["FEDHEAD_PLUGINS"] = plugin
    run(
        [
            "-m",
            "cli",
            "train",
            "--features",
            str(store),
            *cli_args,
            "--clients",
            "4",
            "--rounds",
            "2",
            "--out",
            str(tmp_path / "cli"),
        ]
    )
    run(
        [
            "-m",
            "cli",
            "bench",
            "baselines",
            "--features",
            str(store),
            "--quick",
            "--rounds",
            "2",
            "--clients",
            "4",
            "--methods",
            bench_method,
            "--partitions",
            "iid",
            "--out",
            str(tmp_path / "bl"),
        ]
    )
    return out


def small_cfg(store, shards_per_client: int = 1, **kw):
    """A small run on ``store`` (8 clients, shard partition, 3 rounds of one local epoch, CPU): the base's options
    only where they apply to the case (a closed-form head takes no --rounds), the case's own ``kw`` as given."""
    from fedhead.federation.config import TrainConfig, applicable

    base = dict(
        features=str(store),
        clients=8,
        rounds=3,
        local_epochs=1,
        batch_size=20,
        device="cpu",
        partition="shard",
        partition_params={"shards_per_client": shards_per_client},
    )
    return TrainConfig(**{**applicable({**base, **kw}), **kw})


def one_line_error(res) -> str:
    """A CliRunner result that failed as a user sees it: non-zero exit, no traceback, one ``error: `` line on stderr
    (returned)."""
    shown = f"exit {res.exit_code}\nstderr: {res.stderr!r}\nstdout: {res.stdout[-400:]!r}"
    assert res.exit_code != 0, shown
    assert res.exception is None or isinstance(res.exception, SystemExit), (repr(res.exception), shown)
    assert "Traceback" not in res.output, shown
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    return lines[0]


def crash_at(monkeypatch, module, name: str, n: int):
    """Make the ``n``-th call of ``module.name`` raise KeyboardInterrupt (a crash mid-run; the training resume
    tests cut a run at an evaluation); returns a function that puts the real one back."""
    real, calls = getattr(module, name), {"n": 0}

    def crashing(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(module, name, crashing)
    return lambda: monkeypatch.setattr(module, name, real)


if os.environ.get("FEDHEAD_TEST_TIMELINE"):  # opt-in: where the suite's wall time goes (worker, start, end, test)

    @pytest.fixture(autouse=True)
    def _timeline(request):
        import time

        t0 = time.time()
        yield
        with open(os.environ["FEDHEAD_TEST_TIMELINE"], "a") as f:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            f.write(f"{worker}\t{t0:.2f}\t{time.time():.2f}\t{request.node.nodeid}\n")
