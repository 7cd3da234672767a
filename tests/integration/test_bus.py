"""The bus as the services use it, against RabbitMQ and against the in-memory broker.

Every test runs on both implementations; the RabbitMQ runs carry ``pytest.mark.integration``.
Each test gets its own random prefix, so runs never see each other's exchanges or queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import aiormq
import pytest

from services.common.bus import (
    MEMORY_URL,
    SILENT_CHECK_S,
    BrokerUnreachable,
    Bus,
    Delivery,
    InMemoryBroker,
    InMemoryBus,
    QueueTypeMismatch,
    RabbitBus,
    make_bus,
    safe_url,
    topic_matches,
)
from tests.integration.harness import free_ports

RABBIT_URL = os.environ.get("MEGHA_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
WAIT_S = 3.0  # upper bound for anything we expect to arrive
QUIET_S = 0.3  # how long "nothing more arrives" is watched

# The only logical names the tests use, so the fixture knows what to delete afterwards.
HEARTBEATS = "heartbeats"
EVENTS = "events"
QUEUE = "user-a"
KEPT = "cancels.lm-1"

BusFactory = Callable[[], Awaitable[Bus]]


@pytest.fixture(
    params=[
        pytest.param("memory", id="memory"),
        pytest.param("rabbit", id="rabbit", marks=pytest.mark.integration),
    ]
)
async def new_bus(request: pytest.FixtureRequest) -> AsyncIterator[BusFactory]:
    """A factory of connected buses that share one broker and a fresh random prefix."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    url = MEMORY_URL if request.param == "memory" else RABBIT_URL
    broker = InMemoryBroker()
    buses: list[Bus] = []

    async def factory() -> Bus:
        bus = make_bus(url, prefix=prefix, broker=broker)
        try:
            await bus.connect()
        except OSError as err:
            pytest.fail(
                f"RabbitMQ is not reachable at {url} ({err}); start it with "
                "'rabbitmq-server -detached' or deselect these tests with -m 'not integration'"
            )
        buses.append(bus)
        return bus

    yield factory

    for bus in buses:
        await bus.close()
    if request.param == "rabbit":
        connection = await aio_pika.connect(RABBIT_URL)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(f"{prefix}.queue.{QUEUE}")
            for exchange in (HEARTBEATS, EVENTS):
                await channel.exchange_delete(f"{prefix}.{exchange}")


async def close_and_delete(buses: tuple[Bus, ...], prefix: str, queues: list[str]) -> None:
    """Close ``buses``, then delete the prefix's ``queues`` and its heartbeat exchange."""
    for bus in buses:
        await bus.close()
    connection = await aio_pika.connect(RABBIT_URL)
    async with connection:
        channel = await connection.channel()
        for queue in queues:
            await channel.queue_delete(f"{prefix}.queue.{queue}")
        await channel.exchange_delete(f"{prefix}.{HEARTBEATS}")


async def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


def test_make_bus_picks_the_implementation_from_the_url() -> None:
    broker = InMemoryBroker()
    memory = make_bus("memory://", prefix="p", broker=broker)
    assert isinstance(memory, InMemoryBus)
    assert memory.broker is broker
    assert isinstance(make_bus(RABBIT_URL), RabbitBus)
    assert make_bus(RABBIT_URL, prefix="p").queue_name("q") == "p.queue.q"
    assert make_bus(RABBIT_URL, prefix="p").exchange_name("heartbeats") == "p.heartbeats"


@pytest.mark.parametrize(
    ("binding_key", "routing_key", "matches"),
    [
        ("task.*", "task.lm-1", True),
        ("task.*", "job.lm-1", False),
        ("task.*", "task.lm-1.node-3", False),
        ("task.*", "task", False),
        ("task.#", "task", True),
        ("task.#", "task.lm-1.node-3", True),
        ("#", "anything.at.all", True),
        ("*.lm-1", "task.lm-1", True),
        ("task.#.done", "task.lm-1.node-3.done", True),
        ("task.#.done", "task.done", True),
        ("task.#.done", "task.lm-1.failed", False),
    ],
)
def test_topic_matching_follows_amqp(binding_key: str, routing_key: str, matches: bool) -> None:
    assert topic_matches(binding_key, routing_key) is matches


# --------------------------------------------------------------------------- fan-out


