"""ChildFailedError: the report of a failed worker group, root cause first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relaunch._text import printable
from relaunch.errors._exceptions import ConfigError, WorkerError
from relaunch.errors._failure import FailureFormatError, ProcessFailure

__all__ = ["ChildFailedError"]

_MAX_WIDTH = 60
#: Version of the JSON produced by :meth:`ChildFailedError.to_json`.
REPORT_JSON_VERSION = 1


class ChildFailedError(WorkerError):
    """Worker processes failed; carries one :class:`ProcessFailure` per failed global rank.

    The root cause is the failure with the earliest timestamp (ties broken by the precise
    time, then by the lowest rank). ``str(error)`` is :meth:`format_msg`.

    Raising it inside a function decorated with :func:`relaunch.errors.record` copies the
    root cause's error file, unchanged, to this process's own error file.

    Raises:
        ConfigError: ``failures`` is empty.
    """

    def __init__(self, name: str, failures: Mapping[int, ProcessFailure]) -> None:
        if not failures:
            raise ConfigError("ChildFailedError: failures must name at least one failed rank")
        self.name = name
        self.failures: dict[int, ProcessFailure] = dict(failures)
        super().__init__(self.format_msg())

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.failures))

    def to_json(self) -> dict[str, Any]:
        """A versioned JSON-serializable dict (for publishing the report to other nodes)."""
        return {
            "version": REPORT_JSON_VERSION,
            "name": self.name,
            "failures": {str(rank): f.to_json() for rank, f in self.failures.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> ChildFailedError:
        """Rebuild a report from :meth:`to_json` output.

        Raises:
            FailureFormatError: ``data`` is malformed or of an unknown version.
        """
        if not isinstance(data, dict) or data.get("version") != REPORT_JSON_VERSION:
            raise FailureFormatError(
                f"failure report must be an object with version {REPORT_JSON_VERSION}"
            )
        name, failures = data.get("name"), data.get("failures")
        if not isinstance(name, str) or not isinstance(failures, dict) or not failures:
            raise FailureFormatError(
                "failure report needs a string 'name' and a non-empty 'failures' object"
            )
        parsed: dict[int, ProcessFailure] = {}
        for rank, failure in failures.items():
            try:
                parsed[int(rank)] = ProcessFailure.from_json(failure)
            except ValueError as exc:  # FailureFormatError is a ValueError too
                raise FailureFormatError(f"failure report, rank {rank!r}: {exc}") from exc
        return cls(name, parsed)

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """Return ``(global_rank, failure)`` of the root cause (the earliest failure)."""
        rank = min(
            self.failures,
            key=lambda r: (self.failures[r].timestamp, self.failures[r].time, r),
        )
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """A readable multi-line report: header, root cause, then the other failures."""
        title = f"{self.name} FAILED"
        root_rank, root = self.get_first_failure()
        root_text = _format_failure(0, root_rank, root)
        others = [
            _format_failure(idx, rank, failure)
            for idx, (rank, failure) in enumerate(
                ((r, f) for r, f in sorted(self.failures.items()) if r != root_rank), start=1
            )
        ]
        width = max(len(line) for text in [title, root_text, *others] for line in text.split("\n"))
        width = min(width, _MAX_WIDTH)
        border = boarder_delim * width
        section = section_delim * width
        lines = [
            "",
            border,
            title,
            section,
            "Root Cause (first observed failure):",
            root_text,
            section,
            "Other Failures:",
            "\n".join(others) if others else "  <NO_OTHER_FAILURES>",
            border,
        ]
        return "\n".join(lines)


def _format_failure(idx: int, rank: int, failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        exit_text = f"{failure.exitcode} ({failure.signal_name()}, pid: {failure.pid})"
    else:
        exit_text = f"{failure.exitcode} (pid: {failure.pid})"
    detail = failure.traceback if failure.traceback else failure.message
    detail = printable(detail.rstrip("\n"), keep_newlines=True).replace("\n", "\n    ")
    rows = [
        f"[{idx}]:",
        f"  time      : {failure.timecode}",
        f"  host      : {printable(failure.hostname)}",
        f"  rank      : {rank} (local_rank: {failure.local_rank})",
        f"  exitcode  : {exit_text}",
        f"  error_file: {printable(failure.error_file)}",
    ]
    if failure.traceback and failure.message not in failure.traceback:
        rows.append(f"  message   : {printable(failure.message)}")
    rows.append(f"  traceback : {detail}")
    return "\n".join(rows)
