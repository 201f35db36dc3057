"""Secure aggregation on Flower: every sum the fedhead server needs, computed with Flower's SecAgg+.

With ``--secure-aggregation`` the server learns only the SUM over a round's clients of what they send: the
aggregation rule's message in every training round (plus the sample count, class holds, loss, compute time and
SCAFFOLD's variate delta), the feature statistics of ``--center``/``--scale rms`` (with the class counts and the
flipped labels), the closed-form statistics of ncm/ridge/cof/lda and ``--init``, and CCVR's class moments. DEPLOY.md
"Secure aggregation" has the threat model and what is still revealed.

How SecAgg+ is driven. The protocol is Flower's, untouched: the server runs the four stages of
:class:`flwr.server.workflow.SecAggPlusWorkflow` (``setup_stage`` ... ``unmask_stage``) against the Grid, and the
nodes run :func:`flwr.client.mod.secaggplus_mod` around fedhead's own train handler
(:func:`fedhead.flower.masking.secure_mod` applies it to the messages that carry its configuration, so a node serves
plain and secure runs alike). The workflow is
written for Flower's legacy fit path, so each exchange is one legacy round: a :class:`LegacyContext` whose
strategy (:class:`_Exchange`) hands the workflow fedhead's per-node messages as ``FitIns`` and receives the
unmasked result in ``aggregate_fit``. Every node sends weight 1 (``FitRes.num_examples = 1``, ``max_weight = 1``),
so the workflow returns the mean of the vectors; times the number of vectors it added, that is their sum. The
stages are called one by one (not ``workflow(grid, context)``) to learn which nodes dropped out where: a node lost
in the first two stages (before any mask exists) is left out and the protocol restarts with the others, because
Flower's unmask stage would ask the survivors for key shares that node never made and abort the round.

Quantisation. Flower quantises a vector clipped to ``[-c, c]`` into ``[0, R]`` by stochastic rounding, one range
for the whole vector: fedhead's vectors mix head weights (~1), sample counts (~1e4) and Gram sums (~1e6), so any
one ``c`` clips some or loses others. fedhead therefore rounds every value itself to a fixed-point integer
``X = round(x * 2^F)``, written in ``L`` balanced base-2^30 digits (each in ``[-2^29, 2^29]``), and sets Flower's
ranges so that its quantiser is exact on such digits (``c = 2^29``, ``R = 2^30``: ``q = digit + 2^29``, no
rounding left); the masks live in ``Z_(2^62)`` (``modulus_range``), wide enough for the digit sums of 2^32 clients.
The only error is fedhead's rounding, at most ``2^-(F+1)`` per value and client, deterministic (a secure run is
reproducible). :data:`HEAD_FORMAT` (training rounds: F = 24, L = 2, |x| < 2^35) and :data:`STATS_FORMAT`
(statistics: F = 36, L = 3, |x| < 2^53); a value outside the range, or not finite, is the node's one-line error.
Each digit travels as one int64, so a value costs 8 L bytes (Flower's own default costs 8).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np

from fedhead.flower.common import require_flower

require_flower()

import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict  # noqa: E402
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Status,
    bytes_to_ndarray,
    ndarrays_to_parameters,  # noqa: E402
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402
from flwr.server.compat.grid_client_proxy import GridClientProxy  # noqa: E402
from flwr.server.compat.legacy_context import LegacyContext  # noqa: E402
from flwr.server.server_config import ServerConfig  # noqa: E402
from flwr.server.strategy import Strategy as LegacyStrategy  # noqa: E402
from flwr.server.workflow import SecAggPlusWorkflow  # noqa: E402
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD  # noqa: E402
from flwr.server.workflow.constant import Key as WorkflowKey  # noqa: E402
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState  # noqa: E402

from fedhead.core.aggregate import aggregator_of
from fedhead.core.ccvr import ClassStats, PooledStats
from fedhead.core.closedform import StatsAccumulator, pack_upper, unpack_upper
from fedhead.core.sampling import per_round as clients_per_round
from fedhead.federation.clients import FeatureStats
from fedhead.federation.config import SECURE_MIN_CLIENTS as MIN_CLIENTS  # noqa: E402
from fedhead.flower.common import (
    LOG,
    MESSAGE_PREFIX,
    by_node,
    client_stats_from_record,
    short_reason,
)
from fedhead.flower.masking import METRICS
from fedhead.flower.replies import npy_count
from fedhead.infra import devices
from fedhead.infra.errors import FedheadError  # noqa: E402

LIMB_BITS = 30
QUANTIZATION_RANGE = 1 << LIMB_BITS  # Flower's quantization_range R
CLIPPING_RANGE = float(1 << (LIMB_BITS - 1))  # Flower's clipping_range c: its quantiser maps digit d to d + c exactly
MODULUS_RANGE = 1 << 62  # the masks' group Z_(2^62) (Flower's modulus_range, a power of 2)
COMPLETE_GRAPH_UP_TO = 32  # up to this many nodes every node shares keys with every other
KIND = "secure-kind"  # config key: which exchange a secure train message is
ARRAY_NAMES = "secure-arrays"  # config key: the names of the FitIns parameters, in order


# ---------------------------------------------------------------- fixed point


@dataclass(frozen=True)
class FixedPoint:
    """``x -> round(x * 2^frac_bits)`` as ``limbs`` balanced base-2^30 digits, each exactly representable by
    Flower's quantiser (see the module docstring). Decoding a digit-wise sum gives the sum of the rounded values."""

    frac_bits: int
    limbs: int

    @property
    def step(self) -> float:
        """The rounding step: each value is off by at most half of it, per client."""
        return 2.0**-self.frac_bits

    @property
    def bound(self) -> float:
        """Values must satisfy ``|x| < bound``."""
        return 2.0 ** (LIMB_BITS - 1 + LIMB_BITS * (self.limbs - 1) - self.frac_bits)

    def encode(self, x: np.ndarray, what: str = "value") -> np.ndarray:
        """``x [n]`` -> the digits ``[limbs * n]`` (float64 holding integers in [-2^29, 2^29]), lowest digit
        block first. Exact except the final rounding (each subtraction below is exact in float64)."""
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(x)):
            raise FedheadError(
                f"The secure-aggregation {what} holds a non-finite number, which SecAgg+ cannot add. "
                "Lower --lr (or check the features) so that training stays finite."
            )
        big = float(np.abs(x).max()) if x.size else 0.0
        if big >= self.bound:
            raise FedheadError(
                f"The secure-aggregation {what} holds a value of magnitude {big:.3g}, outside the "
                f"fixed-point range |x| < {self.bound:.3g} (2^-{self.frac_bits} steps). Lower --lr "
                "or rescale the features (fedhead.flower.secure formats)."
            )
        r = x * 2.0**self.frac_bits
        digits = []
        for j in range(self.limbs - 1, 0, -1):
            unit = 2.0 ** (LIMB_BITS * j)
            d = np.rint(r / unit)
            r = r - d * unit
            digits.append(d)
        digits.append(np.rint(r))
        return np.concatenate(digits[::-1])

    def decode(self, digit_sums: np.ndarray) -> np.ndarray:
        """The sum of the encoded values from the digit-wise sums ``[limbs * n]`` (float64)."""
        d = np.asarray(digit_sums, dtype=np.float64).reshape(self.limbs, -1)
        out = np.zeros(d.shape[1])
        for j in range(self.limbs - 1, -1, -1):  # the largest digit first
            out += d[j] * 2.0 ** (LIMB_BITS * j)
        return out * 2.0**-self.frac_bits