async def test_fanout_reaches_every_subscriber_in_order(new_bus: BusFactory) -> None:
    publisher = await new_bus()
    inboxes: list[list[bytes]] = [[], [], []]
    for inbox in inboxes:
        subscriber = await new_bus()

        async def handler(body: bytes, inbox: list[bytes] = inbox) -> None:
            inbox.append(body)

        await subscriber.subscribe_fanout(HEARTBEATS, handler, ttl_s=5)

    sent = [f"beat-{i}".encode() for i in range(5)]
    for body in sent:
        await publisher.publish_fanout(HEARTBEATS, body, ttl_s=5)

    await wait_until(lambda: all(len(inbox) == len(sent) for inbox in inboxes))
    assert inboxes == [sent, sent, sent]


@pytest.mark.parametrize("ttl_on", ["subscription", "message"])
async def test_fanout_skips_messages_that_waited_longer_than_ttl(
    new_bus: BusFactory, ttl_on: str
) -> None:
    """A GM stuck in a slow handler must not replay heartbeats that are already stale."""
    publisher, subscriber = await new_bus(), await new_bus()
    ttl_s = 0.2
    received: list[bytes] = []
    release = asyncio.Event()

    async def slow_handler(body: bytes) -> None:
        received.append(body)
        if body == b"first":
            await release.wait()

    await subscriber.subscribe_fanout(
        HEARTBEATS, slow_handler, ttl_s=ttl_s if ttl_on == "subscription" else None
    )
    message_ttl = ttl_s if ttl_on == "message" else None
    await publisher.publish_fanout(HEARTBEATS, b"first", ttl_s=message_ttl)
    await wait_until(lambda: received == [b"first"])

    for body in (b"stale-1", b"stale-2"):
        await publisher.publish_fanout(HEARTBEATS, body, ttl_s=message_ttl)
    await asyncio.sleep(ttl_s * 2.5)
    release.set()
    await publisher.publish_fanout(HEARTBEATS, b"fresh", ttl_s=message_ttl)

    await wait_until(lambda: b"fresh" in received)
    assert received == [b"first", b"fresh"]


async def test_a_failing_fanout_handler_does_not_stop_the_subscription(
    new_bus: BusFactory,
) -> None:
    bus = await new_bus()
    received: list[bytes] = []

    async def handler(body: bytes) -> None:
        received.append(body)
        if body == b"bad":
            raise ValueError("cannot parse heartbeat")

    await bus.subscribe_fanout(HEARTBEATS, handler)
    await bus.publish_fanout(HEARTBEATS, b"bad")
    await bus.publish_fanout(HEARTBEATS, b"good")
    await wait_until(lambda: len(received) == 2)
    assert received == [b"bad", b"good"]


async def test_cancelled_fanout_subscription_receives_nothing(new_bus: BusFactory) -> None:
    bus = await new_bus()
    gone: list[bytes] = []
    kept: list[bytes] = []

    async def to_gone(body: bytes) -> None:
        gone.append(body)

    async def to_kept(body: bytes) -> None:
        kept.append(body)

    subscription = await bus.subscribe_fanout(HEARTBEATS, to_gone)
    await bus.subscribe_fanout(HEARTBEATS, to_kept)
    await subscription.cancel()
    await subscription.cancel()  # idempotent
    await bus.publish_fanout(HEARTBEATS, b"after-cancel")
    await wait_until(lambda: kept == [b"after-cancel"])
    assert gone == []


@pytest.mark.integration
async def test_a_kept_fanout_queue_holds_what_is_published_while_its_subscriber_is_away() -> None:
    # RabbitMQ only: the in-memory broker lives and dies with its one process.
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    publisher, subscriber = make_bus(RABBIT_URL, prefix=prefix), make_bus(RABBIT_URL, prefix=prefix)
    got: list[bytes] = []

    async def handler(body: bytes) -> None:
        got.append(body)

    try:
        await publisher.connect()
        await subscriber.connect()
        first = await subscriber.subscribe_fanout(HEARTBEATS, handler, keep_as=KEPT)
        await publisher.publish_fanout(HEARTBEATS, b"while-there")
        await wait_until(lambda: got == [b"while-there"])
        await asyncio.sleep(0.2)  # its ack goes out (gathered every 50 ms)
        await first.cancel()
        await publisher.publish_fanout(HEARTBEATS, b"while-away")
        await subscriber.subscribe_fanout(HEARTBEATS, handler, keep_as=KEPT)
        await wait_until(lambda: got == [b"while-there", b"while-away"])
        await asyncio.sleep(QUIET_S)
        assert got == [b"while-there", b"while-away"]  # the acked one is not sent again
    finally:
        await close_and_delete((publisher, subscriber), prefix, [KEPT])


