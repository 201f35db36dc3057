"""``fedhead bench ...``: commands that reproduce the OvA-LP paper's experiments on top of ``fedhead train``.

Each command builds a grid of training runs (:mod:`fedhead.bench.report`), runs them with
:func:`fedhead.federation.train.run_training` into ``<report>/runs/<name>/`` (finished runs are reused, interrupted
ones resumed), and writes ``report.md``, ``results.csv``, ``curves.csv`` and PNG plots
(:mod:`fedhead.federation.plots`). ``geometry`` measures feature geometry without training
(:mod:`fedhead.bench.geometry`).
"""
