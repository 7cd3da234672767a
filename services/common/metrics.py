"""Prometheus metrics (``megha_`` prefix, base units, no task or job ids in labels)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

# 100 us .. ~100 s, x2 per bucket: allocation times span five orders of magnitude.
_SECONDS = tuple(0.0001 * 2**i for i in range(21))

ALLOCATION_SECONDS = Histogram(
    "megha_allocation_duration_seconds",
    "Time from submission to the task starting on a worker (paper eq. 1).",
    ["gm"],
    buckets=_SECONDS,
)
SCHEDULE_ATTEMPTS = Counter(
    "megha_schedule_attempts_total",
    "Placement attempts by the GM, by result.",
    ["gm", "result"],
)
QUEUE_PENDING = Gauge("megha_queue_pending_tasks", "Tasks waiting in a user queue.", ["queue"])
QUEUE_USAGE_SHARE = Gauge(
    "megha_queue_usage_share",
    "Dominant share of the federation a queue holds (tasks the LMs hold or accepted).",
    ["queue"],
)
QUEUE_HELD = Gauge(
    "megha_queue_held",
    "What a queue holds (tasks the LMs hold or accepted), per resource in its base unit "
    "(cpu_milli, memory_mb, disk_mb, net_mbps): a queue with a limit only.",
    ["queue", "resource"],
)
QUEUE_LIMIT = Gauge(
    "megha_queue_limit",
    "A queue's limit per resource it limits, in the same units as megha_queue_held.",
    ["queue", "resource"],
)
INCONSISTENCIES = Counter(
    "megha_inconsistencies_total",
    "GM requests an LM rejected because the GM's view was stale.",
    ["gm", "lm"],
)
REPARTITIONS = Counter("megha_repartitions_total", "Placements on another GM's nodes.", ["gm"])
SUBMISSIONS_REFUSED = Counter(
    "megha_submissions_refused_total",
    "Submissions a GM refused RESOURCE_EXHAUSTED: its intake was full (Admission).",
    ["gm"],
)
SUBMISSION_ANSWER_SECONDS = Histogram(
    "megha_submission_answer_seconds",
    "Time from a GM reading a submission it took on to its answer (the broker confirmed "
    "the job's message, or it failed); refusals are answered at once and not counted.",
    ["gm"],
    buckets=_SECONDS,
)
SCHEDULE_ROUND_SECONDS = Histogram(
    "megha_schedule_round_seconds",
    "How long a GM's scheduling round held its event loop (the round and handing its "
    "launches over); rounds that took no work are not counted.",
    ["gm"],
    buckets=_SECONDS,
)
SUBMISSION_READ_WAIT_SECONDS = Histogram(
    "megha_submission_read_wait_seconds",
    "How long a streamed submission waited in front of the GM's read (the client's stream, "
    "flow control), by the client's clock against the least delay seen on its stream.",
    ["gm"],
    buckets=_SECONDS,
)
WATCHES_CUT = Counter(
    "megha_watches_cut_total",
    "WatchJob streams a GM ended RESOURCE_EXHAUSTED because their client read too slowly "
    "(WATCH_BACKLOG events waiting); the client watches again.",
    ["gm"],
)
SUBMIT_STREAMS_PAUSED = Counter(
    "megha_submit_streams_paused_total",
    "Times a GM stopped reading a SubmitStream because its client left STREAM_ANSWERS_OWED "
    "answers unread; it reads on as the client reads.",
    ["gm"],
)
QUEUE_MESSAGES = Counter(
    "megha_queue_messages_total",
    "Messages a GM published to user queues for the jobs submitted to it (several jobs "
    "taken while the queue's publishes awaited their confirms go in one).",
    ["gm"],
)
QUEUE_MESSAGE_JOBS = Counter(
    "megha_queue_message_jobs_total",
    "Jobs those messages carried (over megha_queue_messages_total: jobs per message).",
    ["gm"],
)
BROKER_CONFIRM_SECONDS = Histogram(
    "megha_broker_confirm_seconds",
    "Time from publishing a durable message (a job, a task's return to its queue) to "
    "the broker's confirm.",
    buckets=_SECONDS,
)
SUBMISSION_LIMIT = Gauge(
    "megha_submission_limit",
    "How many submissions a GM takes on at once now (adapted, services/core/admission.py).",
    ["gm"],
)
PREEMPTION_ATTEMPTS = Counter(
    "megha_preemption_attempts_total", "Preempt requests sent to LMs.", ["gm"]
)
PREEMPTIONS = Counter("megha_preemptions_total", "Tasks preempted by an LM.", ["lm"])
HEARTBEATS_APPLIED = Counter(
    "megha_heartbeats_applied_total", "LM states a GM applied, by result.", ["gm", "result"]
)
HEARTBEAT_AGE_SECONDS = Histogram(
    "megha_heartbeat_age_seconds",
    "Age of an LM heartbeat when the GM applied it.",
    ["gm"],
    buckets=_SECONDS,
)
LM_PLACEMENTS = Counter(
    "megha_lm_placements_total",
    "GM requests an LM decided, by kind and status.",
    ["lm", "kind", "status"],
)
WORKERS = Gauge("megha_workers", "Worker nodes registered with an LM, by health.", ["lm", "health"])
TASKS_FINISHED = Counter(
    "megha_tasks_finished_total", "Tasks ended, by final state.", ["lm", "state"]
)
EVENTS_RECOVERED = Counter(
    "megha_events_recovered_total",
    "Task ends a GM never heard of on the broker and learnt from the LM instead.",
    ["gm"],
)
SUBSCRIPTIONS_RENEWED = Counter(
    "megha_bus_subscriptions_renewed",
    "Times a subscription consumed again (it got no delivery while its queue held ready "
    "messages, SILENT_CHECK_S) or was made again on a new channel (after a reconnection, "
    "or its channel stayed closed) (services.common.bus).",
    ["queue"],
)
UNAUTHENTICATED_MESSAGES = Counter(
    "megha_gm_unauthenticated_messages",
    "Messages a GM dropped from a user queue it serves because they carried no valid "
    "signature (broker.queue_signing_key).",
    ["gm", "queue"],
)
TASKS_CANCELLED = Counter(
    "megha_tasks_cancelled_total",
    "Queued tasks of cancelled jobs a GM dropped (LMs count the running ones they killed "
    "as megha_tasks_finished_total{state=cancelled}).",
    ["gm"],
)
TASKS_ADOPTED = Counter(
    "megha_tasks_adopted_total",
    "Tasks an LM booked again from its workers' word after it restarted.",
    ["lm"],
)


def children(metric: Any, *fixed: str) -> Callable[..., Any]:
    """``metric.labels(*fixed, *rest)`` for a hot path, each child looked up once:
    ``labels`` checks its arguments and takes a lock on every call (about 3 us, 5 % of
    an LM's CPU at 2,700 tasks/s when called per task). Only for metrics whose children
    are never removed."""
    cache: dict[tuple[str, ...], Any] = {}

    def child(*rest: str) -> Any:
        found = cache.get(rest)
        if found is None:
            found = cache[rest] = metric.labels(*fixed, *rest)
        return found

    return child