# --------------------------------------------------------------------------- topic


async def test_topic_bindings_route_by_wildcard(new_bus: BusFactory) -> None:
    publisher, subscriber = await new_bus(), await new_bus()
    one_word: list[tuple[str, bytes]] = []
    any_words: list[tuple[str, bytes]] = []

    async def to_one_word(key: str, body: bytes) -> None:
        one_word.append((key, body))

    async def to_any_words(key: str, body: bytes) -> None:
        any_words.append((key, body))

    await subscriber.subscribe_topic(EVENTS, "task.*", to_one_word)
    await subscriber.subscribe_topic(EVENTS, "task.#", to_any_words)

    await publisher.publish_topic(EVENTS, "job.lm-1", b"job")
    await publisher.publish_topic(EVENTS, "task.lm-1.node-3", b"deep")
    await publisher.publish_topic(EVENTS, "task.lm-1", b"task")
    # Messages of one publisher stay in order, so once the sentinel is in, nothing
    # published before it is still on the way.
    await publisher.publish_topic(EVENTS, "task.end", b"sentinel")

    await wait_until(lambda: len(one_word) >= 2 and len(any_words) >= 3)
    assert one_word == [("task.lm-1", b"task"), ("task.end", b"sentinel")]
    assert any_words == [
        ("task.lm-1.node-3", b"deep"),
        ("task.lm-1", b"task"),
        ("task.end", b"sentinel"),
    ]


async def test_a_topic_subscription_keeps_receiving_past_its_prefetch_window(
    new_bus: BusFactory,
) -> None:
    # Its acks are gathered (one multiple-ack per batch): had they stopped, RabbitMQ
    # would deliver no more than the prefetch window (256) and this would stall there.
    publisher, subscriber = await new_bus(), await new_bus()
    got: list[bytes] = []

    async def handler(_key: str, body: bytes) -> None:
        got.append(body)

    await subscriber.subscribe_topic(EVENTS, "task.#", handler)
    bodies = [str(i).encode() for i in range(700)]
    for i, body in enumerate(bodies):
        await publisher.publish_topic(EVENTS, "task.lm-1", body)
        if i % 100 == 0:
            await asyncio.sleep(0.06)  # a pause: the pending ack goes out on time
    await wait_until(lambda: len(got) >= len(bodies))
    assert got == bodies


# --------------------------------------------------------------------------- work queues


async def test_enqueued_messages_are_stored_and_consumed_in_fifo_order(
    new_bus: BusFactory,
) -> None:
    producer, consumer = await new_bus(), await new_bus()
    bodies = [f"task-{i}".encode() for i in range(20)]
    await producer.enqueue(QUEUE, bodies[0])
    await producer.enqueue_many(QUEUE, bodies[1:])
    # enqueue returned, so the broker holds them, before anyone consumes.
    assert await producer.queue_depth(QUEUE) == len(bodies)

    received: list[bytes] = []

    async def handler(delivery: Delivery) -> None:
        received.append(delivery.body)
        await delivery.ack()

    await consumer.consume(QUEUE, handler)
    await wait_until(lambda: len(received) == len(bodies))
    assert received == bodies


async def test_prefetch_bounds_the_unacked_deliveries(new_bus: BusFactory) -> None:
    producer, consumer = await new_bus(), await new_bus()
    await producer.enqueue_many(QUEUE, [f"task-{i}".encode() for i in range(5)])
    held: list[Delivery] = []

    async def never_ack(delivery: Delivery) -> None:
        held.append(delivery)

    await consumer.consume(QUEUE, never_ack, prefetch=2)
    await wait_until(lambda: len(held) == 2)
    await asyncio.sleep(QUIET_S)
    assert [d.body for d in held] == [b"task-0", b"task-1"]
    assert await producer.queue_depth(QUEUE) == 3

    await held[0].ack()  # room for exactly one more
    await wait_until(lambda: len(held) == 3)
    await asyncio.sleep(QUIET_S)
    assert [d.body for d in held] == [b"task-0", b"task-1", b"task-2"]


