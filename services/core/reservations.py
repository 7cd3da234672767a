"""The LM's side of a gang's two-phase reserve/commit, as a pure state machine.

    GM: plan_gang ──Reserve(gang, pieces)──> every LM ──all ACCEPTED──> Commit(gang) ──> run
                                        any refusal ──> Release(gang) on every LM
    LM:  reserve: validate every piece, book a placeholder per piece ─ held until deadline
         commit:  placeholders -> the real tasks (launch / repartition), in one step
         release / expire(now): placeholders off the books; free room exactly as before

Model and assumptions:

- What a reservation holds is booked in the LM's ``ClusterState`` as ordinary
  allocations, one **placeholder** per piece (id ``<task>#gang<life>.<n>``; same queue,
  job, constraints, resources and CPU usage as the member). So every check a launch gets
  (node known, alive, not draining, partition, constraints, the LM's policy) is the one
  the reservation gets, GMs see the room taken in the next heartbeat, and releasing a
  placeholder gives back exactly what it took. The commit releases each placeholder and
  launches the real task into the room it left, after checking that none of them can be
  refused (``ClusterState.refusal``): all pieces become tasks, or none does.
- Idempotent by gang id, and a gang id names one *attempt* to place a gang (a GM that
  re-plans after a refusal uses a new one, e.g. ``job/2``): a retry with the same pieces
  gets the same verdict back while the reservation is held or committed; other pieces
  under the same id are refused; a released or expired id is refused for ``ttl_s``
  (a late copy of its Reserve must not hold room again). A refused reserve holds nothing
  and is not remembered: a retry is judged again on fresh books.
- Time comes in as ``now`` (seconds, any monotonic origin); the driver calls
  ``expire(now)`` from its timer. A reservation not committed by its deadline is released.
- The LM's driver must keep placeholders away from workers and the watchdog (they run
  nowhere): ``is_placeholder`` tells them apart.
- With a VDC layout the uplink is checked first with ``vdc.fits_uplinks`` on this LM's
  nodes (the GM planned with the same function), and each piece must book exactly its
  member's uplink share as ``net_mbps``.
- **Room held for a gang** (``hold_room``): a victim preempted for a waiting gang job
  leaves its room booked as a placeholder for that job (id ``room_id(victim, job)``,
  the victim's node, resources and queue) until ``now + ttl_s``: the room the gang
  preempted for is the gang's, not whoever's launch reaches the LM first (another GM
  that heard of the freed room, the victims' own next attempts). The job's first
  reserve here takes every room held for it (released, then the pieces booked; a
  refusal books them again as they were); ``expire`` releases what no reserve took.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from services.core.cancels import CancelledJobs
from services.core.cluster_state import ClusterState, Decision
from services.core.gang import GangPiece, VdcLayout
from services.core.resources import CPU, NET
from services.core.snapshot import Allocation
from services.core.status import PlacementStatus
from services.core.task import TaskSpec
from services.core.vdc import UNJUDGED, fits_uplinks, member_uplink

# How long an LM holds a gang's room for its commit: far above a reserve/commit round
# trip, short enough that room held by a GM that died comes back soon. What a GM asks
# (``ReserveGang.ttl_s``; 0: the default) is held within the bounds (``held_for``).
DEFAULT_TTL_S = 5.0
TTL_MIN_S, TTL_MAX_S = 0.1, 60.0


def held_for(asked_s: float) -> float:
    """How long a reservation asked to be held ``asked_s`` (0: the default) is held."""
    return min(max(asked_s or DEFAULT_TTL_S, TTL_MIN_S), TTL_MAX_S)


_MARK = "#gang"
_ROOM = "#gang-room:"  # a placeholder holding a preempted victim's room for a gang job


def is_placeholder(task_id: str) -> bool:
    """Whether an allocation is a reservation's placeholder (no worker runs it)."""
    return _MARK in task_id


def room_id(victim_task_id: str, job_id: str) -> str:
    """The placeholder that holds ``victim_task_id``'s room for gang job ``job_id``
    (``Reservations.hold_room``); the GM that preempted names it the same way."""
    return f"{victim_task_id}{_ROOM}{job_id}"


