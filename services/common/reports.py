"""The federation as plain data: what ``megha status/jobs/job --json`` print and what
the console (``services/console``) shows, built once from the GM's answers.

    GM GetClusterView ──+ each queue's pending, from the GM serving it──▶ status_record
    GM ListJobs ──▶ job_summary_record       GM GetJob ──▶ job_record (task_record each)
    GM PlanJob ──▶ plan_record

Records are dicts of JSON types with stable keys (scripts read them): states are lower
case names (``succeeded``), resources are in base units (``cpu_milli``, ``memory_mb``,
...), durations in seconds. Keys may be added, none removed or renamed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc

from services._proto.megha.v1 import common_pb2, global_master_pb2
from services.common.client import STATE_NAMES, GlobalMasterClient
from services.common.config import ConfigError, FederationConfig

Record = dict[str, Any]

# How long ``megha status`` waits for the other GMs' counts of their queues' waiting
# tasks (asked all at once): a GM that is down or frozen shows ``?`` after about this
# long, not after a full call deadline of its own, one GM after the other.
PEER_STATUS_TIMEOUT_S = 1.5

PLAN_OUTCOMES = {
    v.number: v.name.removeprefix("PLAN_OUTCOME_").lower()
    for v in global_master_pb2.PlanOutcome.DESCRIPTOR.values
}


def resources_record(r: common_pb2.Resources) -> Record:
    return {
        "cpu_milli": r.cpu_milli,
        "memory_mb": r.memory_mb,
        "disk_mb": r.disk_mb,
        "net_mbps": r.net_mbps,
    }


def state_name(state: int) -> str:
    return STATE_NAMES.get(state, "?")


# ---------------------------------------------------------------------------- status
async def peer_view(target: str) -> global_master_pb2.GetClusterViewResponse | None:
    """The cluster view of the GM at ``target``; None if it does not answer in time."""
    try:
        async with GlobalMasterClient(target) as other:
            return await other.cluster(timeout_s=PEER_STATUS_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return None


async def pending_by_serving_gm(
    view: global_master_pb2.GetClusterViewResponse, config: FederationConfig, asked: str
) -> dict[str, int | None]:
    """Each queue's waiting tasks as the GM that serves it counts them (only that GM
    holds them; the GM asked shows 0 for the others' queues); None: it did not answer."""
    return {
        queue: served.pending for queue, served in (await served_by(view, config, asked)).items()
    }


@dataclass(frozen=True, slots=True)
class Served:
    """Who serves a queue now and the tasks it holds waiting (None: unknown, the GM did
    not answer or, with queue failover, no GM that answered says it serves the queue)."""

    gm_id: str | None
    pending: int | None


async def served_by(
    view: global_master_pb2.GetClusterViewResponse, config: FederationConfig, asked: str
) -> dict[str, Served]:
    """Each queue's serving GM and its waiting tasks. Without queue failover a queue's GM
    is the one it names; with it, the GM that says it serves it (``served_here``: the
    broker's single active consumer), so every GM is asked."""
    targets = {gm.target: gm.id for gm in config.gms}
    asked_id = targets.get(asked, "")
    if config.queue_failover:
        others = sorted(set(targets) - {asked})
        peers = await asyncio.gather(*map(peer_view, others))
        views = [(asked_id, view), *((targets[t], v) for t, v in zip(others, peers, strict=True))]
        found: dict[str, Served] = {q.queue: Served(None, None) for q in view.queues}
        for gm_id, seen in views:
            for q in seen.queues if seen is not None else ():
                if q.served_here and q.queue in found:
                    found[q.queue] = Served(gm_id, q.pending_tasks)
        return found
    serving: dict[str, str] = {}  # queue -> the target of the GM that serves it
    for q in view.queues:
        try:
            serving[q.queue] = config.gm(q.gm_id).target
        except ConfigError:
            serving[q.queue] = asked
    others = sorted(set(serving.values()) - {asked})
    views = dict(zip(others, await asyncio.gather(*map(peer_view, others)), strict=True))
    result: dict[str, Served] = {}
    for q in view.queues:
        if serving[q.queue] == asked:
            result[q.queue] = Served(q.gm_id, q.pending_tasks)
            continue
        other_view = views[serving[q.queue]]
        rows = [r for r in other_view.queues if r.queue == q.queue] if other_view else []
        result[q.queue] = Served(q.gm_id, rows[0].pending_tasks if rows else None)
    return result


