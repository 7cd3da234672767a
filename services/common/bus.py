"""The message bus: one small publish/subscribe interface, backed by RabbitMQ or by memory.

Three kinds of traffic use it (DESIGN.md §3, "Messaging"):

- **Fan-out** (LM heartbeats): every current subscriber gets every message. Each subscriber
  has its own exclusive, auto-deleted queue whose messages expire after ``ttl_s``, so a slow
  subscriber skips stale state instead of replaying history.
- **Topic** (task lifecycle events): routing keys such as ``task.<lm_id>``; binding keys may
  use the AMQP wildcards ``*`` (exactly one word) and ``#`` (zero or more words).
- **Durable work queues** (user queues): ``enqueue`` returns only once the broker has
  confirmed the message is stored (a nacked publish is tried again on a new channel for
  up to ``NACK_RETRY_S``), and a delivery leaves the queue only when ``ack()`` is
  called. A consumer that goes away (cancelled, bus closed, process killed) gives its
  unacked deliveries back; the next consumer sees them with ``redelivered=True``.

Names passed in are logical. Exchanges are named ``<prefix>.<exchange>`` and work queues
``<prefix>.queue.<queue>``, so tests (or two federations on one broker) never collide.

How handlers are called:

- Fan-out and topic handlers of one subscription run **one at a time, in arrival order**, so
  heartbeats of one LM are applied in the order they were sent. A handler that raises is
  logged (logger ``megha.bus``) and the message is dropped; the subscription keeps going.
  With a ``ttl_s`` a subscription holds at most one message outside the broker, so a message
  that waited longer than the TTL behind a slow handler is never delivered.
- Work-queue handlers run **concurrently, up to ``prefetch``** unacked deliveries per
  consumer, each in its own task. A handler that raises is logged and its delivery is
  nacked with ``requeue=True`` (unless the handler already settled it). ``ack``/``nack``
  after the delivery was settled, or after its channel is gone, do nothing (the broker
  redelivers what was not acked, so consumers must be idempotent, e.g. by task id).
- Cancelling a subscription cancels its in-flight handler tasks (except the caller's own).

``RabbitBus`` uses one robust connection with a channel with publisher confirms for
``enqueue``, a channel without confirms for fan-out/topic publishing (heartbeats must not
wait for confirms), and a channel per subscription. Work queues are durable and their
messages persistent; fan-out/topic exchanges are not durable (they carry only live state,
and every publisher or subscriber declares them again, also after a reconnect).

Work queues (user queues and kept fan-out queues such as the cancel queues: whatever holds
acknowledged work) are quorum queues by default (``queue_type``): replicated on the nodes
of a RabbitMQ cluster, a publisher confirm means a majority of them stored the message, and
the queue lives on while a majority does. Quorum queues are never exclusive, auto-deleted
or server-named, and (RabbitMQ 3.10) have no message priorities and no global prefetch;
nothing here needs those for work queues. They take per-message and per-queue TTLs
(``x-message-ttl``, since 3.10; ``x-expires``, whose lease a consumer renews, a
re-declaration not), per-consumer prefetch, and mark a message
given back by a consumer ``redelivered`` (with an ``x-delivery-count`` header) as classic
queues do. Live-state subscriptions (heartbeats, events) keep their exclusive, auto-deleted
classic queues: they are transient by design. A queue cannot change type: declaring one
that exists with the other type raises ``QueueTypeMismatch``, which names the queue.

The URL may list the nodes of one cluster, separated by commas. The bus connects to the
first that answers; when its node goes away, each reconnection attempt tries the next URL
in turn (``_FailoverConnection``), and the robust channels declare their exchanges, queues
and consumers again there.
An ``amqps://`` URL connects over TLS, with the federation's CA and certificate when
``tls`` is set (``services.common.server.broker_ssl_context``).

A bus made with a ``signing_key`` signs what it enqueues (``services.common.queue_signing``:
a header on the message) and its ``authentic`` tells a consumer whether a delivery carries
a valid signature for its queue; without one, nothing is signed and every delivery passes.

``InMemoryBus`` gives the same semantics inside one process for ``megha up --embedded``:
several buses sharing one ``InMemoryBroker`` behave like clients of one RabbitMQ.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self
from urllib.parse import urlsplit, urlunsplit

import aio_pika
from aio_pika import RobustConnection
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from aio_pika.exceptions import (
    AMQPConnectionError,
    AMQPError,
    ChannelInvalidStateError,
    ChannelPreconditionFailed,
    DeliveryError,
    PublishError,
)
from yarl import URL

from services.common import metrics
from services.common.config import split_urls
from services.common.queue_signing import SIGNATURE_HEADER, sign, verify
from services.common.server import broker_ssl_context, warn_if_broker_plaintext
from services.common.tasks import long_lived

log = logging.getLogger("megha.bus")

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
MEMORY_URL = "memory://"
QUEUE_TYPES = ("quorum", "classic")

FanoutHandler = Callable[[bytes], Awaitable[None]]
TopicHandler = Callable[[str, bytes], Awaitable[None]]

# Unacked messages a fan-out/topic subscription without TTL may hold client-side. Bounded,
# so a slow subscriber's backlog stays in the broker rather than in our memory.
_STREAM_PREFETCH = 256
# A kept fan-out queue (``subscribe_fanout(keep_as=...)``) nobody subscribed to for this
# long is deleted by the broker, with what it held.
KEPT_QUEUE_IDLE_S = 7 * 24 * 3600.0
# Such a subscription acks what it handled at most this often, with one multiple-ack, not
# one ack per message (each is a frame to write and for the broker to process).
_STREAM_ACK_EVERY_S = 0.05
# Bound on the broker round trips of cancel/close, so shutdown never hangs on a dead broker.
_CLOSE_TIMEOUT_S = 5.0
# An enqueue not confirmed within this fails (TimeoutError): its caller retries or
# tells its client (see RabbitBus.enqueue).
ENQUEUE_TIMEOUT_S = 10.0
# A nacked publish is tried again on a new channel for this long, the pauses between tries
# doubling from _NACK_PAUSE_S up to _NACK_PAUSE_MAX_S; then the nack goes to the caller.
# Long enough for a quorum queue's new leader to be elected and written into the queue
# record after its node died (0.3-2 s measured), short of ENQUEUE_TIMEOUT_S.
NACK_RETRY_S = 4.0
_NACK_PAUSE_S = 0.1
_NACK_PAUSE_MAX_S = 1.0
# Errors that mean "this channel or connection is gone"; the broker requeues what we held.
_GONE = (AMQPError, ChannelInvalidStateError, ConnectionError, asyncio.TimeoutError)
# A subscription that got no delivery for this long while its queue holds ready messages
# and it holds fewer than its prefetch unsettled is consuming nothing: it consumes again
# (``_RabbitSubscription._watch``). Seen in the multi-host broker-kill test (issue #30, 3 of
# 19 runs on RabbitMQ 3.10.8): a consumer aio-pika restored on a surviving node while its
# quorum queue elected a new leader got no delivery ever after (a GM's consumer of q2: the
# acknowledged tasks relayed into it never ran), and in the others a GM's event and, it
# seems, heartbeat subscriptions (docs/multihost.md).
SILENT_CHECK_S = 2.0
# Making a subscription again (``_RabbitSubscription.renew_soon``): each try bounded, then
# paused, the pause doubling while it fails.
_RENEW_TIMEOUT_S = 10.0
_RENEW_PAUSE_S = 0.5
_RENEW_PAUSE_MAX_S = 8.0
# Pause between reconnection attempts with several broker URLs. Each attempt tries the next
# node, so a short pause crosses a dead node quickly; with one URL aio-pika's default (5 s)
# stays, as before.
_FAILOVER_RECONNECT_S = 0.5


class Delivery(Protocol):
    """One message from a durable work queue."""

    body: bytes
    redelivered: bool
    """True if an earlier consumer got it and never acked it (e.g. a GM crashed)."""
    headers: Mapping[str, Any]
    """The message's AMQP headers (its signature among them, if signed)."""
    message_id: str
    """The publisher's id for the message ('' if it gave none), for logs."""

    async def ack(self) -> None:
        """Remove the message from the queue for good."""
        ...

    async def nack(self, requeue: bool = True) -> None:
        """Give the message back (``requeue=True``) or drop it."""
        ...