async def test_unacked_deliveries_survive_a_consumer_crash(new_bus: BusFactory) -> None:
    """A GM that dies between receiving tasks and launching them loses none of them."""
    producer, doomed, successor = await new_bus(), await new_bus(), await new_bus()
    bodies = [f"task-{i}".encode() for i in range(3)]
    await producer.enqueue_many(QUEUE, bodies)

    first: list[Delivery] = []

    async def hold(delivery: Delivery) -> None:
        first.append(delivery)

    await doomed.consume(QUEUE, hold, prefetch=10)
    await wait_until(lambda: len(first) == len(bodies))
    assert not any(d.redelivered for d in first)
    await doomed.close()

    second: list[Delivery] = []

    async def launch(delivery: Delivery) -> None:
        second.append(delivery)
        await delivery.ack()

    await successor.consume(QUEUE, launch)
    await wait_until(lambda: len(second) == len(bodies))
    assert [d.body for d in second] == bodies
    assert all(d.redelivered for d in second)

    await first[0].ack()  # a late ack from the dead consumer changes nothing
    await asyncio.sleep(QUIET_S)
    assert len(second) == len(bodies)
    assert await producer.queue_depth(QUEUE) == 0


async def test_cancelled_consumer_gives_unacked_back_to_the_head(new_bus: BusFactory) -> None:
    producer, consumer = await new_bus(), await new_bus()
    await producer.enqueue_many(QUEUE, [b"a", b"b", b"c"])
    held: list[Delivery] = []

    async def hold(delivery: Delivery) -> None:
        held.append(delivery)

    subscription = await consumer.consume(QUEUE, hold, prefetch=2)
    await wait_until(lambda: len(held) == 2)
    await subscription.cancel()
    await subscription.cancel()  # idempotent

    again: list[tuple[bytes, bool]] = []

    async def take(delivery: Delivery) -> None:
        again.append((delivery.body, delivery.redelivered))
        await delivery.ack()

    await consumer.consume(QUEUE, take)
    await wait_until(lambda: len(again) == 3)
    assert again == [(b"a", True), (b"b", True), (b"c", False)]


async def test_acked_messages_are_gone(new_bus: BusFactory) -> None:
    producer, consumer, latecomer = await new_bus(), await new_bus(), await new_bus()
    await producer.enqueue_many(QUEUE, [b"a", b"b", b"c"])
    acked: list[bytes] = []

    async def ack(delivery: Delivery) -> None:
        await delivery.ack()
        acked.append(delivery.body)

    subscription = await consumer.consume(QUEUE, ack)
    await wait_until(lambda: len(acked) == 3)
    await subscription.cancel()
    assert await producer.queue_depth(QUEUE) == 0

    # Queues are FIFO, so if anything acked had come back it would arrive before this.
    await producer.enqueue(QUEUE, b"sentinel")
    later: list[bytes] = []

    async def record(delivery: Delivery) -> None:
        later.append(delivery.body)
        await delivery.ack()

    await latecomer.consume(QUEUE, record)
    await wait_until(lambda: len(later) >= 1)
    await asyncio.sleep(QUIET_S)
    assert later == [b"sentinel"]


async def test_a_failing_handler_gets_the_message_again_and_keeps_consuming(
    new_bus: BusFactory,
) -> None:
    bus = await new_bus()
    seen: list[tuple[bytes, bool]] = []
    done: list[bytes] = []

    async def flaky(delivery: Delivery) -> None:
        seen.append((delivery.body, delivery.redelivered))
        if delivery.body == b"a" and not delivery.redelivered:
            raise ConnectionError("LM unreachable")
        await delivery.ack()
        done.append(delivery.body)

    await bus.consume(QUEUE, flaky, prefetch=1)
    await bus.enqueue(QUEUE, b"a")
    await wait_until(lambda: done == [b"a"])
    assert seen == [(b"a", False), (b"a", True)]

    await bus.enqueue(QUEUE, b"b")
    await wait_until(lambda: done == [b"a", b"b"])
    assert await bus.queue_depth(QUEUE) == 0


