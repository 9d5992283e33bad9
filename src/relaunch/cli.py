"""The ``relaunch`` command: a drop-in for ``torchrun`` (torch 2.13 flags and PET_* defaults).

Every value comes from, in this order: the flag, the ``PET_<FLAG>`` environment
variable, the default. This module is the only one that reads the environment for
configuration. Everything is validated before anything starts: a bad value ends with
exit code 2 and one line on stderr naming the flag, the value and what was expected.
torchrun flags relaunch cannot honour are refused the same way, never ignored.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.machinery import PathFinder
from typing import Any, NoReturn

from relaunch.config import (
    BACKENDS,
    DEFAULT_SIGNALS,
    START_METHODS,
    LaunchConfig,
    Std,
    check_template,
    parse_endpoint,
    parse_nnodes,
    parse_rdzv_conf,
    parse_signals,
)
from relaunch.errors import ConfigError

__all__ = ["main", "parse_args"]

logger = logging.getLogger(__name__)

_C10D_PORT = 29400
_ETCD_PORT = 2379
_STATIC_PORT = 29500


@dataclass(frozen=True)
class _Opt:
    flags: tuple[str, ...]
    default: str | None
    help: str
    env: bool = True
    switch: bool = False


# dest -> option; dest is the first long flag with "-" -> "_" (so PET_<DEST> as in torchrun).
_OPTS: dict[str, _Opt] = {
    "nnodes": _Opt(("--nnodes",), "1:1", "Number of nodes, or MIN:MAX for an elastic job."),
    "nproc_per_node": _Opt(("--nproc-per-node", "--nproc_per_node"), "1",
                           "Workers per node: a number, auto, cpu, gpu or xpu."),
    "rdzv_backend": _Opt(("--rdzv-backend", "--rdzv_backend"), "static",
                         "Rendezvous backend: static, c10d or etcd."),
    "rdzv_endpoint": _Opt(("--rdzv-endpoint", "--rdzv_endpoint"), "",
                          "Rendezvous endpoint, HOST[:PORT] (etcd: a comma-separated list)."),
    "rdzv_id": _Opt(("--rdzv-id", "--rdzv_id"), "none", "Job id, the same on every node."),
    "rdzv_conf": _Opt(("--rdzv-conf", "--rdzv_conf"), "",
                      "Rendezvous options: KEY=VALUE,... (join_timeout, last_call_timeout, ...)."),
    "standalone": _Opt(("--standalone",), None, "Single node: c10d rendezvous on 127.0.0.1, "
                       "fresh job id; --rdzv-backend/-endpoint/-id and --nnodes are ignored.",
                       switch=True),
    "max_restarts": _Opt(("--max-restarts", "--max_restarts"), "0",
                         "Worker group restarts allowed before the job fails."),
    "monitor_interval": _Opt(("--monitor-interval", "--monitor_interval"), "0.1",
                             "Seconds between two checks of the workers."),
    "start_method": _Opt(("--start-method", "--start_method"), "spawn",
                         "Start method for function entrypoints: spawn, fork or forkserver."),
    "event_log_handler": _Opt(("--event-log-handler", "--event_log_handler"), "null",
                              "torchrun's event handler; only 'null' (relaunch has its own events)."),
    "role": _Opt(("--role",), "default", "Role of the workers (ROLE_NAME)."),
    "module": _Opt(("-m", "--module"), None, "Run the entrypoint as a module (python -m).",
                   switch=True),
    "no_python": _Opt(("--no-python", "--no_python"), None,
                      "Execute the entrypoint directly, not with python.", switch=True),
    "run_path": _Opt(("--run-path", "--run_path"), None,
                     "Run the script with runpy.run_path (takes precedence over --no-python).",
                     switch=True),
    "log_dir": _Opt(("--log-dir", "--log_dir"), None, "Base directory for the worker logs."),
    "redirects": _Opt(("-r", "--redirects"), "0", "Streams to log files only: 0-3 or "
                      "LOCAL_RANK:0-3,... (1 stdout, 2 stderr, 3 both)."),
    "tee": _Opt(("-t", "--tee"), "0", "Streams to log files and console (as --redirects)."),
    "local_ranks_filter": _Opt(("--local-ranks-filter", "--local_ranks_filter"), "",
                               "Show only these local ranks on the console, e.g. 0,1."),
    "duplicate_stdout_filters": _Opt(("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
                                     "", "Not supported by relaunch (must be empty)."),
    "duplicate_stderr_filters": _Opt(("--duplicate-stderr-filters", "--duplicate_stderr_filters"),
                                     "", "Not supported by relaunch (must be empty)."),
    "node_rank": _Opt(("--node-rank", "--node_rank"), "0", "This node's rank (static only)."),
    "master_addr": _Opt(("--master-addr", "--master_addr"), None,
                        "Address of node 0 (static only; default 127.0.0.1)."),
    "master_port": _Opt(("--master-port", "--master_port"), None,
                        "Port on node 0 (static only; default 29500)."),
    "local_addr": _Opt(("--local-addr", "--local_addr"), None,
                       "This node's address as the other nodes reach it."),
    "logs_specs": _Opt(("--logs-specs", "--logs_specs"), None,
                       "Not supported by relaunch (torchrun.logs_specs plugins).", env=False),
    "numa_binding": _Opt(("--numa-binding", "--numa_binding"), None,
                         "Not supported by relaunch.", env=False),
    "signals_to_handle": _Opt(("--signals-to-handle", "--signals_to_handle"), DEFAULT_SIGNALS,
                              "Signals forwarded to the workers, e.g. SIGTERM,SIGINT,SIGUSR1."),
    "shutdown_timeout": _Opt(("--shutdown-timeout", "--shutdown_timeout"), None,
                             "Not supported by relaunch yet."),
    "virtual_local_rank": _Opt(("--virtual-local-rank", "--virtual_local_rank"), None,
                               "Not supported by relaunch.", switch=True),
    "exit_barrier_timeout": _Opt(("--exit-barrier-timeout", "--exit_barrier_timeout"), "300",
                                 "Seconds a finished node waits for the others."),
    "log_line_prefix_template": _Opt(
        ("--log-line-prefix-template", "--log_line_prefix_template"), None,
        "Console line prefix, e.g. '[${role_name}${rank}]:' (default from "
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)."),
    "warm_standby": _Opt(("--warm-standby", "--warm_standby"), None, "Keep a warm interpreter "
                         "with torch imported per local rank: fast restarts (default).", switch=True),
}  # fmt: skip

_REFUSED = {
    "event_log_handler": "'null' (relaunch writes its own structured events)",
    "duplicate_stdout_filters": "nothing (duplicating filtered lines is not supported)",
    "duplicate_stderr_filters": "nothing (duplicating filtered lines is not supported)",
    "logs_specs": "nothing (relaunch has its own log layout, no logs_specs plugins)",
    "numa_binding": "nothing (NUMA binding is not supported)",
    "shutdown_timeout": "nothing (not supported yet: workers get SIGTERM, then SIGKILL)",
    "virtual_local_rank": "nothing (virtual local ranks are not supported)",
}


class _Store(argparse.Action):
    """Store the value and remember which spelling was used (for error messages)."""

    def __call__(self, parser: Any, ns: Any, values: Any, option_string: Any = None) -> None:
        setattr(ns, self.dest, self.const if self.nargs == 0 else values)
        ns.spelling[self.dest] = option_string


class _Parser(argparse.ArgumentParser):
    argv: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:
        """One line naming the flag as the user spelled it, instead of usage + error + exit."""
        match = re.match(r"argument ([^: ]+): (.*)", message)
        if match is None:
            raise ConfigError(message)
        flags = match[1].split("/")
        used = [f for f in flags if any(a == f or a.startswith(f + "=") for a in self.argv)]
        raise ConfigError(f"{(used or flags)[0]}: {match[2]}")


def _parser() -> _Parser:
    parser = _Parser(prog="relaunch", description="Fault-tolerant drop-in for torchrun.")
    for dest, opt in _OPTS.items():
        nargs = 0 if opt.switch else None
        const = True if opt.switch else None
        parser.add_argument(
            *opt.flags, dest=dest, action=_Store, nargs=nargs, const=const, help=opt.help
        )
    parser.add_argument("--no-warm-standby", "--no_warm_standby", dest="warm_standby",
                        action=_Store, nargs=0, const=False, help="Start every worker cold.")  # fmt: skip
    parser.add_argument("training_script", nargs="?", help="Script, module or binary to run.")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    parser.set_defaults(**dict.fromkeys(_OPTS))
    return parser


class _Values:
    """Each setting with its source: flag > PET_<DEST> environment variable > default."""

    def __init__(self, ns: argparse.Namespace, env: Mapping[str, str]) -> None:
        self._ns = ns
        self._env = env

    def label(self, dest: str) -> str:
        """The flag as the user spelled it, or its canonical spelling and the PET_ variable."""
        spelling: str | None = self._ns.spelling.get(dest)
        if spelling is not None:
            return spelling
        canonical = next(flag for flag in _OPTS[dest].flags if flag.startswith("--"))
        if self._env_value(dest) is not None:
            return f"{canonical} (from PET_{dest.upper()})"
        return canonical

    def _env_value(self, dest: str) -> str | None:
        if not _OPTS[dest].env:
            return None
        return self._env.get(f"PET_{dest.upper()}") or None

    def given(self, dest: str) -> bool:
        return getattr(self._ns, dest) is not None or self._env_value(dest) is not None

    def text(self, dest: str) -> str | None:
        value = getattr(self._ns, dest)
        if value is None:
            value = self._env_value(dest)
        return _OPTS[dest].default if value is None else str(value)

    def switch(self, dest: str, default: bool = False) -> bool:
        value = getattr(self._ns, dest)
        if value is not None:
            return bool(value)
        text = self._env_value(dest)
        if text is None:
            return default
        if not re.fullmatch(r"\s*\d+\s*", text):
            raise ConfigError(f"PET_{dest.upper()}: expected 0 or 1, got {text!r}")
        return int(text) != 0

    def fail(self, dest: str, expected: str, got: object = None) -> NoReturn:
        got = self.text(dest) if got is None else got
        raise ConfigError(f"{self.label(dest)}: expected {expected}, got {got!r}")

    def integer(self, dest: str, low: int, high: int | None = None) -> int:
        text = (self.text(dest) or "").strip()
        ok = re.fullmatch(r"[+-]?\d+", text) is not None
        if not ok or int(text) < low or (high is not None and int(text) > high):
            self.fail(dest, f"an integer >= {low}" + (f" and <= {high}" if high else ""))
        return int(text)

    def number(self, dest: str, *, positive: bool) -> float:
        text = (self.text(dest) or "").strip()
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value > 0 if positive else value >= 0) or value == float("inf"):
            self.fail(dest, "a finite number " + ("> 0" if positive else ">= 0"))
        return value

    def parsed(self, dest: str, parse: Any, *args: Any) -> Any:
        """Run a config parser, renaming the field in its error to the flag used."""
        return parse(self.text(dest) or "", *args, self.label(dest))


def _check_host(values: _Values, dest: str) -> str | None:
    host = values.text(dest)
    if host is not None and not re.fullmatch(r"\[[\w.:-]+\]|[\w.:-]+", host.strip()):
        values.fail(dest, "a host name or IP address (IPv6 in brackets)")
    return None if host is None else host.strip()


def _nproc(values: _Values) -> int | str:
    text = (values.text("nproc_per_node") or "").strip()
    if re.fullmatch(r"[+-]?\d+", text) and int(text) >= 1:
        return int(text)
    if text in ("auto", "cpu", "gpu", "xpu"):
        return text
    return values.fail("nproc_per_node", "a number >= 1, auto, cpu, gpu or xpu")


def _cpu_count() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _resolve_nproc(values: _Values, kind: int | str) -> int:
    if isinstance(kind, int):
        return kind
    if kind == "cpu":
        return _cpu_count()
    import torch  # only to count devices

    if kind == "auto":
        if torch.accelerator.is_available():
            return int(torch.accelerator.device_count())
        return _cpu_count()
    device = torch.cuda if kind == "gpu" else torch.xpu
    if not device.is_available() or device.device_count() < 1:
        values.fail("nproc_per_node", f"a device type present on this node ({kind} is not)")
    count: int = device.device_count()
    logger.info("--nproc-per-node=%s: %s devices found", kind, count)
    return count


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` would find the module, without running any of its code."""
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
        return False
    parts = name.split(".")
    if parts[0] in sys.builtin_module_names:
        return len(parts) == 1
    spec = PathFinder.find_spec(parts[0], [os.getcwd(), *sys.path])
    if spec is None and len(parts) == 1:
        return importlib.util.find_spec(parts[0]) is not None  # frozen modules
    for part in parts[1:]:
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


