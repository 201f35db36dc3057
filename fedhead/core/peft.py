"""The trainable parts of a pretrained encoder in federated fine-tuning (``fedhead finetune --peft KIND``).

A fine-tuned model is :class:`FineTuned`: a pretrained encoder (timm or open_clip, as ``fedhead extract`` loads it)
followed by a linear classifier. A *tuning* (one registered :class:`Tuning` per ``--peft`` name) says which tensors
train and travel; every other tensor stays frozen and is shared by all simulated clients (one copy in memory, the
clients' states are the trainable tensors only, :func:`trainable_vector`). The linear classifier always trains.

==========  =========================================================================================================
``head``    nothing in the encoder: the frozen encoder's features once, then a head (``fedhead train``; OvA-LP)
``lora``    low-rank adapters (Hu et al. 2022) through the PEFT library on a ViT's attention and MLP projections
            (``qkv``, ``proj``, ``fc1``, ``fc2``) or a CNN's pointwise (1x1) convolutions; ``B = 0`` at start, so the
            model's outputs are the pretrained encoder's until a round trains them
``prompt``  a ViT: VPT (Jia et al. 2022) ``--prompt-mode shallow`` (P learnt tokens in the first layer's input) or
            ``deep`` (P tokens per layer); any encoder: ``pixel``, a learnt border of ``--prompt-width`` pixels added
            to the normalised image (Bahng et al. 2022's padding prompt), the only form a CNN takes
``bitfit``  the encoder's bias terms (Ben Zaken et al. 2022; a CNN's are its normalisation layers' shifts)
``full``    every parameter of the encoder
==========  =========================================================================================================

The encoder runs in eval mode in every form (batch norm uses its pretrained running statistics, which therefore
never need to travel; dropout is off except LoRA's own ``--lora-dropout``). Random initialisations (LoRA's ``A``,
the prompts) come from a generator keyed by the seed.

VPT places its prompts after the class token; here they are appended after the patch tokens and removed after the
last block. A transformer block is equivariant to the order of tokens that carry no position embedding (VPT's
prompts carry none), so the class token and the pooled output are the same as VPT's.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
from dataclasses import asdict, dataclass

from fedhead.core.plugins import class_registrar, load_plugins
from fedhead.infra.errors import FedheadError, param_error, unknown_name
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
peft_lib = lazy_module("peft")

PROMPT_MODES = ("auto", "shallow", "deep", "pixel")
LORA_TARGETS = ("auto", "attention", "mlp", "pointwise", "linear")


@dataclass(frozen=True)
class TuneSpec:
    """What ``--peft`` and its options ask for (the parameters of every kind; each kind reads its own)."""

    peft: str = "lora"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "auto"  # auto | attention | mlp | pointwise | linear | a regular expression over module names
    prompt_mode: str = "auto"  # auto (ViT: shallow, other: pixel) | shallow | deep | pixel
    prompt_tokens: int = 10  # VPT: learnt tokens per layer
    prompt_width: int = 4  # pixel prompt: border width in pixels
    experts: int = 4  # moe: LoRA experts per adapted layer
    top_k: int = 2  # moe: experts each token uses
    pfpt_pool: int = 20  # pfpt: prompts in the server's pool

    def as_dict(self) -> dict:
        return asdict(self)


class FineTuned(nn.Module):
    """``logits = classifier(encoder(prompt(x)))``: ``x`` the normalised images [B, 3, S, S]."""

    def __init__(self, encoder, feature_dim: int, num_classes: int, image_size: int):
        super().__init__()
        self.encoder = encoder
        self.image_size = int(image_size)
        self.classifier = nn.Linear(feature_dim, num_classes)
        nn.init.zeros_(self.classifier.weight)
        nn.init.zeros_(self.classifier.bias)
        self.pixel_prompt = None  # a PixelPrompt when --prompt-mode pixel

    def features(self, x):
        if self.pixel_prompt is not None:
            x = self.pixel_prompt(x)
        return self.encoder(x)

    def forward(self, x):
        return self.classifier(self.features(x))


class PixelPrompt(nn.Module):
    """A learnt border of ``width`` pixels added to the [B, 3, S, S] input (four tensors: only the border trains)."""

    def __init__(self, size: int, width: int):
        super().__init__()
        inner = size - 2 * width
        self.size, self.width = size, width
        self.top = nn.Parameter(torch.zeros(3, width, size))
        self.bottom = nn.Parameter(torch.zeros(3, width, size))
        self.left = nn.Parameter(torch.zeros(3, inner, width))
        self.right = nn.Parameter(torch.zeros(3, inner, width))

    def forward(self, x):
        inner = self.size - 2 * self.width
        mid = torch.cat([self.left, x.new_zeros(3, inner, inner), self.right], dim=2)
        border = torch.cat([self.top, mid, self.bottom], dim=1)
        return x + border.to(x.dtype)


class Tuning:
    """One ``--peft`` kind: :meth:`attach` makes its tensors of a :class:`FineTuned` trainable (adding them if
    needed); :meth:`check` refuses, in one line, an encoder it does not fit. ``frozen_features``: the encoder does
    not train at all (``head``: features are extracted once). :meth:`aux_loss` adds a term to the local loss (a
    mixture's load balancing); :meth:`aggregate` replaces the rule's average for a kind whose server step is not an
    average (PFPT's prompt matching)."""

    name = ""
    description = ""
    frozen_features = False

    def check(self, model: FineTuned, spec: TuneSpec) -> None:
        """Raise a one-line error when the kind does not fit the encoder."""

    def attach(self, model: FineTuned, spec: TuneSpec, seed: int) -> None:
        raise NotImplementedError

    def aux_loss(self, model: FineTuned):
        return None

    aggregate = None  # or a callable(previous_vector, client_vectors [K, P], sizes [K], spec) -> new vector


TUNINGS: dict[str, type] = {}
register_tuning = class_registrar(TUNINGS, Tuning, "fine-tuning kind", "attach()")


# the built-in kinds defined beside this module (they subclass Tuning, so they are imported on first use: importing
# fedhead.core must not import torch)
BUILTIN_MODULES = ("fedhead.core.fftmoe", "fedhead.core.pfpt")


def _builtin() -> None:
    for name in BUILTIN_MODULES:
        importlib.import_module(name)


def tuning_names() -> list[str]:
    _builtin()
    load_plugins()
    return list(TUNINGS)


def create_tuning(name: str) -> Tuning:
    _builtin()
    if name not in TUNINGS:
        load_plugins()
    if name not in TUNINGS:
        raise unknown_name("--peft", name, TUNINGS, "fine-tuning kind")
    return TUNINGS[name]()


def is_vit(encoder) -> bool:
    """A timm vision transformer (patch embedding, a list of blocks, token sequences)."""
    return hasattr(encoder, "patch_embed") and isinstance(getattr(encoder, "blocks", None), nn.Sequential)


def _freeze(model: FineTuned) -> None:
    for p in model.encoder.parameters():
        p.requires_grad_(False)


@contextlib.contextmanager
def seeded(seed: int, salt: int):
    """The global torch RNG forked and seeded by ``(seed, salt)`` (the PEFT library draws LoRA's ``A`` from it)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((int(seed) * 1_000_003 + salt) % (2**63 - 1))
        yield


# ---------------------------------------------------------------- the kinds


@register_tuning("head")
class HeadOnly(Tuning):
    description = "a head on the frozen encoder's features, extracted once (fedhead train; OvA-LP)"
    frozen_features = True

    def attach(self, model, spec, seed):
        _freeze(model)


@register_tuning("full")
class Full(Tuning):
    description = "every parameter of the encoder"

    def attach(self, model, spec, seed):
        for p in model.encoder.parameters():
            p.requires_grad_(True)


@register_tuning("bitfit")
class BitFit(Tuning):
    description = "the encoder's bias terms (a CNN's normalisation shifts)"

    def check(self, model, spec):
        if not any(n.endswith("bias") for n, _ in model.encoder.named_parameters()):
            raise param_error("--peft", "bitfit", "needs an encoder with bias terms", "Use --peft lora or full.")

    def attach(self, model, spec, seed):
        _freeze(model)
        for n, p in model.encoder.named_parameters():
            if n.endswith("bias"):
                p.requires_grad_(True)


def lora_targets(encoder, targets: str) -> list[str]:
    """The names of the modules ``--lora-targets`` adapts in ``encoder``: ``auto`` is a ViT's attention and MLP
    projections, a CNN's pointwise convolutions; ``attention`` / ``mlp`` a ViT's; ``pointwise`` every 1x1
    convolution (groups 1); ``linear`` every ``nn.Linear``; anything else a regular expression matched against the
    whole module name."""
    vit = is_vit(encoder)
    named = list(encoder.named_modules())

    def linear_under(part: str):
        return [n for n, m in named if isinstance(m, nn.Linear) and re.search(part, n)]

    if targets == "auto":
        targets = "attention+mlp" if vit else "pointwise"
    if targets == "attention+mlp":
        return linear_under(r"\.attn\.(qkv|proj)$") + linear_under(r"\.mlp\.fc[12]$")
    if targets == "attention":
        return linear_under(r"\.attn\.(qkv|proj)$")
    if targets == "mlp":
        return linear_under(r"\.mlp\.fc[12]$")
    if targets == "pointwise":
        return [
            n for n, m in named if isinstance(m, nn.Conv2d) and tuple(m.kernel_size) == (1, 1) and m.groups == 1 and n
        ]
    if targets == "linear":
        return [n for n, m in named if isinstance(m, nn.Linear)]
    try:
        pattern = re.compile(targets)
    except re.error as exc:
        raise param_error("--lora-targets", targets, f"is not a valid regular expression ({exc})") from None
    return [n for n, m in named if n and pattern.fullmatch(n) and isinstance(m, (nn.Linear, nn.Conv2d))]


def checked_targets(model: FineTuned, spec: TuneSpec) -> list[str]:
    """:func:`lora_targets` of the model's encoder, refused in one line when they name no module."""
    names = lora_targets(model.encoder, spec.lora_targets)
    if not names:
        kind = "a ViT" if is_vit(model.encoder) else "a CNN"
        raise param_error(
            "--lora-targets",
            spec.lora_targets,
            f"matches no linear or convolution module of this encoder ({kind})",
            "Use auto, attention, mlp, pointwise, linear, or a regular expression over its module names.",
        )
    return names


@register_tuning("lora")
class LoRA(Tuning):
    description = "low-rank adapters on attention/MLP projections (ViT) or pointwise convolutions (CNN), PEFT library"

    def targets(self, model, spec) -> list[str]:
        return checked_targets(model, spec)

    def check(self, model, spec):
        self.targets(model, spec)

    def attach(self, model, spec, seed):
        _freeze(model)
        config = peft_lib.LoraConfig(
            r=int(spec.lora_rank),
            lora_alpha=float(spec.lora_alpha),
            lora_dropout=float(spec.lora_dropout),
            target_modules=self.targets(model, spec),
            bias="none",
        )
        with seeded(seed, 0x10A):
            peft_lib.inject_adapter_in_model(config, model.encoder)
        for n, p in model.encoder.named_parameters():
            p.requires_grad_("lora_" in n)


class VisualPrompts(nn.Module):
    """VPT's learnt tokens of a timm ViT: ``[layers, P, D]`` (shallow: one layer), appended before block 0 (and
    replaced before every later block when deep), removed after the last block."""

    def __init__(self, encoder, tokens: int, deep: bool, seed: int):
        super().__init__()
        depth = len(encoder.blocks) if deep else 1
        dim = int(encoder.embed_dim)
        patch = encoder.patch_embed.patch_size
        fan = 3 * int(math.prod(patch if isinstance(patch, (tuple, list)) else (patch, patch)))
        bound = math.sqrt(6.0 / float(fan + dim))  # VPT's uniform (Xavier-style) initialisation
        gen = torch.Generator().manual_seed(int(seed) * 7919 + 0xBEE)
        self.tokens = nn.Parameter(torch.empty(depth, tokens, dim).uniform_(-bound, bound, generator=gen))
        self.n = tokens
        blocks = list(encoder.blocks)
        self._hooks = [blocks[0].register_forward_pre_hook(self._first)]
        if deep:
            self._hooks += [b.register_forward_pre_hook(self._layer(i)) for i, b in enumerate(blocks) if i > 0]
        self._hooks.append(blocks[-1].register_forward_hook(self._strip))

    def _first(self, module, args):
        x = args[0]
        p = self.tokens[0].to(x.dtype).expand(x.shape[0], -1, -1)
        return (torch.cat([x, p], dim=1), *args[1:])

    def _layer(self, i: int):
        def hook(module, args):
            x = args[0]
            p = self.tokens[i].to(x.dtype).expand(x.shape[0], -1, -1)
            return (torch.cat([x[:, : -self.n], p], dim=1), *args[1:])

        return hook

    def _strip(self, module, args, out):
        return out[:, : -self.n]


@register_tuning("prompt")
class Prompt(Tuning):
    description = "VPT shallow/deep learnt tokens (ViT) or a learnt pixel border (any encoder)"

    @staticmethod
    def mode(model, spec) -> str:
        if spec.prompt_mode == "auto":
            return "shallow" if is_vit(model.encoder) else "pixel"
        return spec.prompt_mode

    def check(self, model, spec):
        mode = self.mode(model, spec)
        if mode not in ("shallow", "deep", "pixel"):
            raise unknown_name("--prompt-mode", spec.prompt_mode, PROMPT_MODES, "prompt mode")
        if mode in ("shallow", "deep") and not is_vit(model.encoder):
            raise param_error(
                "--prompt-mode",
                mode,
                "needs a vision transformer (VPT adds tokens to its sequence); this encoder is a CNN",
                "Use --prompt-mode pixel (a learnt pixel border), or --peft lora.",
            )

    def attach(self, model, spec, seed):
        _freeze(model)
        mode = self.mode(model, spec)
        if mode == "pixel":
            model.pixel_prompt = PixelPrompt(model.image_size, int(spec.prompt_width))
        else:
            model.encoder.vpt = VisualPrompts(model.encoder, int(spec.prompt_tokens), mode == "deep", seed)


def attach(model: FineTuned, spec: TuneSpec, seed: int) -> Tuning:
    """Check ``spec`` against the model's encoder and make its trainable parts (the classifier always trains)."""
    tuning = create_tuning(spec.peft)
    tuning.check(model, spec)
    tuning.attach(model, spec, seed)
    for p in model.classifier.parameters():
        p.requires_grad_(True)
    return tuning


def trainable(model) -> list[tuple[str, object]]:
    """``(name, parameter)`` of every trainable tensor, in the model's order (what travels)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def trainable_vector(model):
    """The trainable tensors as one float32 vector (a client's state, the server's global state)."""
    return torch.cat([p.detach().reshape(-1).float() for _, p in trainable(model)])


def load_vector(model, vector) -> None:
    """Set the trainable tensors from :func:`trainable_vector`'s layout."""
    params = trainable(model)
    total = sum(p.numel() for _, p in params)
    if vector.numel() != total:
        raise FedheadError(f"A trainable state of {vector.numel()} values does not fit this model ({total}).")
    with torch.no_grad():
        i = 0
        for _, p in params:
            p.copy_(vector[i : i + p.numel()].view_as(p).to(p.dtype))
            i += p.numel()


def trainable_state(model) -> dict:
    """``{name: tensor}`` of the trainable tensors (CPU copies): what a model file keeps beside the encoder id."""
    return {n: p.detach().cpu().clone() for n, p in trainable(model)}
