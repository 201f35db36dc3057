"""Users' own heads and methods, without editing fedhead.

- A head: a class with a local loss (``per_sample``, or a closed-form ``solve`` from client statistics when
  it subclasses :class:`fedhead.core.closedform.ClosedFormHead`), registered with :func:`fedhead.register_head`.
  It then runs in ``fedhead train --head NAME``, every ``fedhead bench`` command, ``fedhead flower`` and
  :func:`fedhead.run`, through the same engine, statistics exchange and Flower strategy as the built-in heads.
- A method: a named set of training options (a head plus ``--init``, ``--prox-mu``, ``--server-opt``, ...)
  registered with :func:`register_method`; ``fedhead bench baselines --methods NAME`` runs it.

Where the registration code lives: a module named in ``FEDHEAD_PLUGINS`` (comma-separated module names,
imported on first use), or a ``fedhead.methods`` entry point of an installed package (each entry point is
loaded on first use). A Flower SuperNode needs the same plugin installed or named.
"""

from __future__ import annotations

import importlib
import os

from fedhead.infra.errors import FedheadError

PLUGIN_ENV = "FEDHEAD_PLUGINS"
ENTRY_POINT_GROUP = "fedhead.methods"
_loaded: set[str] = set()


def load_plugins() -> None:
    """Import the modules named in ``FEDHEAD_PLUGINS`` and load the ``fedhead.methods`` entry points (once each;
    the installed packages' metadata is scanned once per process: a scan costs about 40 ms, and the checks of a
    bench grid read the registries hundreds of times)."""
    for name in [m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(",") if m.strip()]:
        if name in _loaded:
            continue
        _loaded.add(name)
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise FedheadError(
                f"The '{PLUGIN_ENV}' variable names module {name!r}, which cannot be imported "
                f"({exc}). Put it on PYTHONPATH or fix the name."
            ) from None
    if ENTRY_POINT_GROUP in _loaded:  # installed packages do not change within a process: scanned once
        return
    _loaded.add(ENTRY_POINT_GROUP)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        key = f"ep:{ep.value}"
        if key not in _loaded:
            _loaded.add(key)
            ep.load()


def class_registrar(registry: dict, base: type, kind: str, override: str):
    """A class decorator factory ``register(name)`` for one of fedhead's registries of classes (aggregation rules,
    server optimisers): the class must subclass ``base`` (else one line saying which methods to ``override``); it
    is named ``name`` and stored in ``registry``."""

    def register(name: str):
        def deco(cls):
            if not (isinstance(cls, type) and issubclass(cls, base)):
                raise FedheadError(
                    f"The {kind} {name!r} must be a subclass of fedhead.{base.__name__}. Got {cls!r} instead. "
                    f"Subclass it and override {override}."
                )
            cls.name = name
            registry[name] = cls
            return cls

        return deco

    return register
