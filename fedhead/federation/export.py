"""One deployable file that classifies raw images: a run's model (:mod:`fedhead.federation.model`) with its encoder,
preprocessing and feature preparation, as ONNX or TorchScript (``fedhead export``).

The exported graph takes ``images``: uint8 ``[N, H, W, 3]`` RGB at one fixed input size ``H x W`` (the store's
source size by default: 8 x 8 for digits, 32 x 32 for CIFAR) and returns ``logits [N, C]`` and ``probabilities
[N, C]`` (columns in the order of the card's classes; the class is the argmax of the logits). Inside, the same
operations as ``fedhead predict``: the resize and centre crop as two matrix products
(:func:`extract.encoders.resize_matrix`), rounding to uint8 levels, normalisation, the encoder's forward, the
features rounded to the store's dtype (float16 by default), centring and scaling, the head with its bias column,
and the head's probabilities (softmax, or one-vs-all sigmoids normalised to sum to 1).

A fine-tuned model (``fedhead finetune``, :mod:`fedhead.federation.finetuned`) exports the same way: the same
pixels (``--input-size`` by default the encoder's input size), then the encoder with its trained adapters, prompts
or tensors and its linear classifier, and the softmax; the file is held to :meth:`FinetunedModel.logits`.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np

from extract.encoders import Preprocessing, resize_geometry, resize_matrix, resize_mode
from fedhead.federation.finetuned import FinetunedModel, portable
from fedhead.federation.model import Model, portable_card, probabilities
from fedhead.infra.errors import FedheadError, param_error
from fedhead.infra.files import atomic_path, check_out
from fedhead.infra.lazy import lazy_module, on_import

torch = lazy_module("torch")

FORMATS = ("onnx", "torchscript")
ONNX_OPSET = 18


def _pixel_buffers(module, pre: Preprocessing, size: tuple[int, int]) -> None:
    """The resize and centre crop of ``size`` images to the encoder's input, and the normalisation, as ``module``'s
    buffers (the same products as :func:`extract.encoders.preprocess_batch`)."""
    h, w = size
    s = pre.image_size
    nh, nw, t, l_ = resize_geometry(h, w, pre)
    mode = resize_mode(pre)
    module.size, module.s, module.round_pixels = (h, w), s, mode != "nearest"
    module.identity = (h, w) == (s, s) and pre.resize_size == s
    module.register_buffer("mh", resize_matrix(h, nh, t, s, mode, "cpu", torch.float32).clone())
    module.register_buffer("mw_t", resize_matrix(w, nw, l_, s, mode, "cpu", torch.float32).t().contiguous())
    std = torch.tensor(pre.std, dtype=torch.float32)
    module.register_buffer("pix_scale", (1.0 / (255.0 * std)).view(1, 1, 3, 1))
    module.register_buffer("pix_bias", (-torch.tensor(pre.mean, dtype=torch.float32) / std).view(1, 1, 3, 1))


def _pixels(module, images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` -> the encoder's normalised input ``[N, 3, S, S]`` (``module``'s buffers)."""
    b = images.shape[0]
    h, w = module.size
    s = module.s
    y = images.permute(0, 1, 3, 2).to(torch.float32)  # [N, H, 3, W]
    if not module.identity:  # the same products as extract.encoders.preprocess_batch
        y = torch.matmul(y.reshape(-1, w), module.mw_t)  # [N*H*3, S]
        y = torch.matmul(module.mh, y.reshape(b, h, 3 * s)).reshape(b, s, 3, s)  # [N, S, 3, S]
    if module.round_pixels:
        y = y.clamp(0.0, 255.0).round()
    return torch.addcmul(module.pix_bias, y, module.pix_scale).permute(0, 2, 1, 3).contiguous()  # [N, 3, S, S]


