"""The :class:`Tree` rank assignment (NVIDIA's algorithm, relaunch's code)."""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from relaunch.inprocess._core._assign_base import (
    Layer,
    LayerFlag,
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
)
from relaunch.inprocess._core._exceptions import RestartError
from relaunch.inprocess._core._state import Mode, State

__all__ = ["Tree"]


class _Node:
    """A subtree of a :class:`Tree`; a leaf holds one rank's state."""

    def __init__(self, parent: _Node | None, layer: Layer | None, state: State | None) -> None:
        self.parent, self.layer, self.state = parent, layer, state
        self.children: dict[Any, _Node] = {}
        self.inactive: dict[int, _Node] = {}  # reserve leaves below, by initial rank
        self.active_count = 0
        self.backfill_domain: _Node | None = None

    def leaves(self) -> Iterator[_Node]:
        if not self.children:
            yield self
        for child in self.children.values():
            yield from child.leaves()

    def ancestors(self) -> Iterator[_Node]:
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def flagged(self, flag: LayerFlag) -> bool:
        return bool(self.layer is not None and self.layer.flag and self.layer.flag & flag)

    @property
    def s(self) -> State:
        assert self.state is not None
        return self.state

    def deactivate(self) -> None:
        self.s.mode, self.s.active_rank = Mode.INACTIVE, None
        for node in self.ancestors():
            node.inactive[self.s.initial_rank or 0] = self

    def activate(self, active_rank: int | None) -> None:
        self.s.mode, self.s.active_rank = Mode.ACTIVE, active_rank
        for node in self.ancestors():
            node.inactive.pop(self.s.initial_rank or 0, None)

    def terminate(self) -> None:
        self.s.mode = Mode.TERMINATED
        for node in self.ancestors():
            node.inactive.pop(self.s.initial_rank or 0, None)


