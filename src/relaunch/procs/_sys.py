"""Linux process primitives: parent-death signal, subreaper, the limit on open files,
descendants, group kill."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import resource
import signal
import time
from collections.abc import Callable

from relaunch._children import unreaped

__all__ = [
    "child_preexec",
    "descendants",
    "is_live",
    "is_stopped",
    "kill_group",
    "members",
    "process_state",
    "raise_open_files_limit",
    "reap_orphans",
    "set_child_subreaper",
    "set_parent_death_signal",
    "start_token",
    "terminate",
]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc: ctypes.CDLL | None = None


def _prctl(option: int, arg: int) -> bool:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            return False
    # prctl is variadic: pass full unsigned long words, not C ints (undefined upper half).
    word = ctypes.c_ulong
    return bool(_libc.prctl(ctypes.c_int(option), word(arg), word(0), word(0), word(0)) == 0)


def set_parent_death_signal(sig: int = signal.SIGKILL, *, parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent thread dies.

    Runs in the child between fork and exec. If the parent is already gone (we were
    reparented before the call took effect), exit at once. ``parent``: the parent's
    pid read *before* the fork (see :func:`child_preexec`); without it the
    check only covers a parent that dies during the call.
    """
    expected = os.getppid() if parent is None else parent
    _prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != expected:
        os._exit(1)


def child_preexec(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for the processes that run the user's code: the parent-death
    signal, checked against this process, and the limit on open files this process was
    given (where :func:`raise_open_files_limit` raised its own)."""
    return functools.partial(_child_setup, sig, os.getpid(), _given_nofile)


def _child_setup(sig: int, parent: int, nofile: int | None) -> None:
    if nofile is not None:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, _hard_nofile()))
    set_parent_death_signal(sig, parent=parent)


_given_nofile: int | None = None
"""The soft limit on open files this process was started with, once raised."""


def _hard_nofile() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit, as Go programs
    do at their start (etcd among them). An agent serves a connection per node (the
    rendezvous store) and one or more per worker (the workers' store): at the common
    soft limit of 1,024 a job of 128 nodes of 8 ranks ran out. The processes started
    with :func:`child_preexec` get the limit back (the workers' environment is the one
    the job was given, as under torchrun). Idempotent; a refusal is logged only."""
    global _given_nofile
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.debug("cannot raise the limit on open files from %d to %d: %s", soft, hard, exc)
        return
    if _given_nofile is None:
        _given_nofile = soft


def set_child_subreaper() -> bool:
    """Make orphaned descendants of this process reparent to it (so they can be found and reaped)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def kill_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the process group ``pgid``; return whether any process received it."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not allowed to signal process group %s", pgid)
        return False
    return True


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 on); None if
    the process is gone. The command name may hold spaces and parentheses: the split
    is after its last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (``R``, ``S``, ``T``, ``Z``...); None if gone."""
    fields = _stat_fields(pid)
    return fields[0].decode() if fields else None


def start_token(pid: int) -> str | None:
    """When ``pid`` started (clock ticks after boot, as /proc says it): with the pid, it
    names one process even after the pid is reused. None where unavailable."""
    fields = _stat_fields(pid)
    return fields[19].decode() if fields is not None and len(fields) > 19 else None


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is in the stopped state (``T``: SIGSTOP, SIGTSTP) or traced."""
    return process_state(pid) in ("T", "t")


def _proc_table() -> list[tuple[int, int, int, int, bool]]:
    """(pid, ppid, pgid, sid, is_zombie) of every process, read from /proc."""
    table: list[tuple[int, int, int, int, bool]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
        rest = stat[stat.rfind(b")") + 2 :].split()
        if len(rest) < 4:
            continue
        with contextlib.suppress(ValueError):
            zombie = rest[0] in (b"Z", b"X")
            table.append((int(entry), int(rest[1]), int(rest[2]), int(rest[3]), zombie))
    return table


def _children_map(*, zombies: bool = False) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid, ppid, _, _, zombie in _proc_table():
        if zombies or not zombie:
            children.setdefault(ppid, []).append(pid)
    return children


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), read from /proc."""
    children = _children_map()
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def is_live(pid: int) -> bool:
    """Whether a process that has not exited has ``pid`` (a zombie has exited)."""
    return process_state(pid) not in (None, "Z", "X")


def members(sessions: set[int]) -> list[int]:
    """Live processes whose session or process group is one of ``sessions``."""
    return [
        pid
        for pid, _, pgid, sid, zombie in _proc_table()
        if not zombie and (sid in sessions or pgid in sessions)
    ]


def reap_orphans() -> None:
    """Reap exited direct children that no Popen owns (grandchildren reparented to us).

    Never waits on a child a tracked Popen started (:mod:`relaunch._children`): its
    owner must see its real exit status.
    """
    me = os.getpid()
    keep = unreaped()
    for pid in _children_map(zombies=True).get(me, []):
        if pid in keep:
            continue
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def terminate(
    pid: int,
    gone: Callable[[], bool],
    *,
    grace: float,
    sig: int = signal.SIGTERM,
    kill_wait: float = 5.0,
    what: str = "process",
) -> bool:
    """Stop one process: ``sig``, up to ``grace`` seconds for it to go, then SIGKILL and up
    to ``kill_wait`` more. ``gone()`` tells whether it is gone (reaped, or its pidfd
    readable); a stopped process gets SIGKILL at once. Returns whether it went."""
    for signum, wait in ((sig, grace), (signal.SIGKILL, kill_wait)):
        if gone():
            return True
        if signum != signal.SIGKILL and is_stopped(pid):
            continue  # a stopped process cannot act on SIGTERM: no grace for it
        log.warning("%s %s: sending %s", what, pid, signal.Signals(signum).name)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
        end = time.monotonic() + wait
        while not gone() and time.monotonic() < end:
            time.sleep(0.01)
    return gone()
