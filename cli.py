"""The ``fedhead`` command line. This file only lists commands; they live in their modules, and a command run from
the shell imports only its own module, when click resolves it (:func:`main`). The groups list their commands from
:data:`COMMANDS` without importing them, so ``fedhead --help``, ``fedhead bench --help`` and ``fedhead flower --help``
import no command module, and ``fedhead train --help`` no torch."""

from __future__ import annotations

import functools
import importlib
import importlib.util

import typer

from fedhead import __version__
from fedhead.infra.errors import enter_cli_names
from fedhead.interface.usage import OneLineCommand, lazy_group  # click usage errors as one 'error:' line


def _lazy(group: str | None):
    """The click group class of ``group``: it lists the group's commands of :data:`COMMANDS` and imports one only
    when it is resolved (:func:`fedhead.interface.usage.lazy_group`)."""
    return lazy_group(lambda: _commands_of(group))  # COMMANDS is read when typer builds the group


_app = typer.Typer(
    name="fedhead",
    help="Federated fine-tuning of linear heads on frozen foundation-model features (OvA-LP).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=_lazy(None),
)
bench_app = typer.Typer(
    help="Benchmarks that reproduce the papers' experiments and measure speed.",
    no_args_is_help=True,
    cls=_lazy("bench"),
)
flower_app = typer.Typer(
    help="Real federation on Flower (needs the 'fedhead\\[flower]' extra).", no_args_is_help=True, cls=_lazy("flower")
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"fedhead {__version__}")
        raise typer.Exit()


@_app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print fedhead's version and exit."
    ),
) -> None:
    # every command's errors name the flags ('--lr'), where the Python API names the fields ('lr')
    ctx.call_on_close(enter_cli_names())