class Subscription(Protocol):
    async def cancel(self) -> None:
        """Stop delivering. Idempotent; unacked deliveries go back to the queue."""
        ...


class Bus(abc.ABC):
    """Publish/subscribe and durable work queues; see the module docstring."""

    def __init__(self, prefix: str = "megha", signing_key: bytes | None = None) -> None:
        if not prefix:
            raise ValueError("bus prefix must not be empty")
        self.prefix = prefix
        self.signing_key = signing_key

    def _signature(self, queue_name: str, body: bytes) -> dict[str, Any] | None:
        """The headers that sign ``body`` on the broker queue ``queue_name``, if we sign."""
        if self.signing_key is None:
            return None
        return {SIGNATURE_HEADER: sign(self.signing_key, queue_name, body)}

    def authentic(self, queue: str, delivery: Delivery) -> bool:
        """Whether ``delivery`` from work queue ``queue`` carries a valid signature (always
        True on a bus without a signing key: today's unsigned federation)."""
        if self.signing_key is None:
            return True
        return verify(self.signing_key, self.queue_name(queue), delivery.body, delivery.headers)

    def exchange_name(self, exchange: str) -> str:
        return f"{self.prefix}.{exchange}"

    def queue_name(self, queue: str) -> str:
        return f"{self.prefix}.queue.{queue}"

    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Idempotent; cancels every subscription made through this bus."""

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @abc.abstractmethod
    async def publish_fanout(self, exchange: str, body: bytes, ttl_s: float | None = None) -> None:
        """Send ``body`` to every current subscriber; it expires after ``ttl_s`` if given."""

    @abc.abstractmethod
    async def subscribe_fanout(
        self,
        exchange: str,
        handler: FanoutHandler,
        ttl_s: float | None = None,
        keep_as: str | None = None,
    ) -> Subscription:
        """Receive every message published from now on that is not older than ``ttl_s``.

        With ``keep_as`` (a name unique to the subscriber, e.g. ``cancels.lm-1``) the
        subscription's queue is durable and outlives the subscriber: what is published
        while it is away waits for its next subscription under that name (for
        ``KEPT_QUEUE_IDLE_S``), and what it had not acked is delivered again."""

    @abc.abstractmethod
    async def publish_topic(self, exchange: str, routing_key: str, body: bytes) -> None: ...

    @abc.abstractmethod
    async def subscribe_topic(
        self, exchange: str, binding_key: str, handler: TopicHandler
    ) -> Subscription:
        """Receive ``(routing_key, body)`` for every message whose key matches ``binding_key``."""

    @abc.abstractmethod
    async def enqueue(self, queue: str, body: bytes) -> None:
        """Store ``body`` durably at the tail of ``queue``; returns once the broker confirmed."""

    @property
    @abc.abstractmethod
    def can_enqueue(self) -> bool:
        """Whether an enqueue could be sent now (connected, channel open). A cheap check
        before work that assumes the enqueue will be tried; True promises no confirm."""

    async def enqueue_many(self, queue: str, bodies: Sequence[bytes]) -> None:
        """Enqueue concurrently; returns once every body is confirmed, or raises the first error.

        On error some bodies may be stored and others not: the caller retries the batch, and
        consumers deduplicate (by task id).
        """
        results = await asyncio.gather(
            *(self.enqueue(queue, body) for body in bodies), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    @abc.abstractmethod
    async def consume(
        self, queue: str, handler: Callable[[Delivery], Awaitable[None]], prefetch: int = 1000
    ) -> Subscription:
        """Deliver messages of ``queue``, at most ``prefetch`` unacked at once."""

    @abc.abstractmethod
    async def delete_queue(self, queue: str) -> None:
        """Delete a work queue and its messages (tests and cleanup); no error if missing."""

    @abc.abstractmethod
    async def queue_depth(self, queue: str) -> int:
        """Messages ready in a work queue (delivered-but-unacked ones are not counted)."""


def make_bus(
    url: str,
    prefix: str = "megha",
    broker: InMemoryBroker | None = None,
    signing_key: bytes | None = None,
    queue_type: str = "quorum",
    single_active: bool = False,
) -> Bus:
    """``memory://`` → an in-process bus on ``broker`` (or a shared default); else RabbitMQ
    (``url`` may list a cluster's nodes, comma-separated), its work queues of
    ``queue_type``. With ``signing_key`` it signs what it enqueues (see ``Bus.authentic``).
    With ``single_active`` the broker delivers a work queue's messages to one of its
    consumers at a time, the next when that one goes away (queue failover)."""
    if url.startswith(MEMORY_URL):
        shared = broker if broker is not None else _DEFAULT_BROKER
        return InMemoryBus(
            shared, prefix=prefix, signing_key=signing_key, single_active=single_active
        )
    return RabbitBus(
        url,
        prefix=prefix,
        signing_key=signing_key,
        queue_type=queue_type,
        single_active=single_active,
    )


def _check_prefetch(prefetch: int) -> None:
    if not 1 <= prefetch <= 65535:
        raise ValueError(f"prefetch must be between 1 and 65535, got {prefetch}")


# --------------------------------------------------------------------------- RabbitMQ


class BrokerUnreachable(AMQPConnectionError):
    """The first connection to RabbitMQ failed (refused, TLS, credentials); the message
    names the URL, its password hidden, and the reason. Later losses are reconnected."""


class QueueTypeMismatch(RuntimeError):
    """A work queue exists on the broker with another type than the bus declares it with
    (RabbitMQ's PRECONDITION_FAILED, inequivalent arg 'x-queue-type'), or with single
    active consumer set otherwise (``x-single-active-consumer``: the federation's
    ``queue_failover``); the message names the queue and the two ways out."""

    def __init__(self, queue: str, wanted: str, broker_says: str) -> None:
        if wanted in QUEUE_TYPES:
            found = "classic" if wanted == "quorum" else "quorum"
            what = (
                f"exists as a {found} queue, but this federation declares its work queues "
                f"as {wanted} queues (queue_type: {wanted})"
            )
            other = f"queue_type: {found}"
        else:  # "single-active" or "" (queue failover on or off)
            on = wanted == SINGLE_ACTIVE
            what = (
                f"exists {'without' if on else 'with'} single active consumer, but this "
                f"federation declares its user queues {'with' if on else 'without'} it "
                f"(queue_failover: {'true' if on else 'false'})"
            )
            other = f"queue_failover: {'false' if on else 'true'}"
        super().__init__(
            f"RabbitMQ queue {queue!r} {what}. Delete it (rabbitmqctl delete_queue {queue}; "
            f"the messages it holds go with it) or set {other} in the federation file. The "
            f"broker said: {broker_says}"
        )
        self.queue = queue


SINGLE_ACTIVE = "single-active"


def safe_url(url: str) -> str:
    """``url`` (or each URL of a comma-separated list) with its password, if any,
    replaced by ``***``."""
    if "," in url:
        return ",".join(safe_url(part) for part in split_urls(url))
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


class _FailoverConnection(RobustConnection):
    """aio-pika's robust connection over the nodes of one cluster: every connection attempt
    after the first goes to the next URL in turn, so the first attempt after the node we
    were on went away already tries another one (``connect_robust`` takes one URL).

    aio-pika clears ``transport`` at the start of every attempt (and on close), and reads
    ``url`` to connect: those two attributes are the hook (aio-pika 10.2), and
    ``test_a_bus_fails_over_to_the_next_url_when_its_node_dies`` fails if that changes.
    ``url`` is the current node's.
    """

    def __init__(self, url: URL | str, *args: Any, urls: Sequence[str] = (), **kwargs: Any) -> None:
        self._urls = [URL(u) for u in urls] or [URL(url)]
        self._at = 0
        self._clears = -1  # Connection.__init__ clears the transport once: not an attempt
        self._transport: Any = None
        super().__init__(self._urls[0], *args, **kwargs)

    @property  # type: ignore[override]
    def url(self) -> URL:
        return self._urls[self._at]

    @url.setter
    def url(self, value: URL | str) -> None:  # aio-pika's __init__ and update_secret
        self._urls[self._at] = URL(value)

    @property  # type: ignore[override]
    def transport(self) -> Any:
        return self._transport

    @transport.setter
    def transport(self, value: Any) -> None:
        if value is None:
            self._clears += 1
            if self._clears > 1:
                self._at = (self._at + 1) % len(self._urls)
        self._transport = value


class RabbitBus(Bus):
    """The bus on RabbitMQ through aio-pika, with a robust (reconnecting) connection to one
    node of the URLs ``url`` lists (comma-separated), failing over to the others."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        prefix: str = "megha",
        signing_key: bytes | None = None,
        queue_type: str = "quorum",
        single_active: bool = False,
    ) -> None:
        super().__init__(prefix, signing_key)
        self.single_active = single_active
        if queue_type not in QUEUE_TYPES:
            raise ValueError(f"queue_type must be one of {QUEUE_TYPES}, got {queue_type!r}")
        self.url = url
        self.urls = split_urls(url)
        if not self.urls:
            raise ValueError("no broker URL given")
        self.queue_type = queue_type
        self._connection: AbstractRobustConnection | None = None
        self._confirmed: AbstractChannel | None = None  # publisher confirms: enqueue
        self._fast: AbstractChannel | None = None  # no confirms: fan-out and topic
        self._exchanges: dict[str, AbstractExchange] = {}
        self._work_queues: set[str] = set()
        self._declare_lock = asyncio.Lock()
        self._subscriptions: set[_RabbitSubscription] = set()

    async def connect(self) -> None:
        if self._connection is not None:
            return
        for url in self.urls:
            warn_if_broker_plaintext(url)
        connection = await self._first_reachable()
        try:
            # on_return_raises: an enqueue to a queue deleted behind our back must fail, not
            # be confirmed and silently dropped.
            self._confirmed = await connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
            self._fast = await connection.channel(publisher_confirms=False)
        except BaseException:
            await connection.close()
            raise
        self._connection = connection
        connection.reconnect_callbacks.add(self._reconnected)

    def _reconnected(self, *_: Any) -> None:
        """aio-pika re-established the connection (to this node or another) and restored
        what it could: every subscription is made again on a new channel."""
        for subscription in list(self._subscriptions):
            subscription.renew_soon("the connection to the broker was re-established")

    @property
    def connected(self) -> bool:
        """Whether the connection to a node is up now (not being re-established)."""
        connection = self._connection
        return connection is not None and not connection.is_closed and connection.connected.is_set()

    async def _first_reachable(self) -> AbstractRobustConnection:
        """A robust connection to the first node that answers, in the order listed; it
        fails over from there in turn. BrokerUnreachable names every URL tried."""
        failures = []
        for start in range(len(self.urls)):
            order = [*self.urls[start:], *self.urls[:start]]
            extra: dict[str, Any] = {}
            if len(order) > 1 and "reconnect_interval" not in URL(order[0]).query:
                extra["reconnect_interval"] = _FAILOVER_RECONNECT_S
            # What aio_pika.connect_robust does, with our connection class (connect_robust
            # would also copy ``urls`` into the URL's query string). The URL's query
            # (heartbeat=...) and TLS come from the first URL; a cluster's share them.
            connection = _FailoverConnection(
                order[0], ssl_context=broker_ssl_context(order[0]), urls=order, **extra
            )
            try:
                await connection.connect()
                return connection
            except (AMQPConnectionError, OSError) as err:
                with contextlib.suppress(*_GONE):
                    await connection.close()
                failures.append(f"{safe_url(order[0])}: {err}")
        if len(failures) == 1:
            raise BrokerUnreachable(f"cannot reach RabbitMQ at {failures[0]}")
        raise BrokerUnreachable("cannot reach any RabbitMQ node: " + "; ".join(failures))

    def _queue_arguments(self, **arguments: Any) -> dict[str, Any]:
        """A work queue's declare arguments: its type, and ``arguments``. Every declare of
        one queue must pass the same ones (else the broker refuses it: inequivalent arg)."""
        return {"x-queue-type": self.queue_type, **arguments}

    def _user_queue_arguments(self) -> dict[str, Any]:
        """A queue that ``enqueue`` and ``consume`` use: with ``single_active``, RabbitMQ
        delivers to its first consumer only, and hands it to the next (in the order they
        subscribed) when that one goes away: its unacked messages come back redelivered."""
        if self.single_active:
            return self._queue_arguments(**{"x-single-active-consumer": True})
        return self._queue_arguments()

    @contextlib.contextmanager
    def _declaring(self, name: str) -> Iterator[None]:
        """Tell a work queue of the other type apart from other declare failures."""
        try:
            yield
        except ChannelPreconditionFailed as err:
            if "x-queue-type" in str(err):
                raise QueueTypeMismatch(name, self.queue_type, str(err)) from None
            if "x-single-active-consumer" in str(err):
                wanted = SINGLE_ACTIVE if self.single_active else ""
                raise QueueTypeMismatch(name, wanted, str(err)) from None
            raise

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        await asyncio.gather(
            *(sub.cancel() for sub in list(self._subscriptions)), return_exceptions=True
        )
        self._exchanges.clear()
        self._work_queues.clear()
        self._confirmed = self._fast = None
        with contextlib.suppress(*_GONE):
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await connection.close()

    @property
    def can_enqueue(self) -> bool:
        # A robust channel reads as closed while its connection is being re-established.
        return self._confirmed is not None and not self._confirmed.is_closed

    def _require(self) -> AbstractRobustConnection:
        if self._connection is None:
            raise RuntimeError("bus is not connected: call connect() or use 'async with'")
        return self._connection

    async def _exchange(self, name: str, kind: aio_pika.ExchangeType) -> AbstractExchange:
        self._require()
        exchange = self._exchanges.get(name)
        if exchange is None:
            async with self._declare_lock:
                exchange = self._exchanges.get(name)
                if exchange is None:
                    assert self._fast is not None
                    exchange = await self._fast.declare_exchange(name, kind, durable=False)
                    self._exchanges[name] = exchange
        return exchange

    async def publish_fanout(self, exchange: str, body: bytes, ttl_s: float | None = None) -> None:
        target = await self._exchange(self.exchange_name(exchange), aio_pika.ExchangeType.FANOUT)
        # mandatory=False: nobody listening is normal, and a returned message would only
        # cost bandwidth (and an aiormq error log, since this channel has no confirms).
        await target.publish(aio_pika.Message(body, expiration=ttl_s), "", mandatory=False)

    async def publish_topic(self, exchange: str, routing_key: str, body: bytes) -> None:
        target = await self._exchange(self.exchange_name(exchange), aio_pika.ExchangeType.TOPIC)
        await target.publish(aio_pika.Message(body), routing_key, mandatory=False)

    async def subscribe_fanout(
        self,
        exchange: str,
        handler: FanoutHandler,
        ttl_s: float | None = None,
        keep_as: str | None = None,
    ) -> Subscription:
        async def call(_key: str, body: bytes) -> None:
            await handler(body)

        kept = None if keep_as is None else self.queue_name(keep_as)
        return await self._subscribe_stream(
            self.exchange_name(exchange), aio_pika.ExchangeType.FANOUT, "", ttl_s, call, kept
        )

    async def subscribe_topic(
        self, exchange: str, binding_key: str, handler: TopicHandler
    ) -> Subscription:
        return await self._subscribe_stream(
            self.exchange_name(exchange), aio_pika.ExchangeType.TOPIC, binding_key, None, handler
        )

    async def _subscribe_stream(
        self,
        exchange_name: str,
        kind: aio_pika.ExchangeType,
        binding_key: str,
        ttl_s: float | None,
        call: TopicHandler,
        kept: str | None = None,
    ) -> Subscription:
        def reopen() -> Awaitable[tuple[AbstractChannel, AbstractQueue]]:
            return self._open_stream(exchange_name, kind, binding_key, ttl_s, kept)

        channel, queue = await reopen()
        return await self._started(
            _RabbitStream(self, channel, queue, call, exchange_name, ttl_s, reopen), channel
        )

    async def _started(
        self, subscription: _RabbitSubscription, channel: AbstractChannel
    ) -> Subscription:
        """``subscription`` consuming on ``channel``, kept; the channel closed if not."""
        try:
            await subscription.start()
        except BaseException:
            with contextlib.suppress(*_GONE):
                await channel.close()
            raise
        self._subscriptions.add(subscription)
        return subscription

    async def _open_stream(
        self,
        exchange_name: str,
        kind: aio_pika.ExchangeType,
        binding_key: str,
        ttl_s: float | None,
        kept: str | None,
    ) -> tuple[AbstractChannel, AbstractQueue]:
        """A new channel with a queue bound to the exchange: a new exclusive queue each
        time (a new name), or the ``kept`` one."""
        channel = await self._require().channel(publisher_confirms=False)
        try:
            # With a TTL, one message at a time: the rest wait in the broker, where they expire.
            await channel.set_qos(prefetch_count=1 if ttl_s is not None else _STREAM_PREFETCH)
            exchange = await channel.declare_exchange(exchange_name, kind, durable=False)
            arguments: dict[str, Any] = {}
            if ttl_s is not None:
                arguments["x-message-ttl"] = max(0, round(ttl_s * 1000))
            if kept is None:
                queue = await channel.declare_queue(
                    exclusive=True, auto_delete=True, arguments=arguments or None
                )
            else:  # outlives the subscriber, a work queue; the broker drops it once long unused
                arguments["x-expires"] = round(KEPT_QUEUE_IDLE_S * 1000)
                with self._declaring(kept):
                    queue = await channel.declare_queue(
                        kept, durable=True, arguments=self._queue_arguments(**arguments)
                    )
            await queue.bind(exchange, routing_key=binding_key)
        except BaseException:
            with contextlib.suppress(*_GONE):
                await channel.close()
            raise
        return channel, queue

    async def _work_queue(self, name: str) -> None:
        if name in self._work_queues:
            return
        async with self._declare_lock:
            if name not in self._work_queues:
                assert self._confirmed is not None
                with self._declaring(name):
                    await self._confirmed.declare_queue(
                        name, durable=True, arguments=self._user_queue_arguments()
                    )
                self._work_queues.add(name)

    async def enqueue(self, queue: str, body: bytes) -> None:
        self._require()
        name = self.queue_name(queue)
        # Bounded: a publish on a robust channel whose connection is lost waits for the
        # reconnection, and one caught in it may never be confirmed (aio-pika #636); the
        # caller's retry may then store it twice, which consumers tell apart by task id.
        async with asyncio.timeout(ENQUEUE_TIMEOUT_S):
            await self._work_queue(name)
            give_up = time.monotonic() + NACK_RETRY_S
            pause = _NACK_PAUSE_S
            returned = False
            while True:
                channel = self._confirmed
                assert channel is not None
                try:
                    began = time.monotonic()
                    await self._publish_persistent(channel, name, body)
                    metrics.BROKER_CONFIRM_SECONDS.observe(time.monotonic() - began)
                    return
                except PublishError:
                    # Returned as unroutable: the queue was deleted since we declared it.
                    if returned:
                        raise
                    returned = True
                    self._work_queues.discard(name)
                except DeliveryError:
                    # Nacked: not stored, so trying again stores it at most once more.
                    # After a cluster node died, a channel whose first publish to a
                    # quorum queue came while the queue record still named the dead
                    # leader has every later publish to it nacked (issue #30): on a
                    # channel's first publish, RabbitMQ 3.10's rabbit_fifo_client asks
                    # the record's leader node, rejects on nodedown and keeps no other
                    # leader, so each later publish asks the dead node again (fixed
                    # upstream in 3.11/3.12: rabbitmq-server #9221, #9241). A new channel
                    # reads the record afresh: once the new leader is in it, the publish
                    # goes through. So: a new channel, a pause (one opened at once would
                    # read the same stale record), and again, for a while.
                    if time.monotonic() + pause > give_up:
                        raise
                    await self._new_confirmed_channel(channel)
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, _NACK_PAUSE_MAX_S)
                await self._work_queue(name)

    async def _new_confirmed_channel(self, old: AbstractChannel) -> None:
        """Replace the publisher-confirms channel ``old`` (once for a burst of nacks:
        publishes that failed on it find the new one already there)."""
        async with self._declare_lock:
            if self._confirmed is not old:
                return
            log.warning("the broker nacked a publish: opening a new publishing channel")
            self._confirmed = await self._require().channel(
                publisher_confirms=True, on_return_raises=True
            )
            self._work_queues.clear()
        with contextlib.suppress(*_GONE):
            await old.close()

    async def _publish_persistent(self, channel: AbstractChannel, name: str, body: bytes) -> None:
        message = aio_pika.Message(
            body,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            headers=self._signature(name, body),
            message_id=uuid.uuid4().hex,  # names it in a consumer's logs
        )
        # With publisher confirms this returns once the broker has stored the message, and
        # raises DeliveryError if the broker nacks it.
        await channel.default_exchange.publish(message, name, mandatory=True)

    async def enqueue_many(self, queue: str, bodies: Sequence[bytes]) -> None:
        self._require()
        await self._work_queue(self.queue_name(queue))  # once, not once per body
        await super().enqueue_many(queue, bodies)

    async def consume(
        self, queue: str, handler: Callable[[Delivery], Awaitable[None]], prefetch: int = 1000
    ) -> Subscription:
        _check_prefetch(prefetch)
        name = self.queue_name(queue)

        def reopen() -> Awaitable[tuple[AbstractChannel, AbstractQueue]]:
            return self._open_work_queue(name, prefetch)

        channel, amqp_queue = await reopen()
        subscription = _RabbitConsumer(
            self, channel, amqp_queue, handler, name, prefetch, reopen, self.single_active
        )
        return await self._started(subscription, channel)

    async def _open_work_queue(
        self, name: str, prefetch: int
    ) -> tuple[AbstractChannel, AbstractQueue]:
        channel = await self._require().channel(publisher_confirms=False)
        try:
            await channel.set_qos(prefetch_count=prefetch)
            with self._declaring(name):
                amqp_queue = await channel.declare_queue(
                    name, durable=True, arguments=self._user_queue_arguments()
                )
        except BaseException:
            with contextlib.suppress(*_GONE):
                await channel.close()
            raise
        return channel, amqp_queue

    async def delete_queue(self, queue: str) -> None:
        self._require()
        name = self.queue_name(queue)
        assert self._confirmed is not None
        self._work_queues.discard(name)
        # RabbitMQ answers delete-ok for a queue that does not exist.
        await self._confirmed.queue_delete(name, if_unused=False, if_empty=False)

    async def queue_depth(self, queue: str) -> int:
        self._require()
        assert self._confirmed is not None
        # A raw (non-robust) declare, so a periodic depth probe does not pile up queue objects
        # for the robust channel to restore; declaring (not passive) makes "missing" mean 0
        # instead of a channel-closing 404.
        channel = await self._confirmed.get_underlay_channel()
        name = self.queue_name(queue)
        with self._declaring(name):
            declared = await channel.queue_declare(
                name, durable=True, arguments=self._user_queue_arguments()
            )
        return int(declared.message_count or 0)