class ImageClassifier:  # a torch.nn.Module: _bind_torch below makes it one once torch is imported
    """uint8 images ``[N, H, W, 3]`` -> (logits, probabilities) ``[N, C]`` (see the module docstring)."""

    def __init__(self, model: Model, encoder: torch.nn.Module, pre: Preprocessing, size: tuple[int, int]):
        super().__init__()
        self.encoder = encoder
        _pixel_buffers(self, pre, size)
        self.half = model.store_dtype == "float16"
        self.center = model.mean32 is not None
        self.register_buffer("mean", model.mean32 if self.center else torch.zeros(1))
        self.scale = float(model.stats.scale)
        self.register_buffer("theta_t", model.theta.t().contiguous())
        self.kind = model.probabilities

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = images.shape[0]
        f = self.encoder(_pixels(self, images))
        if self.half:
            f = f.to(torch.float16).to(torch.float32)
        if self.center:
            f = f - self.mean
        if self.scale != 1.0:
            f = f / self.scale
        f = torch.cat([f, torch.ones(b, 1, dtype=f.dtype)], 1)
        logits = torch.matmul(f, self.theta_t)
        return logits, probabilities(logits, self.kind)


class FinetunedClassifier:  # a torch.nn.Module, as ImageClassifier
    """uint8 images ``[N, H, W, 3]`` -> (logits, probabilities) ``[N, C]`` of a fine-tuned model: the same pixels as
    :class:`ImageClassifier`, then the fine-tuned encoder with its trainable parts and its classifier, and the
    softmax."""

    def __init__(self, net: torch.nn.Module, pre: Preprocessing, size: tuple[int, int]):
        super().__init__()
        self.net = net
        _pixel_buffers(self, pre, size)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(_pixels(self, images)).float()
        return logits, torch.softmax(logits, -1)


def _bind_torch(t) -> None:
    """``class ImageClassifier(torch.nn.Module)`` (and FinetunedClassifier), run once torch is imported, by whoever
    imports it (the command line imports this module for its help without torch)."""
    global ImageClassifier, FinetunedClassifier
    bound = []
    for body in (ImageClassifier, FinetunedClassifier):
        ns = {"__module__": __name__, "__qualname__": body.__qualname__, "__doc__": body.__doc__}
        bound.append(type(body.__name__, (body, t.nn.Module), ns))
    ImageClassifier, FinetunedClassifier = bound


on_import("torch", _bind_torch)


def parse_size(text: str | None, model: Model | FinetunedModel) -> tuple[int, int]:
    """``--input-size HxW`` (or, when not given, the store's source size; a fine-tuned model's input size)."""
    if text is None and isinstance(model, FinetunedModel):
        return int(model.card["image_size"]), int(model.card["image_size"])
    if text is None:
        src = model.card["store"].get("source_size")
        if not src:
            raise param_error("--input-size", None, "is needed for this model: its store's images have no one size",
                              "Give the size the client's camera delivers, e.g. --input-size 224x224.")  # fmt: skip
        return int(src[0]), int(src[1])
    try:
        h, w = (int(v) for v in str(text).lower().replace(" ", "").split("x"))
    except ValueError:
        raise param_error("--input-size", text, "must be HxW in pixels", "E.g. --input-size 32x32.") from None
    if h < 1 or w < 1:
        raise param_error("--input-size", text, "must be positive HxW in pixels", "E.g. --input-size 32x32.")
    return h, w


def build_classifier(model: Model, size: tuple[int, int]) -> ImageClassifier:
    """The model as one torch module on the CPU (its encoder loaded and checked against the card)."""
    if model.head is not None:
        raise param_error("--model", str(model.path), f"holds a {model.card['head']['kind']!r} head, which is not "
                          "linear in the features; export writes linear heads only",
                          "Classify with 'fedhead predict' or fedhead.load_model, or export a linear head.")  # fmt: skip
    enc = model.load_encoder()
    enc.model.to("cpu").eval()
    return ImageClassifier(model, enc.model, enc.preprocessing, size).eval()


def _example(size: tuple[int, int], n: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, *size, 3), dtype=torch.uint8, generator=g)


def build_finetuned(model: FinetunedModel, size: tuple[int, int]) -> FinetunedClassifier:
    """A fine-tuned model as one torch module on the CPU."""
    model.to("cpu")
    return FinetunedClassifier(model.net, model.preprocessing, size).eval()


