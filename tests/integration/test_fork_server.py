"""The fork server: forked workers, exit codes, fork safety and the fallback to fresh
interpreters, and nothing left behind when it (or its agent) goes away."""

from __future__ import annotations

import os
import resource
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from multinode_support.waiting import wait_for
from relaunch.procs import Entrypoint, ForkServer, ProcessSpec, WorkerProcesses, process_state

pytestmark = pytest.mark.timeout(90)


def server_for(tmp_path: Path, modules: list[str]) -> ForkServer:
    preload = tmp_path / "modules.txt"
    preload.write_text("\n".join(modules) + "\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    server = ForkServer(env=env, preload_file=str(preload), log_file=str(tmp_path / "fs.log"))
    wait_for(lambda: (server.pump(0.05), server.ready)[1])
    return server


def job(tmp_path: Path, body: str, n: int = 2) -> tuple[Entrypoint, list[ProcessSpec]]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    specs = [
        ProcessSpec(
            local_rank=i,
            env={**os.environ, "LOCAL_RANK": str(i), "OUT": str(tmp_path)},
            stdout=str(tmp_path / f"out_{i}.log"),
            stderr=str(tmp_path / f"err_{i}.log"),
        )
        for i in range(n)
    ]
    return Entrypoint(kind="script", target=str(script)), specs


SCRIPT = """
import os, sys
rank = os.environ["LOCAL_RANK"]
print("preloaded" if "json" in sys.modules and "email.mime.text" in sys.modules else "cold")
sys.exit(int(rank) * 3)
"""


def test_forked_workers_run_with_the_preloaded_modules_and_report_exit_codes(
    tmp_path: Path,
) -> None:
    server = server_for(tmp_path, ["json", "email.mime.text"])
    try:
        entry, specs = job(tmp_path, SCRIPT)
        procs = WorkerProcesses(entry, specs, fork_server=server)
        procs.start()
        assert procs.forked == [0, 1] and procs.fork_refused is None
        wait_for(lambda: all(c is not None for c in procs.poll().values()))
        assert procs.close() == {0: 0, 1: 3}
        for i in (0, 1):
            assert (tmp_path / f"out_{i}.log").read_text().strip() == "preloaded"
    finally:
        server.close()


def test_a_server_whose_socket_is_past_descriptor_1023_forks(tmp_path: Path) -> None:
    """An agent that hosts a big job's store holds thousands of descriptors; the fork
    server, started late in a run, gets one past 1,023, which select() refused (the
    agent's first look at the server raised, and the agent ended)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit of open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        server = server_for(tmp_path, ["json", "email.mime.text"])
        try:
            fd = server.fileno()
            assert fd is not None and fd > 1023
            entry, specs = job(tmp_path, SCRIPT)
            procs = WorkerProcesses(entry, specs, fork_server=server)
            procs.start()
            assert procs.forked == [0, 1]
            wait_for(lambda: all(c is not None for c in procs.poll().values()))
            assert procs.close() == {0: 0, 1: 3}
        finally:
            server.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    ("module", "why"),
    [
        ("threader", "importing threader started 1 thread"),
        ("opener", "a socket is open"),
    ],
)
def test_a_fork_unsafe_server_refuses_and_workers_start_fresh(
    tmp_path: Path, module: str, why: str
) -> None:
    (tmp_path / "threader.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    (tmp_path / "opener.py").write_text("import socket\nkept = socket.socket()\n")
    server = server_for(tmp_path, ["json", module])
    try:
        entry, specs = job(tmp_path, SCRIPT)
        procs = WorkerProcesses(entry, specs, fork_server=server)
        procs.start()
        assert procs.forked == []
        assert procs.fork_refused is not None and why in procs.fork_refused
        wait_for(lambda: all(c is not None for c in procs.poll().values()))
        assert procs.close() == {0: 0, 1: 3}
        assert (tmp_path / "out_0.log").read_text().strip() == "cold"
    finally:
        server.close()


# A thread of C code only, started with libc's pthread_create: it runs pause() with every
# signal blocked (so it never returns) and has no Python thread state.
NATIVE_THREAD = """
import ctypes, signal

def start_native_thread():
    libc = ctypes.CDLL(None, use_errno=True)
    pause = ctypes.cast(libc.pause, ctypes.c_void_p)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        assert libc.pthread_create(ctypes.byref(ctypes.c_ulong()), None, pause, None) == 0
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
"""


@pytest.mark.parametrize(
    ("module", "why"),
    [
        # started while the server imported the module
        ("native_at_import", "importing native_at_import started 1 thread"),
        # started after the preload (here from a timer's signal handler): seen at fork time
        ("native_later", "1 native thread(s) running"),
    ],
)
def test_a_native_thread_makes_the_server_refuse(tmp_path: Path, module: str, why: str) -> None:
    (tmp_path / "native_at_import.py").write_text(NATIVE_THREAD + "start_native_thread()\n")
    (tmp_path / "native_later.py").write_text(
        NATIVE_THREAD
        + "import os\n"
        + "def later(signum, frame):\n"
        + "    start_native_thread()\n"
        + "    open(os.path.join(os.path.dirname(__file__), 'started'), 'w').close()\n"
        + "signal.signal(signal.SIGALRM, later)\n"
        + "signal.setitimer(signal.ITIMER_REAL, 0.2)\n"
    )
    server = server_for(tmp_path, ["json", module])
    try:
        if module == "native_later":
            wait_for(lambda: (tmp_path / "started").exists(), what="the late native thread")
        entry, specs = job(tmp_path, SCRIPT)
        procs = WorkerProcesses(entry, specs, fork_server=server)
        procs.start()
        assert procs.forked == []
        assert procs.fork_refused is not None and why in procs.fork_refused
        wait_for(lambda: all(c is not None for c in procs.poll().values()))
        assert procs.close() == {0: 0, 1: 3}
        assert (tmp_path / "out_0.log").read_text().strip() == "cold"
    finally:
        server.close()


def test_initialized_cuda_makes_the_server_refuse(tmp_path: Path) -> None:
    """The check asks the server's torch, ``torch.cuda.is_initialized()``. Without a GPU
    CUDA cannot be initialized: the module sets the flag ``torch.cuda._lazy_init`` sets
    once CUDA is up. With a GPU it initializes CUDA for real; the driver's own threads
    or files may then be what the refusal names first."""
    (tmp_path / "cuda_user.py").write_text(
        "import os, torch\n"
        "if torch.cuda.is_available():\n"
        "    torch.cuda.init()\n"
        "    open(os.path.join(os.path.dirname(__file__), 'real_cuda'), 'w').close()\n"
        "else:\n"
        "    torch.cuda._initialized = True\n"
        "assert torch.cuda.is_initialized()\n"
    )
    server = server_for(tmp_path, ["json", "cuda_user"])
    try:
        entry, specs = job(tmp_path, SCRIPT)
        procs = WorkerProcesses(entry, specs, fork_server=server)
        procs.start()
        assert procs.forked == []
        if (tmp_path / "real_cuda").exists():
            assert procs.fork_refused is not None
        else:
            assert procs.fork_refused == "CUDA is initialized"
        wait_for(lambda: all(c is not None for c in procs.poll().values()))
        assert procs.close() == {0: 0, 1: 3}
        assert (tmp_path / "out_0.log").read_text().strip() == "cold"
    finally:
        server.close()


def test_forked_workers_die_with_the_server(tmp_path: Path) -> None:
    server = server_for(tmp_path, ["json"])
    body = "import os, time\nopen(os.environ['OUT'] + '/up_' + os.environ['LOCAL_RANK'], 'w')\n"
    entry, specs = job(tmp_path, body + "time.sleep(600)\n")
    procs = WorkerProcesses(entry, specs, fork_server=server)
    try:
        procs.start()
        pids = list(procs.pids().values())
        wait_for(lambda: all((tmp_path / f"up_{i}").exists() for i in (0, 1)))
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        # Reparented to us (a subreaper would get them; here: their exit is reaped by the
        # ForkServer handle), they died with the server.
        wait_for(lambda: all(c is not None for c in procs.poll().values()))
        assert set(procs.poll().values()) == {-signal.SIGKILL}
        # (the server's exit sends them SIGKILL; each dies once it next runs)
        wait_for(lambda: all(process_state(pid) in (None, "Z", "X") for pid in pids))
    finally:
        procs.close(grace=0)
        server.close()


SLEEPS = """
import time
time.sleep(60)
"""


def test_a_refusal_leaves_the_workers_already_forked_running(tmp_path: Path) -> None:
    """The fork server refuses a fork (a replacement for a lost in-process rank, after
    its preload started a thread): the workers it forked before keep running until the
    attempt's workers are stopped (closing it then killed them: they have it as their
    parent-death parent, and an in-process recovery became a group restart)."""
    from relaunch.agent._forking import NodeForkServer

    said: list[object] = []
    node = NodeForkServer(
        modules_file=str(tmp_path / "modules.txt"), log_dir=str(tmp_path), delay=0.0,
        emit=said.append,
    )  # fmt: skip
    node.prewarm(env=dict(os.environ), modules=["json"])
    server = node.usable()
    assert server is not None
    wait_for(lambda: (server.pump(0.05), server.ready)[1])
    entry, specs = job(tmp_path, SLEEPS, n=1)
    procs = WorkerProcesses(entry, specs, fork_server=server)
    try:
        procs.start()
        assert procs.forked == [0]
        node.refused("a thread was started")
        assert node.usable() is None  # the next workers start fresh
        assert procs.poll() == {0: None}  # (it died with the server at once)
        (pid,) = procs.pids().values()
        assert process_state(pid) not in (None, "Z")
    finally:
        procs.close(grace=5.0)
        node.workers_stopped()
    assert not server.alive()
    node.close()


RUNS = """
import os, sys
rank = os.environ["LOCAL_RANK"]
with open(os.environ["OUT"] + "/runs_" + rank, "a") as f:
    f.write(f"{os.getpid()}\\n")
