"""One local-training engine over member-stacked parameters, plus the pure aggregators.

A *member* is one independently trained copy of a model: a client (FedAvg, FedABC, D&C) or a
(client, class) pair (FedOVA). Parameters are dicts ``name -> [M, ...]``; every member has its own
index array into the training set, its own shuffles and its own optimizer state. One step gathers a
``[M, B]`` batch (padded, with a validity mask for ragged clients), runs the model for all members at
once with ``torch.func.functional_call`` under ``vmap``, and updates the active members only. The
algorithms differ in the loss function they hand the engine (``loss_fn(out [M,B,O], y [M,B],
valid [M,B], aux) -> [M]``). ``backend="loop"`` trains members one at a time (debug / reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from fedhead.infra.devices import autocast, flush_denormals, keep_freed_memory, mixed_precision
from fedhead.infra.errors import FedheadError
from fedhead.scratch.models import DualHead, _Seq

Params = dict[str, torch.Tensor]


# ---------------------------------------------------------------- parameters


def init_params(model: nn.Module, gen: torch.Generator, count: int | None = None) -> Params:
    """Fresh PyTorch-default initialisations drawn from ``gen`` (no global seeding).

    With ``count`` the result is stacked ``[count, ...]`` of independent initialisations.
    """

    def one() -> Params:
        out = {}
        for mname, mod in model.named_modules():
            if isinstance(mod, (nn.Conv2d, nn.Linear)):
                w = torch.empty_like(mod.weight, device="cpu")
                nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
                fan_in = w[0].numel()
                out[f"{mname}.weight"] = w
                if mod.bias is not None:
                    bound = 1 / math.sqrt(fan_in)
                    out[f"{mname}.bias"] = torch.empty(mod.bias.shape).uniform_(-bound, bound, generator=gen)
        names = [n for n, _ in model.named_parameters()]
        if sorted(names) != sorted(out):
            raise FedheadError(f"model has parameters outside Conv2d/Linear: {sorted(set(names) - set(out))}")
        return {n: out[n] for n in names}

    if count is None:
        return one()
    many = [one() for _ in range(count)]
    return {n: torch.stack([m[n] for m in many]) for n in many[0]}


def stack_copies(params: Params, count: int) -> Params:
    return {n: p.unsqueeze(0).expand(count, *p.shape).clone() for n, p in params.items()}


def nbytes(params: Params, names=None) -> int:
    return int(sum(p.numel() * p.element_size() for n, p in params.items() if names is None or n in names))


def flatten(stacked: Params, names: list[str]) -> torch.Tensor:
    """Member-stacked tensors ``name -> [M, ...]`` -> one ``[M, P]`` matrix (``names`` order)."""
    return torch.cat([stacked[n].reshape(stacked[n].shape[0], -1) for n in names], dim=1)


def unflatten(flat: torch.Tensor, like: Params, names: list[str]) -> Params:
    """Inverse of :func:`flatten`: ``[M, P]`` -> ``name -> [M, ...]`` shaped as ``like[name]`` (views of ``flat``)."""
    out, i = {}, 0
    for n in names:
        shape = like[n].shape[1:]
        k = int(np.prod(shape, dtype=np.int64))
        out[n] = flat[:, i : i + k].reshape(flat.shape[0], *shape)
        i += k
    if i != flat.shape[1]:
        raise FedheadError(f"unflatten: {flat.shape[1]} values for tensors holding {i}.")
    return out


# ---------------------------------------------------------------- optimizers on stacked members


@dataclass(frozen=True)
class OptimSpec:
    name: str  # "sgd" or "adam"
    lr: float
    momentum: float = 0.0  # sgd only
    weight_decay: float = 0.0  # L2 added to the gradient (torch.optim semantics)
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8


_FUSED_OK: dict = {}


def _fused_ok(name: str, device) -> bool:
    """Whether torch's fused multi-tensor kernel (``torch._fused_adam_`` / ``torch._fused_sgd_``: one pass over the
    parameters, gradients and state) runs on ``device``; checked once per device type."""
    key = (name, torch.device(device).type)
    if key not in _FUSED_OK:
        try:
            w, g, m = [torch.zeros(2, device=device)], [torch.ones(2, device=device)], [torch.zeros(2, device=device)]
            if name == "adam":
                torch._fused_adam_(
                    w,
                    g,
                    m,
                    [torch.zeros(2, device=device)],
                    [],
                    [torch.ones((), device=device)],
                    lr=0.1,
                    beta1=0.9,
                    beta2=0.999,
                    weight_decay=0.0,
                    eps=1e-8,
                    amsgrad=False,
                    maximize=False,
                )
            else:
                torch._fused_sgd_(
                    w,
                    g,
                    m,
                    weight_decay=0.0,
                    momentum=0.9,
                    lr=0.1,
                    dampening=0.0,
                    nesterov=False,
                    maximize=False,
                    is_first_step=False,
                )
            _FUSED_OK[key] = bool(torch.isfinite(w[0]).all()) and float(w[0][0]) < 0
        except (AttributeError, RuntimeError, NotImplementedError, TypeError):
            _FUSED_OK[key] = False
    return _FUSED_OK[key]


class StackedOptimizer:
    """SGD(momentum) / Adam (torch.optim semantics) with per-member state; members not ``active`` in a step are
    left untouched.

    :meth:`step_prefix` is the engine's step: the first ``k`` members, all with the same number of past steps
    (the engine orders members so that the active ones always are such a prefix), updated in place by one fused
    multi-tensor call over every tensor (``torch._fused_adam_`` / ``torch._fused_sgd_``, or the same maths as
    ``torch._foreach_*`` calls where the fused kernel does not run). :meth:`step` takes any ``active`` mask and
    falls back to masked updates when it is not such a prefix."""

    def __init__(self, params: Params, spec: OptimSpec, fused: bool | None = None):
        if spec.name not in ("sgd", "adam"):
            raise FedheadError(f"The '--optimizer' parameter must be one of 'sgd', 'adam'. Got {spec.name!r} instead.")
        self.spec = spec
        m = next(iter(params.values())).shape[0]
        dev = next(iter(params.values())).device
        self.t = torch.zeros(m, device=dev)  # steps taken per member (the masked path's bias correction)
        self.count = np.zeros(m, dtype=np.int64)  # the same on the host (no device sync to test a prefix)
        self.buf = {n: torch.zeros_like(p) for n, p in params.items()}
        self.sq = {n: torch.zeros_like(p) for n, p in params.items()} if spec.name == "adam" else {}
        self.fused = _fused_ok(spec.name, dev) if fused is None else fused
        self._step = torch.zeros((), device=dev)  # the fused Adam kernel's step count (shared by the prefix)

    @torch.no_grad()
    def step(self, params: Params, grads: Params, active: torch.Tensor) -> None:
        """One step for the members where ``active`` [M] is true; ``grads`` are ``[M, ...]``."""
        a = active.detach().cpu().numpy().astype(bool)
        k = int(a.sum())
        if a[:k].all() and (k == 0 or self.count[:k].min() == self.count[:k].max()):
            if k:
                self.step_prefix(params, {n: g[:k] for n, g in grads.items()}, k)
            return
        self.count += a
        s = self.spec
        self.t += active.float()
        for n, p in params.items():
            g = grads[n]
            a = active.view(-1, *([1] * (p.dim() - 1)))
            if s.weight_decay:
                g = g + s.weight_decay * p
            if s.name == "sgd":
                if s.momentum:
                    b = self.buf[n]
                    b.copy_(torch.where(a, s.momentum * b + g, b))
                    g = b
                p.sub_(torch.where(a, s.lr * g, torch.zeros_like(g)))
            else:
                b1, b2 = s.betas
                m, v = self.buf[n], self.sq[n]
                m.copy_(torch.where(a, b1 * m + (1 - b1) * g, m))
                v.copy_(torch.where(a, b2 * v + (1 - b2) * g * g, v))
                t = self.t.clamp(min=1).view(-1, *([1] * (p.dim() - 1)))
                mhat = m / (1 - b1**t)
                vhat = v / (1 - b2**t)
                p.sub_(torch.where(a, s.lr * mhat / (vhat.sqrt() + s.eps), torch.zeros_like(m)))

    @torch.no_grad()
    def step_prefix(self, params: Params, grads: Params, k: int) -> None:
        """One step for members ``0..k-1`` (equal step counts); ``params`` are ``[M, ...]``, ``grads`` ``[k, ...]``."""
        if self.count[:k].min() != self.count[:k].max():
            raise FedheadError(
                f"step_prefix: members 0..{k - 1} have taken different numbers of steps "
                f"({sorted(set(self.count[:k].tolist()))})."
            )
        s = self.spec
        self.count[:k] += 1
        self.t[:k] += 1
        names = list(params)
        ps = [params[n][:k] for n in names]
        gs = [grads[n].contiguous() for n in names]  # the fused kernels read gradients in the params' layout
        fused = self.fused and all(p.is_contiguous() for p in ps)
        if s.name == "sgd":
            bufs = [self.buf[n][:k] for n in names] if s.momentum else []
            if fused:
                torch._fused_sgd_(
                    ps,
                    gs,
                    bufs,
                    weight_decay=s.weight_decay,
                    momentum=s.momentum,
                    lr=s.lr,
                    dampening=0.0,
                    nesterov=False,
                    maximize=False,
                    is_first_step=False,
                )
                return
            if s.weight_decay:
                gs = torch._foreach_add(gs, ps, alpha=s.weight_decay)
            if s.momentum:  # zero buffers at first: the first step's buffer is the gradient
                torch._foreach_mul_(bufs, s.momentum)
                torch._foreach_add_(bufs, gs)
                gs = bufs
            torch._foreach_add_(ps, gs, alpha=-s.lr)
            return
        b1, b2 = s.betas
        ms, vs = [self.buf[n][:k] for n in names], [self.sq[n][:k] for n in names]
        t = int(self.count[0])
        if fused:
            self._step.fill_(t)
            torch._fused_adam_(
                ps,
                gs,
                ms,
                vs,
                [],
                [self._step] * len(ps),
                lr=s.lr,
                beta1=b1,
                beta2=b2,
                weight_decay=s.weight_decay,
                eps=s.eps,
                amsgrad=False,
                maximize=False,
            )
            return
        if s.weight_decay:
            gs = torch._foreach_add(gs, ps, alpha=s.weight_decay)
        torch._foreach_lerp_(ms, gs, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, math.sqrt(1 - b2**t))
        torch._foreach_add_(denom, s.eps)
        torch._foreach_addcdiv_(ps, ms, denom, value=-s.lr / (1 - b1**t))


# ---------------------------------------------------------------- losses (per member, mean over valid samples)


def _masked_mean(per_sample: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    v = valid.to(per_sample.dtype)
    return (per_sample * v).sum(1) / v.sum(1).clamp(min=1)


def _f32(out: torch.Tensor) -> torch.Tensor:
    """Autocast's half-precision outputs in float32 for the loss; float32 and float64 stay as they are."""
    return out.float() if out.dtype in (torch.float16, torch.bfloat16) else out