class _RabbitSubscription:
    """A consumer on its own channel; cancelling closes the channel, which requeues unacked.

    ``reopen`` makes a new channel and queue for it (a stream: a new exclusive queue bound
    to its exchange). After every reconnection the subscription is made again that way
    (``renew_soon``) instead of trusting aio-pika's restore of its channel: in the
    multi-host broker kill a restored subscription now and then got nothing ever after
    while its channel looked restored (a GM's events, the work queue of another), and
    nothing said so. Also when its channel stays closed while the connection is up."""

    def __init__(
        self,
        bus: RabbitBus,
        channel: AbstractChannel,
        queue: AbstractQueue,
        name: str,
        prefetch: int,
        reopen: Callable[[], Awaitable[tuple[AbstractChannel, AbstractQueue]]],
        single_active: bool = False,
    ) -> None:
        self._bus = bus
        self._channel = channel
        self._queue = queue
        self._name = name
        self._prefetch = prefetch
        self._reopen = reopen
        self._renewing: asyncio.Task[None] | None = None
        # With the broker's single active consumer a standby gets nothing by design: it is
        # watched only once it got a delivery (it was the active one) since it consumed.
        self._single_active = single_active
        self._tag: str | None = None
        self._cancelled = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unsettled = 0  # delivered, not yet acked or nacked
        self._delivered_at = time.monotonic()
        self._delivered_since_consume = False
        self.reconsumed = 0  # times ``_watch`` found it consuming nothing
        self.renewed = 0  # times it was made again on a new channel

    async def start(self) -> None:
        self._tag = await self._queue.consume(self._on_message, no_ack=False)
        self._tasks.add(long_lived(self._watch, f"watch:{self._name}"))

    def _delivered(self) -> None:
        self._unsettled += 1
        self._delivered_at = time.monotonic()
        self._delivered_since_consume = True

    def _settled(self, count: int = 1) -> None:
        self._unsettled = max(0, self._unsettled - count)

    async def _watch(self) -> None:
        """Consume again when the broker delivers nothing although it could (``SILENT_CHECK_S``).
        Asks the queue's depth only after a silent interval: a subscription that gets
        deliveries costs nothing. A channel closed for two checks in a row while the
        connection is up is not being restored: the subscription is made again."""
        closed = 0
        while not self._cancelled:
            await asyncio.sleep(SILENT_CHECK_S)
            closed = closed + 1 if self._channel.is_closed and self._bus.connected else 0
            if closed >= 2:
                self.renew_soon("its channel stayed closed while the connection was up")
                closed = 0
                continue
            try:
                if await self._silent():
                    await self._reconsume()
            except Exception as err:  # reconnecting: the next round looks again
                log.debug("no check", extra={"queue": self._name, "error": repr(err)})

    async def _silent(self) -> bool:
        checked = time.monotonic()
        if checked - self._delivered_at < SILENT_CHECK_S or self._unsettled >= self._prefetch:
            return False
        if self._single_active and not self._delivered_since_consume:
            return False
        channel = await self._channel.get_underlay_channel()
        declared = await channel.queue_declare(
            self._queue.name,
            durable=self._queue.durable,
            exclusive=self._queue.exclusive,
            auto_delete=self._queue.auto_delete,
            arguments=self._queue.arguments,
            timeout=SILENT_CHECK_S,
        )
        ready = int(declared.message_count or 0)
        return ready > 0 and self._delivered_at < checked and not self._cancelled

    async def _reconsume(self) -> None:
        log.warning(
            "a subscription got no delivery for %.1f s while its queue held ready messages: "
            "consuming again",
            time.monotonic() - self._delivered_at,
            extra={"queue": self._name},
        )
        self.reconsumed += 1
        metrics.SUBSCRIPTIONS_RENEWED.labels(self._name).inc()
        old, self._tag = self._tag, None
        if old is not None:
            with contextlib.suppress(*_GONE):
                await self._queue.cancel(old)
        self._tag = await self._queue.consume(self._on_message, no_ack=False)
        self._delivered_since_consume = False
        self._delivered_at = time.monotonic()

    def renew_soon(self, why: str) -> None:
        """Make the subscription again on a new channel (``_renew``), tried until it
        works; nothing if that is under way already."""
        if self._cancelled or (self._renewing is not None and not self._renewing.done()):
            return
        self._renewing = asyncio.get_running_loop().create_task(
            self._renew_until_done(why), name=f"renew:{self._name}"
        )
        self._tasks.add(self._renewing)
        self._renewing.add_done_callback(self._tasks.discard)

    async def _renew_until_done(self, why: str) -> None:
        pause = _RENEW_PAUSE_S
        while not self._cancelled:
            try:
                async with asyncio.timeout(_RENEW_TIMEOUT_S):
                    await self._renew()
            except Exception as err:
                log.warning(
                    "could not make a subscription again; trying again",
                    extra={"queue": self._name, "error": repr(err)},
                )
                await asyncio.sleep(pause)
                pause = min(2 * pause, _RENEW_PAUSE_MAX_S)
                continue
            self.renewed += 1
            metrics.SUBSCRIPTIONS_RENEWED.labels(self._name).inc()
            log.info(
                "subscription made again on a new channel: %s", why, extra={"queue": self._name}
            )
            return

    async def _renew(self) -> None:
        """A new channel and queue (``reopen``), consumed; then the old channel closed
        (what it delivered and was not acked goes back to the queue, or with it)."""
        channel, queue = await self._reopen()
        try:
            tag = await queue.consume(self._on_message, no_ack=False)
        except BaseException:
            with contextlib.suppress(Exception):
                await channel.close()
            raise
        old = self._channel
        self._channel, self._queue, self._tag = channel, queue, tag
        self._unsettled = 0
        self._delivered_at = time.monotonic()
        self._delivered_since_consume = False
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await old.close()

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        raise NotImplementedError

    async def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        self._bus._subscriptions.discard(self)
        current = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not current]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(*_GONE):
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                if self._tag is not None and not self._channel.is_closed:
                    await self._queue.cancel(self._tag)
                await asyncio.gather(*tasks, return_exceptions=True)
                await self._channel.close()


