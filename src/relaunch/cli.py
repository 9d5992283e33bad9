"""The ``relaunch`` command: a drop-in for ``torchrun`` (torch 2.13 flags and PET_* defaults).

Every value comes from, in this order: the flag, the ``PET_<FLAG>`` environment
variable, Slurm's job step when run by ``srun`` on several nodes (``_cli_slurm``), the
default. This module is the only one that reads the environment for configuration.
Everything is validated before anything starts: a bad value ends with
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
import tempfile
import uuid
from collections.abc import Callable, Sequence
from importlib.machinery import PathFinder
from typing import TypeVar

from relaunch import _parse
from relaunch._cli_notes import say_conf_ignored, say_new_job
from relaunch._cli_options import OPTS
from relaunch._cli_slurm import SlurmDefaults, slurm_defaults
from relaunch._cli_values import Values, build_parser
from relaunch._endpoint import C10D_PORT, ETCD_PORT, join_endpoint
from relaunch.config import BACKENDS, START_METHODS, LaunchConfig, Std
from relaunch.errors import ConfigError

__all__ = ["main", "parse_args"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_STATIC_PORT = 29500


def _check_host(values: Values, dest: str) -> str | None:
    host = values.text(dest)
    if host is not None and not re.fullmatch(r"\[[\w.:-]+\]|[\w.:-]+", host.strip()):
        values.fail(dest, "a host name or IP address (IPv6 in brackets)")
    # the host itself: "[::1]" is "::1" (the brackets went on again where a port joins it)
    return None if host is None else host.strip().removeprefix("[").removesuffix("]")


def _nproc(values: Values) -> int | str:
    text = values.stripped("nproc_per_node")
    if re.fullmatch(r"[+-]?\d+", text) and int(text) >= 1:
        return int(text)
    if text in ("auto", "cpu", "gpu", "xpu"):
        return text
    return values.fail("nproc_per_node", "a number >= 1, auto, cpu, gpu or xpu")


def _cpu_count() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _resolve_nproc(values: Values, kind: int | str) -> int:
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
    # The worker's sys.path starts with its working directory; other finders (frozen,
    # editable installs) only look up the top-level name, which runs no code of it.
    spec = PathFinder.find_spec(parts[0], [os.getcwd(), *sys.path])
    try:
        spec = spec or importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):  # e.g. a module in sys.modules without a spec
        return False
    for part in parts[1:]:
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


def _std(values: Values, dest: str, nproc: int) -> dict[int, Std]:
    parsed = values.parsed(dest, _parse.parse_std)
    if isinstance(parsed, dict) and any(rank >= nproc for rank in parsed):
        logger.warning("%s: local ranks >= %s do not exist; ignored", values.label(dest), nproc)
    return Std.to_map(parsed, nproc)


def _ranks_filter(values: Values) -> frozenset[int] | None:
    text = values.stripped("local_ranks_filter")
    if not text:
        return None
    if not re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
        values.fail("local_ranks_filter", "a comma-separated list of local ranks, e.g. 0,1,2")
    return frozenset(int(item) for item in text.split(","))


def _rendezvous(values: Values, nnodes: tuple[int, int]) -> tuple[str, str, str, tuple[int, int]]:
    """(backend, endpoint, run id, (min, max)) after --standalone and torchrun's fallbacks."""
    backend = values.stripped("rdzv_backend")
    if backend not in BACKENDS:
        values.fail("rdzv_backend", "one of " + ", ".join(BACKENDS))
    endpoint = values.stripped("rdzv_endpoint")
    run_id = values.parsed("rdzv_id", _parse.check_run_id)
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
            endpoint = join_endpoint(addr, _STATIC_PORT if port is None else port)
            return backend, endpoint, run_id, nnodes
        return backend, values.parsed("rdzv_endpoint", _parse.parse_endpoint, None), run_id, nnodes
    default_port = C10D_PORT if backend == "c10d" else ETCD_PORT
    items = endpoint.split(",") if backend == "etcd" and endpoint else [endpoint or "127.0.0.1"]
    label = values.label("rdzv_endpoint")
    if backend == "c10d" and "," in endpoint:
        values.fail("rdzv_endpoint", "HOST[:PORT] (one endpoint for c10d)")
    normalized = [_parse.parse_endpoint(item, default_port, label) for item in items]
    return backend, ",".join(normalized), run_id, nnodes


