"""How fresh the in-process progress watchdog's automatic timestamp is.

    python bench/progress_watchdog.py [--interval 0.02] [--seconds 2] [--runs 5]

``MainThreadProgress`` writes a timestamp each ``--interval`` in which the main thread
ran Python code (a pending call it must run). Prints the timestamp's age as another
thread sees it (every 5 ms) while the main thread runs Python for ``--seconds``:
median and largest, to compare with the interval; and its age just after the main
thread spent 0.5 s in a C call (``time.sleep``: the GIL released, no bytecode): it
should be about 0.5 s, no timestamp having been written meanwhile. Medians of
``--runs``. tests/unit/test_inprocess_mechanics.py checks the behaviour (timestamps
while Python runs, none while it does not); this prints the figures. Run by hand.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median

from relaunch.inprocess.progress_watchdog import MainThreadProgress, SharedProgress

C_CALL = 0.5


def one(interval: float, seconds: float) -> tuple[float, float, float]:
    """(median age, largest age) while Python runs; age after a C_CALL s sleep."""
    shared = SharedProgress()
    watchdog = MainThreadProgress(shared, interval)
    watchdog.start()
    ages: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            ages.append(time.monotonic() - shared.auto_ts)

    sampler = threading.Thread(target=sample, name="bench-sampler")
    try:
        end = time.monotonic() + interval * 5
        while time.monotonic() < end:  # the first timestamps land
            pass
        sampler.start()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        stop.set()
        sampler.join(10)
        time.sleep(C_CALL)
        after_c_call = time.monotonic() - shared.auto_ts
        return median(ages), max(ages), after_c_call
    finally:
        stop.set()
        watchdog.shutdown()
        shared.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rows = [one(args.interval, args.seconds) for _ in range(args.runs)]
    for run, (mid, top, stale) in enumerate(rows):
        print(f"run {run}: age median {mid * 1e3:6.1f} ms  largest {top * 1e3:6.1f} ms  "
              f"after {C_CALL:g} s in C {stale:.3f} s", flush=True)  # fmt: skip
    print(f"\ninterval {args.interval * 1e3:g} ms, median of {args.runs} runs:")
    print(f"  timestamp age while Python runs: median {median([r[0] for r in rows]) * 1e3:.1f} ms,"
          f" largest {median([r[1] for r in rows]) * 1e3:.1f} ms")  # fmt: skip
    print(f"  age after {C_CALL:g} s in a C call:     {median([r[2] for r in rows]):.3f} s")


if __name__ == "__main__":
    main()
