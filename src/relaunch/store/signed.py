"""A store view that signs every value with the job's secret (HMAC-SHA256).

With ``--rdzv-conf secret_file=PATH`` every record an agent writes to the rendezvous
(the state, join requests and acks, rank assignments, failures, the workers' store
address, status reports) carries ``SUFFIX + hex MAC`` over its key and value; a record
read back without a valid MAC is refused with
:class:`~relaunch.errors.RendezvousStateError` naming the key. Counters (``add``) cannot
carry a MAC and stay unsigned. A node without the secret cannot read a signed record
(it says so, :func:`is_signed`), nor write one the others accept.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from relaunch.errors import ConfigError, RendezvousStateError
from relaunch.store._protocol import Store, has_leases
from relaunch.store._view import LeaseView, StoreView

__all__ = ["SUFFIX", "SignedLeaseStore", "SignedStore", "is_signed", "read_secret"]

SUFFIX = b"\x00relaunch-mac1:"
_MAC_HEX = 64


def read_secret(path: str) -> bytes:
    """The secret in ``path``; ConfigError when it cannot be one (missing, < 16 bytes)."""
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigError(
            f"--rdzv-conf secret_file: expected a readable file, got {path!r} ({exc.strerror})"
        ) from exc
    if len(secret) < 16:
        raise ConfigError(
            f"--rdzv-conf secret_file: expected at least 16 bytes of secret, {path!r} has "
            f"{len(secret)}"
        )
    if os.stat(path).st_mode & 0o077:
        import logging

        logging.getLogger(__name__).warning(
            "the secret file %s is readable by other users (chmod 600 it)", path
        )
    return secret


def is_signed(raw: bytes) -> bool:
    """Whether ``raw`` carries a MAC (for a node without the secret, to say why it fails)."""
    return len(raw) > len(SUFFIX) + _MAC_HEX and raw[-len(SUFFIX) - _MAC_HEX :].startswith(SUFFIX)


class SignedStore(StoreView):
    """Sign on write, verify on read; every other call passes through."""

    def __init__(self, store: Store, secret: bytes) -> None:
        super().__init__(store)
        self._secret = secret

    def _mac(self, key: str, value: bytes) -> bytes:
        digest = hmac.new(self._secret, key.encode() + b"\x00" + value, hashlib.sha256)
        return digest.hexdigest().encode()

    def _seal(self, key: str, value: bytes) -> bytes:
        value = bytes(value)
        return value + SUFFIX + self._mac(key, value)

    def _open(self, key: str, raw: bytes | None) -> bytes | None:
        if raw is None:
            return None
        if not is_signed(raw):
            raise RendezvousStateError(
                f"the record at key {key!r} is not signed with this job's secret: refused"
            )
        value, mac = raw[: -len(SUFFIX) - _MAC_HEX], raw[-_MAC_HEX:]
        if not hmac.compare_digest(mac, self._mac(key, value)):
            raise RendezvousStateError(
                f"the record at key {key!r} does not verify with this job's secret: refused"
            )
        return value

    @staticmethod
    def over(store: Store, secret: bytes) -> SignedStore:
        """The signed view with every capability ``store`` has."""
        if has_leases(store):
            return SignedLeaseStore(store, secret)
        return SignedStore(store, secret)


class SignedLeaseStore(LeaseView, SignedStore):
    """:class:`SignedStore` over a store with leases (etcd)."""
