"""A model's life after training: its version history, the statistics a closed-form model keeps, and the exact
update and removal of clients (``fedhead update``, ``fedhead forget``; docs/lifecycle.md).

Every model a run writes carries ``versions`` in its card: version 1 is the training (the store's content hash, the
seed, the run's resolved configuration and the ids of the clients whose data reached the head), and each later
change appends one entry. A closed-form head's solve reads only the clients' summed statistics
(``ClosedFormHead.updatable``), so with ``--keep-statistics`` the run writes those sums beside the model
(``statistics-seed<S>-v<N>.safetensors``, float64, owner-only, its sha256 in the card) and:

- :func:`update_model` sums new clients' statistics (a store of the same encoder, partitioned as the options say) into
  the kept ones and solves again: the head of a run over the union of the data;
- :func:`forget_model` subtracts the statistics of the clients that withdraw (their messages sent again, or in
  simulation recomputed from the partition their version recorded) and solves again: the head of a run that never
  had them. An iterative head has no such sums: its honest removal is a new run without those clients
  (``--withdrawn-clients``), from the remaining clients' closed-form start where the run had one (``--init``).

Each change writes the new statistics and weights under the next version's names, then the card (the one file that
says which version is current: a crash before it leaves the old version whole), then removes the old version's
files, so that after a removal no file of the run directory still holds the withdrawn clients' sums or the head
solved with them (head-seed<S>.pt and the checkpoint are replaced or removed too)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path, PurePath

import numpy as np

from extract.store import Features, load_store, store_content_hash
from fedhead.core.closedform import StatsAccumulator, accumulate, is_closed_form
from fedhead.core.engine import evaluate as head_accuracy
from fedhead.core.heads import HEADS, create_head
from fedhead.core.sampling import round_clients
from fedhead.federation.clients import FeatureStats, build_federation, prepare
from fedhead.federation.config import TrainConfig
from fedhead.federation.experiment import parse_client_ids
from fedhead.federation.model import (
    compare_encoder,
    head_tensors,
    model_card_path,
    model_stem,
    portable_card,
    read_card,
    sha256_file,
    write_weights,
)
from fedhead.federation.rundir import read_csv, write_csv
from fedhead.infra.devices import check_budget
from fedhead.infra.errors import FedheadError, is_count, param_error, shown
from fedhead.infra.files import atomic_path, atomic_torch_save, atomic_write_json, name_inside
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

STATS_FORMAT = "fedhead-statistics"
STAT_TENSORS = ("sums", "counts", "gram", "second")
ACTIONS = ("train", "update", "forget")


# ---------------------------------------------------------------- client ids as ranges


def id_ranges(ids) -> list[list[int]]:
    """Sorted client ids as ``[[first, last], ...]`` runs (10,000 consecutive ids are one pair in the card)."""
    out: list[list[int]] = []
    for k in sorted(int(i) for i in ids):
        if out and k == out[-1][1] + 1:
            out[-1][1] = k
        elif not out or k > out[-1][1]:
            out.append([k, k])
    return out


def range_ids(ranges, where: str) -> set[int]:
    """The ids of :func:`id_ranges`' pairs, checked (a card is a file from elsewhere)."""
    if not isinstance(ranges, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(is_count(v, 1 << 40, 0) for v in r) and r[0] <= r[1] for r in ranges
    ):
        raise FedheadError(f"{where} must list client ids as [[first, last], ...] pairs of integers >= 0.")
    total = sum(b - a + 1 for a, b in ranges)
    if total > 1 << 24:
        raise FedheadError(f"{where} lists {total:,} client ids; a card holds at most {1 << 24:,}.")
    return {k for a, b in ranges for k in range(a, b + 1)}


