"""What the runner (``_warm.py``) installs in a worker: process groups kept alive to the
end of the process, the progress probe for ``--hang-timeout``, the stack dump.

This file runs beside ``_warm.py``, outside the relaunch package: it must import
nothing of relaunch.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import importlib.abc
import os
import sys
import threading
import time
import types
from typing import Any

# -- process groups kept alive -------------------------------------------------------
_kept_groups: dict[int, Any] = {}


def _live_groups() -> list[Any]:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None)
    try:
        return list(pg_map) if pg_map else []
    except RuntimeError:  # changed size while read from another thread
        return []


def _keep_live_groups() -> None:
    for group in _live_groups():
        _kept_groups.setdefault(id(group), group)


def _patch_destroy(module: Any) -> None:
    """Make ``module.destroy_process_group`` keep a reference to the groups it destroys."""
    original = getattr(module, "destroy_process_group", None)
    if original is None or getattr(original, "__relaunch_keeps_groups__", False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        _keep_live_groups()
        return original(*args, **kwargs)

    destroy_process_group.__relaunch_keeps_groups__ = True  # type: ignore[attr-defined]
    destroy_process_group.__relaunch_take_kept__ = _take_kept  # type: ignore[attr-defined]
    module.destroy_process_group = destroy_process_group


def _take_kept() -> dict[int, Any]:
    """Hand over (and forget) the groups kept so far: the in-process wrapper takes them
    once a failed iteration's objects are freed, and drops them (they must not outlive
    the iteration: a program's own multi-tenant TCPStore would keep the old keys)."""
    kept = dict(_kept_groups)
    _kept_groups.clear()
    return kept


class _GroupKeeper(importlib.abc.MetaPathFinder):
    """Patches torch.distributed's ``destroy_process_group`` as soon as it is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.distributed.distributed_c10d":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def patched(module: types.ModuleType, _exec: Any = exec_module) -> None:
                    _exec(module)
                    _patch_destroy(module)

                spec.loader.exec_module = patched  # type: ignore[method-assign]
                return spec
        return None


def install_group_keeper() -> None:
    """Keep every process group alive until the process exits (see the module docstring)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None:
        _patch_destroy(c10d)
        _patch_destroy(sys.modules.get("torch.distributed"))
    elif not any(isinstance(f, _GroupKeeper) for f in sys.meta_path):
        sys.meta_path.insert(0, _GroupKeeper())


def immortalize_groups() -> None:
    """Never destroy the groups seen: the process is ending, the OS frees them."""
    _keep_live_groups()
    for group in _kept_groups.values():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


# -- progress (hang detection) -------------------------------------------------------
class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _start_progress(path: str, timeout: float, probe: float = 0.02) -> None:
    """Keep ``path``'s mtime at the last time the main thread ran Python code.

    A daemon thread queues a pending call (libc's ``sem_post``: the interpreter runs
    it between two bytecodes of the main thread) every ``probe`` seconds. While the
    main thread answers, the mtime is refreshed every ``timeout / 10`` seconds; when
    it stops answering, the mtime is set once to its last answer, precise to
    ``probe``: of ranks blocked together, the one that stopped first is the cause.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    sem = ctypes.create_string_buffer(64)  # sem_t is 32 bytes on 64-bit Linux
    if libc.sem_init(sem, 0, 0) != 0:
        return
    add_pending = ctypes.pythonapi.Py_AddPendingCall
    add_pending.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    add_pending.restype = ctypes.c_int
    post = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
    refresh = min(1.0, max(probe, timeout / 10))
    with contextlib.suppress(OSError):
        open(path, "a").close()

    def stamp(when: float) -> None:
        with contextlib.suppress(OSError):
            os.utime(path, (when, when))

    def run() -> None:
        queued = False
        last_ok = written = time.time()
        stalled = False
        while True:
            if not queued:
                queued = add_pending(post, ctypes.addressof(sem)) == 0
            deadline = time.time() + probe
            spec = _Timespec(int(deadline), int((deadline % 1) * 1e9))
            now = time.time()
            if queued and libc.sem_timedwait(sem, ctypes.byref(spec)) == 0:
                queued, stalled, last_ok = False, False, time.time()
                if last_ok - written >= refresh:
                    stamp(last_ok)
                    written = last_ok
                time.sleep(max(0.0, deadline - time.time()))
            elif not stalled and now - last_ok >= 5 * probe:
                stalled = True
                stamp(last_ok)
                written = last_ok

    threading.Thread(target=run, name="relaunch-progress", daemon=True).start()


def install_progress_and_stacks() -> None:
    progress = os.environ.get("RELAUNCH_PROGRESS_FILE")
    if progress:
        with contextlib.suppress(ValueError):
            _start_progress(progress, float(os.environ.get("RELAUNCH_HANG_TIMEOUT", "0")))
    stack_file, stack_signal = (
        os.environ.get("RELAUNCH_STACK_FILE"),
        os.environ.get("RELAUNCH_STACK_SIGNAL"),
    )
    if stack_file and stack_signal:
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            out = open(stack_file, "w")  # noqa: SIM115 - kept open for the signal handler
            faulthandler.register(int(stack_signal), file=out, all_threads=True, chain=False)