class Held(enum.Enum):
    HELD = "held"
    COMMITTED = "committed"
    GONE = "gone"  # released or expired: the id is refused until ``until``


@dataclass(frozen=True, slots=True)
class GangVerdict:
    """An LM's answer to Reserve / Commit for one gang, with the reason a person needs.

    ``allocations``: the placeholders (reserve) or the real tasks (commit) it booked.
    """

    gang_id: str
    status: PlacementStatus
    reason: str = ""
    allocations: tuple[Allocation, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status.ok


@dataclass(frozen=True, slots=True)
class _Room:
    holder_id: str
    node: int
    resources: np.ndarray
    queue: str
    partition: int
    logical: bool
    deadline: float


@dataclass(slots=True)
class _Record:
    key: tuple
    gm_id: str
    pieces: tuple[GangPiece, ...]
    placeholders: tuple[str, ...]
    deadline: float
    ttl_s: float
    reserved: GangVerdict
    state: Held = Held.HELD
    committed: GangVerdict | None = None
    until: float = 0.0  # GONE / COMMITTED: remembered until then
    reason: str = ""


def _key(gm_id: str, pieces: Sequence[GangPiece]) -> tuple:
    """What makes two Reserve requests the same request."""
    pieces_key = sorted(
        (
            p.member,
            p.task.task_id,
            p.task.attempt,
            p.node,
            p.repartition,
            p.task.resources.tobytes(),
        )
        for p in pieces
    )
    return (gm_id, *pieces_key)


class Reservations:
    """The gangs an LM holds room for, over its books (``cluster``)."""

    def __init__(self, cluster: ClusterState, cancelled: CancelledJobs | None = None):
        """``cancelled``: the LM's cancelled jobs (``Lifecycle.cancelled``); a gang of one
        holds nothing here."""
        self.cluster = cluster
        self.cancelled = cancelled if cancelled is not None else CancelledJobs()
        # Gang id -> its reservation, held, committed or gone (until ``expire`` forgets it).
        self._records: dict[str, _Record] = {}
        self._sequence = 0  # numbers placeholders: a new id per reservation
        # Gang job id -> the room preempted victims left it (``hold_room``).
        self._rooms: dict[str, list[_Room]] = {}

    # ------------------------------------------------------------ held room
    def hold_room(self, job_id: str, victim: Allocation, now: float, ttl_s: float) -> Allocation:
        """Book the room ``victim`` (just released from the books: preempted for gang job
        ``job_id``) held, for that job alone, until ``now + ttl_s``: a placeholder on its
        node with its resources, in its queue and partition (fairness and the owner's
        books see nothing change until the gang takes it). Holding again what is held
        already (a retried preemption) changes nothing."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        holder_id = room_id(victim.task_id, job_id)
        held = self.cluster.allocations.get(holder_id)
        if held is not None:
            return held
        room = _Room(
            holder_id,
            victim.node,
            victim.resources.copy(),
            victim.queue,
            victim.partition,
            victim.logical,
            now + ttl_s,
        )
        self._rooms.setdefault(job_id, []).append(room)
        return self._book_room(job_id, room)

    def rooms_held(self, job_id: str) -> list[str]:
        """The placeholders holding room for gang job ``job_id`` here."""
        return [room.holder_id for room in self._rooms.get(job_id, ())]

    def _book_room(self, job_id: str, room: _Room) -> Allocation:
        holder = TaskSpec(
            task_id=room.holder_id,
            resources=room.resources,
            queue=room.queue,
            job_id=job_id,
            gang=True,  # never a preemption's victim
        )
        return self.cluster.hold(holder, room.node, room.partition, room.logical)

    def _take_rooms(self, job_id: str) -> list[_Room]:
        """Release the room held for ``job_id`` so that its reserve books its pieces
        there; ``_give_rooms`` books them again if the reserve is refused."""
        # Only what was still booked: a dead node took the rest off the books (its room
        # may hold another task since), so it is not booked again on a refusal.
        rooms = self._rooms.pop(job_id, [])
        return [room for room in rooms if self.cluster.release(room.holder_id) is not None]

    def _give_rooms(self, job_id: str, rooms: list[_Room]) -> None:
        for room in rooms:
            self._book_room(job_id, room)
        if rooms:
            self._rooms[job_id] = rooms

    # ----------------------------------------------------------------- reserve
    def reserve(
        self,
        gang_id: str,
        pieces: Sequence[GangPiece],
        now: float,
        ttl_s: float,
        *,
        gm_id: str,
        layout: VdcLayout | None = None,
    ) -> GangVerdict:
        """Hold room for every piece until ``now + ttl_s``, or for none (with why)."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        for piece in pieces:  # a cancelled job's gang holds nothing, retried or not
            why = self.cancelled.refusal(piece.task.job_id)
            if why is not None:
                return self._refused(gang_id, PlacementStatus.REJECTED_CANCELLED, why)
        key = _key(gm_id, pieces)
        record = self._records.get(gang_id)
        if record is not None:
            if record.state is Held.GONE:
                return self._refused(gang_id, PlacementStatus.REJECTED_EXPIRED, record.reason)
            if record.key != key:
                return self._refused(
                    gang_id,
                    PlacementStatus.REJECTED_INVALID,
                    f"gang {gang_id} is already {record.state.value} here with other pieces",
                )
            if record.state is Held.HELD and now >= record.deadline:
                self._drop(gang_id, record, now, f"gang {gang_id}'s reservation expired")
                return self._refused(gang_id, PlacementStatus.REJECTED_EXPIRED, record.reason)
            return record.reserved  # a retry: the same answer
        problem = self._invalid(gang_id, pieces, layout)
        if problem is not None:
            return problem
        early = self._refusal(gang_id, gm_id, pieces)
        if early is not None:
            return early
        job_id = pieces[0].task.job_id
        rooms = self._take_rooms(job_id)  # the room preempted for this job is its own
        if layout is not None:
            up = self._uplinks(gang_id, pieces, layout)
            if up is not None:
                self._give_rooms(job_id, rooms)
                return up
        self._sequence += 1
        booked: list[Allocation] = []
        for piece in pieces:
            holder = _placeholder(piece.task, self.cluster.incarnation, self._sequence)
            decision = self._place(gm_id, holder, piece)
            if not decision.ok or decision.allocation is None:
                for allocation in booked:  # all or nothing
                    self.cluster.release(allocation.task_id)
                self._give_rooms(job_id, rooms)
                node = self.cluster.table.node_ids[piece.node]
                why = f"{piece.task.task_id} on {node}: {decision.reason}"
                return self._refused(gang_id, decision.status, why)
            booked.append(decision.allocation)
        verdict = GangVerdict(gang_id, PlacementStatus.ACCEPTED, "", tuple(booked))
        self._records[gang_id] = _Record(
            key=key,
            gm_id=gm_id,
            pieces=tuple(pieces),
            placeholders=tuple(a.task_id for a in booked),
            deadline=now + ttl_s,
            ttl_s=ttl_s,
            reserved=verdict,
        )
        return verdict

    # ------------------------------------------------------------------ commit
    def commit(self, gang_id: str, now: float) -> GangVerdict:
        """Turn a live reservation into the real tasks, all in one step; committing again
        returns the same verdict. Refused (and released) when it expired or lost a piece
        (its node died); the GM then releases the gang everywhere."""
        record = self._records.get(gang_id)
        if record is None:
            return self._refused(
                gang_id,
                PlacementStatus.REJECTED_EXPIRED,
                f"no reservation of gang {gang_id} here (never made, or long gone)",
            )
        if record.state is Held.COMMITTED:
            assert record.committed is not None
            return record.committed
        if record.state is Held.GONE:
            return self._refused(gang_id, PlacementStatus.REJECTED_EXPIRED, record.reason)
        if now >= record.deadline:
            self._drop(gang_id, record, now, f"gang {gang_id}'s reservation expired")
            return self._refused(gang_id, PlacementStatus.REJECTED_EXPIRED, record.reason)
        cluster = self.cluster
        for holder_id, piece in zip(record.placeholders, record.pieces, strict=True):
            held = cluster.allocations.get(holder_id)
            if held is None or held.node != piece.node:
                why = f"gang {gang_id} lost its room on node {piece.node_id} (node lost)"
                self._drop(gang_id, record, now, why)
                return self._refused(gang_id, PlacementStatus.REJECTED_NODE_DEAD, why)
        for piece in record.pieces:
            refusal = cluster.refusal(record.gm_id, piece.task, piece.node)
            if refusal is not None:
                why = f"{piece.task.task_id}: {refusal.reason}"
                self._drop(gang_id, record, now, f"gang {gang_id} refused at commit: {why}")
                return self._refused(gang_id, refusal.status, why)
        started: list[Allocation] = []
        for holder_id, piece in zip(record.placeholders, record.pieces, strict=True):
            cluster.release(holder_id)
            decision = self._place(record.gm_id, piece.task, piece)
            if decision.allocation is None or decision.status is not PlacementStatus.ACCEPTED:
                # Unreachable: the room was just freed and every check passed. Undo all
                # rather than leave part of a gang running.
                for allocation in started:
                    cluster.release(allocation.task_id)
                why = f"{piece.task.task_id}: {decision.reason}"
                self._drop(gang_id, record, now, f"gang {gang_id} failed at commit: {why}")
                return self._refused(gang_id, decision.status, why)
            started.append(decision.allocation)
        record.state = Held.COMMITTED
        record.until = now + record.ttl_s
        record.committed = GangVerdict(gang_id, PlacementStatus.ACCEPTED, "", tuple(started))
        return record.committed

    # ------------------------------------------------------- release / expire
    def release(self, gang_id: str, now: float = 0.0) -> bool:
        """Give back what a held reservation holds; whether it held anything. A committed
        gang's tasks are not touched (they run: ending them is the lifecycle's business).
        The id is refused afterwards for the reservation's ``ttl_s`` from ``now``."""
        record = self._records.get(gang_id)
        if record is None or record.state is not Held.HELD:
            return False
        self._drop(gang_id, record, now, f"gang {gang_id} was released")
        return True

    def expire(self, now: float) -> list[str]:
        """Release every reservation past its deadline; their gang ids. Also forgets the
        ids released or committed more than their ``ttl_s`` ago, and releases the room
        held for a gang job (``hold_room``) that no reserve took by its deadline."""
        for job_id, rooms in list(self._rooms.items()):
            kept = []
            for room in rooms:
                if now >= room.deadline:
                    self.cluster.release(room.holder_id)  # no reserve came for it
                else:
                    kept.append(room)
            if kept:
                self._rooms[job_id] = kept
            else:
                del self._rooms[job_id]
        released = []
        for gang_id, record in list(self._records.items()):
            if record.state is Held.HELD and now >= record.deadline:
                self._drop(gang_id, record, now, f"gang {gang_id}'s reservation expired")
                released.append(gang_id)
            elif record.state is not Held.HELD and now >= record.until:
                del self._records[gang_id]
        return released

    # --------------------------------------------------------------- queries
    def state(self, gang_id: str) -> Held | None:
        record = self._records.get(gang_id)
        return None if record is None else record.state

    def held(self) -> list[str]:
        """Gang ids with room held now, in reservation order."""
        return [g for g, r in self._records.items() if r.state is Held.HELD]

    def next_deadline(self) -> float | None:
        """When ``expire`` next has something to do (for the driver's timer)."""
        times = [r.deadline if r.state is Held.HELD else r.until for r in self._records.values()]
        times += [room.deadline for rooms in self._rooms.values() for room in rooms]
        return min(times, default=None)

    # ------------------------------------------------------------- internals
    def _refused(self, gang_id: str, status: PlacementStatus, reason: str) -> GangVerdict:
        if status.ok:  # a refusal never reads as a success
            status = PlacementStatus.REJECTED_INVALID
        return GangVerdict(gang_id, status, reason)

    def _drop(self, gang_id: str, record: _Record, now: float, reason: str) -> None:
        for holder_id in record.placeholders:
            self.cluster.release(holder_id)  # idempotent: a lost node's are gone already
        record.state = Held.GONE
        record.until = now + record.ttl_s
        record.reason = reason

    def _place(self, gm_id: str, task: TaskSpec, piece: GangPiece) -> Decision:
        if piece.repartition:
            return self.cluster.repartition(gm_id, task, piece.node)
        return self.cluster.launch(gm_id, task, piece.node)

    def _invalid(
        self, gang_id: str, pieces: Sequence[GangPiece], layout: VdcLayout | None
    ) -> GangVerdict | None:
        bad = PlacementStatus.REJECTED_INVALID
        if not pieces:
            return self._refused(gang_id, bad, f"gang {gang_id}: no pieces to reserve")
        ids = [p.task.task_id for p in pieces]
        if len(set(ids)) != len(ids):
            return self._refused(gang_id, bad, f"gang {gang_id} names a task twice")
        if any(is_placeholder(i) for i in ids):
            return self._refused(gang_id, bad, f"gang {gang_id}: a task id contains {_MARK!r}")
        for piece in pieces:
            if piece.lm_id != self.cluster.lm_id:
                why = f"piece {piece.task.task_id} is for {piece.lm_id}, not {self.cluster.lm_id}"
                return self._refused(gang_id, bad, why)
            table = self.cluster.table
            if not 0 <= piece.node < table.size or table.node_ids[piece.node] != piece.node_id:
                return self._refused(
                    gang_id,
                    PlacementStatus.REJECTED_UNKNOWN_NODE,
                    f"no node {piece.node_id} at index {piece.node} here",
                )
        if layout is not None:
            members = np.array([p.member for p in pieces])
            if members.min() < 0 or members.max() >= len(layout.slots):
                return self._refused(gang_id, bad, f"gang {gang_id}: member outside its layout")
        return None

    def _refusal(self, gang_id: str, gm_id: str, pieces: Sequence[GangPiece]) -> GangVerdict | None:
        """The real tasks must be launchable at commit: refuse now what would be then."""
        for piece in pieces:
            refusal = self.cluster.refusal(gm_id, piece.task, piece.node)
            if refusal is not None:
                return self._refused(
                    gang_id, refusal.status, f"{piece.task.task_id}: {refusal.reason}"
                )
        return None

    def _uplinks(
        self, gang_id: str, pieces: Sequence[GangPiece], layout: VdcLayout
    ) -> GangVerdict | None:
        """The LM's check of the VDC's traffic over its own nodes' uplinks."""
        slots = np.asarray(layout.slots, dtype=np.int64)
        share = member_uplink(layout.vdc, layout.cpu_milli, slots)
        free = np.full(int(slots.max(initial=-1)) + 1, UNJUDGED, dtype=np.int64)
        names = [f"slot {k} (another LM's)" for k in range(len(free))]
        row_of: dict[int, int] = {}
        for piece in pieces:
            slot = int(slots[piece.member])
            wrong = (
                slot < 0
                or row_of.setdefault(slot, piece.node) != piece.node
                or piece.task.resources[NET] != share[piece.member]
                or piece.task.resources[CPU] != layout.cpu_milli[piece.member]
            )
            if wrong:
                return self._refused(
                    gang_id,
                    PlacementStatus.REJECTED_INVALID,
                    f"piece {piece.task.task_id} disagrees with gang {gang_id}'s VDC layout",
                )
            free[slot] = self.cluster.table.free[NET, piece.node]
            names[slot] = piece.node_id
        if len(set(row_of.values())) != len(row_of):
            return self._refused(
                gang_id, PlacementStatus.REJECTED_INVALID, f"gang {gang_id}: two slots, one node"
            )
        fit = fits_uplinks(layout.vdc, layout.cpu_milli, slots, free, names)
        if not fit:
            return self._refused(gang_id, PlacementStatus.REJECTED_RESOURCES, fit.reason)
        return None


def _placeholder(task: TaskSpec, incarnation: int, sequence: int) -> TaskSpec:
    """A stand-in holding exactly what ``task`` will; a new id per reservation (and per
    life of the LM), so that its end (release) never makes a later reservation of the
    same task a duplicate."""
    holder_id = f"{task.task_id}{_MARK}{incarnation}.{sequence}"
    return replace(task, task_id=holder_id, attempt=0, lease=0)
