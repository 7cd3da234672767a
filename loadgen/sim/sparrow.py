"""Sparrow (Ousterhout et al., SOSP'13) in virtual time: batch sampling with late binding.

    job arrival ──▶ probe_ratio x tasks reservations on distinct random workers ──delay──▶
    worker FIFO of reservations ──slot free, reservation at head──▶ getTask ──delay──▶
    scheduler: next unlaunched task of the job, or a no-op ──delay──▶ worker runs it / frees
    the slot and takes the next reservation

Modelled as the public Sparrow simulator does: no constraints, no cancellation messages
(a surplus reservation costs the worker one round trip), no scheduler processing time.
A job with more probes than workers probes every worker, then again, in random order.

Stamps, in eq. 2 terms: the probe is the scheduler → worker hop (communication); the
reservation then sits in the worker's queue until its task starts (worker queuing, which
includes the late-binding round trip). Sparrow has no LM, so lm_* equal the probe arrival.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from loadgen.sim.config import SimConfig, ns
from loadgen.sim.engine import Engine
from loadgen.sim.workload import TaskLog, Workload


class SparrowSim:
    def __init__(
        self, config: SimConfig, workload: Workload, engine: Engine, rng: np.random.Generator
    ):
        self.config = config
        self.workload = workload
        self.engine = engine
        self.rng = rng
        self.log = TaskLog(workload.tasks)
        self.delay = ns(config.network_delay_s)
        self.free_slots = [config.cores_per_worker] * config.workers
        self.reservations: list[deque[tuple[int, int]]] = [deque() for _ in range(config.workers)]
        self.next_task = workload.first[:-1].copy()  # per job: first task not yet launched
        self.remaining = workload.tasks
        self.probes = 0
        self.noops = 0
        self.late_binding_rtts = 0

    def start(self) -> None:
        for job in range(self.workload.jobs):
            self.engine.at(int(self.workload.arrival_ns[job]), self._arrive, job)

    def _arrive(self, job: int) -> None:
        now = self.engine.now
        lo, hi = int(self.workload.first[job]), int(self.workload.first[job + 1])
        for name in ("submitted", "queued", "dequeued", "decided"):
            self.log.stamps[name][lo:hi] = now
        count = math.ceil(self.config.probe_ratio * (hi - lo))
        self.probes += count
        self.engine.at(now + self.delay, self._probes_arrive, job, self._sample(count))

    def _sample(self, count: int) -> np.ndarray:
        """``count`` workers, all distinct while there are enough of them."""
        workers = self.config.workers
        if count <= workers:
            return self.rng.choice(workers, size=count, replace=False)
        rounds = [self.rng.permutation(workers) for _ in range(count // workers)]
        rounds.append(self.rng.choice(workers, size=count % workers, replace=False))
        return np.concatenate(rounds)

    def _probes_arrive(self, job: int, workers: np.ndarray) -> None:
        now = self.engine.now
        for worker in workers.tolist():
            self.reservations[worker].append((job, now))
            if self.free_slots[worker]:
                self._next_reservation(worker)

    def _next_reservation(self, worker: int) -> None:
        queue = self.reservations[worker]
        while self.free_slots[worker] and queue:
            job, probed = queue.popleft()
            self.free_slots[worker] -= 1  # held for the getTask round trip
            self.late_binding_rtts += 1
            self.engine.at(self.engine.now + self.delay, self._get_task, worker, job, probed)

    def _get_task(self, worker: int, job: int, probed: int) -> None:
        """At the scheduler: late binding hands out the job's next task, if any is left."""
        now = self.engine.now
        task = int(self.next_task[job])
        if task >= self.workload.first[job + 1]:
            self.noops += 1
            self.engine.at(now + self.delay, self._slot_free, worker)
            return
        self.next_task[job] = task + 1
        stamps = self.log.stamps
        stamps["lm_received"][task] = probed
        stamps["lm_decided"][task] = probed
        stamps["worker_received"][task] = probed
        started = now + self.delay
        stamps["started"][task] = started
        self.log.node[task] = worker
        finish = started + int(self.workload.duration_ns[task])
        self.engine.at(finish, self._finished, worker, task)

    def _slot_free(self, worker: int) -> None:
        self.free_slots[worker] += 1
        self._next_reservation(worker)

    def _finished(self, worker: int, task: int) -> None:
        self.log.stamps["finished"][task] = self.engine.now
        self.remaining -= 1
        if self.remaining == 0:
            self.engine.stop()
            return
        self._slot_free(worker)
