"""Snapshots of the training state in node memory: a fault costs at most the steps since
the last ``save``, one when you save every step.

In the training script (under ``relaunch``)::

    from relaunch import checkpoint

    dist.init_process_group("gloo")
    restored = checkpoint.load()                     # None on a fresh start
    if restored is not None:
        step, state = restored
        model.load_state_dict(state["model"]); optimizer.load_state_dict(state["opt"])
    for step in range(step + 1 if restored else 0, steps):
        ...train one step...
        checkpoint.save(step, {"model": model.state_dict(), "opt": optimizer.state_dict()})

``save(step, state)`` returns at once (CUDA tensors: once their copies into the page-locked
snapshot file, or a pinned buffer, are queued on a copy stream); a writer thread copies the tensors into the
node's snapshot directory (the agent's ``--snapshot-dir``, by default a folder under
/dev/shm removed when the job ends), then checksums them, writes the manifest and
renames the folder, which makes the snapshot complete. The copy is finished before any
optimizer steps again (a ``torch.optim`` pre-step hook waits for it); the state's
tensors no optimizer holds (a module's buffers, which the next forward updates) are
cloned in ``save`` (or it blocks, for many bytes of them); a tensor an optimizer holds
that you change outside its ``step`` must wait for ``wait_copied()``. The node keeps each rank's newest ``--snapshot-keep`` snapshots: they
survive the worker's death and the group's restart. ``load()`` returns
``(step, state)`` for the newest step that every rank of the current world can
restore, the same on every rank (ranks compare what they have over the default process
group: call it after ``init_process_group``), or None. A snapshot that is not whole
(killed mid-save, truncated, corrupt) is never loaded: the older one is, after one
warning. ``load(replicated=True)``, for a state that is the same on every rank (plain
data parallel training), restores the newest step any rank holds, across a change of
the world's size too (``_replica``). Tensors come back on the CPU; ``load_state_dict``
copies them where they belong. A worker that starts with a snapshot of its rank in node memory (a restart)
has it read back on a thread while its script starts (the runner begins the read), so
``load()`` mostly finds it done. With ``--checkpoint-dir`` the agent also copies snapshots to shared storage in
the background, and a rank whose node memory lacks a step takes it from there (the
ranks of a lost node on their replacement; every rank after every node was lost).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint import _restores
from relaunch.errors import SnapshotError

__all__ = ["SnapshotError", "load", "save", "wait", "wait_copied"]

log = logging.getLogger("relaunch.checkpoint")

_lock = threading.Lock()
_current: Any = None
"""This process's Saver (not named ``_saver``: importing the submodule of that name
would set the package attribute to the module)."""


def save(step: int, state: object, *, blocking: bool = False) -> None:
    """Snapshot ``state`` (what ``state_dict()`` returns) as of ``step``.

    Returns at once: a writer thread copies the tensors into node memory (the copies of
    CUDA ones to the host are queued on a copy stream before this returns). The copy
    is done before any ``torch.optim`` optimizer steps again, and before the next
    ``save`` or ``load``. With ``blocking=True`` this returns once the snapshot is
    complete in node memory (a death right after it loses nothing; what the writer
    failed with is raised here; the copy on the peer node, which the agents make, is
    not waited for): before a risky step, or as the last act of a process that was
    told to stop. The tensors that no
    optimizer which has stepped holds (a module's buffers, such as BatchNorm's running
    statistics, which the next forward updates in place; an average of the weights) are
    cloned before this returns, on CUDA on the current stream; where they are more than
    an eighth of the state's bytes, this waits for their copy instead. A
    tensor an optimizer holds that you change outside its ``step`` (in place, by hand)
    must wait for :func:`wait_copied` first.
    SnapshotError for a value of an unsupported type (naming its key path), a save over
    the node's limit, or a failure of the previous save's writer."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise SnapshotError(f"save: step must be a non-negative int, got {step!r}")
    _get().save(step, state, blocking=blocking)


def wait_copied() -> None:
    """Wait until the tensors of the last ``save`` are copied (not yet complete)."""
    if _current is not None:
        _current.wait_copied()


