"""JSON read from outside this process: a store's record, a file, a peer's message.

``json.loads`` raises RecursionError, not a ValueError, for a document nested more
deeply than the interpreter's recursion limit (a few kilobytes of ``[``): a corrupt or
hostile record would pass every ``except ValueError`` that refuses a bad one, and end
the thread that read it; and a plain ValueError for an integer of 4,300 digits or more,
past the readers that refuse a ``json.JSONDecodeError``. :func:`loads` makes each a
``json.JSONDecodeError`` like any other malformed document (bytes that are not UTF-8
too). (The modules loaded by path, standard library only, catch them themselves.)
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def loads(raw: str | bytes | bytearray) -> Any:
    """``json.loads(raw)``; ``json.JSONDecodeError`` for any document it refuses."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
    except ValueError as exc:  # (an int of 4,300+ digits; bytes that are not UTF-8)
        raise json.JSONDecodeError(str(exc)[:200], "", 0) from None
