"""The fork server: ``python -u _zygote.py CTRL_FD OUT_FD ERR_FD PRELOAD_FILE``.

One per node and job. It imports the modules the job's workers import (PRELOAD_FILE,
followed as it grows), then forks each replacement worker on request, so a
replacement never pays the imports again. The child becomes the worker through the
same runner as every other Python worker (``_warm.py``).

Protocol on CTRL_FD (a Unix stream socket to the agent), one JSON object per line,
``"version": 1`` in each:

- agent -> server: ``{"op": "fork", "id": N, "until": T, "request": {...runner
  request...}}`` (``T``: ``time.monotonic()`` past which the request is not forked:
  the agent's wait for the answer ends soon after),
  ``{"op": "withdraw", "id": N}`` (the agent gave up waiting and started that worker
  fresh: a fork request not read yet is dropped; one already forked, the agent kills)
- server -> agent: ``{"event": "forked", "id": N, "pid": P}``,
  ``{"event": "refused", "id": N, "reason": "..."}`` (not fork-safe: the agent starts
  a fresh interpreter), ``{"event": "exited", "pid": P, "exitcode": C}`` (negative:
  killed by that signal, like ``Popen.returncode``), ``{"event": "ready", "modules": M}``,
  ``{"event": "dropped", "id": N}`` (a withdrawn request, or one read past its
  ``until``, not forked).

Fork safety is checked before every fork: no Python thread but the main one, no
native thread except thread pools that stop themselves on fork (OpenBLAS, started
by importing numpy), no socket but CTRL_FD, CUDA not initialized. The children are
the server's: it reaps them and reports their exit codes; they get SIGKILL when it
dies, and it gets SIGKILL when the agent dies.

This file runs by path, outside the relaunch package: it imports only ``_warm`` beside it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

import _warm  # type: ignore[import-not-found]  # beside this file, on sys.path[0] here

VERSION = 1


class _Child(Exception):
    """Raised in a forked child: run ``request`` from ``main()``, with a clean stack."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__()
        self.request = request


def _tasks() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