HEAD_FORMAT = FixedPoint(24, 2)  # training rounds: |x| < 2^35 ~ 3.4e10, step 6.0e-8 (heads, n_k W_k, deltas)
STATS_FORMAT = FixedPoint(36, 3)  # statistics: |x| < 2^53 ~ 9.0e15, step 1.5e-11 (float64 sums, Gram, moments)


@dataclass
class Layout:
    """The named parts of one exchange's vector (every node and the server build the same one)."""

    parts: list  # [(name, shape)]
    fmt: FixedPoint

    @property
    def size(self) -> int:
        return int(sum(int(np.prod(s)) for _, s in self.parts))

    def flatten(self, values: dict) -> np.ndarray:
        out = []
        for name, shape in self.parts:
            v = np.asarray(values[name], dtype=np.float64)
            if v.shape != tuple(shape):
                raise FedheadError(
                    f"The secure-aggregation part {name!r} has shape {v.shape}, but the exchange "
                    f"expects {tuple(shape)}. Every client must send the same message shapes."
                )
            out.append(v.reshape(-1))
        return np.concatenate(out) if out else np.zeros(0)

    def unflatten(self, vec: np.ndarray) -> dict:
        out, o = {}, 0
        for name, shape in self.parts:
            k = int(np.prod(shape))
            out[name] = vec[o : o + k].reshape(shape)
            o += k
        return out

    def encode(self, values: dict, what: str) -> np.ndarray:
        return self.fmt.encode(self.flatten(values), what)

    def decode(self, digit_sums: np.ndarray) -> dict:
        if digit_sums.size != self.fmt.limbs * self.size:
            raise FedheadError(
                f"The secure sum has {digit_sums.size} digits, but the exchange expects "
                f"{self.fmt.limbs * self.size}. The nodes run another fedhead version; update them."
            )
        return self.unflatten(self.fmt.decode(digit_sums))


def train_layout(agg, theta: torch.Tensor, scaffold: bool) -> Layout:
    """A training round: the rule's message (shapes from a dry run, as :meth:`fedhead.Aggregator.nbytes`), the
    sample count, class holds, whether the client trained, its loss and compute time, SCAFFOLD's delta."""
    C = theta.shape[0]
    dry = agg.message(
        theta, theta[None], torch.ones(1, device=theta.device), torch.ones(1, C, dtype=torch.bool, device=theta.device)
    )
    parts = [("msg." + k, tuple(v.shape[1:])) for k, v in sorted(dry.items())]
    parts += [("n", ()), ("holds", (C,)), ("trained", ()), ("loss", ()), ("ms", ())]
    if scaffold:
        parts += [("scaffold-delta", tuple(theta.shape)), ("scaffold-lost", ())]
    return Layout(parts, HEAD_FORMAT)


