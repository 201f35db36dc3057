"""Per-client accuracy of a global head: each client's accuracy on test samples in its own label proportions.

FedABC's personalised protocol (SPEC section 3) gives every client a local test set drawn from the global test set
in the client's training class proportions p_k(c) = n_kc / n_k. Drawing test samples of class c uniformly from the
global test set's class c, the expected accuracy of client k's set is

    acc_k = sum_c p_k(c) * acc_c,        acc_c = (correct test predictions of class c) / (test samples of class c)

which is what fedhead reports: the limit of the sampled protocol as the local test set grows (a finite sampled set
differs from it by sampling noise only), deterministic, so it needs no seed. Classes absent from the test split
are left out of p_k (renormalised over the classes the test split has); a client whose classes are all absent
from it (or that holds no sample) has no accuracy and is left out of the statistics.

The cost: one pass of the test set through the head per evaluation (the matmul ``evaluate`` does anyway, giving
the per-class correct counts), then one sparse product of the clients' proportions [K, C] (at most as many
non-zeros as training samples) with acc_c: vectorised, no loop over clients. Measured at 10,000 clients x 1,203
classes x 120,000 training samples (2 CPU cores, load average 15): :func:`client_accuracy` and :func:`client_summary`
0.36 ms per evaluation; :func:`client_weights` once per run unit, 19 ms from sparse counts, 0.33 s from the dense
int64 [K, C] counts the in-process census holds.

With ``--eval-unseen-clients`` the same four statistics are reported, prefixed ``unseen_``, over the clients that no
round has sampled up to the evaluated round (:func:`unseen_summary`; under partial participation, how the global head
serves clients that never trained), with their number, ``unseen_clients``.

Reported over the clients (unweighted: every client counts once): ``client_accuracy_mean``,
``client_accuracy_worst10`` (the mean of the worst 10% of clients, at least one client: ceil(K / 10)),
``client_accuracy_best10`` (the same for the best 10%) and ``client_accuracy_std`` (the population standard
deviation over clients).

Sampled local test sets
-----------------------
The protocol itself, for comparison with papers that sample: :func:`local_test_sets` draws each client a local test
set from the global test split. Client k gets n_k_test = round(n_k N / n_train) samples (n_k its training samples,
N the test split's, n_train all clients'; at least one) or a fixed number per client, split over the classes the test
split has in its training proportions by the largest-remainder method (the counts sum to n_k_test exactly; ties go
to the lower class), each class's share capped at the test samples of that class, so a client that would need a
test sample twice gets fewer samples instead. Each (client, class) share is drawn uniformly without replacement from
that class's test samples: a client's set holds no sample twice, different clients may share samples. The draws
of client k come from Philox generators keyed by (seed, k) alone, so its set does not depend on the other clients'
counts (with ``"proportional"``, only through n_train, the size rule's N / n_train) or on their number; the same
seed gives the same sets. The sets are CSR (:class:`LocalTests`); :func:`sample_correct` gives the correctness of
every test sample from the same pass through the head that :func:`class_correct` makes, and
:func:`local_accuracy` each client's accuracy on its set from it (one cumulative sum, no loop over clients).

The two forms agree in expectation: a sampled set's accuracy is, over seeds, sum_c (m_kc / m_k) acc_c with m_kc
its samples of class c, i.e. acc_k above up to the rounding of the allocation and the caps, so acc_k is the sampled
accuracy's limit as the local set grows; a finite sampled set adds sampling noise (a client with a handful of test
samples has an accuracy of a few possible values), which also widens ``worst10``/``best10`` and ``std``. Reported
as ``local_accuracy_mean``, ``local_accuracy_worst10``, ``local_accuracy_best10`` and ``local_accuracy_std``
(:func:`local_summary`: :func:`client_summary`'s statistics under these names). Measured at 10,000 clients x 1,203
classes x 120,000 training samples and a 60,000-sample test split (2 CPU cores, idle): :func:`local_test_sets`
0.12-0.16 s from sparse counts, 0.20-0.26 s from dense int64 [K, C] counts (about 62,500 test samples in all; IID
clients or three classes a client), once per run unit; :func:`local_accuracy` and :func:`local_summary` 0.5-0.7 ms
per evaluation.
"""

