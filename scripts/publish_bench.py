"""How long a confirmed publish to a durable queue takes while the event loop is busy.

A GM under load runs hundreds of callbacks per turn of its loop and publishes many jobs
at once. aio-pika's ``Exchange.publish`` (what ``RabbitBus.enqueue`` calls: aiormq's
``basic_publish`` with ``wait=True``) holds the channel's lock until the connection's
writer has written and drained the frame, so concurrent publishes on one channel go out
one per loop turn; ``basic_publish(wait=False)`` queues the frame under the lock and then
waits for the confirm only. This offers bursts of publishes to a quorum queue on the
broker, with ``--busy`` extra callbacks (each a little arithmetic) queued on every turn
of the loop, and prints each way's publish-to-confirm time. (The GM kept the first way:
the second made its confirms 2-8x sooner under load but its clients' waits no shorter,
docs/overload.md.)

    python scripts/publish_bench.py --rate 1000 --seconds 5 --burst 200 --busy 0 200
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import aio_pika
from aiormq import spec

from services.common.bus import RabbitBus


async def _offer(publish, rate: float, seconds: float, burst: int, busy: int) -> list[float]:
    loop = asyncio.get_running_loop()
    took: list[float] = []

    async def one(body: bytes) -> None:
        began = time.monotonic()
        await publish(body)
        took.append(time.monotonic() - began)

    async def keep_busy() -> None:
        while True:
            for _ in range(busy):
                loop.call_soon(sum, range(200))
            await asyncio.sleep(0)

    busy_task = asyncio.create_task(keep_busy())
    sent, start = [], time.monotonic()
    for i in range(int(rate * seconds)):
        if i % burst == 0:
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        sent.append(asyncio.create_task(one(b"x" * 300)))
    await asyncio.gather(*sent)
    busy_task.cancel()
    return took


async def main(args: argparse.Namespace) -> None:
    prefix = f"pubbench-{uuid.uuid4().hex[:8]}"
    bus = RabbitBus(args.url, prefix=prefix)
    async with bus:
        await bus.enqueue("q", b"warm")  # declares the queue (a quorum queue)
        name = bus.queue_name("q")
        connection = await aio_pika.connect(args.url)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)

        async def aio_pika_publish(body: bytes) -> None:
            message = aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            await channel.default_exchange.publish(message, name, mandatory=True)

        underlay = await channel.get_underlay_channel()

        async def pipelined(body: bytes) -> None:
            properties = spec.Basic.Properties(delivery_mode=2)
            await underlay.basic_publish(
                body, routing_key=name, properties=properties, mandatory=True, wait=False
            )

        print(f"{args.rate:g} publishes/s in bursts of {args.burst}, {args.seconds:g} s each")
        print("busy callbacks/turn  way                         p50 ms   p99 ms")
        try:
            for busy in args.busy:
                for way, publish in (
                    ("Exchange.publish (wait)", aio_pika_publish),
                    ("basic_publish(wait=False)", pipelined),
                ):
                    took = sorted(await _offer(publish, args.rate, args.seconds, args.burst, busy))
                    p99 = took[min(len(took) - 1, int(0.99 * len(took)))]
                    print(
                        f"{busy:19d}  {way:25s} {1e3 * statistics.median(took):8.1f} "
                        f"{1e3 * p99:8.1f}"
                    )
        finally:
            await connection.close()
            await bus.delete_queue("q")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 200])
    asyncio.run(main(parser.parse_args()))
