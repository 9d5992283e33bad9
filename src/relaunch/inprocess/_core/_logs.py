"""Where the in-process wrapper logs: under NVIDIA's logger name.

NVIDIA's resiliency extension logs everything to the ``nvrx`` logger; code that
captures its records (a handler or a level set on ``nvrx``, pytest's ``caplog``)
sees ours too, since each module's logger is a child of it
(``nvrx.relaunch.inprocess._core._loop``, ...), and they reach the root logger as usual.
"""

from __future__ import annotations

import logging

__all__ = ["NVRX_LOGGER", "get_logger"]

NVRX_LOGGER = "nvrx"


def get_logger(module: str) -> logging.Logger:
    """The logger of in-process module ``module`` (its ``__name__``)."""
    return logging.getLogger(f"{NVRX_LOGGER}.{module}")
