"""Real federation on Flower (the optional ``fedhead[flower]`` extra).

- :mod:`fedhead.flower.client_app`  the ClientApp: opens the node's own feature store, trains the head locally
  with the simulator's engine (``Engine.train_block``), returns the head, its size and its class holds. It
  imports no torch: its handlers' work is :mod:`fedhead.flower.node`, imported on a message's first need.
- :mod:`fedhead.flower.server_app`  the ServerApp: a :class:`~fedhead.flower.strategy.FedheadStrategy` that
  aggregates with fedhead's own aggregators, samples clients with fedhead's seeded generator, evaluates
  centrally, writes the same run directory as ``fedhead train``, checkpoints and resumes.
- :mod:`fedhead.flower.commands`    ``fedhead flower simulate|superlink`` and ``fedhead bench flower``.
- :mod:`fedhead.flower.launch`      ``fedhead flower supernode``, the environment of Flower's processes and the
  checks of TLS certificates and SuperNode keys; it imports no torch, so a SuperNode's start does not pay for it.

This package's ``__init__``, ``commands`` and ``launch`` do not import ``flwr``, so the core CLI works without the
extra; everything that needs Flower calls :func:`require_flower` first, which gives
the one-line ``pip install 'fedhead[flower]'`` error when it is missing.
"""

from fedhead.infra.errors import FedheadError

INSTALL_HINT = "pip install 'fedhead[flower]'"


def require_flower():
    """Import flwr or fail with the one-line install hint."""
    try:
        import flwr  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "flwr":
            raise FedheadError(f"Flower is not installed. Install the extra: {INSTALL_HINT}") from None
        raise
    return flwr