def wait() -> None:
    """Wait until the last ``save`` is complete in node memory (as ``blocking=True``);
    raise what it failed with."""
    if _current is not None:
        _current.wait_whole()


def load(*, replicated: bool = False) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest snapshot every rank can restore, or None.

    ``replicated=True`` says the state is the same on every rank, as plain data
    parallel training's (DDP, an optimizer every rank steps alike): any rank's snapshot
    is then every rank's. The newest step any rank holds whole is restored on every
    rank, also when the world's size changed since it was saved (a node lost with no
    spare to take its ranks, a node that joined); a rank that holds no whole copy of it
    receives one from a rank that does, over the default process group. Without it a
    rank restores only its own rank's snapshots of the current world size (each rank
    its own shard), and a change of size starts afresh."""
    from relaunch.checkpoint._agree import newest_common
    from relaunch.checkpoint._replica import newest_replica

    if not isinstance(replicated, bool):
        raise SnapshotError(f"load: replicated must be True or False, got {replicated!r}")
    saver = _get()
    saver.wait()
    durable = saver.where.durable
    roots = [None] if durable is None else [None, durable]
    found, newest = (newest_replica if replicated else newest_common)(saver, roots)
    step = None if found is None else found[0]
    source = None if found is None else found[2]
    _note_restore(saver.where, _restores.Restore(saver.where.rank, step, newest, source))
    gone = saver.discard_newer(step)
    if gone:
        log.info("rank %s: dropped snapshots of steps %s (newer than the restored one)",
                 saver.where.rank, gone)  # fmt: skip
    if found is None:
        return None
    ahead = " (read ahead while the script started)" if saver.read_ahead else ""
    log.info("rank %s: restored step %s from %s%s", saver.where.rank, step, source, ahead)
    return found[0], found[1]


def _note_restore(where: layout.Where, restore: _restores.Restore) -> None:
    """Record this rank's restore for the agent's summary (never fails the load)."""
    try:
        os.makedirs(where.root, exist_ok=True)
        _restores.append_restore(where.root, restore)
    except OSError as exc:
        log.warning("cannot record the restore in %s: %s", where.root, exc)


def _prefetch() -> None:
    """Start reading this rank's newest snapshot in node memory on a thread (the runner
    calls this in a restarted worker before its script runs); ``load()`` takes it when
    the ranks agree on that step, and a ``save()`` first drops it."""
    _get().prefetch()


def _get() -> Any:
    global _current
    with _lock:
        if _current is None:
            from relaunch.checkpoint._saver import Saver

            _current = Saver(_where_from_env(os.environ))
        return _current


def _where_from_env(env: Any) -> Any:
    from relaunch.checkpoint._fill import threads_for
    from relaunch.checkpoint._saver import Where

    root = env.get(layout.ENV_DIR)
    if not root:
        raise SnapshotError(
            f"no snapshot directory: {layout.ENV_DIR} is not set (run the script under "
            "`relaunch`, which sets it, or set it to a directory)"
        )
    durable = env.get(layout.ENV_DURABLE) or None
    job = env.get("TORCHELASTIC_RUN_ID") or "none"
    return Where(
        root=root,
        job=job,
        rank=_int(env, "RANK", "0", 0),
        world_size=_int(env, "WORLD_SIZE", "1", 1),
        keep=_int(env, layout.ENV_KEEP, "2", 2),
        limit=_int(env, layout.ENV_LIMIT, "0", 0) or None,
        durable=os.path.join(durable, layout.safe_job(job)) if durable else None,
        agent=_agent(env.get(layout.ENV_AGENT)),
        threads=threads_for(env),
    )


def _agent(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SnapshotError(f"{layout.ENV_AGENT}: expected HOST:PORT, got {value!r}")
    return host, int(port)


def _int(env: Any, name: str, default: str, low: int) -> int:
    text = env.get(name) or default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise SnapshotError(f"{name}={text!r}: expected an int >= {low}")
    return value