def _check_entrypoint(values: _Values, script: str, module: bool, no_python: bool) -> str:
    if module:
        if not _module_exists(script):
            raise ConfigError(f"-m/--module: expected an importable module, got {script!r}")
    elif no_python:
        if shutil.which(script) is None:
            raise ConfigError(
                f"--no-python: expected an executable file or a program on PATH, got {script!r}"
            )
    elif not os.path.isfile(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        raise ConfigError(f"training_script: expected an existing Python script, got {script!r}")
    return script


def _std(values: _Values, dest: str, nproc: int) -> dict[int, Std]:
    parsed = values.parsed(dest, Std.parse)
    if isinstance(parsed, dict) and any(rank >= nproc for rank in parsed):
        logger.warning("%s: local ranks >= %s do not exist; ignored", values.label(dest), nproc)
    return Std.to_map(parsed, nproc)


def _ranks_filter(values: _Values) -> frozenset[int] | None:
    text = (values.text("local_ranks_filter") or "").strip()
    if not text:
        return None
    if not re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
        values.fail("local_ranks_filter", "a comma-separated list of local ranks, e.g. 0,1,2")
    return frozenset(int(item) for item in text.split(","))


def _rendezvous(values: _Values, nnodes: tuple[int, int]) -> tuple[str, str, str, tuple[int, int]]:
    """(backend, endpoint, run id, (min, max)) after --standalone and torchrun's fallbacks."""
    backend = (values.text("rdzv_backend") or "").strip()
    if backend not in BACKENDS:
        values.fail("rdzv_backend", "one of " + ", ".join(BACKENDS))
    endpoint = (values.text("rdzv_endpoint") or "").strip()
    run_id = (values.text("rdzv_id") or "").strip()
    if not run_id:
        values.fail("rdzv_id", "a non-empty job id")
    if values.switch("standalone"):
        for dest in ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "nnodes"):
            if values.given(dest):
                logger.warning(
                    "--standalone: ignoring %s=%s", values.label(dest), values.text(dest)
                )
        return "c10d", "127.0.0.1:0", str(uuid.uuid4()), (1, 1)
    if backend == "static" and not endpoint and not values.given("master_port") and nnodes[1] == 1:
        # torchrun's single-node default; an explicit --rdzv-id is kept (torchrun drops it).
        return (
            "c10d",
            "127.0.0.1:0",
            run_id if values.given("rdzv_id") else str(uuid.uuid4()),
            nnodes,
        )
    if backend == "static":
        if nnodes[0] != nnodes[1]:
            values.fail("nnodes", "N (the static backend has a fixed number of nodes)")
        if not endpoint:
            addr = _check_host(values, "master_addr") or "127.0.0.1"
            port = values.integer("master_port", 0, 65535) if values.given("master_port") else None
            return backend, f"{addr}:{_STATIC_PORT if port is None else port}", run_id, nnodes
        return backend, values.parsed("rdzv_endpoint", parse_endpoint, None), run_id, nnodes
    default_port = _C10D_PORT if backend == "c10d" else _ETCD_PORT
    items = endpoint.split(",") if backend == "etcd" and endpoint else [endpoint or "127.0.0.1"]
    label = values.label("rdzv_endpoint")
    if backend == "c10d" and "," in endpoint:
        values.fail("rdzv_endpoint", "HOST[:PORT] (one endpoint for c10d)")
    normalized = [parse_endpoint(item, default_port, label) for item in items]
    return backend, ",".join(normalized), run_id, nnodes