def _start_method(values: Values) -> str:
    """``--start-method``, reconciled with ``--[no-]warm-standby`` (its older spelling):
    ``fork`` and ``forkserver`` fork workers from the fork server, ``spawn`` starts a fresh
    interpreter for each. Both given and disagreeing: refused."""
    method = values.stripped("start_method")
    if method not in START_METHODS:
        values.fail("start_method", "one of " + ", ".join(START_METHODS))
    if not values.given("warm_standby"):
        return method
    warm = values.switch("warm_standby")
    if values.given("start_method") and warm != (method != "spawn"):
        raise ConfigError(
            f"{values.label('warm_standby')}: contradicts {values.label('start_method')} "
            f"{method} (fork and forkserver use the fork server, spawn does not); give one"
        )
    return method if values.given("start_method") else ("forkserver" if warm else "spawn")


def _entry(values: Values, script: str | None) -> tuple[str, bool, bool, bool]:
    """(entrypoint, module, no_python, run_path) from the flags."""
    module, no_python, run_path = (values.switch(d) for d in ("module", "no_python", "run_path"))
    if not script:
        raise ConfigError("training_script: expected a script, module (-m) or program to run")
    if module and no_python:
        values.fail("no_python", "no --module with --no-python", "--module")
    if run_path and module:
        values.fail("run_path", "no --module with --run-path", "--module")
    no_python = no_python and not run_path  # torchrun: --run-path takes precedence
    return script, module, no_python, run_path


def _check_exists(script: str, module: bool, no_python: bool) -> str:
    """The entrypoint exists where the workers will look for it (no code of it runs here)."""
    python = os.environ.get("PYTHON_EXEC")
    if python and not no_python and os.path.realpath(python) != os.path.realpath(sys.executable):
        raise ConfigError(f"PYTHON_EXEC: expected unset (workers use {sys.executable}), "
                          f"got {python!r}")  # fmt: skip
    if module and not _module_exists(script):
        raise ConfigError(f"-m/--module: expected an importable module, got {script!r}")
    if no_python and shutil.which(script) is None:
        raise ConfigError(
            f"--no-python: expected an executable file or a program on PATH, got {script!r}"
        )
    main_file = os.path.join(script, "__main__.py")
    if not (module or no_python or os.path.isfile(script) or os.path.isfile(main_file)):
        raise ConfigError(f"training_script: expected an existing Python script, got {script!r}")
    return script


def _with_secret(conf: dict[str, str]) -> dict[str, str]:
    """``RELAUNCH_RDZV_SECRET_FILE`` when ``--rdzv-conf`` names no ``secret_file``."""
    path = os.environ.get("RELAUNCH_RDZV_SECRET_FILE", "").strip()
    if path and "secret_file" not in conf:
        return {**conf, "secret_file": path}
    return conf


def _check_log_dir(values: Values, log_dir: str) -> None:
    """The log directory exists (or is created) and takes files: else one line, exit 2,
    before anything starts."""
    if os.path.exists(log_dir) and not os.path.isdir(log_dir):
        values.fail("log_dir", "a directory or a path where one can be created")
    try:
        os.makedirs(log_dir, exist_ok=True)
        with tempfile.TemporaryFile(prefix=".relaunch-probe-", dir=log_dir) as probe:
            probe.write(b"\0" * 65536)  # room for the first logs and error files
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        values.fail("log_dir", f"a writable directory ({exc.strerror or exc})")


def _template(values: Values) -> str | None:
    template = values.text("log_line_prefix_template")
    label = values.label("log_line_prefix_template")
    if template is None:
        template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None
        label = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
    return None if template is None else _parse.check_template(template, label)