class Tree(RankAssignment):
    """Rank assignment and activation over a topology tree of :class:`Layer` (NVIDIA's
    algorithm): first, ranks are activated depth-first while every ancestor layer
    allows more (``max_ranks``); after terminations, (1) a subtree left with fewer
    than ``min_ranks`` healthy ranks is terminated whole, (2) a terminated active rank
    is replaced by a reserve rank of the nearest ``RESERVE`` ancestors, (3) within a
    ``BACKFILL`` subtree the highest active ranks move into the gaps, (4) remaining
    gaps are closed by shifting, (5) ``world_size_filter(active_world_size)`` may
    lower the active size (ranks above it become reserves). Cannot be composed with
    other assignments. Exchanges every rank's state and keys through the store on
    its first call: every rank must call it.
    """

    def __init__(
        self, layers: list[Layer], world_size_filter: Callable[[int], int] | None = None
    ) -> None:
        self.layers = layers
        self.world_size_filter = world_size_filter
        self.tree: _Node | None = None
        self.rank_map: dict[int, _Node] = {}
        self.init_rank_map: dict[int, _Node] = {}

    def _build(self, state: State, store: Any) -> _Node:
        key = [layer.key_or_fn(state) if callable(layer.key_or_fn) else layer.key_or_fn
               for layer in self.layers]  # fmt: skip
        store.send_state(state, state.rank)
        states = store.get_states(range(state.world_size))
        store.send_key(key, state.rank)
        keys = store.get_keys(range(state.world_size))
        roots = {k[0] for k in keys}
        if len(roots) != 1:
            raise RuntimeError(f"every rank needs the same root key of the tree, got {roots}")
        root = _Node(None, self.layers[0], None)
        for k, s in zip(keys, states, strict=True):
            node = root
            for part, layer in zip(k[1:], self.layers[1:], strict=True):
                node = node.children.setdefault(part, _Node(node, layer, None))
            leaf = node.children.setdefault(("rank", s.initial_rank), _Node(node, None, s))
            self.init_rank_map[s.initial_rank or 0] = self.rank_map[s.rank or 0] = leaf
        for index, leaf in enumerate(root.leaves()):
            if index != leaf.s.rank:
                warnings.warn(
                    f"the initial ranks do not follow the topology: rank {leaf.s.rank} is "
                    f"leaf {index} of the tree",
                    stacklevel=3,
                )
        counter = 0
        for leaf in root.leaves():
            path = list(leaf.ancestors())
            if all(a.layer is None or a.layer.max_ranks is None or a.active_count < a.layer.max_ranks
                   for a in path):  # fmt: skip
                leaf.activate(counter)
                counter += 1
                for a in path:
                    a.active_count += 1
            else:
                leaf.deactivate()
        for leaf in root.leaves():
            leaf.s.active_world_size = counter
            domain = None
            for a in leaf.ancestors():
                if not a.flagged(LayerFlag.BACKFILL):
                    break
                domain = a
            leaf.backfill_domain = domain
        return root

    def _propagate(self, node: _Node, dead: set[int]) -> set[int]:
        for child in node.children.values():
            dead = self._propagate(child, dead)
        if node.children and node.layer is not None:
            healthy = [x for x in node.leaves() if x.s.mode is not Mode.TERMINATED]
            if sum(1 for x in healthy if x.s.rank not in dead) < node.layer.min_ranks:
                dead = dead | {x.s.rank for x in healthy if x.s.rank is not None}
        return dead

    def _from_reserve(self, dead_active: set[int]) -> set[int]:
        replaced = set()
        for rank in sorted(dead_active):
            gone = self.rank_map[rank]
            for a in gone.ancestors():
                if not a.flagged(LayerFlag.RESERVE):
                    break
                if a.inactive:
                    _, spare = a.inactive.popitem()
                    spare.activate(gone.s.active_rank)
                    replaced.add(rank)
                    break
        return replaced

    def _backfill(self, unhandled: set[int]) -> set[int]:
        gaps: set[int] = set()
        by_domain: dict[int, list[_Node]] = collections.defaultdict(list)
        domains: dict[int, _Node] = {}
        for rank in sorted(unhandled):
            gone = self.rank_map[rank]
            if gone.backfill_domain is None:
                gaps.add(gone.s.active_rank or 0)
            else:
                by_domain[id(gone.backfill_domain)].append(gone)
                domains[id(gone.backfill_domain)] = gone.backfill_domain
        for key, gone_nodes in by_domain.items():
            active = (x for x in domains[key].leaves() if x.s.mode is Mode.ACTIVE)
            highest = heapq.nlargest(len(gone_nodes), active, key=lambda x: x.s.active_rank or 0)
            for mover, gone in itertools.zip_longest(reversed(highest), gone_nodes):
                if mover is not None:
                    gaps.add(mover.s.active_rank or 0)
                    mover.s.active_rank = gone.s.active_rank
                else:
                    gaps.add(gone.s.active_rank or 0)
        return gaps

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        if self.tree is None:
            self.tree = self._build(state, ctx.store)
        root = self.tree
        for leaf in root.leaves():
            leaf.s.fn_exception, leaf.s.iteration = state.fn_exception, state.iteration
        dead = self._propagate(root, set(ctx.terminated_ranks))
        dead_active = {r for r in dead if self.rank_map[r].s.mode is Mode.ACTIVE}
        for rank in dead:
            self.rank_map[rank].terminate()
        unhandled = dead_active - self._from_reserve(dead_active)
        if unhandled:
            gaps = sorted(self._backfill(unhandled))
            for node in self.rank_map.values():
                node.s.active_world_size = (node.s.active_world_size or 0) - len(unhandled)
                if node.s.active_rank is not None:
                    node.s.active_rank -= bisect.bisect_left(gaps, node.s.active_rank)
        if self.world_size_filter is not None:
            size = next(iter(self.rank_map.values())).s.active_world_size or 0
            new_size = self.world_size_filter(size)
            if new_size > size:
                raise RestartError(f"world_size_filter({size}) returned {new_size} > {size}")
            for leaf in root.leaves():
                leaf.s.active_world_size = new_size
                if leaf.s.mode is Mode.ACTIVE and (leaf.s.active_rank or 0) >= new_size:
                    leaf.deactivate()
        world_size = state.world_size - len(dead)
        for leaf in root.leaves():
            leaf.s.world_size = world_size
        for rank in dead:
            self.rank_map[rank].s.rank = self.rank_map[rank].s.active_rank = None
        ordered = sorted(root.leaves(), key=lambda x: x.s.mode is Mode.TERMINATED)
        self.rank_map = {}
        for index, leaf in enumerate(ordered):
            leaf.s.rank = index
            self.rank_map[index] = leaf
        mine = self.init_rank_map[state.initial_rank or 0].s
        if mine.mode is Mode.TERMINATED:
            raise RankDiscarded(f"rank={state.rank} terminated_ranks={sorted(dead)}")
        ctx.state = dataclasses.replace(mine)
        ctx.terminated_ranks = set()
        return ctx
