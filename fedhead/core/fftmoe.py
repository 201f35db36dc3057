"""``--peft moe``: a sparse mixture of LoRA experts on an encoder's projections (the FFT-MoE baseline of OvA-LP's
Section 4.3; Hu et al. 2025, "FFT-MoE: Efficient Federated Fine-Tuning for Foundation Models via Large-scale Sparse
MoE under Heterogeneous Edge").

Every module :func:`fedhead.core.peft.lora_targets` names (a ViT's ``qkv``, ``proj``, ``fc1``, ``fc2``; a CNN's
pointwise convolutions) is replaced by :class:`MoELoRA`, which keeps the frozen module (shared, never copied) and adds
``E = --experts`` low-rank experts and a router. For a token ``x`` (a ViT's token, a CNN's pixel)::

    logits = W_r x                                   W_r: [E, d_in], no bias (the paper's routing matrix W_R)
    S      = the --top-k largest logits              (ties: the lower expert index)
    g_e    = softmax over S of the logits, e in S    (0 for every other expert)
    y      = base(x) + (alpha / r) * sum_e g_e B_e A_e x      A_e: [r, d_in], B_e: [d_out, r], r = --lora-rank

``B_e = 0`` at start, so the model's outputs are the pretrained encoder's until a round trains them. Every expert
of every layer and every router travel and are averaged by the aggregation rule (FFT-MoE's server step is the
size-weighted FedAvg of the MoE adapters). A stride-``s`` pointwise convolution routes the pixels it reads
(``x[:, :, ::s, ::s]``).

The load-balancing term (:meth:`MoE.aux_loss`) is Switch Transformer's (Fedus et al. 2022, eq. 4), the standard
the paper's "heterogeneity-aware auxiliary loss" regularises; that loss's own formula was not recoverable (see
``docs/finetune-baselines.md``). Per adapted layer, over the ``N`` tokens of the batch::

    f_e = (tokens that route to e) / (k N)           the fraction of the k N routing slots expert e receives
    P_e = mean over tokens of softmax(logits)_e      the router's mean probability (all E experts)
    L   = E * sum_e f_e P_e                          1 when routing is uniform, E / k when it collapses

and the term added to the local loss is ``AUX_WEIGHT`` times the mean of ``L`` over the adapted layers (a mean,
not Switch's per-layer sum, so the weight does not grow with the depth of the encoder). ``f`` carries no gradient;
``P`` does.

Initialisation, from a generator keyed by the seed, module by module in the encoder's order: ``A_e`` and ``W_r``
uniform in ``+-1/sqrt(d_in)`` (the bound of PyTorch's and PEFT's default ``kaiming_uniform_(a=sqrt(5))``),
``B_e = 0``. ``--lora-dropout`` applies to the experts' input, as in LoRA.
"""

from __future__ import annotations

import math

from fedhead.core.peft import FineTuned, TuneSpec, Tuning, checked_targets, register_tuning
from fedhead.infra.errors import param_error
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
F = lazy_module("torch.nn.functional")

AUX_WEIGHT = 0.01  # Switch Transformer's alpha (Fedus et al. 2022, Section 2.2); FFT-MoE's value was not recoverable


