"""The agent through its Python API: a function entrypoint, return values, restarts."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from relaunch.agent import LocalAgent, WorkerSpec, WorkerState
from relaunch.procs import Entrypoint
from relaunch.rendezvous.static import StandaloneRendezvousHandler


def _module(tmp_path: Path) -> None:
    (tmp_path / "jobfuncs.py").write_text(
        textwrap.dedent(
            """
            import os

            def square_rank(offset):
                if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["LOCAL_RANK"] == "1":
                    raise RuntimeError("first attempt fails")
                return {"rank": int(os.environ["RANK"]), "value": int(os.environ["RANK"]) ** 2 + offset}
            """
        )
    )


@pytest.mark.timeout(60)
def test_function_entrypoint_returns_values_after_a_restart(tmp_path: Path) -> None:
    _module(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        import jobfuncs  # type: ignore[import-not-found]

        spec = WorkerSpec(
            local_world_size=3,
            entrypoint=Entrypoint.from_function(jobfuncs.square_rank),
            args=(10,),
            rdzv_handler=StandaloneRendezvousHandler(),
            max_restarts=1,
            base_env={**os.environ, "PYTHONPATH": str(tmp_path)},
            log_dir=str(tmp_path / "logs"),
        )
        result = LocalAgent(spec).run()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("jobfuncs", None)
    assert result.state == WorkerState.SUCCEEDED
    assert result.return_values == {r: {"rank": r, "value": r * r + 10} for r in range(3)}


def test_lambdas_are_refused_with_a_clear_error() -> None:
    from relaunch.errors import ConfigError

    with pytest.raises(ConfigError, match="module-level function"):
        Entrypoint.from_function(lambda: None)
