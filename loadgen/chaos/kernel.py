"""The simulation's clock, its one random generator, and processes that can crash or pause.

    Engine (virtual ns) ──▶ Actor.gate(life, fn) ──crashed since? dropped
                                                 ──paused? kept, run in order on resume
                                                 ──else fn(*args)
    Actor.spawn(generator) ──yield Future──▶ resumed through the gate when it is set

A driver's ``async def`` becomes a generator that yields ``Future``s (a sleep, an RPC's
answer, a broker confirm): the live code's await points are the simulation's, so what may
interleave there is what may interleave live. Everything random comes from
``Kernel.rng``, one ``numpy.random.Generator`` seeded once: a seed replays exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from loadgen.sim.engine import Engine

NS = 1_000_000_000


class Future:
    """A value some event sets once; callbacks run when it is set."""

    __slots__ = ("callbacks", "done", "value")

    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self.callbacks: list[Callable[[Any], None]] = []

    def set(self, value: Any = None) -> None:
        if self.done:
            return
        self.done, self.value = True, value
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback(value)

    def on(self, callback: Callable[[Any], None]) -> None:
        if self.done:
            callback(self.value)
        else:
            self.callbacks.append(callback)


Proc = Generator[Future, Any, Any]


class Kernel:
    """The engine, the random generator and the trace of one run."""

    def __init__(self, seed: int, trace: bool = False) -> None:
        self.engine = Engine()
        self.rng = np.random.default_rng(seed)
        self.tracing = trace
        self.trace: list[str] = []
        self.procs: set[Proc] = set()  # generators not finished (``close`` ends them)

    def close(self) -> None:
        """End the generators a run left suspended (crashed lives', timers' waits) now,
        not in the garbage collector, which may meet one while closing another."""
        self.engine._heap.clear()
        procs, self.procs = self.procs, set()
        for proc in procs:
            proc.close()

    @property
    def now(self) -> float:
        return self.engine.now / NS

    def after(self, seconds: float, fn: Callable[..., None], *args: Any) -> None:
        self.engine.at(self.engine.now + max(0, math.ceil(seconds * NS)), fn, *args)

    def sleep(self, seconds: float) -> Future:
        future = Future()
        self.after(seconds, future.set, None)
        return future

    def log(self, who: str, what: str) -> None:
        if self.tracing:
            self.trace.append(f"{self.now:10.4f} {who:8} {what}")

    # Draws, named so that a reader sees what each is for.
    def chance(self, p: float) -> bool:
        return p > 0 and self.rng.random() < p

    def uniform(self, low: float, high: float) -> float:
        return float(self.rng.uniform(low, high))

    def log_uniform(self, low: float, high: float) -> float:
        return float(np.exp(self.rng.uniform(np.log(low), np.log(high))))


class Actor:
    """A process: ``life`` counts its starts; what was scheduled for an earlier life (a
    timer, an RPC's answer, a generator's next step) is dropped when it comes."""

    def __init__(self, kernel: Kernel, name: str) -> None:
        self.k = kernel
        self.name = name
        self.life = 0
        self.alive = True
        self.paused = False
        self._backlog: list[tuple[Callable[..., None], tuple[Any, ...]]] = []

    def gate(self, life: int, fn: Callable[..., None], *args: Any) -> None:
        if life != self.life or not self.alive:
            return
        if self.paused:
            self._backlog.append((fn, args))
            return
        fn(*args)

    def later(self, seconds: float, fn: Callable[..., None], *args: Any) -> None:
        self.k.after(seconds, self.gate, self.life, fn, *args)

    def spawn(self, proc: Proc) -> None:
        self.k.procs.add(proc)
        self._step(self.life, proc, None)

    def _step(self, life: int, proc: Proc, value: Any) -> None:
        try:
            future = proc.send(value)
        except StopIteration:
            self.k.procs.discard(proc)
            return
        # Resumed from the engine, never from inside whatever set the future: a generator
        # that sets a future another waits on must not be re-entered by that other.
        future.on(lambda v: self.k.after(0.0, self.gate, life, self._step, life, proc, v))

    def crash(self) -> None:
        self.alive = False
        self.paused = False
        self._backlog.clear()
        self.life += 1
        self.k.log(self.name, "CRASH")

    def pause(self) -> None:
        self.paused = True
        self.k.log(self.name, "PAUSE")

    def resume(self) -> None:
        self.k.log(self.name, f"RESUME ({len(self._backlog)} waiting)")
        self.paused = False
        backlog, self._backlog = self._backlog, []
        life = self.life
        for fn, args in backlog:
            if self.paused or life != self.life or not self.alive:
                break
            fn(*args)
