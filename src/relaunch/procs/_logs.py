"""Per-run and per-attempt log directories, and the tailer that tees worker output."""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RunLogDir", "Std", "TeeTailer", "TeeTarget"]

log = logging.getLogger(__name__)


class Std(enum.IntFlag):
    """Which standard streams of a worker go to its log files (redirect) or to both (tee)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def to_map(cls, value: Std | Mapping[int, Std], nproc_per_node: int) -> dict[int, Std]:
        """One entry per local rank ``0..nproc_per_node-1``; ranks not in a mapping get NONE."""
        if isinstance(value, Std):
            return dict.fromkeys(range(nproc_per_node), value)
        return {rank: cls(value.get(rank, cls.NONE)) for rank in range(nproc_per_node)}


class RunLogDir:
    """``<log_dir>/<run_id>_<uid>/``; with no ``log_dir``, a temp dir removed at :meth:`close`."""

    def __init__(self, log_dir: str | None, run_id: str) -> None:
        self._temp_root: str | None = None
        if log_dir is None:
            self._temp_root = tempfile.mkdtemp(prefix="relaunch_")
            base = self._temp_root
        else:
            if os.path.isfile(log_dir):
                raise NotADirectoryError(f"--log-dir {log_dir!r} is a file")
            os.makedirs(log_dir, exist_ok=True)
            base = log_dir
        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id) or "run"
        self.path = tempfile.mkdtemp(prefix=f"{safe_id}_", dir=base)

    @property
    def is_temporary(self) -> bool:
        return self._temp_root is not None

    def attempt_dir(self, attempt: int, local_rank: int) -> str:
        """Create (fresh) and return ``attempt_<attempt>/<local_rank>/``."""
        path = os.path.join(self.path, f"attempt_{attempt}", str(local_rank))
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def close(self, *, keep: bool = False) -> str | None:
        """Remove the directory if it is a temporary one, unless ``keep`` (a failed run:
        its error files stay for the report). Returns the kept temporary path, if any.
        Idempotent."""
        root, self._temp_root = self._temp_root, None
        if root is None:
            return None
        if keep:
            return self.path
        shutil.rmtree(root, ignore_errors=True)
        return None


@dataclass(frozen=True)
class TeeTarget:
    path: str
    prefix: str
    dst_fd: int


class TeeTailer:
    """Copies new lines of worker log files to the console, each with a prefix.

    One named thread per attempt; :meth:`close` drains what is left and joins it.
    """

    def __init__(self, targets: list[TeeTarget], *, interval: float = 0.05, name: str = "") -> None:
        self._targets = targets
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"relaunch-tee{('-' + name) if name else ''}", daemon=True
        )
        self._files: dict[str, object] = {}

    def start(self) -> TeeTailer:
        if self._targets:
            self._thread.start()
        return self

    def _pump(self, offsets: dict[int, int], partial: dict[int, bytes], final: bool) -> None:
        for i, target in enumerate(self._targets):
            try:
                with open(target.path, "rb") as f:
                    f.seek(offsets.get(i, 0))
                    data = f.read()
                    offsets[i] = f.tell()
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.debug("tee: cannot read %s: %s", target.path, exc)
                continue
            buf = partial.get(i, b"") + data
            lines = buf.split(b"\n")
            rest = lines.pop()
            if final and rest:
                lines.append(rest)
                rest = b""
            partial[i] = rest
            if lines:
                prefix = target.prefix.encode()
                out = b"".join(prefix + line + b"\n" for line in lines)
                with contextlib.suppress(OSError):
                    os.write(target.dst_fd, out)

    def _run(self) -> None:
        offsets: dict[int, int] = {}
        partial: dict[int, bytes] = {}
        while not self._stop.wait(self._interval):
            self._pump(offsets, partial, final=False)
        self._pump(offsets, partial, final=True)

    def close(self, timeout: float = 5.0) -> None:
        """Print what is left and stop. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