def softmax_ce(out, y, valid, aux):
    m, b, c = out.shape
    ce = F.cross_entropy(_f32(out).reshape(m * b, c), y.reshape(-1), reduction="none").view(m, b)
    return _masked_mean(ce, valid)


def binary_bce(out, y, valid, aux):
    """One logit per member; target 1 where y == aux['cls'][member] (FedOVA's binary networks)."""
    s = _f32(out[..., 0])
    target = (y == aux["cls"].view(-1, 1)).to(s.dtype)
    bce = F.binary_cross_entropy_with_logits(s, target, reduction="none")
    return _masked_mean(bce, valid)


def fedabc_loss(out, y, valid, aux):
    """FedABC (SPEC section 3): masked focal-style BCE per class; masks from this forward, no gradient.

    ``aux['present']`` [M, C] bool marks the classes with local positives; ``aux['margins']`` is
    (m_p, m_n, m_nn, gamma). Summed over classes, divided by the (valid) batch size.
    """
    mp, mn, mnn, gamma = aux["margins"]
    s = _f32(out)
    q = torch.sigmoid(s)
    pos = F.one_hot(y, s.shape[-1]).bool()
    present = aux["present"].unsqueeze(1)  # [M, 1, C]
    with torch.no_grad():
        qd = q.detach()
        m_pos = pos & present & (qd < mp)
        m_neg_p = ~pos & present & (qd > mn)
        m_neg_n = ~present & (qd > mnn)
    lpos = -((1 - q) ** gamma) * F.logsigmoid(s)
    lneg = -(q**gamma) * F.logsigmoid(-s)
    per = (lpos * m_pos + lneg * (m_neg_p | m_neg_n)).sum(-1)  # [M, B]
    return _masked_mean(per, valid)


