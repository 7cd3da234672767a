"""The GM's driver of gang jobs: all of a job's tasks start together, or none does.

    delivery of a gang's message ──▶ GangJob (its tasks, never in the scheduler's queues)
        plan_gang over the view ──Verdict──▶ wait (reason on each task) for a view change
                                │  its queue under its share, entitled to it whole:
                                └─gang_evictions─▶ StopTasks(preempt) on the victims'
                                   LMs, their fresh states applied, planned again at once
                                ──GangPlan──▶ book ──▶ ReserveGang on every LM (parallel)
            all ACCEPTED ──▶ CommitGang on every LM ──▶ accepted: the message is acked
            any refusal / no answer ──▶ ReleaseGang on every LM, unbook, apply their
                                        fresh states, plan again (a new gang id) later
    a started member's next attempt (lost, retried, preempted) ──▶ Regathering, never
        the round: LookupTasks on every LM ──regather──▶ StopTasks on the LMs of the
        members still running (their LMs queue their next attempts once killed)
        ──▶ every member's next attempt here ──▶ GangJob as above (all or nothing)

The decisions are the core's (``services.core.gang``, ``services.core.gang_restart``;
the LMs' ``Reservations`` and ``Lifecycle``); this module only carries them out over
gRPC. A gang of a queue with a limit starts only within it (``Scheduler.plan_gang``:
the members that start together fit what the queue holds; with ``min_tasks`` the rest
are queued one by one, each within the limit). A gang that finds no room preempts as
one unit (``Scheduler.gang_evictions``): only if its queue is under its share and stays
within it with the members that start together, victims of the queue most over its
share down to that queue's share, never a gang's (``Allocation.gang``: no half gang is
preempted); each LM ends them PREEMPTED only if it too finds their queue over its share
(``Lifecycle.evict``), holds each victim's room for the gang's job alone
(``Reservations.hold_room``: a placeholder until the job's reserve there, or
``GANG_EVICT_S``; no other GM's launch and no victim's next attempt takes it) and answers
with its state, so the gang is planned in that room at once (``plan_gang``'s ``held``).
An LM that refused every victim (its
word on the other LMs' usage lags by a heartbeat) is asked again after
``GANG_RETRY_S``; a gang that preempted does not again for ``GANG_EVICT_S``.

A commit that fails on one LM after another committed (only a node lost or a cancel
between reserve and commit can do that) leaves the committed part running and the rest
planned again as a gang; the part that runs is then stopped and restarted with it when
the rest's next attempts come back (``Regathering``) only if a member of it is lost
later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import grpc

from services._proto.megha.v1 import common_pb2, local_master_pb2
from services.common.convert import layout_to_proto, placement_status_from_proto, vdc_from_proto
from services.core.gang import (
    GANG_EVICT_S,
    GANG_RETRY_S,
    Eviction,
    Gang,
    GangError,
    GangPiece,
    GangPlan,
    VdcLayout,
    book,
    unbook,
)
from services.core.gang_restart import Standing, Stop, kill_reason, regather
from services.core.reservations import DEFAULT_TTL_S, room_id
from services.core.resources import NET
from services.core.scheduler import Drop
from services.core.states import TaskState
from services.core.status import Verdict
from services.core.task import TaskSpec
from services.core.vdc import Vdc, VdcError

if TYPE_CHECKING:
    from services.global_master.service import GlobalMaster, Pending

log = logging.getLogger("megha.gm.gangs")

# A restarting gang asks the LMs again this often while it waits for its members' kills.
REGATHER_RETRY_S = 0.5


def gang_of(job_id: str, specs: Sequence[TaskSpec], min_tasks: int, vdc: Vdc | None = None) -> Gang:
    """The gang of a job's tasks (``GangError`` if malformed); a new id per attempt."""
    return Gang(f"{job_id}/{uuid.uuid4().hex[:8]}", tuple(specs), min(min_tasks, len(specs)), vdc)


