"""Interruption records: why an iteration was interrupted (NVIDIA's
``inprocess.attribution``), as versioned JSON lines. Defined in the core, which
writes and reads them in the coordination store."""

from relaunch.inprocess._core import _records
from relaunch.inprocess._core._records import *  # noqa: F403  (the names of its __all__)

__all__ = list(_records.__all__)