print("preloaded" if "slowmod" in sys.modules else "cold")
sys.exit(int(rank) * 3)
"""


def test_a_fork_not_answered_in_time_starts_fresh_and_never_runs_twice(tmp_path: Path) -> None:
    """The server answers between imports only: a fork asked during a slow one (a cold
    file system) waits the answer timeout, then the workers start fresh and the request
    is withdrawn. The server, reading it after the import, never forks a second worker
    of the rank (it used to: two workers of one rank until the attempt ended), and it
    forks the next workers as usual (it is not given up for good)."""
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(3)\n")
    preload = tmp_path / "modules.txt"
    preload.write_text("slowmod\njson\n")  # (nothing is answered before slowmod is in)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    log_file = tmp_path / "fs.log"
    server = ForkServer(env=env, preload_file=str(preload), log_file=str(log_file))
    server.answer_timeout = 0.5
    try:
        entry, specs = job(tmp_path, RUNS)
        procs = WorkerProcesses(entry, specs, fork_server=server)
        procs.start()
        assert procs.forked == [] and procs.fork_refused is None
        wait_for(lambda: all(c is not None for c in procs.poll().values()))
        assert procs.close() == {0: 0, 1: 3}
        assert (tmp_path / "out_0.log").read_text().strip() == "cold"
        wait_for(lambda: (server.pump(0.05), server.ready)[1])  # the requests were read
        assert "forked" not in log_file.read_text()
        again = WorkerProcesses(entry, specs, fork_server=server)
        again.start()
        assert again.forked == [0, 1]
        wait_for(lambda: all(c is not None for c in again.poll().values()))
        assert again.close() == {0: 0, 1: 3}
        for i in (0, 1):  # one fresh run and one forked run of each rank, no third
            assert len((tmp_path / f"runs_{i}").read_text().split()) == 2
    finally:
        server.close()


def test_a_fork_read_past_its_time_is_dropped_and_answered_so(tmp_path: Path) -> None:
    """The server forks no request it reads past the time the agent gives (the agent
    still waits then, and takes the answer): a late read never runs as a second worker
    of its rank, and the server is not left busy."""
    server = server_for(tmp_path, ["json"])
    server.answer_margin = 2.0  # every request's time is past when it is read
    try:
        entry, specs = job(tmp_path, RUNS)
        procs = WorkerProcesses(entry, specs, fork_server=server)
        procs.start()
        assert procs.forked == [] and procs.fork_refused is None
        assert not server.busy
        wait_for(lambda: all(c is not None for c in procs.poll().values()))
        assert procs.close() == {0: 0, 1: 3}
        assert "forked" not in (tmp_path / "fs.log").read_text()
        for i in (0, 1):
            assert len((tmp_path / f"runs_{i}").read_text().split()) == 1
    finally:
        server.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))


LATE_RUNS = """
import os, time
time.sleep(1)  # (a fork killed as late is killed before it could write)
with open(os.environ["OUT"] + "/runs_" + os.environ["LOCAL_RANK"], "a") as f:
    f.write(f"{os.getpid()}\\n")