class _RabbitStream(_RabbitSubscription):
    """Fan-out/topic subscription: messages go through a local inbox to one handler loop."""

    def __init__(
        self,
        bus: RabbitBus,
        channel: AbstractChannel,
        queue: AbstractQueue,
        call: TopicHandler,
        name: str,
        ttl_s: float | None,
        reopen: Callable[[], Awaitable[tuple[AbstractChannel, AbstractQueue]]],
    ) -> None:
        prefetch = 1 if ttl_s is not None else _STREAM_PREFETCH
        super().__init__(bus, channel, queue, name, prefetch, reopen)
        self._call = call
        self._ttl_s = ttl_s
        self._inbox: asyncio.Queue[tuple[AbstractIncomingMessage, float]] = asyncio.Queue()

    async def start(self) -> None:
        pump = long_lived(self._pump, f"bus:{self._name}")
        self._tasks.add(pump)
        try:
            await super().start()
        except BaseException:
            pump.cancel()
            raise

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        # aio-pika runs each callback in a new task; they start in arrival order, and this
        # one does not await, so the inbox keeps that order.
        self._delivered()
        self._inbox.put_nowait((message, time.monotonic()))

    async def _pump(self) -> None:
        # With a TTL (prefetch 1) each message is acked after its handler, so the next one
        # waits (and expires) in the broker while the handler is busy. Without one, acks
        # are gathered: the newest handled message is acked with multiple=True (which
        # covers every earlier one) once _STREAM_ACK_EVERY_S has passed, or when the
        # prefetch window is half used.
        batched = self._ttl_s is None
        unacked: AbstractIncomingMessage | None = None
        count, due = 0, 0.0
        while not self._cancelled:  # (what is unacked at the end goes with the queue)
            if unacked is not None:
                try:
                    async with asyncio.timeout(max(0.0, due - time.monotonic())):
                        message, received = await self._inbox.get()
                except TimeoutError:
                    await self._ack(unacked, multiple=True)
                    self._settled(count)
                    unacked = None
                    continue
            else:
                message, received = await self._inbox.get()
            if not self._expired(message, received):
                try:
                    await self._call(message.routing_key or "", message.body)
                except Exception:
                    log.exception("handler for %s failed; message dropped", self._name)
            if not batched:
                await self._ack(message)
                self._settled()
                continue
            if unacked is None:
                count, due = 0, time.monotonic() + _STREAM_ACK_EVERY_S
            unacked, count = message, count + 1
            if count >= _STREAM_PREFETCH // 2 or time.monotonic() >= due:
                await self._ack(unacked, multiple=True)
                self._settled(count)
                unacked = None

    @staticmethod
    async def _ack(message: AbstractIncomingMessage, multiple: bool = False) -> None:
        # Whatever the channel raises (aio-pika's RuntimeError for a closed connection
        # too): a message of a dead channel goes back with it, and the pump must go on.
        try:
            await message.ack(multiple=multiple)
        except _GONE as err:
            log.debug("ack not sent", extra={"error": repr(err)})
        except Exception as err:
            log.warning("ack not sent", extra={"error": repr(err)})

    def _expired(self, message: AbstractIncomingMessage, received: float) -> bool:
        """Whether it waited here longer than its TTL (only possible with prefetch > 1).

        The broker drops what expires in the queue; this drops what expired in our inbox,
        e.g. a message published with a TTL to a subscription made without one. It is
        conservative: time spent in the broker before delivery is not counted.
        """
        ttls = [t for t in (message.expiration, self._ttl_s) if t is not None]
        return bool(ttls) and time.monotonic() - received > min(ttls)