from __future__ import annotations

import math

import numpy as np

from fedhead.core.engine import scores
from fedhead.infra.lazy import lazy_module

torch = lazy_module("torch")

__all__ = [
    "ClientWeights",
    "class_correct",
    "client_weights",
    "client_accuracy",
    "client_summary",
    "unseen_summary",
    "CLIENT_FIELDS",
    "UNSEEN_FIELDS",
    "LocalTests",
    "local_test_sets",
    "local_accuracy",
    "local_correct",
    "local_summary",
    "sample_correct",
    "LOCAL_FIELDS",
]

CLIENT_FIELDS = ("client_accuracy_mean", "client_accuracy_worst10", "client_accuracy_best10", "client_accuracy_std")
UNSEEN_FIELDS = (*(f"unseen_{k}" for k in CLIENT_FIELDS), "unseen_clients")
LOCAL_FIELDS = ("local_accuracy_mean", "local_accuracy_worst10", "local_accuracy_best10", "local_accuracy_std")


def _correct_mask(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, chunk: int, head) -> torch.Tensor:
    """Whether ``argmax`` of :func:`scores` is each sample's label (bool [N], on y's device)."""
    with torch.no_grad():
        parts = [scores(theta, x[i : i + chunk], head).argmax(1) == y[i : i + chunk] for i in range(0, len(y), chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool, device=y.device)


def sample_correct(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, chunk: int = 65536, head=None) -> np.ndarray:
    """Whether each sample is predicted correctly (bool [N]): ``argmax(x @ theta^T)`` (or of ``head.logits(theta,
    x)``) against ``y``; x carries the trailing 1. ``np.bincount(y[ok], minlength=C)`` gives the correct counts of
    :func:`class_correct`, and :func:`local_accuracy` reads it: both from one pass through the head."""
    return _correct_mask(theta, x, y, chunk, head).cpu().numpy()


def class_correct(
    theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, num_classes: int, chunk: int = 65536, head=None
) -> tuple[np.ndarray, np.ndarray]:
    """Correct predictions of ``argmax(x @ theta^T)`` (or of ``head.logits(theta, x)`` for a head not linear in
    ``x``) and test samples, per class (int64 [C] each); x carries the trailing 1. Their sums give the overall
    accuracy of :func:`fedhead.core.engine.evaluate`."""
    ok = _correct_mask(theta, x, y, chunk, head)
    with torch.no_grad():
        correct = torch.bincount(y[ok], minlength=num_classes)[:num_classes]
        total = torch.bincount(y, minlength=num_classes)[:num_classes]
    return correct.cpu().numpy().astype(np.int64), total.cpu().numpy().astype(np.int64)


class ClientWeights:
    """The clients' label proportions over the classes the test split has (sparse [K, C]) and which clients have
    any (``valid``): built once per partition, used at every evaluation."""

    def __init__(self, props, valid: np.ndarray):  # props: scipy.sparse.csr_matrix [K, C]
        self.props, self.valid = props, valid


def client_weights(counts, test_totals: np.ndarray) -> ClientWeights:
    """:class:`ClientWeights` from the clients' training label counts ``counts`` [K, C] (dense or sparse) and the
    test samples per class ``test_totals`` [C]."""
    import scipy.sparse as sp  # here, not at import: scipy.sparse costs every command 0.14 s to start

    m = sp.csr_matrix(counts, dtype=np.float64)
    present = (np.asarray(test_totals) > 0).astype(np.float64)
    m = m @ sp.diags(present)  # classes the test split lacks weigh nothing
    rows = np.asarray(m.sum(1)).ravel()
    valid = rows > 0
    inv = np.zeros_like(rows)
    inv[valid] = 1.0 / rows[valid]
    return ClientWeights(sp.csr_matrix(sp.diags(inv) @ m), valid)


def client_accuracy(
    weights: ClientWeights, correct: np.ndarray, totals: np.ndarray, among: np.ndarray | None = None
) -> np.ndarray:
    """Each valid client's accuracy (float64 [K'], clients without test classes left out): sum_c p_k(c) acc_c;
    ``among`` (bool [K]): only those clients."""
    acc_c = np.asarray(correct, np.float64) / np.maximum(np.asarray(totals, np.float64), 1.0)
    keep = weights.valid if among is None else weights.valid & np.asarray(among, dtype=bool)
    return (weights.props @ acc_c)[keep]


def unseen_summary(weights: ClientWeights, correct: np.ndarray, totals: np.ndarray, trained: np.ndarray) -> dict:
    """:data:`UNSEEN_FIELDS`: :func:`client_summary` over the clients not in ``trained`` (bool [K]: sampled by some
    round so far), and how many of them have an accuracy."""
    acc = client_accuracy(weights, correct, totals, among=~np.asarray(trained, dtype=bool))
    got = client_summary(acc)
    return {**{f"unseen_{k}": v for k, v in got.items()}, "unseen_clients": int(acc.size)}


def client_summary(acc: np.ndarray) -> dict:
    """The four reported statistics of the clients' accuracies (NaN when there is no client)."""
    acc = np.sort(np.asarray(acc, dtype=np.float64))
    if not acc.size:
        return dict.fromkeys(CLIENT_FIELDS, float("nan"))
    m = max(1, math.ceil(acc.size / 10))
    return {
        "client_accuracy_mean": float(acc.mean()),
        "client_accuracy_worst10": float(acc[:m].mean()),
        "client_accuracy_best10": float(acc[-m:].mean()),
        "client_accuracy_std": float(acc.std()),
    }


# ---------------------------------------------------------------- sampled local test sets


class LocalTests:
    """The clients' sampled local test sets in CSR form: client k's are ``index[indptr[k] : indptr[k + 1]]``
    (int64, indices into the global test split, ascending, distinct); ``valid`` (bool [K]): the clients that got
    at least one test sample."""

    def __init__(self, indptr: np.ndarray, index: np.ndarray, valid: np.ndarray):
        self.indptr, self.index, self.valid = indptr, index, valid

    def of(self, k: int) -> np.ndarray:
        """Client ``k``'s local test set."""
        return self.index[self.indptr[k] : self.indptr[k + 1]]

    @property
    def sizes(self) -> np.ndarray:
        """Each client's number of local test samples (int64 [K])."""
        return np.diff(self.indptr)


def local_test_sets(counts, test_y: np.ndarray, seed: int, size: str | int = "proportional") -> LocalTests:
    """Each client's local test set (:class:`LocalTests`) drawn from the global test split (labels ``test_y`` [N])
    in the client's training label proportions (``counts`` [K, C], dense or sparse), over the classes the test
    split has. ``size``: ``"proportional"`` (client k gets round(n_k N / n_train) samples, at least one) or the
    number per client. Allocated over classes by largest remainder, capped at each class's test samples (a capped
    client gets fewer); client k's draws come from generators keyed by (seed, k) alone."""
    import scipy.sparse as sp  # here, not at import (see client_weights)

    test_y = np.asarray(test_y, dtype=np.int64)
    m = sp.csr_matrix(counts, dtype=np.int64, copy=True)  # a copy: the caller's matrix stays as it was
    m.sum_duplicates()  # canonical: columns ascending within a row
    K, C = m.shape
    N = test_y.size
    by_class = np.bincount(test_y, minlength=C)
    totals = by_class[:C]
    starts = np.concatenate([[0], np.cumsum(by_class)])[:C]  # class c's test samples: pool[starts[c]:][:totals[c]]
    pool = np.argsort(test_y, kind="stable")

    n_k = np.asarray(m.sum(1), dtype=np.int64).ravel()  # training size (every class)
    row = np.repeat(np.arange(K, dtype=np.int64), np.diff(m.indptr))
    keep = (totals[m.indices] > 0) & (m.data > 0)  # classes the test split has
    row, col, cnt = row[keep], m.indices[keep].astype(np.int64), m.data[keep]
    held = np.bincount(row, weights=cnt, minlength=K).astype(np.int64)  # training samples of those classes
    if size == "proportional":
        n_train = int(n_k.sum())
        want = (2 * n_k * N + n_train) // (2 * n_train) if n_train else np.zeros(K, np.int64)  # round half up
        want = np.maximum(want, 1)
    elif isinstance(size, (int, np.integer)) and not isinstance(size, bool) and size >= 1:
        want = np.full(K, int(size), dtype=np.int64)
    else:
        raise ValueError(f'size: "proportional" or a positive number of test samples per client, not {size!r}')
    want = np.where(held > 0, want, 0)

    # largest remainder, in exact integers: floor of want * cnt / held, then one more for the largest remainders
    # of each client (ties: the lower class first)
    share = want[row] * cnt
    alloc, rem = share // held[row], share % held[row]
    short = want - np.bincount(row, weights=alloc, minlength=K).astype(np.int64)
    order = np.lexsort((col, -rem, row))
    firsts = np.concatenate([[0], np.cumsum(np.bincount(row, minlength=K))])[:-1]
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) - firsts[row[order]]
    alloc += rank < short[row]
    take = np.minimum(alloc, totals[col])  # no test sample twice within a client
    got = take > 0
    row, col, take = row[got], col[got], take[got]
    avail = totals[col]

    entry, pos = _draw(row, take, avail, K, seed)
    index = pool[starts[col[entry]] + pos]
    key = np.sort(row[entry] * max(N, 1) + index)
    who, index = key // max(N, 1), key % max(N, 1)
    sizes = np.bincount(who, minlength=K)
    indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return LocalTests(indptr, index.astype(np.int64), sizes > 0)


