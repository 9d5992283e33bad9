"""The node's fork server, as the agent runs it: when to start it, its events, its end."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from relaunch.procs import ForkServer

__all__ = ["NodeForkServer"]

log = logging.getLogger(__name__)


class NodeForkServer:
    """Starts one fork server per job (once the workers told what they import, or after
    30 s, and ``delay`` seconds after they started), announces it ready, and drops it for
    good when it refuses to fork. Owned by the agent until :meth:`close`."""

    def __init__(
        self, *, modules_file: str, log_dir: str, delay: float, emit: Callable[..., None]
    ) -> None:
        self.modules_file = modules_file
        self._log_file = os.path.join(log_dir, "fork_server.log")
        self._delay = delay
        self._emit = emit
        self._server: ForkServer | None = None
        self._refused: str | None = None
        self._ready = False

    def usable(self) -> ForkServer | None:
        """The server to fork this attempt's workers from, if one runs."""
        server = self._server
        return server if server is not None and server.alive() else None

    def tick(self, *, wanted: bool, running_for: float, env: Mapping[str, str]) -> None:
        """Called while the workers run: start the server when due; say when it is ready."""
        server = self._server
        if server is not None:
            if not self._ready:
                server.pump(0.0)
                if server.ready:
                    self._ready = True
                    self._emit("fork_server_ready", pid=server.pid)
            return
        if not wanted or self._refused is not None or running_for < self._delay:
            return
        # Wait until the workers told us what they import (or for long enough), so the
        # server preloads exactly that, and does not compete with the workers' own start.
        if not os.path.exists(self.modules_file) and running_for < 30.0:
            return
        self._server = ForkServer(env=env, preload_file=self.modules_file, log_file=self._log_file)
        self._emit("fork_server_started", pid=self._server.pid)

    def refused(self, reason: str) -> None:
        """The server would not fork: workers start fresh from now on."""
        self._refused = reason
        log.warning(
            "the fork server cannot fork workers (%s): starting fresh interpreters from now on",
            reason,
        )
        self._emit("fork_server_refused", reason=reason)
        self.close()

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