class _RabbitDelivery:
    __slots__ = (
        "_message",
        "_on_settled",
        "_settled",
        "body",
        "headers",
        "message_id",
        "redelivered",
    )

    def __init__(
        self, message: AbstractIncomingMessage, on_settled: Callable[[], None] | None = None
    ) -> None:
        self._message = message
        self._on_settled = on_settled
        self._settled = False
        self.body: bytes = message.body
        self.redelivered: bool = bool(message.redelivered)
        self.headers: Mapping[str, Any] = message.headers or {}
        self.message_id: str = message.message_id or ""

    async def ack(self) -> None:
        if self._first_settle():
            await self._settle(self._message.ack(), "ack")

    async def nack(self, requeue: bool = True) -> None:
        if self._first_settle():
            await self._settle(self._message.nack(requeue=requeue), "nack")

    def _first_settle(self) -> bool:
        """Whether this is the delivery's first ack or nack (later ones do nothing)."""
        if self._settled:
            return False
        self._settled = True
        if self._on_settled is not None:
            self._on_settled()
        return True

    @staticmethod
    async def _settle(action: Awaitable[None], what: str) -> None:
        try:
            await action
        except _GONE as err:
            # The channel is gone, so the broker has already put the message back.
            log.warning("could not %s a delivery (%r); the broker will redeliver it", what, err)


