"""How `make test` spreads the suite over its workers (tests/conftest.py): the groups name real tests, and every test
that shares the worker's Ray is in the group that keeps them on one worker."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import SAME_WORKER, unit_of

TESTS = Path(__file__).resolve().parent


def _tests() -> dict[str, list[str]]:
    """Node id (without parameters) -> the test function's arguments, for every test function of the suite."""
    out = {}
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                out[f"tests/{path.name}::{node.name}"] = [a.arg for a in node.args.args]
    return out


def test_every_group_names_tests_of_the_suite():
    ids = list(_tests())
    for name, prefixes in SAME_WORKER.items():
        for prefix in prefixes:
            assert any(i.startswith(prefix) for i in ids), f"group {name!r}: no test starts with {prefix!r}"


def test_the_tests_that_share_ray_run_on_one_worker():
    tests = _tests()
    shared = [i for i, args in tests.items() if "shared_ray" in args]
    assert len(shared) >= 3
    assert {unit_of(i) for i in shared} == {"ray"}, shared
    assert {i for i in tests if unit_of(i) == "ray"} == set(shared)  # and only those


def test_every_slow_entry_names_tests_of_the_suite():
    """`make test-fast` leaves out what conftest's SLOW names: a renamed test must not move into the fast tier
    unnoticed (an entry naming nothing fails here)."""
    from conftest import SLOW

    ids = list(_tests())
    for why, entries in SLOW.items():
        for e in entries:
            base = e.split("[")[0].rstrip(":")
            assert any(i == base or i.startswith(base + "::") or i.startswith(e) for i in ids), (why, e)