async def test_delete_queue_drops_its_messages_and_tolerates_missing(
    new_bus: BusFactory,
) -> None:
    bus = await new_bus()
    await bus.delete_queue(QUEUE)  # never existed
    await bus.enqueue_many(QUEUE, [b"a", b"b"])
    await bus.delete_queue(QUEUE)
    assert await bus.queue_depth(QUEUE) == 0
    await bus.enqueue(QUEUE, b"c")  # a deleted queue is declared again on use
    assert await bus.queue_depth(QUEUE) == 1


# ------------------------------------------------------------- a broker out of reach


def test_safe_url_hides_only_the_password():
    assert safe_url("amqp://guest:s3cr%40t@rabbit:5672/v") == "amqp://guest:***@rabbit:5672/v"
    assert safe_url("amqps://rabbit/") == "amqps://rabbit/"
    assert safe_url("amqp://user@rabbit/") == "amqp://user@rabbit/"


async def test_a_broker_out_of_reach_is_named_without_its_password():
    (port,) = free_ports(1)
    with pytest.raises(BrokerUnreachable) as unreachable:
        await RabbitBus(f"amqp://guest:hunter2@127.0.0.1:{port}/").connect()
    message = str(unreachable.value)
    assert f"cannot reach RabbitMQ at amqp://guest:***@127.0.0.1:{port}/: " in message
    assert "hunter2" not in message


def test_a_gm_whose_broker_is_out_of_reach_says_so_in_one_line(tmp_path):
    (port,) = free_ports(1)
    env = {**os.environ, "MEGHA_RABBITMQ_URL": f"amqp://guest:hunter2@127.0.0.1:{port}/"}
    gm = subprocess.run(
        [sys.executable, "-m", "services.cli", "gm", "--id", "gm-1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert gm.returncode == 1
    last = gm.stderr.strip().splitlines()[-1]
    assert last.startswith(f"megha: cannot reach RabbitMQ at amqp://guest:***@127.0.0.1:{port}/")
    assert "Traceback" not in gm.stderr and "hunter2" not in gm.stderr


# ------------------------------------------------------- queue types and broker failover


async def _declare_raw(name: str, arguments: dict | None) -> None:
    connection = await aio_pika.connect(RABBIT_URL)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True, arguments=arguments)


async def _delete_raw(*names: str) -> None:
    connection = await aio_pika.connect(RABBIT_URL)
    async with connection:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)


@pytest.mark.integration
async def test_work_queues_are_quorum_queues_by_default_and_classic_on_request() -> None:
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    quorum, classic = (
        RabbitBus(RABBIT_URL, prefix=prefix),
        RabbitBus(RABBIT_URL, prefix=f"{prefix}-c", queue_type="classic"),
    )
    try:
        async with quorum, classic:
            await quorum.enqueue(QUEUE, b"q")
            await classic.enqueue(QUEUE, b"c")
            assert await quorum.queue_depth(QUEUE) == await classic.queue_depth(QUEUE) == 1
        # The broker holds each with its type: the other type's declare is refused.
        await _declare_raw(quorum.queue_name(QUEUE), {"x-queue-type": "quorum"})
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await _declare_raw(quorum.queue_name(QUEUE), None)
        await _declare_raw(classic.queue_name(QUEUE), None)
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await _declare_raw(classic.queue_name(QUEUE), {"x-queue-type": "quorum"})
    finally:
        await _delete_raw(quorum.queue_name(QUEUE), classic.queue_name(QUEUE))


@pytest.mark.integration
async def test_a_work_queue_of_the_other_type_is_named_with_the_way_out() -> None:
    """An operator's broker full of classic queues, and a federation now on quorum."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    bus = RabbitBus(RABBIT_URL, prefix=prefix)
    name = bus.queue_name(QUEUE)
    await _declare_raw(name, None)  # as every release before quorum queues did
    try:
        async with bus:
            for attempt in (bus.enqueue(QUEUE, b"x"), bus.consume(QUEUE, _never)):
                with pytest.raises(QueueTypeMismatch) as mismatch:
                    await attempt
                message = str(mismatch.value)
                assert f"RabbitMQ queue '{name}' exists as a classic queue" in message
                assert f"rabbitmqctl delete_queue {name}" in message
                assert "queue_type: classic" in message
            await asyncio.sleep(1.5)  # the robust channel the failed declare closed reopens
            classic = RabbitBus(RABBIT_URL, prefix=prefix, queue_type="classic")
            async with classic:  # the operator's other way out
                await classic.enqueue(QUEUE, b"kept classic")
                assert await classic.queue_depth(QUEUE) == 1
    finally:
        await _delete_raw(name)


async def _never(delivery: Delivery) -> None:
    raise AssertionError("nothing should be delivered")


class _Proxy:
    """A TCP relay to the test broker: a second 'node' that can die with its connections."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        target = urlsplit(RABBIT_URL)

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._writers.add(writer)
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
            broker_r, broker_w = await asyncio.open_connection(target.hostname, target.port or 5672)
            await asyncio.gather(relay(client_r, broker_w), relay(broker_r, client_w))

        self._server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def url(self) -> str:
        target = urlsplit(RABBIT_URL)
        return urlunsplit(
            target._replace(netloc=f"{target.netloc.rpartition('@')[0]}@127.0.0.1:{self.port}")
        )

    def kill(self) -> None:
        """The node dies: nothing listens any more, every connection through it drops."""
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()


