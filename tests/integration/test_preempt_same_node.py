"""A preempted task's next attempt placed on the very node it was preempted from, before
the kill of the old attempt reached the worker: the old attempt is killed, the new one
runs. Before, the worker ignored the new start ("duplicate start ignored": it knew the
task id) and then the kill, which named no attempt, removed the only copy; the LM kept
the new attempt booked as running and its job never ended (4 of 7 two-queue replays).

The LM and its worker are real (in this process, on the in-memory bus); the test plays
the GM, so that the second launch can follow the preemption at once; the broker takes
0.3 s to confirm a message (as a loaded one may), so the launch comes while the LM is
re-queueing the victim, deterministically."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from services._proto.megha.v1 import common_pb2, local_master_pb2, local_master_pb2_grpc
from services.app.runner import running_lm, running_workers
from services.common.bus import InMemoryBroker, make_bus
from services.common.config import parse_config
from services.common.names import EVENT_EXCHANGE, EVERY_TASK_EVENT, user_queue
from services.common.server import channel
from tests.integration.harness import free_ports, lm_alone, register_worker

pytestmark = pytest.mark.integration

PREEMPTED = common_pb2.TASK_STATE_PREEMPTED
RUNNING = common_pb2.TASK_STATE_RUNNING
SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED


def _task(task_id: str, queue: str, attempt: int, seconds: float) -> common_pb2.Task:
    task = common_pb2.Task(
        task_id=task_id, job_id=f"job-{task_id}", queue=queue, attempt=attempt, lease=1
    )
    task.resources.cpu_milli, task.resources.memory_mb = 1000, 256
    task.sim.duration_s = seconds
    return task


def _config(journal: str = ""):
    lm: dict = {"id": "lm-1", "port": free_ports(1)[0]}
    if journal:
        lm["journal"] = journal
    return parse_config(
        {
            "gms": [{"id": "gm-1", "port": free_ports(1)[0]}],
            "lms": [lm],
            "workers": [{"lm": "lm-1", "count": 1, "capacity": "cpu=2,mem=4Gi"}],
            "queues": [
                {"name": "low", "share": 0.1, "gm": "gm-1"},
                {"name": "high", "share": 0.9, "gm": "gm-1"},
            ],
            "heartbeat_interval_s": 0.2,
            "worker_heartbeat_interval_s": 0.2,
            "event_batch_s": 0.01,
        },
        env={},
    )


@contextlib.asynccontextmanager
async def _lm_with_one_worker():
    config = _config()
    broker = InMemoryBroker()
    events: list[common_pb2.TaskEvent] = []

    async def on_events(_key: str, body: bytes) -> None:
        events.extend(common_pb2.TaskEventBatch.FromString(body).events)

    async with (
        make_bus("memory://", broker=broker) as bus,
        running_lm(config, "lm-1", bus) as lm,
        running_workers(config, None, None),
        channel(config.lm("lm-1").target) as ch,
    ):
        await bus.subscribe_topic(EVENT_EXCHANGE, EVERY_TASK_EVENT, on_events)
        enqueue = bus.enqueue

        async def slow_enqueue(queue: str, body: bytes) -> None:
            await asyncio.sleep(0.3)
            await enqueue(queue, body)

        bus.enqueue = slow_enqueue  # the LM's broker confirms late
        deadline = time.monotonic() + 10
        while not lm.state.table.alive.count():
            assert time.monotonic() < deadline, "the worker never registered"
            await asyncio.sleep(0.02)
        yield local_master_pb2_grpc.LocalMasterStub(ch), events, lm


async def _until(events, predicate, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(predicate(e) for e in events):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_the_next_attempt_of_a_victim_runs_on_the_node_it_was_preempted_from():
    async with _lm_with_one_worker() as (lm, events, books):
        victim = _task("v", "low", 0, seconds=30)
        launch = local_master_pb2.LaunchRequest(
            gm_id="gm-1", placements=[local_master_pb2.Placement(task=victim, node_index=0)]
        )
        reply = await lm.Launch(launch, timeout=5)
        assert reply.results[0].status == local_master_pb2.PLACEMENT_STATUS_ACCEPTED
        await _until(events, lambda e: e.task_id == "v" and e.state == RUNNING, "v never ran")

        preempt = local_master_pb2.PreemptRequest(
            gm_id="gm-1",
            task=_task("p", "high", 0, seconds=30),
            node_index=0,
            victim_task_ids=["v"],
        )
        again = local_master_pb2.LaunchRequest(
            gm_id="gm-1",
            placements=[
                local_master_pb2.Placement(task=_task("v", "low", 1, seconds=0.3), node_index=0)
            ],
        )
        # The victim's next attempt follows the preemption at once, as a GM that takes
        # it from the broker the moment the LM re-queues it does: once the LM has booked
        # the preemption, while it waits for the broker.
        preempted = asyncio.ensure_future(lm.Preempt(preempt, timeout=5))
        while "p" not in books.state.allocations:
            await asyncio.sleep(0.005)
        relaunched = await lm.Launch(again, timeout=5)
        assert (await preempted).results[0].status == local_master_pb2.PLACEMENT_STATUS_ACCEPTED
        assert relaunched.results[0].status == local_master_pb2.PLACEMENT_STATUS_ACCEPTED

        await _until(
            events,
            lambda e: e.task_id == "v" and e.attempt == 1 and e.state == SUCCEEDED,
            "the victim's next attempt never ended",
        )
        ends = [(e.attempt, e.state) for e in events if e.task_id == "v" and e.state != RUNNING]
        assert (0, PREEMPTED) in ends
        starts = sorted(e.attempt for e in events if e.task_id == "v" and e.state == RUNNING)
        assert starts == [0, 1]


async def _victim_running(lm, events) -> None:
    """Task "v" of the low queue, 30 s long, launched and running on the only node."""
    reply = await lm.Launch(
        local_master_pb2.LaunchRequest(
            gm_id="gm-1",
            placements=[local_master_pb2.Placement(task=_task("v", "low", 0, 30), node_index=0)],
        ),
        timeout=5,
    )
    assert reply.results[0].status == local_master_pb2.PLACEMENT_STATUS_ACCEPTED
    await _until(events, lambda e: e.task_id == "v" and e.state == RUNNING, "v never ran")


async def test_a_preempting_task_starts_while_its_victims_wait_for_the_broker():
    """The victim's re-queue waits for a broker that is away; the task that preempted it
    is started and held meanwhile, and its worker's reports are read. Before, the LM
    started it only once every re-queue was confirmed: through a broker restart it sat
    booked but neither started nor held, and when it was preempted in turn nobody
    re-queued it (the chaos suite's stuck task). The re-queue, made once the worker
    says the victim is killed, must not hold back that worker's later reports either."""
    async with _lm_with_one_worker() as (lm, events, books):
        await _victim_running(lm, events)
        back = asyncio.Event()
        enqueue = books.bus.enqueue

        async def broker_away(queue: str, body: bytes) -> None:
            await back.wait()
            await enqueue(queue, body)

        books.bus.enqueue = broker_away
        preempt = local_master_pb2.PreemptRequest(
            gm_id="gm-1", task=_task("p", "high", 0, 30), node_index=0, victim_task_ids=["v"]
        )
        preempted = await lm.Preempt(preempt, timeout=10)  # not held back by the broker
        assert preempted.results[0].status == local_master_pb2.PLACEMENT_STATUS_ACCEPTED
        await _until(events, lambda e: e.task_id == "p" and e.state == RUNNING, "p never ran")
        held = await lm.LookupTasks(local_master_pb2.LookupTasksRequest(task_ids=["p"]))
        assert [t.task_id for t in held.tasks] == ["p"]
        back.set()


async def test_a_victims_requeue_waits_for_its_kill_and_outlives_a_broker_away():
    """The victim's next attempt is queued once its worker says it is killed (chaos-sim
    bug 2: queued as the kill was sent, it could run beside the old attempt), not by the
    Preempt call: that answers at once. A broker away meanwhile only delays it. (Before,
    a Preempt whose deadline passed while the LM waited for the broker cancelled the
    re-queue with its handler, and the task was lost for good.)"""
    async with _lm_with_one_worker() as (lm, events, books):
        await _victim_running(lm, events)
        back, stored = asyncio.Event(), []
        enqueue = books.bus.enqueue

        async def broker_away(queue: str, body: bytes) -> None:
            await back.wait()
            await enqueue(queue, body)
            stored.append(common_pb2.TaskBatch.FromString(body))

        books.bus.enqueue = broker_away
        preempt = local_master_pb2.PreemptRequest(
            gm_id="gm-1", task=_task("p", "high", 0, 30), node_index=0, victim_task_ids=["v"]
        )
        reply = await lm.Preempt(preempt, timeout=0.5)
        assert reply.results[0].status == local_master_pb2.PLACEMENT_STATUS_ACCEPTED
        await _until(events, lambda e: e.task_id == "p" and e.state == RUNNING, "p never ran")
        await asyncio.sleep(0.2)
        back.set()
        deadline = time.monotonic() + 5
        while not stored:
            assert time.monotonic() < deadline, "the victim's next attempt was never queued"
            await asyncio.sleep(0.02)
        assert [(t.task_id, t.attempt) for t in stored[0].tasks] == [("v", 1)]


async def test_a_requeue_the_broker_never_confirmed_is_sent_by_the_restarted_lm(tmp_path):
    """The LM stops while a victim's re-queue (sent once its worker reported the kill)
    waits for a broker that is away: the attempt has ended on its books (and in its
    journal), and the message is the task's only way on. The restarted LM, its journal
    kept, sends it. Before, it was lost with the LM and the job never ended
    (``megha-loadgen chaos-sim --small --seed 6``)."""
    config = _config(journal=str(tmp_path / "lm-1.journal"))
    events: list[common_pb2.TaskEvent] = []
    stored: list[common_pb2.TaskBatch] = []

    async def on_events(_key: str, body: bytes) -> None:
        events.extend(common_pb2.TaskEventBatch.FromString(body).events)

    async def on_low(delivery) -> None:
        stored.append(common_pb2.TaskBatch.FromString(delivery.body))
        await delivery.ack()

    async with (
        make_bus("memory://", broker=InMemoryBroker()) as bus,
        running_workers(config, None, None),
    ):
        await bus.subscribe_topic(EVENT_EXCHANGE, EVERY_TASK_EVENT, on_events)
        enqueue = bus.enqueue
        async with (
            running_lm(config, "lm-1", bus) as books,
            channel(config.lm("lm-1").target) as ch,
        ):
            lm = local_master_pb2_grpc.LocalMasterStub(ch)
            deadline = time.monotonic() + 10
            while not books.state.table.alive.count():
                assert time.monotonic() < deadline, "the worker never registered"
                await asyncio.sleep(0.02)
            await _victim_running(lm, events)

            async def broker_away(queue: str, body: bytes) -> None:
                await asyncio.Event().wait()

            bus.enqueue = broker_away
            preempt = local_master_pb2.PreemptRequest(
                gm_id="gm-1", task=_task("p", "high", 0, 30), node_index=0, victim_task_ids=["v"]
            )
            reply = await lm.Preempt(preempt, timeout=5)
            assert reply.results[0].status == local_master_pb2.PLACEMENT_STATUS_ACCEPTED
            await _until(events, lambda e: e.task_id == "v" and e.state == PREEMPTED, "no end")
            # Its next attempt is owed once the worker says the kill took effect.
            deadline = time.monotonic() + 10
            while not books.journal.load().owed:
                assert time.monotonic() < deadline, "the victim's re-queue was never owed"
                await asyncio.sleep(0.05)
        bus.enqueue = enqueue  # the broker is back; the LM was not
        await bus.consume(user_queue("low"), on_low)
        await asyncio.sleep(0.3)
        assert not stored, "the stopped LM's re-queue reached the broker after all"
        async with running_lm(config, "lm-1", bus):
            deadline = time.monotonic() + 10
            while not stored:
                assert time.monotonic() < deadline, "the owed re-queue was never sent"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
        assert [(t.task_id, t.attempt) for b in stored for t in b.tasks] == [("v", 1)]


async def test_a_start_after_a_worker_registered_again_goes_out_on_its_new_stream():
    """A worker registers again only once it has left its stream, but the LM's end of
    that stream may not know yet: a start written to it then was lost (the worker never
    read it, and the LM took it for sent), so the task stayed placed for ever
    (``chaos-sim --small --calm-streams --seed 293``). The test plays the worker."""
    config = _config()
    async with lm_alone(config) as lm:
        node = await register_worker(lm, "w-0")

        def beat() -> local_master_pb2.WorkerHeartbeat:
            return local_master_pb2.WorkerHeartbeat(
                node_id="w-0", node_index=node, sent_unix_nanos=time.time_ns()
            )

        old = lm.WorkerHeartbeats()
        await old.write(beat())
        await asyncio.sleep(0.2)  # the LM serves the old stream
        # The worker left it (its end only: the LM's end stays open) and registers again.
        await register_worker(lm, "w-0")
        reply = await lm.Launch(
            local_master_pb2.LaunchRequest(
                gm_id="gm-1",
                placements=[
                    local_master_pb2.Placement(task=_task("t", "low", 0, 30), node_index=node)
                ],
            ),
            timeout=5,
        )
        assert reply.results[0].status == local_master_pb2.PLACEMENT_STATUS_ACCEPTED
        new = lm.WorkerHeartbeats()
        await new.write(beat())
        async with asyncio.timeout(5):
            command = await new.read()
        started = [t.task_id for t in command.starts.tasks] or [command.start.task.task_id]
        assert started == ["t"]
        old.cancel()
        new.cancel()
