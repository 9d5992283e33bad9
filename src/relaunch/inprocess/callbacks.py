"""relaunch's earlier home of the callback base classes (now in ``initialize``,
``finalize`` and ``health_check``, NVIDIA's modules); kept for existing imports."""

from relaunch.inprocess.finalize import Finalize
from relaunch.inprocess.health_check import CudaHealthCheck, FaultCounter, HealthCheck
from relaunch.inprocess.initialize import Initialize

__all__ = ["CudaHealthCheck", "FaultCounter", "Finalize", "HealthCheck", "Initialize"]