def parse_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse and validate a ``relaunch`` command line (flags > PET_* environment > defaults).

    Raises ConfigError with a one-line message naming the flag, the value and what was
    expected. Imports torch only to resolve ``--nproc-per-node auto|gpu|xpu``.
    """
    ns, values, slurm = _command_line(argv)
    entrypoint, module, no_python, run_path = _entry(values, ns.training_script)
    nnodes = values.parsed("nnodes", _parse.parse_nnodes)
    nproc_kind = _nproc(values)
    node_rank = values.integer("node_rank", 0)
    if values.stripped("rdzv_backend") == "static" and node_rank >= nnodes[1]:
        values.fail("node_rank", f"a rank below the number of nodes ({nnodes[1]})")
    start_method = _start_method(values)
    role = values.stripped("role") or values.fail("role", "a non-empty role name")
    backend, endpoint, run_id, (min_nodes, max_nodes) = _rendezvous(values, nnodes)
    if node_rank and backend != "static":
        logger.warning("--node-rank is only used by the static backend; ignored for %s", backend)
    log_dir = values.text("log_dir") or None
    if log_dir is not None:
        _check_log_dir(values, log_dir)
    config = LaunchConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, node_rank=node_rank,
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_id=run_id,
        rdzv_conf=slurm.conf(_with_secret(values.parsed("rdzv_conf", _parse.parse_rdzv_conf))),
        standalone=values.switch("standalone"),
        max_restarts=values.integer("max_restarts", 0),
        monitor_interval=values.number("monitor_interval", positive=True),
        start_method=start_method, role=role,
        args=tuple(ns.training_script_args), module=module, no_python=no_python,
        run_path=run_path, log_dir=log_dir,
        local_ranks_filter=_ranks_filter(values),
        master_addr=_check_host(values, "master_addr"),
        master_port=values.integer("master_port", 0, 65535) if values.given("master_port") else None,
        local_addr=_check_host(values, "local_addr"),
        exit_barrier_timeout=values.number("exit_barrier_timeout", positive=False),
        shutdown_timeout=_shutdown_timeout(values),
        watchdog=os.environ.get("TORCHELASTIC_ENABLE_FILE_TIMER", "").strip() == "1",
        watchdog_file=os.environ.get("TORCHELASTIC_TIMER_FILE", "").strip() or None,
        hang_timeout=values.number("hang_timeout", positive=False),
        status_port=values.integer("status_port", 1, 65535) if values.given("status_port") else None,
        status_host=_check_host(values, "status_host") or "127.0.0.1",
        log_line_prefix_template=_template(values),
        snapshot_dir=_check_dir(values, "snapshot_dir"),
        snapshot_keep=values.integer("snapshot_keep", 2),
        snapshot_limit=values.parsed("snapshot_limit", _parse.parse_bytes)
        if values.given("snapshot_limit") else None,
        checkpoint_dir=_check_dir(values, "checkpoint_dir"),
        signals_to_handle=values.parsed("signals_to_handle", _parse.parse_signals),
        # Last: the file system, then counting devices (may import torch).
        entrypoint=_check_exists(entrypoint, module, no_python),
        nproc_per_node=(nproc := _resolve_nproc(values, nproc_kind)),
        redirects=_std(values, "redirects", nproc), tee=_std(values, "tee", nproc),
    )  # fmt: skip
    if config.alone and values.given("rdzv_conf"):
        say_conf_ignored(config, values)
    if config.checkpoint_dir and run_id != values.parsed("rdzv_id", _parse.check_run_id):
        say_new_job(config, values.switch("standalone"))
    return config


def _command_line(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Values, SlurmDefaults]:
    """The parsed flags, their values (flags > PET_* environment > Slurm's step >
    defaults), and the Slurm step; a refused flag or variable is a ConfigError."""
    parser = build_parser()
    parser.argv = sys.argv[1:] if argv is None else argv
    ns = parser.parse_args(parser.argv, namespace=argparse.Namespace(spelling={}))
    values = Values(ns, os.environ)
    slurm = slurm_defaults(values, os.environ)  # `srun relaunch ...`: Slurm's step
    values = values.with_fallback(slurm.fallback)
    if slurm.summary:
        print(f"relaunch: {slurm.summary}", file=sys.stderr, flush=True)
    for dest, opt in OPTS.items():
        if opt.refuse and (values.switch(dest) if opt.switch else values.text(dest) != opt.default):
            values.fail(dest, opt.refuse, "set" if opt.switch else None)
    return ns, values, slurm


def _check_dir(values: Values, dest: str) -> str | None:
    """A directory the agent can create and write in (made now), or None when not given."""
    path = values.text(dest) or None
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(prefix=".relaunch-probe-", dir=path):
            pass
    except OSError as exc:
        values.fail(dest, f"a writable directory ({exc.strerror or exc})")
    return os.path.abspath(path)


def _shutdown_timeout(values: Values) -> float:
    if values.given("shutdown_timeout"):
        return values.number("shutdown_timeout", positive=False)
    text = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "").strip() or "30"
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise ConfigError(
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT: expected a finite number >= 0, got {text!r}"
        )
    return value


def _configure_logging() -> None:
    level = os.environ.get("LOGLEVEL", "WARNING").strip().upper() or "WARNING"
    if not isinstance(logging.getLevelName(level), int):
        raise ConfigError(
            f"LOGLEVEL: expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}"
        )
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="[relaunch] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the ``relaunch`` command; return the process exit code (2 for a bad command line)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "status" and not os.path.isfile("status"):  # a job's state
        from relaunch._status_cli import status_main

        return status_main(args[1:])
    try:
        _configure_logging()
        config = parse_args(argv)
    except ConfigError as exc:
        message = str(exc).replace("\r", "\\r").replace("\n", "\\n")
        print(f"relaunch: error: {message}", file=sys.stderr, flush=True)
        return 2
    launcher = importlib.import_module("relaunch.launcher")  # lazily: parsing never needs it
    launch: Callable[[LaunchConfig], int] = launcher.launch
    return launch(config)