def export_model(model: Model | FinetunedModel, fmt: str, out: str | os.PathLike, size: tuple[int, int]) -> dict:
    """Write ``model`` as one ``fmt`` file (atomically) and check it: the ONNX file with ``onnx.checker`` and a run
    under onnxruntime, the TorchScript file loaded back; both must give the logits of the torch module (a fine-tuned
    model: of :meth:`FinetunedModel.logits`, fedhead's own forward) on a test batch (to 1e-4 relative). Returns
    what was checked."""
    if fmt not in FORMATS:
        raise param_error("--format", fmt, f"must be one of {', '.join(FORMATS)}", "E.g. --format onnx.")
    out = check_out(Path(out))
    x = _example(size)
    if isinstance(model, FinetunedModel):
        clf = build_finetuned(model, size)
        want = model.logits(x.numpy()).numpy()
        card = portable(model.card)
    else:
        clf = build_classifier(model, size)
        with torch.no_grad():
            want = clf(x)[0].numpy()
        card = portable_card(model.card)
    meta = {"classes": json.dumps(list(model.classes_)), "fedhead_model": json.dumps(card)}
    with atomic_path(out) as tmp:
        got = _onnx(clf, x, tmp, meta) if fmt == "onnx" else _torchscript(clf, x, tmp, meta)
        err = float(np.abs(got - want).max() / max(1e-12, float(np.abs(want).max())))
        if not err <= 1e-4:
            raise FedheadError(f"The exported {fmt} model's logits differ from fedhead's by {err:.2g} (relative) on a "
                               "test batch; nothing was written. Report this with FEDHEAD_DEBUG=1.")  # fmt: skip
    return {"format": fmt, "out": str(out), "input": [None, *size, 3], "max_relative_error": err}


def _onnx_export(clf: ImageClassifier, x: torch.Tensor, path: Path) -> None:
    """torch's TorchScript-based ONNX exporter, with a dynamic batch axis: about a fifth of the CPU of the
    torch.export-based one on these models (EfficientNet-Lite0 at 8x8: 2.5 s against 13.8 s, measured; logits within
    2e-5 of each other). Where a torch no longer has it, the torch.export-based exporter."""
    names = dict(input_names=["images"], output_names=["logits", "probabilities"], opset_version=ONNX_OPSET)
    with torch.no_grad():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its deprecation notice: the check below holds the file to account
                torch.onnx.export(clf, (x,), str(path), dynamic_axes={"images": {0: "n"}}, dynamo=False, **names)
            return
        except Exception:  # noqa: BLE001 - any failure of the old exporter: the current one decides
            pass
        n = torch.export.Dim("n", min=1)
        torch.onnx.export(clf, (x,), str(path), dynamic_shapes={"images": {0: n}}, dynamo=True, verbose=False, **names)


def _onnx(clf: ImageClassifier, x: torch.Tensor, path: Path, meta: dict) -> np.ndarray:
    """Export, add ``meta`` as the file's metadata (the class names, the card), check, run under onnxruntime."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError:
        raise FedheadError(
            "The 'onnx' format needs the export extra: pip install 'fedhead[export]' (onnx, onnxruntime, onnxscript)."
        ) from None
    _onnx_export(clf, x, path)
    proto = onnx.load(str(path))
    for k, v in meta.items():
        proto.metadata_props.add(key=k, value=v)
    onnx.save(proto, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(["logits"], {"images": x.numpy()})[0]


def _torchscript(clf: ImageClassifier, x: torch.Tensor, path: Path, meta: dict) -> np.ndarray:
    """Trace, save with ``meta`` as extra files (``classes``, ``fedhead_model``), load back and run."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # a ViT's size checks: the loaded file is checked
        traced = torch.jit.trace(clf, (x,), check_trace=False)
        torch.jit.save(traced, str(path), _extra_files=meta)
        loaded = torch.jit.load(str(path), map_location="cpu")
    with torch.no_grad():
        return loaded(x)[0].numpy()