def fedrod_loss(out, y, valid, aux):
    """FedRoD (linear mode) on a :class:`~fedhead.scratch.models.DualHead` output ``[M, B, 2C]`` = (generic logits
    g, personalised logits g.detach() + p): the generic head's balanced softmax (Ren et al. 2020: CE of
    ``g + log n_c``, ``n_c`` the member's local class counts; FL-bench's ``balanced_softmax_loss`` with gamma 1)
    plus the personalised CE. ``aux['log_counts']`` [M, C] holds ``log n_c`` (-inf for absent classes: they get
    probability 0 in the generic loss, never a target there)."""
    m, b, c2 = out.shape
    c = c2 // 2
    s = _f32(out)
    g = s[..., :c] + aux["log_counts"].unsqueeze(1)
    yy = y.reshape(-1)
    bsm = F.cross_entropy(g.reshape(m * b, c), yy, reduction="none").view(m, b)
    ce = F.cross_entropy(s[..., c:].reshape(m * b, c), yy, reduction="none").view(m, b)
    per = torch.where(valid, bsm + ce, torch.zeros_like(bsm))  # padding rows may hit a -inf target: dropped
    return per.sum(1) / valid.to(per.dtype).sum(1).clamp(min=1)


# ---------------------------------------------------------------- local training


@dataclass
class TrainResult:
    params: Params  # trained stacked parameters (trainable names only)
    loss: torch.Tensor  # [M] mean training loss over each member's steps
    steps: np.ndarray  # [M] optimizer steps taken


def _schedule(member_idx: list[np.ndarray], epochs: int, batch_size: int, rng: np.random.Generator):
    """Per member: E shuffled epochs split into batches -> padded [S, M, B] index array, -1 = padding."""
    seqs = []
    for idx in member_idx:
        batches = []
        for _ in range(epochs):
            perm = idx[rng.permutation(len(idx))]
            batches += [perm[i : i + batch_size] for i in range(0, len(perm), batch_size)]
        seqs.append(batches)
    s = max((len(b) for b in seqs), default=0)
    out = np.full((s, len(member_idx), batch_size), -1, dtype=np.int64)
    for m, batches in enumerate(seqs):
        for t, b in enumerate(batches):
            out[t, m, : len(b)] = b
    return out, np.array([len(b) for b in seqs])


