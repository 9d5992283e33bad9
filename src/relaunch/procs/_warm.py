"""The program of a warm standby interpreter: ``python -u _warm.py FD [PRELOAD_FILE]``.

It imports the modules listed in PRELOAD_FILE (one per line: what a worker of
this job imported from installed packages) ahead of time, then blocks reading
file descriptor FD. The agent writes one request
(versioned JSON: environment changes, working directory, output files, what to
run) and closes the pipe; the interpreter then becomes that worker, running the
script or module exactly as ``python -u script.py args...`` or
``python -u -m module args...`` would: same ``sys.argv``, ``__main__``,
``sys.path[0]`` and environment. End of file without a request means "not
needed": it exits 0.

A worker may be asked to report the modules it imported (``report_modules``):
a daemon thread keeps the list current during its first two minutes, so the
standbys of the next attempt can preload what this job really uses.

This file runs by path, outside the relaunch package: it must import nothing of relaunch.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.machinery
import json
import os
import runpy
import select
import sys
import sysconfig
import threading
import time
import types
import zipfile

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


def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots)


def _imported_modules() -> list[str]:
    """Modules imported so far that come from the standard library or installed packages."""
    roots = _installed_roots()
    names = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name in ("__main__", "__mp_main__") or not isinstance(path, str):
            continue
        if os.path.realpath(path).startswith(roots):
            names.append(name)
    return names


def _report_modules(path: str, period: float = 1.0, duration: float = 120.0) -> None:
    """Keep ``path`` listing this worker's imports, rewritten whenever it imported more.

    A daemon thread checks ``len(sys.modules)`` once a second for ``duration`` seconds:
    the standbys that preload the list follow the worker's start closely.
    """

    def run() -> None:
        end = time.monotonic() + duration
        written = -1
        while time.monotonic() < end:
            time.sleep(period)
            count = len(sys.modules)
            if count == written:
                continue
            written = count
            with contextlib.suppress(OSError):
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write("\n".join(_imported_modules()) + "\n")
                os.replace(tmp, path)

    threading.Thread(target=run, name="relaunch-report-modules", daemon=True).start()


def _preload(path: str) -> None:
    try:
        with open(path) as f:
            names = [line.strip() for line in f if line.strip()]
    except OSError:
        return
    for name in names:
        if name in sys.modules:
            continue
        with contextlib.suppress(BaseException):
            importlib.import_module(name)


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
        and kind in ("script", "module", "function")
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
    report = request.get("report_modules")
    if isinstance(report, str):
        _report_modules(report)
    argv = [str(a) for a in args]
    if kind == "script":
        sys.argv = [target, *argv]
        sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
        _run_script(os.path.abspath(target))
    elif kind == "module":
        sys.argv = [target, *argv]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        _call_function(target, request)


def _run_script(path: str) -> None:
    """Run a script file exactly as ``python path`` does; directories and zips via runpy."""
    if not os.path.isfile(path) or zipfile.is_zipfile(path):
        runpy.run_path(path, run_name="__main__")
        return
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _call_function(target: str, request: dict[str, object]) -> None:
    """``module:qualname`` or ``/path/script.py:qualname``; JSON args in, JSON result out."""
    where, _, qualname = target.rpartition(":")
    sys.path.insert(0, os.getcwd())
    if where.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.realpath(where)))
        namespace = runpy.run_path(where, run_name="__mp_main__")
        obj: object = namespace[qualname.split(".")[0]]
        for part in qualname.split(".")[1:]:
            obj = getattr(obj, part)
    else:
        obj = importlib.import_module(where)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    call_args = request.get("call_args", [])
    if not callable(obj) or not isinstance(call_args, list):
        raise SystemExit(f"relaunch: {target!r} is not a function taking a JSON list")
    value = obj(*call_args)
    result_file = request.get("result_file")
    if isinstance(result_file, str):
        try:
            data = json.dumps({"version": 1, "value": value})
        except (TypeError, ValueError):
            data = json.dumps({"version": 1, "unserializable": repr(value)[:2000]})
        with open(result_file, "w") as f:
            f.write(data)


def main() -> None:
    fd = int(sys.argv[1])
    del sys.path[0]  # this file's directory: the worker gets its own sys.path[0]
    preload = sys.argv[2] if len(sys.argv) > 2 else None
    seen = -1.0
    while True:
        # Preload what the job's workers import; take in later reports while idle.
        if preload is not None:
            with contextlib.suppress(OSError):
                mtime = os.stat(preload).st_mtime
                if mtime != seen:
                    seen = mtime
                    _preload(preload)
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            break
    data = _read_all(fd)
    os.close(fd)
    if not data:
        return
    request = json.loads(data)
    if not isinstance(request, dict):
        raise SystemExit("relaunch standby: malformed request")
    # Drop what this module added so the worker starts from a clean slate.
    sys.argv = sys.argv[:1]
    try:
        _become_worker(request)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        # Print it as `python script.py` would: without this runner's and runpy's frames.
        tb = exc.__traceback__
        ours = (__file__, runpy.__file__, "<frozen runpy>")
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(1)


if __name__ == "__main__":
    main()
