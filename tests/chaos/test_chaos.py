"""Nothing lost, nothing run twice, with faults: a live federation (real processes, real
RabbitMQ) replays two queues that preempt each other while one fault strikes, and an
independent recorder (a subscriber of the events exchange, ``loadgen.invariants``)
checks the promises afterwards: every acknowledged task ends, no (task, attempt) starts
twice, no two attempts of a task run at once, no node holds more than it has, and the
LMs' books are balanced once idle.

Faults: kill -9 of a GM, of an LM (journalled), of a worker host, each restarted after
a while; SIGSTOP of an LM past the GM's call timeout; kill -9 of a GM while an LM is
stopped with its launches; a broker restart. Each runs with four seeds, which pick the
victim, when it strikes and for how long: 24 runs.

What the recorder cannot see it does not guess: an attempt whose end no worker stamped
(the LM ended it: preempted, or lost with its worker) has no known end, and is left out
of the overlap and capacity sweeps; the summary counts them."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import grpc
import pytest

from loadgen.invariants import check
from services._proto.megha.v1 import common_pb2
from services.core.states import TERMINAL
from tests.integration.harness import Federation, broker_ctl, sim_tasks

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

FAULTS = [
    "gm-kill",
    "lm-kill",
    "worker-host-kill",
    "lm-pause",
    "gm-kill-during-lm-pause",
    "broker-restart",
]
# MEGHA_CHAOS_SEEDS=N runs N seeds of each fault (CI: 4).
SEEDS = range(int(os.environ.get("MEGHA_CHAOS_SEEDS", "4")))
CALL_TIMEOUT_S = 1.0  # lm_call_timeout_s: an LM paused longer has its requests fenced
WORKER_TIMEOUT_S = 4.0  # a pause shorter than this keeps the LM's workers alive
CPU = 1000
CAPACITY = 4000
QUEUES = [{"name": "a", "share": 0.5, "gm": "gm-1"}, {"name": "b", "share": 0.5, "gm": "gm-2"}]
TASKS_PER_QUEUE = 150
DEADLINE_S = 150  # for every task to end after the fault


def _tasks(rng: random.Random, count: int) -> list[common_pb2.Task]:
    tasks = []
    for task in sim_tasks(count, 1.0, cpu_milli=CPU):
        task.sim.duration_s = task.expected_duration_s = round(rng.uniform(0.5, 3.0), 2)
        tasks.append(task)
    return tasks


async def _strike(fed: Federation, fault: str, rng: random.Random) -> str:
    """Inflict ``fault`` and undo it (restart, resume); what was done, for the report."""
    lm = rng.choice([lm.id for lm in fed.config.lms])
    killed = {
        "gm-kill": f"gm-{rng.choice(['gm-1', 'gm-2'])}",
        "lm-kill": f"lm-{lm}",
        "worker-host-kill": f"workers-{lm}",
    }.get(fault)
    if killed is not None:  # kill -9, back after a while (as a supervisor restarts it)
        fed.children.kill(killed)
        down = rng.uniform(0.5, 3.0)
        await asyncio.sleep(down)
        fed.children.restart(killed)
        return f"kill -9 {killed}, back after {down:.1f} s"
    if fault == "gm-kill-during-lm-pause":
        # The GM dies with launches out at a frozen LM; its successor gets their messages
        # again and must not run them elsewhere while the frozen LM may still take them.
        proc = fed.children.procs[f"lm-{lm}"]
        gm = f"gm-{rng.choice(['gm-1', 'gm-2'])}"
        paused = rng.uniform(2.0, WORKER_TIMEOUT_S - 0.5)
        proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(0.5)
            fed.children.kill(gm)
            fed.children.restart(gm)
            await asyncio.sleep(paused - 0.5)
        finally:
            proc.send_signal(signal.SIGCONT)
        return f"SIGSTOP lm-{lm} for {paused:.1f} s, kill -9 {gm} 0.5 s into it"
    if fault == "lm-pause":
        proc = fed.children.procs[f"lm-{lm}"]
        # Past the GM's patience, within the workers': the launches it reads late find
        # live nodes, so only fencing keeps them from running twice.
        paused = rng.uniform(CALL_TIMEOUT_S + 0.5, WORKER_TIMEOUT_S - 0.5)
        proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(paused)
        finally:
            proc.send_signal(signal.SIGCONT)
        return f"SIGSTOP lm-{lm} for {paused:.1f} s"
    assert fault == "broker-restart"
    try:
        broker_ctl("stop_app")
        down = rng.uniform(1.0, 3.0)
        await asyncio.sleep(down)
    finally:
        broker_ctl("start_app")
    return f"broker stopped for {down:.1f} s"


async def _strike_at(fed: Federation, fault: str, rng: random.Random, at: float) -> str:
    await asyncio.sleep(at)
    return f"at {at:.1f} s: " + await _strike(fed, fault, rng)


async def _submit(fed: Federation, gm_id: str, tasks, queue: str, job_id: str):
    """Submit, again under the same job id while the GM is down (a client's retry)."""
    for _ in range(60):
        try:
            return await fed.gm(gm_id).submit(tasks, queue=queue, job_id=job_id)
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.5)
    return await fed.gm(gm_id).submit(tasks, queue=queue, job_id=job_id)


