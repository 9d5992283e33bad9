"""The agent's side of the fork server (``_zygote.py``): replacement workers in milliseconds."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from relaunch._children import track
from relaunch._json import loads as json_loads
from relaunch.procs._lines import LineSender, ready
from relaunch.procs._sys import child_preexec

__all__ = ["ForkServer", "ForkedProcess", "NotForked"]

log = logging.getLogger(__name__)

_ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zygote.py")
_VERSION = 1
FORK_TIMEOUT = 15.0
"""How long a fork waits for the server's answer. It answers between imports only (a
new module list, a cold file system): a worker not answered for by then starts fresh,
which an import that slow would cost anyway, and the agent looks at its workers again."""


def _message(line: bytes) -> dict[str, Any] | None:
    """One line the server wrote, or None (said once) when it is not one of its messages."""
    try:
        message = json_loads(line)
    except ValueError:
        log.warning("fork server: unreadable message %r", line[:200])
        return None
    if not isinstance(message, dict) or message.get("version") != _VERSION:
        log.warning("fork server: unexpected message %r", line[:200])
        return None
    return message


@dataclass(frozen=True)
class NotForked:
    """Why the server did not fork a worker (which then starts fresh)."""

    reason: str
    lasting: bool
    """The server will refuse every fork (it is not fork-safe, or it is gone); else
    it was busy importing and did not answer in time (its next fork may succeed)."""


class ForkedProcess:
    """A worker forked by the fork server: the parts of ``Popen`` the agent uses.

    Its exit code comes from the server, which reaps it (the process is the server's
    child, not ours).
    """

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def exit_fd(self) -> int | None:
        """What becomes readable when it exits: the server's socket (None: it is gone)."""
        return self._server.fileno()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.pump(0.0)
            self.returncode = self._server.exitcode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            self._server.pump(0.05 if left is None else min(0.05, left))
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """One fork server per node and job, owned by the agent until :meth:`close`.

    It preloads the modules listed in ``preload_file`` (and those added later), and
    forks replacement workers on :meth:`fork`. Its own output goes to ``log_file``;
    the workers it forks write to the agent's stdout/stderr unless redirected.
    """

    answer_timeout: float = FORK_TIMEOUT
    """Seconds a fork waits for the server's answer (a test may shorten it)."""
    answer_margin: float = 0.1
    """The share of ``answer_timeout`` before its end past which the server forks
    nothing: what it forks, it answers while the fork still waits."""

    def __init__(self, *, env: Mapping[str, str], preload_file: str, log_file: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        self._lines = LineSender(ours)
        """Sends with a deadline: a server that reads nothing (hung) never blocks us."""
        self._buffer = b""
        self._exits: dict[int, int] = {}
        self._replies: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        self._withdrawn: set[int] = set()
        """Requests given up on (unanswered in time): a late fork is killed at once."""
        self._dead = False
        self.ready = False
        self._log_file = log_file
        opened: list[int] = []  # (each closed here once the server has its own)
        try:
            opened.append(os.dup(1))
            opened.append(os.dup(2))
            opened.append(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
            out, err, log_fd = opened
            fds = (theirs.fileno(), out, err)
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-u", _ZYGOTE, *(str(fd) for fd in fds), preload_file],
                env=dict(env),
                stdout=log_fd,
                stderr=log_fd,
                pass_fds=fds,
                start_new_session=True,
                preexec_fn=child_preexec(),
            )
            track(self._proc)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            for fd in opened:
                os.close(fd)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return not self._dead and self._proc is not None and self._proc.poll() is None

    def fileno(self) -> int | None:
        """The control socket: readable when the server says something (a forked
        worker's exit), drained by :meth:`pump`; None once the server is gone."""
        return None if self._dead else self._sock.fileno()

    # -- messages -----------------------------------------------------------------
    def pump(self, timeout: float) -> None:
        """Read what the server said within ``timeout`` seconds (exit codes, replies)."""
        if self._dead:
            return
        if not ready(self._sock, select.POLLIN, timeout):
            return
        try:
            chunk = self._sock.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._on_death()
            return
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        late = []
        for message in filter(None, map(_message, lines)):  # in the order they were said
            event, pid = message.get("event"), message.get("pid")
            if event == "exited" and isinstance(pid, int):
                code = message.get("exitcode")
                self._exits[pid] = code if isinstance(code, int) else 1
            elif event in ("forked", "refused", "dropped") and isinstance(message.get("id"), int):
                if event == "forked" and isinstance(pid, int):
                    self._exits.pop(pid, None)  # an earlier process's, of a pid used again
                if message["id"] in self._withdrawn:
                    late.append(message)
                else:
                    self._replies[message["id"]] = message
            elif event == "ready":
                self.ready = True
        for message in late:  # after the batch's exits: one that exited is not killed
            self._late(message)

    @property
    def busy(self) -> bool:
        """Whether requests given up on are still unread by the server (it is importing,
        or hung in an import): a fork now would wait in vain, and fill its socket."""
        return bool(self._withdrawn)

    def _late(self, reply: dict[str, Any]) -> None:
        """The server's answer to a withdrawn request (it is not busy with it any more)."""
        self._withdrawn.discard(reply["id"])
        self._kill_late(reply)

    def _kill_late(self, reply: dict[str, Any]) -> None:
        """A fork no caller took (given up on, or the wait interrupted): its worker
        started fresh, or will not start, so this process would be a second worker of
        its rank. Killed, with anything it started (it leads a session of its own once
        it runs)."""
        pid = reply.get("pid")
        if reply.get("event") != "forked" or not isinstance(pid, int) or pid <= 0:
            return
        if pid in self._exits:  # gone already, reaped: the pid may be another's by now
            return
        log.warning("fork server: worker %s was forked after the agent gave up; killed", pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:  # not yet the leader of its session: itself
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        except PermissionError:
            pass

    def _send(self, messages: list[dict[str, Any]], deadline: float) -> list[bool]:
        """Send ``messages``; for each, whether the server reads it whole (none when it
        is gone)."""
        lines = [json.dumps({"version": _VERSION, **m}).encode() + b"\n" for m in messages]
        try:
            return self._lines.send(lines, deadline)
        except OSError:  # (its end of the socket closed: it died)
            if not self._dead:
                self._on_death()
            return [False] * len(lines)

    def _withdraw(self, ids: list[int]) -> None:
        """Give up on these requests, which the server has whole and has not answered:
        it drops those it has not read yet (and says so), and :meth:`pump` kills what it
        forked for the others. Busy until it answered for each."""
        self._withdrawn.update(ids)
        self._send([{"op": "withdraw", "id": i} for i in ids], time.monotonic() + 1.0)

    def _on_death(self) -> None:
        """The server died: its children got SIGKILL and were reparented to us (subreaper)."""
        self._dead = True
        tail = self.log_tail().strip()
        log.warning(
            "the fork server (pid %s) exited; its workers were killed; workers start fresh "
            "from now on.%s",
            self.pid,
            f" Its last output:\n{tail}" if tail else "",
        )

    def exitcode(self, pid: int) -> int | None:
        code = self._exits.get(pid)
        if code is not None or not self._dead:
            return code
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            got, status = pid, -1
        if got == 0:
            return None
        self._exits[pid] = os.waitstatus_to_exitcode(status) if status >= 0 else -signal.SIGKILL
        return self._exits[pid]

    # -- forking ------------------------------------------------------------------
    def fork(self, requests: Mapping[int, dict[str, Any]]) -> dict[int, ForkedProcess | NotForked]:
        """Fork one worker per request (by local rank): a process, or why it was not.

        A request unanswered within the answer timeout (or when this call is
        interrupted) is withdrawn: the server never runs it as a second worker of its rank.
        """
        timeout = self.answer_timeout
        self.pump(0.0)
        if self.busy:
            why = "the fork server is still busy with requests given up on (an import)"
            return {rank: NotForked(why, False) for rank in requests}
        ids: dict[int, int] = {}
        for rank in requests:
            self._next_id += 1
            ids[rank] = self._next_id
        deadline = time.monotonic() + timeout
        # the server forks none past ``until`` (the same monotonic clock, this machine's):
        # what it forks, it answers while we still wait, so a request it reads late never
        # runs as a second worker of its rank before the kill of a late answer reaches it
        until = deadline - self.answer_margin * timeout
        messages = [
            {"op": "fork", "id": ids[r], "until": until, "request": q} for r, q in requests.items()
        ]
        asked: list[int] = []
        try:
            whole = self._send(messages, deadline)
            asked = [i for i, sent in zip(ids.values(), whole, strict=True) if sent]
            while not self._dead and not all(i in self._replies for i in asked):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.pump(min(left, 0.5))
        except BaseException:  # interrupted: no caller takes the workers forked so far
            whole = self._lines.last_whole  # (the send's, when it was interrupted)
            asked = asked or [i for i, sent in zip(ids.values(), whole, strict=False) if sent]
            self._withdraw([i for i in asked if i not in self._replies])
            for i in asked:
                reply = self._replies.pop(i, None)
                if reply is not None:
                    self._kill_late(reply)
            raise
        self._withdraw([i for i in asked if i not in self._replies])
        out: dict[int, ForkedProcess | NotForked] = {}
        for rank, i in ids.items():
            reply = self._replies.pop(i, None)
            if reply is None and self._dead:
                out[rank] = NotForked("the fork server exited", True)
            elif reply is None and i not in asked:
                out[rank] = NotForked(f"the fork server read nothing in {timeout:g} s", False)
            elif reply is None:
                out[rank] = NotForked(f"no answer from the fork server in {timeout:g} s", False)
            elif reply.get("event") == "forked" and isinstance(reply.get("pid"), int):
                out[rank] = ForkedProcess(self, reply["pid"])
            elif reply.get("event") == "dropped":
                out[rank] = NotForked("the fork server read it too late (an import)", False)
            else:
                out[rank] = NotForked(str(reply.get("reason", "refused")), True)
        return out

    def log_tail(self, limit: int = 2000) -> str:
        try:
            with open(self._log_file, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def close(self, timeout: float = 5.0) -> None:
        """Stop the server (its remaining children die with it). Idempotent."""
        proc, self._proc = self._proc, None
        with contextlib.suppress(OSError):
            self._sock.close()
        self._dead = True
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL did not work
            log.warning("fork server %s did not exit after SIGKILL", proc.pid)
