"""RabbitMQ as the federation uses it (``services/common/bus.py``), with its failures.

enqueue(queue, body) ──stored (durable, survives a restart)──▶ confirm (True) or False
    (down; or the broker went down before confirming: stored or not, the publisher
    cannot tell)
consume(queue, gm): single active consumer, registration order; deliveries unacked
    until ``ack``; a consumer that goes (crash) or a broker restart puts them back
    at the head, ``redelivered``
fanout(kind, body): to every subscriber of ``kind`` alive now; lost if the broker
    restarts before it is delivered (exclusive queues die with it)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loadgen.chaos.kernel import Actor, Future, Kernel
from loadgen.chaos.net import Net


@dataclass(eq=False, slots=True)
class Delivery:
    tag: int
    body: Any
    redelivered: bool
    broker_life: int


@dataclass(eq=False, slots=True)
class _Consumer:
    actor: Actor
    life: int
    handler: Callable[[Delivery], None]
    ack: Callable[[Delivery], None] | None = None


class Broker(Actor):
    def __init__(self, kernel: Kernel, net: Net) -> None:
        super().__init__(kernel, "broker")
        self.net = net
        self.ready: dict[str, deque[tuple[Any, bool]]] = {}
        self.consumers: dict[str, list[_Consumer]] = {}
        self.unacked: dict[int, tuple[str, Any, _Consumer]] = {}
        self.subscribers: dict[str, list[tuple[Actor, Callable[[Any], None]]]] = {}
        self._tags = 0
        self.slow = True  # its messages may take the weather's slow path
        self.stored = 0  # messages ever stored

    # ------------------------------------------------------------ work queues
    def enqueue(self, queue: str, body: Any) -> Future:
        confirm = Future()
        if not self.alive:
            self.k.after(self.net.delay(self.slow), confirm.set, False)
            return confirm
        life = self.life
        self.k.after(self.net.delay(self.slow), self._store, life, queue, body, confirm)
        return confirm

    def _store(self, life: int, queue: str, body: Any, confirm: Future) -> None:
        if life != self.life or not self.alive:
            confirm.set(False)  # the connection died with the broker: not stored
            return
        self.ready.setdefault(queue, deque()).append((body, False))
        self.stored += 1
        self._dispatch(queue)
        self.k.after(self.net.delay(self.slow), self._confirm, life, confirm)

    def _confirm(self, life: int, confirm: Future) -> None:
        # Stored, but a restart before the confirm leaves the publisher in doubt.
        confirm.set(life == self.life and self.alive)

    def consume(self, queue: str, actor: Actor, handler: Callable[[Delivery], None]) -> None:
        self.consumers.setdefault(queue, []).append(_Consumer(actor, actor.life, handler))
        self._dispatch(queue)

    def ack(self, delivery: Delivery) -> None:
        self.k.after(self.net.delay(self.slow), self._ack, delivery)

    def _ack(self, delivery: Delivery) -> None:
        if delivery.broker_life == self.life and self.alive:
            self.unacked.pop(delivery.tag, None)

    def consumer_gone(self, actor: Actor) -> None:
        """``actor`` died: its consumers go, their unacked deliveries back to the head."""
        for queue, consumers in self.consumers.items():
            consumers[:] = [c for c in consumers if c.actor is not actor]
            tags = [t for t, (q, _, c) in self.unacked.items() if q == queue and c.actor is actor]
            self._requeue(queue, tags)
        for queue in list(self.consumers):
            self._dispatch(queue)

    def _requeue(self, queue: str, tags: list[int]) -> None:
        back = []
        for tag in sorted(tags):
            q, body, _ = self.unacked.pop(tag)
            assert q == queue
            back.append((body, True))
        self.ready.setdefault(queue, deque()).extendleft(reversed(back))

    def _dispatch(self, queue: str) -> None:
        if not self.alive:
            return
        consumers = [
            c for c in self.consumers.get(queue, ()) if c.actor.alive and c.actor.life == c.life
        ]
        ready = self.ready.get(queue)
        if not consumers or not ready:
            return
        active = consumers[0]
        while ready:
            body, redelivered = ready.popleft()
            self._tags += 1
            self.unacked[self._tags] = (queue, body, active)
            delivery = Delivery(self._tags, body, redelivered, self.life)
            self.k.after(
                self.net.delay(self.slow), active.actor.gate, active.life, active.handler, delivery
            )

    # ----------------------------------------------------------------- fanout
    def subscribe(self, kind: str, actor: Actor, handler: Callable[[Any], None]) -> None:
        subs = self.subscribers.setdefault(kind, [])
        subs[:] = [(a, h) for a, h in subs if a is not actor]
        subs.append((actor, handler))

    def fanout(self, kind: str, body: Any) -> bool:
        if not self.alive:
            return False
        life = self.life
        for actor, handler in self.subscribers.get(kind, ()):
            if actor.alive:
                self.k.after(
                    self.net.delay(self.slow), self._fan, life, actor, actor.life, handler, body
                )
        return True

    def _fan(self, life: int, actor: Actor, actor_life: int, handler, body) -> None:
        if life == self.life and self.alive:
            actor.gate(actor_life, handler, body)

    # --------------------------------------------------------------- restarts
    def restart_down(self) -> None:
        """The broker goes down: unacked deliveries go back (durable queues keep them)."""
        self.crash()
        by_queue: dict[str, list[int]] = {}
        for tag, (queue, _, _) in self.unacked.items():
            by_queue.setdefault(queue, []).append(tag)
        for queue, tags in by_queue.items():
            self._requeue(queue, tags)

    def restart_up(self) -> None:
        self.alive = True
        self.k.log(self.name, "UP")
        for queue in list(self.consumers):
            self._dispatch(queue)
