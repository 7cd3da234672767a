"""Work-queue signatures: what a GM accepts from a queue, and what it drops."""

from __future__ import annotations

import asyncio

import pytest

from services.common.bus import Delivery, InMemoryBroker, make_bus
from services.common.queue_signing import (
    SIGNATURE_HEADER,
    SigningKeyError,
    read_signing_key,
    sign,
    verify,
)

KEY = b"k" * 32
QUEUE = "megha.queue.user.q1"


def test_a_signature_verifies_only_for_its_key_queue_and_exact_body():
    body = b"\x0a\x03job"
    headers = {SIGNATURE_HEADER: sign(KEY, QUEUE, body)}
    assert verify(KEY, QUEUE, body, headers)
    assert not verify(b"x" * 32, QUEUE, body, headers)  # another key
    assert not verify(KEY, "megha.queue.user.q2", body, headers)  # moved to another queue
    assert not verify(KEY, QUEUE, body + b"\x00", headers)  # one byte more
    assert not verify(KEY, QUEUE, body, {})  # none
    assert not verify(KEY, QUEUE, body, None)
    assert not verify(KEY, QUEUE, body, {SIGNATURE_HEADER: 7})
    as_bytes = {SIGNATURE_HEADER: headers[SIGNATURE_HEADER].encode()}
    assert verify(KEY, QUEUE, body, as_bytes)  # a long string may arrive as bytes


def test_the_key_file_is_read_stripped_and_a_short_one_refused(tmp_path):
    path = tmp_path / "queue.key"
    path.write_text("ab" * 32 + "\n")
    assert read_signing_key(path) == b"ab" * 32
    path.write_text("short\n")
    with pytest.raises(SigningKeyError, match="fewer than 32"):
        read_signing_key(path)
    with pytest.raises(SigningKeyError, match="cannot read"):
        read_signing_key(tmp_path / "missing")


async def _deliveries(bus, queue: str, count: int) -> list[Delivery]:
    got: list[Delivery] = []
    done = asyncio.Event()

    async def handler(delivery: Delivery) -> None:
        got.append(delivery)
        await delivery.ack()
        if len(got) == count:
            done.set()

    sub = await bus.consume(queue, handler)
    await asyncio.wait_for(done.wait(), 3)
    await sub.cancel()
    return got


async def test_a_signing_bus_signs_what_it_enqueues_and_a_consumer_tells_forgeries():
    broker = InMemoryBroker()
    async with (
        make_bus("memory://", broker=broker, signing_key=KEY) as signer,
        make_bus("memory://", broker=broker) as unsigned,
        make_bus("memory://", broker=broker, signing_key=b"w" * 32) as wrong,
    ):
        await signer.enqueue("user.q1", b"signed")
        await unsigned.enqueue("user.q1", b"unsigned")
        await wrong.enqueue("user.q1", b"wrong key")
        got = await _deliveries(signer, "user.q1", 3)
        verdicts = {d.body: signer.authentic("user.q1", d) for d in got}
        assert verdicts == {b"signed": True, b"unsigned": False, b"wrong key": False}
        assert all(d.message_id for d in got if d.body != b"unsigned")
        # Signed for q1, it is no good in q2 (a copy moved by someone who may write there).
        assert not signer.authentic("user.q2", next(d for d in got if d.body == b"signed"))
        # Without a key, everything passes: today's unsigned federation.
        assert all(unsigned.authentic("user.q1", d) for d in got)


def test_a_seal_covers_what_a_task_runs_not_its_attempt():
    from services._proto.megha.v1 import common_pb2
    from services.common.convert import next_attempt
    from services.common.queue_signing import seal, sealed

    key = b"k" * 32
    task = common_pb2.Task(task_id="t", job_id="j", queue="q", owner="user/alice")
    task.process.args.extend(["echo", "hi"])
    task.resources.cpu_milli = 500
    task.seal = seal(key, task)
    assert sealed(key, task)
    assert sealed(key, next_attempt(task, 1))  # a retry keeps it
    assert not sealed(b"x" * 32, task)
    for change in (
        lambda t: t.process.args.append("; id"),
        lambda t: setattr(t, "owner", "user/bob"),
        lambda t: setattr(t, "queue", "other"),
        lambda t: setattr(t.resources, "cpu_milli", 64_000),
    ):
        forged = common_pb2.Task()
        forged.CopyFrom(task)
        change(forged)
        assert not sealed(key, forged)
