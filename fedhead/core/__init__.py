"""The pure pieces of federated head training, each usable alone: heads and their losses, closed-form solves,
the local-training engine, aggregation rules, server optimisers, partitions, label noise, differential privacy,
CCVR and the central reference. Nothing here reads a run directory or talks to a client."""

# Every built-in head is registered once this package is imported: the iterative heads (fedhead.core.heads) and the
# closed-form ones (fedhead.core.closedform, which builds on heads, and fedhead.core.moments), whichever module of the package comes first.
# The compressed-update aggregation rules (fedhead.core.compress) register themselves the same way.
from fedhead.core import closedform, compress, moments  # noqa: E402,F401
