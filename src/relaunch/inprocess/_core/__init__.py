"""The engine of in-process restart, private: the public modules of
:mod:`relaunch.inprocess` (NVIDIA's names) re-export what users see of it and build on
it; nothing here imports them (``tests/unit/test_inprocess_units.py`` checks it).

The call and its loop:

- ``_call``: what one call owns on a rank (monitor process, watchdog, store clients)
- ``_loop``: the restart loop: first roster, iterations, next roster
- ``_iteration``: one iteration: barrier, the function under a monitor thread
- ``_restart``: the restart procedure after an interrupted iteration
- ``_abort``: the abort callbacks once per iteration; the default group's destruction
- ``_config``: what the engine reads of the wrapper's parameters (a protocol)

The watchers:

- ``_monitor_process``: the forked monitor process (heartbeats, hard timeout, deaths)
- ``_monitor_thread``: the monitor thread (interruptions, soft timeout, abort)
- ``_main_thread``: whether and how the main thread is interrupted
- ``_progress``: the shared progress record and the main thread's watchdog
- ``_threads``: stopping a thread (join with a timeout)

Coordination between ranks:

- ``_coord``: the coordination store: records, barriers, heartbeats
- ``_records``: interruption records (versioned JSON lines)
- ``_rejoin``: replacement processes taking a dead rank's place
- ``_roster``: every rank's next state (rank assignment and filter, pure)
- ``_exchange``: states and keys exchanged through a torch Store (``StoreMixin``)
- ``_state``, ``_exceptions``: the restart state; the exceptions
- ``_assign_base``, ``_tree``: the base of rank assignments; the ``Tree`` assignment

The process around the call:

- ``_env``: everything read from the environment; the agent marker; the store endpoint
- ``_params``: the ``CallWrapper`` parameter; running the user's callbacks
- ``_rendezvous``: a fresh ``env://`` rendezvous namespace per iteration
- ``_groups``: keeping process groups alive until an iteration's objects are gone
- ``_sockets``: shutting down the connections an iteration opened (gloo's abort)
- ``_nic``: what sysfs says about a GPU's InfiniBand NIC (the NIC health check)
- ``_logs``: the loggers, under NVIDIA's ``nvrx``
"""

__all__: list[str] = []
