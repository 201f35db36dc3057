"""fedhead's ServerApp strategy and ClientApp in one process, without Ray or sockets: a synchronous Grid that
hands each message to the ClientApp of its node, optionally through Flower's wire format (every message and
reply serialised and parsed, so sizes and contents are what a network would carry).

The test suite runs the fault and parity cases on it (seconds, not a Ray start-up); ``fedhead bench privacy``
measures SecAgg+'s bytes and compute on it (no network latency: say so where its times are shown).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from fedhead.flower.common import require_flower

require_flower()

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from fedhead.flower.client_app import make_client_app
from fedhead.flower.server_app import run_server
from fedhead.flower.strategy import ServerSettings


class InProcessGrid(Grid):
    """Delivers each message to the ClientApp of its node synchronously; an exception becomes an error reply
    with Flower's own reason format, as the SuperNode runtime makes it. ``wire``: serialise and parse every
    message and reply (Flower's protobuf), as a network would. ``push_messages`` answers at once too, and
    ``pull_messages`` hands a reply out only after ``slow[node]`` pulls that asked for it (slow nodes, counted in
    pulls: no wall clock)."""

    def __init__(
        self, app, node_configs: list[dict], run_config: dict | None = None, wire: bool = False,
        slow: dict | None = None,
    ):  # fmt: skip
        self.app, self.wire, self.slow = app, wire, dict(slow or {})
        self.pushed: dict = {}  # message id -> [reply, pulls still to wait]
        self.count = 0
        self.ctx = {
            1000 + i: Context(
                run_id=1, node_id=1000 + i, node_config=nc, state=RecordDict(), run_config=run_config or {}
            )
            for i, nc in enumerate(node_configs)
        }

    def set_run(self, run_id):
        pass

    @property
    def run(self):
        return None

    def create_message(self, *a, **k):
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.ctx)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            self.count += 1
            mid = f"pushed-{self.count}"
            m.metadata.__dict__["_message_id"] = mid  # as Flower's in-memory grid names a pushed message
            reply = self._answer(m)
            reply.metadata.__dict__["_reply_to_message_id"] = mid  # the reply names the message it answers
            self.pushed[mid] = [reply, self.slow.get(m.metadata.dst_node_id, 0)]
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        out = []
        for mid in message_ids:
            entry = self.pushed.get(mid)
            if entry is None:
                continue
            if entry[1] > 0:
                entry[1] -= 1
                continue
            out.append(self.pushed.pop(mid)[0])
        return out

    def send_and_receive(self, messages, *, timeout=None):
        return [self._answer(m) for m in messages]

    def _answer(self, m):
        """The node's reply to ``m`` (an exception: an error reply)."""
        if self.wire:
            m = Message(
                recorddict_from_proto(recorddict_to_proto(m.content)),
                dst_node_id=m.metadata.dst_node_id,
                message_type=m.metadata.message_type,
                group_id=m.metadata.group_id,
            )
        try:
            r = self.app(m, self.ctx[m.metadata.dst_node_id])
            if self.wire and not r.has_error():
                r = Message(recorddict_from_proto(recorddict_to_proto(r.content)), reply_to=m)
            return r
        except Exception as ex:  # noqa: BLE001
            return Message(Error(code=1, reason=str(type(ex)) + ":<'" + str(ex) + "'>"), reply_to=m)


@contextlib.contextmanager
def task_identity():
    """Flower's Message constructor reads the process's task identity (a SuperLink sets it; so does this)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = 1, 1, 1
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def sim_nodes(k: int) -> list[dict]:
    return [{"partition-id": i, "num-partitions": k} for i in range(k)]


def run_in_process(cfg, out: str | Path, *, wire: bool = True, wait_timeout: float = 5.0):
    """Run ``cfg`` with fedhead's ServerApp strategy and ``cfg.clients`` ClientApp nodes in this process (each
    node reads the server's store and takes its partition, as ``flower simulate`` does); the run directory goes
    to ``out``. Returns the strategy's outcome."""
    with task_identity():
        grid = InProcessGrid(make_client_app(str(cfg.features)), sim_nodes(cfg.clients), wire=wire)
        return run_server(grid, cfg, ServerSettings(out=str(out), wait_timeout=wait_timeout))