class _RabbitConsumer(_RabbitSubscription):
    """Work-queue consumer: one task per delivery, at most ``prefetch`` at once (broker qos)."""

    def __init__(
        self,
        bus: RabbitBus,
        channel: AbstractChannel,
        queue: AbstractQueue,
        handler: Callable[[Delivery], Awaitable[None]],
        name: str,
        prefetch: int,
        reopen: Callable[[], Awaitable[tuple[AbstractChannel, AbstractQueue]]],
        single_active: bool = False,
    ) -> None:
        super().__init__(bus, channel, queue, name, prefetch, reopen, single_active)
        self._handler = handler

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        if self._cancelled:
            return  # left unacked: closing the channel requeues it
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._delivered()
        delivery = _RabbitDelivery(message, self._settled)
        try:
            await self._handler(delivery)
        except Exception:
            log.exception("handler for %s failed; message requeued", self._name)
            await delivery.nack(requeue=True)
        finally:
            self._tasks.discard(task)


# --------------------------------------------------------------------------- in memory


def topic_matches(binding_key: str, routing_key: str) -> bool:
    """AMQP topic matching on dot-separated words: ``*`` is one word, ``#`` zero or more."""
    words = routing_key.split(".")
    reachable = {0}  # how many words the pattern so far can have consumed
    for part in binding_key.split("."):
        if part == "#":
            reachable = set(range(min(reachable), len(words) + 1))
        else:
            reachable = {i + 1 for i in reachable if i < len(words) and part in ("*", words[i])}
        if not reachable:
            return False
    return len(words) in reachable


