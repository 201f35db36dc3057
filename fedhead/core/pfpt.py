"""``--peft pfpt``: probabilistic federated prompt tuning of a ViT (the PFPT baseline of OvA-LP's Section 4.3; Weng
et al., NeurIPS 2024, "Probabilistic Federated Prompt-Tuning with Non-IID and Imbalanced Data").

Clients train ``P = --prompt-tokens`` VPT-shallow prompts (:class:`fedhead.core.peft.VisualPrompts`) and the linear
classifier. The server does not average prompts slot by slot: a client's prompts are an unordered set, and slot
``j`` of one client need not mean what slot ``j`` of another means. PFPT models every client's prompt set as a noisy
sample of a subset of global prompts (each global prompt used by a client with a Beta-Bernoulli process
probability), aligns the sets by a per-client assignment solved with the Hungarian algorithm, and keeps as the
global pool the global prompts that some client used.

:func:`align_prompts` is fedhead's hard-assignment (MAP, small-variance) form of that model, the BP-means objective
of the Beta-Bernoulli process (Broderick, Kulis and Jordan 2013)::

    minimise  sum_k sum_j ||x_kj - phi_a(k,j)||^2  +  lam * (number of global prompts)
    subject to a(k, .) injective: a client's P prompts take P different global prompts

solved by alternating (as the authors' code alternates its likelihood step and its assignment step): for each client
in turn, a :func:`scipy.optimize.linear_sum_assignment` of its prompts to the current global prompts (cost: the
squared distance to the global prompt fitted without this client) or to a new one (cost ``lam``); then every global
prompt becomes the mean of the local prompts assigned to it. ``lam = NEW_PROMPT_COST`` times the clients' mean
within-set spread ``mean_k mean_j ||x_kj - mean_j x_kj||^2`` (how far apart prompts that are certainly different
lie), so a local prompt joins a global prompt when it lies closer than about half the typical distance between
different prompts, and opens a new one otherwise. The result does not depend on the order of any client's prompts.

The pool (``self.pool`` [G, D], ``self.support`` [G]) persists across rounds: last round's pool prompts are the
first candidates of the next matching (a candidate that no client's prompt joins keeps its vector, and its support
halves); a global prompt's support is the share of this round's clients that used it (the Bernoulli probability's
estimate). The pool keeps the ``--pfpt-pool`` best supported prompts; the broadcast vector carries the ``P`` best
supported (ties: the earlier pool prompt), which every client starts the next round from. The classifier is the
clients' size-weighted average. :meth:`PFPT.state_dict` / :meth:`PFPT.load_state_dict` carry the pool across a resume.
"""

from __future__ import annotations

from fedhead.core.peft import FineTuned, TuneSpec, Tuning, VisualPrompts, is_vit, register_tuning, trainable
from fedhead.infra.errors import param_error
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")
scipy_optimize = lazy_module("scipy.optimize")

NEW_PROMPT_COST = 0.5  # lam in units of the clients' mean within-set prompt spread
REFINE_ROUNDS = 10  # alternations after the first greedy pass (the authors' code: outer_loop=10)
STALE_DECAY = 0.5  # support of a pool prompt that no client used this round is multiplied by this


def _assign(x, centres, lam: float) -> list[int]:
    """The Hungarian assignment of the rows of ``x`` [P, D] to ``centres`` [C, D] or to one of P new prompts (cost
    ``lam``): the centre index of every row, ``-1`` for a new prompt."""
    p = x.shape[0]
    new = torch.full((p, p), float(lam), dtype=x.dtype)
    cost = torch.cat([torch.cdist(x, centres) ** 2, new], dim=1) if len(centres) else new
    rows, cols = scipy_optimize.linear_sum_assignment(cost.numpy())
    out = [-1] * p
    for r, c in zip(rows, cols):
        out[int(r)] = int(c) if c < len(centres) else -1
    return out


def _centres(local, assign: list[list[int]], anchors, n: int, skip: int | None = None):
    """Every global prompt's mean over its assigned local prompts (client ``skip`` left out) ``[n, D]`` and its
    member count ``[n]``; a prompt without members keeps its anchor (last round's vector), or NaN if it has none."""
    d = local.shape[-1]
    total = torch.zeros(n, d, dtype=local.dtype)
    count = torch.zeros(n, dtype=local.dtype)
    for k, a in enumerate(assign):
        if k == skip or not a:
            continue
        idx = torch.tensor(a)
        total.index_add_(0, idx, local[k])
        count.index_add_(0, idx, torch.ones(len(a), dtype=local.dtype))
    out = total / count.clamp(min=1).unsqueeze(1)
    fill = torch.full((n, d), float("nan"), dtype=local.dtype)
    fill[: len(anchors)] = anchors
    return torch.where((count > 0).unsqueeze(1), out, fill), count


