"""How fast the agents move a lost node's snapshots: one peer's snapshot fetched over
loopback by the code the agents run (``relaunch.checkpoint._peer_server`` and
``_peer_client``: the server, in a process of its own as on the other node, sends with
sendfile; the receiver receives into node memory, mapped, and checks the CRC-32 of
each chunk as it comes).

    python bench/snapshot_transfer.py [--sizes 256,1024] [--repeat 3]

Prints per size (MB): the median seconds of a fetch into new memory (a spare taking a
lost node's ranks) and its throughput in GB/s; the same for a fetch that reuses the
pages of an older copy (a successor's steady state: each new snapshot of its
predecessor takes the place of the copy that goes); and beside them a plain
``shutil.copyfile`` of the same file in /dev/shm (the machine's memory bandwidth for one
copy), which bounds what any transfer here can reach.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import in_loopback_netns

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._channel import Channel
from relaunch.checkpoint._peer_client import fetch_step

JOB = "bench"


def _make(root: str, nbytes: int) -> str:
    folder = layout.step_dir(layout.rank_dir(root, 0), 1)
    os.makedirs(folder)
    path = os.path.join(folder, layout.DATA)
    block = os.urandom(1 << 20)
    crc = 0
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
            crc = zlib.crc32(block, crc)
    layout.write_manifest(folder, layout.Manifest(JOB, 0, 2, 1, nbytes, crc, {}))
    return path


class _Server:
    """A SnapshotServer in a child process (the other node's agent)."""

    def __init__(self, root: str) -> None:
        code = (
            "import sys\n"
            "from relaunch.checkpoint._peer_server import SnapshotServer\n"
            f"s = SnapshotServer({root!r}, {JOB!r}, '127.0.0.1')\n"
            "print(s.port, flush=True)\n"
            "sys.stdin.read()\n"
            "s.close()\n"
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="256,1024", help="snapshot sizes in MB")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    in_loopback_netns()
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    print(f"{'MB':>6} {'fetch s':>8} {'GB/s':>6} {'reusing s':>10} {'GB/s':>6} "
          f"{'copyfile s':>11} {'GB/s':>6}")  # fmt: skip
    for mb in (int(s) for s in args.sizes.split(",")):
        work = tempfile.mkdtemp(prefix="bench-snapshot-transfer-", dir=base)
        try:
            source = os.path.join(work, "source")
            data = _make(source, mb << 20)
            server = _Server(source)
            fetches, reusing, copies = [], [], []
            steady = os.path.join(work, "steady")
            kept = layout.rank_dir(steady, 0)
            peer = Channel("127.0.0.1", server.port)  # as the agents: one connection
            try:
                for i in range(args.repeat):
                    into = os.path.join(work, f"into-{i}")
                    t0 = time.perf_counter()
                    fetch_step(peer, JOB, 0, 1, into)
                    fetches.append(time.perf_counter() - t0)
                    shutil.rmtree(into)
                    t0 = time.perf_counter()
                    fetch_step(peer, JOB, 0, 1, steady, reuse=0)
                    reusing.append(time.perf_counter() - t0)
                    # the copy becomes the older one, whose pages the next fetch reuses
                    os.rename(layout.step_dir(kept, 1), layout.step_dir(kept, 0))
                    t0 = time.perf_counter()
                    shutil.copyfile(data, os.path.join(work, "copy"))
                    copies.append(time.perf_counter() - t0)
                    os.unlink(os.path.join(work, "copy"))
            finally:
                peer.close()
                server.close()
            f, c = statistics.median(fetches), statistics.median(copies)
            r = statistics.median(reusing[1:] or reusing)  # the first has no pages to reuse
            gb = (mb << 20) / 1e9
            print(f"{mb:>6} {f:8.3f} {gb / f:6.2f} {r:10.3f} {gb / r:6.2f} "
                  f"{c:11.3f} {gb / c:6.2f}")  # fmt: skip
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
