"""Start, watch and stop the worker processes of one attempt."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from relaunch._children import track
from relaunch.errors import ConfigError, WorkerError
from relaunch.procs._forkserver import ForkedProcess, ForkServer
from relaunch.procs._logs import TeeTailer, TeeTarget
from relaunch.procs._standby import Standby
from relaunch.procs._sys import (
    child_preexec,
    descendants,
    is_live,
    is_stopped,
    kill_group,
    members,
    reap_orphans,
)

__all__ = ["Entrypoint", "ProcessSpec", "WorkerProcesses", "runner_request"]

log = logging.getLogger(__name__)

EntryKind = Literal["script", "module", "binary", "function"]


@dataclass(frozen=True, kw_only=True)
class Entrypoint:
    """What each worker runs: a Python script, a module (``-m``), a binary, or a function.

    A function is named by ``module:qualname`` (or ``/path/script.py:qualname``)
    and must be importable there, as for multiprocessing's spawn; build it with
    :meth:`from_function`. Its arguments and return value travel as JSON.
    """

    kind: EntryKind
    target: str
    run_path: bool = False
    """Run the script with ``runpy`` inside an interpreter we start (torchrun ``--run-path``)."""

    def __post_init__(self) -> None:
        if self.kind not in ("script", "module", "binary", "function"):
            raise ConfigError(
                f"entrypoint kind: expected script, module or binary, got {self.kind!r}"
            )
        if not self.target:
            raise ConfigError("entrypoint: expected a script, module or program, got nothing")

    @classmethod
    def from_function(cls, fn: Callable[..., object]) -> Entrypoint:
        """The entrypoint for a module-level function (not a lambda or a nested function)."""
        qualname = getattr(fn, "__qualname__", "")
        module = getattr(fn, "__module__", None)
        if not qualname or "<" in qualname or module is None:
            raise ConfigError(
                f"entrypoint: expected a module-level function, got {fn!r} "
                "(lambdas and nested functions cannot be started in another process)"
            )
        if module in ("__main__", "__mp_main__"):
            main = sys.modules[module]
            path = getattr(main, "__file__", None)
            if not path:
                raise ConfigError(f"entrypoint: {qualname} is defined in an interactive __main__")
            module = os.path.abspath(path)
        return cls(kind="function", target=f"{module}:{qualname}")

    def argv(self, args: Sequence[str]) -> list[str]:
        if self.kind == "script":
            return [sys.executable, "-u", self.target, *args]
        if self.kind == "module":
            return [sys.executable, "-u", "-m", self.target, *args]
        if self.kind == "binary":
            return [self.target, *args]
        raise WorkerError("a function entrypoint runs in the warm runner, not from a command line")

    @property
    def is_python(self) -> bool:
        return self.kind != "binary"


@dataclass(frozen=True, kw_only=True)
class ProcessSpec:
    """One worker process of an attempt."""

    local_rank: int
    env: Mapping[str, str]
    """The worker's complete environment."""
    args: tuple[str, ...] = ()
    """Arguments after the script/module/binary, with ``${local_rank}`` substituted."""
    call_args: tuple[object, ...] = ()
    """Arguments of a function entrypoint (JSON data)."""
    result_file: str | None = None
    """Where a function entrypoint's return value is written (JSON)."""
    stdout: str | None = None
    """File to write stdout to (appended); ``None`` for the agent's console."""
    stderr: str | None = None
    tee: list[TeeTarget] = field(default_factory=list)


def _open_out(path: str | None) -> int | None:
    if path is None:
        return None
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