@pytest.mark.integration
async def test_a_bus_fails_over_to_the_next_url_when_its_node_dies() -> None:
    first, second = _Proxy(), _Proxy()
    await first.start()
    await second.start()
    (dead,) = free_ports(1)
    dead_url = f"amqp://guest:guest@127.0.0.1:{dead}/"
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    # A node that is down at start is skipped; the bus runs on the first that answers.
    bus = RabbitBus(f"{dead_url}, {first.url()},{second.url()}", prefix=prefix)
    got: list[bytes] = []

    async def take(delivery: Delivery) -> None:
        got.append(delivery.body)
        await delivery.ack()

    try:
        async with bus:
            await bus.consume(QUEUE, take)
            await bus.enqueue(QUEUE, b"before")
            await wait_until(lambda: got == [b"before"])
            first.kill()
            began = asyncio.get_running_loop().time()
            for _ in range(100):  # what a GM does: try the enqueue again until confirmed
                try:
                    await bus.enqueue(QUEUE, b"after")
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            took = asyncio.get_running_loop().time() - began
            # "before" may come again: its ack may have died with the node (at least once).
            await wait_until(lambda: b"after" in got, timeout=20)
            assert set(got) == {b"before", b"after"} and got.count(b"after") == 1, got
            assert took < 5, f"enqueue took {took:.1f} s to get through again"
    finally:
        second.kill()
        await _delete_raw(f"{prefix}.queue.{QUEUE}")


@pytest.mark.integration
async def test_after_a_reconnection_every_subscription_is_made_again_and_hears() -> None:
    """The node under a bus dies; once it is connected through the next one, its
    work-queue consumer and its fan-out subscription are each made again on a new
    channel (not left to aio-pika's restore, which the multi-host broker kill showed
    leaving an event subscription deaf), and both hear what is sent after."""
    first, second = _Proxy(), _Proxy()
    await first.start()
    await second.start()
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    bus = RabbitBus(f"{first.url()},{second.url()}", prefix=prefix)
    got: list[bytes] = []
    heard: list[bytes] = []

    async def take(delivery: Delivery) -> None:
        got.append(delivery.body)
        await delivery.ack()

    async def hear(body: bytes) -> None:
        heard.append(body)

    try:
        async with bus:
            consumer = await bus.consume(QUEUE, take)
            stream = await bus.subscribe_fanout("news", hear)
            await bus.enqueue(QUEUE, b"before")
            await bus.publish_fanout("news", b"before")
            await wait_until(lambda: got == [b"before"] and heard == [b"before"])
            first.kill()
            await wait_until(lambda: consumer.renewed == 1 and stream.renewed == 1, timeout=20)
            for _ in range(100):
                try:
                    await bus.enqueue(QUEUE, b"after")
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            await bus.publish_fanout("news", b"after")
            await wait_until(lambda: b"after" in got and b"after" in heard, timeout=20)
            assert heard == [b"before", b"after"], heard  # one queue bound, not two
            assert got.count(b"after") == 1, got
    finally:
        second.kill()
        await _delete_raw(f"{prefix}.queue.{QUEUE}")


async def test_a_broker_list_out_of_reach_names_every_node():
    ports = free_ports(2)
    urls = ",".join(f"amqp://guest:hunter2@127.0.0.1:{port}/" for port in ports)
    with pytest.raises(BrokerUnreachable) as unreachable:
        await RabbitBus(urls).connect()
    message = str(unreachable.value)
    assert message.startswith("cannot reach any RabbitMQ node: ")
    for port in ports:
        assert f"amqp://guest:***@127.0.0.1:{port}/: " in message
    assert "hunter2" not in message


