"""A worker host that shuts down gives its tasks back once each. Its last heartbeat
carries its tasks' LOST reports and says it leaves; the LM used to carry out each
report's re-queue (awaiting the broker) before it read ``leaving``, and meanwhile took a
launch of that very next attempt onto the leaving node (its room just freed), then lost
it with the node: two LOST events for one stop, and the task ran again only after that
(seen in CI on a loaded machine: test_a_worker_host_shut_down_gives_its_tasks_back_at_once).
"""

from __future__ import annotations

import asyncio

from services._proto.megha.v1 import common_pb2, local_master_pb2
from services.common.names import user_queue
from services.local_master import service
from services.local_master.service import LocalMaster
from tests.unit.lm.one_lm import lm_without_broker

LOST = common_pb2.TASK_STATE_LOST


class Context:
    """What the LM's handlers use of a gRPC call's context."""

    def peer(self) -> str:
        return "test"

    async def abort(self, code, details: str):
        raise AssertionError(f"aborted: {code} {details}")


def _task(attempt: int) -> common_pb2.Task:
    task = common_pb2.Task(task_id="j.0", job_id="j", queue="q", attempt=attempt)
    task.resources.cpu_milli, task.resources.memory_mb = 4000, 256
    return task


async def _launch(master: LocalMaster, task: common_pb2.Task) -> int:
    placement = local_master_pb2.Placement(task=task, node_index=0)
    request = local_master_pb2.LaunchRequest(gm_id="gm-1", placements=[placement])
    reply = await master.Launch(request, Context())
    return reply.results[0].status


async def test_a_leaving_workers_node_takes_no_task_while_its_reports_are_carried_out(
    monkeypatch,
):
    monkeypatch.setattr(service, "EVENT_RETRY_S", 0.01)
    master, bus = lm_without_broker()  # not connected: the broker is away
    register = local_master_pb2.RegisterWorkerRequest(node_id="lm-1-w0")
    register.capacity.cpu_milli, register.capacity.memory_mb = 4000, 8192
    await master.RegisterWorker(register, Context())
    assert await _launch(master, _task(0)) == local_master_pb2.PLACEMENT_STATUS_ACCEPTED

    # The worker shuts down: its last heartbeat reports the task LOST and says it leaves.
    report = local_master_pb2.TaskReport(
        task_id="j.0", attempt=0, state=LOST, message="worker lm-1-w0 shut down while the task ran"
    )
    beat = local_master_pb2.WorkerHeartbeat(
        node_id="lm-1-w0", node_index=0, reports=[report], leaving=True
    )
    heartbeat = asyncio.create_task(master._on_heartbeat(master.sessions[0], beat))
    await asyncio.sleep(0.05)  # the re-queue of attempt 1 waits for the broker
    assert not heartbeat.done()

    # A GM that got attempt 1 from its queue places it where the room was.
    assert await _launch(master, _task(1)) == local_master_pb2.PLACEMENT_STATUS_REJECTED_NODE_DEAD

    await bus.connect()
    await asyncio.wait_for(heartbeat, 5)
    assert await bus.queue_depth(user_queue("q")) == 1  # attempt 1, queued once
    lost = [(e.task_id, e.attempt) for e in master._events if e.state == LOST]
    assert lost == [("j.0", 0)]
    assert not master.state.table.is_alive(0)