class Server:
    def __init__(self, ctrl: int, out_fd: int, err_fd: int, preload: str) -> None:
        self.ctrl = socket.socket(fileno=ctrl)
        self.ctrl.setblocking(True)
        self.out_fd, self.err_fd = out_fd, err_fd
        self.preload = preload
        self.buffer = b""
        self.imported: set[str] = set()
        self.tolerated_threads = 0
        self.unsafe: str | None = None
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        self.poller = select.poll()
        self.poller.register(self.ctrl.fileno(), select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.children: set[int] = set()
        self.withdrawn: set[object] = set()
        """Requests the agent gave up on before they were read: never forked."""
        self.pid = os.getpid()

    # -- messages -------------------------------------------------------------------
    def send(self, **message: Any) -> None:
        data = json.dumps({"version": VERSION, **message}).encode() + b"\n"
        with contextlib.suppress(OSError):
            self.ctrl.sendall(data)

    def requests(self, timeout: float) -> list[dict[str, Any]] | None:
        """Requests received within ``timeout`` (children reaped meanwhile); None at EOF."""
        # poll, not select: the agent's descriptors (and so this one) may be past 1,023
        ready = [fd for fd, _ in self.poller.poll(math.ceil(max(timeout, 0.0) * 1000))]
        if self.wake_r in ready:
            with contextlib.suppress(OSError):
                os.read(self.wake_r, 4096)
        self.reap()
        if self.ctrl.fileno() not in ready:
            return []
        try:
            chunk = self.ctrl.recv(1 << 20)
        except InterruptedError:
            return []
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        out = []
        for line in lines:
            with contextlib.suppress(ValueError, RecursionError):
                message = json.loads(line)
                if isinstance(message, dict) and message.get("version") == VERSION:
                    out.append(message)
        return out

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.send(event="exited", pid=pid, exitcode=os.waitstatus_to_exitcode(status))

    # -- preloading -------------------------------------------------------------------
    def preload_more(self) -> bool:
        """Import the listed modules not imported yet, answering requests between them.

        Returns False when the agent went away.
        """
        names = [
            n for n in _warm._contract.read_module_list(self.preload) if n not in self.imported
        ]
        if not names:
            return True
        t0 = time.monotonic()
        for name in names:
            self.imported.add(name)
            if name in sys.modules:
                continue
            before, had_numpy = _tasks(), "numpy" in sys.modules
            with contextlib.suppress(BaseException):
                importlib.import_module(name)
            started = _tasks() - before
            if started > 0:
                if not had_numpy and "numpy" in sys.modules:  # OpenBLAS's pool
                    self.tolerated_threads += started
                elif self.unsafe is None:
                    self.unsafe = f"importing {name} started {started} thread(s)"
            if not self.serve(0.0):
                return False
        self.send(event="ready", modules=len(self.imported))
        print(f"imported {len(names)} modules in {time.monotonic() - t0:.2f} s", flush=True)
        return True

    # -- forking ----------------------------------------------------------------------
    def fork_safety(self) -> str | None:
        """Why forking now would be unsafe, or None."""
        if self.unsafe:
            return self.unsafe
        if threading.active_count() > 1:
            names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
            return f"Python threads are running: {', '.join(names)}"
        extra = _tasks() - 1 - self.tolerated_threads
        if extra > 0:
            return f"{extra} native thread(s) running"
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if int(fd) != self.ctrl.fileno() and os.readlink(f"/proc/self/fd/{fd}").startswith(
                    "socket:"
                ):
                    return f"a socket is open (fd {fd})"
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        with contextlib.suppress(Exception):
            if cuda is not None and cuda.is_initialized():
                return "CUDA is initialized"
        return None

    def serve(self, timeout: float) -> bool:
        """Handle the requests that arrive within ``timeout``. False when the agent left."""
        requests = self.requests(timeout)
        if requests is None:
            return False
        # (an id that is not an int cannot be the agent's: such a message is dropped)
        requests = [m for m in requests if isinstance(m.get("id"), int)]
        self.withdrawn.update(m.get("id") for m in requests if m.get("op") == "withdraw")
        for message in requests:
            if message.get("op") != "fork" or not isinstance(message.get("request"), dict):
                continue
            until = message.get("until")
            late = isinstance(until, (int, float)) and time.monotonic() > until
            if message.get("id") in self.withdrawn or late:  # its worker starts fresh
                self.withdrawn.discard(message.get("id"))
                self.send(event="dropped", id=message.get("id"))
                continue
            reason = self.fork_safety()
            if reason is not None:
                self.send(event="refused", id=message.get("id"), reason=reason)
                continue
            t0 = time.monotonic()
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                self.become_child(message["request"])  # never returns
            self.children.add(pid)
            self.send(event="forked", id=message.get("id"), pid=pid)
            print(f"forked {pid} in {time.monotonic() - t0:.3f} s", flush=True)
        return True

    def become_child(self, request: dict[str, Any]) -> None:
        """Leave the server in the forked child: raises _Child (or exits on failure)."""
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            # The server may have died since fork(): compare with its pid from before.
            if not _warm.set_parent_death_signal() or os.getppid() != self.pid:
                os._exit(1)  # it could outlive the server (and the agent): never run it
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.ctrl.close()
            os.dup2(self.out_fd, 1)
            os.dup2(self.err_fd, 2)
            os.close(self.out_fd)
            os.close(self.err_fd)
            gc.enable()
        except BaseException:
            os._exit(1)
        raise _Child(request)

    def run(self) -> None:
        seen = -1.0
        while True:
            with contextlib.suppress(OSError):
                mtime = os.stat(self.preload).st_mtime
                if mtime != seen:
                    seen = mtime
                    if not self.preload_more():
                        return
            if not self.serve(1.0):
                return


def main() -> None:
    del sys.path[0]  # this file's directory: workers get their own sys.path[0]
    ctrl, out_fd, err_fd = (int(a) for a in sys.argv[1:4])
    preload = sys.argv[4]
    sys.argv = sys.argv[:1]
    gc.disable()  # no holes in shared pages; children enable it (see gc.freeze's docs)
    try:
        Server(ctrl, out_fd, err_fd, preload).run()
    except _Child as child:
        request = child.request
    else:
        return
    # A forked child: the server is gone from the stack; run and exit like `python script.py`.
    _warm.run_request(request)


if __name__ == "__main__":
    main()