def _draw(row: np.ndarray, take: np.ndarray, avail: np.ndarray, K: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """For every entry j (client ``row[j]``, ascending), ``take[j]`` distinct positions drawn uniformly from
    ``range(avail[j])``; returns (entry, position) pairs. An entry taking all its positions draws nothing; one
    taking more than a quarter sorts uniform keys over all of them; the others draw positions and redraw duplicates
    until there are none (the set is uniform: nothing depends on the values' labels). Client k's draws come from
    its own generators, :func:`_keyed` (seed, k, 0) and (seed, k, r) for the r-th redraw."""
    every = take == avail
    dense = ~every & (4 * take > avail)
    sparse = ~every & ~dense
    e_all, p_all = _ranges(np.flatnonzero(every), avail[every])
    e_sp = np.repeat(np.flatnonzero(sparse), take[sparse])  # one per draw
    e_de, p_de = _ranges(np.flatnonzero(dense), avail[dense])  # one per position of the class
    sp_ptr = np.searchsorted(row[e_sp], np.arange(K + 1))
    de_ptr = np.searchsorted(row[e_de], np.arange(K + 1))
    u_sp, u_de = np.empty(e_sp.size), np.empty(e_de.size)
    gen = _keyed(seed)
    for k in np.flatnonzero((np.diff(sp_ptr) > 0) | (np.diff(de_ptr) > 0)).tolist():
        g = gen(k, 0)
        g.random(out=u_sp[sp_ptr[k] : sp_ptr[k + 1]])
        g.random(out=u_de[de_ptr[k] : de_ptr[k + 1]])

    t_sp = avail[e_sp]
    p_sp = np.minimum((u_sp * t_sp).astype(np.int64), t_sp - 1)
    first = np.searchsorted(e_sp, np.arange(take.size + 1))  # entry j's draws: first[j]:first[j + 1]
    look, redraw = np.arange(e_sp.size), 0  # the draws to check: those of entries that had a duplicate
    while look.size:  # redraw the later of equal positions of an entry
        o = look[np.lexsort((p_sp[look], e_sp[look]))]
        dup = np.zeros(o.size, dtype=bool)
        dup[1:] = (e_sp[o[1:]] == e_sp[o[:-1]]) & (p_sp[o[1:]] == p_sp[o[:-1]])
        again = np.sort(o[dup])
        if not again.size:
            break
        redraw += 1
        redo = np.unique(e_sp[again])
        look = np.add(*_ranges(first[redo], take[redo]))  # their draws' indices
        u = np.empty(again.size)
        ptr = np.searchsorted(row[e_sp[again]], np.arange(K + 1))
        for k in np.flatnonzero(np.diff(ptr)).tolist():
            gen(k, redraw).random(out=u[ptr[k] : ptr[k + 1]])
        p_sp[again] = np.minimum((u * t_sp[again]).astype(np.int64), t_sp[again] - 1)

    o = np.lexsort((u_de, e_de))  # within each dense entry, its positions by key: the first take[j] win
    firsts = np.searchsorted(e_de, e_de)
    chosen = o[np.arange(o.size) - firsts < take[e_de]]  # e_de[o] == e_de: o keeps each entry's block in place
    return np.concatenate([e_all, e_sp, e_de[chosen]]), np.concatenate([p_all, p_sp, p_de[chosen]])


def _keyed(seed: int):
    """``(k, stream) -> np.random.Generator(np.random.Philox(key=[seed, k], counter=[0, 0, 0, stream]))``: one
    generator whose state is set per call (7 us, against 30 us to build one; 10,000 clients' worth is most of
    :func:`local_test_sets`' time). Philox is counter-based: each key is its own stream, and the streams of one
    key start 2**192 blocks apart."""
    bits = np.random.Philox(key=[seed, 0])
    gen = np.random.Generator(bits)
    empty = np.zeros(4, dtype=np.uint64)

    def at(k: int, stream: int) -> np.random.Generator:
        state = {"counter": np.array([0, 0, 0, stream], np.uint64), "key": np.array([seed, k], np.uint64)}
        bits.state = dict(bit_generator="Philox", state=state, buffer=empty, buffer_pos=4, has_uint32=0, uinteger=0)
        return gen

    return at


def _ranges(entries: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(entry, position) for every position in range(lengths[i]) of every entries[i]."""
    e = np.repeat(entries, lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    return e, np.arange(e.size) - np.repeat(starts, lengths)


def local_correct(tests: LocalTests, correct: np.ndarray) -> np.ndarray:
    """Each client's correct predictions on its local test set (int64 [K]), from ``correct`` (bool [N]: whether each
    global test sample is predicted correctly, :func:`sample_correct`): one cumulative sum, no loop over clients."""
    hits = np.concatenate([[0], np.cumsum(np.asarray(correct, dtype=np.int64)[tests.index])])
    return hits[tests.indptr[1:]] - hits[tests.indptr[:-1]]


def local_accuracy(tests: LocalTests, correct: np.ndarray) -> np.ndarray:
    """Each valid client's accuracy on its local test set (float64 [K'], clients without one left out), from
    ``correct`` (:func:`local_correct`)."""
    return local_correct(tests, correct)[tests.valid] / tests.sizes[tests.valid]


def local_summary(acc: np.ndarray) -> dict:
    """:data:`LOCAL_FIELDS`: :func:`client_summary`'s statistics of the clients' local test set accuracies."""
    got = client_summary(acc)
    return {local: got[client] for client, local in zip(CLIENT_FIELDS, LOCAL_FIELDS)}
