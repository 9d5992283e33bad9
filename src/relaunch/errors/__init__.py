"""Errors of relaunch and error propagation from workers to the agent.

The exception tree is documented in :mod:`relaunch.errors._exceptions`.

Worker side: decorate the main function with :func:`record`; an uncaught exception is
written to ``TORCHELASTIC_ERROR_FILE`` in torch's JSON layout. Agent side: build a
:class:`ProcessFailure` per failed process (it reads the error file, never raising on a
corrupt one) and raise :class:`ChildFailedError` with the root cause first.
"""

from relaunch.errors._exceptions import (
    ConfigError,
    InProcessError,
    RelaunchError,
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
    SnapshotError,
    StatusError,
    StoreClosedError,
    StoreConnectionError,
    StoreError,
    StoreLostError,
    StoreTimeoutError,
    TimerError,
    WorkerError,
)
from relaunch.errors._failure import FailureFormatError, ProcessFailure
from relaunch.errors._file import (
    ERROR_FILE_ENV,
    ErrorFileProblem,
    ErrorRecord,
    ProblemKind,
    build_error_data,
    read_error_file,
    write_error_file,
)
from relaunch.errors._record import record
from relaunch.errors._report import ChildFailedError

__all__ = [
    "ERROR_FILE_ENV",
    "ChildFailedError",
    "ConfigError",
    "ErrorFileProblem",
    "ErrorRecord",
    "FailureFormatError",
    "InProcessError",
    "ProblemKind",
    "ProcessFailure",
    "RelaunchError",
    "RendezvousClosedError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "SnapshotError",
    "StatusError",
    "StoreClosedError",
    "StoreConnectionError",
    "StoreError",
    "StoreLostError",
    "StoreTimeoutError",
    "TimerError",
    "WorkerError",
    "build_error_data",
    "read_error_file",
    "record",
    "write_error_file",
]
