"""Replay a trace against a live federation: submit at the trace's arrival times, follow
every job's events, and report allocation times (paper eq. 1: submission to start)."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from loadgen.trace import ReadStats, read_tr
from services._proto.megha.v1 import common_pb2
from services.client import GlobalMasterClient
from services.common.convert import resources_to_proto
from services.core.resources import resources

TERMINAL = {common_pb2.TASK_STATE_SUCCEEDED, common_pb2.TASK_STATE_FAILED}


@dataclass
class ReplayReport:
    jobs: int = 0
    tasks: int = 0
    completed: int = 0
    failed: int = 0
    wall_s: float = 0.0
    allocation_s: list[float] = field(default_factory=list)
    skipped_lines: int = 0

    def percentiles(self) -> dict[str, float]:
        if not self.allocation_s:
            return {}
        values = np.array(self.allocation_s)
        keys = {"p50": 50, "p90": 90, "p99": 99, "p999": 99.9}
        out = {k: float(np.percentile(values, q)) for k, q in keys.items()}
        out["max"] = float(values.max())
        return out

    def render(self) -> str:
        p = self.percentiles()
        lines = [
            f"replayed {self.jobs} jobs, {self.tasks} tasks in {self.wall_s:.1f} s: "
            f"{self.completed} completed, {self.failed} failed"
            + (
                f", {self.skipped_lines} malformed trace lines skipped"
                if self.skipped_lines
                else ""
            ),
        ]
        if p:
            lines.append(
                "allocation time: " + "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in p.items())
            )
        return "\n".join(lines)


async def replay_trace(
    path: str,
    gms: list[str],
    speedup: float = 1.0,
    max_jobs: int | None = None,
    queues: list[str] | None = None,
    cpu_milli: int = 1000,
    memory_mb: int = 128,
    timeout_s: float | None = None,
) -> ReplayReport:
    """``speedup`` compresses arrival times and task durations alike."""
    stats = ReadStats()
    jobs = list(read_tr(path, max_jobs=max_jobs, stats=stats))
    report = ReplayReport(jobs=len(jobs), skipped_lines=stats.skipped)
    clients = [GlobalMasterClient(t) for t in gms]
    queue_cycle = itertools.cycle(queues or [""])
    client_cycle = itertools.cycle(clients)
    request = resources_to_proto(resources(cpu_milli, memory_mb))
    start = time.monotonic()
    watchers = []
    span = max((j.arrival_s for j in jobs), default=0.0) / speedup
    longest = max((max(j.durations_s) for j in jobs), default=0.0) / speedup
    deadline = timeout_s or 60 + 3 * (span + longest)
    try:
        first_arrival = jobs[0].arrival_s if jobs else 0.0
        for job in jobs:
            delay = (job.arrival_s - first_arrival) / speedup - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks = []
            for t in job.tasks:
                d = t.duration_s / speedup
                task = common_pb2.Task(resources=request, expected_duration_s=d)
                task.constraints.extend(t.constraints)
                task.sim.duration_s = d
                tasks.append(task)
            client = next(client_cycle)
            reply = await client.submit(tasks, queue=next(queue_cycle))
            report.tasks += len(tasks)
            watchers.append(asyncio.create_task(_follow(client, reply.job_id, report)))
        await asyncio.wait_for(asyncio.gather(*watchers), timeout=deadline)
    finally:
        for w in watchers:
            w.cancel()
        for client in clients:
            await client.close()
    report.wall_s = time.monotonic() - start
    return report


async def _follow(client: GlobalMasterClient, job_id: str, report: ReplayReport) -> None:
    started: set[str] = set()
    async for event in client.watch(job_id):
        stamps = event.timestamps
        if event.task_id not in started and stamps.started_unix_nanos:
            started.add(event.task_id)
            report.allocation_s.append(
                (stamps.started_unix_nanos - stamps.submitted_unix_nanos) / 1e9
            )
        if event.state == common_pb2.TASK_STATE_SUCCEEDED:
            report.completed += 1
        elif event.state == common_pb2.TASK_STATE_FAILED:
            report.failed += 1
