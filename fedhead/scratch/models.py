"""Model registry for the scratch paths (timm-style: ``create_model(name, in_shape, num_outputs)``).

All models are buffer-free (no batch norm) so that member-stacked parameters can be trained with
``torch.func.functional_call`` under ``vmap``. ``weight_layers(model)`` lists the weight layers
(Conv2d / Linear, in forward order) used by Divide-and-Conquer's layer split and by byte counting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fedhead.infra.errors import FedheadError, unknown_name


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[tuple, int], nn.Module]  # (in_shape (C, H, W), num_outputs) -> module
    help: str
    input_kind: str  # "image" or "mfcc"; the dataset must match


MODELS: dict[str, ModelSpec] = {}


def register_model(name: str, help: str, input_kind: str = "image"):
    def deco(fn):
        MODELS[name] = ModelSpec(name, fn, help, input_kind)
        return fn

    return deco


def create_model(name: str, in_shape: tuple, num_outputs: int) -> nn.Module:
    if name not in MODELS:
        raise unknown_name("--model", name, MODELS, "model")
    return MODELS[name].build(tuple(in_shape), int(num_outputs))


def weight_layers(model: nn.Module) -> list[list[str]]:
    """Parameter names grouped by weight layer (Conv2d / Linear), in registration (forward) order."""
    groups = []
    for mname, mod in model.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            prefix = f"{mname}." if mname else ""
            groups.append([prefix + p for p, _ in mod.named_parameters(recurse=False)])
    return groups


def _flat_dim(features: nn.Module, in_shape: tuple) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *in_shape)).flatten(1).shape[1])


class _Seq(nn.Module):
    """features -> flatten -> classifier; the common shape of every registered model."""

    def __init__(self, features: nn.Module, classifier_dims: list[int], in_shape: tuple, dropout=0.0):
        super().__init__()
        self.features = features
        dims = [_flat_dim(features, in_shape), *classifier_dims]
        layers: list[nn.Module] = []
        for i in range(len(dims) - 1):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < len(dims) - 2:
                layers.append(nn.ReLU(inplace=False))
                if dropout:
                    layers.append(nn.Dropout(dropout))
        self.classifier = nn.Sequential(*layers)

    def embed(self, x):
        """The input of the last linear layer (the representation a head sees)."""
        z = self.features(x).flatten(1)
        for m in self.classifier[:-1]:
            z = m(z)
        return z

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class DualHead(nn.Module):
    """FedRoD's two predictors on one body (Chen & Chao, ICLR 2022; linear mode).

    The wrapped model's own last linear layer is the generic head G; ``p_head`` is a personal linear head of the
    same shape reading the same representation z. The output ``[..., 2C]`` is the generic logits ``G(z)`` then
    the personalised logits ``G(z).detach() + P(z.detach())``: the personal head is learnt on top of the generic
    predictor, and its loss reaches neither G nor the body (as in the authors' pcode ``FedRodWorker``). Parameter
    names are the wrapped model's plus ``p_head.weight`` / ``p_head.bias``.
    """

    def __init__(self, base: _Seq):
        super().__init__()
        if not isinstance(base, _Seq) or not isinstance(base.classifier[-1], nn.Linear):
            raise FedheadError("FedRoD needs a model whose last layer is linear (every registered model is).")
        self.features = base.features
        self.classifier = base.classifier
        last = base.classifier[-1]
        self.p_head = nn.Linear(last.in_features, last.out_features)

    def forward(self, x):
        z = _Seq.embed(self, x)
        g = self.classifier[-1](z)
        return torch.cat([g, g.detach() + self.p_head(z.detach())], dim=-1)


@register_model(
    "cnn",
    "FedOVA/FedAvg CNN: conv16-pool-conv32-pool (5x5, 2x2 pooling) + linear "
    "(MNIST / Fashion-MNIST; any image size and channel count)",
)
def _cnn(in_shape, n):
    c = in_shape[0]
    f = nn.Sequential(
        nn.Conv2d(c, 16, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )
    return _Seq(f, [n], in_shape)


@register_model("fedabc-mlp", "FedABC MLP 784-260-200-n (flattened input)")
def _mlp(in_shape, n):
    return _Seq(nn.Identity(), [260, 200, n], in_shape)


@register_model("fedabc-convnet", "FedABC ConvNet: conv64-pool-conv64-pool (5x5) + FC 120, 64, n (CIFAR-10)")
def _convnet(in_shape, n):
    c = in_shape[0]
    f = nn.Sequential(nn.Conv2d(c, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(64, 64, 5), nn.ReLU(), nn.MaxPool2d(2))
    return _Seq(f, [120, 64, n], in_shape)


VGG9_CFG = [32, 64, "M", 128, 128, "M", 256, 256, "M"]  # FedMA ModerateCNN (D&C)
VGG11_CFG = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def _vgg_features(cfg, c):
    layers: list[nn.Module] = []
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
            c = v
    return nn.Sequential(*layers)


def _vgg(cfg: list, div: int = 1):
    """A VGG without batch norm: ``cfg``'s convs (3x3) and FC 512, 512, n, every width divided by ``div``."""
    convs = [v if v == "M" else max(1, v // div) for v in cfg]
    return lambda in_shape, n: _Seq(_vgg_features(convs, in_shape[0]), [512 // div, 512 // div, n], in_shape)


register_model("vgg11", "VGG11 (no batch norm; FedOVA CIFAR-10): 8 conv + FC 512, 512, n")(_vgg(VGG11_CFG))
register_model("vgg9", "VGG-9 (FedMA ModerateCNN, D&C): conv 32,64,P,128,128,P,256,256,P + FC 512, 512, n")(
    _vgg(VGG9_CFG)
)
for _div in (2, 4, 8):  # narrower copies (every conv and hidden FC width / div): paper protocols cut to CPU size
    register_model(
        f"vgg11-w{_div}",
        f"VGG11 at 1/{_div} width: 8 conv ({64 // _div}..{512 // _div}) + FC {512 // _div}, {512 // _div}, n",
    )(_vgg(VGG11_CFG, _div))
    register_model(
        f"vgg9-w{_div}",
        f"VGG-9 at 1/{_div} width: conv {32 // _div}..{256 // _div} + FC {512 // _div}, {512 // _div}, n",
    )(_vgg(VGG9_CFG, _div))


@register_model(
    "kws-cnn", "Keyword-spotting CNN: 3 conv (16/32/64, 3x3, 1x2 pooling) + FC 256, n on 50x16 MFCCs", input_kind="mfcc"
)
def _kws(in_shape, n):
    c = in_shape[0]
    f = nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d((1, 2)),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d((1, 2)),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d((1, 2)),
    )
    return _Seq(f, [256, n], in_shape)


def check_model_input(name: str, input_kind: str, dataset: str) -> None:
    spec = MODELS[name]
    if spec.input_kind != input_kind:
        raise FedheadError(
            f"The '--model' parameter {name!r} takes {spec.input_kind} input but dataset "
            f"{dataset!r} gives {input_kind} input. Use a model made for {input_kind} input."
        )