def parse_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse and validate a ``relaunch`` command line (flags > PET_* environment > defaults).

    Raises ConfigError with a one-line message naming the flag, the value and what was
    expected. Imports torch only to resolve ``--nproc-per-node auto|gpu|xpu``.
    """
    parser = _parser()
    parser.argv = sys.argv[1:] if argv is None else argv
    ns = parser.parse_args(parser.argv, namespace=argparse.Namespace(spelling={}))
    values = _Values(ns, os.environ)
    for dest, expected in _REFUSED.items():
        if _OPTS[dest].switch and values.switch(dest):
            values.fail(dest, expected, "set")
        if not _OPTS[dest].switch and values.text(dest) != _OPTS[dest].default:
            values.fail(dest, expected)
    module, no_python, run_path = (values.switch(d) for d in ("module", "no_python", "run_path"))
    script: str | None = ns.training_script
    if not script:
        raise ConfigError("training_script: expected a script, module (-m) or program to run")
    if module and no_python:
        values.fail("no_python", "no --module with --no-python", "--module")
    if run_path and module:
        values.fail("run_path", "no --module with --run-path", "--module")
    if run_path and no_python:
        logger.info("--run-path takes precedence over --no-python")
        no_python = False
    nnodes = values.parsed("nnodes", parse_nnodes)
    nproc_kind = _nproc(values)
    node_rank = values.integer("node_rank", 0)
    raw_backend = (values.text("rdzv_backend") or "").strip()
    if raw_backend == "static" and node_rank >= nnodes[1]:
        values.fail("node_rank", f"a rank below the number of nodes ({nnodes[1]})")
    max_restarts = values.integer("max_restarts", 0)
    monitor_interval = values.number("monitor_interval", positive=True)
    exit_barrier_timeout = values.number("exit_barrier_timeout", positive=False)
    start_method = (values.text("start_method") or "").strip()
    if start_method not in START_METHODS:
        values.fail("start_method", "one of " + ", ".join(START_METHODS))
    role = (values.text("role") or "").strip() or values.fail("role", "a non-empty role name")
    rdzv_conf = values.parsed("rdzv_conf", parse_rdzv_conf)
    signals = values.parsed("signals_to_handle", parse_signals)
    master_addr = _check_host(values, "master_addr")
    master_port = values.integer("master_port", 0, 65535) if values.given("master_port") else None
    local_addr = _check_host(values, "local_addr")
    backend, endpoint, run_id, (min_nodes, max_nodes) = _rendezvous(values, nnodes)
    if node_rank and backend != "static":
        logger.warning("--node-rank is only used by the static backend; ignored for %s", backend)
    redirects_given = values.parsed("redirects", Std.parse)
    tee_given = values.parsed("tee", Std.parse)
    del redirects_given, tee_given  # syntax checked before any device count
    ranks_filter = _ranks_filter(values)
    log_dir = values.text("log_dir") or None
    if log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        values.fail("log_dir", "a directory or a path where one can be created")
    template = values.text("log_line_prefix_template")
    if template is None:
        template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None
    if template is not None:
        label = values.label("log_line_prefix_template")
        if values.text("log_line_prefix_template") is None:
            label = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
        check_template(template, label)
    python_exec = os.environ.get("PYTHON_EXEC")
    if (
        python_exec
        and not no_python
        and os.path.realpath(python_exec) != os.path.realpath(sys.executable)
    ):
        raise ConfigError(f"PYTHON_EXEC: expected unset (workers use {sys.executable}), "
                          f"got {python_exec!r}")  # fmt: skip
    entrypoint = _check_entrypoint(values, script, module, no_python)
    nproc = _resolve_nproc(values, nproc_kind)
    try:
        return LaunchConfig(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nproc_per_node=nproc,
            node_rank=node_rank,
            rdzv_backend=backend,
            rdzv_endpoint=endpoint,
            rdzv_id=run_id,
            rdzv_conf=rdzv_conf,
            standalone=values.switch("standalone"),
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            start_method=start_method,
            role=role,
            entrypoint=entrypoint,
            args=tuple(ns.training_script_args),
            module=module,
            no_python=no_python,
            run_path=run_path,
            log_dir=log_dir,
            redirects=_std(values, "redirects", nproc),
            tee=_std(values, "tee", nproc),
            local_ranks_filter=ranks_filter,
            master_addr=master_addr,
            master_port=master_port,
            local_addr=local_addr,
            exit_barrier_timeout=exit_barrier_timeout,
            warm_standby=values.switch("warm_standby", default=True),
            log_line_prefix_template=template,
            signals_to_handle=signals,
        )
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in the launch configuration)") from exc


def _configure_logging() -> None:
    level = os.environ.get("LOGLEVEL", "WARNING").strip().upper() or "WARNING"
    if not isinstance(logging.getLevelName(level), int):
        raise ConfigError(
            f"LOGLEVEL: expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}"
        )
    logging.basicConfig(
        level=level, stream=sys.stderr, format="[relaunch] %(levelname)s %(name)s: %(message)s"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the ``relaunch`` command; return the process exit code (2 for a bad command line)."""
    try:
        _configure_logging()
        config = parse_args(argv)
    except ConfigError as exc:
        message = str(exc).replace("\r", "\\r").replace("\n", "\\n")
        print(f"relaunch: error: {message}", file=sys.stderr, flush=True)
        return 2
    if "OMP_NUM_THREADS" not in os.environ and config.nproc_per_node > 1:
        logger.info("OMP_NUM_THREADS is not set: setting it to 1 for the workers")
        os.environ["OMP_NUM_THREADS"] = "1"
    agent = importlib.import_module("relaunch.agent")  # lazily: parsing never needs it
    launch: Callable[[LaunchConfig], int] = agent.launch
    return launch(config)
