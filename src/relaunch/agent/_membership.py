"""What the rendezvous says about this node's round while its workers run (nodes
waiting to join, a node of it finished), and this node's part in replacing a lost node
without restarting the others (tiered recovery, node tier).

While every node of a complete round runs in-process workers (each agent says so with
``mark_inprocess`` once its workers announced it), the rendezvous leaves a lost node's
group rank vacant instead of starting a new round. Every surviving agent then records
the deaths of that node's ranks in its workers' store (``<job>/lost``, read by
``relaunch.inprocess`` with its own death records), so the in-process ranks go on
without them at once, and a spare or a new node takes the rank: its agent starts the
ranks' workers at the vacancy's incarnation, and they join the running iteration as
replacements do (``inprocess/_core/_rejoin.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from relaunch._contract import lost_key
from relaunch.agent._core import Observation
from relaunch.agent._round import round_finishing
from relaunch.agent._spec import WorkerGroup
from relaunch.errors import RelaunchError
from relaunch.events import Emit, NodeLost, NodeReplaced
from relaunch.rendezvous import RendezvousHandler, RendezvousInfo, TieredMembership
from relaunch.store.tcp import TCPStoreClient

__all__ = ["Membership", "declare_lost"]

log = logging.getLogger(__name__)


def declare_lost(
    addr: str, port: int, key: str, ranks: range, incarnation: int, message: str, *, replaced: bool
) -> None:
    """Append a death record of each of ``ranks`` (every incarnation up to
    ``incarnation``) to ``key`` in the workers' store: UNRESPONSIVE while no node took
    them over (no restart waits for them), TERMINATED by the node that did (its
    workers ask to join next). Raises StoreError."""
    from relaunch.inprocess.attribution import Interruption, InterruptionRecord

    kind = Interruption.TERMINATED if replaced else Interruption.UNRESPONSIVE
    blob = "".join(
        InterruptionRecord(
            initial_rank=rank,
            interruption=kind,
            message=message,
            incarnation=incarnation,
        ).encode()
        for rank in ranks
    )
    client = TCPStoreClient(addr, port, timeout=5.0)
    try:
        client.append(key, blob.encode())
    finally:
        client.close()


class Membership:
    """What this node did about the current round's vacancies; reset at each round."""

    def __init__(self, handler: RendezvousHandler, emit: Emit, run_id: str) -> None:
        self._handler = handler
        self._tiers = handler if isinstance(handler, TieredMembership) else None
        """None for a backend whose rounds end with a lost node (static): no vacancy."""
        self._emit = emit
        self._run_id = run_id
        self.declared: frozenset[tuple[int, int]] = frozenset()
        self.marked = False
        self._told: set[tuple[int, int]] = set()
        self._rank: int | None = None
        self._incarnation = 0
        self._dropped_said = False

    def new_round(self, group_rank: int, incarnation: int) -> None:
        """This node's place in a new round (``incarnation`` > 0: it replaced a lost one)."""
        self.declared, self.marked, self._rank = frozenset(), False, group_rank
        self._incarnation, self._dropped_said = incarnation, False
        # (seats taken before this node came are not news to it)
        self._told = {(group_rank, incarnation), *self._replaced().items()}

    def observe(
        self, obs: Observation, info: RendezvousInfo | None, *, running: bool = True
    ) -> Observation:
        """``obs`` with its membership fields filled in; those of the rendezvous are read
        with ``info`` (the running round) only (a few cheap reads), and while some
        worker is not ``running`` only whether the others dropped this node."""
        obs = dataclasses.replace(obs, declared=self.declared, marked_inprocess=self.marked)
        if info is None:
            return obs
        replaced = self._replaced()
        vacancies = self._vacancies(replaced)
        dropped = self._dropped(vacancies, replaced)
        if not running:
            return dataclasses.replace(obs, dropped=dropped)
        waiting = self._handler.num_nodes_waiting()
        return dataclasses.replace(
            obs,
            nodes_waiting=waiting,
            # (a store read of its own, made only while some node waits)
            round_finishing=bool(waiting)
            and not self._handler.round_ended()
            and not self._handler.is_closed()  # (static: a give-up reads as one waiting)
            and round_finishing(info),
            vacancies={g: i for g, i in vacancies.items() if g != self._rank},
            dropped=dropped,
        )

    def _dropped(self, vacancies: Mapping[int, int], replaced: Mapping[int, int]) -> bool:
        """Whether the others took this node for lost (its agent stalled past the
        dead-node delay, say): its group rank is vacant, or another node holds it."""
        rank = self._rank
        if rank is None:
            return False
        holder = replaced.get(rank, self._incarnation)
        dropped = rank in vacancies or holder != self._incarnation
        if dropped and not self._dropped_said:
            self._dropped_said = True
            log.warning(
                "the other nodes took this node for lost (no heartbeat from it for the "
                "dead-node delay: its agent stalled?) and went on without its group rank "
                "%d: its workers stop, and it joins again",
                rank,
            )
        return dropped

    def _vacancies(self, replaced: Mapping[int, int]) -> dict[int, int]:
        """The round's vacancies (one cheap read); says when a node took a lost one's
        place (``replaced``: the seats taken over), whether or not this node saw the
        vacancy first."""
        for seat in replaced.items():
            if seat not in self._told:
                self._told.add(seat)
                group_rank, incarnation = seat
                self._emit(
                    NodeReplaced(
                        group_rank=group_rank,
                        lost_at=incarnation / 1_000_000,  # the incarnation is the loss's time
                        seen_lost=seat in self.declared,
                    )
                )
        return self._tiers.vacancies() if self._tiers is not None else {}

    def _replaced(self) -> dict[int, int]:
        return self._tiers.replaced() if self._tiers is not None else {}

    def mark(self) -> None:
        if self._tiers is not None:
            self._tiers.mark_inprocess()
        self.marked = True

    def lost(
        self,
        vacancies: Mapping[int, int],
        group: WorkerGroup,
        restart_count: int,
        *,
        taking_over: bool = False,
    ) -> None:
        """Record the deaths of the vacancies' ranks in ``group``'s workers' store
        (``taking_over``: this node fills the vacancy, before it starts the ranks' new
        workers)."""
        assert group.master_addr is not None and group.master_port is not None
        store = (group.master_addr, group.master_port)
        nproc = len(group.workers)
        key = lost_key(self._run_id, restart_count)
        for group_rank, incarnation in sorted(vacancies.items()):
            ranks = range(group_rank * nproc, (group_rank + 1) * nproc)
            message = f"node of group rank {group_rank} lost (its agent left the rendezvous)"
            try:
                declare_lost(*store, key, ranks, incarnation - 1, message, replaced=taking_over)
            except RelaunchError as exc:
                # The workers find out by their own heartbeats, later.
                log.warning("could not record the ranks of the lost node: %s", exc)
            self.declared |= {(group_rank, incarnation)}
            if taking_over:
                continue
            self._emit(NodeLost(group_rank=group_rank, ranks=(ranks.start, ranks.stop - 1)))
