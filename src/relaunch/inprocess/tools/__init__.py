"""Tools for testing fault tolerance (NVIDIA's ``inprocess.tools``)."""

from relaunch.inprocess.tools import inject_fault

__all__ = ["inject_fault"]
