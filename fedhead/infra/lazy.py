"""Modules imported on first use, so that what only needs a module's names (the command line's help, the
experiment table with its registries of heads and rules) does not pay for importing it (torch: seconds and about
650 MB of memory).

``torch = lazy_module("torch")`` at the top of a module stands for ``import torch``: the first attribute read
(``torch.zeros``) imports torch. Once torch is imported (there or by anyone) the module's global ``torch`` is torch
itself, so hot loops pay a plain module attribute lookup (a stand-in's read costs about ten times a module's); a
reference to the stand-in kept elsewhere still works and keeps what it reads on itself. Annotations stay strings
(``from __future__ import annotations``); a default argument or a class body that needs torch at definition time
must read it later (``dtype=None``, then ``torch.float32`` in the body), or be bound with :func:`on_import`.

:func:`on_import` runs a function once a module is imported, by whoever imports it (at once if it already is), so a
module gets a constant such as ``F64 = torch.float64`` before any of its code can need it (no tensor exists before
torch is imported)::

    def _bind_torch(t) -> None:
        global F64
        F64 = t.float64

    on_import("torch", _bind_torch)
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
import types
from typing import Callable

__all__ = ["LazyModule", "lazy_module", "on_import"]


class LazyModule(types.ModuleType):
    """A stand-in for the module ``name`` that imports it on the first attribute read and keeps each attribute it
    reads on itself (``__getattr__`` then no longer runs for it). Once the module is imported, the globals that
    hold the stand-in (``owners``: the namespaces of the modules that called :func:`lazy_module`) hold the module."""

    def __init__(self, name: str, owners: list[dict] | None = None) -> None:
        super().__init__(name, f"lazy stand-in for the module {name!r}")
        self.__dict__["_lazy_target"] = name
        self.__dict__["_lazy_owners"] = list(owners or [])

    def _lazy_rebind(self, module: types.ModuleType) -> None:
        """Every owner's global that holds this stand-in now holds ``module``."""
        for owner in self._lazy_owners:
            for key, value in list(owner.items()):
                if value is self:
                    owner[key] = module

    def __getattr__(self, attr: str):
        module = importlib.import_module(self._lazy_target)
        if self._lazy_target in _HOOKS:  # imported past the finder (one placed before it): the hooks run now
            _run_hooks(self._lazy_target, module)
        self._lazy_rebind(module)
        value = getattr(module, attr)
        if not (attr.startswith("__") and attr.endswith("__")):
            # a dunder (copy, pickle, inspect and doctest probe for them) is answered but not kept, so that the
            # stand-in never claims to be the module's file or spec
            self.__dict__[attr] = value
        return value

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self._lazy_target))

    def __repr__(self) -> str:
        state = "imported" if self._lazy_target in sys.modules else "not imported yet"
        return f"<lazy module {self._lazy_target!r} ({state})>"


def lazy_module(name: str) -> LazyModule:
    """A stand-in for ``import name`` (or ``import a.b as x``: ``x = lazy_module("a.b")``) at the top of a module,
    that imports the module on first use; the caller's global that holds it is rebound to the module once it is
    imported (by anyone). The module itself when it is already imported."""
    module = sys.modules.get(name)
    if module is not None:
        return module  # type: ignore[return-value]
    proxy = LazyModule(name, [sys._getframe(1).f_globals])
    on_import(name, proxy._lazy_rebind)
    return proxy


_HOOKS: dict[str, list[Callable[[types.ModuleType], object]]] = {}
_LOCK = threading.RLock()


def _run_hooks(name: str, module: types.ModuleType) -> None:
    with _LOCK:
        hooks = _HOOKS.pop(name, [])
    for fn in hooks:
        fn(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module with hooks waiting, it finds the module's spec with the finders after it
    and makes its loader run the hooks once the module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_hooks(module: types.ModuleType) -> None:
            exec_module(module)
            _run_hooks(fullname, sys.modules.get(fullname, module))

        loader.exec_module = exec_then_hooks  # type: ignore[method-assign]
        return spec


_FINDER = _PostImportFinder()


def on_import(name: str, fn: Callable[[types.ModuleType], object]) -> None:
    """Call ``fn(module)`` once the module ``name`` is imported: now if it already is, else right after its import
    (whoever imports it)."""
    with _LOCK:
        module = sys.modules.get(name)
        if module is None:
            _HOOKS.setdefault(name, []).append(fn)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
    if module is not None:
        fn(module)
