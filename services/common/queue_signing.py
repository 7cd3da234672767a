"""Signatures on work-queue messages, so a GM schedules only what a GM or an LM queued.

    GM / LM ──enqueue: body + header x-megha-signature = HMAC(key, queue, body)──▶ queue
    queue ──delivery──▶ GM: same HMAC? schedule it : drop it (nack, no requeue), count it

The broker's permissions say who may write to a user queue; this says that the message
came from a process that holds the federation's queue signing key (a file only GMs and LMs
read: LMs queue lost and preempted tasks again). A broker user left with too much room
(``guest`` on the federation's vhost, a leaked password) can then still fill a queue, but
cannot have anything run. The signature covers the queue's full name too, so a signed
message copied into another user's queue is refused there.

One HMAC-SHA256 per message (a message is a whole batch of a job's tasks), over the
exact bytes the broker carries: the protobuf is not parsed before it is verified.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SIGNATURE_HEADER = "x-megha-signature"
# Versioned, so that another scheme (or a key id for rotation) can come later beside it.
_SCHEME = "v1"
_CONTEXT = b"megha work queue v1\x00"
# A key shorter than this is refused: HMAC-SHA256 wants at least its output size.
MIN_KEY_BYTES = 32


class SigningKeyError(ValueError):
    """The signing key file is missing, unreadable or too short; the message says which."""


def read_signing_key(path: str | Path) -> bytes:
    """The key in ``path``: its bytes without surrounding whitespace (``openssl rand -hex
    32 > FILE`` writes 64 hex characters and a newline; those characters are the key)."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as err:
        raise SigningKeyError(f"cannot read queue signing key {path}: {err.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise SigningKeyError(
            f"queue signing key {path} holds {len(key)} bytes, fewer than {MIN_KEY_BYTES} "
            "(make one with: openssl rand -hex 32 > FILE)"
        )
    return key


def sign(key: bytes, queue_name: str, body: bytes) -> str:
    """The header value for ``body`` on the broker queue named ``queue_name`` (with its
    prefix, e.g. ``megha.queue.user.q1``)."""
    mac = hmac.new(key, _CONTEXT + queue_name.encode() + b"\x00" + body, hashlib.sha256)
    return f"{_SCHEME}:{mac.hexdigest()}"


def verify(key: bytes, queue_name: str, body: bytes, headers: Mapping[str, Any] | None) -> bool:
    """Whether ``headers`` carry a signature of ``body`` on ``queue_name`` made with ``key``."""
    given = (headers or {}).get(SIGNATURE_HEADER)
    if isinstance(given, bytes):  # AMQP long strings may arrive as bytes
        given = given.decode("ascii", errors="replace")
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given, sign(key, queue_name, body))