def align_prompts(local, pool=None, new_cost: float = NEW_PROMPT_COST, rounds: int = REFINE_ROUNDS):
    """Align the clients' prompt sets ``local`` [K, P, D] (float64) with each other and with last round's ``pool``
    [M, D] (or None); returns the global prompts ``[G, D]``, how many clients used each ``[G]``, and each client's
    assignment (``[K][P]`` indices into the global prompts)."""
    k_clients, p, d = local.shape
    anchors = pool if pool is not None else torch.zeros(0, d, dtype=local.dtype)
    spread = (local - local.mean(1, keepdim=True)).pow(2).sum(-1).mean()
    if p == 1 or float(spread) == 0.0:
        spread = (local.reshape(-1, d) - local.reshape(-1, d).mean(0)).pow(2).sum(-1).mean()
    lam = new_cost * float(spread) + 1e-12 * (1.0 + float(local.pow(2).sum(-1).mean()))
    n = len(anchors)
    assign: list[list[int]] = [[] for _ in range(k_clients)]

    def place(k: int) -> bool:
        nonlocal n
        centres, _ = _centres(local, assign, anchors, n, skip=k)
        live = [i for i in range(n) if not torch.isnan(centres[i, 0])]
        picked = _assign(local[k], centres[live], lam) if live else [-1] * p
        a = []
        for c in picked:
            if c < 0:
                a.append(n)
                n += 1
            else:
                a.append(live[c])
        changed = a != assign[k]
        assign[k] = a
        return changed

    for k in range(k_clients):  # the greedy pass: each client against the pool and the clients before it
        place(k)
    for _ in range(rounds):  # alternate until no client's assignment changes
        if not any([place(k) for k in range(k_clients)]):
            break
    centres, count = _centres(local, assign, anchors, n)
    used = sorted({i for a in assign for i in a} | set(range(len(anchors))))
    remap = {old: new for new, old in enumerate(used)}
    return centres[used], count[used], [[remap[i] for i in a] for a in assign]


@register_tuning("pfpt")
class PFPT(Tuning):
    description = "PFPT: VPT-shallow prompts aligned across clients into a global pool (Hungarian matching), ViT only"

    def __init__(self):
        self.pool = None  # [G, D] float64 on the CPU: the server's global prompts
        self.support = None  # [G]: the share of a round's clients that used each (decayed when unused)

    def check(self, model: FineTuned, spec: TuneSpec) -> None:
        if not is_vit(model.encoder):
            raise param_error(
                "--peft",
                "pfpt",
                "needs a vision transformer (its prompts are tokens of the sequence); this encoder is a CNN",
                "Use --peft prompt (a pixel prompt), lora or moe.",
            )
        if spec.prompt_mode not in ("auto", "shallow"):
            raise param_error("--prompt-mode", spec.prompt_mode, "must be auto or shallow with --peft pfpt",
                              "PFPT's prompts are VPT-shallow; leave --prompt-mode at auto.")  # fmt: skip
        if int(spec.pfpt_pool) < int(spec.prompt_tokens):
            raise param_error("--pfpt-pool", spec.pfpt_pool, f"must be >= --prompt-tokens ({spec.prompt_tokens})",
                              "The pool holds at least the prompts a client trains; raise --pfpt-pool.")  # fmt: skip

    def attach(self, model, spec, seed):
        for p in model.encoder.parameters():
            p.requires_grad_(False)
        model.encoder.vpt = VisualPrompts(model.encoder, int(spec.prompt_tokens), False, seed)
        self.pool, self.support = None, None

    def aggregate(self, model, theta, vectors, sizes, spec):
        """The new global vector [P] from the clients' vectors ``[K, P]``: prompts aligned into the pool, the P
        best supported broadcast; every other trainable tensor the size-weighted average."""
        dev = vectors.device
        v = vectors.detach().to("cpu", torch.float64)
        w = torch.as_tensor(sizes, dtype=torch.float64).cpu()
        out = (w[:, None] * v).sum(0) / w.sum()
        prompts = model.encoder.vpt.tokens
        i = 0
        for _, t in trainable(model):
            if t is prompts:
                break
            i += t.numel()
        p, d = prompts.shape[-2], prompts.shape[-1]
        local = v[:, i : i + p * d].reshape(len(v), p, d)
        self.update_pool(local, int(spec.pfpt_pool))
        top = torch.argsort(-self.support, stable=True)[:p]
        out[i : i + p * d] = self.pool[top].reshape(-1)
        return out.to(dev, torch.float32)

    def update_pool(self, local, size: int) -> None:
        """Align ``local`` [K, P, D] with the pool; keep the ``size`` best supported global prompts."""
        m = 0 if self.pool is None else len(self.pool)
        centres, count, _ = align_prompts(local, self.pool)
        support = count / len(local)
        if m:
            stale = self.support * STALE_DECAY
            support[:m] = torch.where(count[:m] > 0, support[:m], stale)
        keep = torch.sort(torch.argsort(-support, stable=True)[:size]).values
        self.pool, self.support = centres[keep].clone(), support[keep].clone()

    def state_dict(self) -> dict:
        """The server's pool (for a checkpoint); empty before the first aggregation."""
        if self.pool is None:
            return {}
        return {"pool": self.pool.clone(), "support": self.support.clone()}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            self.pool, self.support = None, None
            return
        self.pool = torch.as_tensor(state["pool"], dtype=torch.float64).cpu().clone()
        self.support = torch.as_tensor(state["support"], dtype=torch.float64).cpu().clone()
