"""relaunch: a fault-tolerant launcher for distributed PyTorch training.

Importing :mod:`relaunch` does not import torch: the agent never needs it.
"""

from relaunch.errors import RelaunchError

__version__ = "0.1.0"

__all__ = ["RelaunchError", "__version__"]