@dataclass(slots=True)
class _Stored:
    body: bytes
    redelivered: bool = False
    headers: Mapping[str, Any] | None = None
    message_id: str = ""


class _MemoryWorkQueue:
    """FIFO of ready messages plus its consumers, served round-robin within their prefetch
    (``single_active``: only the first consumer, like RabbitMQ's single active consumer)."""

    def __init__(self) -> None:
        self.ready: deque[_Stored] = deque()
        self.consumers: list[_MemoryConsumer] = []
        self._next = 0
        self.single_active = False

    def dispatch(self) -> None:
        while self.ready and self.consumers:
            consumer = self._next_with_room()
            if consumer is None:
                return
            consumer.deliver(self.ready.popleft())

    def _next_with_room(self) -> _MemoryConsumer | None:
        if self.single_active:
            first = self.consumers[0]
            return first if first.has_room() else None
        count = len(self.consumers)
        for step in range(count):
            index = (self._next + step) % count
            consumer = self.consumers[index]
            if consumer.has_room():
                self._next = (index + 1) % count
                return consumer
        return None

    def give_back(self, stored: Sequence[_Stored]) -> None:
        """Put messages back at the head, keeping their order, marked redelivered."""
        self.ready.extendleft(
            _Stored(s.body, True, s.headers, s.message_id) for s in reversed(stored)
        )
        self.dispatch()


class InMemoryBroker:
    """What one RabbitMQ would hold, for buses in the same process and event loop."""

    def __init__(self) -> None:
        self._fanout: dict[str, list[_MemoryStream]] = {}
        self._topic: dict[str, list[_MemoryStream]] = {}
        self._queues: dict[str, _MemoryWorkQueue] = {}

    def work_queue(self, name: str) -> _MemoryWorkQueue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = _MemoryWorkQueue()
        return queue


_DEFAULT_BROKER = InMemoryBroker()


