"""The fedhead ClientApp: local training of the head on the node's own feature store.

Node config (``flower-supernode --node-config``; Flower's simulation sets the last two itself):

``feature-store``   path of this node's HDF5 feature store (written by ``fedhead extract`` on its own images)
``partition-id``    this node's client id (the server samples participation by it)
``num-partitions``  optional: the store is shared and this node takes slice ``partition-id`` of
                    ``num-partitions``, made with the same partitioner, seed and label noise as
                    ``fedhead train`` (:func:`fedhead.federation.clients.build_federation`). Without it the node's whole
                    training split is its local data.
``device``          optional: auto | cpu | cuda (default auto)
``state-dir``       optional: a folder where the node also keeps its SCAFFOLD variates on disk, so that a server
                    resumed in a new Flower run finds them (``fedhead flower supernode --state-dir``); in
                    Flower's simulation (no ``feature-store`` in the node config) it is ``<run-dir>/node-state``
                    (:data:`NODE_STATE`)
``delay``           optional: seconds each train reply waits before it leaves (``fedhead flower supernode --delay``):
                    a slow node for tests and benches (``fedhead bench deploy --async``), never a production setting

Flower starts one ClientApp process per message on a deployed SuperNode. This module is what that process loads:
it imports Flower and nothing of torch; the handlers' work (:mod:`fedhead.flower.node`: the store, the engine)
is imported when a message needs it, so the stages of a SecAgg+ exchange that only set up keys, share them and
unmask start in a fraction of the time.
"""

from __future__ import annotations

from fedhead.flower import require_flower

require_flower()

from flwr.app import Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedhead.flower.masking import is_secure, secure_mod  # noqa: E402
from fedhead.infra.errors import FedheadError  # noqa: E402


def _fedhead_errors(fn):
    """Mark fedhead's own one-line errors so the server can quote them cleanly: ``[[message]]``."""

    def wrapper(msg: Message, context: Context) -> Message:
        try:
            from fedhead.flower.node import load_plugins  # the handlers' module: every handler imports it

            load_plugins()  # FEDHEAD_PLUGINS in this node's process, before the handler's module is used
            return fn(msg, context)
        except FedheadError as exc:
            if str(exc).startswith("[["):  # marked already (a handler called by another)
                raise
            raise FedheadError(f"[[{exc}]]") from None

    wrapper.__name__ = fn.__name__
    return wrapper


def make_client_app(default_store: str | None = None, default_state_dir: str | None = None) -> "ClientApp":
    """A ClientApp; ``default_store`` and ``default_state_dir`` are used by nodes whose node config names no store
    (simulation; the run config's ``run-dir`` names the state folder first)."""
    app = ClientApp()

    @app.query()
    @_fedhead_errors
    def hello(msg: Message, context: Context) -> Message:
        from fedhead.flower.node import hello as handle  # torch and the engine: on the first message that needs them

        return handle(msg, context, default_store, default_state_dir)

    @app.query("ccvr")
    @_fedhead_errors
    def ccvr(msg: Message, context: Context) -> Message:
        from fedhead.flower.node import ccvr as handle

        return handle(msg, context, default_store, default_state_dir)

    @app.query("validate")
    @_fedhead_errors
    def validate(msg: Message, context: Context) -> Message:
        from fedhead.flower.node import validate as handle

        return handle(msg, context, default_store, default_state_dir)

    @app.query("personalize")
    @_fedhead_errors
    def personalize(msg: Message, context: Context) -> Message:
        from fedhead.flower.node import personalize as handle

        return handle(msg, context, default_store, default_state_dir)

    @app.train(mods=[secure_mod])
    @_fedhead_errors
    def train(msg: Message, context: Context) -> Message:
        if is_secure(msg):  # a SecAgg+ exchange: the plain handler's numbers, masked
            from fedhead.flower.node import secure_exchange

            return secure_exchange(
                msg,
                context,
                {"train": plain_train, "census": hello, "statistics": hello, "cof-spread": hello, "ccvr": ccvr},
                default_store,
            )
        return plain_train(msg, context)

    def plain_train(msg: Message, context: Context) -> Message:
        from fedhead.flower.node import plain_train as handle

        return handle(msg, context, default_store, default_state_dir)

    return app


# ``flwr run`` / ``flower-supernode`` load this object ([tool.flwr.app.components] clientapp).
app = make_client_app()
