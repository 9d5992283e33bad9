"""A fresh runner interpreter (``_warm.py``) that becomes a worker on :meth:`Standby.activate`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from relaunch._children import track
from relaunch.errors import WorkerError
from relaunch.procs._sys import child_preexec

__all__ = ["Standby"]

log = logging.getLogger(__name__)

_WARM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_warm.py")
_MAX_REQUEST = 60 * 1024  # below the pipe's capacity: writing never blocks


class Standby:
    """One runner interpreter, started with ``env``, that becomes a worker on :meth:`activate`.

    The caller owns it: either :meth:`activate` hands the process over as a worker
    (the caller then owns the returned Popen), or :meth:`discard` ends it.
    """

    def __init__(self, *, env: Mapping[str, str], cwd: str) -> None:
        read_fd, self._write_fd = os.pipe()
        try:
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-u", _WARM, str(read_fd)],
                env=dict(env),
                cwd=cwd,
                pass_fds=(read_fd,),
                start_new_session=True,
                preexec_fn=child_preexec(),
            )
            track(self._proc)
        except BaseException:
            os.close(self._write_fd)
            raise
        finally:
            os.close(read_fd)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def activate(self, request: Mapping[str, Any]) -> subprocess.Popen[bytes] | None:
        """Turn the runner into a worker; ``None`` if it cannot (the caller spawns afresh)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self.discard()
            return None
        try:
            data = json.dumps(dict(request)).encode()
        except (TypeError, ValueError) as exc:
            self.discard()
            raise WorkerError(f"function arguments must be JSON data: {exc}") from exc
        if len(data) > _MAX_REQUEST:
            log.info("runner request too large (%d bytes); starting a plain worker", len(data))
            self.discard()
            return None
        try:
            os.write(self._write_fd, data)
        except OSError:
            self.discard()
            return None
        os.close(self._write_fd)
        self._write_fd = -1
        self._proc = None
        return proc

    def discard(self, timeout: float = 5.0) -> None:
        """End the runner (end of file tells it to exit; killed if it lingers). Idempotent."""
        if self._write_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._write_fd)
            self._write_fd = -1
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, 9)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL did not work
            log.warning("runner %s did not exit after SIGKILL", proc.pid)