# (module, attribute, command name, group, help): every command, in the listing's order; a module that is missing is
# skipped so that the core commands work while optional parts are absent. ``help`` is the line the group's listing
# shows without importing the module: the first paragraph of the command's docstring (tests/test_help_imports.py
# holds them equal).
COMMANDS = [
    ("extract.commands", "extract_cmd", "extract", None,
     "Encode a dataset with a frozen encoder into an HDF5 feature store (resumable)."),
    ("extract.commands", "import_cmd", "import", None,
     "Turn features made elsewhere (.npy, .npz, Parquet, a clip-retrieval output folder) into a feature store with a "
     "content hash."),
    ("extract.commands", "info_cmd", "info", None, "Print a feature store's metadata and shapes."),
    ("fedhead.commands", "train_cmd", "train", None,
     "Run federated rounds of a linear head over cached features and print the final numbers."),
    ("fedhead.commands", "compare_cmd", "compare", None,
     "Print several runs side by side (--metric at the final round and at the round the run's validation selected, "
     "ratios, bytes, wall time, the settings that differ) and plot --metric per round of every run into "
     "OUT/compare.png (the table beside it: compare.csv, compare.json)."),
    ("fedhead.commands", "synth_cmd", "synth", None,
     "Write a synthetic feature store (many classes, few samples, non-negative features)."),
    ("fedhead.commands", "demo_cmd", "demo", None,
     "The embedded default job: extract scikit-learn's digits with the pretrained EfficientNet-Lite0 that installs "
     "from the package registry, train softmax / OvA / OvA-LP heads on non-IID clients, then classify the test "
     "digits as PNG files with the OvA-LP model through predict's path and its exported ONNX file."),
    ("fedhead.deploy", "predict_cmd", "predict", None,
     "Classify images (encoded with the model's own encoder) or a store's features with a run's model: a CSV of the "
     "top-k classes and probabilities; accuracy and a confusion matrix when the labels are known; --reject or "
     "--reject-rate labels open-set inputs 'unknown'."),
    ("fedhead.deploy", "export_cmd", "export", None,
     "Write a run's model as one file that classifies raw uint8 images [N, H, W, 3] without fedhead (encoder, "
     "preprocessing, feature preparation and head), checked against fedhead's own forward before it is kept."),
    ("fedhead.lifecycle", "update_cmd", "update", None,
     "Take new clients into a closed-form model that kept its statistics (--keep-statistics): their statistics "
     "summed into the kept ones and the head solved again, equal to a run over the union of the data; the card "
     "records the new version."),
    ("fedhead.lifecycle", "forget_cmd", "forget", None,
     "Take withdrawn clients out of a model: a closed-form model that kept its statistics subtracts theirs and "
     "solves again (equal to a run that never had them); an iterative head's run is retrained without them into "
     "--out. The card records the new version."),
    ("fedhead.scratch.commands", "scratch_cmd", "scratch", None,
     "Train a model from scratch with FedAvg, FedOVA, FedABC, Divide-and-Conquer or FedABC's baselines (local, "
     "FedProx, SCAFFOLD, FedPer, FedRep, FedRoD, LG-FedAvg)."),
    ("fedhead.scratch.ftcommands", "finetune_cmd", "finetune", None,
     "Fine-tune a pretrained encoder federatedly on raw images (LoRA, prompts, BitFit, full, FFT-MoE, PFPT), or a "
     "head on its frozen features, with fedhead train's partitions, rounds and run directory."),
    ("extract.bench", "bench_extract_cmd", "extract", "bench",
     "Extraction throughput vs the bare encoder forward on the same batches (images/s)."),
    ("fedhead.bench.commands", "ablation_cmd", "ablation", "bench",
     "Heads x partitions x recipes (the paper's Table 1 / Fig. 3): ratio to IID, Acc@95, cost."),
    ("fedhead.bench.commands", "partitions_cmd", "partitions", "bench",
     "Five heterogeneity patterns against IID (the paper's Fig. 5)."),
    ("fedhead.bench.commands", "encoders_cmd", "encoders", "bench",
     "The same protocol over stores made by different encoders (the paper's Fig. 6)."),
    ("fedhead.bench.commands", "noise_cmd", "noise", "bench",
     "Label-noise robustness, FedLTF protocol (the paper's Table 2): declines from the lowest rate."),
    ("fedhead.bench.commands", "participation_cmd", "participation", "bench",
     "Client participation sweep under Dirichlet (the paper's Fig. 9); IID at full participation as reference."),
    ("fedhead.bench.commands", "geometry_cmd", "geometry", "bench",
     "Feature geometry (the paper's Fig. 2): alignment, intra, inter and intra/inter ratio. No training."),
    ("fedhead.bench.baselines", "baselines_cmd", "baselines", "bench",
     "Closed-form heads, closed-form + fine-tuning and the classic FL baselines against the central ceiling."),
    ("fedhead.bench.privacy", "privacy_cmd", "privacy", "bench",
     "Accuracy against epsilon (DP-FedAvg for iterative heads, noisy statistics for closed-form heads) and the time "
     "and bytes DP adds, against the same runs without DP."),
    ("fedhead.bench.papers", "papers_cmd", "papers", "bench",
     "A seed paper's table on the scratch path (FedOVA Tables I-II, FedABC Tables 1-2, D&C Table 1), next to the "
     "paper's numbers."),
    ("fedhead.bench.personal", "personal_cmd", "personal", "bench",
     "Personalisation methods on the head path in the shape of FedABC's Tables 1-2: PFL accuracy, gain over the "
     "global head and drift per method and partition, the paper's numbers beside."),
    ("fedhead.bench.fft", "fft_cmd", "fft", "bench",
     "OvA-LP beside federated fine-tuning of the encoder (LoRA, prompts, full, FFT-MoE, PFPT) under IID, shard-1, "
     "shard-2 and Bernoulli-Dirichlet: final accuracy, retention of the IID accuracy, Acc@95 with its time and "
     "bytes, per-round costs, the paper's numbers beside."),
    ("fedhead.bench.lifecycle", "lifecycle_cmd", "lifecycle", "bench",
     "Update and forget against a full re-run: the seconds of taking new clients into a closed-form model and "
     "withdrawn ones out of it (exact, from kept statistics), of the runs they equal, and of an iterative head's "
     "retraining without the clients."),
    ("fedhead.bench.speed", "speed_cmd", "speed", "bench",
     "Trainer speed vs the machine's matmul/memory limits, vs a per-client loop, and in 100..1000 clients; the "
     "scratch engine's samples/s and GFLOP/s per model vs its loop backend."),
    ("fedhead.bench.clocked", "async_cmd", "async", "bench",
     "Synchronous rounds, a deadline with over-selection, FedBuff and FedAsync with stragglers on one axis of "
     "simulated time: time-to-accuracy curves and a table."),
    ("fedhead.bench.openset", "openset_cmd", "openset", "bench",
     "Open-set rejection: train on the first half of the classes, test on all; AUROC and FPR at 95% TPR of each "
     "head's unknown score (from the model file each run wrote) and the closed-set accuracy, per head and "
     "partition."),
    ("fedhead.bench.tune", "tune_cmd", "tune", "bench",
     "Tune every method with the same number of trials, choose on validation, re-run the winner with --seeds."),
    ("fedhead.flower.commands", "simulate_cmd", "simulate", "flower",
     "Run the same job as 'fedhead train' on Flower's simulation engine (one virtual SuperNode per client)."),
    ("fedhead.flower.commands", "superlink_cmd", "superlink", "flower",
     "Start a Flower SuperLink; with --features, also run the training job on the connected SuperNodes."),
    ("fedhead.flower.launch", "supernode_cmd", "supernode", "flower",
     "Start a Flower SuperNode that trains the head on this machine's own feature store."),
    ("fedhead.flower.commands", "bench_cmd", "flower", "bench",
     "Time the same job in 'fedhead train' and in Flower's simulation engine; print both wall times."),
    ("fedhead.flower.churn", "deploy_cmd", "deploy", "bench",
     "A loopback Flower deployment under churn: N SuperNodes killed and restarted, the server killed and resumed."),
]  # fmt: skip
_GROUPS = {None: _app, "bench": bench_app, "flower": flower_app}
_registered: set = set()