async def test_a_nacked_publish_is_tried_again_on_a_new_channel():
    """A full quorum queue that rejects publishes (a policy: max-length 1, overflow
    reject-publish) nacks them: the bus tries again on new publishing channels (a
    channel left unable to publish after a node died is replaced so) for NACK_RETRY_S,
    then lets the nack through; the new channel publishes once there is room."""
    if subprocess.run(["which", "rabbitmqctl"], capture_output=True).returncode != 0:
        pytest.skip("needs rabbitmqctl")
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    policy = f"{prefix}-full"
    bus = RabbitBus(RABBIT_URL, prefix=prefix)
    async with bus:
        name = bus.queue_name("q")
        subprocess.run(
            ["rabbitmqctl", "set_policy", "--apply-to", "queues", policy, f"^{name}$",
             '{"max-length": 1, "overflow": "reject-publish"}'],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        try:
            await bus.enqueue("q", b"first")
            first_channel = bus._confirmed
            nacked = False
            for _ in range(50):  # until the policy reaches the queue
                try:
                    await bus.enqueue("q", b"more")
                except aiormq.exceptions.DeliveryError:
                    nacked = True
                    break
                await asyncio.sleep(0.1)
            assert nacked
            assert bus._confirmed is not first_channel  # tried again on a new channel
        finally:
            subprocess.run(["rabbitmqctl", "clear_policy", policy], capture_output=True, timeout=60)
            with contextlib.suppress(Exception):
                await bus.delete_queue("q")


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["work queue", "kept fan-out"])
async def test_a_subscription_the_broker_stopped_delivering_to_consumes_again(kind: str) -> None:
    """Issue #30: in the multi-host broker-kill test a subscription aio-pika had restored
    on a surviving node sometimes got no delivery ever again (a GM's consumer of its own
    quorum queue, restored while the queue elected a new leader: the acknowledged tasks
    relayed into it never ran). The same from the client's side: the broker stops
    delivering (its consumer is cancelled behind the subscription's back) while messages
    wait. The subscription finds its queue holding ready messages it gets none of, and
    consumes again within a few ``SILENT_CHECK_S``; nothing is lost or delivered twice.
    (Live-state subscriptions watch the same way, but their queues are auto-deleted with
    their last consumer, so cancelling it here would delete the queue instead.)"""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    publisher, subscriber = make_bus(RABBIT_URL, prefix=prefix), make_bus(RABBIT_URL, prefix=prefix)
    got: list[bytes] = []

    async def on_body(body: bytes) -> None:
        got.append(body)

    async def on_delivery(delivery: Delivery) -> None:
        got.append(delivery.body)
        await delivery.ack()

    async def publish(body: bytes) -> None:
        if kind == "work queue":
            await publisher.enqueue(QUEUE, body)
        else:
            await publisher.publish_fanout(HEARTBEATS, body)

    try:
        await publisher.connect()
        await subscriber.connect()
        if kind == "work queue":
            sub = await subscriber.consume(QUEUE, on_delivery, prefetch=10)
        else:
            sub = await subscriber.subscribe_fanout(HEARTBEATS, on_body, keep_as=KEPT)
        await publish(b"before")
        await wait_until(lambda: got == [b"before"])
        # The broker forgets the consumer; the subscription (and aio-pika) do not know.
        channel = await sub._channel.get_underlay_channel()  # type: ignore[attr-defined]
        await channel.basic_cancel(sub._tag)  # type: ignore[attr-defined]
        began = asyncio.get_running_loop().time()
        for i in range(3):
            await publish(f"after-{i}".encode())
        await wait_until(lambda: len(got) == 4, timeout=4 * SILENT_CHECK_S)
        took = asyncio.get_running_loop().time() - began
        await asyncio.sleep(QUIET_S)
        assert got == [b"before", b"after-0", b"after-1", b"after-2"], got
        assert sub.reconsumed == 1  # type: ignore[attr-defined]
        print(f"\n{kind}: consuming again {took:.1f} s after the broker stopped delivering")
    finally:
        await close_and_delete((publisher, subscriber), prefix, [QUEUE, KEPT])
