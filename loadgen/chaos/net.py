"""Messages between processes, as one seed's weather makes them: delays (milliseconds,
with a heavy tail up to tens of seconds), drops, duplicates, and the reorderings that
independent delays give.

    Net.rpc(src, dst, handler, args, timeout) ──request (maybe dropped or late)──▶ dst
        ◀──answer (maybe dropped)── handler's value (a generator: its return value)
        the caller's Future: the first answer, or None at the timeout / a refused connect
    lanes: what one (from, to, lane) carries arrives in order; lanes overtake each other
    Stream: a worker's heartbeat stream, on its connection to the LM; a break (``cut``)
        loses what is on the wire; commands the LM has not written yet stay

An RPC to a process that is down fails at once (connection refused); one that is read by
a process that restarted meanwhile is lost (its connection died with the process). gRPC
never delivers a request twice; a request is "duplicated" in the only way it can be: its
call broke after it was written, the caller gave up (and may send it again, fenced), and
the callee reads it late.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loadgen.chaos.kernel import Actor, Future, Kernel, Proc


@dataclass(frozen=True)
class Weather:
    """One seed's message faults."""

    base_s: float = 0.002  # median one-way delay
    slow_p: float = 0.0  # chance a message takes the slow path
    slow_max_s: float = 0.0  # the slow path: log-uniform in [0.2 s, this]
    drop_p: float = 0.0  # GM <-> LM requests and answers
    broken_p: float = 0.0  # a call breaks: the caller sees an error, the request lands

    @staticmethod
    def draw(k: Kernel, calm: bool = False) -> Weather:
        if calm:
            return Weather()
        slow_max = k.log_uniform(0.5, 40.0)
        return Weather(
            base_s=k.log_uniform(0.0005, 0.02),
            slow_p=k.uniform(0.0, 0.05),
            slow_max_s=slow_max,
            drop_p=k.uniform(0.0, 0.05),
            broken_p=k.uniform(0.0, 0.05),
        )


class Net:
    def __init__(self, kernel: Kernel, weather: Weather) -> None:
        self.k = kernel
        self.w = weather
        self.calm = False  # after the fault window: delays stay, faults stop
        # Per (from, to, lane): when the lane is free. What one lane carries arrives in
        # order (a slow message holds up those behind it); lanes overtake each other: a
        # method's calls (an HTTP/2 stream, a handler of its own) against another's.
        self._free_at: dict[tuple[str, str, str], float] = {}

    def arrival(
        self, src: str, dst: str, lane: str, slow: bool = True, extra: float = 0.0
    ) -> float:
        """How long from now a message ``src`` sends ``dst`` on ``lane`` takes."""
        now = self.k.now
        key = (src, dst, lane)
        at = max(self._free_at.get(key, 0.0), now + self.delay(slow) + extra)
        self._free_at[key] = at
        return at - now

    def delay(self, slow: bool = True) -> float:
        k, w = self.k, self.w
        if slow and not self.calm and k.chance(w.slow_p):
            return k.log_uniform(0.2, max(0.21, w.slow_max_s))
        return w.base_s * float(k.rng.lognormal(0.0, 0.6))

    def lossy(self) -> bool:
        return not self.calm and self.k.chance(self.w.drop_p)

    # -------------------------------------------------------------------- RPCs
    def rpc(
        self,
        src: Actor,
        dst: Actor,
        handler: Callable[..., Any],
        args: tuple[Any, ...],
        timeout: float,
        faults: bool = True,
        lane: str = "",
    ) -> Future:
        """Call ``handler(*args)`` on ``dst``; the answer, or None (no answer in time).
        Calls on one ``lane`` (default: the handler's) arrive in order."""
        k = self.k
        answer = Future()
        k.after(timeout, answer.set, None)
        if not dst.alive:
            k.after(min(timeout, self.delay()), answer.set, None)
            return answer
        life = dst.life
        if faults and self.lossy():
            return answer  # the request is lost: the caller times out
        extra = 0.0
        if faults and not self.calm and k.chance(self.w.broken_p):
            # The caller gives up at once (its call broke, or it was cancelled) and the
            # request is read anyway, maybe much later (the connection stalled).
            k.after(0.001, answer.set, None)
            extra = k.log_uniform(0.01, 30.0)
        lane = lane or handler.__name__
        delay = self.arrival(src.name, dst.name, lane, extra=extra)
        route = (dst.name, src.name, lane)
        k.after(delay, dst.gate, life, self._serve, dst, handler, args, answer, faults, route)
        return answer

    def _serve(
        self,
        dst: Actor,
        handler: Callable[..., Any],
        args: tuple,
        answer: Future,
        faults: bool,
        route: tuple[str, str, str],
    ) -> None:
        value = handler(*args)
        if inspect.isgenerator(value):
            dst.spawn(self._finish(value, answer, faults, route))
        else:
            self._answer(answer, value, faults, route)

    def _finish(
        self, proc: Proc, answer: Future, faults: bool, route: tuple[str, str, str]
    ) -> Proc:
        value = yield from proc
        self._answer(answer, value, faults, route)

    def _answer(
        self, answer: Future, value: Any, faults: bool, route: tuple[str, str, str]
    ) -> None:
        if answer.done or (faults and self.lossy()):
            return
        self.k.after(self.arrival(*route), answer.set, value)

    # ------------------------------------------------------------ one-way sends
    def send(self, dst: Actor, fn: Callable[..., None], *args: Any) -> None:
        """A message ``dst`` reads after a delay, if the life it was sent to still runs."""
        self.k.after(self.delay(), dst.gate, dst.life, fn, *args)


class Stream:
    """A worker's heartbeat stream to its LM: ordered each way; ``cut`` breaks it."""

    def __init__(self, net: Net, worker: str, lm: str) -> None:
        self.net = net
        self.id = 0  # the stream open now (0: none yet)
        self.slow = True  # its messages may take the weather's slow path
        self._routes = {True: (worker, lm, "stream"), False: (lm, worker, "stream")}

    def open(self) -> int:
        self.id += 1
        return self.id

    def cut(self) -> None:
        self.id += 1

    def carry(self, to_lm: bool, stream: int, dst: Actor, fn: Callable[..., None], *args) -> None:
        """Send on ``stream`` (dropped if it is broken by the time it arrives)."""
        delay = self.net.arrival(*self._routes[to_lm], slow=self.slow)
        self.net.k.after(delay, self._arrive, stream, dst, dst.life, fn, args)

    def _arrive(self, stream: int, dst: Actor, life: int, fn, args) -> None:
        if stream == self.id:
            dst.gate(life, fn, *args)
