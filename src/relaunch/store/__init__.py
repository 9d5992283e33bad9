"""Key-value stores behind one narrow protocol: memory, TCP (torch-compatible), etcd."""

from relaunch.store._protocol import Store

__all__ = ["Store"]
