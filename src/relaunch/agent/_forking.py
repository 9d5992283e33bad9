"""The node's fork server, as the agent runs it: when to start it, its events, its end."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import re
import sysconfig
from collections.abc import Mapping

from relaunch._contract import read_module_list
from relaunch._json import loads as json_loads
from relaunch.events import Emit, ForkServerReady, ForkServerRefused, ForkServerStarted
from relaunch.procs import Entrypoint, ForkServer

__all__ = ["NodeForkServer", "decode_modules", "encode_modules", "guess_imports"]

_MODULES_VERSION = 1
_MAX_MODULES = 20_000
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

log = logging.getLogger(__name__)


class NodeForkServer:
    """Starts one fork server per job (once the workers told what they import, or after
    30 s, and ``delay`` seconds after they started), announces it ready, and drops it for
    good when it refuses to fork. Owned by the agent until :meth:`close`."""

    def __init__(self, *, modules_file: str, log_dir: str, delay: float, emit: Emit) -> None:
        self.modules_file = modules_file
        self._log_file = os.path.join(log_dir, "fork_server.log")
        self._delay = delay
        self._emit = emit
        self._server: ForkServer | None = None
        self._refused: str | None = None
        self._ready = False
        self._retired: ForkServer | None = None
        """A server that refused a fork: kept until the workers it forked are stopped
        (they die with it: its forked children have it as their parent-death parent)."""

    def usable(self) -> ForkServer | None:
        """The server to fork this attempt's workers from, if one runs."""
        server = self._server
        return server if server is not None and server.alive() else None

    def tick(self, *, wanted: bool, running_for: float, env: Mapping[str, str]) -> None:
        """Called while the workers run: start the server when due; say when it is ready."""
        server = self._server
        if server is not None:
            if not self._ready or server.busy:  # (busy: a late fork is killed at once)
                server.pump(0.0)
            if not self._ready and server.ready:
                self._ready = True
                self._emit(ForkServerReady(pid=server.pid))
            return
        if not wanted or self._refused is not None or running_for < self._delay:
            return
        # Wait until the workers told us what they import (or for long enough), so the
        # server preloads exactly that, and does not compete with the workers' own start.
        if not os.path.exists(self.modules_file) and running_for < 30.0:
            return
        try:
            self._server = ForkServer(
                env=env, preload_file=self.modules_file, log_file=self._log_file
            )
        except OSError as exc:  # (no descriptor left, say): the workers start fresh
            self.refused(f"it could not be started: {exc}")
            return
        self._emit(ForkServerStarted(pid=self._server.pid))

    @property
    def started(self) -> bool:
        """Whether the server was started (or refused for good)."""
        return self._server is not None or self._refused is not None

    def prewarm(self, *, env: Mapping[str, str], modules: list[str]) -> None:
        """Start the server before any worker ran (a spare waiting for a node to replace),
        preloading ``modules`` (what the other nodes' workers import, or a guess); a
        running one preloads those it did not have yet. The first workers' own list of
        imports replaces them."""
        if self._refused is not None:
            return
        self.add_modules(modules)
        if self._server is None:
            self._server = ForkServer(
                env=env, preload_file=self.modules_file, log_file=self._log_file
            )
            self._emit(ForkServerStarted(pid=self._server.pid, prewarm=True))

    def add_modules(self, modules: list[str]) -> None:
        """Add to the list the server preloads (and replacements import before joining)."""
        known = set(read_module_list(self.modules_file))
        fresh = [m for m in modules if m not in known]
        if fresh:
            with open(self.modules_file, "a") as f:
                f.write("".join(f"{m}\n" for m in fresh))

    def modules(self) -> list[str] | None:
        """What the workers import, once the server was started from their own list."""
        if self._server is None or not os.path.exists(self.modules_file):
            return None
        return read_module_list(self.modules_file)

    def refused(self, reason: str) -> None:
        """The server would not fork: workers start fresh from now on."""
        self._refused = reason
        log.warning(
            "the fork server cannot fork workers (%s): starting fresh interpreters from now on",
            reason,
        )
        self._emit(ForkServerRefused(reason=reason))
        self._retired, self._server = self._server, None

    def workers_stopped(self) -> None:
        """The attempt's workers were stopped: a server that refused a fork may go now."""
        retired, self._retired = self._retired, None
        if retired is not None:
            retired.close()

    def close(self) -> None:
        self.workers_stopped()
        server, self._server = self._server, None
        if server is not None:
            server.close()


def _installed(name: str, roots: tuple[str, ...]) -> bool:
    """Whether top-level module ``name`` is installed (stdlib or site-packages), found
    without importing anything: a user's own module may do work when imported."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) if spec is not None else None
    return isinstance(origin, str) and os.path.realpath(origin).startswith(roots)


def guess_imports(entrypoint: Entrypoint) -> list[str]:
    """The installed modules a script imports (parsed, not run), and torch: what a fork
    server started before any worker preloads."""
    names: list[str] = []
    if entrypoint.kind == "script":
        try:
            with open(entrypoint.target, "rb") as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError):
            tree = ast.Module(body=[], type_ignores=[])
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.append(node.module)
    paths = sysconfig.get_paths()
    roots = tuple(
        os.path.join(os.path.realpath(paths[k]), "")
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
        if k in paths
    )
    found = [n for n in dict.fromkeys([*names, "torch", "torch.distributed"])
             if _installed(n.partition(".")[0], roots)]  # fmt: skip
    if any(n.startswith("relaunch") for n in names):
        found.append("relaunch.inprocess")  # ours, wherever it is installed
    return found


def encode_modules(names: list[str]) -> bytes:
    """What a node's workers import, as shared with the other nodes (versioned JSON)."""
    valid = [n for n in names if _MODULE_NAME.fullmatch(n)][:_MAX_MODULES]
    return json.dumps({"version": _MODULES_VERSION, "modules": valid}).encode()


def decode_modules(raw: bytes | None) -> list[str]:
    """The module names of :func:`encode_modules`' document; [] for anything else (a
    spare then preloads its guess only)."""
    if not raw or len(raw) > 2 * 1024 * 1024:
        return []
    try:
        doc = json_loads(raw)
    except ValueError:
        return []
    if not isinstance(doc, dict) or doc.get("version") != _MODULES_VERSION:
        return []
    names = doc.get("modules")
    if not isinstance(names, list):
        return []
    return [n for n in names[:_MAX_MODULES] if isinstance(n, str) and _MODULE_NAME.fullmatch(n)]
