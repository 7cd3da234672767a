"""Several jobs in one user-queue message (``TaskBatch.more_jobs``).

A GM publishes the jobs it took for a queue while its previous publish there awaited
the broker's confirm as one message: one publish, confirm, delivery and ack for all of
them instead of four per job. ``join`` makes that message from the jobs' own bodies,
``split`` gives the jobs back, each handled as a message of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from services._proto.megha.v1 import common_pb2

# TaskBatch.more_jobs is field 6, length-delimited (wire type 2): its tag byte.
_MORE_TAG = bytes([6 << 3 | 2])


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def join(bodies: Sequence[bytes]) -> bytes:
    """One message of serialized ``TaskBatch``es (none with ``more_jobs`` of its own): the
    first, with the others as its ``more_jobs``. Protobuf reads a message followed by more
    encoded fields as the message with those fields (a repeated one appended to), so
    no body is parsed or encoded again."""
    if not bodies:
        raise ValueError("join needs at least one body")
    if len(bodies) == 1:
        return bodies[0]
    out = bytearray(bodies[0])
    for body in bodies[1:]:
        out += _MORE_TAG
        out += _varint(len(body))
        out += body
    return bytes(out)


def split(batch: common_pb2.TaskBatch) -> list[common_pb2.TaskBatch]:
    """The jobs of a message: ``batch`` itself (its ``more_jobs`` cleared) and each of its
    ``more_jobs``; ``[batch]`` for a message of one job."""
    if not batch.more_jobs:
        return [batch]
    more = list(batch.more_jobs)
    batch.ClearField("more_jobs")  # the elements taken above stay whole (they are detached)
    return [batch, *more]
