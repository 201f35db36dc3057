"""The fedhead ServerApp: runs :class:`~fedhead.flower.strategy.FedheadStrategy` over the Grid.

``app`` (registered in pyproject ``[tool.flwr.app.components]``) reads its configuration from the Flower run
config (``[tool.flwr.app.config]`` plus ``flwr run -c`` overrides; see :mod:`fedhead.flower.common`).
:func:`make_server_app` builds one from a :class:`fedhead.federation.config.TrainConfig` (``fedhead flower simulate``).
"""

from __future__ import annotations

import time

from fedhead.flower.common import require_flower

require_flower()

from flwr.app import Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from extract.store import Features, load_store  # noqa: E402
from fedhead.federation.config import TrainConfig  # noqa: E402
from fedhead.federation.experiment import RUN_OPTIONS
from fedhead.flower.common import canonical_run_config, config_from_run_config  # noqa: E402
from fedhead.flower.strategy import FedheadStrategy, RunOutcome, ServerSettings, validate_server_config  # noqa: E402
from fedhead.infra.errors import cli_names  # noqa: E402


def settings_from_run_config(rc: dict) -> ServerSettings:
    """The server's run options from the run config (renamed keys read as their new names; the table's defaults)."""
    rc = canonical_run_config(rc)

    def value(name: str):
        given = rc.get(RUN_OPTIONS[name].key, "")
        return RUN_OPTIONS[name].default if given in ("", None) else given

    return ServerSettings(out=str(value("out") or "") or None, resume=bool(value("resume")),
                          round_timeout=float(value("round_timeout")), wait_timeout=float(value("wait_timeout")))  # fmt: skip


class PromptGrid:
    """A deployed SuperLink's Grid whose ``send_and_receive`` looks for replies ``FIRST`` seconds after sending, then
    ever less often (x1.5, at most ``LAST`` s apart; back to ``FIRST`` when replies come), where Flower's looks every
    3 s: a round's messages wait 1.5 s less on average for the server to notice their replies, and a SecAgg+ exchange
    has four such waits. Everything else is the wrapped Grid's."""

    FIRST, LAST = 0.05, 1.0

    def __init__(self, grid: Grid):
        self._grid = grid

    def __getattr__(self, name: str):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list:
        waiting = set(self._grid.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        replies: list = []
        pause = self.FIRST
        while waiting:
            got = list(self._grid.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            left = None if end is None else end - time.monotonic()
            if not waiting or (left is not None and left <= 0):
                break
            pause = self.FIRST if got else min(pause * 1.5, self.LAST)
            time.sleep(pause if left is None else min(pause, left))
        return replies


def run_server(grid: Grid, cfg: TrainConfig, settings: ServerSettings, store: Features | None = None) -> RunOutcome:
    """Validate ``cfg`` against the server's store (loaded here unless given) and run the strategy. Its errors name
    the options as fedhead's commands do (``--calibrate``; the run-config key is the flag without ``--``)."""
    with cli_names():
        store = store if store is not None else load_store(cfg.features, param="features")
        cfg = validate_server_config(cfg, store)
        return FedheadStrategy(cfg, store, settings).start(grid)


def make_server_app(
    cfg: TrainConfig, settings: ServerSettings, results: list | None = None, store: Features | None = None
) -> ServerApp:
    """A ServerApp for a fixed configuration; the outcome is appended to ``results`` (same process).
    ``store``: the server's store if the caller loaded it already (``fedhead flower simulate``)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            out = run_server(grid, cfg, settings, store)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
            if results is None:
                raise
            results.append(exc)
            return
        if results is not None:
            results.append(out)

    return app


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = dict(context.run_config)
    run_server(PromptGrid(grid), config_from_run_config(rc), settings_from_run_config(rc))
