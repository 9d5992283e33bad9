"""The live view of a job: what each agent publishes, ``relaunch status``, the status page.

Each agent keeps a :class:`StatusBoard` fed with its events (it also gives them a
human voice on stderr) and publishes the resulting :class:`NodeReport` to the
rendezvous store. :func:`read_job` joins the rendezvous state and the reports into
one document (``docs/status.md``), drawn by :func:`render_text` in the terminal and
served by :class:`StatusServer` as a page, ``/status.json`` and ``/metrics``.
"""

import importlib
from typing import TYPE_CHECKING

from relaunch.status._board import StatusBoard, escape
from relaunch.status._job import JOB_VERSION, job_document, local_document, read_job, status_key
from relaunch.status._report import (
    MAX_REPORT_BYTES,
    REPORT_VERSION,
    FailureLine,
    NodeReport,
    Recovery,
    TimelineEntry,
    WorkerRow,
    decode_report,
    encode_report,
)
from relaunch.status._server import StatusServer

if TYPE_CHECKING:
    from relaunch.status._metrics import render_metrics
    from relaunch.status._text import render_text
    from relaunch.status._web import render_html

_LAZY = {"render_text": "_text", "render_html": "_web", "render_metrics": "_metrics"}


def __getattr__(name: str) -> object:
    # rich and prometheus_client load only when a view is drawn (the agent never does).
    if name in _LAZY:
        module = importlib.import_module(f"relaunch.status.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "JOB_VERSION",
    "MAX_REPORT_BYTES",
    "REPORT_VERSION",
    "FailureLine",
    "NodeReport",
    "Recovery",
    "StatusBoard",
    "StatusServer",
    "TimelineEntry",
    "WorkerRow",
    "decode_report",
    "encode_report",
    "escape",
    "job_document",
    "local_document",
    "read_job",
    "render_html",
    "render_metrics",
    "render_text",
    "status_key",
]
