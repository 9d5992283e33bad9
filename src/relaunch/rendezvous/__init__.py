"""Rendezvous: the agents of a job agree on who takes part in each round."""

from relaunch.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousParameters

__all__ = ["RendezvousHandler", "RendezvousInfo", "RendezvousParameters"]
