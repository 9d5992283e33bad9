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
from typing import Literal

from relaunch.errors import ConfigError, WorkerError
from relaunch.procs._logs import TeeTailer, TeeTarget
from relaunch.procs._standby import Standby
from relaunch.procs._sys import (
    descendants,
    kill_group,
    members,
    reap_orphans,
    set_parent_death_signal,
)

__all__ = ["Entrypoint", "ProcessSpec", "WorkerProcesses"]

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


class WorkerProcesses:
    """The worker processes of one attempt on this node, owned until :meth:`close`.

    Each worker runs in a session (and process group) of its own, gets SIGKILL
    when the agent dies (parent-death signal), and is stopped with its whole
    group: SIGTERM, a grace period, then SIGKILL; descendants that left the
    group are found in /proc and killed too.
    """

    def __init__(
        self,
        entry: Entrypoint,
        specs: Sequence[ProcessSpec],
        *,
        standbys: Mapping[int, Standby] | None = None,
        via_runner: bool = False,
        report_modules: Mapping[int, str] | None = None,
        name: str = "",
    ) -> None:
        self._entry = entry
        self._specs = list(specs)
        self._standbys = dict(standbys or {})
        self._via_runner = via_runner or entry.run_path or entry.kind == "function"
        self._report_modules = dict(report_modules or {})
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._exitcodes: dict[int, int] = {}
        self._tailer = TeeTailer([t for s in self._specs for t in s.tee], name=name)
        self._closed = False

    # -- starting ---------------------------------------------------------------
    def start(self) -> None:
        """Start every worker. Raises WorkerError (and stops those started) when one cannot start."""
        try:
            for spec in self._specs:
                self._procs[spec.local_rank] = self._start_one(spec)
        except BaseException:
            self.close(grace=0.0)
            raise
        self._tailer.start()

    def _start_one(self, spec: ProcessSpec) -> subprocess.Popen[bytes]:
        standby = self._standbys.pop(spec.local_rank, None)
        if standby is None and self._via_runner and self._entry.is_python:
            # Same program as a standby, activated at once: runpy in an interpreter we start.
            standby = Standby(env=spec.env, cwd=os.getcwd())
        if standby is not None:
            proc = standby.activate(
                env=spec.env,
                kind=self._entry.kind,
                target=self._entry.target,
                args=spec.args,
                stdout=spec.stdout,
                stderr=spec.stderr,
                report_modules=self._report_modules.get(spec.local_rank),
                call_args=spec.call_args,
                result_file=spec.result_file,
            )
            if proc is not None:
                log.debug(
                    "local rank %s: warm standby %s became the worker", spec.local_rank, proc.pid
                )
                return proc
        out, err = _open_out(spec.stdout), _open_out(spec.stderr)
        try:
            return subprocess.Popen(
                self._entry.argv(spec.args),
                env=dict(spec.env),
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=set_parent_death_signal,
            )
        except OSError as exc:
            raise WorkerError(
                f"cannot start local rank {spec.local_rank}: {self._entry.target!r}: {exc}"
            ) from exc
        finally:
            for fd in (out, err):
                if fd is not None:
                    os.close(fd)

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

    # -- stopping ---------------------------------------------------------------
    def close(self, sig: int = signal.SIGTERM, grace: float = 30.0) -> dict[int, int]:
        """Stop every worker and its descendants; return the exit codes. Idempotent."""
        if self._closed:
            return dict(self._exitcodes)
        self._closed = True
        for standby in self._standbys.values():
            standby.discard()
        self._standbys.clear()
        sessions = {p.pid for p in self._procs.values()}
        strays = {d for pid in sessions for d in descendants(pid)}
        live = [p for p in self._procs.values() if p.poll() is None]
        for proc in live:
            kill_group(proc.pid, sig)
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
        reap_orphans(owned=set())
        self._tailer.close()
        return dict(self._exitcodes)