def members(cfg: TrainConfig, seed: int, rounds: int) -> list[list[int]]:
    """The clients whose data reached the head of a run: those some round sampled (a closed-form head's single
    exchange, or every round of an iterative one; with an asynchronous rule or over-selection, whose draws are the
    clock's, every client), less the withdrawn ones; as :func:`id_ranges`."""
    seen = np.zeros(int(cfg.clients), dtype=bool)
    if getattr(cfg, "async_rule", "none") not in (None, "none") or getattr(cfg, "over_selection", 0):
        seen[:] = True  # draws of the clock's own (FedBuff's idle clients, over-selection): any client may have trained
    for r in range(1, int(rounds) + 1):  # the draws are keyed by (seed, round): no training happens here
        seen[round_clients(cfg, seed, r)] = True
        if seen.all():
            break
    gone = parse_client_ids(cfg.withdrawn_clients) if cfg.withdrawn_clients else []
    seen[list(gone)] = False
    return id_ranges(np.flatnonzero(seen))


# ---------------------------------------------------------------- the statistics file


def statistics_name(seed: int, name: str, version: int) -> str:
    return f"statistics-{model_stem(seed, name)[len('model-') :]}-v{int(version)}.safetensors"


def weights_name(seed: int, name: str, version: int) -> str:
    """Version 1 keeps the run's own name (model-seed<S>.safetensors); later versions add ``-v<N>``."""
    stem = model_stem(seed, name)
    return f"{stem}.safetensors" if version == 1 else f"{stem}-v{int(version)}.safetensors"


def write_statistics(path: Path, tensors: dict) -> str:
    """The kept sums as a float64 safetensors file, atomically and readable by its owner only; returns its sha256."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": STATS_FORMAT})
        os.chmod(tmp, 0o600)  # safetensors writes the file anew: owner-only again before it takes the name
        return sha256_file(tmp)


def read_statistics(card: dict, card_path: Path) -> StatsAccumulator:
    """The statistics the card names, checked as hostile input before anything is allocated: the file inside the
    model's folder, its sha256, then :func:`read_sums`."""
    st = card.get("statistics")
    if not isinstance(st, dict):
        raise param_error("--model", str(card_path), "must be a model whose run kept its statistics",
                          "Train it with --keep-statistics (a closed-form head: ridge, lda, ncm, qda, ...).")  # fmt: skip
    path = name_inside(card_path.parent, st.get("file"), f"The model card {str(card_path)!r} (statistics.file)")
    if not path.is_file():
        raise param_error("--model", str(card_path), f"needs its statistics file {path.name!r} beside it",
                          "Copy the run directory whole.")  # fmt: skip
    if sha256_file(path) != st.get("sha256"):
        raise param_error("--model", str(card_path), f"has a statistics file {path.name!r} that is not the one the "
                          "card was written with (sha256 differs)", "Copy the run directory whole.")  # fmt: skip
    D = st.get("dim")
    if not is_count(D, 1 << 20):
        raise param_error("--model", str(card_path), f"must record its statistics' dimension (it has {shown(D)})",
                          "Use the card the run wrote.")  # fmt: skip
    clients = int(st["clients"]) if is_count(st.get("clients"), 1 << 40, 0) else 0
    return read_sums(path, len(card["classes"]), int(D), "--model", clients, set(st.get("kinds") or ()))


def read_sums(path: Path, C: int, D: int, param: str, clients: int = 0, kinds: set | None = None) -> StatsAccumulator:
    """Summed statistics from a safetensors file (a model's kept sums, or the ones withdrawing clients sent again),
    checked before anything is allocated: the tensor names, dtypes and shapes from the header against ``C`` classes
    and dimension ``D`` (and the ``kinds`` the model keeps), the size against free memory, then finite values and
    whole, non-negative counts."""
    from safetensors import SafetensorError, safe_open

    want = {"sums": (C, D), "counts": (C,), "gram": (D + 1, D + 1), "second": (C, D, D)}
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
            wrong = set(shapes) - set(STAT_TENSORS) or not {"sums", "counts"} <= set(shapes) or any(
                shapes[k] != want[k] for k in shapes
            ) or any(d != "F64" for d in dtypes.values()) or (kinds and set(shapes) != kinds)  # fmt: skip
            if wrong:
                need = ", ".join(f"{k} {list(want[k])}" for k in sorted(kinds or {"sums", "counts"}))
                raise param_error(param, str(path), f"must hold the float64 statistics {need} (it holds {shapes})",
                                  "Use a file written for this model.")  # fmt: skip
            check_budget(8 * sum(int(np.prod(s)) for s in shapes.values()), f"The statistics file {str(path)!r}")
            tensors = {k: f.get_tensor(k) for k in shapes}
    except (SafetensorError, OSError) as exc:
        raise param_error(param, str(path), "must be a readable safetensors file",
                          str(exc).splitlines()[0]) from None  # fmt: skip
    counts = tensors["counts"]
    if (
        not all(bool(torch.isfinite(t).all()) for t in tensors.values())
        or bool((counts < 0).any())
        or bool((counts != counts.round()).any())
    ):
        raise param_error(param, str(path), "must hold finite sums and whole counts >= 0",
                          "Use a file written for this model.")  # fmt: skip
    return StatsAccumulator.from_tensors(tensors, clients)


