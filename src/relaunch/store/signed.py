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
from contextlib import AbstractContextManager

from relaunch.errors import ConfigError, RendezvousStateError
from relaunch.store._protocol import (
    LeaseStore,
    Store,
    get_many,
    has_leases,
    peek,
    set_many,
    take_ticket,
    tickets_taken,
    together,
)

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


class SignedStore:
    """Sign on write, verify on read; every other call passes through."""

    def __init__(self, store: Store, secret: bytes) -> None:
        self.store = store
        self._secret = secret

    def _mac(self, key: str, value: bytes) -> bytes:
        digest = hmac.new(self._secret, key.encode() + b"\x00" + value, hashlib.sha256)
        return digest.hexdigest().encode()

    def _sign(self, key: str, value: bytes) -> bytes:
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

    def get(self, key: str) -> bytes | None:
        return self._open(key, self.store.get(key))

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, self._sign(key, bytes(value)))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bytes, bool]:
        raw_expected = None if expected is None else self._sign(key, bytes(expected))
        current, written = self.store.compare_set(key, raw_expected, self._sign(key, desired))
        return self._open(key, current) or b"", written

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def take_ticket(self, key: str) -> int:
        return take_ticket(self.store, key)

    def tickets(self, key: str) -> int:
        return tickets_taken(self.store, key)

    def delete(self, key: str) -> bool:
        return self.store.delete(key)

    def wait(self, keys: list[str], timeout: float) -> None:
        self.store.wait(keys, timeout)

    def together(self) -> AbstractContextManager[None]:
        return together(self.store)

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        raws = get_many(self.store, keys)
        return [self._open(k, r) for k, r in zip(keys, raws, strict=True)]

    def multi_set(self, items: dict[str, bytes]) -> None:
        set_many(self.store, {k: self._sign(k, bytes(v)) for k, v in items.items()})

    def close(self) -> None:
        self.store.close()

    @staticmethod
    def over(store: Store, secret: bytes) -> SignedStore:
        """The signed view with every capability ``store`` has."""
        if has_leases(store):
            return SignedLeaseStore(store, secret)
        return SignedStore(store, secret)


class SignedLeaseStore(SignedStore):
    """:class:`SignedStore` over a store with leases (etcd)."""

    store: LeaseStore

    def set_ephemeral(self, key: str, value: bytes, ttl: float) -> None:
        self.store.set_ephemeral(key, self._sign(key, bytes(value)), ttl)

    def peek(self, key: str) -> bytes | None:
        return self._open(key, peek(self.store, key))

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return self.store.keys_with_prefix(prefix)