def _autocast(device: torch.device):
    """The forward's precision (:func:`fedhead.infra.devices.mixed_precision`: bfloat16 on CUDA where the GPU has
    it, else float32)."""
    return autocast(device, mixed_precision(device))


class _GradMods:
    """FedProx's ``mu (w - w_start)`` and SCAFFOLD's ``c - c_k``, added to each step's gradients (in that order).

    ``mu w_start`` is computed once (the head trainer's ``mu_theta``); with ``mu = 0`` and no offset nothing runs."""

    def __init__(self, train_p: Params, prox_mu: float, grad_offset: Params | None, device):
        self.mu = float(prox_mu)
        self.mu_start = {n: p.detach() * self.mu for n, p in train_p.items()} if self.mu else None
        self.offset = None
        if grad_offset is not None:
            missing = sorted(set(train_p) - set(grad_offset))
            if missing:
                raise FedheadError(f"grad_offset has no tensor for the trainable parameters {missing}.")
            self.offset = {n: grad_offset[n].to(device) for n in train_p}

    @torch.no_grad()
    def apply(self, train_p: Params, grads: Params, k: int) -> None:
        """Add the terms of members ``0..k-1`` to their gradients ``grads [k, ...]``."""
        if self.mu:
            for n, g in grads.items():
                g.add_(train_p[n][:k], alpha=self.mu).sub_(self.mu_start[n][:k])
        if self.offset is not None:
            for n, g in grads.items():
                g.add_(self.offset[n][:k])


# ---------------------------------------------------------------- the member-stacked network