def client_statistics_file(model: str | os.PathLike, x: np.ndarray, y: np.ndarray, out: str | os.PathLike,
                           seed: int | None = None) -> Path:  # fmt: skip
    """A client's side of a removal in a deployment: its statistics for ``model`` (the message it sent when it took
    part: class sums, counts and what the head needs, through the head's own lift and sketch) from its raw features
    ``x [n, D]`` and labels ``y [n]``, written to ``out`` for ``fedhead forget --client-statistics``."""
    op = open_model(model, seed, "forget")
    head = _solver(op)
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
    acc = accumulate(xt, torch.as_tensor(np.asarray(y, dtype=np.int64)), [np.arange(len(y))], len(op.card["classes"]),
                     cof=False, **head.message_kwargs(xt.shape[1]))  # fmt: skip
    write_statistics(Path(out), acc.tensors())
    return Path(out)


# ---------------------------------------------------------------- version 1, written by the run


def _config_record(cfg: TrainConfig, store: Features) -> dict:
    d = cfg.to_dict()
    d["features"] = PurePath(str(store.info.path)).name  # a card names no path (portable_card)
    return json.loads(json.dumps(d, default=str))


def version_entry(action: str, version: int, store: Features | None, seed: int, clients, samples: int,
                  weights_sha: str = "", **more) -> dict:  # fmt: skip
    """One entry of the card's ``versions``."""
    entry = {"version": int(version), "action": action, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "seed": int(seed), "clients": id_ranges(clients), "samples": int(samples)}  # fmt: skip
    if store is not None:
        entry["store"] = PurePath(str(store.info.path)).name
        entry["store_sha256"] = store_content_hash(store)
    if weights_sha:
        entry["weights_sha256"] = weights_sha
    entry.update(more)
    return entry


def first_version(run_dir: Path, unit: tuple, cfg: TrainConfig, store: Features, done: dict, metrics: dict) -> dict:
    """The card keys a run adds to each global model: ``versions`` (the training as version 1) and, with
    ``--keep-statistics``, ``statistics`` (the kept sums, written here beside the model first)."""
    seed, name = unit
    ids = sorted(range_ids(done.get("members", []), "members"))
    samples = int(done["statistics"]["tensors"]["counts"].sum()) if "statistics" in done else 0
    entry = version_entry("train", 1, store, seed, ids, samples, config=_config_record(cfg, store),
                          test_accuracy=metrics.get("test_accuracy"))  # fmt: skip
    extra = {"versions": [entry]}
    if "statistics" in done:
        kept = done["statistics"]
        file = statistics_name(seed, name, 1)
        sha = write_statistics(Path(run_dir) / file, kept["tensors"])
        extra["statistics"] = statistics_card(file, sha, kept["tensors"], kept["clients"], ids, kept["head_params"])
    return extra


def statistics_card(file: str, sha: str, tensors: dict, clients: int, ids, head_params: dict) -> dict:
    return {
        "file": file,
        "sha256": sha,
        "dim": int(tensors["sums"].shape[1]),
        "kinds": sorted(tensors),
        "clients": int(clients),
        "samples": int(tensors["counts"].sum()),
        "members": id_ranges(ids),
        "head_params": json.loads(json.dumps(head_params, default=str)),
    }


# ---------------------------------------------------------------- update and forget


