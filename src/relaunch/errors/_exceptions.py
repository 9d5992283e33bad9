"""The one exception tree of relaunch.

Every error relaunch raises on purpose derives from :class:`RelaunchError`::

    RelaunchError
    ├── ConfigError                 a flag, config value or parameter is invalid (also ValueError)
    ├── StoreError                  the key-value store failed
    │   ├── StoreTimeoutError       a wait or get did not finish in time (also TimeoutError)
    │   ├── StoreClosedError        we closed the store; using it afterwards is a bug
    │   └── StoreConnectionError    the server or peer broke the connection, or cannot be reached
    │       └── StoreLostError      the store is gone for good (its quorum lost): nothing is tried
    ├── RendezvousError             the rendezvous could not be completed
    │   ├── RendezvousClosedError   the rendezvous was closed (the job is over)
    │   ├── RendezvousTimeoutError  a rendezvous deadline expired (also TimeoutError)
    │   ├── RendezvousStateError    the shared state is corrupt or from another run
    │   └── RendezvousGracefulExitError  a spare node is not needed and leaves cleanly
    ├── WorkerError                 starting or supervising worker processes failed
    │   └── ChildFailedError        workers failed; carries the root-cause report
    ├── TimerError                  the worker watchdog could not be used
    ├── StatusError                 a job's status could not be read (not found, corrupt)
    ├── SnapshotError               a snapshot cannot be taken (unsupported value, over the limit)
    └── InProcessError              in-process restart (see relaunch.inprocess.exception)

"We closed it" (``StoreClosedError``, ``RendezvousClosedError``) is kept apart from
"the peer or store broke it" (``StoreConnectionError``). Errors of third-party
libraries (torch, etcd, sockets) are translated at the boundary with
``raise OurError(...) from exc``.
"""

from __future__ import annotations


class RelaunchError(Exception):
    """Root of every error relaunch raises on purpose."""


class ConfigError(RelaunchError, ValueError):
    """A flag, configuration value or parameter is invalid.

    The message names what was wrong and what was expected.
    """


class StoreError(RelaunchError):
    """The key-value store failed."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store wait or get did not complete before its timeout."""


class StoreClosedError(StoreError):
    """The store was closed by its owner; using it afterwards is a bug."""


class StoreConnectionError(StoreError):
    """The store server or peer cannot be reached or broke the connection."""


class StoreLostError(StoreConnectionError):
    """The store is gone for good (the embedded store lost its quorum): no call to it
    can succeed again, so none is tried; the message says why."""


class RendezvousError(RelaunchError):
    """The rendezvous could not be completed."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the job has finished or was stopped."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """A rendezvous deadline (join, last call, close) expired."""


class RendezvousStateError(RendezvousError):
    """The shared rendezvous state is corrupt, of an unknown version, or of another run."""


class RendezvousGracefulExitError(RendezvousError):
    """This node is a spare that is no longer needed; it should exit with success."""


class WorkerError(RelaunchError):
    """Starting, watching or stopping worker processes failed."""


class TimerError(RelaunchError):
    """The worker watchdog (named-pipe timer) could not be used."""


class StatusError(RelaunchError):
    """A job's status could not be read: no such job, or a corrupt status record."""


class SnapshotError(RelaunchError):
    """A snapshot cannot be taken or read: a value of an unsupported type (the message
    names its key path), a save over the node's limit, no snapshot directory."""


class InProcessError(RelaunchError):
    """Base of the in-process restart errors (see ``relaunch.inprocess``)."""