@functools.cache
def _installed(module: str) -> bool:
    """Whether ``module`` is there to import (its parent packages are imported to find it: only docstrings)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _function(module: str, attr: str):
    """The command function ``module.attr`` (importing the module), or None where the module is missing."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
            return None
        raise
    return getattr(mod, attr, None)


def _build(module: str, attr: str, name: str):
    """The click command ``name`` of the function ``module.attr``, as the groups' own typer would build it (None
    where the module is missing): click calls this when it resolves the command (a command run, its --help)."""
    fn = _function(module, attr)
    if fn is None:
        return None
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    one.command(name, cls=OneLineCommand)(fn)
    return typer.main.get_command(one)


def _commands_of(group: str | None) -> dict:
    """name -> (help, builder) of the installed commands of ``group`` (None: the top level), in the listing's order."""
    return {
        name: (text, functools.partial(_build, module, attr, name))
        for module, attr, name, g, text in COMMANDS
        if g == group and _installed(module)
    }


def _register() -> None:
    """Register every command on the typer apps (``cli.app``), importing every command module; each once."""
    for module, attr, name, group, _ in COMMANDS:
        if (group, name) in _registered:
            continue
        fn = _function(module, attr)
        if fn is not None:
            _GROUPS[group].command(name, cls=OneLineCommand)(fn)
            _registered.add((group, name))


_app.add_typer(bench_app, name="bench")
_app.add_typer(flower_app, name="flower")


def __getattr__(name: str):
    """``cli.app``: the command line with every command registered (tests, ``typer.testing.CliRunner``)."""
    if name == "app":
        _register()
        return _app
    raise AttributeError(f"module 'cli' has no attribute {name!r}")


def main() -> None:
    _app()  # the groups import a command's module when click resolves it (lazy_group)


if __name__ == "__main__":
    main()