class InMemoryBus(Bus):
    """The bus inside one process; several buses on one broker act like RabbitMQ clients."""

    def __init__(
        self,
        broker: InMemoryBroker,
        prefix: str = "megha",
        signing_key: bytes | None = None,
        single_active: bool = False,
    ) -> None:
        super().__init__(prefix, signing_key)
        self.broker = broker
        self.single_active = single_active
        self._connected = False
        self._subscriptions: set[_MemoryStream | _MemoryConsumer] = set()

    async def connect(self) -> None:
        self._connected = True

    async def close(self) -> None:
        if not self._connected:
            return
        self._connected = False
        await asyncio.gather(
            *(sub.cancel() for sub in list(self._subscriptions)), return_exceptions=True
        )

    @property
    def can_enqueue(self) -> bool:
        return self._connected

    def _require(self) -> None:
        if not self._connected:
            raise RuntimeError("bus is not connected: call connect() or use 'async with'")

    async def publish_fanout(self, exchange: str, body: bytes, ttl_s: float | None = None) -> None:
        self._require()
        now = time.monotonic()
        for stream in self.broker._fanout.get(self.exchange_name(exchange), ()):
            stream.push("", body, now, ttl_s)

    async def publish_topic(self, exchange: str, routing_key: str, body: bytes) -> None:
        self._require()
        now = time.monotonic()
        for stream in self.broker._topic.get(self.exchange_name(exchange), ()):
            if topic_matches(stream.binding_key, routing_key):
                stream.push(routing_key, body, now, None)

    async def subscribe_fanout(
        self,
        exchange: str,
        handler: FanoutHandler,
        ttl_s: float | None = None,
        keep_as: str | None = None,
    ) -> Subscription:
        """``keep_as`` is accepted and changes nothing: the broker lives and dies with the
        one process all its subscribers run in."""

        async def call(_key: str, body: bytes) -> None:
            await handler(body)

        return self._subscribe(self.broker._fanout, exchange, "", ttl_s, call)

    async def subscribe_topic(
        self, exchange: str, binding_key: str, handler: TopicHandler
    ) -> Subscription:
        return self._subscribe(self.broker._topic, exchange, binding_key, None, handler)

    def _subscribe(
        self,
        registry: dict[str, list[_MemoryStream]],
        exchange: str,
        binding_key: str,
        ttl_s: float | None,
        call: TopicHandler,
    ) -> _MemoryStream:
        self._require()
        name = self.exchange_name(exchange)
        streams = registry.setdefault(name, [])
        stream = _MemoryStream(self, streams, binding_key, ttl_s, call, name)
        streams.append(stream)
        self._subscriptions.add(stream)
        return stream

    async def enqueue(self, queue: str, body: bytes) -> None:
        await self.enqueue_many(queue, [body])

    async def enqueue_many(self, queue: str, bodies: Sequence[bytes]) -> None:
        self._require()
        name = self.queue_name(queue)
        work_queue = self.broker.work_queue(name)
        work_queue.ready.extend(self._stored(name, bytes(body)) for body in bodies)
        work_queue.dispatch()

    def _stored(self, name: str, body: bytes) -> _Stored:
        if self.signing_key is None:
            return _Stored(body)
        return _Stored(body, headers=self._signature(name, body), message_id=uuid.uuid4().hex)

    async def consume(
        self, queue: str, handler: Callable[[Delivery], Awaitable[None]], prefetch: int = 1000
    ) -> Subscription:
        self._require()
        _check_prefetch(prefetch)
        name = self.queue_name(queue)
        work_queue = self.broker.work_queue(name)
        work_queue.single_active = work_queue.single_active or self.single_active
        consumer = _MemoryConsumer(self, work_queue, handler, prefetch, name)
        work_queue.consumers.append(consumer)
        self._subscriptions.add(consumer)
        work_queue.dispatch()
        return consumer

    async def delete_queue(self, queue: str) -> None:
        self._require()
        work_queue = self.broker._queues.pop(self.queue_name(queue), None)
        if work_queue is not None:
            # Like RabbitMQ, which cancels the consumers of a deleted queue.
            for consumer in list(work_queue.consumers):
                await consumer.cancel()
            work_queue.ready.clear()

    async def queue_depth(self, queue: str) -> int:
        self._require()
        work_queue = self.broker._queues.get(self.queue_name(queue))
        return 0 if work_queue is None else len(work_queue.ready)


class _MemoryStream:
    """A fan-out/topic subscriber's private queue, drained by one handler loop."""

    def __init__(
        self,
        bus: InMemoryBus,
        streams: list[_MemoryStream],
        binding_key: str,
        ttl_s: float | None,
        call: TopicHandler,
        name: str,
    ) -> None:
        self._bus = bus
        self._streams = streams
        self.binding_key = binding_key
        self._ttl_s = ttl_s
        self._call = call
        self._name = name
        self._inbox: deque[tuple[str, bytes, float | None]] = deque()
        self._wakeup = asyncio.Event()
        self._cancelled = False
        self._pump_task = asyncio.get_running_loop().create_task(self._pump(), name=f"bus:{name}")

    def push(self, routing_key: str, body: bytes, now: float, ttl_s: float | None) -> None:
        ttls = [t for t in (ttl_s, self._ttl_s) if t is not None]
        deadline = now + min(ttls) if ttls else None
        self._inbox.append((routing_key, body, deadline))
        self._wakeup.set()

    async def _pump(self) -> None:
        while not self._cancelled:
            if not self._inbox:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            routing_key, body, deadline = self._inbox.popleft()
            if deadline is not None and time.monotonic() > deadline:
                continue  # expired while waiting, as RabbitMQ's x-message-ttl drops it
            try:
                await self._call(routing_key, body)
            except Exception:
                log.exception("handler for %s failed; message dropped", self._name)

    async def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        self._bus._subscriptions.discard(self)
        with contextlib.suppress(ValueError):
            self._streams.remove(self)
        self._inbox.clear()
        self._wakeup.set()
        if self._pump_task is not asyncio.current_task():
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump_task


class _MemoryDelivery:
    __slots__ = ("_consumer", "_stored", "body", "headers", "message_id", "redelivered", "tag")

    def __init__(self, consumer: _MemoryConsumer, stored: _Stored, tag: int) -> None:
        self.tag = tag
        self._consumer = consumer
        self._stored = stored
        self.body = stored.body
        self.redelivered = stored.redelivered
        self.headers: Mapping[str, Any] = stored.headers or {}
        self.message_id = stored.message_id

    async def ack(self) -> None:
        self._consumer.settle(self, requeue=None)

    async def nack(self, requeue: bool = True) -> None:
        self._consumer.settle(self, requeue=requeue)


class _MemoryConsumer:
    def __init__(
        self,
        bus: InMemoryBus,
        queue: _MemoryWorkQueue,
        handler: Callable[[Delivery], Awaitable[None]],
        prefetch: int,
        name: str,
    ) -> None:
        self._bus = bus
        self._queue = queue
        self._handler = handler
        self._prefetch = prefetch
        self._name = name
        self._unacked: dict[int, _MemoryDelivery] = {}  # insertion order = delivery order
        self._tags = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._cancelled = False

    def has_room(self) -> bool:
        return len(self._unacked) < self._prefetch

    def deliver(self, stored: _Stored) -> None:
        delivery = _MemoryDelivery(self, stored, next(self._tags))
        self._unacked[delivery.tag] = delivery
        # A task, so the publisher never runs consumer code inline.
        task = asyncio.get_running_loop().create_task(self._run(delivery))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, delivery: _MemoryDelivery) -> None:
        try:
            await self._handler(delivery)
        except Exception:
            log.exception("handler for %s failed; message requeued", self._name)
            self.settle(delivery, requeue=True)

    def settle(self, delivery: _MemoryDelivery, requeue: bool | None) -> None:
        """``requeue=None`` acks; a delivery already settled or given back is ignored."""
        if self._unacked.pop(delivery.tag, None) is None:
            return
        if requeue:
            self._queue.give_back([delivery._stored])
        else:
            self._queue.dispatch()

    async def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        self._bus._subscriptions.discard(self)
        with contextlib.suppress(ValueError):
            self._queue.consumers.remove(self)
        current = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not current]
        for task in tasks:
            task.cancel()
        unacked = [delivery._stored for delivery in self._unacked.values()]
        self._unacked.clear()
        self._queue.give_back(unacked)
        await asyncio.gather(*tasks, return_exceptions=True)