class _Process(Protocol):
    """What the agent needs of a worker process: a ``Popen`` or a forked worker."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def runner_request(
    entry: Entrypoint, spec: ProcessSpec, report_modules: str | None
) -> dict[str, object]:
    """The request that turns a runner (``_warm.py``) into the worker ``spec`` describes."""
    return {
        "version": 1,
        "cwd": os.getcwd(),
        "env": dict(spec.env),
        "kind": entry.kind,
        "target": entry.target,
        "args": list(spec.args),
        "stdout": spec.stdout,
        "stderr": spec.stderr,
        "report_modules": report_modules,
        "call_args": list(spec.call_args),
        "result_file": spec.result_file,
    }


class WorkerProcesses:
    """The worker processes of one attempt on this node, owned until :meth:`close`.

    Each worker runs in a session (and process group) of its own, gets SIGKILL
    when the agent dies (parent-death signal; through the fork server for a
    forked worker), and is stopped with its whole group: SIGTERM, a grace period,
    then SIGKILL (at once for a stopped process); descendants that left the group
    are found in /proc and killed too. Python workers run through the runner
    (``_warm.py``): forked from ``fork_server`` when one is given, else fresh.
    """

    def __init__(
        self,
        entry: Entrypoint,
        specs: Sequence[ProcessSpec],
        *,
        fork_server: ForkServer | None = None,
        report_modules: Mapping[int, str] | None = None,
        name: str = "",
    ) -> None:
        self._entry = entry
        self._specs = list(specs)
        self._fork_server = fork_server
        self._report_modules = dict(report_modules or {})
        self._procs: dict[int, _Process] = {}
        self._exitcodes: dict[int, int] = {}
        self._tailer = TeeTailer([t for s in self._specs for t in s.tee], name=name)
        self._closed = False
        self._retired: list[int] = []
        """Sessions of processes that died and were replaced (see :meth:`replace`)."""
        self._pidfds: list[tuple[_Process, int]] = []
        """A pidfd per running worker this process started itself (:meth:`exit_fds`),
        beside its process (not its pid: a replacement may get a dead worker's pid)."""
        self._no_pidfds = False
        """This kernel (or a seccomp filter) refuses pidfds."""
        self.forked: list[int] = []
        """Local ranks whose worker was forked from the fork server."""
        self.fork_refused: str | None = None
        """Why the fork server did not fork (a worker then started fresh), if it did not."""

    # -- starting ---------------------------------------------------------------
    def start(self) -> None:
        """Start every worker. Raises WorkerError (and stops those started) when one cannot start."""
        try:
            forked = self._fork(self._specs, self._fork_server)
            for spec in self._specs:
                proc = forked.get(spec.local_rank)
                self._procs[spec.local_rank] = proc if proc is not None else self._start_one(spec)
        except BaseException:
            self.close(grace=0.0)
            raise
        self._tailer.start()

    def _request(self, spec: ProcessSpec) -> dict[str, object]:
        return runner_request(self._entry, spec, self._report_modules.get(spec.local_rank))

    def _fork(self, specs: Sequence[ProcessSpec], server: ForkServer | None) -> dict[int, _Process]:
        """Fork these workers from ``server`` if it is usable; those it forked, by rank."""
        if server is None or not self._entry.is_python or not server.alive():
            return {}
        replies = server.fork({s.local_rank: self._request(s) for s in specs})
        out: dict[int, _Process] = {}
        for rank, reply in replies.items():
            if isinstance(reply, ForkedProcess):
                out[rank] = reply
                self.forked.append(rank)
            elif reply.lasting:
                self.fork_refused = reply.reason
            else:
                log.warning("local rank %s starts fresh: %s", rank, reply.reason)
        return out

    def _start_one(self, spec: ProcessSpec) -> _Process:
        if self._entry.is_python:
            proc = Standby(env=spec.env, cwd=os.getcwd()).activate(self._request(spec))
            if proc is not None:
                return proc
        out, err = _open_out(spec.stdout), _open_out(spec.stderr)
        try:
            proc = subprocess.Popen(
                self._entry.argv(spec.args),
                env=dict(spec.env),
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=child_preexec(),
            )
            return track(proc)
        except OSError as exc:
            raise WorkerError(
                f"cannot start local rank {spec.local_rank}: {self._entry.target!r}: {exc}"
            ) from exc
        finally:
            for fd in (out, err):
                if fd is not None:
                    os.close(fd)

    def replace(self, spec: ProcessSpec, fork_server: ForkServer | None = None) -> tuple[int, bool]:
        """Start a new process for ``spec.local_rank`` (whose process died): forked from
        ``fork_server`` when it is usable, else fresh. Returns its pid and whether it
        was forked. The dead process's session is killed with the others at
        :meth:`close`.

        Raises WorkerError when it cannot start.
        """
        lr = spec.local_rank
        old = self._procs.get(lr)
        if old is not None:
            self._retired.append(old.pid)
        self._specs = [spec if s.local_rank == lr else s for s in self._specs]
        self._exitcodes.pop(lr, None)
        proc = self._fork([spec], fork_server).get(lr)
        self._procs[lr] = proc if proc is not None else self._start_one(spec)
        return self._procs[lr].pid, proc is not None

    # -- watching ---------------------------------------------------------------
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self._procs.items()}

    def poll(self) -> dict[int, int | None]:
        """Exit code per local rank (negative: killed by that signal), ``None`` while running."""
        result: dict[int, int | None] = {}
        for rank, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                self._exitcodes[rank] = code
            result[rank] = code
        return result

    def exit_fds(self) -> list[int]:
        """Descriptors that become readable when a worker still running exits: a pidfd
        of each worker started here, the fork server's socket for forked ones (a caller
        polls them, then :meth:`poll` drains them). A worker with neither (no pidfds on
        this kernel; the fork server gone) is seen at the caller's next look."""
        running = [p for p in self._procs.values() if p.returncode is None]
        kept = []
        for proc, fd in self._pidfds:
            if any(proc is p for p in running):
                kept.append((proc, fd))
            else:
                os.close(fd)
        self._pidfds = kept
        fds = {fd for _, fd in kept}
        for proc in running:
            if isinstance(proc, ForkedProcess):
                server = proc.exit_fd()
                if server is not None:
                    fds.add(server)
            elif not self._no_pidfds and not any(proc is p for p, _ in kept):
                try:
                    fd = os.pidfd_open(proc.pid)
                except ProcessLookupError:  # gone already: the next poll sees it
                    continue
                except (OSError, AttributeError):  # no pidfds here: looked at each interval
                    self._no_pidfds = True
                    continue
                self._pidfds.append((proc, fd))
                fds.add(fd)
        return sorted(fds)

    # -- stopping ---------------------------------------------------------------
    def close(self, sig: int = signal.SIGTERM, grace: float = 30.0) -> dict[int, int]:
        """Stop every worker and its descendants; return the exit codes. Idempotent."""
        if self._closed:
            return dict(self._exitcodes)
        self._closed = True
        for _, fd in self._pidfds:  # not waited on from here
            os.close(fd)
        self._pidfds = []
        live = [p for p in self._procs.values() if p.poll() is None]
        running = {p.pid for p in live}
        # The pid of a worker that exited may be another process's now: its session's
        # members are looked for only while no live process has that pid (a session
        # with members holds its number), and its descendants not at all (they were
        # handed to this agent, or to init)
        gone = ({p.pid for p in self._procs.values()} | set(self._retired)) - running
        sessions = running | {pid for pid in gone if not is_live(pid)}
        strays = {d for pid in running for d in descendants(pid)}
        for proc in live:
            # A stopped process cannot act on SIGTERM: no grace for it.
            kill_group(proc.pid, signal.SIGKILL if is_stopped(proc.pid) else sig)
            kill_group(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + grace
        for proc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in live:
            if proc.poll() is None:
                log.warning(
                    "worker %s did not exit %.1fs after %s; sending SIGKILL", proc.pid, grace, sig
                )
                kill_group(proc.pid, signal.SIGKILL)
        # Whatever is left of their sessions or descendants (DataLoader workers, shells...).
        for pid in strays | set(members(sessions)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for rank, proc in self._procs.items():
            try:
                self._exitcodes[rank] = proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                log.error("worker %s survived SIGKILL", proc.pid)
        reap_orphans()
        self._tailer.close()
        return dict(self._exitcodes)