@dataclass
class Change:
    """What :func:`update_model` / :func:`forget_model` did: the card written, the new version's number, the clients
    taken in or out, the seconds it took (summing or recomputing the statistics, solving, writing) and, where a
    store's test split was at hand, the new head's test accuracy."""

    card: Path
    version: int
    clients: list
    seconds: float
    test_accuracy: float | None = None
    samples: int = 0


@dataclass
class Opened:
    """A model and its kept statistics, opened for a change."""

    card_path: Path
    card: dict
    acc: StatsAccumulator
    cfg: TrainConfig
    seed: int
    name: str
    members: set


def open_model(model: str | os.PathLike, seed: int | None, action: str) -> Opened:
    """The model ``--model`` names, with its kept statistics; a model of an iterative head or one that kept none is
    refused in one line."""
    card_path = model_card_path(model, seed)
    card = read_card(card_path)
    kind = str(card["head"].get("kind"))
    if card.get("client") is not None:
        raise param_error("--model", str(card_path), f"must be a run's global model ({action} changes the global "
                          "head; this is a client's personal head)", "Name the run directory.")  # fmt: skip
    if "statistics" not in card:
        iterative = kind in HEADS and not is_closed_form(kind)
        how = "train it with --keep-statistics"
        if iterative:
            how = ("retrain without them: fedhead forget --out DIR does" if action == "forget"
                   else "train a new run on all the data (fedhead train)")  # fmt: skip
        raise param_error("--model", str(card_path), f"must be a model whose run kept its statistics (head {kind!r} "
                          f"kept none, so fedhead {action} cannot be exact)", f"To change it, {how}.")  # fmt: skip
    versions = card.get("versions")
    if not isinstance(versions, list) or not versions or not all(isinstance(v, dict) for v in versions):
        raise param_error("--model", str(card_path), "must have a version history ('versions')",
                          "Use the card the run wrote.")  # fmt: skip
    first = versions[0].get("config")
    if not isinstance(first, dict):
        raise param_error("--model", str(card_path), "must record its run's configuration (versions[0].config)",
                          "Use the card the run wrote.")  # fmt: skip
    cfg = TrainConfig.from_dict(first)
    acc = read_statistics(card, card_path)
    run = card.get("run", {})
    name = "iid" if isinstance(run, dict) and run.get("variant") == "iid" else "main"
    mem = range_ids(card["statistics"].get("members", []), f"The model card {str(card_path)!r} (statistics.members)")
    return Opened(card_path, card, acc, cfg, int(versions[0].get("seed", 0)), name, mem)


def _solver(op: Opened):
    head = create_head(op.cfg.head, **op.card["statistics"].get("head_params", {}))
    head.message_kwargs(int(op.card["store"]["feature_dim"]))  # the lift and sketch the run's clients applied
    return head


def _store_for(op: Opened, features: str | os.PathLike, param: str = "--features") -> Features:
    """The store ``features``, refused in one line where its encoder, preprocessing, dimension or classes differ from
    the model's."""
    store = load_store(features, param)
    info = store.info
    bad = compare_encoder(op.card, info.encoder, str(info.attrs.get("weights_sha256", "")),
                          info.attrs.get("preprocessing"), int(store.train_x.shape[1]))  # fmt: skip
    if list(info.class_names) != list(op.card["classes"]):
        bad.what.append(f"classes {list(info.class_names)[:4]}... (the model's: {op.card['classes'][:4]}...)")
    if bad:
        raise param_error(param, str(features), "must be a store of the model's encoder and classes",
                          f"It differs: {'; '.join(bad.what)}.")  # fmt: skip
    return store


def _client_statistics(store: Features, cfg: TrainConfig, seed: int, clients: list, head) -> StatsAccumulator:
    """The summed messages of ``clients`` of the federation ``cfg`` draws on ``store`` for ``seed``: what those clients
    send (recomputed in simulation: the partition, label noise and validation split are keyed by seed)."""
    fed = build_federation(store, cfg, seed, cfg.partition, cfg.partition_params)
    x = torch.as_tensor(store.train_x, dtype=torch.float32)
    return accumulate(x, torch.as_tensor(fed.labels), [fed.parts[k] for k in clients], store.info.num_classes,
                      cof=False, **head.message_kwargs(x.shape[1]))  # fmt: skip


