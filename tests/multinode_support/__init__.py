"""Helpers for the multi-node acceptance tests: real ``relaunch`` agents as processes."""
