"""The restart state of one rank (NVIDIA's ``inprocess.state``: ``State``, ``Mode``,
``FrozenState``), defined in the core: the engine builds and exchanges them.

The wrapper hands callbacks a :class:`FrozenState` (read-only); rank assignments get
and return a :class:`State` in a :class:`~relaunch.inprocess.rank_assignment.RankAssignmentCtx`.
Internally the wrapper never mutates a state it shared: it builds new ones with
:func:`dataclasses.replace`.
"""

from relaunch.inprocess._core import _state
from relaunch.inprocess._core._state import *  # noqa: F403  (the names of its __all__)

__all__ = list(_state.__all__)
