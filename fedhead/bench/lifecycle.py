"""``fedhead bench lifecycle``: what taking clients into and out of a finished model costs against training again.

On a synthetic store of the preset's shape (``cross-device``: the shape of docs/scale.md's cross-device row, 1,203
classes x 100 samples x 1,280 dimensions over 10,000 Dirichlet(0.1) clients), the training rows are split into a
base store (90%) and the rows of new clients (10%, a store of its own with the same encoder and classes). For each
closed-form head it times, each through the command's own function:

- the training on the base store with ``--keep-statistics`` (the model being changed);
- ``update`` with the new store's clients, against a full run over the union store (the run it equals);
- ``forget`` of the first ``forget`` clients, their statistics recomputed from the base store (loading it and
  drawing the partition again are part of the cost), against a full run without them (``--withdrawn-clients``);

and the largest difference of the test logits between each changed model and the run it equals. For the iterative
head (``--iterative``, with ``--init ridge``) it times the honest removal, a retraining without the clients over
``rounds`` rounds, against the exact subtraction's seconds. Writes lifecycle.json, lifecycle.csv and lifecycle.md
(printed) into ``--out``."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer

from extract.store import load_store, write_store
from fedhead.core.synthetic import write_synthetic
from fedhead.federation.config import TrainConfig
from fedhead.federation.model import load_model
from fedhead.federation.rundir import write_csv
from fedhead.federation.train import run_training
from fedhead.federation.versions import forget_model, ids_text, update_model
from fedhead.infra.console import stderr_console, stdout_console
from fedhead.infra.errors import OneOf, validate
from fedhead.infra.exits import cli_errors
from fedhead.infra.files import atomic_write_json, atomic_write_text, check_out
from fedhead.lifecycle import retrain_without

PRESETS = {
    "quick": dict(classes=20, per_class=40, dim=64, clients=100, alpha=0.1, forget=5, rounds=3),
    "cross-device": dict(classes=1203, per_class=100, dim=1280, clients=10_000, alpha=0.1, forget=100, rounds=3),
}
NEW_SHARE = 0.1  # of the training rows, held out as the new clients' store


def make_stores(folder: Path, shape: dict, seed: int) -> dict:
    """The union store, and its training rows split into the base store and the new clients' store (same test
    split, encoder attributes and classes); made once per folder."""
    paths = {k: folder / f"{k}.h5" for k in ("union", "base", "new")}
    if all(p.is_file() for p in paths.values()):
        return paths
    write_synthetic(paths["union"], num_classes=shape["classes"], train_per_class=shape["per_class"],
                    test_per_class=max(5, shape["per_class"] // 5), dim=shape["dim"], seed=seed)  # fmt: skip
    u = load_store(paths["union"])
    order = np.random.default_rng(seed).permutation(len(u.train_y))
    cut = int(round(len(order) * (1 - NEW_SHARE)))
    for name, idx in (("base", np.sort(order[:cut])), ("new", np.sort(order[cut:]))):
        write_store(paths[name], train=(u.train_x[idx], u.train_y[idx]), test=(u.test_x, u.test_y),
                    class_names=list(u.info.class_names), attrs=dict(u.info.attrs))  # fmt: skip
    return paths


def _timed_run(cfg: TrainConfig, out: Path) -> float:
    t0 = time.perf_counter()
    run_training(cfg, out=out, progress=False, overwrite=True)
    return time.perf_counter() - t0


def _max_diff(a: Path, b: Path, x: np.ndarray) -> float:
    return float(np.abs(load_model(a).decision_function(x) - load_model(b).decision_function(x)).max())


def closed_form_row(head: str, stores: dict, shape: dict, out: Path, seed: int) -> dict:
    """One closed-form head: train, update against the union run, forget against the run without them."""
    k, new_k = shape["clients"], max(1, int(round(shape["clients"] * NEW_SHARE)))
    # no validation part: an update's clients train on all their data, so the run it equals holds none out either
    base = dict(head=head, partition="dirichlet", alpha=shape["alpha"], min_size=0, device="cpu", seeds=[seed],
                plots=False, val_fraction=0.0)  # fmt: skip
    run = out / f"{head}-model"
    train_s = _timed_run(TrainConfig(features=str(stores["base"]), clients=k, keep_statistics=True, **base), run)
    up = update_model(run, stores["new"], partition="dirichlet", alpha=shape["alpha"], min_size=0, clients=new_k)
    union_s = _timed_run(TrainConfig(features=str(stores["union"]), clients=k + new_k, **base), out / f"{head}-union")
    x = load_store(stores["union"]).test_x
    update_diff = _max_diff(run, out / f"{head}-union", x)
    gone = ids_text(range(shape["forget"]))
    fo = forget_model(run, gone, stores["base"])
    # the run over the base store without them, and the new clients' update again: the model forget equals
    without = out / f"{head}-without"
    without_s = _timed_run(TrainConfig(features=str(stores["base"]), clients=k, withdrawn_clients=gone,
                                       keep_statistics=True, **base), without)  # fmt: skip
    update_model(without, stores["new"], partition="dirichlet", alpha=shape["alpha"], min_size=0, clients=new_k)
    return {"head": head, "train_s": train_s, "update_s": up.seconds, "union_run_s": union_s,
            "update_max_logit_diff": update_diff, "forget_s": fo.seconds, "run_without_s": without_s,
            "forget_max_logit_diff": _max_diff(run, without, x), "forgotten_clients": shape["forget"],
            "new_clients": new_k, "update_samples": up.samples, "update_speedup": union_s / max(up.seconds, 1e-9),
            "forget_speedup": without_s / max(fo.seconds, 1e-9)}  # fmt: skip


def iterative_row(head: str, stores: dict, shape: dict, out: Path, seed: int, exact_s: float) -> dict:
    """The iterative head's honest removal (a retraining without the clients) against the exact subtraction."""
    cfg = TrainConfig(features=str(stores["base"]), head=head, init="ridge", clients=shape["clients"],
                      rounds=shape["rounds"], partition="dirichlet", alpha=shape["alpha"], min_size=0, device="cpu",
                      seeds=[seed], plots=False)  # fmt: skip
    run = out / f"{head}-model"
    train_s = _timed_run(cfg, run)
    target = out / f"{head}-retrained"
    if target.exists():  # a re-run of the bench: the retraining starts afresh
        shutil.rmtree(target)
    ch = retrain_without(run, ids_text(range(shape["forget"])), target, progress=False)
    return {"head": f"{head} (--init ridge, {shape['rounds']} rounds)", "train_s": train_s, "forget_s": ch.seconds,
            "run_without_s": ch.seconds, "forgotten_clients": shape["forget"],
            "forget_vs_exact": ch.seconds / max(exact_s, 1e-9)}  # fmt: skip