def vdc_of(task: common_pb2.Task) -> Vdc | None:
    """The VDC a gang's member carries (``Task.vdc``), if any. Checked at submission; one
    that is not valid now (it is not sealed: a forged re-queue) is left out, said."""
    if not task.HasField("vdc"):
        return None
    try:
        return vdc_from_proto(task.vdc)
    except VdcError as err:
        log.warning("a gang member's VDC is not valid; left out", extra={"error": str(err)})
        return None


@dataclass(eq=False)
class GangJob:
    """A gang job's tasks that wait to start together (``min_tasks``: 0, all of them)."""

    job_id: str
    queue: str
    items: list[Pending]
    min_tasks: int
    evict_after: float = 0.0  # monotonic: no preemption for it before then
    # (lm_id, placeholder id) of the room its last preemption's victims left it, which
    # their LMs hold for it (``room_id``) until it reserves there: counted free for it.
    held: list[tuple[str, str]] = field(default_factory=list)


@dataclass(eq=False)
class Regathering:
    """A started gang that lost a member: the next attempts of its members that came
    back here (by task id), until every member to restart has (``regather``)."""

    job_id: str
    queue: str
    items: dict[str, Pending]
    lost: str  # the member whose next attempt came first (named in the kills' reason)
    arrived: asyncio.Event


