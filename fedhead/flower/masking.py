"""The node side of SecAgg+ that needs no torch: which train messages belong to a secure exchange, and the mod that
masks their replies (Flower's :func:`flwr.client.mod.secaggplus_mod`, timed). :mod:`fedhead.flower.client_app`
applies it; the protocol itself (formats, layouts, the server's workflow) is :mod:`fedhead.flower.secure`."""

from __future__ import annotations

import time

from fedhead.flower import require_flower

require_flower()

from flwr.app import Context, Message, MessageType, MetricRecord  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS  # noqa: E402

METRICS = "fedhead.secagg"  # reply metric record: the node's SecAgg+ compute time (ms)


def is_secure(msg: Message) -> bool:
    return RECORD_KEY_CONFIGS in msg.content.config_records


def secure_mod(msg: Message, ctxt: Context, call_next) -> Message:
    """Flower's :func:`secaggplus_mod` for the messages of a secure exchange (they carry its configuration); any
    other message goes straight to the handler. Adds the node's SecAgg+ compute time (keys, shares, masks; the
    handler's own time excluded) to the reply as metric record :data:`METRICS`."""
    if msg.metadata.message_type != MessageType.TRAIN or not is_secure(msg):
        return call_next(msg, ctxt)
    inner = [0.0]

    def timed(m, c):
        t = time.perf_counter()
        try:
            return call_next(m, c)
        finally:
            inner[0] += time.perf_counter() - t

    t0 = time.perf_counter()
    out = secaggplus_mod(msg, ctxt, timed)
    if not out.has_error():
        out.content.metric_records[METRICS] = MetricRecord({"ms": 1000 * (time.perf_counter() - t0 - inner[0])})
    return out
