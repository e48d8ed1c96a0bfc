"""Per-job keys and the join MAC: with a key, only holders of it can join a job (and so start a generation
or redirect a rank). Keyed BLAKE2b (hashlib, RFC 7693) over the join's fields, truncated to 16 bytes."""
from __future__ import annotations

import hashlib
import hmac
import os
import struct

from . import wire

KEY_ENV = "INA_JOB_KEY"
MIN_KEY_BYTES = 16
_FIELDS = struct.Struct(">HBQHHH")  # job, rank, nonce, world, window, elements


def load_key(path: str) -> bytes:
    """A key file's bytes, surrounding whitespace stripped; at least MIN_KEY_BYTES of them."""
    with open(path, "rb") as f:
        return check_key(f.read().strip(), f"key file {path}")


def check_key(key, what: str = "job key") -> bytes:
    if isinstance(key, str):
        key = key.encode()
    key = bytes(key)
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{what}: {len(key)} bytes; a key needs at least {MIN_KEY_BYTES}")
    return key


def key_from_env() -> bytes | None:
    value = os.environ.get(KEY_ENV)
    return check_key(value, f"${KEY_ENV}") if value else None


def join_mac(key: bytes, job: int, rank: int, nonce: int, world: int, window: int, elements: int = 0) -> bytes:
    k = key if len(key) <= 64 else hashlib.blake2b(key).digest()
    msg = b"ina-join-v%d" % wire.VERSION + _FIELDS.pack(job, rank, nonce, world, window, elements)
    return hashlib.blake2b(msg, key=k, digest_size=wire.JOIN_MAC_SIZE).digest()


def mac_ok(key: bytes, mac: bytes, job: int, rank: int, nonce: int, world: int, window: int,
           elements: int = 0) -> bool:
    return hmac.compare_digest(mac, join_mac(key, job, rank, nonce, world, window, elements))
