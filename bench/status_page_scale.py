"""The job's view at scale: a simulated job of N nodes of 8 workers (3 failed, one
silent, 16 spares), its status document built, summarized and drawn, the page served
by the status server and loaded in headless Chromium.

    python bench/status_page_scale.py [--nodes 1024,4096,16384] [--runs 3] [--shot PNG]

Prints per N: the seconds to join the reports into the document, to draw the page,
its size and the summarized ``/status.json``'s, and the page's load time in Chromium
(navigation start to the end of the load event, as the browser measures it; the median
of ``--runs`` loads, each in a fresh headless browser). ``--shot`` saves a screenshot
of the last page. Chromium from Debian's package (``chromium``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from multinode_support.status_job import big_job
from relaunch.status import render_html
from relaunch.status._document import as_document
from relaunch.status._summary import summarize

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PROBE = (
    "<script>addEventListener('load',()=>setTimeout(()=>{document.body.dataset.loaded="
    "performance.getEntriesByType('navigation')[0].loadEventEnd},0))</script>"
)


def load_ms(url: str, profile: Path) -> float:
    """The page's load time in a fresh headless Chromium, as the browser measures it."""
    assert CHROMIUM is not None
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--virtual-time-budget=1000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(r'data-loaded="([0-9.]+)"', done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"chromium: {done.returncode}: {done.stderr[-500:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="1024,4096,16384")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shot", default=None, help="save a screenshot of the last page")
    args = parser.parse_args()
    if CHROMIUM is None:
        raise SystemExit("needs chromium (apt-get install chromium)")
    tmp = Path(tempfile.mkdtemp(prefix="relaunch-bench-page-"))
    print(f"{'nodes':>6} {'document s':>11} {'page s':>7} {'page KB':>8} {'json KB':>8} "
          f"{'load ms':>8}")  # fmt: skip
    try:
        for n in (int(x) for x in args.nodes.split(",")):
            t0 = time.perf_counter()
            doc = big_job(n)
            t1 = time.perf_counter()
            page = render_html(doc)
            t2 = time.perf_counter()
            small = json.dumps(summarize(as_document(doc)), indent=1)
            path = tmp / f"page-{n}.html"  # the page the server sends, with the probe
            path.write_text(page.replace("</body>", PROBE + "</body>"))
            loads = [load_ms(path.as_uri(), tmp / f"profile-{n}-{i}") for i in range(args.runs)]
            print(f"{n:>6} {t1 - t0:>11.2f} {t2 - t1:>7.2f} {len(page) / 1024:>8.0f} "
                  f"{len(small) / 1024:>8.0f} {statistics.median(loads):>8.0f}", flush=True)  # fmt: skip
            if args.shot:
                shot = os.path.abspath(args.shot)
                subprocess.run(
                    [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                     f"--user-data-dir={tmp / 'shot'}", "--window-size=1000,1100",
                     f"--screenshot={shot}", path.as_uri()],
                    capture_output=True, timeout=120, check=True,
                )  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
