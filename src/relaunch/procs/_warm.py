"""The runner of every Python worker: ``python -u _warm.py FD``.

The agent starts it (or forks it from the fork server, ``_zygote.py``) and writes
one request (versioned JSON: environment, working directory, output files, what to
run) on file descriptor FD; the interpreter then becomes that worker, running the
script or module exactly as ``python -u script.py args...`` or ``python -u -m
module args...`` would: same ``sys.argv``, ``__main__``, ``sys.path[0]``,
environment and tracebacks. End of file without a request means "not needed": it
exits 0.

What the runner adds to a plain ``python script.py`` (the worker contract, defined in
``relaunch/_contract.py``, which the runner loads by path; the agent sets the variables):

- ``RELAUNCH_EXIT_FILE``: when the script ends, the runner writes how *before* the
  interpreter tears down (atexit handlers, gloo threads: seconds). A non-zero code
  (it raised or exited non-zero) has the agent restart the group at once; 0 (it
  returned or exited 0) makes the worker succeeded, whatever the teardown does next
  (an atexit handler or a C++ destructor that aborts, a hang). Only the process the
  runner started announces: a child the script forked (``os.fork``) that unwinds
  through the runner does not. When the script raised, the runner also writes the
  error file (``TORCHELASTIC_ERROR_FILE``) with the traceback if the script did not
  (no ``@record``).
- Process groups are kept alive to the end of the process: torch's teardown of a
  DDP model whose process group was destroyed first deadlocks under the GIL
  (``~Reducer -> ~ProcessGroupGloo -> join`` while a gloo thread waits for the GIL).
- ``RELAUNCH_PROGRESS_FILE``: a daemon thread touches it whenever the main thread
  runs Python code (checked with a pending call, like the in-process watchdog), so
  the agent can find a hung worker; ``RELAUNCH_STACK_FILE`` receives the Python
  stacks (faulthandler) when the agent sends ``RELAUNCH_STACK_SIGNAL``.
- A worker whose rank has a snapshot in node memory: a thread reads the newest back
  while the script starts (``relaunch.checkpoint``; the one import of relaunch here).
- ``report_modules``: a daemon thread keeps a list of the modules this worker
  imported current during its first two minutes, for the fork server to preload.

This file runs by path, outside the relaunch package: it imports nothing of relaunch
(the contract module is loaded from its file: standard library only) but
``relaunch.checkpoint``, in a worker that has a snapshot to read back.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib
import importlib.machinery
import importlib.util
import json
import os
import runpy
import sys
import sysconfig
import threading
import time
import traceback
import types
import zipfile

import _worker_hooks  # type: ignore[import-not-found]  # beside this file (sys.path[0])

REQUEST_VERSION = 1


def _load_contract() -> types.ModuleType:
    """``relaunch/_contract.py``, by path (this file runs outside the package)."""
    name = "_relaunch_worker_contract"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_contract.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_contract = _load_contract()


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


def set_parent_death_signal(sig: int = 9) -> bool:
    """SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``).

    prctl is variadic: its arguments must be passed as full ``unsigned long`` words
    (a plain int leaves the register's upper half undefined, and the call may fail).
    Returns whether the signal is set (read back with ``PR_GET_PDEATHSIG``).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    word = ctypes.c_ulong
    libc.prctl(ctypes.c_int(1), word(sig), word(0), word(0), word(0))
    got = ctypes.c_int(0)
    libc.prctl(ctypes.c_int(2), ctypes.byref(got), word(0), word(0), word(0))
    return got.value == sig


def _write_atomic(path: str, data: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(data)
    os.replace(tmp, path)


# -- the modules a worker imports ---------------------------------------------------
def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots)


def _imported_modules(known: dict[str, bool] | None = None) -> list[str]:
    """Modules imported so far that come from the standard library or installed packages.

    ``known``: each module's answer from an earlier call, kept there (a worker that
    imports torch holds about a thousand modules, each a ``realpath`` of its file: a
    tenth of a second of CPU a pass, taken from the imports it runs beside)."""
    roots = _installed_roots()
    seen = {} if known is None else known
    names = []
    for name, module in list(sys.modules.items()):
        installed = seen.get(name)
        if installed is None:
            path = getattr(module, "__file__", None)
            installed = isinstance(path, str) and os.path.realpath(path).startswith(roots)
            seen[name] = installed
        if installed and name not in ("__main__", "__mp_main__"):
            names.append(name)
    return names


def _report_modules(path: str, period: float = 1.0, duration: float = 120.0) -> None:
    """Keep ``path`` listing this worker's imports, rewritten whenever it imported more."""

    def run() -> None:
        end = time.monotonic() + duration
        written = -1
        known: dict[str, bool] = {}
        while time.monotonic() < end:
            time.sleep(period)
            count = len(sys.modules)
            if count == written:
                continue
            written = count
            with contextlib.suppress(OSError):
                _write_atomic(path, "\n".join(_imported_modules(known)) + "\n")

    threading.Thread(target=run, name="relaunch-report-modules", daemon=True).start()


# -- becoming the worker -------------------------------------------------------------
def become_worker(request: dict[str, object]) -> None:
    """Run the request's script, module or function in this process (see the module doc)."""
    if request.get("version") != REQUEST_VERSION:
        raise SystemExit(f"relaunch runner: unsupported request version {request.get('version')!r}")
    cwd, env = request.get("cwd"), request.get("env")
    kind, target, args = request.get("kind"), request.get("target"), request.get("args")
    if not (
        isinstance(cwd, str)
        and isinstance(env, dict)
        and kind in ("script", "module", "function")
        and isinstance(target, str)
        and isinstance(args, list)
    ):
        raise SystemExit("relaunch runner: malformed request")
    os.chdir(cwd)
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(str(key)) != str(value):
            os.environ[str(key)] = str(value)
    stdout, stderr = request.get("stdout"), request.get("stderr")
    _redirect(stdout if isinstance(stdout, str) else None, 1)
    _redirect(stderr if isinstance(stderr, str) else None, 2)
    report = request.get("report_modules")
    if isinstance(report, str):
        _report_modules(report)
    _worker_hooks.install_progress_and_stacks()
    _worker_hooks.install_group_keeper()
    _start_snapshot_prefetch()
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


def _start_snapshot_prefetch() -> None:
    """A worker whose rank has a snapshot in node memory (a restart; a node that took a
    lost node's ranks): start reading the newest back now, beside the script's imports
    and its model's construction; ``checkpoint.load()`` takes it. Only such a worker
    imports relaunch (and torch) here: the script that saved those snapshots did."""
    if not _contract.snapshot_to_prefetch(os.environ):
        return
    try:
        from relaunch import checkpoint

        checkpoint._prefetch()
    except Exception as exc:  # load() reads the snapshot itself, and says what fails
        print(f"relaunch runner: snapshot not read ahead ({exc!r})", file=sys.stderr)


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


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _announce_exit(code: int, worker: int) -> None:
    """Tell the agent this worker is done with ``code`` before the slow interpreter
    teardown (0: it succeeded, whatever the teardown does). ``worker``: the pid that
    runs the script; a process it forked does not speak for it."""
    path = os.environ.get(_contract.EXIT_FILE_ENV)
    if not path or os.getpid() != worker:
        return
    with contextlib.suppress(OSError):
        _write_atomic(path, json.dumps(_contract.exit_record(code, time.time())))


def _write_error_file(exc: BaseException, tb: types.TracebackType | None) -> None:
    """The error file in torch's layout, unless the script wrote one (``@record``)."""
    path = os.environ.get(_contract.ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        return
    data = _contract.error_record(
        f"{type(exc).__name__}: {exc}",
        "".join(traceback.format_exception(type(exc), exc, tb)),
        time.time(),
    )
    with contextlib.suppress(OSError, TypeError, ValueError):
        _write_atomic(path, json.dumps(data))


def run_request(request: dict[str, object]) -> None:
    """Become the worker; report how it ended; exit as ``python script.py`` would."""
    worker = os.getpid()
    try:
        become_worker(request)
    except KeyboardInterrupt:
        _announce_exit(-2, worker)  # Python exits by SIGINT then
        _worker_hooks.immortalize_groups()
        raise
    except SystemExit as exc:
        _announce_exit(_exit_code(exc), worker)
        _worker_hooks.immortalize_groups()
        raise
    except BaseException as exc:
        # Print it as `python script.py` would: without this runner's and runpy's frames.
        tb = exc.__traceback__
        ours = (__file__, runpy.__file__, "<frozen runpy>")
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        _write_error_file(exc, tb)
        _announce_exit(1, worker)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        _worker_hooks.immortalize_groups()
        sys.exit(1)
    _announce_exit(0, worker)  # it returned: done, whatever the teardown does
    _worker_hooks.immortalize_groups()


def main() -> None:
    fd = int(sys.argv[1])
    del sys.path[0]  # this file's directory: the worker gets its own sys.path[0]
    data = _read_all(fd)
    os.close(fd)
    if not data:
        return
    request = json.loads(data)
    if not isinstance(request, dict):
        raise SystemExit("relaunch runner: malformed request")
    sys.argv = sys.argv[:1]  # drop what this module got: the worker starts from a clean slate
    run_request(request)


if __name__ == "__main__":
    main()
