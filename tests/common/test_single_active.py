"""The in-memory bus's single active consumer acts as RabbitMQ's (queue failover): a
queue's messages go to its first consumer only, and when that one goes away its unacked
messages and the rest go to the next, marked redelivered."""

from __future__ import annotations

import asyncio

from services.common.bus import Delivery, InMemoryBroker, make_bus


async def test_only_the_first_consumer_gets_messages_until_it_goes_away():
    broker = InMemoryBroker()
    got: dict[str, list[Delivery]] = {"first": [], "second": []}

    def keep(name: str):
        async def handler(delivery: Delivery) -> None:
            got[name].append(delivery)  # never acked: held as a GM holds waiting tasks

        return handler

    async with (
        make_bus("memory://", broker=broker, single_active=True) as one,
        make_bus("memory://", broker=broker, single_active=True) as two,
    ):
        first = await one.consume("q", keep("first"))
        await two.consume("q", keep("second"))
        for body in (b"a", b"b", b"c"):
            await two.enqueue("q", body)
        await asyncio.sleep(0)
        assert [d.body for d in got["first"]] == [b"a", b"b", b"c"] and not got["second"]
        await got["first"][0].ack()
        await first.cancel()  # the active GM goes away
        await asyncio.sleep(0)
        assert [(d.body, d.redelivered) for d in got["second"]] == [(b"b", True), (b"c", True)]
        await one.enqueue("q", b"d")
        await asyncio.sleep(0)
        assert got["second"][-1].body == b"d"


async def test_without_it_consumers_share_the_queue():
    broker = InMemoryBroker()
    got: list[str] = []
    async with make_bus("memory://", broker=broker) as bus:
        for name in ("first", "second"):

            async def handler(delivery: Delivery, name: str = name) -> None:
                got.append(name)
                await delivery.ack()

            await bus.consume("q", handler)
        for _ in range(4):
            await bus.enqueue("q", b"x")
        await asyncio.sleep(0)
    assert sorted(got) == ["first", "first", "second", "second"]