class StackedNet:
    """A registered model run for ``A`` members at once: member-major inputs ``[A*B, ...]`` -> ``[A, B, O]``, the
    same maths as ``A`` calls of the module (what ``vmap(functional_call)`` computes), formulated for the CPU:

    * the convolutional features member by member (``conv="member"``), in channels-last layout, so that one
      member's activations stay small; ``vmap`` turns A members' convolutions into one grouped convolution over
      activations A times larger (``conv="grouped"``, kept for tests and comparison), which oneDNN ran slower
      here, and max pooling on NCHW tensors ran many times slower than on channels-last ones;
    * a ReLU right before a max pooling runs after it (``pool(relu(x)) == relu(pool(x))`` exactly, values and
      gradients, on a quarter of the elements);
    * the linear layers as one batched matrix product over the members (:class:`_StackedLinear`: its weight
      gradients come out in the weights' own layout, as the fused optimizer reads them).

    ``fedhead bench speed`` measures the whole training step against the loop backend. :meth:`build` returns None
    for models with other layers (the engine then uses ``vmap``)."""

    def __init__(self, feature_ops: list, classifier_ops: list, dual: bool, conv: str):
        self.fops, self.cops, self.dual, self.conv = feature_ops, classifier_ops, dual, conv

    @classmethod
    def build(cls, model: nn.Module, conv: str = "member") -> "StackedNet | None":
        if type(model) not in (_Seq, DualHead):
            return None
        feats = model.features
        if isinstance(feats, nn.Identity):
            mods = []
        elif type(feats) is nn.Sequential:
            mods = list(feats.named_children())
        else:
            return None
        fops, i = [], 0
        while i < len(mods):
            name, m = mods[i]
            nxt = mods[i + 1][1] if i + 1 < len(mods) else None
            if type(m) is nn.Conv2d and m.padding_mode == "zeros":
                fops.append(("conv", f"features.{name}", m))
            elif type(m) is nn.ReLU and type(nxt) is nn.MaxPool2d and not nxt.return_indices:
                fops += [("pool", "", nxt), ("relu", "", m)]
                i += 1
            elif type(m) is nn.ReLU:
                fops.append(("relu", "", m))
            elif type(m) is nn.MaxPool2d and not m.return_indices:
                fops.append(("pool", "", m))
            elif type(m) is not nn.Identity:
                return None
            i += 1
        cops = []
        for name, m in model.classifier.named_children():
            if type(m) is nn.Linear:
                cops.append(("linear", f"classifier.{name}", m))
            elif type(m) is nn.ReLU:
                cops.append(("relu", "", m))
            elif not (type(m) is nn.Identity or (type(m) is nn.Dropout and m.p == 0)):
                return None
        if not cops or cops[-1][0] != "linear":
            return None
        return cls(fops, cops, isinstance(model, DualHead), conv)

    def __call__(self, p: Params, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """``p``: name -> ``[a, ...]``; ``x``: ``[a*b, ...]`` member-major -> ``[a, b, O]``."""
        if not self.fops:
            h = x.reshape(a, b, -1)
        elif self.conv == "grouped":
            h = self._grouped_features(p, x, a, b)
        else:  # member by member: each one's activations stay small (in cache)
            ws = {n: t.unbind(0) for n, t in p.items() if n.startswith("features.")}  # one backward node each
            xs = x.contiguous(memory_format=torch.channels_last).split(b)
            h = torch.stack(
                [self._features({n: t[i] for n, t in ws.items()}, xs[i]).reshape(b, -1) for i in range(a)]
            )  # flattened in (C, H, W) order, as the module does
        *body, (_, last, _) = self.cops
        for kind, pre, _ in body:
            h = _linear(p, pre, h) if kind == "linear" else F.relu(h)
        g = _linear(p, last, h)
        if self.dual:  # FedRoD: DualHead.forward
            return torch.cat([g, g.detach() + _linear(p, "p_head", h.detach())], dim=-1)
        return g

    def _features(self, p: dict, h: torch.Tensor) -> torch.Tensor:
        for kind, pre, m in self.fops:
            if kind == "conv":
                h = F.conv2d(
                    h, p[f"{pre}.weight"], p.get(f"{pre}.bias"), m.stride, m.padding, m.dilation, m.groups
                ).contiguous(memory_format=torch.channels_last)  # 1 input channel: NCHW
            elif kind == "pool":
                h = F.max_pool2d(h, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)
            else:
                h = F.relu(h)
        return h

    def _grouped_features(self, p: Params, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        h = x.view(a, b, *x.shape[1:]).transpose(0, 1).reshape(b, a * x.shape[1], *x.shape[2:])
        for kind, pre, m in self.fops:  # [B, A*C, H, W]: member a's channels are group a
            if kind == "conv":
                w, bias = p[f"{pre}.weight"], p.get(f"{pre}.bias")
                h = F.conv2d(
                    h,
                    w.reshape(-1, *w.shape[2:]),
                    None if bias is None else bias.reshape(-1),
                    m.stride,
                    m.padding,
                    m.dilation,
                    a * m.groups,
                )
            elif kind == "pool":
                h = F.max_pool2d(h, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)
            else:
                h = F.relu(h)
        return h.reshape(b, a, -1).transpose(0, 1)


class _StackedLinear(torch.autograd.Function):
    """``out[a] = h[a] w[a]^T + b[a]`` for every member: ``[A, B, F]``, ``[A, O, F]``, ``[A, O]`` -> ``[A, B, O]``.

    The backward computes the weight gradient as ``bmm(grad^T, h)``, in the weight's own ``[A, O, F]`` layout;
    autograd's rule for ``bmm(h, w^T)`` gives it as a transposed view, and making that contiguous for the fused
    optimizer cost three times the product itself (the keyword-spotting CNN's 6400 x 256 layer).

    Under autocast the forward's product runs in the autocast dtype (bmm is on autocast's lower-precision list);
    the backward, which runs outside autocast on every device, computes in the dtype of the incoming gradient and
    autograd casts the weight gradient back to the weight's dtype. (Explicit casts rather than ``custom_bwd``, whose
    device type is fixed at decoration: so the CPU tests run the same logic as a GPU.)"""

    @staticmethod
    def forward(ctx, h, w, b):
        ctx.save_for_backward(h, w)
        ctx.bias = b is not None
        wt = w.transpose(1, 2)
        return torch.bmm(h, wt) if b is None else torch.baddbmm(b.unsqueeze(1), h, wt)

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        gh = torch.bmm(g, w.to(g.dtype)) if ctx.needs_input_grad[0] else None
        gw = torch.bmm(g.transpose(1, 2), h.to(g.dtype)) if ctx.needs_input_grad[1] else None
        gb = g.sum(1) if ctx.bias and ctx.needs_input_grad[2] else None
        return gh, gw, gb


def _linear(p: Params, pre: str, h: torch.Tensor) -> torch.Tensor:
    return _StackedLinear.apply(h, p[f"{pre}.weight"], p.get(f"{pre}.bias"))


def _take(v, order: torch.Tensor | None, copy: bool = False):
    """Rows of tensor ``v`` in ``order`` (None: as they are; a copy if ``copy``); anything else as it is."""
    if not torch.is_tensor(v):
        return v
    if order is None:
        return v.clone(memory_format=torch.contiguous_format) if copy else v
    return v[order.to(v.device)].contiguous()


def train_members(
    model: nn.Module,
    params: Params,
    member_idx: list[np.ndarray],
    aux: dict,
    loss_fn: Callable,
    *,
    x_all: torch.Tensor,
    y_all: torch.Tensor,
    to_float: Callable,
    epochs: int,
    batch_size: int,
    optim: OptimSpec,
    rng: np.random.Generator,
    trainable: set[str] | None = None,
    backend: str = "vectorized",
    prox_mu: float = 0.0,
    grad_offset: Params | None = None,
    net: str = "auto",
) -> TrainResult:
    """Train M members (stacked ``params``) on their own index arrays; returns the trainable params.

    Parameters not in ``trainable`` stay fixed (D&C). ``x_all`` / ``y_all`` live on the device.

    ``prox_mu`` (FedProx): each member's objective gets ``(mu/2) ||w - w_start||^2`` over its trainable tensors,
    added as ``mu (w - w_start)`` to the gradient before the optimizer step (weight decay is the optimizer's, after
    it), as the head trainer's vectorized backend does (:mod:`fedhead.core.engine`); ``mu = 0`` runs no extra operation,
    so FedProx at 0 is FedAvg bit for bit. ``grad_offset`` (SCAFFOLD's ``c - c_k``): ``name -> [M, ...]`` added to
    every step's gradient of that trainable tensor, after the FedProx term.

    The members are trained in order of their number of steps (most first), so that the members still training
    at any step are a prefix ``0..A-1``: every step is views of the stacked tensors (no gather of parameters or
    optimizer state) and one fused optimizer call. ``net``: ``auto`` runs :class:`StackedNet` on the CPU and
    ``vmap`` on other devices or for models it does not know; ``member`` / ``grouped`` / ``vmap`` force one
    formulation (tests, ``fedhead bench speed``).
    """
    if x_all.device.type == "cpu":
        flush_denormals()  # a decaying optimizer state must not fall into slow subnormal arithmetic
        keep_freed_memory()
    if backend == "loop":
        return _train_loop(
            model,
            params,
            member_idx,
            aux,
            loss_fn,
            x_all=x_all,
            y_all=y_all,
            to_float=to_float,
            epochs=epochs,
            batch_size=batch_size,
            optim=optim,
            rng=rng,
            trainable=trainable,
            prox_mu=prox_mu,
            grad_offset=grad_offset,
        )
    if net not in ("auto", "member", "grouped", "vmap"):
        raise FedheadError(
            f"The 'net' parameter of train_members must be one of 'auto', 'member', 'grouped', "
            f"'vmap'. Got {net!r} instead."
        )
    device = x_all.device
    names = list(params)
    trainable = set(names) if trainable is None else set(trainable)
    sched, steps = _schedule(member_idx, epochs, batch_size, rng)
    order = np.argsort(-steps, kind="stable")  # most steps first: the active members are a prefix
    same = bool((order == np.arange(len(order))).all())
    order_t = None if same else torch.from_numpy(order).to(device)
    n_active = (steps[order][None, :] > np.arange(sched.shape[0])[:, None]).sum(1)
    sched_t = torch.from_numpy(np.ascontiguousarray(sched[:, order])).to(device)
    train_p = {n: _take(params[n].detach().to(device), order_t, copy=True) for n in names if n in trainable}
    fixed_p = {n: _take(params[n].detach().to(device), order_t) for n in names if n not in trainable}
    aux_o = {k: _take(v, order_t) for k, v in aux.items()}
    offset_o = None if grad_offset is None else {n: _take(v, order_t) for n, v in grad_offset.items()}
    opt = StackedOptimizer(train_p, optim)
    mods = _GradMods(train_p, prox_mu, offset_o, device)
    stacked, batched = _member_forward(model, net, device)
    loss_sum = _step_loop(
        stacked,
        batched,
        loss_fn,
        x_all=x_all,
        y_all=y_all,
        to_float=to_float,
        batch_size=batch_size,
        sched_t=sched_t,
        n_active=n_active,
        names=names,
        train_p=train_p,
        fixed_p=fixed_p,
        aux_o=aux_o,
        mods=mods,
        opt=opt,
    )
    mean_loss = loss_sum / torch.from_numpy(np.maximum(steps[order], 1)).to(device)
    inv = None if same else torch.from_numpy(np.argsort(order)).to(device)
    return TrainResult({n: _take(p, inv) for n, p in train_p.items()}, _take(mean_loss, inv).cpu(), steps)


def _member_forward(model: nn.Module, net: str, device: torch.device) -> tuple[StackedNet | None, Callable]:
    """The members' forward of :func:`train_members`: its :class:`StackedNet` (None: use vmap) and the vmap one."""
    stacked = None
    if net in ("member", "grouped") or (net == "auto" and device.type == "cpu"):
        stacked = StackedNet.build(model, conv="member" if net == "auto" else net)
        if stacked is None and net != "auto":
            raise FedheadError(f"train_members: net={net!r} does not support {type(model).__name__}; use 'vmap'.")
    batched = vmap(lambda p, x: functional_call(model, p, (x,)), in_dims=(0, 0), randomness="different")
    return stacked, batched


def _step_loop(
    stacked: StackedNet | None,
    batched: Callable,
    loss_fn: Callable,
    *,
    x_all: torch.Tensor,
    y_all: torch.Tensor,
    to_float: Callable,
    batch_size: int,
    sched_t: torch.Tensor,
    n_active: np.ndarray,
    names: list[str],
    train_p: Params,
    fixed_p: Params,
    aux_o: dict,
    mods: _GradMods,
    opt: StackedOptimizer,
) -> torch.Tensor:
    """The steps of :func:`train_members` on its members in training order (``sched_t``: ``[S, M, B]``): step t
    trains the active prefix ``0..n_active[t]-1`` (``train_p`` and the optimizer state in place); returns each
    member's loss summed over its steps."""
    device = x_all.device
    m_count = sched_t.shape[1]
    loss_sum = torch.zeros(m_count, device=device)
    b = batch_size
    for t in range(sched_t.shape[0]):
        a = int(n_active[t])
        full = a == m_count
        idx = sched_t[t] if full else sched_t[t, :a]  # [A, B]
        valid = idx >= 0
        flat = idx.clamp(min=0).reshape(-1)
        xb = to_float(x_all[flat])  # [A*B, ...] member-major
        yb = y_all[flat].view(a, b)
        leaves = {n: (p if full else p[:a]).detach().requires_grad_(True) for n, p in train_p.items()}
        p_all = {n: (leaves[n] if n in leaves else fixed_p[n] if full else fixed_p[n][:a]) for n in names}
        aux_a = aux_o if full else {k: (v[:a] if torch.is_tensor(v) else v) for k, v in aux_o.items()}
        with _autocast(device):
            out = stacked(p_all, xb, a, b) if stacked is not None else batched(p_all, xb.view(a, b, *xb.shape[1:]))
        losses = loss_fn(out, yb, valid, aux_a)
        grads = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True)
        grads = {n: (g if g is not None else torch.zeros_like(leaves[n])) for n, g in zip(leaves, grads)}
        mods.apply(train_p, grads, a)
        opt.step_prefix(train_p, grads, a)
        with torch.no_grad():
            loss_sum[:a] += losses.detach()
    return loss_sum


def _train_loop(
    model,
    params,
    member_idx,
    aux,
    loss_fn,
    *,
    x_all,
    y_all,
    to_float,
    epochs,
    batch_size,
    optim,
    rng,
    trainable,
    prox_mu=0.0,
    grad_offset=None,
):
    """Reference backend: one member at a time, same schedule and optimizer maths as the vmap path."""
    outs, losses, steps = [], [], []
    sched, _ = _schedule(member_idx, epochs, batch_size, rng)
    for m in range(len(member_idx)):
        one = {n: p[m : m + 1] for n, p in params.items()}
        aux_m = {k: (v[m : m + 1] if torch.is_tensor(v) else v) for k, v in aux.items()}
        sub = sched[:, m : m + 1]
        sub = sub[(sub >= 0).any(axis=(1, 2))]
        off_m = None if grad_offset is None else {n: v[m : m + 1] for n, v in grad_offset.items()}
        try:
            r = _run_fixed(model, one, sub, aux_m, loss_fn, x_all, y_all, to_float, optim, trainable, prox_mu, off_m)
        except Exception as exc:  # noqa: BLE001 - re-raised with the member named
            raise FedheadError(f"local training failed for member {m}: {type(exc).__name__}: {exc}") from exc
        outs.append(r.params)
        losses.append(r.loss)
        steps.append(r.steps[0])
    return TrainResult({n: torch.cat([o[n] for o in outs]) for n in outs[0]}, torch.cat(losses), np.array(steps))


def _run_fixed(
    model, params, sched, aux, loss_fn, x_all, y_all, to_float, optim, trainable, prox_mu=0.0, grad_offset=None
):
    device = x_all.device
    trainable = set(params) if trainable is None else set(trainable)
    train_p = {n: params[n].detach().clone().to(device).requires_grad_(True) for n in params if n in trainable}
    fixed_p = {n: params[n].detach().to(device) for n in params if n not in trainable}
    opt = StackedOptimizer(train_p, optim)
    mods = _GradMods(train_p, prox_mu, grad_offset, device)
    total = torch.zeros(1, device=device)
    for t in range(sched.shape[0]):
        idx = torch.from_numpy(sched[t]).to(device)
        valid = idx >= 0
        flat = idx.clamp(min=0).reshape(-1)
        xb = to_float(x_all[flat])
        p = {n: v[0] for n, v in {**train_p, **fixed_p}.items()}
        with _autocast(device):
            out = functional_call(model, p, (xb,)).unsqueeze(0)
        loss = loss_fn(out, y_all[flat].view(idx.shape), valid, aux)
        names = list(train_p)
        grads = torch.autograd.grad(loss.sum(), [train_p[n] for n in names], allow_unused=True)
        grads = {n: (g if g is not None else torch.zeros_like(train_p[n])) for n, g in zip(names, grads)}
        mods.apply(train_p, grads, 1)
        opt.step_prefix(train_p, grads, 1)  # the loop's schedule holds this member's batches only
        total += loss.detach()
    return TrainResult(
        {n: p.detach() for n, p in train_p.items()}, (total / max(sched.shape[0], 1)).cpu(), np.array([sched.shape[0]])
    )


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def predict_logits(
    model: nn.Module, params: Params, x: torch.Tensor, to_float: Callable, batch_size: int = 1000
) -> torch.Tensor:
    """Single (unstacked) ``params`` on ``x`` -> logits [N, O]."""
    device = next(iter(params.values())).device
    outs = []
    for i in range(0, len(x), batch_size):
        with _autocast(device):
            outs.append(functional_call(model, params, (to_float(x[i : i + batch_size].to(device)),)).float())
    return torch.cat(outs)


@torch.no_grad()
def predict_stacked_shared(
    model: nn.Module, params: Params, x: torch.Tensor, to_float: Callable, batch_size: int = 500
) -> torch.Tensor:
    """Stacked ``params`` [M, ...], all on the same inputs -> [M, N, O] (FedOVA's n binary networks)."""
    device = next(iter(params.values())).device
    f = vmap(lambda p, xb: functional_call(model, p, (xb,)), in_dims=(0, None))
    outs = []
    for i in range(0, len(x), batch_size):
        with _autocast(device):
            outs.append(f(params, to_float(x[i : i + batch_size].to(device))).float())
    return torch.cat(outs, dim=1)


@torch.no_grad()
def predict_stacked_own(
    model: nn.Module, params: Params, x_all: torch.Tensor, idx: np.ndarray, to_float: Callable, batch_size: int = 250
) -> torch.Tensor:
    """Stacked ``params`` [M, ...], member m on rows ``idx[m]`` of ``x_all`` -> [M, n, O]."""
    device = next(iter(params.values())).device
    f = vmap(lambda p, xb: functional_call(model, p, (xb,)), in_dims=(0, 0))
    idx_t = torch.as_tensor(idx, device=x_all.device)
    outs = []
    for i in range(0, idx_t.shape[1], batch_size):
        blk = idx_t[:, i : i + batch_size]
        xb = to_float(x_all[blk.reshape(-1)]).view(*blk.shape, *x_all.shape[1:]).to(device)
        with _autocast(device):
            outs.append(f(params, xb).float())
    return torch.cat(outs, dim=1)


# ---------------------------------------------------------------- pure aggregators


def weighted_average(stacked: Params, weights: torch.Tensor) -> Params:
    """Size-weighted FedAvg: sum_m w_m p_m / sum_m w_m for every tensor."""
    w = weights.double() / weights.double().sum()
    return {n: torch.tensordot(w.to(p.device), p.double(), dims=1).to(p.dtype) for n, p in stacked.items()}


def grouped_average(previous: Params, stacked: Params, group: torch.Tensor) -> Params:
    """FedOVA: ``previous`` [G, ...]; member m's params belong to group ``group[m]``. Each group becomes
    the unweighted mean of its members; groups no member returned keep their previous values."""
    out = {}
    g_count = next(iter(previous.values())).shape[0]
    counts = torch.bincount(group.cpu(), minlength=g_count).to(torch.float64)
    for n, prev in previous.items():
        s = torch.zeros((g_count, *prev.shape[1:]), dtype=torch.float64, device=prev.device)
        s.index_add_(0, group.to(prev.device), stacked[n].double().to(prev.device))
        c = counts.to(prev.device).view(-1, *([1] * (prev.dim() - 1)))
        out[n] = torch.where(c > 0, s / c.clamp(min=1), prev.double()).to(prev.dtype)
    return out


def partial_average(previous: Params, stacked: Params, weights: torch.Tensor) -> Params:
    """D&C: size-weighted average of the tensors in ``stacked`` (the trained layers); all other tensors
    of ``previous`` are kept as they are."""
    new = weighted_average(stacked, weights)
    return {n: (new[n] if n in new else p) for n, p in previous.items()}


# ---------------------------------------------------------------- layer-wise divergence (D&C)


def cosine_divergence(
    reference: Params, stacked: Params, layers: list[list[str]], mode: str = "local-vs-global"
) -> np.ndarray:
    """Per weight layer: 1 - cos between flattened weights (all tensors of the layer concatenated).

    ``local-vs-global``: mean over members of 1 - cos(local_m, reference). ``local-vs-local``: mean over
    member pairs of 1 - cos(local_a, local_b).
    """
    out = []
    for names in layers:
        loc = torch.cat([stacked[n].reshape(stacked[n].shape[0], -1).double() for n in names], dim=1)
        if mode == "local-vs-global":
            ref = torch.cat([reference[n].reshape(-1).double() for n in names])
            cos = F.cosine_similarity(loc, ref.unsqueeze(0).expand_as(loc), dim=1)
            out.append(float((1 - cos).mean()))
        elif mode == "local-vs-local":
            m = loc.shape[0]
            if m < 2:
                raise FedheadError("local-vs-local divergence needs at least 2 collaborators per round.")
            u = F.normalize(loc, dim=1)
            sim = u @ u.T
            iu = torch.triu_indices(m, m, offset=1)
            out.append(float((1 - sim[iu[0], iu[1]]).mean()))
        else:
            raise FedheadError(
                f"The '--divergence' parameter must be one of 'local-vs-global', "
                f"'local-vs-local'. Got {mode!r} instead."
            )
    return np.array(out)


def choose_split(divergence: np.ndarray, threshold: float) -> int:
    """Split s (1-based, layers 1..s class-agnostic): the layer before the first whose divergence exceeds
    ``threshold`` x the largest divergence; clamped to [1, L-1]."""
    d = np.asarray(divergence, dtype=float)
    top = d.max() if d.size else 0.0
    over = np.flatnonzero(d > threshold * top) if top > 0 else np.array([], int)
    first = int(over[0]) + 1 if over.size else len(d)
    return int(min(max(first - 1, 1), len(d) - 1))
