"""A rank program for the in-process restart tests (run as a script, not collected).

Environment: IPX_FAULTS, a JSON list of faults ``{"iteration", "rank" (initial),
"kind", "step"}``; IPX_WRAPPER, JSON keyword arguments of the Wrapper (durations in
seconds); IPX_STEPS, steps per iteration. Prints one JSON object per line on stdout.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import sys
import threading
import time


def _emit(**doc: object) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _sockets() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                count += 1
        except OSError:
            pass
    return count


def _children() -> list[int]:
    out: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


class _Hook:
    def __call__(self, state):  # health check that can be told to fail (NVIDIA's arity)
        fail = json.loads(os.environ.get("IPX_UNHEALTHY", "[]"))
        if state.initial_rank in fail and state.fn_exception is not None:
            raise RuntimeError("injected unhealthy rank")
        return state


class _StuckFinalize:
    def __call__(self, state):  # finalize that blocks in C holding the GIL
        if state.initial_rank in json.loads(os.environ["IPX_STUCK_FINALIZE"]):
            _emit(event="finalize_stuck", t=time.time())
            ctypes.PyDLL(None).pause()
        return state


def main() -> None:
    import torch
    import torch.distributed as dist

    from relaunch import inprocess

    if os.environ.get("IPX_LOG"):
        import logging

        logging.basicConfig(
            level=logging.DEBUG,
            format=f"%(relativeCreated)d r{os.environ['RANK']} %(process)d %(name)s %(message)s",
        )
    faults = json.loads(os.environ.get("IPX_FAULTS", "[]"))
    steps = int(os.environ.get("IPX_STEPS", "5"))
    params = json.loads(os.environ.get("IPX_WRAPPER", "{}"))
    kwargs: dict[str, object] = {
        k: datetime.timedelta(seconds=v) if isinstance(v, int | float) else v
        for k, v in params.items()
        if k not in ("max_active_world_size", "tree")
    }
    if "tree" in params:  # [ranks per host, active ranks per host]: NVIDIA's Tree
        per_host, active = params["tree"]
        ra = inprocess.rank_assignment
        kwargs["rank_assignment"] = ra.Tree(
            [
                ra.Layer(min_ranks=1, key_or_fn="root", flag=ra.LayerFlag.RESERVE),
                ra.Layer(min_ranks=1, max_ranks=active, flag=ra.LayerFlag.RESERVE,
                         key_or_fn=lambda s: f"host{s.initial_rank // per_host}"),
            ]
        )  # fmt: skip
    if os.environ.get("IPX_CUSTOM"):  # an assignment of the user's: NVIDIA calls it so
        ra = inprocess.rank_assignment

        class Mine(ra.RankAssignment):
            def __call__(self, ctx):  # type: ignore[no-untyped-def]
                assert ctx.store is not None, "called without the store"
                _emit(event="assign", pid=os.getpid(), rank=ctx.state.initial_rank)
                return ra.ShiftRanks()(ctx)

        kwargs["rank_assignment"] = Mine()
    if "max_active_world_size" in params:
        kwargs["rank_filter"] = inprocess.MaxActiveWorldSize(params["max_active_world_size"])
    if os.environ.get("IPX_UNHEALTHY"):
        kwargs["health_check"] = _Hook()
    if os.environ.get("IPX_STUCK_FINALIZE"):
        kwargs["finalize"] = _StuckFinalize()
    initial = int(os.environ["RANK"])
    sockets_before = _sockets()

    @inprocess.Wrapper(**kwargs)
    def train(call_wrapper: inprocess.CallWrapper | None = None) -> str:
        assert call_wrapper is not None
        it = call_wrapper.iteration
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        _emit(
            event="start",
            iteration=it,
            rank=rank,
            world=world,
            initial=initial,
            pid=os.getpid(),
            t=time.time(),
        )
        mine = [f for f in faults if f["iteration"] == it and f["rank"] == initial]
        for step in range(steps):
            for fault in mine:
                if fault.get("step", 1) == step:
                    _inject(fault["kind"], call_wrapper)
            tensor = torch.ones(1)
            dist.all_reduce(tensor)
            assert int(tensor.item()) == world, (tensor, world)
            call_wrapper.ping()
            time.sleep(0.01)
        for fault in mine:  # ("step": "end": after the last collective, before returning)
            if fault.get("step") == "end":
                _inject(fault["kind"], call_wrapper)
        if os.environ.get("IPX_REPORT_GLOO"):
            _report_gloo_timeouts(call_wrapper, dist.group.WORLD._get_backend(torch.device("cpu")))
        dist.destroy_process_group()
        _emit(event="done", iteration=it, rank=rank, initial=initial)
        return f"value-{initial}"

    late = os.environ.get("IPX_LATE", "")  # "RANK:SECONDS": that rank comes late
    if late and int(late.split(":")[0]) == initial:
        time.sleep(float(late.split(":")[1]))
    try:
        value = train()
    except inprocess.RestartError as exc:
        _emit(event="error", kind=type(exc).__name__, message=str(exc))
        value = "error"
    time.sleep(0.05)
    import gc

    gc.collect()
    _emit(
        event="return",
        value=value,
        initial=initial,
        threads=[t.name for t in threading.enumerate() if t is not threading.main_thread()],
        children=_children(),
        sockets=_sockets() - sockets_before,
    )
    sys.exit(3 if value == "error" else 0)


def _report_gloo_timeouts(call_wrapper: object, backend: object) -> None:
    """The gloo group's collective timeout once the monitor thread saw the group (at
    most 10 s), inside ``disable_hang_protection()``, and after it."""

    def timeout() -> float:
        return float(backend.options._timeout.total_seconds())  # type: ignore[attr-defined]

    deadline = time.monotonic() + 10
    while timeout() > 600 and time.monotonic() < deadline:
        time.sleep(0.02)
    outside = timeout()
    with call_wrapper.disable_hang_protection():  # type: ignore[attr-defined]
        inside = timeout()
    _emit(event="gloo", outside=outside, inside=inside, after=timeout())


def _inject(kind: str, call_wrapper: object) -> None:
    _emit(event="fault", kind=kind, t=time.time())
    if kind == "exception":
        raise RuntimeError("injected fault")
    if kind == "sleep":
        time.sleep(3600)
    if kind == "busy":  # Python loop, pinging stops: the manual progress timeout fires
        while True:
            pass
    if kind == "gil":  # hold the GIL in C forever: only the monitor process can help
        ctypes.pythonapi.Py_Initialize  # noqa: B018  (resolve before busy loop)
        libc = ctypes.PyDLL(None)
        libc.pause()
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "silent":  # the rank and its monitor process stop: no heartbeat, no death
        for child in _children():
            os.kill(child, signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "unprotected":  # silent past the hard timeout, with hang protection off
        with call_wrapper.disable_hang_protection():  # type: ignore[attr-defined]
            time.sleep(5.0)
    if kind == "atomic":
        with call_wrapper.atomic():  # type: ignore[attr-defined]
            _emit(event="atomic_enter")
            time.sleep(1.0)
            _emit(event="atomic_exit")


if __name__ == "__main__":
    main()