def status_record(
    view: global_master_pb2.GetClusterViewResponse,
    pending: dict[str, int | None] | dict[str, Served],
    config: FederationConfig,
    gm_target: str,
) -> Record:
    """``megha status --json``: the LMs and their partitions as the GM asked sees them
    (a silent LM's are what it last said), the LMs it never heard from, the queues, and
    the GM's recent allocation times."""
    lms = [
        {
            "lm_id": lm.lm_id,
            "version": lm.version,
            "age_s": round(lm.age_s, 3),
            "silent": lm.silent,
            "partitions": [
                {
                    "gm_id": p.gm_id,
                    "nodes": p.node_count,
                    "free": resources_record(p.free),
                }
                for p in lm.partitions
            ],
        }
        for lm in view.lms
    ]
    queues = []
    for q in view.queues:
        known = pending.get(q.queue, q.pending_tasks)
        served = known if isinstance(known, Served) else Served(q.gm_id, known)
        row: Record = {
            "queue": q.queue,
            "gm_id": q.gm_id,
            "served_by": served.gm_id,
            "share": q.share,
            "usage_share": q.usage_share,
            "pending_tasks": served.pending,
            "running_tasks": q.running_tasks,
            "preempted_tasks": q.preempted_tasks,
            "limit": resources_record(q.limit) if q.HasField("limit") else None,
            "held": resources_record(q.held) if q.HasField("held") else None,
        }
        queues.append(row)
    times = view.recent_allocation_times
    return {
        "gm": gm_target,
        "lms": lms,
        "lms_not_heard_from": sorted({lm.id for lm in config.lms} - {lm.lm_id for lm in view.lms}),
        "queues": queues,
        "allocation_s": {
            "count": times.count,
            "p50": times.p50_s,
            "p90": times.p90_s,
            "p99": times.p99_s,
        },
    }


# ------------------------------------------------------------------------------ jobs
def state_counts(states) -> dict[str, int]:
    """``JobSummary.states`` as {state name: tasks}, most first."""
    counts = Counter({state_name(c.state): c.tasks for c in states})
    return dict(counts.most_common())


def job_summary_record(job: global_master_pb2.JobSummary) -> Record:
    return {
        "job_id": job.job_id,
        "queue": job.queue,
        "tasks": job.tasks,
        "states": state_counts(job.states),
    }


def allocation_s(t: common_pb2.TaskTimestamps) -> float | None:
    """Submission to the start on a worker (paper eq. 1); None until it started."""
    if not (t.started_unix_nanos and t.submitted_unix_nanos):
        return None
    return (t.started_unix_nanos - t.submitted_unix_nanos) / 1e9


def task_record(task: global_master_pb2.TaskStatus) -> Record:
    record: Record = {
        "task_id": task.task_id,
        "state": state_name(task.state),
        "attempt": task.attempt,
        "lm_id": task.lm_id,
        "node_id": task.node_id,
        "pending_reason": task.pending_reason,
        "allocation_s": allocation_s(task.timestamps),
        "submitted_unix_nanos": task.timestamps.submitted_unix_nanos,
        "started_unix_nanos": task.timestamps.started_unix_nanos,
        "finished_unix_nanos": task.timestamps.finished_unix_nanos,
        "peak_memory_mb": task.peak_memory_mb,
        "previous_end": None,
    }
    if task.HasField("previous_end"):
        end = task.previous_end
        record["previous_end"] = {
            "attempt": end.attempt,
            "state": state_name(end.state),
            "reason": end.reason,
        }
    return record


def job_record(job: global_master_pb2.Job) -> Record:
    """``megha job --json``: the job, its counts by state, and every task."""
    counts = Counter(state_name(t.state) for t in job.tasks)
    return {
        "job_id": job.job_id,
        "queue": job.queue,
        "tasks": len(job.tasks),
        "states": dict(counts.most_common()),
        "task_list": [task_record(t) for t in job.tasks],
    }


# ---------------------------------------------------------------------------- dry run
def plan_record(plan: global_master_pb2.PlanJobResponse) -> Record:
    """``megha submit --dry-run --json``: where each task would go, or why not."""
    return {
        "gm_id": plan.gm_id,
        "queue": plan.queue,
        "served_here": plan.served_here,
        "tasks": [
            {
                "index": t.index,
                "outcome": PLAN_OUTCOMES.get(t.outcome, "?"),
                "lm_id": t.lm_id,
                "node_id": t.node_id,
                "repartition": t.repartition,
                "reason": t.reason,
            }
            for t in plan.tasks
        ],
    }