def census_layout(C: int, D: int, features: bool) -> Layout:
    """Before round 1 (all clients): class counts and flipped labels; the feature sums of --center/--scale rms."""
    parts = [("counts", (C,)), ("flipped", ()), ("n", ())]
    if features:
        parts += [("feature-sum", (D,)), ("feature-sq", ())]
    return Layout(parts, STATS_FORMAT)


def statistics_layout(C: int, D: int, gram: bool) -> Layout:
    """A closed-form head's / --init's statistics, dense over all classes: sums, counts, holders, the Gram."""
    parts = [("sums", (C, D)), ("counts", (C,)), ("holders", (C,)), ("ms", ())]
    if gram:
        parts += [("gram", ((D + 1) * (D + 2) // 2,))]
    return Layout(parts, STATS_FORMAT)


def spread_layout(D: int) -> Layout:
    """cof's second exchange: the client's weighted spread of its class sums (upper triangle)."""
    return Layout([("spread", (D * (D + 1) // 2,))], STATS_FORMAT)


def ccvr_layout(C: int, D: int) -> Layout:
    """CCVR's class moments: counts, sums and second moments (upper triangles), all classes."""
    return Layout([("counts", (C,)), ("sums", (C, D)), ("second", (C, D * (D + 1) // 2)), ("ms", ())], STATS_FORMAT)


# ---------------------------------------------------------------- the protocol's parameters


def _mb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{int(n):,} bytes"


def protocol_params(n: int) -> tuple[int | float, int]:
    """``(num_shares, reconstruction_threshold)`` for ``n`` nodes: every node shares with all others up to
    :data:`COMPLETE_GRAPH_UP_TO` nodes (``1.0``: Flower's "all"), else with ``2 ceil(2 log2 n) + 1`` neighbours
    (SecAgg+'s logarithmic graph); the threshold is a majority of a node's neighbourhood (itself included)."""
    if n <= COMPLETE_GRAPH_UP_TO:
        return 1.0, n // 2 + 1
    k = min(n, 2 * math.ceil(2 * math.log2(n)) + 1)
    return k, k // 2 + 1


# ---------------------------------------------------------------- the node side


def plain_content(msg: Message) -> tuple[str, RecordDict]:
    """The fedhead message a secure one carries (the workflow sends it as legacy ``FitIns``): its kind and its
    content ``{"arrays", "config"}`` as a plain run's handler reads it."""
    rd = msg.content
    cfg = rd.config_records["fitins.config"]
    names = [str(n) for n in cfg.get(ARRAY_NAMES, [])]
    rec = rd.array_records["fitins.parameters"]
    arrays = ArrayRecord({n: Array(bytes_to_ndarray(rec[str(i)].data)) for i, n in enumerate(names)})
    config = ConfigRecord({k: v for k, v in cfg.items() if k != ARRAY_NAMES})
    return str(cfg[KIND]), RecordDict({"arrays": arrays, "config": config})


def secure_reply(msg: Message, vector: np.ndarray) -> Message:
    """The reply :func:`secaggplus_mod` masks: the encoded vector as the only parameters, weight 1, no metrics."""
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([vector]), 1, {})
    return Message(compat.fitres_to_recorddict(res, True), reply_to=msg)


def _dense_stats(m, C: int, D: int, gram: bool) -> dict:
    """A :class:`fedhead.core.closedform.ClientStats` as dense arrays over all classes."""
    sums = np.zeros((C, D))
    counts = np.zeros(C)
    sums[m.classes] = np.asarray(m.sums).reshape(len(m.classes), D)
    counts[m.classes] = m.counts
    out = {"sums": sums, "counts": counts, "holders": (counts > 0).astype(np.float64)}
    if gram:
        out["gram"] = pack_upper(np.asarray(m.gram)) if m.gram is not None else np.zeros((D + 1) * (D + 2) // 2)
    return out


def node_values(kind: str, request: RecordDict, reply: Message, C: int, D: int, cfg) -> tuple[Layout, dict]:
    """What a node adds to a secure exchange, read from its plain handler's ``reply`` to ``request`` (the plain
    run's message, so both runs send the same numbers): the layout and its values."""
    if reply.has_error():
        raise FedheadError(reply.error.reason)
    arrays = reply.content["arrays"] if "arrays" in reply.content else {}
    m = reply.content["metrics"]
    if kind == "train":
        theta = torch.as_tensor(request["arrays"]["head"].numpy(), dtype=torch.float32)
        layout = train_layout(aggregator_of(cfg), theta, cfg.scaffold)
        v = {name: np.zeros(shape) for name, shape in layout.parts}
        if cfg.scaffold and int(m.get("scaffold-lost", 0)):
            v["scaffold-lost"] = 1.0
        elif int(m["num-examples"]) > 0:  # an empty client adds nothing (the plain server skips it)
            for name, _ in layout.parts:
                if name.startswith("msg."):
                    v[name] = arrays[MESSAGE_PREFIX + name[4:]].numpy()
            v.update(
                n=float(m["num-examples"]),
                holds=arrays["holds"].numpy().astype(np.float64),
                trained=1.0,
                loss=float(m["train-loss"]),
                ms=float(m["client-ms"]),
            )
            if cfg.scaffold:
                v["scaffold-delta"] = arrays["scaffold-delta"].numpy()
        return layout, v
    if kind == "census":
        features = "feature-sum" in arrays
        v = {
            "counts": arrays["class-counts"].numpy(),
            "flipped": float(m["noise-flipped"]),
            "n": float(m["num-examples"]),
        }
        if features:
            v.update({"feature-sum": arrays["feature-sum"].numpy(), "feature-sq": float(m["feature-sq"])})
        return census_layout(C, D, features), v
    if kind == "statistics":
        gram = "cf-gram" in arrays
        v = _dense_stats(client_stats_from_record(arrays, D), C, D, gram)
        v["ms"] = float(m.get("stats-ms", 0.0))
        return statistics_layout(C, D, gram), v
    if kind == "cof-spread":
        acc = StatsAccumulator(C, D)
        acc.set_cof_weights(request["arrays"]["class-n"].numpy(), request["arrays"]["class-k"].numpy())
        acc.add(client_stats_from_record(arrays, D))
        return spread_layout(D), {"spread": acc.spread.numpy()[np.triu_indices(D)]}
    if kind == "ccvr":
        blob = arrays["ccvr-stats"].numpy().tobytes()
        counts, sums, second = np.zeros(C), np.zeros((C, D)), np.zeros((C, D * (D + 1) // 2))
        if blob:
            s = ClassStats.from_bytes(blob, D)
            iu = np.triu_indices(D)
            for j, cls in enumerate(s.classes):
                n, mu = float(s.counts[j]), s.means[j]
                counts[cls], sums[cls] = n, n * mu
                second[cls] = ((n - 1.0) * s.covs[j] + n * np.outer(mu, mu))[iu]
        return ccvr_layout(C, D), {"counts": counts, "sums": sums, "second": second, "ms": float(m["client-ms"])}
    raise FedheadError(f"Unknown secure exchange {kind!r} from the server. Update this node's fedhead.")


# ---------------------------------------------------------------- the server side


def content_bytes(rd: RecordDict) -> int:
    """Payload bytes of a SecAgg+ message as fedhead counts a plain one's (the head and the messages, not the run's
    configuration): arrays' data, bytes and strings, 8 bytes a number, in every record but fedhead's own config
    (``fitins.config``, which a plain run sends too and does not count) and :data:`METRICS`; protobuf framing and
    record names not counted."""
    total = 0
    for rec in rd.array_records.values():
        total += sum(len(a.data) for a in rec.values())
    recs = [
        r
        for k, r in list(rd.config_records.items()) + list(rd.metric_records.items())
        if k not in ("fitins.config", METRICS)
    ]
    for rec in recs:
        for v in rec.values():
            for x in v if isinstance(v, list) else [v]:
                total += len(x) if isinstance(x, (bytes, str)) else 8
    return total


class _Recorder:
    """The Grid as the workflow sees it: forwards every call, and records per node the bytes each way, the
    failures (error replies and missing ones) of the last stage and the nodes' SecAgg+ compute time. A masked
    vector of another shape than the exchange's (``vector`` digits) becomes that node's error reply, so the
    workflow leaves the node out as a dropout (its values are masked: only shapes and the range can be checked)."""

    def __init__(self, grid, timeout: float, vector: int | None = None):
        self.grid, self.timeout, self.vector = grid, timeout, vector
        self.up: dict = {}
        self.down: dict = {}
        self.node_ms: dict = {}
        self.failed: dict = {}  # node -> reason, for the last call
        self.wait_s = 0.0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        stage = ""
        for m in messages:
            stage = str(m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE])
            self.down[m.metadata.dst_node_id] = self.down.get(m.metadata.dst_node_id, 0) + content_bytes(m.content)
        t0 = time.perf_counter()
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.wait_s += time.perf_counter() - t0
        if stage == Stage.COLLECT_MASKED_VECTORS and self.vector is not None:
            replies = [self._checked(node, r, messages) for node, r in by_node(replies, messages)]
        self.failed = {}
        seen = set()
        for node, r in by_node(replies, messages):
            seen.add(node)
            if r.has_error():
                self.failed[node] = f"{short_reason(r.error.reason)} (SecAgg+ stage {stage})"
                continue
            self.up[node] = self.up.get(node, 0) + content_bytes(r.content)
            if METRICS in r.content.metric_records:
                self.node_ms[node] = self.node_ms.get(node, 0.0) + float(r.content.metric_records[METRICS]["ms"])
        for m in messages:
            if m.metadata.dst_node_id not in seen:
                self.failed[m.metadata.dst_node_id] = f"no reply within {self.timeout:g} s (SecAgg+ stage {stage})"
        return replies

    def _checked(self, node: int, r: Message, sent: list) -> Message:
        """``r``, or an error reply in its place when its masked vector is not the exchange's ``[1] + [vector]``
        integers in ``[0, 2^62)``."""
        if r.has_error():
            return r
        why = masked_vector_problem(r, self.vector)
        if why is None:
            return r
        req = next((m for m in sent if m.metadata.dst_node_id == node), None)
        LOG.log(WARNING, "[fedhead] SecAgg+: the masked vector of node %s is refused: %s", node, why)
        return Message(Error(code=0, reason=f"[[bad masked vector refused: {why}]]"), reply_to=req)

    def __getattr__(self, name):
        return getattr(self.grid, name)


def masked_vector_problem(r: Message, vector: int) -> str | None:
    """Why a node's SecAgg+ stage-2 reply is no masked vector of ``vector`` digits (None: it is one). Sizes are read
    from the ``.npy`` headers before any array is."""
    try:
        got = r.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]
        if not isinstance(got, list) or len(got) != 2 or not all(isinstance(b, bytes) for b in got):
            return "not two arrays (the weight and the vector)"
        for b, want in zip(got, (1, vector)):
            n, dt = npy_count(b)
            if n != want or dt.kind not in "iu":
                return f"an array of {n} {dt} values, expected {want} integers"
            a = bytes_to_ndarray(b)
            if a.size and (int(a.min()) < 0 or int(a.max()) >= MODULUS_RANGE):
                return "values outside the masks' group"
    except Exception as exc:  # noqa: BLE001 - any malformed reply is the node's failure
        return f"malformed ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    return None


class _Exchange(LegacyStrategy):
    """The legacy strategy the workflow drives: ``configure_fit`` hands it fedhead's messages of the nodes still
    in the exchange, ``aggregate_fit`` receives the unmasked mean (the workflow's weighted average, weights 1)."""

    def __init__(self, grid, fitins: dict):
        self.grid, self.fitins = grid, fitins
        self.mean, self.included = None, []

    def configure_fit(self, server_round, parameters, client_manager):
        return [(GridClientProxy(n, self.grid, 0), ins) for n, ins in self.fitins.items()]

    def aggregate_fit(self, server_round, results, failures):
        self.mean = parameters_to_ndarrays(results[0][1].parameters)[0] if results else None
        self.included = [proxy.node_id for proxy, _ in results]
        return None, {}

    def initialize_parameters(self, client_manager):
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


@dataclass
class SecureSum:
    """One secure exchange: the decoded ``sums`` (None when the protocol stopped: ``halted`` says why), the nodes
    whose vectors are in them, the nodes left out with their reasons, bytes and times."""

    sums: dict | None
    included: list
    failed: dict
    halted: str | None
    bytes_up: int = 0  # all nodes, all stages
    bytes_down: int = 0
    wall_s: float = 0.0
    server_s: float = 0.0  # the server's own computation (unmasking, decoding)
    node_ms: dict = field(default_factory=dict)
    restarts: int = 0
    shares: int | float = 0
    threshold: int = 0


def _fit_ins(messages: list, kind: str) -> dict:
    """Each node's plain-exchange message as the workflow's ``FitIns`` (its arrays in order, ``kind`` in its config)."""
    pending = {}
    for m in messages:
        content = m.content
        arrays = content["arrays"] if "arrays" in content.array_records else ArrayRecord()
        names = list(arrays.keys())
        config = dict(content["config"])
        config.update({KIND: kind, ARRAY_NAMES: names})
        pending[m.metadata.dst_node_id] = FitIns(ndarrays_to_parameters([arrays[k].numpy() for k in names]), config)
    return pending


def _workflow(shares: int | float, t: int, nodes: int, timeout: float) -> SecAggPlusWorkflow:
    """Flower's SecAgg+ workflow for ``nodes`` nodes, its ranges set so that its quantiser is exact on the digits."""
    return SecAggPlusWorkflow(
        shares if isinstance(shares, float) else min(shares, nodes),
        t,
        max_weight=1.0,
        clipping_range=CLIPPING_RANGE,
        quantization_range=QUANTIZATION_RANGE,
        modulus_range=MODULUS_RANGE,
        timeout=timeout,
    )


def _legacy_context(strat: _Exchange, rnd: int) -> LegacyContext:
    """The legacy round ``rnd`` the workflow runs, with ``strat`` as its strategy."""
    ctx = LegacyContext(
        Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        config=ServerConfig(num_rounds=max(1, rnd)),
        strategy=strat,
    )
    ctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: int(rnd)})
    ctx.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    return ctx


def _key_stages(
    wf: SecAggPlusWorkflow, rec: _Recorder, ctx: LegacyContext, state: WorkflowState
) -> tuple[dict, str | None]:
    """Run SecAgg+'s setup and share-keys stages; return the nodes that failed there and why the protocol stopped."""
    early: dict = {}
    for name, step in (("setup", wf.setup_stage), ("share keys", wf.share_keys_stage)):
        ok = step(rec, ctx, state)
        early.update(rec.failed)
        if not ok:
            return early, f"secure aggregation stopped in SecAgg+ stage {name}"
    return early, None


def _masked_stages(
    wf: SecAggPlusWorkflow,
    rec: _Recorder,
    ctx: LegacyContext,
    state: WorkflowState,
    strat: _Exchange,
    failed: dict,
    asked: int,
    t: int,
) -> str | None:
    """Run SecAgg+'s collect-masked-vectors and unmask stages; return why the protocol stopped (None: it did not)."""
    ok = wf.collect_masked_vectors_stage(rec, ctx, state)
    failed.update(rec.failed)
    if not ok:
        lost = "; ".join(f"node {k}: {v}" for k, v in sorted(rec.failed.items()))
        return (
            f"secure aggregation stopped in SecAgg+ stage collect masked vectors: "
            f"{len(state.active_node_ids)} of {asked} nodes sent their masked vectors, fewer "
            f"than the reconstruction threshold {t} ({lost})"
        )
    ok = wf.unmask_stage(rec, ctx, state)
    if not ok or strat.mean is None:
        return (
            f"secure aggregation stopped in SecAgg+ stage unmask: fewer than the reconstruction "
            f"threshold {t} nodes returned their key shares"
        )
    return None


def secure_sum(grid, messages: list, kind: str, layout: Layout, rnd: int, timeout: float) -> SecureSum:
    """The sum over the nodes of ``messages`` (fedhead's messages of a plain exchange, one per node) of the
    vectors their handlers make for ``kind``, by Flower's SecAgg+ (see the module docstring)."""
    t0 = time.perf_counter()
    pending = _fit_ins(messages, kind)
    n0 = len(pending)
    shares, t = protocol_params(n0)
    rec = _Recorder(grid, timeout, layout.fmt.limbs * layout.size)
    failed: dict = {}
    out = SecureSum(None, [], failed, None, shares=shares, threshold=t)

    def done(halted=None, sums=None, included=()):
        out.halted, out.sums, out.included = halted, sums, list(included)
        out.bytes_up, out.bytes_down = sum(rec.up.values()), sum(rec.down.values())
        out.wall_s = time.perf_counter() - t0
        out.server_s = out.wall_s - rec.wait_s
        out.node_ms = dict(rec.node_ms)
        return out

    if n0 < MIN_CLIENTS:
        return done(f"secure aggregation needs at least {MIN_CLIENTS} clients, but only {n0} could be asked")
    while True:
        if len(pending) < max(t, MIN_CLIENTS - 1):
            return done(
                f"secure aggregation stopped: {len(pending)} of {n0} nodes left before masking, fewer "
                f"than the reconstruction threshold {t}"
            )
        wf = _workflow(shares, t, len(pending), timeout)
        strat = _Exchange(rec, dict(pending))
        ctx = _legacy_context(strat, rnd)
        state = WorkflowState()
        try:  # a node's malformed SecAgg+ reply stops this exchange (its round's failure), not the run
            early, halted = _key_stages(wf, rec, ctx, state)
            if early:  # no mask involves these nodes yet: start again without them
                for node, why in early.items():
                    failed[node] = why
                    pending.pop(node, None)
                out.restarts += 1
                continue
            if halted is not None:
                return done(halted)
            halted = _masked_stages(wf, rec, ctx, state, strat, failed, len(pending), t)
            if halted is not None:
                return done(halted)
            included = strat.included
            digit_sums = np.rint(np.asarray(strat.mean, dtype=np.float64) * len(included))
            return done(None, layout.decode(digit_sums), included)
        except Exception as exc:  # noqa: BLE001
            why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            return done(f"secure aggregation stopped: a SecAgg+ reply could not be used ({why})")


# ---------------------------------------------------------------- the strategy's secure exchanges


class SecureRounds:
    """The exchanges of :class:`fedhead.flower.strategy.FedheadStrategy` under ``--secure-aggregation``: each builds
    the plain run's messages, sums the nodes' vectors by :func:`secure_sum` and hands the strategy the same sums a
    plain run adds from the replies. Bytes are those of every SecAgg+ message (:func:`content_bytes`), summed until
    the strategy writes a row (:meth:`take_bytes`)."""

    def __init__(self, strategy):
        self.s = strategy
        self.up = self.down = 0
        self.client_ms = 0.0  # the statistics exchange's mean client time (its row)
        self.exchanges: list = []  # one record per exchange (summary.json)
        self.check_memory()

    @property
    def dims(self) -> tuple[int, int]:
        return self.s.store.info.num_classes, self.s.store.test_x.shape[1]

    def check_memory(self) -> None:
        """Refuse, before round 1, an exchange whose masked vectors cannot fit in this server's memory: SecAgg+
        sums dense vectors (a closed-form head's Gram, CCVR's second moments of every class, where a plain node
        sends only the classes it holds), and the server receives one from each node of the exchange at once."""
        cfg, (C, D) = self.s.cfg, self.dims
        per_round = clients_per_round(cfg)
        needs = [("census", cfg.clients, census_layout(C, D, bool(cfg.center or cfg.scale != "none")), None)]
        if self.s.solver is not None:
            what = f"'--head' {cfg.head!r}" if cfg.head == self.s.solver.name else f"'--init' {cfg.init!r}"
            needs.append(
                (
                    "statistics",
                    per_round,
                    statistics_layout(C, D, self.s.solver.needs_gram),
                    (
                        what,
                        f"{D + 1}x{D + 1} Gram" if self.s.solver.needs_gram else f"{C}x{D} class sums",
                        "use a head without a Gram (ncm, lda) or fewer --clients / --participation",
                    ),
                )
            )
        if cfg.calibrate == "ccvr":
            needs.append(
                (
                    "ccvr",
                    cfg.clients,
                    ccvr_layout(C, D),
                    (
                        "'--calibrate' option 'ccvr'",
                        f"{C} classes x {D}-dim covariances",
                        "drop --calibrate ccvr, or run it without --secure-aggregation (each node then sends "
                        "only the classes it holds)",
                    ),
                )
            )
        free = devices.available_memory()
        for kind, nodes, layout, why in needs:
            per_node = layout.size * layout.fmt.limbs * 8  # int64 digits
            if per_node > 1e6:
                LOG.info("[fedhead] SecAgg+ %s: %.1f MB from each of %s nodes", kind, per_node / 1e6, nodes)
            if why is not None and free is not None and per_node * nodes > free:
                opt, size, fix = why
                raise FedheadError(
                    f"The {opt} with '--secure-aggregation' needs {_mb(per_node * nodes)} on the server for its "
                    f"masked {'class moments' if kind == 'ccvr' else kind} ({nodes} nodes x {_mb(per_node)}: "
                    f"{size}), but this machine has {_mb(free)} free. {fix[0].upper() + fix[1:]}, or run the server on a "
                    "machine with more memory."
                )

    def _run(self, grid, msgs: list, kind: str, layout: Layout, rnd: int) -> SecureSum:
        res = secure_sum(grid, msgs, kind, layout, rnd, self.s.settings.round_timeout)
        self.up += res.bytes_up
        self.down += res.bytes_down
        node_ms = float(np.mean(list(res.node_ms.values()))) if res.node_ms else 0.0
        self.exchanges.append(
            {
                "seed": int(self.s.seed),
                "round": int(rnd),
                "kind": kind,
                "nodes": len(msgs),
                "included": len(res.included),
                "shares": res.shares,
                "threshold": res.threshold,
                "restarts": res.restarts,
                "bytes_up": res.bytes_up,
                "bytes_down": res.bytes_down,
                "wall_s": res.wall_s,
                "server_s": res.server_s,
                "node_secagg_ms": node_ms,
                "halted": res.halted or "",
            }
        )
        LOG.log(
            WARNING if res.halted else INFO,
            "[fedhead] SecAgg+ %s (round %s): %s of %s nodes summed, %s shares, threshold %s, %.0f B up and "
            "%.0f B down per node, %.2f s%s",
            kind,
            rnd,
            len(res.included),
            len(msgs),
            "all" if isinstance(res.shares, float) else res.shares,
            res.threshold,
            res.bytes_up / max(1, len(msgs)),
            res.bytes_down / max(1, len(msgs)),
            res.wall_s,
            f": {res.halted}" if res.halted else "",
        )
        return res

    def take_bytes(self, clients: int, extra_down: int = 0) -> dict:
        """The row's bytes: every SecAgg+ message since the last row, plus ``extra_down`` sent outside it."""
        up, down = self.up, self.down
        self.up = self.down = 0
        return {"bytes_up_per_client": up / max(1, clients), "bytes_total": up + down + extra_down}

    def _everyone(self, res: SecureSum, what: str) -> dict:
        """The sums of an exchange that needs every node (the plain run's query needs them all too)."""
        pid_of = {n: p for p, n in self.s.node_of.items()}
        if res.halted or res.failed:
            why = res.halted or "; ".join(f"partition {pid_of.get(n, n)}: {r}" for n, r in sorted(res.failed.items()))
            raise FedheadError(f"The secure {what} needs every node, but {why}. Check the nodes and run again.")
        return res.sums

    def _query(self, pids: list, kind: str, want_stats: bool, closed_form: str, arrays: dict | None = None) -> list:
        s = self.s
        cr = ConfigRecord(
            {
                "train-config": s.cfg_json,
                "server-store": s.fingerprint,
                "seed": int(s.seed),
                "want-stats": bool(want_stats),
                "closed-form": closed_form,
                "round": 1,
            }
        )
        content = {"config": cr}
        if arrays:
            content["arrays"] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
        return [
            Message(RecordDict(content), dst_node_id=s.node_of[p], message_type=MessageType.TRAIN, group_id=kind)
            for p in pids
        ]

    def census(self, grid):
        """Before round 1, every node: the class counts, flipped labels and feature sums, summed. Returns the
        :class:`fedhead.federation.clients.FeatureStats` and the realised noise rate."""
        s, (C, D) = self.s, self.dims
        features = bool(s.cfg.center or s.cfg.scale != "none")
        pids = list(range(s.cfg.clients))
        res = self._run(grid, self._query(pids, "census", features, ""), "census", census_layout(C, D, features), 0)
        v = self._everyone(res, "census (class counts and feature statistics)")
        n = float(np.rint(v["n"]))
        K = len(pids)
        stats = (
            s.stats_from_sums(v["feature-sum"], float(v["feature-sq"]), n, res.bytes_up / K, res.bytes_down / K)
            if features
            else FeatureStats(None, 1.0, 0, 0)
        )
        return stats, (float(np.rint(v["flipped"])) / n if n else 0.0)

    def statistics(self, grid, pids: list):
        """The statistics exchange of a closed-form head / --init start over the round's clients: the accumulator
        the plain run builds, from the sums (cof: a second exchange for the spread of the class means)."""
        s, (C, D) = self.s, self.dims
        solver = s.solver
        res = self._run(
            grid,
            self._query(pids, "statistics", False, solver.name),
            "statistics",
            statistics_layout(C, D, solver.needs_gram),
            1,
        )
        v = self._everyone(res, "statistics exchange")
        acc = StatsAccumulator(C, D, gram=solver.needs_gram)
        acc.sums = torch.as_tensor(v["sums"], dtype=torch.float64)
        acc.counts = torch.as_tensor(np.rint(v["counts"]), dtype=torch.float64)
        if solver.needs_gram:
            acc.gram = torch.as_tensor(unpack_upper(v["gram"], D + 1), dtype=torch.float64)
        acc.clients, acc.bytes_up = len(res.included), res.bytes_up
        self.client_ms = float(v["ms"]) / max(1, len(pids))
        if solver.needs_client_means:  # cof: a_c needs the summed counts and holders first
            n_c, k_c = np.rint(v["counts"]), np.rint(v["holders"])
            acc.set_cof_weights(n_c, k_c)
            res2 = self._run(
                grid,
                self._query(pids, "cof-spread", False, solver.name, {"class-n": n_c, "class-k": k_c}),
                "cof-spread",
                spread_layout(D),
                1,
            )
            acc.spread = torch.as_tensor(
                unpack_upper(self._everyone(res2, "cof spread exchange")["spread"], D), dtype=torch.float64
            )
            acc.bytes_up += res2.bytes_up
        return acc

    def train_round(self, grid, rnd: int, msgs: list) -> None:
        """A training round: the rule's messages (and the rest of :func:`train_layout`) summed; the strategy's
        :meth:`_finish_round` does the rest as for a plain round. A protocol that stops fails the round."""
        s = self.s
        layout = train_layout(aggregator_of(s.cfg), s.theta, s.cfg.scaffold)
        res = self._run(grid, msgs, "train", layout, rnd)
        pid_of = {n: p for p, n in s.node_of.items()}
        for node, why in res.failed.items():
            s.last.failed[pid_of.get(node, node)] = why
        if res.sums is None:
            for m in msgs:  # no update of this round reaches the head
                s.last.failed[pid_of[m.metadata.dst_node_id]] = res.halted
            return
        v = res.sums
        if s.cfg.scaffold and np.rint(v["scaffold-lost"]) > 0:
            s.lost_variates = (
                f"{int(np.rint(v['scaffold-lost']))} node(s) no longer held their control variate "
                "(counted in the secure sum)"
            )
        trained = int(np.rint(v["trained"]))
        if trained == 0:
            return
        dev = s.device
        msg = {
            name[4:]: torch.as_tensor(v[name], dtype=torch.float64, device=dev)[None]
            for name, _ in layout.parts
            if name.startswith("msg.")
        }
        deltas = torch.as_tensor(v["scaffold-delta"], dtype=torch.float64)[None] if s.cfg.scaffold else None
        s._finish_round(
            rnd,
            msg,
            torch.as_tensor([float(np.rint(v["n"]))], device=dev),
            torch.as_tensor(np.rint(v["holds"]), device=dev)[None],
            trained,
            deltas,
            sorted(pid_of[n] for n in res.included),
            float(v["loss"]),
            [float(v["ms"]) / trained],
            time.perf_counter() - res.server_s,
        )

    def ccvr(self, grid, msgs: list, rnd: int, failed: dict):
        """CCVR's statistics as class moments summed over the nodes that answer (a lost node is a failure of the
        ``ccvr`` row, as in a plain run). Returns ``(pooled, answered pids, failed, bytes up, client ms)``."""
        s, (C, D) = self.s, self.dims
        pid_of = {n: p for p, n in s.node_of.items()}
        res = self._run(grid, msgs, "ccvr", ccvr_layout(C, D), rnd)
        for node, why in res.failed.items():
            failed[pid_of.get(node, node)] = why
        if res.sums is None:
            for m in msgs:
                failed[pid_of[m.metadata.dst_node_id]] = res.halted
            return PooledStats(C, D), {}, failed, 0, 0.0
        v = res.sums
        second = np.stack([unpack_upper(t, D) for t in v["second"]])
        return (
            PooledStats.from_moments(v["counts"], v["sums"], second),
            {pid_of[n]: None for n in res.included},
            failed,
            res.bytes_up,
            float(v["ms"]),
        )

    def summary(self) -> dict:
        """summary.json's ``secure_aggregation``: the protocol's parameters and every exchange."""
        return {
            "protocol": "SecAgg+ (flwr SecAggPlusWorkflow / secaggplus_mod)",
            "min_clients": MIN_CLIENTS,
            "threshold": "majority of each node's neighbourhood (all nodes up to "
            f"{COMPLETE_GRAPH_UP_TO}, then 2 ceil(2 log2 n) + 1)",
            "head_format": {
                "frac_bits": HEAD_FORMAT.frac_bits,
                "limbs": HEAD_FORMAT.limbs,
                "step": HEAD_FORMAT.step,
                "bound": HEAD_FORMAT.bound,
            },
            "stats_format": {
                "frac_bits": STATS_FORMAT.frac_bits,
                "limbs": STATS_FORMAT.limbs,
                "step": STATS_FORMAT.step,
                "bound": STATS_FORMAT.bound,
            },
            "modulus_range": MODULUS_RANGE,
            "exchanges": self.exchanges,
        }
