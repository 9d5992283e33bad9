"""Run programs and tests written for ``nvidia_resiliency_ext.inprocess`` on
``relaunch.inprocess``, unchanged: every ``nvidia_resiliency_ext.inprocess[.x]`` import
gets ``relaunch.inprocess[.x]``. The rest of ``nvidia_resiliency_ext`` comes from
NVIDIA's package when it is installed; without it, the top-level package is an empty
stand-in and ``device_utils`` gives CPU/CUDA answers (enough for NVIDIA's test app).

    PYTHONPATH=bench/nvrx_compat python -m pytest <nvidia-resiliency-ext>/tests/inprocess

(Python imports ``sitecustomize`` from the path at start-up.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

NVRX = "nvidia_resiliency_ext"
ALIASED = NVRX + ".inprocess"


def _nvrx_installed() -> bool:
    return importlib.machinery.PathFinder.find_spec(NVRX) is not None


def _device_utils(name: str) -> types.ModuleType:
    import torch

    module = types.ModuleType(name)

    def get_current_device() -> Any:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    module.get_current_device = get_current_device  # type: ignore[attr-defined]
    module.get_distributed_init_method = lambda: "env://"  # type: ignore[attr-defined]
    return module


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self.standalone = not _nvrx_installed()
        self.own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name == ALIASED or name.startswith(ALIASED + "."):
            ours = importlib.import_module("relaunch.inprocess" + name[len(ALIASED) :])
            return importlib.util.spec_from_loader(name, self, is_package=hasattr(ours, "__path__"))
        if self.standalone and (name == NVRX or name.startswith(NVRX + ".")):
            return importlib.util.spec_from_loader(name, self, is_package=name == NVRX)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        name = spec.name
        if name == ALIASED or name.startswith(ALIASED + "."):
            ours = importlib.import_module("relaunch.inprocess" + name[len(ALIASED) :])
            self.own_specs[ours.__name__] = ours.__spec__
            return ours
        if name == NVRX + ".device_utils":
            return _device_utils(name)
        if name == NVRX:
            module = types.ModuleType(name)
            module.__path__ = []
            return module
        raise ModuleNotFoundError(f"{name} needs NVIDIA's package (only .inprocess is aliased)")

    def exec_module(self, module: types.ModuleType) -> None:
        # importlib set the alias's spec on relaunch's module: give it back its own
        own = self.own_specs.pop(module.__name__, None)
        if own is not None:
            module.__spec__ = own


sys.meta_path.insert(0, _Alias())
