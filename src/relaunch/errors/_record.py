"""record(): write a worker's uncaught exception to its error file."""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from relaunch.errors._file import ERROR_FILE_ENV, NOT_AVAILABLE, build_error_data, write_error_file

__all__ = ["record"]

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def record(fn: Callable[_P, _R]) -> Callable[_P, _R | None]:
    """Decorate a worker's main function so its uncaught exception reaches the agent.

    On entry, :mod:`faulthandler` is enabled (all threads), as torch does. If ``fn`` raises:

    - an ``Exception``: it is written as JSON (torch's layout: message, traceback,
      timestamp) to the file named by ``TORCHELASTIC_ERROR_FILE`` (or only logged when the
      variable is unset), then re-raised;
    - a ``ChildFailedError`` (relaunch's or torch's): the root cause's error file is copied
      unchanged to this process's error file, then the error is re-raised;
    - ``SystemExit(0)``: success; the wrapper returns ``None`` and writes nothing;
    - any other ``BaseException`` (``SystemExit`` with another code, ``KeyboardInterrupt``):
      re-raised without writing, like torch.

    A failure to write the error file is logged; it never hides the original exception.
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        _enable_faulthandler()
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code == 0:
                return None
            raise
        except Exception as exc:
            if _is_child_failed(exc):
                _propagate_child_failure(exc)
            else:
                _record_exception(exc)
            raise

    return wrapper


def _enable_faulthandler() -> None:
    try:
        faulthandler.enable(all_threads=True)
    except (OSError, RuntimeError, ValueError) as exc:
        logger.warning("could not enable faulthandler: %s: %s", type(exc).__name__, exc)


def _is_child_failed(exc: Exception) -> bool:
    # relaunch's ChildFailedError and torch's share this interface; torch is not imported.
    named = any(cls.__name__ == "ChildFailedError" for cls in type(exc).__mro__)
    return named and callable(getattr(exc, "get_first_failure", None))


def _record_exception(exc: Exception) -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    data = build_error_data(exc)
    if not path:
        logger.error(
            "%s: %s (%s is not set; the error is not recorded to a file)",
            type(exc).__name__,
            exc,
            ERROR_FILE_ENV,
        )
        return
    try:
        write_error_file(path, data)
    except OSError as write_exc:
        logger.error("could not write error file %s: %s", path, write_exc)


def _propagate_child_failure(exc: Exception) -> None:
    rank: Any
    failure: Any
    rank, failure = exc.get_first_failure()  # type: ignore[attr-defined]
    child_file = getattr(failure, "error_file", NOT_AVAILABLE)
    my_file = os.environ.get(ERROR_FILE_ENV)
    if not isinstance(child_file, str) or child_file == NOT_AVAILABLE:
        logger.info(
            "rank %s failed with no error file; decorate its entrypoint with @record "
            "for a traceback",
            rank,
        )
        return
    if not my_file:
        logger.error(
            "%s is not set: cannot copy the error file %s of failed rank %s",
            ERROR_FILE_ENV,
            child_file,
            rank,
        )
        return
    try:
        with open(child_file, "rb") as fp:
            content = fp.read()
        if os.path.abspath(child_file) != os.path.abspath(my_file):
            write_error_file(my_file, content)
    except OSError as copy_exc:
        logger.error("could not copy error file %s to %s: %s", child_file, my_file, copy_exc)
