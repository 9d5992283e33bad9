"""The agent under real faults: signals, stubborn workers, grandchildren, the watchdog."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from multinode_support.waiting import wait_for
from relaunch.agent import LocalAgent, WorkerState
from relaunch.cli import parse_args
from relaunch.launcher import build_spec, create_rendezvous_handler

PY = sys.executable


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


@pytest.mark.timeout(60)
def test_sigterm_to_agent_leaves_no_process_behind(tmp_path: Path) -> None:
    # Each worker starts a grandchild in its group and one that escapes into its own session.
    s = script(
        tmp_path,
        "family.py",
        """
        import os, subprocess, sys, time
        out = sys.argv[1]
        a = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        with open(os.path.join(out, "pids_" + os.environ["LOCAL_RANK"]), "w") as f:
            f.write(f"{os.getpid()} {a.pid} {b.pid}")
        time.sleep(600)
        """,
    )
    agent = subprocess.Popen(
        [PY, "-m", "relaunch", "--standalone", "--nproc-per-node=2", s, str(tmp_path)],
        stderr=subprocess.PIPE,
        text=True,
    )
    files = [tmp_path / "pids_0", tmp_path / "pids_1"]
    wait_for(lambda: all(f.exists() and f.read_text().count(" ") == 2 for f in files))
    pids = [int(p) for f in files for p in f.read_text().split()]
    assert all(alive(p) for p in pids)
    agent.send_signal(signal.SIGTERM)
    _, err = agent.communicate(timeout=30)
    assert agent.returncode == 128 + signal.SIGTERM, err
    wait_for(lambda: not any(alive(p) for p in pids), timeout=10)


@pytest.mark.timeout(60)
def test_worker_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        "stubborn.py",
        """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(sys.argv[1], "up_" + os.environ["LOCAL_RANK"]), "w").close()
        if os.environ["LOCAL_RANK"] == "1":
            while not os.path.exists(os.path.join(sys.argv[1], "up_0")):
                time.sleep(0.01)
            sys.exit(3)
        time.sleep(600)
        """,
    )
    # the failed run keeps its logs (by design): in tmp_path, not in /tmp
    config = parse_args(
        ["--standalone", "--nproc-per-node=2", "--shutdown-timeout=0.5",
         f"--log-dir={tmp_path / 'logs'}", s, str(tmp_path)]
    )  # fmt: skip
    spec = build_spec(config, create_rendezvous_handler(config), dict(os.environ))
    assert spec.stop_grace == 0.5
    result = LocalAgent(spec).run()
    assert result.state == WorkerState.FAILED
    assert [f.exitcode for f in result.failures.values()] == [3]


@pytest.mark.timeout(60)
def test_watchdog_kills_an_overdue_worker(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        "overdue.py",
        """
        import time
        from relaunch.timer import expires
        with expires(after=0.5, scope="step"):
            time.sleep(600)
        """,
    )
    logs = tmp_path / "logs"
    r = subprocess.run(
        [PY, "-m", "relaunch", "--standalone", "--nproc-per-node=1", "--log-dir", str(logs), s],
        capture_output=True,
        text=True,
        timeout=45,
        env={**os.environ, "TORCHELASTIC_ENABLE_FILE_TIMER": "1"},
    )
    assert r.returncode == 1
    assert "SIGKILL" in r.stderr
    ev = [json.loads(x) for x in next(logs.glob("*/events.jsonl")).read_text().splitlines()]
    expired = [e for e in ev if e["name"] == "watchdog_expired"]
    assert expired and expired[0]["metadata"]["scope"] == "step"


@pytest.mark.timeout(90)
def test_forked_worker_runs_the_script_like_a_fresh_interpreter(tmp_path: Path) -> None:
    script(
        tmp_path,
        "probe.py",
        """
        import json, os, sys, time, warnings
        out = sys.argv[1]
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "plain")
        state = {
            "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
            "cwd": os.getcwd(), "main_file": sys.modules["__main__"].__file__,
            "spec": repr(__spec__), "unbuffered": sys.stdout.write_through,
            "main_has_probe": hasattr(sys.modules["__main__"], "json"),
        }
        try:
            raise ValueError("x")
        except ValueError as exc:
            state["tb_files"] = [f.f_code.co_filename for f in [exc.__traceback__.tb_frame]]
        name = f"state_{attempt}_{os.environ.get('LOCAL_RANK', '0')}.json"
        with open(os.path.join(out, name), "w") as f:
            json.dump(state, f)
        if attempt == "0":
            time.sleep(5)  # the fork server starts while we run
            sys.exit(1)
        """,
    )
    plain = subprocess.run(
        [PY, "-u", "probe.py", str(tmp_path), "x y"], cwd=tmp_path, capture_output=True, timeout=30
    )
    assert plain.returncode == 0, plain.stderr
    logs = tmp_path / "logs"
    r = subprocess.run(
        [
            PY, "-m", "relaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
            "--log-dir", str(logs), "probe.py", str(tmp_path), "x y",
        ],
        capture_output=True, text=True, timeout=80, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    ev = [json.loads(x) for x in next(logs.glob("*/events.jsonl")).read_text().splitlines()]
    started = [e for e in ev if e["name"] == "workers_started"]
    assert started[1]["metadata"]["forked"] == [0, 1]
    expected = json.loads((tmp_path / "state_plain_0.json").read_text())
    for lr in (0, 1):
        first = json.loads((tmp_path / f"state_0_{lr}.json").read_text())
        warm = json.loads((tmp_path / f"state_1_{lr}.json").read_text())
        assert first == expected
        assert warm == expected


@pytest.mark.timeout(60)
def test_workers_die_with_a_sigkilled_agent(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        "sleeper.py",
        """
        import os, sys, time
        open(os.path.join(sys.argv[1], "pid_" + os.environ["LOCAL_RANK"]), "w").write(str(os.getpid()))
        time.sleep(600)
        """,
    )
    # A SIGKILLed agent cannot remove its log directory: keep it in tmp_path.
    agent = subprocess.Popen(
        [PY, "-m", "relaunch", "--standalone", "--nproc-per-node=2",
         f"--log-dir={tmp_path / 'logs'}", s, str(tmp_path)],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    files = [tmp_path / "pid_0", tmp_path / "pid_1"]
    wait_for(lambda: all(f.exists() and f.read_text() for f in files))
    pids = [int(f.read_text()) for f in files]
    agent.kill()
    agent.wait(10)
    wait_for(lambda: not any(alive(p) for p in pids), timeout=10)


@pytest.mark.timeout(90)
def test_no_temp_dir_or_pipe_left_after_success_failure_or_signal(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "TORCHELASTIC_ENABLE_FILE_TIMER": "1"}
    ok = script(tmp_path, "ok.py", "print('fine')\n")
    bad = script(tmp_path, "bad.py", "raise SystemExit(4)\n")
    slow = script(tmp_path, "slow.py", "import time\ntime.sleep(600)\n")
    for s, code in ((ok, 0), (bad, 1)):
        r = subprocess.run(
            [PY, "-m", "relaunch", "--standalone", "--nproc-per-node=2", "--tee=3", s],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert r.returncode == code, r.stderr
        if code:  # a failed run keeps its run dir (error files), says where, and no pipe
            (kept,) = list(tmp.iterdir())
            assert str(kept) in r.stderr and list(kept.glob("*/events.jsonl"))
            assert not [p for p in kept.rglob("*") if p.is_fifo()]
            shutil.rmtree(kept)
        assert list(tmp.iterdir()) == []
    agent = subprocess.Popen(
        [PY, "-m", "relaunch", "--standalone", "--nproc-per-node=2", slow],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: any(tmp.iterdir()))
    time.sleep(0.5)
    agent.send_signal(signal.SIGINT)
    assert agent.wait(30) == 128 + signal.SIGINT
    assert list(tmp.iterdir()) == []
