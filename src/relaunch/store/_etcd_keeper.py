"""The keeper of one embedded etcd member: ``python -m relaunch.store._etcd_keeper``.

    python -m relaunch.store._etcd_keeper AGENT_PID DATA_DIR ETCD_BINARY [ETCD_ARGS...]

The agent (AGENT_PID, its parent) starts this process in a session of its own; the keeper starts etcd with a
parent-death signal (SIGKILL). When the keeper is told to stop (SIGTERM, SIGINT) or
sees its agent gone (a pidfd of the agent becomes readable the moment it exits, so even
a SIGKILL of the agent's whole process group, which does not reach this session, is
seen at once; without pidfds, its parent changing, checked every 0.2 s; a
parent-death signal would not do, as it follows the agent's thread that started
the keeper, not the agent), it stops
etcd (SIGTERM, then SIGKILL after 5 s; SIGKILL at once when the agent is gone or
told so by SIGUSR1: a member that left the cluster),
removes DATA_DIR and exits. When etcd exits
by itself, the keeper removes DATA_DIR and exits with etcd's code. So neither an etcd
process nor its data outlive the agent, however the agent ends.

At once matters: a member whose node is gone but which still answers is counted up by
the members that leave meanwhile (:func:`relaunch.rendezvous._member_calls.leave_cluster`),
and its death right after their leave costs the others their quorum. The keeper
sleeps in ``poll`` until something happens (and every 5 s, a safety net: idle CPU
nil, where the 0.2 s loop cost 0.05% of a core).

Standard library only: it runs beside the agent, never in a worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from types import FrameType

_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int, parent: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    word = ctypes.c_ulong  # prctl is variadic: full unsigned long words
    libc.prctl(ctypes.c_int(_PR_SET_PDEATHSIG), word(sig), word(0), word(0), word(0))
    if os.getppid() != parent:
        os._exit(1)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[0].isdigit():
        print("usage: python -m relaunch.store._etcd_keeper AGENT_PID DATA_DIR ETCD [ARGS...]",
              file=sys.stderr)  # fmt: skip
        return 2
    agent, data_dir, binary, args = int(argv[0]), argv[1], argv[2], argv[3:]
    stop, at_once = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGUSR1:
            at_once.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, on_signal)
    me = os.getpid()
    if os.getppid() != agent:  # the agent died before this process got here
        shutil.rmtree(data_dir, ignore_errors=True)
        return 0
    try:
        proc = subprocess.Popen(
            [binary, "--data-dir", data_dir, *args],
            preexec_fn=lambda: _die_with_parent(signal.SIGKILL, me),
        )
    except OSError as exc:
        print(f"relaunch: cannot start etcd {binary}: {exc}", file=sys.stderr)
        shutil.rmtree(data_dir, ignore_errors=True)
        return 1
    orphaned = False
    try:
        orphaned = _watch(agent, proc, stop)
        if orphaned:
            stop.set()  # (the keeper's own end, not etcd's: exit 0)
    finally:
        if proc.poll() is None:
            # the node is gone, or the member left the cluster: nothing to hand over, no
            # reason to wait (a member's graceful stop waits up to 1 s for its peers'
            # connections to close)
            if orphaned or at_once.is_set():
                proc.kill()
            else:
                proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0 if stop.is_set() else proc.returncode


def _watch(agent: int, proc: subprocess.Popen[bytes], stop: threading.Event) -> bool:
    """Wait until etcd exits, the keeper is told to stop or the agent is gone; whether
    the agent is gone."""
    fds: list[int] = []
    try:
        fds.append(os.pidfd_open(agent))
        fds.append(os.pidfd_open(proc.pid))
    except (AttributeError, OSError):  # no pidfds (kernel < 5.3): look every 0.2 s
        for fd in fds:
            os.close(fd)
        while proc.poll() is None and not stop.wait(0.2):
            if os.getppid() != agent:
                return True
        return False
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    previous = signal.set_wakeup_fd(wake_w)  # a signal (the stop) wakes the poll
    try:
        poller = select.poll()
        for fd in (*fds, wake_r):
            poller.register(fd, select.POLLIN)
        while not stop.is_set() and proc.poll() is None:
            # (checked after the pidfd's opening: the pidfd is of the agent)
            if os.getppid() != agent:
                return True
            for fd, _ in poller.poll(5000):  # (5 s: should a wake-up ever go amiss)
                if fd == fds[0]:
                    return True
                if fd == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 64)
        return False
    finally:
        signal.set_wakeup_fd(previous)
        for fd in (*fds, wake_r, wake_w):
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