def _commit(op: Opened, theta, acc: StatsAccumulator, entry: dict, head) -> Change:
    """Write the next version (statistics, weights, head file, then the card) and remove the previous one's files."""
    run_dir, version = op.card_path.parent, int(op.card["versions"][-1].get("version", 1)) + 1
    old = [op.card.get("weights_file"), op.card["statistics"].get("file")]
    stats_file = statistics_name(op.seed, op.name, version)
    tensors = acc.tensors()
    sha_s = write_statistics(run_dir / stats_file, tensors)
    wfile = weights_name(op.seed, op.name, version)
    # a closed-form head acts on raw features (no centring: config.check_method); its open-set statistics (lda's
    # class means and precision, qda's counts) come from the same new sums
    extra = {k: v for k, v in head.openset_statistics(acc).items()} if hasattr(head, "openset_statistics") else {}
    sha_w = write_weights(run_dir / wfile, head_tensors(theta, None, None, extra or None), op.card_path.name)
    head_file = run_dir / f"head-seed{op.seed}{'' if op.name == 'main' else '-iid'}.pt"
    if head_file.exists():  # the run's own copy of the head: the new one (never the old head beside the new card)
        atomic_torch_save(theta.detach().cpu().clone(), head_file)
    ids = sorted(op.members)
    card = dict(op.card)
    card.update(weights_file=wfile, weights_file_sha256=sha_w, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    card["statistics"] = statistics_card(stats_file, sha_s, tensors, acc.clients, ids,
                                         op.card["statistics"].get("head_params", {}))  # fmt: skip
    entry.update(version=version, weights_sha256=sha_w, statistics_sha256=sha_s)
    card["versions"] = list(op.card["versions"]) + [entry]
    if isinstance(card.get("openset"), dict) and "validation_quantiles" in card["openset"]:
        # the quantiles were the old head's scores on the run's validation part: --reject-rate has none to read now
        card["openset"] = {"score": card["openset"].get("score"), "validation_quantiles_dropped_at": version}
    if entry.get("test_accuracy") is not None and isinstance(card.get("metrics"), dict):
        card["metrics"] = {**card["metrics"], "test_accuracy": entry["test_accuracy"], "test_store": entry.get("store")}
    atomic_write_json(op.card_path, portable_card(card))
    for f in old:  # the previous version's weights and sums (a withdrawn client's data must not stay behind)
        if isinstance(f, str) and f not in (wfile, stats_file):
            p = run_dir / PurePath(f).name
            if p.is_file():
                p.unlink()
    for ckpt in run_dir.glob("checkpoint*"):  # the finished run's resume state holds the old head
        if ckpt.is_file():
            ckpt.unlink()
    if entry.get("action") == "forget":
        scrub_clients(run_dir, op.seed, range_ids(entry.get("clients", []), "clients"))
    return Change(op.card_path, version, entry.get("clients", []), float(entry.get("seconds", 0.0)),
                  entry.get("test_accuracy"), int(entry.get("samples", 0)))  # fmt: skip


def _test_accuracy(theta, head, store: Features) -> float:
    """The head's accuracy on the store's test split (raw features: a closed-form head is not centred)."""
    xt = prepare(store.test_x, FeatureStats(None, 1.0, 0, 0), "cpu")
    return float(head_accuracy(theta, xt, torch.as_tensor(store.test_y), head=None if head.linear else head))


def _solve(op: Opened, acc: StatsAccumulator, head):
    theta = head.solve_statistics(acc)
    return theta.to(torch.float32 if theta.ndim == 2 else torch.float64)


def update_model(model: str | os.PathLike, features: str | os.PathLike, *, seed: int | None = None,
                 progress: bool = False, **partition) -> Change:  # fmt: skip
    """Fold the statistics of new clients into ``model``'s kept sums and write the next version: the clients of the
    store ``features`` (same encoder and classes), partitioned as ``partition`` says (``partition``, its parameters,
    ``clients``; default: the run's), all of them taking part, none holding data out; they get the ids after the
    model's highest. The head equals a run's over the union of the data (float64 rounding)."""
    torch.float64  # noqa: B018  (torch imported before the clock starts: no part of the change's cost)
    t0 = time.perf_counter()
    op = open_model(model, seed, "update")
    store = _store_for(op, features)
    ucfg = update_config(op.cfg, features, op.seed, partition)
    head = _solver(op)
    new = _client_statistics(store, ucfg, op.seed, list(range(ucfg.clients)), head)
    if new.counts.sum() == 0:
        raise param_error("--features", str(features), "must hold training samples to take in",
                          "Name a store with a train split.")  # fmt: skip
    acc = op.acc
    acc.merge(new)
    first = _next_client(op)
    ids = list(range(first, first + ucfg.clients))
    op.members |= set(ids)
    theta = _solve(op, acc, head)
    entry = version_entry("update", 0, store, op.seed, ids, int(new.counts.sum()), first_client=first,
                          config=_config_record(ucfg, store))  # fmt: skip
    entry["test_accuracy"] = _test_accuracy(theta, head, store)
    entry["seconds"] = time.perf_counter() - t0
    return _commit(op, theta, acc, entry, head)


def update_config(cfg: TrainConfig, features, seed: int, partition: dict) -> TrainConfig:
    """The federation of an update's new clients: the run's configuration with the given partition options, every
    client taking part and training on all its data (no validation part, no simulated label noise, nobody
    withdrawn)."""
    kw = {k: v for k, v in partition.items() if v is not None}
    pparams = {k: kw.pop(k) for k in list(kw) if k not in {f.name for f in dataclasses.fields(TrainConfig)}}
    base = dataclasses.replace(cfg, features=str(features), seeds=[seed], participation=1.0, clients_per_round=None,
                               val_fraction=0.0, noise="none", noise_rate=0.0, withdrawn_clients=None,
                               keep_statistics=False)  # fmt: skip
    if "partition" in kw and kw["partition"] != cfg.partition:
        base.partition_params = {}
    for k, v in kw.items():
        setattr(base, k, v)
    if pparams:
        base.partition_params = {**base.partition_params, **pparams}
    return base.resolved()


def _next_client(op: Opened) -> int:
    """The first id of an update's clients: after every id any version used (a forgotten id is not given again)."""
    top = max(op.members, default=-1)
    for v in op.card["versions"]:
        for _a, b in v.get("clients", []) if isinstance(v.get("clients"), list) else []:
            top = max(top, int(b))
        if is_count(v.get("first_client"), 1 << 40, 0) and isinstance(v.get("config"), dict):
            top = max(top, int(v["first_client"]) + int(v["config"].get("clients", 0)) - 1)
    return max(top + 1, int(op.cfg.clients))


def forget_model(model: str | os.PathLike, clients, features: str | os.PathLike | None = None, *,
                 seed: int | None = None, statistics_files: list | None = None) -> Change:  # fmt: skip
    """Subtract the statistics of ``clients`` (ids the model has) from ``model``'s kept sums and write the next
    version: the head of a run that never had them. Their statistics are the files ``statistics_files`` (what the
    withdrawing clients sent again: :func:`client_statistics_file`), or recomputed from the store ``features`` (the
    one whose content hash the version that took them in recorded) and that version's partition."""
    torch.float64  # noqa: B018  (torch imported before the clock starts: no part of the change's cost)
    t0 = time.perf_counter()
    op = open_model(model, seed, "forget")
    ids = check_members(clients, op.members)
    head = _solver(op)
    store = statistics = None
    if statistics_files:
        dim, kinds = int(op.card["statistics"]["dim"]), set(op.card["statistics"].get("kinds") or ())
        for f in statistics_files:
            one = read_sums(Path(f), len(op.card["classes"]), dim, "--client-statistics", 1, kinds)
            if statistics is None:
                statistics = one
            else:
                statistics.merge(one)
    if statistics is None:
        if features is None:
            raise param_error("--features", None, "must name the store the clients' data came from (their "
                              "statistics are recomputed from it)", "Give --features STORE.")  # fmt: skip
        statistics, store = _recompute(op, ids, features, head)
    acc = op.acc
    acc.merge(statistics, -1.0)
    if float(acc.counts.sum()) <= 0:
        raise param_error("--clients", ids_text(ids), "must leave the model some clients' data",
                          "Forget fewer clients, or delete the model.")  # fmt: skip
    op.members -= set(ids)
    theta = _solve(op, acc, head)
    entry = version_entry("forget", 0, None, op.seed, ids, int(statistics.counts.sum()),
                          recomputed=store is not None)  # fmt: skip
    if store is not None:
        entry["test_accuracy"] = _test_accuracy(theta, head, store)
        entry["store"] = PurePath(str(store.info.path)).name
    entry["seconds"] = time.perf_counter() - t0
    return _commit(op, theta, acc, entry, head)


def ids_text(ids) -> str:
    return ",".join(map(str, ids))


def check_members(clients, have: set) -> list[int]:
    """The ids ``clients`` names (``3,7`` or ints), each one a client of ``have``; one line otherwise."""
    ids = parse_client_ids(clients) if isinstance(clients, str) else sorted({int(k) for k in clients})
    if not isinstance(ids, list) or not ids:
        raise param_error("--clients", clients, "must be client ids >= 0 separated by commas", "E.g. --clients 3,7.")
    never = [k for k in ids if k not in have]
    if never:
        runs = id_ranges(have)
        listed = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs[:6]) + (" ..." if len(runs) > 6 else "")
        raise param_error("--clients", ids_text(ids), f"must name clients the model has (client {never[0]} is not in "
                          f"it: never sampled, withdrawn or forgotten before)", f"Its clients: {listed}.")  # fmt: skip
    return ids


