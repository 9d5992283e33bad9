"""The program of a warm standby interpreter: ``python -u -m relaunch.procs._warm FD MOD...``.

It imports the modules named on its command line (``torch`` and friends) ahead
of time, then blocks reading file descriptor FD. The agent writes one request
(versioned JSON: environment changes, working directory, output files, what to
run) and closes the pipe; the interpreter then becomes that worker, running the
script or module exactly as ``python -u script.py args...`` or
``python -u -m module args...`` would: same ``sys.argv``, ``__main__``,
``sys.path[0]`` and environment. End of file without a request means "not
needed": it exits 0.

This module must stay import-light and must not import relaunch's other modules.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import sys

REQUEST_VERSION = 1


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _redirect(path: str | None, target_fd: int) -> None:
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, target_fd)
    os.close(fd)


def _become_worker(request: dict[str, object]) -> None:
    if request.get("version") != REQUEST_VERSION:
        raise SystemExit(
            f"relaunch standby: unsupported request version {request.get('version')!r}"
        )
    cwd = request["cwd"]
    env_set = request["env_set"]
    env_unset = request["env_unset"]
    kind = request["kind"]
    target = request["target"]
    args = request["args"]
    if not (
        isinstance(cwd, str)
        and isinstance(env_set, dict)
        and isinstance(env_unset, list)
        and kind in ("script", "module")
        and isinstance(target, str)
        and isinstance(args, list)
    ):
        raise SystemExit("relaunch standby: malformed request")
    os.chdir(cwd)
    for key in env_unset:
        os.environ.pop(str(key), None)
    for key, value in env_set.items():
        os.environ[str(key)] = str(value)
    stdout = request.get("stdout")
    stderr = request.get("stderr")
    _redirect(stdout if isinstance(stdout, str) else None, 1)
    _redirect(stderr if isinstance(stderr, str) else None, 2)
    argv = [str(a) for a in args]
    if kind == "script":
        sys.argv = [target, *argv]
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = [target, *argv]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def main() -> None:
    fd = int(sys.argv[1])
    for name in sys.argv[2:]:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    data = _read_all(fd)
    os.close(fd)
    if not data:
        return
    request = json.loads(data)
    if not isinstance(request, dict):
        raise SystemExit("relaunch standby: malformed request")
    # Drop what this module added so the worker starts from a clean slate.
    sys.argv = sys.argv[:1]
    _become_worker(request)


if __name__ == "__main__":
    main()