class Gangs:
    """Starts gang jobs for one GM (its view, stubs and books)."""

    def __init__(self, gm: GlobalMaster):
        self.gm = gm
        self._changed = asyncio.Event()
        self.waiting: dict[str, GangJob] = {}  # job id -> its gang, until it started
        self.regathering: dict[str, Regathering] = {}  # job id -> its restart, until placed

    def never(
        self,
        job_id: str,
        queue: str,
        specs: Sequence[TaskSpec],
        min_tasks: int,
        vdc: Vdc | None = None,
    ) -> str | None:
        """Why the gang of ``specs`` can never start whole in ``queue``: it asks more
        than the queue's limit, or the federation as the view knows it (its nodes'
        capacities, dead ones too) could never hold it; or None. The latter is not judged
        while an LM of the federation was not heard yet or restarted lately (its nodes
        are coming back): the gang then waits."""
        try:
            gang = gang_of(job_id or "gang", specs, min_tasks, vdc)
        except GangError as err:
            return str(err)
        return self.gm.scheduler.gang_never_runs(queue, gang, time.monotonic())

    def view_changed(self) -> None:
        """The view changed (a state applied, tasks ended, a job cancelled): every
        waiting gang is planned again."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def start(self, job: GangJob) -> None:
        for item in job.items:  # booked in the view as a gang's: never a victim
            item.spec = replace(item.spec, gang=True)
        self.waiting[job.job_id] = job
        self.gm._spawn(self._run(job))

    def rejoin(self, item: Pending, queue: str) -> None:
        """``item`` is the next attempt of a started gang's member (``gang_task_ids``):
        it waits here for the rest of its gang, which is stopped and started again
        whole (``regather``); never placed alone."""
        job_id = item.task.job_id
        gathering = self.regathering.get(job_id)
        if gathering is None:
            gathering = Regathering(job_id, queue, {}, item.task.task_id, asyncio.Event())
            self.regathering[job_id] = gathering
            self.gm._spawn(self._regather(gathering))
        older = gathering.items.get(item.task.task_id)
        if older is not None and older.task.attempt >= item.task.attempt:
            self.gm._spawn(self.gm._launched(item.batch))  # not newer: the one here goes
            return
        if older is not None:
            self.gm._spawn(self.gm._launched(older.batch))
        gathering.items[item.task.task_id] = item
        gathering.arrived.set()

    async def _regather(self, gathering: Regathering) -> None:
        gm = self.gm
        job_id = gathering.job_id
        log.warning(
            "a started gang lost a member: restarting it whole",
            extra={"job_id": job_id, "lost": gathering.lost},
        )
        try:
            while not gm._closed:
                items = gathering.items
                if gm.cancelled.reason(job_id) is not None:
                    gm._drop_cancelled(list(items.values()))
                    return
                gathering.arrived.clear()  # what comes back from now on wakes the wait
                try:
                    if await self._regather_once(gathering):
                        return
                except Exception:  # a bug must not leave the gang waiting for ever, unsaid
                    log.exception("restarting a gang failed; again", extra={"job_id": job_id})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(gathering.arrived.wait(), REGATHER_RETRY_S)
        finally:
            if self.regathering.get(job_id) is gathering:
                del self.regathering[job_id]

    async def _regather_once(self, gathering: Regathering) -> bool:
        """One turn of a gang's restart: True once its members went to ``start``."""
        gm, job_id, items = self.gm, gathering.job_id, gathering.items
        while True:
            members = sorted({m for i in items.values() for m in i.task.gang_task_ids})
            arrived = {t: i.task.attempt for t, i in items.items()}
            standing, complete = await self._standing(members)
            step = regather(members, arrived, standing, complete, gathering.lost)
            if {t: i.task.attempt for t, i in items.items()} != arrived:
                continue  # more came back while the LMs were asked: judged again
            for task_id in step.launched:  # an earlier GM's commit took it: acked
                gm._spawn(gm._launched(items.pop(task_id).batch))
            if step.start:
                ready = [items[t] for t in step.ready]
                log.info(
                    "a gang's members are all back: placing it again whole",
                    extra={"job_id": job_id, "tasks": len(ready)},
                )
                del self.regathering[job_id]
                self.start(GangJob(job_id, gathering.queue, ready, 0))
                return True
            for task_id in items:
                gm.jobs.set_reason(job_id, task_id, step.reason)
            if step.stop:
                # Their next attempts come back once the kills took effect, and wake the
                # wait; one not held where the LM said (an orphan of a restarted LM, not
                # named by its worker yet) is asked about again after the pause.
                await self._stop(step.stop, kill_reason(gathering.lost))
            return False

    async def _standing(self, members: list[str]) -> tuple[dict[str, Standing], bool]:
        """What the LMs know of ``members``: each one's newest attempt; and whether
        every LM answered."""
        gm = self.gm
        lm_ids = list(gm._stubs)
        replies = await asyncio.gather(
            *(gm._lookup(lm_id, members, quiet=True) for lm_id in lm_ids)
        )
        standing: dict[str, Standing] = {}
        for lm_id, reply in zip(lm_ids, replies, strict=True):
            for known in reply.tasks if reply is not None else ():
                ended = None
                last = known.last_ended
                if known.HasField("last_ended") and last.attempt == known.attempt:
                    ended = None if known.running else TaskState(last.state)
                now = Standing(known.attempt, lm_id, known.running, ended)
                seen = standing.get(known.task_id)
                if seen is None or (now.attempt, now.running) > (seen.attempt, seen.running):
                    standing[known.task_id] = now
        return standing, all(reply is not None for reply in replies)

    async def _stop(self, stops: Sequence[Stop], reason: str) -> None:
        """StopTasks on each LM for its members (an LM that does not answer is asked
        again on the next turn: the members still run there)."""
        by_lm: dict[str, list[Stop]] = {}
        for stop in stops:
            by_lm.setdefault(stop.lm_id, []).append(stop)

        await asyncio.gather(
            *(self._stop_on(lm_id, these, reason) for lm_id, these in by_lm.items())
        )

    async def _stop_on(
        self, lm_id: str, these: list[Stop], reason: str, for_job: str = ""
    ) -> list[str]:
        """StopTasks on ``lm_id``: the tasks it stopped (none if it did not answer). With
        ``for_job`` they are victims preempted for that gang job (``preempt``), and the
        LM holds their room for it."""
        gm = self.gm
        preempt = bool(for_job)
        request = local_master_pb2.StopTasksRequest(
            gm_id=gm.gm_id,
            reason=reason,
            preempt=preempt,
            known_version=self._known(lm_id),
            for_job_id=for_job,
        )
        for stop in these:
            request.tasks.add(task_id=stop.task_id, attempt=stop.attempt)
        try:
            reply = await gm._stubs[lm_id].StopTasks(request, timeout=gm.config.lm_call_timeout_s)
        except grpc.aio.AioRpcError as err:
            log.warning("StopTasks failed", extra={"lm": lm_id, "code": err.code().name})
            await asyncio.sleep(REGATHER_RETRY_S)
            return []
        if reply.HasField("state"):
            await gm._apply_state(reply.state)
        if reply.stopped_task_ids or not preempt:
            log.info(
                "preempted for a waiting gang" if preempt else "stopped a gang's members",
                extra={"lm": lm_id, "tasks": list(reply.stopped_task_ids)},
            )
        return list(reply.stopped_task_ids)

    async def _run(self, job: GangJob) -> None:
        gm = self.gm
        try:
            while not gm._closed and job.items:
                if gm.cancelled.reason(job.job_id) is not None:
                    gm._drop_cancelled(job.items)
                    return
                if job.items[0].batch.cancelled:  # its publish failed: see ``_queue_job``
                    for item in job.items:
                        gm._drop(item, Drop.WITHDRAWN)
                    return
                changed = self._changed
                try:
                    specs = [item.spec for item in job.items]
                    gang = gang_of(job.job_id, specs, job.min_tasks, vdc_of(job.items[0].task))
                    outcome = gm.scheduler.plan_gang(
                        job.queue, gang, time.monotonic(), held=job.held
                    )
                    if isinstance(outcome, Verdict):
                        evicted = await self._evict(job, gang)
                        for item in job.items:
                            gm.jobs.set_reason(
                                job.job_id,
                                item.task.task_id,
                                f"its gang waits: {evicted or outcome.reason}",
                            )
                        if evicted:  # the LMs' states show the room: planned again now
                            continue
                        # Bounded: a limit's ledger may be waiting for time alone
                        # (LMs not heard from, up to ``limit_settle_s``).
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(changed.wait(), GANG_RETRY_S)
                        continue
                    if await self._place(job, outcome):
                        return
                except Exception:  # a bug must not leave the gang waiting for ever, unsaid
                    log.exception("placing a gang failed; trying again", extra={"job": job.job_id})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), GANG_RETRY_S)
        finally:
            if self.waiting.get(job.job_id) is job:
                del self.waiting[job.job_id]

    async def _evict(self, job: GangJob, gang: Gang) -> str | None:
        """A gang that found no room preempts for itself as one unit, if fairness lets
        it (``Scheduler.gang_evictions``): StopTasks with ``preempt`` on the victims'
        LMs (each checks the victim's queue is over its share, and ends it PREEMPTED).
        At most once per ``GANG_EVICT_S`` for a gang: the room frees as the kills take
        effect, and the gang is planned again then. What it did, or None."""
        gm, now = self.gm, time.monotonic()
        if now < job.evict_after:
            return None
        eviction = gm.scheduler.gang_evictions(job.queue, gang, now)
        if not isinstance(eviction, Eviction):
            return None
        job.evict_after = now + GANG_EVICT_S
        reason = (
            f"preempted for gang job {job.job_id} (queue {job.queue} under its share; "
            f"queue {eviction.queue} over)"
        )
        by_lm: dict[str, list[Stop]] = {}
        for lm_id, task_id, attempt in eviction.victims:
            by_lm.setdefault(lm_id, []).append(Stop(task_id, attempt, lm_id))
        lm_ids = list(by_lm)
        try:
            stopped = await asyncio.gather(
                *(self._stop_on(lm_id, by_lm[lm_id], reason, job.job_id) for lm_id in lm_ids)
            )
        finally:
            gm.scheduler.evictions_replied(eviction)
        job.held = [
            (lm_id, room_id(task_id, job.job_id))
            for lm_id, ids in zip(lm_ids, stopped, strict=True)
            for task_id in ids
        ]
        count = len(job.held)
        if not count:
            # The LMs found none of them over-share victims (an LM's word on the other
            # LMs' usage comes by heartbeat: it may lag this GM's): asked again soon.
            job.evict_after = now + GANG_RETRY_S
            return None
        log.info(
            "a waiting gang preempted for itself",
            extra={"job_id": job.job_id, "victims": count, "of_queue": eviction.queue},
        )
        return f"preempting {count} task(s) of queue {eviction.queue} to start whole"

    async def _place(self, job: GangJob, plan: GangPlan) -> bool:
        """Reserve ``plan`` on its LMs, then commit it; True once it started."""
        gm = self.gm
        by_lm = plan.by_lm()
        items = {item.task.task_id: item for item in job.items}
        now = time.time_ns()
        # Every member knows its gang: a member's next attempt restarts it whole.
        members = sorted(piece.task.task_id for piece in plan.pieces)
        for piece in plan.pieces:
            task = items[piece.task.task_id].task
            del task.gang_task_ids[:]
            task.gang_task_ids.extend(members)
            task.lease = gm._lease
            task.timestamps.dequeued_unix_nanos = task.timestamps.decided_unix_nanos = now
        book(gm.view, plan, time.monotonic())
        for item in job.items:
            item.batch.launching()
        try:
            reserved = await asyncio.gather(
                *(
                    self._reserve(lm, plan.gang_id, pieces, items, plan.layout)
                    for lm, pieces in by_lm.items()
                )
            )
            refusals = [why for why in reserved if why is not None]
            committed: set[str] = set()
            if not refusals:
                done = await asyncio.gather(
                    *(self._commit(lm, plan.gang_id, ps, items) for lm, ps in by_lm.items())
                )
                committed = {lm_id for lm_id, why in zip(by_lm, done, strict=True) if why is None}
                refusals = [why for why in done if why is not None]
            for lm_id in committed:
                for piece in by_lm[lm_id]:
                    await gm._accepted(lm_id, items[piece.task.task_id])
            if not refusals:
                placed = {piece.task.task_id for piece in plan.pieces}
                rest = [item for item in job.items if item.task.task_id not in placed]
                if rest:  # min_tasks: the others start one by one, as room frees
                    gm._push(job.queue, rest)
                log.info(
                    "a gang started",
                    extra={"job_id": job.job_id, "gang_id": plan.gang_id, "lms": list(by_lm)},
                )
                job.items = []
                return True
            # Refused somewhere: released everywhere, the view's bookings undone, then
            # corrected by the LMs' fresh states.
            await self._release_all(plan, by_lm, committed)
            why = "; ".join(refusals)
            log.info("a gang was refused", extra={"job_id": job.job_id, "why": why})
            if committed:
                log.error(
                    "a gang started in part: an LM refused its commit after another "
                    "committed; the rest is planned again as a gang",
                    extra={"job_id": job.job_id, "committed": sorted(committed)},
                )
                started = {p.task.task_id for lm in committed for p in by_lm[lm]}
                job.items = [i for i in job.items if i.task.task_id not in started]
                job.min_tasks = max(0, job.min_tasks - len(started))
            for item in job.items:
                gm.jobs.set_reason(job.job_id, item.task.task_id, f"its gang was refused: {why}")
            return False
        finally:
            for item in items.values():
                item.batch.landed()

    async def _release_all(
        self, plan: GangPlan, by_lm: dict[str, list[GangPiece]], committed: set[str]
    ) -> None:
        gm = self.gm
        unbook(gm.view, plan, [p for p in plan.pieces if p.lm_id not in committed])
        lms = [lm_id for lm_id in by_lm if lm_id not in committed]
        replies = await asyncio.gather(*(self._release(lm_id, plan.gang_id) for lm_id in lms))
        for reply in replies:
            if reply is not None and reply.HasField("state"):
                await gm._apply_state(reply.state)

    def _known(self, lm_id: str) -> int:
        lmv = self.gm.view.lms.get(lm_id)
        return lmv.version if lmv is not None else 0

    async def _reserve(
        self,
        lm_id: str,
        gang_id: str,
        pieces: list[GangPiece],
        items: dict[str, Pending],
        layout: VdcLayout | None = None,
    ) -> str | None:
        """ReserveGang on ``lm_id``: None if held, else why not."""
        gm = self.gm
        request = local_master_pb2.ReserveGangRequest(
            gm_id=gm.gm_id,
            gang_id=gang_id,
            ttl_s=DEFAULT_TTL_S,
            known_version=self._known(lm_id),
            expires_unix_nanos=gm._expiry(lm_id),
        )
        if layout is not None:
            request.layout.CopyFrom(layout_to_proto(layout))
        for piece in pieces:
            request.placements.add(
                task=items[piece.task.task_id].task,
                node_index=piece.node,
                node_id=piece.node_id,
                repartition=piece.repartition,
                member=piece.member,
                # With a VDC: the member's uplink share, booked as its net_mbps.
                net_mbps=int(piece.task.resources[NET]) if layout is not None else 0,
            )
        try:
            reply = await gm._stubs[lm_id].ReserveGang(request, timeout=gm.config.lm_call_timeout_s)
        except grpc.aio.AioRpcError as err:
            return f"{lm_id} did not answer its reservation ({err.code().name})"
        return await self._verdict(lm_id, reply)

    async def _verdict(self, lm_id: str, reply) -> str | None:
        """None if the LM's reply says yes; else why not, its fresh state applied."""
        status = placement_status_from_proto(reply.status)
        if status.ok:
            return None
        if reply.HasField("state"):
            await self.gm._apply_state(reply.state)
        return f"{lm_id}: {reply.reason or status.name}"

    async def _commit(
        self, lm_id: str, gang_id: str, pieces: list[GangPiece], items: dict[str, Pending]
    ) -> str | None:
        """CommitGang on ``lm_id``: None if its pieces started, else why not. Not
        answered, the LM is asked (with a fence) which of the tasks it holds."""
        gm = self.gm
        request = local_master_pb2.CommitGangRequest(
            gm_id=gm.gm_id, gang_id=gang_id, known_version=self._known(lm_id)
        )
        try:
            reply = await gm._stubs[lm_id].CommitGang(request, timeout=gm.config.lm_call_timeout_s)
        except grpc.aio.AioRpcError as err:
            held = await gm._settle(lm_id, [items[p.task.task_id] for p in pieces])
            if all(p.task.task_id in held for p in pieces):
                return None
            return f"{lm_id} did not answer its commit ({err.code().name})"
        return await self._verdict(lm_id, reply)

    async def _release(
        self, lm_id: str, gang_id: str
    ) -> local_master_pb2.ReleaseGangResponse | None:
        """ReleaseGang on ``lm_id``; unanswered, its reservation expires there."""
        gm = self.gm
        request = local_master_pb2.ReleaseGangRequest(
            gm_id=gm.gm_id, gang_id=gang_id, known_version=self._known(lm_id)
        )
        try:
            return await gm._stubs[lm_id].ReleaseGang(request, timeout=gm.config.lm_call_timeout_s)
        except grpc.aio.AioRpcError as err:
            log.warning(
                "ReleaseGang not answered; the LM lets the reservation expire",
                extra={"lm": lm_id, "gang_id": gang_id, "code": err.code().name},
            )
            return None


def gang_fields(batch: common_pb2.TaskBatch) -> tuple[bool, int]:
    """Whether a queued message is a gang's, and its ``min_tasks``."""
    return batch.gang or batch.min_tasks > 0, batch.min_tasks
