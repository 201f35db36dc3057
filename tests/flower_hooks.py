"""The tests' fault injection for fedhead's Flower app, kept out of the shipped code: importing this module wraps
the node's handlers and the server's end of round.

* ``FEDHEAD_FLOWER_CRASH=PID@ROUND[,PID@ROUND...]``: partition PID raises in that round's train or CCVR message;
* ``FEDHEAD_FLOWER_STOP_AFTER=R``: the server raises :class:`ServerStopped` after round R's checkpoint (it "dies").

Both are read when the wrapped function runs. In-process tests import this module; the processes of a deployment
load it as a trusted plugin (:func:`crash_env`: ``FEDHEAD_PLUGINS=flower_hooks`` with this folder on PYTHONPATH;
fedhead's ClientApp loads the plugins before a handler runs)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import fedhead.flower.node as node
import fedhead.flower.strategy as strategy

CRASH_ENV = "FEDHEAD_FLOWER_CRASH"  # "PID@ROUND[,PID@ROUND...]"
STOP_ENV = "FEDHEAD_FLOWER_STOP_AFTER"  # "ROUND"


class ServerStopped(RuntimeError):
    """Raised after a round's checkpoint when ``FEDHEAD_FLOWER_STOP_AFTER`` names that round."""


def crash_rounds(pid: int) -> set[int]:
    """Rounds in which partition ``pid`` must crash."""
    out = set()
    for item in os.environ.get(CRASH_ENV, "").replace(" ", "").split(","):
        if "@" in item:
            p, r = item.split("@", 1)
            if p.isdigit() and r.isdigit() and int(p) == pid:
                out.add(int(r))
    return out


def stop_after() -> int | None:
    v = os.environ.get(STOP_ENV, "")
    return int(v) if v.isdigit() else None


def crash_env(spec: str) -> dict[str, str]:
    """The environment of a deployed node whose partitions crash as ``spec`` says (``PID@ROUND,...``)."""
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return {CRASH_ENV: spec, "FEDHEAD_PLUGINS": "flower_hooks", "PYTHONPATH": path}


def _crashing(handler):
    @functools.wraps(handler)
    def wrapper(msg, context, default_store, default_state_dir):
        rnd = int(msg.content["config"]["round"])
        pid = node.node_settings(context, default_store, default_state_dir).pid
        if rnd in crash_rounds(pid):
            raise RuntimeError(f"injected crash of partition {pid} in round {rnd} (FEDHEAD_FLOWER_CRASH)")
        return handler(msg, context, default_store, default_state_dir)

    wrapper.fedhead_hook = True
    return wrapper


def _stopping(after_round):
    @functools.wraps(after_round)
    def wrapper(self, seed, rnd, last_round, row):
        after_round(self, seed, rnd, last_round, row)
        if row.get("stage") != "ccvr" and rnd == stop_after():
            raise ServerStopped(f"server stopped after round {rnd} (FEDHEAD_FLOWER_STOP_AFTER)")

    wrapper.fedhead_hook = True
    return wrapper


for _name in ("plain_train", "ccvr"):
    if not getattr(getattr(node, _name), "fedhead_hook", False):  # once, however often this module is loaded
        setattr(node, _name, _crashing(getattr(node, _name)))
if not getattr(strategy.FedheadStrategy.after_round, "fedhead_hook", False):
    strategy.FedheadStrategy.after_round = _stopping(strategy.FedheadStrategy.after_round)
