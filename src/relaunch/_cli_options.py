"""The table of the ``relaunch`` command's options: torchrun 2.13's, and ours."""

from __future__ import annotations

from dataclasses import dataclass

from relaunch.config import DEFAULT_SIGNALS

__all__ = ["OPTS", "Opt"]


@dataclass(frozen=True)
class Opt:
    default: str | None
    help: str
    short: str | None = None
    switch: bool = False
    env: bool = True
    refuse: str | None = None
    """What a torchrun flag relaunch cannot honour must be (anything else is refused)."""

    def flags(self, dest: str) -> tuple[str, ...]:
        long = ("--" + dest.replace("_", "-"), "--" + dest) if "_" in dest else ("--" + dest,)
        return (self.short, *long) if self.short else long


_NO = "nothing ({} is not supported)"
# dest -> option: --dash-case and --underscore_case spellings, PET_<DEST> as in torchrun.
OPTS: dict[str, Opt] = {
    "nnodes": Opt("1:1", "Number of nodes, or MIN:MAX for an elastic job."),
    "nproc_per_node": Opt("1", "Workers per node: a number, auto, cpu, gpu or xpu."),
    "rdzv_backend": Opt("static", "Rendezvous backend: static, c10d or etcd."),
    "rdzv_endpoint": Opt("", "Rendezvous endpoint HOST[:PORT] (etcd: a comma-separated list)."),
    "rdzv_id": Opt("none", "Job id, the same on every node."),
    "rdzv_conf": Opt("", "Rendezvous options KEY=VALUE,... (join_timeout, last_call_timeout...)."),
    "standalone": Opt(None, "Single node: c10d rendezvous on 127.0.0.1 and a fresh job id; "
                       "--rdzv-backend/-endpoint/-id and --nnodes are ignored.", switch=True),
    "max_restarts": Opt("0", "Worker group restarts allowed before the job fails."),
    "monitor_interval": Opt("0.1", "Seconds between two checks of the workers."),
    "start_method": Opt("forkserver", "How workers start: forkserver or fork (forked from a "
                         "fork server that has imported what the workers import: fast restarts; "
                         "the default) or spawn (a fresh interpreter for every worker)."),
    "event_log_handler": Opt("null", "Only 'null': relaunch writes its own structured events.",
                              refuse="'null' (relaunch writes its own structured events)"),
    "role": Opt("default", "Role of the workers (ROLE_NAME)."),
    "module": Opt(None, "Run the entrypoint as a module (python -m).", "-m", switch=True),
    "no_python": Opt(None, "Execute the entrypoint directly, not with python.", switch=True),
    "run_path": Opt(None, "Run the script with runpy.run_path (wins over --no-python).",
                     switch=True),
    "log_dir": Opt(None, "Base directory for the worker logs (default: a temporary one)."),
    "redirects": Opt("0", "Streams to log files only: 0-3 or LOCAL_RANK:0-3,... "
                      "(1 stdout, 2 stderr, 3 both).", "-r"),
    "tee": Opt("0", "Streams to log files and console (format of --redirects).", "-t"),
    "local_ranks_filter": Opt("", "Show only these local ranks on the console, e.g. 0,1."),
    "duplicate_stdout_filters": Opt("", "Not supported.", refuse=_NO.format("duplication")),
    "duplicate_stderr_filters": Opt("", "Not supported.", refuse=_NO.format("duplication")),
    "node_rank": Opt("0", "This node's rank (static backend only)."),
    "master_addr": Opt(None, "Address of node 0 (static only; default 127.0.0.1)."),
    "master_port": Opt(None, "Port on node 0 (static only; default 29500)."),
    "local_addr": Opt(None, "This node's address as the other nodes reach it."),
    "logs_specs": Opt(None, "Not supported (relaunch has its own log layout).", env=False,
                       refuse=_NO.format("a logs_specs plugin")),
    "numa_binding": Opt(None, "Not supported.", env=False, refuse=_NO.format("NUMA binding")),
    "signals_to_handle": Opt(DEFAULT_SIGNALS, "Signals forwarded to the workers, "
                              "e.g. SIGTERM,SIGINT,SIGUSR1."),
    "shutdown_timeout": Opt(None, "Seconds between SIGTERM and SIGKILL when stopping workers "
                             "(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)."),
    "virtual_local_rank": Opt(None, "Not supported.", switch=True,
                               refuse=_NO.format("virtual local rank")),
    "exit_barrier_timeout": Opt("300", "Seconds a finished node waits for the others."),
    "log_line_prefix_template": Opt(None, "Console line prefix, e.g. '[${role_name}${rank}]:' "
                                     "(default: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)."),
    "warm_standby": Opt(None, "Same as --start-method forkserver (the default); "
                         "--no-warm-standby is --start-method spawn.", switch=True),
    "hang_timeout": Opt("0", "Seconds without Python code running in a worker's main thread "
                         "after which it is declared hung and the group restarts (0: off)."),
    "snapshot_dir": Opt(None, "Where this node keeps its ranks' relaunch.checkpoint snapshots "
                         "(default: a new folder under /dev/shm, removed when the job ends)."),
    "snapshot_keep": Opt(
        "2",
        "Snapshots each rank keeps, newest first; at least 2 (the ranks complete a save "
        "at different moments: a fault between them restores the one before it).",
    ),
    "snapshot_limit": Opt(None, "Most bytes this node's snapshots may take, e.g. 16G "
                           "(default: half the file system that holds them)."),
    "checkpoint_dir": Opt(None, "Shared storage that receives copies of the snapshots in the "
                           "background; checkpoint.load() restores from it when no node has one."),
    "status_port": Opt(None, "Serve the job's status page, /status.json and /metrics on this "
                        "port (off by default; a port in use costs a warning, not the job)."),
    "status_host": Opt("127.0.0.1", "Address the status page listens on."),
}  # fmt: skip
