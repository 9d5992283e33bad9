"""JSON read from outside this process: a store's record, a file, a peer's message.

``json.loads`` raises RecursionError, not a ValueError, for a document nested more
deeply than the interpreter's recursion limit (a few kilobytes of ``[``): a corrupt or
hostile record would pass every ``except ValueError`` that refuses a bad one, and end
the thread that read it. :func:`loads` makes it a ``json.JSONDecodeError`` like any
other malformed document. (The modules loaded by path, standard library only, catch
RecursionError themselves.)
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def loads(raw: str | bytes | bytearray) -> Any:
    """``json.loads(raw)``; ``json.JSONDecodeError`` for a document nested too deep."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
