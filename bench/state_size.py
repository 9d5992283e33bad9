"""Size of the rendezvous state at scale, against the store's value limit.

    python bench/state_size.py [--nodes 10000] [--host-len 30]

Builds the state of a complete round of ``--nodes`` nodes with every per-node field
filled (participants, heartbeats, expected, in-process, one waiting and one spare node),
node ids as the agents make them (``<host>_<pid>_<n>``, hosts of ``--host-len``
characters), and prints its encoded size (JSON, as written to the store), the time to
encode and decode it, and the TCP store's value limit (``MAX_VALUE_LEN``).
"""

from __future__ import annotations

import argparse
import time

from relaunch.rendezvous._state import RendezvousState, decode_state, encode_state
from relaunch.store._tcp_wire import MAX_VALUE_LEN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--host-len", type=int, default=30, help="characters per host name")
    args = parser.parse_args()
    now = time.time()
    nodes = [
        f"{f'node{i:05d}.'.ljust(args.host_len, 'x')}_{100000 + i}_0" for i in range(args.nodes)
    ]
    state = RendezvousState(
        run_id="job42",
        seq=123456,
        epoch=4567,
        round=17,
        complete=True,
        participants={n: rank for rank, n in enumerate(nodes)},
        wait_list={nodes[0].replace("node", "wait")},
        redundancy_list={nodes[0].replace("node", "spar")},
        expected=set(nodes),
        last_heartbeats={n: now - (i % 50) / 10 for i, n in enumerate(nodes)},
        applied=args.nodes + 2,
        inprocess=set(nodes),
        store_host=nodes[0].split("_")[0],
    )
    t0 = time.perf_counter()
    raw = encode_state(state)
    t1 = time.perf_counter()
    decode_state(
        raw, key="relaunch/rdzv/job42/state", run_id="job42", now=now, max_nodes=args.nodes
    )
    t2 = time.perf_counter()
    print(
        f"{args.nodes} nodes: {len(raw) / 1e6:.2f} MB encoded "
        f"(encode {(t1 - t0) * 1e3:.0f} ms, decode {(t2 - t1) * 1e3:.0f} ms); "
        f"store value limit {MAX_VALUE_LEN / 2**20:.0f} MiB ({MAX_VALUE_LEN / len(raw):.0f}x)"
    )


if __name__ == "__main__":
    main()
