"""A SuperNode that runs only the apps its operator pinned (``fedhead flower supernode --app-sha256``).

Flower's own control, ``flower-supernode --trusted-entities``, accepts only FABs whose signatures come from Flower
Hub (the SuperLink fetches them with the FAB for ``flwr run @account/app``); a FAB built from a folder (``flwr run
./app``, which is how ``fedhead flower superlink`` submits fedhead) carries none, and such a node refuses every run.
So the node pins the FAB's content instead: this module starts Flower's SuperNode (``flower-supernode``'s own
entry point, the same arguments) with its FAB check replaced by "the sha256 of the FAB's bytes is one of the pinned
ones". The check runs where Flower checks trusted entities: when the node first receives a message of a run, before
the FAB is stored or any ClientApp starts; an unpinned FAB gets Flower's own refusal (an error reply, "The FAB could
not be verified.") and nothing of it runs. A Flower whose SuperNode lacks that check point refuses to start.

Run by ``fedhead flower supernode``: ``python -m fedhead.flower.pin --app-sha256 HEX [...] -- FLOWER-SUPERNODE-ARGS``;
nothing here imports torch."""

from __future__ import annotations

import hashlib
import inspect
import re
import sys

from fedhead.infra.errors import FedheadError

SHA256 = re.compile(r"[0-9a-f]{64}")
CHECK_POINT = "flwr.supernode.start_client_internal: _pull_and_store_message(get_fab=, trusted_entities=), _verify_fab"


def fab_sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def install(pins: frozenset[str]) -> None:
    """Replace the FAB check of Flower's SuperNode (this process) by the pin check of ``pins`` (hex sha256)."""
    from logging import ERROR, INFO

    import flwr.supernode.start_client_internal as sci
    from flwr.common.logger import log

    pull, verify = getattr(sci, "_pull_and_store_message", None), getattr(sci, "_verify_fab", None)
    params = set(inspect.signature(pull).parameters) if callable(pull) else set()
    if not callable(verify) or not {"get_fab", "trusted_entities"} <= params:
        from flwr.supercore.version import package_version

        raise FedheadError(
            f"The installed Flower {package_version} has no FAB check where fedhead pins the node's apps "
            f"({CHECK_POINT}). Install the Flower version of fedhead's pyproject.toml (pip install 'fedhead[flower]')."
        )
    shown = ", ".join(sorted(p[:12] for p in pins))

    def pinned_pull(*args, **kwargs):
        call = inspect.signature(pull).bind(*args, **kwargs)
        get_fab = call.arguments["get_fab"]

        def checked_fab(fab_hash: str, run_id: int):
            fab = get_fab(fab_hash, run_id)
            digest = fab_sha256(fab.content)
            if digest in pins:
                log(INFO, "fedhead: the app of run %s is pinned (FAB sha256 %s)", run_id, digest)
            else:
                log(ERROR, "fedhead: refused the app of run %s: its FAB sha256 %s is not pinned (--app-sha256 %s)",
                    run_id, digest, shown)  # fmt: skip
            fab.verifications = {"valid_license": "pinned by fedhead"}  # the check below is the pin's, not Hub's
            return fab

        call.arguments["get_fab"] = checked_fab
        call.arguments["trusted_entities"] = {"fedhead-pins": shown}  # Flower verifies when this is not empty
        return pull(*call.args, **call.kwargs)

    sci._pull_and_store_message = pinned_pull
    sci._verify_fab = lambda fab, trusted_entities: fab_sha256(fab.content) in pins


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    own, rest = argv[:cut], argv[cut + 1 :]
    pins = frozenset(own[i + 1] for i, a in enumerate(own[:-1]) if a == "--app-sha256")
    if not pins or not all(SHA256.fullmatch(p) for p in pins):
        raise SystemExit("usage: python -m fedhead.flower.pin --app-sha256 HEX [...] -- FLOWER-SUPERNODE-ARGS")
    try:
        install(pins)
    except FedheadError as exc:
        raise SystemExit(f"error: {exc}") from None
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()