class MoELoRA(nn.Module):
    """A frozen ``nn.Linear`` (or pointwise ``nn.Conv2d``) plus a routed mixture of ``experts`` LoRA experts of
    rank ``rank``, ``top_k`` of them per token. ``last_gates`` holds the dense gates ``[N, E]`` of the last forward
    (the test reads which experts each token used); ``balance`` the layer's load-balancing term while gradients are
    on (:meth:`MoE.aux_loss` collects and clears it)."""

    def __init__(self, base, experts: int, rank: int, alpha: float, top_k: int, dropout: float, gen):
        super().__init__()
        conv = isinstance(base, nn.Conv2d)
        d_in = int(base.in_channels if conv else base.in_features)
        d_out = int(base.out_channels if conv else base.out_features)
        self.base = base
        self.conv = conv
        self.stride = tuple(base.stride) if conv else (1, 1)
        self.experts, self.rank, self.top_k = int(experts), int(rank), int(top_k)
        self.scale = float(alpha) / float(rank)
        bound = 1.0 / math.sqrt(d_in)
        self.lora_A = nn.Parameter(torch.empty(self.experts, self.rank, d_in).uniform_(-bound, bound, generator=gen))
        self.lora_B = nn.Parameter(torch.zeros(self.experts, d_out, self.rank))
        self.router = nn.Parameter(torch.empty(self.experts, d_in).uniform_(-bound, bound, generator=gen))
        self.lora_dropout = nn.Dropout(float(dropout)) if dropout > 0 else nn.Identity()
        self.last_gates = None
        self.balance = None

    def route(self, tokens):
        """Dense gates ``[N, E]`` (``top_k`` non-zero per token, summing to 1) and the softmax over all experts."""
        logits = F.linear(tokens, self.router.to(tokens.dtype)).float()
        probs = torch.softmax(logits, dim=-1)
        top, idx = torch.topk(logits, self.top_k, dim=-1, sorted=True)
        gates = torch.zeros_like(logits).scatter(1, idx, torch.softmax(top, dim=-1))
        return gates, probs

    def delta(self, tokens):
        """The experts' contribution ``[N, d_out]`` for tokens ``[N, d_in]``."""
        gates, probs = self.route(tokens)
        self.last_gates = gates.detach()
        if torch.is_grad_enabled():
            used = (gates > 0).float().mean(0) / self.top_k  # f_e: the share of the k N routing slots
            self.balance = self.experts * (used.detach() * probs.mean(0)).sum()
        h = torch.einsum("nd,erd->ner", self.lora_dropout(tokens), self.lora_A.to(tokens.dtype))
        h = h * gates.to(h.dtype).unsqueeze(-1)
        return torch.einsum("ner,eor->no", h, self.lora_B.to(h.dtype)) * self.scale

    def forward(self, x):
        out = self.base(x)
        if self.conv:
            sh, sw = self.stride
            xs = x[:, :, ::sh, ::sw] if (sh, sw) != (1, 1) else x
            b, c, h, w = xs.shape
            d = self.delta(xs.permute(0, 2, 3, 1).reshape(-1, c))
            return out + d.view(b, h, w, -1).permute(0, 3, 1, 2).to(out.dtype)
        d = self.delta(x.reshape(-1, x.shape[-1]))
        return out + d.view(*out.shape[:-1], -1).to(out.dtype)


def _replace(root, name: str, new) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def moe_layers(model) -> list:
    """The :class:`MoELoRA` modules of ``model``, in its order."""
    return [m for m in model.modules() if isinstance(m, MoELoRA)]


@register_tuning("moe")
class MoE(Tuning):
    description = "FFT-MoE: a sparse mixture of LoRA experts with a top-k router on the LoRA targets (own modules)"

    def targets(self, model: FineTuned, spec: TuneSpec) -> list[str]:
        names = checked_targets(model, spec)
        for n in names:
            m = model.encoder.get_submodule(n)
            if isinstance(m, nn.Conv2d) and (tuple(m.kernel_size) != (1, 1) or m.groups != 1 or any(m.padding)):
                raise param_error(
                    "--lora-targets",
                    spec.lora_targets,
                    f"names {n!r}, a convolution that is not pointwise (1x1, groups 1, no padding)",
                    "Use --lora-targets pointwise, or a regular expression over linear or 1x1 modules.",
                )
        return names

    def check(self, model, spec):
        if not 1 <= int(spec.top_k) <= int(spec.experts):
            raise param_error("--top-k", spec.top_k, f"must be in [1, --experts ({spec.experts})]", "Use e.g. 2.")
        self.targets(model, spec)

    def attach(self, model, spec, seed):
        for p in model.encoder.parameters():
            p.requires_grad_(False)
        gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + 0x30E) % (2**63 - 1))
        for name in self.targets(model, spec):
            base = model.encoder.get_submodule(name)
            wrapped = MoELoRA(base, spec.experts, spec.lora_rank, spec.lora_alpha, spec.top_k, spec.lora_dropout, gen)
            _replace(model.encoder, name, wrapped)
        for m in moe_layers(model):
            for p in (m.lora_A, m.lora_B, m.router):
                p.requires_grad_(True)

    def aux_loss(self, model):
        """``AUX_WEIGHT`` times the mean of the adapted layers' balance terms of the last forward (then cleared)."""
        terms = []
        for m in moe_layers(model):
            if m.balance is not None:
                terms.append(m.balance)
                m.balance = None
        if not terms:
            return None
        return AUX_WEIGHT * torch.stack(terms).mean()
