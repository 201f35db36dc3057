"""Run a personalisation method (:mod:`fedhead.core.personal`) over clients, block by block, and count what their
personal heads get right on their local test sets and on the drift set.

The in-process transport hands every client of the federation to :func:`personalize_clients`; a Flower node hands
its own client (``parts`` of length one) and sends back only the counts. A block's personal heads are made,
evaluated and dropped before the next block: at most ``block`` heads ``[C, D+1]`` (float32) are held at once,
with their training rows and the block's scores on its test rows and the drift set (``block_for`` sizes blocks to
``memory_mb``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from fedhead.core.clientacc import LocalTests, local_correct, sample_correct
from fedhead.core.closedform import accumulate, is_closed_form, ridge_solve
from fedhead.core.engine import ClientSet, Engine, LocalConfig, LossContext, OptimConfig, scores
from fedhead.core.heads import create_head
from fedhead.core.personal import (
    BETA_DEFAULT,
    BETA_GRID,
    Personalizer,
    RidgeKernel,
    correct_counts,
    mixed_statistics,
    prior_bias,
    train_apfl,
)
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")


@dataclass
class ClientData:
    """What personalisation reads of the clients (all rows of one feature space, with the trailing 1).

    ``x``/``labels``: the training rows the global head was trained on (the run's prepared features) and their
    (possibly noisy) labels; ``parts``/``val_parts``: each client's training and validation rows; ``counts`` [K, C]:
    the clients' training label counts and ``totals`` [C] the federation's; ``test_x``/``test_y``: the test split
    (prepared like ``x``); ``tests``: each client's local test set; ``drift``: the balanced drift set (indices into
    the test split, shared by every client); ``raw``/``raw_test``: the raw training and test features [N, D] (what
    the closed-form statistics were summed over), needed by ``closed-form`` only; ``ids``: the clients' global ids
    (keys of their draws; ``range(K)`` in process, the node's partition id on Flower)."""

    x: torch.Tensor
    labels: torch.Tensor
    parts: list
    val_parts: list | None
    counts: np.ndarray
    totals: np.ndarray
    test_x: torch.Tensor
    test_y: torch.Tensor
    tests: LocalTests
    drift: np.ndarray
    raw: torch.Tensor | None = None
    raw_test: torch.Tensor | None = None
    ids: list | None = None


@dataclass
class PersonalCounts:
    """Per client: local test size, correct predictions of its personal head and of the global head there, the same
    two on the drift set (of ``drift_size`` samples), the beta chosen (closed-form; NaN otherwise), and the seconds
    it all took."""

    sizes: np.ndarray
    correct: np.ndarray
    correct_global: np.ndarray
    drift: np.ndarray
    drift_global: np.ndarray
    drift_size: int
    beta: np.ndarray
    seconds: float


@dataclass
class Setting:
    """The run's side of personalisation: its head (the loss of the personal epochs), local optimiser, batch size,
    backend, memory budget; ``seed`` and ``rnd`` key the personal epochs' batches (the last round's)."""

    head_name: str
    head_params: dict
    optim: OptimConfig
    batch_size: int
    backend: str = "vectorized"
    memory_mb: float = 1536.0
    seed: int = 0
    rnd: int = 1


def block_for(K: int, per_client_bytes: float, memory_mb: float) -> int:
    """Clients per block: as many as ``memory_mb`` holds at ``per_client_bytes`` each (at least 1, at most K)."""
    return int(max(1, min(max(K, 1), memory_mb * 2**20 // max(1.0, per_client_bytes))))


def _ones(t: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., D]`` with the trailing 1, in float64 (the closed-form statistics' space)."""
    t = t.to(torch.float64)
    return torch.cat([t, torch.ones(*t.shape[:-1], 1, dtype=torch.float64)], -1)


def _padded(rows_of: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged index lists as ``[B, m]`` (padding 0) and a mask."""
    m = max((len(r) for r in rows_of), default=0)
    idx = np.zeros((len(rows_of), max(m, 1)), dtype=np.int64)
    msk = np.zeros((len(rows_of), max(m, 1)), dtype=bool)
    for j, r in enumerate(rows_of):
        idx[j, : len(r)], msk[j, : len(r)] = r, True
    return torch.as_tensor(idx, device=device), torch.as_tensor(msk, device=device)


def _loss_head(method: Personalizer, s: Setting):
    name = method.loss or (s.head_name if not is_closed_form(s.head_name) else "softmax")
    return create_head(name, **(s.head_params if name == s.head_name else {}))


def personalize_clients(
    method: Personalizer, theta: torch.Tensor, data: ClientData, s: Setting, scorer=None, statistics=None,
    solver=None, progress=None, note=None,
) -> PersonalCounts:  # fmt: skip
    """Every client's personal head by ``method`` from the global head ``theta`` (its scorer for a head not linear
    in the features), evaluated on its local test set and the drift set. ``statistics``/``solver``: the global
    statistics and the closed-form head that solved them (``closed-form`` only). ``progress``: called with the
    number of clients done after each block; ``note``: called with a line for stderr (a slow path's cost)."""
    t0 = time.perf_counter()
    K = len(data.parts)
    okn = sample_correct(theta, data.test_x, data.test_y, head=scorer)  # the global head, one pass
    sizes = data.tests.sizes.astype(np.int64)
    correct_global = local_correct(data.tests, okn)
    drift_size = int(len(data.drift))
    drift_global = np.full(K, int(okn[data.drift].sum()) if drift_size else 0, dtype=np.int64)
    beta = np.full(K, np.nan)
    if method.how == "global":
        return PersonalCounts(sizes, correct_global.copy(), correct_global, drift_global.copy(), drift_global,
                              drift_size, beta, time.perf_counter() - t0)  # fmt: skip
    correct = np.zeros(K, dtype=np.int64)
    drift = np.zeros(K, dtype=np.int64)
    if method.how == "statistics":
        _closed_form(method, theta, data, s, scorer, statistics, solver, correct, drift, beta, progress, note)
    else:
        run = {"shift": _prior, "mix": _apfl, "epochs": _trained}[method.how]
        run(method, theta, data, s, scorer, statistics, solver, correct, drift, beta, progress)
    return PersonalCounts(sizes, correct, correct_global, drift, drift_global, drift_size, beta,
                          time.perf_counter() - t0)  # fmt: skip


def _evaluate_heads(W: torch.Tensor, block: list, data: ClientData, correct, drift) -> None:
    """Count the stacked linear heads ``W [B, C, D+1]`` of ``block`` on their local test sets and the drift set."""
    idx, msk = _padded([data.tests.of(k) for k in block], W.device)
    xb = data.test_x[idx]  # [B, m, D+1]
    with torch.no_grad():
        got = correct_counts(torch.bmm(xb, W.transpose(1, 2).to(xb.dtype)), data.test_y[idx], msk)
        correct[block] = got.cpu().numpy()
        if len(data.drift):
            d = torch.as_tensor(data.drift, device=W.device)
            xd, yd = data.test_x[d], data.test_y[d]
            pred = torch.matmul(xd, W.transpose(1, 2).to(xd.dtype)).argmax(-1)  # [B, M]
            drift[block] = (pred == yd).sum(1).cpu().numpy()


def _prior(method, theta, data: ClientData, s, scorer, statistics, solver, correct, drift, beta, progress) -> None:
    K, C = data.counts.shape
    bias = torch.as_tensor(prior_bias(data.counts, data.totals, method.params["prior_smoothing"]), dtype=torch.float32)
    dev = data.x.device
    with torch.no_grad():
        sd = (
            scores(theta, data.test_x[torch.as_tensor(data.drift, device=dev)], scorer).float().cpu()
            if len(data.drift)
            else None
        )
        yd = data.test_y[torch.as_tensor(data.drift, device=dev)].cpu() if len(data.drift) else None
        per = 8 * (max(1, int(data.tests.sizes.max(initial=1))) + len(data.drift)) * C
        step = block_for(K, per, 256.0)
        for b0 in range(0, K, step):
            block = list(range(b0, min(K, b0 + step)))
            idx, msk = _padded([data.tests.of(k) for k in block], dev)
            st = scores(theta, data.test_x[idx].reshape(-1, data.test_x.shape[1]), scorer).float().cpu()
            st = st.reshape(len(block), -1, C) + bias[block][:, None, :]
            correct[block] = correct_counts(st, data.test_y[idx].cpu(), msk.cpu()).numpy()
            if sd is not None:
                drift[block] = ((sd[None] + bias[block][:, None, :]).argmax(-1) == yd).sum(1).numpy()
            if progress:
                progress(len(block))


def _engine(method: Personalizer, data: ClientData, s: Setting) -> Engine:
    """The engine of a method's personal epochs: its loss, the run's optimiser (``personal_lr`` if given), its
    epochs, in the primal form (the heads themselves are scored)."""
    optim = s.optim if method.params.get("personal_lr") is None else OptimConfig(
        name=s.optim.name, lr=float(method.params["personal_lr"]), weight_decay=s.optim.weight_decay,
        momentum=s.optim.momentum)  # fmt: skip
    cs = ClientSet(x=data.x, y=data.labels, parts=data.parts, counts=data.counts, num_classes=data.counts.shape[1])
    return Engine(cs, _loss_head(method, s), optim, LocalConfig(epochs=method.epochs, batch_size=s.batch_size),
                  backend=s.backend, memory_budget_mb=s.memory_mb, dual="off")  # fmt: skip


def _trained(method, theta, data: ClientData, s, scorer, statistics, solver, correct, drift, beta, progress) -> None:
    """finetune, ditto, fedrod, fedabc, local: the engine's local epochs from the global head (or zero)."""
    K, C = data.counts.shape
    start = theta if method.start == "global" else torch.zeros_like(theta)
    engine = _engine(method, data, s) if method.epochs else None
    per = 4 * C * theta.shape[1] * 3 + 4 * C * (len(data.drift) + int(data.tests.sizes.max(initial=1)))
    step = min(engine.block_clients if engine else K, block_for(K, per, s.memory_mb))
    active = [k for k in range(K) if len(data.parts[k])]
    for b0 in range(0, len(active), step):
        block = active[b0 : b0 + step]
        if engine is None:
            W = start.expand(len(block), *start.shape)
        else:
            W = engine.train_block(start, block, s.seed, s.rnd, prox_mu=method.prox)[0]
        _evaluate_heads(W, block, data, correct, drift)
        if progress:
            progress(len(block))
    # a client with no training sample keeps its start (the global head; nothing for local-only)
    idle = [k for k in range(K) if not len(data.parts[k]) and data.tests.sizes[k]]
    if idle:
        _evaluate_heads(start.expand(len(idle), *start.shape), idle, data, correct, drift)


def _apfl(method, theta, data: ClientData, s, scorer, statistics, solver, correct, drift, beta, progress) -> None:
    K, C = data.counts.shape
    head = _loss_head(method, s)
    lr = float(method.params.get("personal_lr") or s.optim.lr)
    D1 = data.x.shape[1]
    nmax = max((len(p) for p in data.parts), default=1)
    step = block_for(K, 4 * (nmax * D1 * 2 + 4 * C * D1), s.memory_mb)
    for b0 in range(0, K, step):
        block = list(range(b0, min(K, b0 + step)))
        idx, msk = _padded([data.parts[k] for k in block], data.x.device)
        x, y = data.x[idx], data.labels[idx]
        counts = torch.as_tensor(data.counts[block], dtype=torch.float32, device=x.device)
        ctx_of = _context(s.rnd, counts)

        seeds = [(s.seed * 1_000_003 + (data.ids[k] if data.ids else k)) for k in block]
        W = train_apfl(theta, x, y, msk.to(x.dtype), head, ctx_of, method.epochs, lr, s.batch_size,
                       float(method.params["apfl_alpha"]), seeds)  # fmt: skip
        _evaluate_heads(W, block, data, correct, drift)
        if progress:
            progress(len(block))


def _context(rnd: int, counts: torch.Tensor):
    """``m -> LossContext`` of a block's clients for batches of ``m`` samples (no sample dropped: u = 0)."""

    def ctx_of(m: int) -> LossContext:
        return LossContext(round=rnd, present=counts > 0, counts=counts,
                           u=torch.zeros(counts.shape[0], m, device=counts.device))  # fmt: skip

    return ctx_of


def _kernel_of(solver, statistics):
    """A :class:`RidgeKernel` when the solver is plain ridge (no normalised rows, no sketch), else None."""
    if solver is None or solver.name != "ridge":
        return None
    if solver.params.get("ridge_normalize") or int(solver.params.get("stats_sketch", 0) or 0):
        return None
    return RidgeKernel(statistics, float(solver.params["ridge_lambda"]))


SLOW_SOLVES = 1e12  # flops of per-client solves past which closed-form says what it costs (about a minute here)


def _closed_form(method, theta, data: ClientData, s, scorer, statistics, solver, correct, drift, beta, progress,
                 note=None):  # fmt: skip
    """Every client's closed-form personal head: validation and test counts for every beta of the grid in one pass
    (the choice reads validation only), then the drift counts of the chosen beta where a drift set is asked for."""
    K, C = data.counts.shape
    total = float(statistics.counts.sum())
    given = method.params.get("personal_beta")
    grid = (float(given),) if given is not None else (BETA_GRID if data.val_parts is not None else (BETA_DEFAULT,))
    kernel = _kernel_of(solver, statistics)
    D1 = data.raw.shape[1] + 1
    nmax = max((len(p) for p in data.parts), default=1)
    mmax = int(data.tests.sizes.max(initial=1)) + max((len(v) for v in (data.val_parts or [])), default=0)
    # float64 per client: its rows (raw, whitened), residuals and Gram; its test and validation rows with their
    # scores and cross terms; the drift set's scores and cross terms
    k = min(nmax, D1)  # the spectrum's size: the dual form's n x n, the primal form's (D+1) x (D+1)
    per = 8 * (nmax * (2 * D1 + C) + 3 * k * k + 2 * k * C + (mmax + len(data.drift)) * (D1 + C + k))
    step = block_for(K, per, s.memory_mb) if kernel is not None else 1
    if kernel is None and note is not None:
        flops = K * len(grid) * float(statistics.D + 1) ** 3 / 3
        if flops > SLOW_SOLVES:
            note(f"note: --personalize closed-form with --head {solver.name} solves a {statistics.D + 1}-square system "
                 f"per client and beta ({K} clients x {len(grid)} betas, about {flops:.1e} flops); --head ridge takes "
                 "the kernel path (an n_k-square solve per client) and --personal-beta fixes one beta.")  # fmt: skip
    run = _kernel_block if kernel is not None else _solve_block
    val = np.full((K, len(grid)), -1, dtype=np.int64)  # validation correct counts per beta (-1: no validation)
    test = np.zeros((K, len(grid)), dtype=np.int64)
    for b0 in range(0, K, step):
        block = list(range(b0, min(K, b0 + step)))
        val[block], test[block] = run(kernel, solver, statistics, data, block, grid, total)
        if progress and not len(data.drift):
            progress(len(block))
    has = val[:, 0] >= 0
    pooled = len(grid) - 1 - int(np.argmax(val[has].sum(0)[::-1])) if has.any() else len(grid) - 1
    pick = np.where(has, len(grid) - 1 - np.argmax(val[:, ::-1], axis=1), pooled)  # ties: the larger beta
    correct[:] = test[np.arange(K), pick]
    beta[:] = np.asarray(grid)[pick]
    if not len(data.drift):
        return
    for b0 in range(0, K, step):
        block = list(range(b0, min(K, b0 + step)))
        drift[block] = run(kernel, solver, statistics, data, block, [float(beta[k]) for k in block], total, True)
        if progress:
            progress(len(block))


def _kernel_block(kernel: RidgeKernel, solver, statistics, data: ClientData, block, betas, total, on_drift=False):
    """The ridge kernel path for a block of clients: (validation, test) correct counts ``[B, len(betas)]`` for every
    beta (validation -1 where a client has none); ``on_drift``: the drift counts ``[B]`` with client j's own
    ``betas[j]``. The block is diagonalised once (:meth:`RidgeKernel.spectrum`): a beta then costs one batched
    product on the evaluated rows."""
    cpu = torch.device("cpu")
    parts = [data.parts[k] for k in block]
    idx, msk = _padded(parts, cpu)
    phi = _ones(data.raw.cpu()[idx])
    sp = kernel.spectrum(phi, data.labels.cpu()[idx], msk)
    n_k = torch.as_tensor([len(p) for p in parts], dtype=torch.float64)
    if on_drift:
        d = torch.as_tensor(data.drift)
        pd = _ones(data.raw_test.cpu()[d])
        rd, based = kernel.both(pd)
        sd = sp.scores(sp.project(rd), based[None], torch.as_tensor(betas) * n_k / total)
        return (sd.argmax(-1) == data.test_y.cpu()[d][None]).sum(1).numpy()
    rows = {"test": [data.tests.of(k) for k in block]}
    if data.val_parts is not None:
        rows["val"] = [data.val_parts[k] for k in block]
    ev = {}
    for what, of in rows.items():
        eidx, emsk = _padded(of, cpu)
        src = data.raw_test if what == "test" else data.raw
        ys = data.test_y if what == "test" else data.labels
        pe = _ones(src.cpu()[eidx])
        re, basee = kernel.both(pe)
        ev[what] = (sp.project(re), basee, ys.cpu()[eidx], emsk)
    val = np.full((len(block), len(betas)), -1, dtype=np.int64)
    test = np.zeros((len(block), len(betas)), dtype=np.int64)
    for i, b in enumerate(betas):
        for what, (proj, base, ys, emsk) in ev.items():
            got = correct_counts(sp.scores(proj, base, b * n_k / total), ys, emsk).numpy()
            (test if what == "test" else val)[:, i] = got
    if "val" in ev:
        val[~ev["val"][3].any(1).numpy()] = -1
    return val, test


def personal_head(solver, statistics, data: ClientData, k: int, b: float) -> torch.Tensor:
    """Client ``k``'s closed-form personal head by ``solver``'s own solve of its statistics plus ``b`` times the
    global ones (raw features; float64)."""
    part = data.parts[k]
    raw = data.raw.cpu()
    own = accumulate(raw, data.labels.cpu(), [part], statistics.C, cof=False,
                     **solver.message_kwargs(raw.shape[1]))  # fmt: skip
    if getattr(solver, "name", "") == "ridge":  # the regulariser travels with the global statistics (RidgeKernel)
        mixed = mixed_statistics(own, statistics, b)
        lam = float(solver.params["ridge_lambda"]) * b
        theta = ridge_solve(mixed, lam, bool(solver.params.get("ridge_normalize")))
        return solver.unsketch(theta)
    return solver.solve_statistics(mixed_statistics(own, statistics, b))


def _solve_block(kernel, solver, statistics, data: ClientData, block, betas, total, on_drift=False):
    """The generic path, one client at a time: each beta's personal head solved by the head's own solve (as
    :func:`_kernel_block`)."""
    k = block[0]
    n_k = len(data.parts[k])
    scorer = None if getattr(solver, "linear", True) else solver

    def count(theta, rows, test: bool) -> int:
        if not len(rows):
            return 0
        r = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        x = _ones(data.raw_test.cpu()[r] if test else data.raw.cpu()[r])
        y = data.test_y.cpu()[r] if test else data.labels.cpu()[r]
        return int((scores(theta.to(torch.float64), x, scorer).argmax(1) == y).sum())

    def head(b: float) -> torch.Tensor:
        return personal_head(solver, statistics, data, k, b * n_k / total if n_k else 1.0)

    if on_drift:
        return np.array([count(head(betas[0]), data.drift, True)])
    vrows = data.val_parts[k] if data.val_parts is not None else []
    val = np.full((1, len(betas)), -1, dtype=np.int64)
    test = np.zeros((1, len(betas)), dtype=np.int64)
    for i, b in enumerate(betas):
        theta = head(b)
        test[0, i] = count(theta, data.tests.of(k), True)
        if len(vrows) and n_k:
            val[0, i] = count(theta, vrows, False)
    return val, test


def personal_heads(
    method: Personalizer, theta: torch.Tensor, data: ClientData, s: Setting, clients: list, statistics=None,
    solver=None, beta: np.ndarray | None = None,
) -> dict:  # fmt: skip
    """The personal heads of ``clients`` themselves (``{k: theta_k}``, for a per-client model file), in the space
    of ``theta``: the same heads :func:`personalize_clients` scores. ``prior`` adds its log-prior shift to the bias
    column (a linear head) or returns the shift for a head that is not linear (``{k: (theta, shift [C])}``);
    ``closed-form`` solves the client's head explicitly with ``beta[k]`` (the beta the scoring chose; default
    ``BETA_DEFAULT``)."""
    K, C = data.counts.shape
    out: dict = {}
    if method.how == "global":
        return {k: theta.detach().clone() for k in clients}
    if method.how == "shift":
        bias = torch.as_tensor(prior_bias(data.counts[clients], data.totals, method.params["prior_smoothing"]))
        for j, k in enumerate(clients):
            if theta.ndim == 2:
                t = theta.detach().clone()
                t[:, -1] += bias[j].to(t.dtype)
                out[k] = t
            else:
                out[k] = (theta.detach().clone(), bias[j])
        return out
    if method.how == "statistics":
        total = float(statistics.counts.sum())
        for k in clients:
            b = float(beta[k]) if beta is not None and beta[k] == beta[k] else BETA_DEFAULT
            n_k = len(data.parts[k])
            out[k] = personal_head(solver, statistics, data, k, b * n_k / total if n_k else 1.0)
        return out
    if method.how == "mix":
        head = _loss_head(method, s)
        lr = float(method.params.get("personal_lr") or s.optim.lr)
        for k in clients:
            idx, msk = _padded([data.parts[k]], data.x.device)
            counts = torch.as_tensor(data.counts[[k]], dtype=torch.float32, device=data.x.device)
            seeds = [s.seed * 1_000_003 + (data.ids[k] if data.ids else k)]
            out[k] = train_apfl(theta, data.x[idx], data.labels[idx], msk.to(data.x.dtype), head,
                                _context(s.rnd, counts), method.epochs, lr, s.batch_size,
                                float(method.params["apfl_alpha"]), seeds)[0]  # fmt: skip
        return out
    start = theta if method.start == "global" else torch.zeros_like(theta)
    if not method.epochs:
        return {k: start.detach().clone() for k in clients}
    engine = _engine(method, data, s)
    trained = [k for k in clients if len(data.parts[k])]
    if trained:
        W = engine.train_block(start, trained, s.seed, s.rnd, prox_mu=method.prox)[0]
        out.update({k: W[j].detach().clone() for j, k in enumerate(trained)})
    out.update({k: start.detach().clone() for k in clients if k not in out})
    return out
