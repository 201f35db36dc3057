"""The Python API's polish: ``fedhead --version``, ``dir(fedhead)``, TrainConfig's field docs in ``help()``, errors
that name fields in Python and flags on the command line, and a user's head or partition without a docstring."""

from __future__ import annotations

import pydoc
import re
from pathlib import Path

import pytest
import torch.nn.functional as F
from typer.testing import CliRunner

import cli
import fedhead
from fedhead.core.heads import HEADS
from fedhead.core.partitions import PARTITIONS, register_partition
from fedhead.federation.experiment import FIELD_LIST
from fedhead.infra.errors import FedheadError, python_spelling

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_version_prints_the_package_version():
    r = runner.invoke(cli.app, ["--version"])
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert r.exit_code == 0 and r.output.strip() == f"fedhead {version}" == f"fedhead {fedhead.__version__}"


def test_dir_lists_the_public_api():
    listed = dir(fedhead)
    assert set(fedhead.__all__) <= set(listed)
    for name in fedhead.__all__:  # each one resolves (lazily imported)
        assert getattr(fedhead, name) is not None


def test_help_shows_every_field_with_its_help_text():
    text = pydoc.render_doc(fedhead.TrainConfig, renderer=pydoc.plaintext)
    text = re.sub(r"\n \|\s+", "\n", text)  # pydoc's margin
    for f in FIELD_LIST:
        first_words = python_spelling(f.help, [g.name for g in FIELD_LIST]).split()[:4]
        assert re.search(rf"\n{f.name} \([^)]*\): " + re.escape(" ".join(first_words)), text), f.name
    assert "lr (float | None): local learning rate [default: recipe: 0.01]." in text


@pytest.mark.parametrize(
    "fields, python, flag",
    [
        ({"lr": -1.0}, "The 'lr' parameter must be a number > 0", "The '--lr' parameter must be a number > 0"),
        (
            {"head": "ova2", "fedlc_tau": 2.0},
            "The 'fedlc_tau' option does not apply to head ova2",
            "The '--fedlc-tau' option does not apply to --head ova2",
        ),
        (
            {"partition": "dirichlet", "alpha": 0.0},
            "The 'alpha' parameter must be a number > 0",
            "The '--alpha' parameter must be a number > 0",
        ),
    ],
)
def test_errors_name_fields_in_python_and_flags_on_the_command_line(tiny_store, tmp_path, fields, python, flag):
    """One message, two spellings: fedhead.run and TrainConfig.resolved name the field, fedhead train the flag."""
    with pytest.raises(FedheadError) as exc:
        fedhead.run(features=str(tiny_store), out=tmp_path / "py", **fields)
    assert str(exc.value).startswith(python) and "--" not in str(exc.value)
    with pytest.raises(FedheadError, match=re.escape(python)):
        fedhead.TrainConfig(features=str(tiny_store), **fields).resolved()

    args = []
    for k, v in fields.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    r = runner.invoke(cli.app, ["train", "--features", str(tiny_store), "--out", str(tmp_path / "cli"), *args])
    assert r.exit_code == 2 and f"error: {flag}" in r.output, r.output
    # the Python message is the command line's with the fields' flags spelled as Python names them
    cli_line = r.output.strip().splitlines()[-1].removeprefix("error: ")
    assert python_spelling(cli_line, [f.name for f in FIELD_LIST]) == str(exc.value)


def test_python_spelling_reads_the_flag_rule_backwards():
    names = ["local_epochs", "center"]
    msg = "Give --local-epochs or --no-center, not --print-config or --local-epochsx."
    assert python_spelling(msg, names) == "Give local_epochs or center=False, not --print-config or --local-epochsx."


def test_a_head_and_a_partition_without_docstrings_register(tiny_store, tmp_path):
    """A user's head class without a docstring registers and trains (it used to fail with IndexError)."""

    @fedhead.register_head("undocumented-head")
    class Undocumented(fedhead.Head):
        def per_sample(self, logits, y, ctx):
            return F.cross_entropy(logits.transpose(1, 2), y, reduction="none")

    @register_partition("undocumented-split")
    def undocumented(labels, num_clients, rng, features=None):
        return [a for a in __import__("numpy").array_split(rng.permutation(len(labels)), num_clients)]

    try:
        assert HEADS["undocumented-head"].doc == "" and PARTITIONS["undocumented-split"].doc == ""
        res = fedhead.run(
            features=str(tiny_store),
            head="undocumented-head",
            partition="undocumented-split",
            clients=4,
            rounds=1,
            out=tmp_path / "run",
        )
        assert res.summary["head"] == "undocumented-head"
    finally:
        HEADS.pop("undocumented-head", None)
        PARTITIONS.pop("undocumented-split", None)