async def _final_states(fed: Federation, jobs: list[tuple[str, str]], missing: set[str]) -> list:
    """What the GMs' books say of the ``missing`` tasks' ends, as events: a recorder
    misses the events published while the broker is away, and a GM learns them
    (LookupTasks)."""
    events = []
    for gm_id, job_id in jobs:
        for _ in range(20):  # the GM may be restarting
            try:
                job = await fed.gm(gm_id).job(job_id)
                break
            except Exception:
                await asyncio.sleep(0.5)
        else:
            continue
        for t in job.tasks:
            if t.task_id in missing and t.state in TERMINAL:
                events.append(
                    common_pb2.TaskEvent(
                        task_id=t.task_id, state=t.state, attempt=t.attempt, node_id=t.node_id
                    )
                )
    return events


async def _books(fed: Federation, jobs: list[tuple[str, str]], task_ids: set[str]) -> str:
    """What the GMs' books say of ``task_ids`` (state, LM, attempt, why it waits)."""
    lines = []
    for gm_id, job_id in jobs:
        try:
            job = await fed.gm(gm_id).job(job_id)
        except Exception as err:
            lines.append(f"  {gm_id} {job_id}: {err!r}")
            continue
        for t in job.tasks:
            if t.task_id in task_ids:
                state = common_pb2.TaskState.Name(t.state)
                lines.append(
                    f"  {gm_id}: {t.task_id} attempt {t.attempt} {state} lm={t.lm_id} "
                    f"node={t.node_id} {t.pending_reason}"
                )
    return "\nthe GMs' books:\n" + ("\n".join(lines) or "  (none)")


def _logs(fed: Federation, task_ids: set[str], limit: int = 60) -> str:
    """The processes' log lines that name ``task_ids``, to tell what they did of them."""
    lines = []
    for path in sorted(fed.dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if any(t in line for t in task_ids):
                lines.append(f"  {path.stem}: {line[:400]}")
    return "\nlog lines naming them:\n" + ("\n".join(lines[-limit:]) or "  (none)")


def _history(events: list, task_ids: set[str]) -> str:
    """Every event the recorder holds of ``task_ids``, to tell a failure's story."""
    lines = []
    for e in events:
        if e.task_id in task_ids:
            state = common_pb2.TaskState.Name(e.state)
            lines.append(
                f"  {e.task_id} attempt {e.attempt} {state} lm={e.lm_id} node={e.node_id} "
                f"{e.reason}"
            )
    return "\nevents of those tasks:\n" + ("\n".join(lines) or "  (none)")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fault", FAULTS)
async def test_no_task_is_lost_or_run_twice(tmp_path, fault, seed):
    rng = random.Random(f"{fault}/{seed}")
    groups = [
        {"lm": f"lm-{i}", "count": 3, "capacity": f"cpu={CAPACITY // 1000},mem=8Gi"}
        for i in (1, 2, 3)
    ]
    async with Federation(
        tmp_path,
        gms=2,
        lms=3,
        worker_groups=groups,
        queues=QUEUES,
        lm_call_timeout_s=CALL_TIMEOUT_S,
        worker_timeout_s=WORKER_TIMEOUT_S,
        # A worker that cannot reach its LM kills its tasks before the LM gives them
        # away: without it a paused LM's tasks run on twice (tests/integration/test_fencing.py).
        worker_fence_s=WORKER_TIMEOUT_S - 1,
    ) as fed:
        jobs, acknowledged, cpu = [], set(), {}
        # The fault strikes while the jobs arrive (a frozen LM then has launches out) or
        # once the pool is full and the second queue preempts the first.
        at = rng.uniform(0.0, 0.2) if "pause" in fault else rng.uniform(0.0, 4.0)
        strike = asyncio.create_task(_strike_at(fed, fault, rng, at))
        for queue, gm_id in (("a", "gm-1"), ("b", "gm-2")):
            for part in range(3):
                job_id = f"{queue}-{seed}-{part}"
                reply = await _submit(fed, gm_id, _tasks(rng, TASKS_PER_QUEUE // 3), queue, job_id)
                jobs.append((gm_id, job_id))
                acknowledged |= set(reply.task_ids)
            await asyncio.sleep(1.0)  # a fills the pool; b then preempts its way to half
        what = await strike
        cpu = dict.fromkeys(acknowledged, CPU)

        deadline = time.monotonic() + DEADLINE_S
        learnt: list = []  # ends the recorder missed (the broker was away), from the GMs
        seen, quiet_since = 0, time.monotonic()
        while True:
            ended = {e.task_id for e in [*fed.events.events, *learnt] if e.state in TERMINAL}
            if acknowledged <= ended or time.monotonic() > deadline:
                break
            if len(fed.events.events) != seen:
                seen, quiet_since = len(fed.events.events), time.monotonic()
            elif time.monotonic() - quiet_since > 5:  # nothing heard: what do the GMs know?
                learnt += await _final_states(fed, jobs, acknowledged - ended)
                quiet_since = time.monotonic()
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # a second run would show by now
        events = [*fed.events.events, *learnt]
        nodes = {e.node_id for e in events if e.node_id}
        report = check(events, acknowledged, cpu, dict.fromkeys(nodes, CAPACITY))
        print(f"{fault} seed {seed}: {what}; {report.summary()}")
        told = {v.task_id for v in report.violations[:5]}
        assert report.ok, (
            f"{what}: {report.summary()}\n"
            + "\n".join(str(v) for v in report.violations[:20])
            + _history(events, told)
            + await _books(fed, jobs, told)
            + _logs(fed, told)
        )
        for _ in range(20):  # the last ends reach the books
            try:
                await fed.assert_books_balanced()
                break
            except AssertionError:
                await asyncio.sleep(0.5)
        else:
            await fed.assert_books_balanced()
