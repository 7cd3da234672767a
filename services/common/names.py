"""The names both ends of the bus agree on: exchanges, work queues, routing keys.

    LM ──HEARTBEAT_EXCHANGE (fanout)──▶ every GM and LM
    LM, GM ──EVENT_EXCHANGE (topic ``task.<process id>``)──▶ GMs, clients, load generator
    GM ──CANCEL_EXCHANGE (fanout)──▶ each GM's and LM's ``cancel_queue``
    GM ──BACKLOG_EXCHANGE (fanout)──▶ every GM (contention ``claims: oldest``)
    GM, LM ──▶ ``user_queue(queue)`` (durable work queue) ──▶ the queue's serving GM

Names without the bus prefix: ``Bus.exchange_name`` / ``Bus.queue_name`` add it.
"""

from __future__ import annotations

HEARTBEAT_EXCHANGE = "heartbeats"
EVENT_EXCHANGE = "events"
CANCEL_EXCHANGE = "cancels"  # JobCancel, from the GM that took a CancelJob
BACKLOG_EXCHANGE = "backlogs"  # GmBacklog, each GM's oldest waiting work
EVERY_TASK_EVENT = "task.#"  # the binding key that hears every process's task events
LIST_BATCH = 5_000  # task events per message (ListTasks, the events exchange): << 4 MiB


def event_key(process_id: str) -> str:
    """The routing key of the task events GM or LM ``process_id`` publishes."""
    return f"task.{process_id}"


def cancel_queue(process_id: str) -> str:
    """The kept queue through which GM or LM ``process_id`` hears of cancelled jobs."""
    return f"cancels.{process_id}"


def user_queue(queue: str) -> str:
    """The durable work queue that holds a user queue's pending tasks."""
    return f"user.{queue}"
