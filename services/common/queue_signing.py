"""Signatures on work-queue messages, so a GM schedules only what a GM or an LM queued,
and seals on tasks, so that of it only what a GM accepted from a client.

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

LMs hold the queue key (they re-queue lost and preempted tasks), so the message
signature alone would let a compromised LM queue work of its own. With a task seal key
(``broker.task_seal_key``, a file only GMs read), the GM that accepts a job seals each
task (``seal``: one HMAC over what it runs and for whom) and a GM schedules from a queue
only messages whose every task's seal holds. An LM can then re-queue a task it was given,
unchanged in what it runs, and nothing else.
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


def read_signing_key(path: str | Path, what: str = "queue signing key") -> bytes:
    """The key in ``path``: its bytes without surrounding whitespace (``openssl rand -hex
    32 > FILE`` writes 64 hex characters and a newline; those characters are the key)."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as err:
        raise SigningKeyError(f"cannot read {what} {path}: {err.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise SigningKeyError(
            f"{what} {path} holds {len(key)} bytes, fewer than {MIN_KEY_BYTES} "
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


# --------------------------------------------------------------------------- task seals
_SEAL_CONTEXT = b"megha task seal v1\x00"


def _sealed_bytes(task: Any) -> bytes:
    """What a seal covers: the fields that say what a task runs and for whom (a retry
    changes none of them), serialized deterministically."""
    from services._proto.megha.v1 import common_pb2

    view = common_pb2.Task(
        task_id=task.task_id,
        job_id=task.job_id,
        queue=task.queue,
        owner=task.owner,
        priority=task.priority,
        max_retries=task.max_retries,
        constraints=task.constraints,
    )
    view.resources.CopyFrom(task.resources)
    which = task.WhichOneof("executor")
    if which is not None:
        getattr(view, which).CopyFrom(getattr(task, which))
    return view.SerializeToString(deterministic=True)


def seal(key: bytes, task: Any) -> bytes:
    """The seal of ``task`` (a ``common_pb2.Task``) with ``key``."""
    return hmac.new(key, _SEAL_CONTEXT + _sealed_bytes(task), hashlib.sha256).digest()


def sealed(key: bytes, task: Any) -> bool:
    """Whether ``task`` carries its seal made with ``key``."""
    return hmac.compare_digest(task.seal, seal(key, task))
