"""The rendezvous store's size over many rounds: keys kept per node per round.

    python bench/rendezvous_keys.py [--nodes 8] [--rounds 20]

N nodes (handlers in threads, a TCP store client each) on relaunch's TCP store server
go through ``--rounds`` group restarts (every node joins the next round, as after a
worker failure). Prints the store's key count after the first round and after the
last (once every node has beaten since), and the keys kept per round: before
2026-11-28 each round left three more per node (a join request, its ack, a place);
what stays now is the live round's keys and one ``epoch/<n>`` key per write that woke
the waiting nodes. Runs in a loopback-only network namespace; by hand, not in CI.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import in_loopback_netns

from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous.handler import DynamicRendezvousHandler
from relaunch.store.tcp import TCPStoreClient, TCPStoreServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    in_loopback_netns()
    n = args.nodes
    settings = RendezvousSettings(run_id="keys", min_nodes=n, max_nodes=n,
                                  keep_alive_interval=0.2, keep_alive_max_attempt=10,
                                  last_call_timeout=0.2)  # fmt: skip
    with TCPStoreServer(host="127.0.0.1", port=0) as server:
        clients = [TCPStoreClient("127.0.0.1", server.port, timeout=30) for _ in range(n)]
        handlers = [
            DynamicRendezvousHandler(backend="c10d", store=c, settings=settings, owns_store=False)
            for c in clients
        ]
        counted: list[int] = []
        try:
            with ThreadPoolExecutor(n, thread_name_prefix="bench-node") as pool:
                for r in range(args.rounds):
                    list(pool.map(lambda h: h.next_rendezvous(), handlers))
                    if r in (0, args.rounds - 1):
                        time.sleep(3 * settings.keep_alive_interval)  # every node beat since
                        counted.append(clients[0].num_keys())
        finally:
            for h in handlers:
                h.shutdown()
            for c in clients:
                c.close()
    first, last = counted
    rounds = args.rounds - 1
    print(f"{n} nodes: {first} keys after round 1, {last} after round {args.rounds}: "
          f"{(last - first) / rounds:.1f} keys kept per round, "
          f"{(last - first) / rounds / n:.2f} per node per round")  # fmt: skip


if __name__ == "__main__":
    main()
