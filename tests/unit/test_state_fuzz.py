"""Fuzz the rendezvous state codec and the handler's reads with random and mutated
states (seeded): nothing but RendezvousStateError comes out, nothing hangs or spins,
and a state that decodes always makes sense."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from relaunch.errors import RendezvousStateError
from relaunch.rendezvous import DynamicRendezvousHandler, RendezvousSettings
from relaunch.rendezvous._state import LATEST_BEAT, RendezvousState, decode_state, encode_state
from relaunch.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(120)

NOW = 1.7e9
KEY = "relaunch/rdzv/job/state"


def valid_state(rng: random.Random) -> dict[str, Any]:
    nodes = [f"10.0.0.{i}_{1000 + i}_0" for i in range(rng.randint(0, 6))]
    state = RendezvousState(
        run_id="job",
        seq=rng.randint(0, 50),
        epoch=rng.randint(0, 50),
        round=rng.randint(0, 5),
        complete=rng.random() < 0.5,
        participants={n: i for i, n in enumerate(nodes[:4])},
        redundancy_list=set(nodes[4:]),
        last_heartbeats={n: NOW - rng.random() for n in nodes},
    )
    doc: dict[str, Any] = json.loads(encode_state(state))
    return doc


WEIRD: list[Any] = [None, -1, -(10**18), 10**18, 1e308, float("nan"), "x", "", [], {}, True,
                    [1, "a"], {"a": "b"}, "\x1b[2J", "é" * 50]  # fmt: skip


def mutate(doc: dict[str, Any], rng: random.Random) -> Any:
    doc = json.loads(json.dumps(doc))
    for _ in range(rng.randint(1, 3)):
        choice = rng.random()
        if choice < 0.35 and doc:
            doc[rng.choice(sorted(doc))] = rng.choice(WEIRD)
        elif choice < 0.5:
            doc[f"extra{rng.randint(0, 9)}"] = rng.choice(WEIRD)
        elif choice < 0.6 and doc:
            del doc[rng.choice(sorted(doc))]
        elif choice < 0.8 and isinstance(doc.get("participants"), dict):
            doc["participants"][f"ghost_{rng.randint(0, 10**6)}_0"] = rng.choice(WEIRD)
        elif isinstance(doc.get("last_heartbeats_ms"), dict):
            doc["last_heartbeats_ms"][f"ghost_{rng.randint(0, 9)}_0"] = rng.choice(WEIRD)
    return doc


def blobs(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    out: list[bytes] = []
    for i in range(count):
        doc = valid_state(rng)
        kind = i % 4
        if kind == 0:
            out.append(json.dumps(mutate(doc, rng), allow_nan=True).encode())
        elif kind == 1:
            raw = bytearray(json.dumps(doc).encode())
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            out.append(bytes(raw))
        elif kind == 2:
            out.append(bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))))
        else:
            out.append(json.dumps(doc).encode())
    return out


def test_decoding_thousands_of_random_states_only_ever_refuses_cleanly() -> None:
    # (how long a decode takes: bench/hostile_input.py; a hang is the test's timeout)
    decoded = refused = 0
    for raw in blobs(seed=20261123, count=4000):
        try:
            state = decode_state(raw, key=KEY, run_id="job", max_nodes=4)
        except RendezvousStateError as exc:
            assert KEY in str(exc)
            refused += 1
            continue
        decoded += 1
        assert state.round >= 0 and state.restarts >= 0 and len(state.participants) <= 4
        assert all(0 <= t <= LATEST_BEAT for t in state.last_heartbeats.values())
    assert decoded > 500 and refused > 2000


def test_the_handler_reads_random_states_without_crashing_or_spinning() -> None:
    store = MemoryStore()
    settings = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=1)
    handler = DynamicRendezvousHandler(
        backend="c10d", store=store, settings=settings, clock=lambda: NOW
    )
    try:
        handler.next_rendezvous()
        for raw in blobs(seed=7, count=300):
            store.set(KEY, raw)
            store.set(f"relaunch/rdzv/job/epoch/{10**6}", b"1")  # make every read a fresh one
            try:  # (how long a read takes: bench/hostile_input.py)
                handler.num_nodes_waiting()
                handler.is_closed()
            except RendezvousStateError:
                pass
    finally:
        handler.shutdown()