"""


def test_a_fork_answered_after_the_agent_gave_up_is_killed_and_the_server_skipped_meanwhile(
    tmp_path: Path,
) -> None:
    """The server read the request in time but its fork took longer than the answer
    timeout (here an at-fork hook that sleeps): the workers started fresh, and the
    process forked late is killed as soon as its answer is read. Until the server has
    answered for every request given up on, it is busy: the next workers start fresh at
    once instead of waiting for it again."""
    (tmp_path / "slowfork.py").write_text(
        "import os, time\nos.register_at_fork(before=lambda: time.sleep(2))\n"
    )
    preload = tmp_path / "modules.txt"
    preload.write_text("slowfork\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    log_file = tmp_path / "fs.log"
    server = ForkServer(env=env, preload_file=str(preload), log_file=str(log_file))
    server.answer_timeout = 0.5
    try:
        wait_for(lambda: (server.pump(0.05), server.ready)[1])
        entry, specs = job(tmp_path, LATE_RUNS, n=1)
        procs = WorkerProcesses(entry, specs, fork_server=server)
        procs.start()  # (one request, read at once, answered 2 s later)
        assert procs.forked == [] and procs.fork_refused is None
        assert server.busy
        again = WorkerProcesses(entry, specs, fork_server=server)
        again.start()  # busy: fresh at once, nothing sent to the server
        assert again.forked == []
        wait_for(lambda: (server.pump(0.05), not server.busy)[1])

        def forked() -> list[int]:  # (the server says it in its log after its answer)
            lines = log_file.read_text().splitlines()
            return [int(line.split()[1]) for line in lines if line.startswith("forked ")]

        wait_for(lambda: len(forked()) == 1)
        late = forked()
        wait_for(lambda: process_state(late[0]) in (None, "Z", "X"))
        for p in (procs, again):
            wait_for(lambda p=p: all(c is not None for c in p.poll().values()))
            assert p.close() == {0: 0}
        assert len((tmp_path / "runs_0").read_text().split()) == 2  # the two fresh ones
    finally:
        server.close()