def table(rows: list, shape: dict) -> str:
    lines = [
        f"Shape: {shape['clients']:,} clients (Dirichlet {shape['alpha']}, --min-size 0) x {shape['classes']:,} "
        f"classes x {shape['dim']:,} dims; update: {rows[0].get('new_clients', 0):,} new clients; forget: "
        f"{shape['forget']} clients.",
        "",
        "| head | train s | update s | union run s | update max logit diff | forget s | run without s | forget max "
        "logit diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cols = [("train_s", "{:.2f}"), ("update_s", "{:.3f}"), ("union_run_s", "{:.2f}"), ("update_max_logit_diff",
            "{:.1e}"), ("forget_s", "{:.3f}"), ("run_without_s", "{:.2f}"), ("forget_max_logit_diff", "{:.1e}")]  # fmt: skip
    for r in rows:
        cells = [spec.format(r[k]) if k in r else "—" for k, spec in cols]
        lines.append(f"| {r['head']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@cli_errors
def lifecycle_cmd(
    preset: str = typer.Option("quick", "--preset", help=f"the shape: {' | '.join(PRESETS)}"),
    heads: Optional[List[str]] = typer.Option(None, "--heads", help="closed-form heads, repeated or comma-separated "
                                              "\\[default: ridge,lda]"),
    iterative: str = typer.Option("ova2", "--iterative", help="the iterative head retrained without the clients "
                                  "('none': skip it)"),
    seed: int = typer.Option(0, "--seed", help="seed of the store and the partition"),
    out: Path = typer.Option(Path("reports/lifecycle"), "--out", help="bench folder (the stores are made once there)"),
):  # fmt: skip
    """Update and forget against a full re-run: the seconds of taking new clients into a closed-form model and
    withdrawn ones out of it (exact, from kept statistics), of the runs they equal, and of an iterative head's
    retraining without the clients.

    Writes lifecycle.md (printed on stdout), lifecycle.csv and lifecycle.json into --out.
    """
    validate("--preset", preset, OneOf(tuple(PRESETS)))
    names = [h for v in (heads or ["ridge,lda"]) for h in v.split(",") if h]
    check_out(out, kind="dir")
    shape = PRESETS[preset]
    console = stderr_console()
    console.print(f"stores for {preset} in {out}", markup=False, highlight=False)
    stores = make_stores(out, shape, seed)
    warm = TrainConfig(features=str(stores["new"]), head="ncm", clients=2, device="cpu", plots=False)
    _timed_run(warm, out / "warm-up")  # imports and first-call costs, outside every timing
    rows = []
    for head in names:
        console.print(f"{head}: train, update, forget, and the runs they equal", markup=False, highlight=False)
        rows.append(closed_form_row(head, stores, shape, out, seed))
    if iterative != "none":
        console.print(f"{iterative}: retraining without the clients", markup=False, highlight=False)
        rows.append(iterative_row(iterative, stores, shape, out, seed, rows[0]["forget_s"] if rows else 0.0))
    md = table(rows, shape)
    atomic_write_text(out / "lifecycle.md", md)
    write_csv(out / "lifecycle.csv", rows, sorted({k for r in rows for k in r}))
    atomic_write_json(out / "lifecycle.json", {"preset": preset, "shape": shape, "rows": rows})
    stdout_console().print(md, markup=False, highlight=False)
