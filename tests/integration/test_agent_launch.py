"""The relaunch command on one node: environment, restarts, reports, output, entrypoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PY = sys.executable
TORCHRUN_KEYS = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)
# Values that are per-run by nature (ports, ids, paths); every other key must agree.
PER_RUN = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


def relaunch(
    *args: str, timeout: float = 90, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "relaunch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def events(log_dir: Path) -> list[dict[str, object]]:
    found = list(log_dir.glob("*/events.jsonl"))
    assert len(found) == 1, found
    return [json.loads(line) for line in found[0].read_text().splitlines()]


DUMP_ENV = """
    import json, os, sys
    out = sys.argv[1]
    rank = os.environ["LOCAL_RANK"]
    with open(os.path.join(out, f"env_{rank}.json"), "w") as f:
        json.dump(dict(os.environ), f)
"""


@pytest.mark.timeout(120)
def test_worker_environment_matches_torchrun(tmp_path: Path) -> None:
    dump = script(tmp_path, "dump.py", DUMP_ENV)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run(
        [
            PY,
            "-m",
            "relaunch",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=2",
            dump,
            str(ours),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    t = subprocess.run(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=2",
            dump,
            str(theirs),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert t.returncode == 0, t.stderr
    for rank in (0, 1):
        a = json.loads((ours / f"env_{rank}.json").read_text())
        b = json.loads((theirs / f"env_{rank}.json").read_text())
        for key in TORCHRUN_KEYS:
            assert key in a, key
            assert key in b, key
            if key not in PER_RUN:
                assert a[key] == b[key], (key, a[key], b[key])
        # every TORCHELASTIC_* / torch.distributed key torchrun sets, we set too
        torch_keys = {k for k in b if k.startswith(("TORCHELASTIC_", "PET_")) or k in TORCHRUN_KEYS}
        assert torch_keys <= set(a), torch_keys - set(a)
        assert int(a["MASTER_PORT"]) > 0


@pytest.mark.timeout(90)
def test_master_port_leaves_the_next_two_ports_to_the_program(tmp_path: Path) -> None:
    """MASTER_PORT is chosen outside the ephemeral range, where no outgoing connection
    takes a source port, with MASTER_PORT + 1 and + 2 free: programs written after NVIDIA's
    examples host their own stores there (in CI one was taken, most likely by an outgoing
    connection's source port)."""
    probe = script(
        tmp_path,
        "probe.py",
        """
        import os, socket, sys
        port = int(os.environ["MASTER_PORT"])
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        servers = []
        for k in (1, 2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((os.environ["MASTER_ADDR"], port + k))
            s.listen()
            servers.append(s)
        assert not low <= port <= high, (port, low, high)
        print(f"rank {os.environ['RANK']} bound {port + 1} and {port + 2}", flush=True)
        """,
    )
    r = relaunch("--nproc-per-node=1", "--max-restarts=0", probe)
    assert r.returncode == 0, r.stderr
    assert "rank 0 bound" in r.stdout, r.stdout


@pytest.mark.timeout(90)
def test_failed_worker_is_restarted_and_job_succeeds(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        "flaky.py",
        """
        import os, sys
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            sys.exit(7)
        """,
    )
    logs = tmp_path / "logs"
    r = relaunch(
        "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--log-dir", str(logs), s
    )
    assert r.returncode == 0, r.stderr
    names = [e["name"] for e in events(logs)]
    assert names.count("workers_started") == 2
    assert "restart" in names
    assert names.index("workers_succeeded") > len(names) - 1 - names[::-1].index("workers_started")


@pytest.mark.timeout(90)
def test_a_worker_s_exit_is_acted_on_without_waiting_for_the_monitor_interval(
    tmp_path: Path,
) -> None:
    """With an hour between the agent's looks, the job still restarts at rank 1's exit
    and ends at the workers' success: a worker's exit wakes the agent (here the pidfds
    of workers it started: the fork server starts at a look, after its delay), and so
    does a SIGTERM while the workers of the next job run on."""
    s = script(
        tmp_path,
        "exits.py",
        """
        import os, sys, time
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            if os.environ["RANK"] == "1":
                sys.exit(7)
            time.sleep(600)
        """,
    )
    logs = tmp_path / "logs"
    r = relaunch(
        "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=3600",
        "--log-dir", str(logs), s, timeout=80,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    names = [e["name"] for e in events(logs)]
    assert names.count("workers_started") == 2 and names[-2:] == [
        "workers_succeeded",
        "workers_stopped",
    ], names
    ready = tmp_path / "ready"
    s = script(
        tmp_path, "waits.py", f"import time; open({str(ready)!r}, 'w').close(); time.sleep(600)"
    )
    proc = subprocess.Popen(
        [PY, "-m", "relaunch", "--standalone", "--nproc-per-node=1", "--monitor-interval=3600", s],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        while not ready.exists() and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "SIGTERM" in err, err[-2000:]


@pytest.mark.timeout(90)
def test_exhausted_restarts_report_names_the_first_failure(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        "fail.py",
        """
        import os, sys, time
        from relaunch.errors import record

        @record
        def main():
            rank = int(os.environ["RANK"])
            if rank == 2:
                raise ValueError("rank two broke first")
            if rank == 0:
                time.sleep(1.0)
                raise KeyError("rank zero broke later")
            time.sleep(60)

        main()
        """,
    )
    r = relaunch("--standalone", "--nproc-per-node=4", "--max-restarts=1", s)
    assert r.returncode == 1
    report = r.stderr
    root = report.split("Root Cause")[1].split("Other Failures")[0]
    assert "ValueError: rank two broke first" in root
    assert "rank      : 2 (local_rank: 2)" in root, report
    # the worker's own traceback (written by @record): the raising line in fail.py's main
    assert "Traceback (most recent call last)" in root, report
    assert 'fail.py", line' in root and "in main" in root, report
    assert 'raise ValueError("rank two broke first")' in root, report
    assert report.count("Root Cause") == 1


@pytest.mark.timeout(90)
def test_sigkilled_worker_is_reported_with_signal_name(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        "kill.py",
        """
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
    )
    r = relaunch("--standalone", "--nproc-per-node=2", s)
    assert r.returncode == 1
    assert "SIGKILL" in r.stderr


@pytest.mark.timeout(90)
def test_tee_prefixes_lines_and_filter_hides_ranks(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        "hello.py",
        """
        import os, sys
        print("hello from", os.environ["LOCAL_RANK"])
        print("err from", os.environ["LOCAL_RANK"], file=sys.stderr)
        """,
    )
    logs = tmp_path / "logs"
    r = relaunch(
        "--standalone",
        "--nproc-per-node=3",
        "--tee=3",
        "--local-ranks-filter=0,2",
        "--log-dir",
        str(logs),
        s,
    )
    assert r.returncode == 0, r.stderr
    assert "[default0]:hello from 0" in r.stdout
    assert "[default2]:hello from 2" in r.stdout
    assert "hello from 1" not in r.stdout
    assert "[default0]:err from 0" in r.stderr
    files = sorted(
        p.relative_to(logs).as_posix().split("/", 1)[1]
        for p in logs.glob("*/attempt_0/*/stdout.log")
    )
    assert files == ["attempt_0/0/stdout.log", "attempt_0/1/stdout.log", "attempt_0/2/stdout.log"]
    assert "hello from 1" in next(logs.glob("*/attempt_0/1/stdout.log")).read_text()


@pytest.mark.timeout(90)
def test_module_binary_and_local_rank_macro(tmp_path: Path) -> None:
    pkg = tmp_path / "mymod.py"
    pkg.write_text(
        "import os, sys\nopen(sys.argv[1] + os.environ['LOCAL_RANK'], 'w').write(repr(sys.argv))\n"
    )
    out = tmp_path / "m_"
    r = relaunch(
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "mymod",
        str(out),
        env={"PYTHONPATH": str(tmp_path)},
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m_0").exists() and (tmp_path / "m_1").exists()
    r = relaunch(
        "--standalone",
        "--nproc-per-node=2",
        "--no-python",
        "sh",
        "-c",
        f"touch {tmp_path}/b_$0",
        "${local_rank}",
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "b_0").exists() and (tmp_path / "b_1").exists()
