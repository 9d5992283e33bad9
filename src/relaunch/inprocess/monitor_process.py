"""NVIDIA's ``inprocess.monitor_process`` module: the monitor process, one per rank, a
separate OS process that outlives its rank (it heartbeats, declares silent ranks
missing, kills its rank at ``hard_timeout`` and records its death at once).

Defined in the core (``_core/_monitor_process.py``, where the mechanism is
described): the wrapper forks it before anything else.
"""

from relaunch.inprocess._core import _monitor_process
from relaunch.inprocess._core._monitor_process import *  # noqa: F403  (the names of its __all__)

__all__ = list(_monitor_process.__all__)