def _recompute(op: Opened, ids: list[int], features, head) -> tuple[StatsAccumulator, Features]:
    """The clients' statistics recomputed from ``features`` and the version that took each in."""
    store = load_store(features, "--features")
    sha = store_content_hash(store)
    total = None
    for v in op.card["versions"]:
        if v.get("action") not in ("train", "update") or not isinstance(v.get("config"), dict):
            continue
        first = int(v.get("first_client", 0)) if v.get("action") == "update" else 0
        vcfg = TrainConfig.from_dict(v["config"])
        mine = [k - first for k in ids if first <= k < first + int(vcfg.clients)]
        if not mine:
            continue
        if v.get("store_sha256") != sha:
            raise param_error("--features", str(features), f"must be the store version {v.get('version')} took "
                              f"clients {ids_text([k + first for k in mine])} from (content hash "
                              f"{str(v.get('store_sha256'))[:12]}…; this store's: {sha[:12]}…)",
                              f"Name the store {v.get('store')!r} (forget the clients of each store separately).")  # fmt: skip
        vcfg.features = str(features)
        part = _client_statistics(store, vcfg, op.seed, mine, head)
        if total is None:
            total = part
        else:
            total.merge(part)
    if total is None:
        raise param_error("--clients", ids_text(ids), "must name clients of a recorded version",
                          "Check the card's versions.")  # fmt: skip
    return total, store


def scrub_clients(run_dir: Path, seed: int, ids: set) -> None:
    """The run's record of what the forgotten clients held: their rows of clients.csv emptied (size 0, no class
    counts) and the partition plot drawn from them removed."""
    path = run_dir / "clients.csv"
    if path.is_file():
        rows = read_csv(path)
        fields = list(rows[0]) if rows else []
        for r in rows:
            if int(r["client"]) in ids and int(r.get("seed", seed) or seed) == seed:
                r.update(size=0, num_classes=0, class_counts="")
        write_csv(path, rows, fields)
    plot = run_dir / "partition.png"
    if plot.is_file():
        plot.unlink()


# ---------------------------------------------------------------- an iterative head: retraining without them


def card_members(card: dict) -> set:
    """The clients a model holds: the kept statistics' members, or its history replayed (taken in by training and
    updates, taken out by removals)."""
    if isinstance(card.get("statistics"), dict):
        return range_ids(card["statistics"].get("members", []), "The model card's statistics.members")
    have: set = set()
    for v in card.get("versions", []) if isinstance(card.get("versions"), list) else []:
        ids = range_ids(v.get("clients", []), "The model card's versions") if isinstance(v, dict) else set()
        have = have - ids if v.get("action") == "forget" else have | ids
    return have
