"""What a hung process is doing: its threads' stacks (``py-spy dump``), for a test's
failure message, so that a hang seen once in CI says where it was."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

__all__ = ["stacks_of_tree"]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def stacks_of_tree(pid: int, limit: int = 8) -> str:
    """The Python stacks of ``pid`` and its descendants (at most ``limit`` processes),
    or why there are none. Never raises."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "(py-spy is not installed: no stacks)"
    todo, dumps = [pid], []
    while todo and len(dumps) < limit:
        p = todo.pop(0)
        todo += _children(p)
        try:
            out = subprocess.run(
                [spy, "dump", "--pid", str(p)], capture_output=True, text=True, timeout=30
            )
            dumps.append(f"--- pid {p} ---\n{out.stdout}{out.stderr}")
        except (OSError, subprocess.SubprocessError) as exc:
            dumps.append(f"--- pid {p}: py-spy failed: {exc}")
    return "\n".join(dumps)
