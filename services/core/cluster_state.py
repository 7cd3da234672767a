"""The LM's authoritative books: which task holds what on which node, for which GM.

Every node belongs to exactly one partition, one per GM. GM requests are validated here
and either applied whole or rejected with a reason; nothing is half-done. The three
requests follow the paper:

- ``launch``: node in the requesting GM's own partition.
- ``repartition``: node in another GM's partition; exactly the task's resources are
  carved out as a logical node of the requester and return to the owner on release.
- ``preempt``: victims still run on the node and their queues are still over share;
  they are released (to be re-queued by their GM) and the task takes their place.

Requests are idempotent by ``(task_id, attempt)``: a repeated launch changes nothing.
Task ids are global: a task id these books hold, or remember ended, under another job is
refused (``REJECTED_TASK_ID_TAKEN``), never taken for a repeat of that job's task.
After a restart the books start empty (a new ``incarnation``); ``adopt`` books again what
the workers say they run.

Books per node: ``free`` (capacity minus the running tasks' requests) and, for GPA, the
sums of their CPU usage means and variances (``gpa.task_usage``; a task without a usage
estimate books its CPU request as mean, variance 0). Memory, disk and network are never
over-committed (free >= 0). CPU ``free`` is >= 0 under a strict policy; under GPA it may
go negative (oversubscription) but only through launches that passed the GPA test, so
every node's P(cpu usage > capacity) was <= rho when its last task arrived, and releases
only lower it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from services.core.constraints import DEFAULT_NUM_CONSTRAINTS, from_mask
from services.core.fairness import usage_by_queue
from services.core.gpa import task_usage
from services.core.match import FirstFit, PlacementPolicy
from services.core.node_table import NodeTable
from services.core.recent import Recent, RecentInts
from services.core.resources import NUM_RESOURCES, format_resources, validate_capacity
from services.core.snapshot import Allocation, Snapshot
from services.core.status import PlacementStatus
from services.core.task import TaskSpec


@dataclass(frozen=True, slots=True)
class Decision:
    status: PlacementStatus
    reason: str = ""
    allocation: Allocation | None = None
    preempted: tuple[Allocation, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status.ok


# How many ended attempts an LM remembers to refuse their retries (about 120 bytes each,
# the task id included: scripts/ended_bench.py; about 25 more with their job, whose string
# the tasks of a job launched together share).
# A GM that dies redelivers the messages it had not acked, and it acks a message once all
# its tasks have launched; a task that ended more than this many endings before such a
# redelivery is not recognised and runs again.
ENDED_KEPT = 1_000_000


class ClusterState:
    """One LM's nodes, partitions and running allocations, versioned for heartbeats."""

    def __init__(
        self,
        lm_id: str,
        gm_ids: Sequence[str],
        num_constraints: int = DEFAULT_NUM_CONSTRAINTS,
        policy: PlacementPolicy | None = None,
        delta_history: int = 100_000,
        incarnation: int = 0,
        ended_kept: int = ENDED_KEPT,
    ):
        if not gm_ids:
            raise ValueError("an LM needs at least one GM (one partition per GM)")
        if len(set(gm_ids)) != len(gm_ids):
            raise ValueError(f"GM ids must be unique, got {list(gm_ids)}")
        self.lm_id = lm_id
        self.incarnation = incarnation  # which life of the LM these books belong to
        self.gm_ids = tuple(gm_ids)
        self._partition_of = {gm: p for p, gm in enumerate(self.gm_ids)}
        self.table = NodeTable(len(self.gm_ids), num_constraints)
        self.policy: PlacementPolicy = policy or FirstFit()
        self.version = 0
        self.allocations: dict[str, Allocation] = {}  # insertion order = version order
        self._by_node: dict[int, set[str]] = collections.defaultdict(set)
        self._free_version = np.zeros(0, dtype=np.int64)
        self._static_version = np.zeros(0, dtype=np.int64)
        self._ended: collections.deque[tuple[int, str]] = collections.deque()
        self._delta_history = delta_history
        self._delta_floor = 0  # deltas from a base below this need a full snapshot
        # The newest ``ended_kept`` ended attempts, oldest first: a retry of one of them
        # is a duplicate. Bounded, so a long-lived LM does not grow by a task per task.
        self._ended_attempt = RecentInts(ended_kept)
        # The job of each of those that this LM knows (not those recalled from a journal
        # that had no event of them left): another job's task with the same id is refused.
        self._ended_job: Recent[str] = Recent(ended_kept)
        self._last_job_id = ""  # see _allocate
        # Per task, the lease a GM fenced it with (``fence``): a placement with an older
        # lease is refused, so a request a GM gave up on (or whose GM died and whose
        # message another took over) is harmless when an LM reads it late.
        self._fences = RecentInts(ended_kept)
        self._sequence = 0
        # Nodes an operator drains: they keep their tasks and take no new ones, and
        # heartbeats show them with nothing free, so that GMs stop matching them.
        self.draining: set[int] = set()

    # ------------------------------------------------------------------ nodes
    def partition_of(self, gm_id: str) -> int | None:
        return self._partition_of.get(gm_id)

    def add_node(
        self,
        node_id: str,
        capacity: np.ndarray,
        constraint_mask: int = 0,
        partition: int | None = None,
        address: str = "",
    ) -> int:
        """Register a node; without a partition it joins the smallest one."""
        validate_capacity(capacity)
        if constraint_mask >> self.table.num_constraints:
            bad = [c for c in from_mask(constraint_mask) if c >= self.table.num_constraints]
            raise ValueError(f"node {node_id!r} claims unknown constraints {bad}")
        if partition is None:
            partition = int(self.table.partition_sizes().argmin())
        index = self.table.add(node_id, capacity, constraint_mask, partition, address)
        self.version += 1
        if index < len(self._free_version):  # a vacant row (a forgotten node's)
            self._free_version[index] = self._static_version[index] = self.version
        else:
            self._free_version = np.append(self._free_version, self.version)
            self._static_version = np.append(self._static_version, self.version)
        return index

    def forget_node(self, index: int) -> bool:
        """Vacate a dead node's row (``NodeTable.vacate``): its id leaves the books, full
        snapshots no longer list it, and the next delta shows the row empty; a new node
        may take it. Refused (False) for a node alive, or holding allocations."""
        if not 0 <= index < self.table.size or index in self.table.vacant:
            return False
        if self.table.is_alive(index) or self._by_node.get(index):
            return False
        self._by_node.pop(index, None)
        self.draining.discard(index)
        self.table.vacate(index)
        self.version += 1
        self._free_version[index] = self._static_version[index] = self.version
        return True

    def drain(self, index: int, on: bool = True) -> bool:
        """Drain a node (``on``) or let it take tasks again; whether that changed it.
        Its running tasks are not touched."""
        if not 0 <= index < self.table.size:
            raise IndexError(f"no node with index {index}")
        if (index in self.draining) == on:
            return False
        if on:
            self.draining.add(index)
        else:
            self.draining.discard(index)
        self.version += 1
        self._free_version[index] = self.version  # the next delta shows what it offers
        return True

    def set_alive(self, index: int, alive: bool) -> list[Allocation]:
        """Mark a node alive or dead. A dead node's tasks are released and returned so
        the caller re-queues them; it takes no new work until it is alive again."""
        if self.table.is_alive(index) == alive:
            return []
        self.version += 1
        self.table.set_alive(index, alive)
        self._static_version[index] = self.version
        if alive:
            return []
        lost = [self.allocations[t] for t in self.task_ids_on(index)]
        for allocation in lost:
            self._release(allocation)
        return lost

    # --------------------------------------------------------------- requests
    def launch(self, gm_id: str, task: TaskSpec, node: int) -> Decision:
        return self._place(gm_id, task, node, repartition=False)

    def repartition(self, gm_id: str, task: TaskSpec, node: int) -> Decision:
        return self._place(gm_id, task, node, repartition=True)

    def preempt(
        self,
        gm_id: str,
        task: TaskSpec,
        node: int,
        victim_ids: Sequence[str],
        is_over_share: Callable[[str], bool],
    ) -> Decision:
        """Kill ``victim_ids`` on ``node`` and launch ``task`` there, if still justified."""
        early = self._check_common(gm_id, task, node)
        if early is not None:
            return early
        if not victim_ids:
            return Decision(PlacementStatus.REJECTED_VICTIMS, "no victims named")
        victims = []
        node_id = self.table.node_ids[node]
        for vid in victim_ids:
            victim = self.allocations.get(vid)
            if victim is None or victim.node != node:
                return Decision(
                    PlacementStatus.REJECTED_VICTIMS,
                    f"victim {vid} no longer runs on node {node_id}",
                )
            if victim.gang:
                return Decision(
                    PlacementStatus.REJECTED_VICTIMS,
                    f"victim {vid} is a gang's task: gangs are never preempted",
                )
            if not is_over_share(victim.queue):
                return Decision(
                    PlacementStatus.REJECTED_VICTIMS,
                    f"victim {vid}'s queue {victim.queue} is no longer over its share",
                )
            victims.append(victim)
        # "Would it fit once the victims are gone?" is asked of the books with them gone,
        # so every policy answers with its usual test (GPA needs their usage sums, not
        # just their requests). Undone at once: the books are exact (integer-valued).
        table = self.table
        for v in victims:
            table.give_back(v.node, v.resources, v.usage_mean, v.usage_var)
        try:
            fits = self.policy.fits(table, node, task)
            reason = "" if fits else self._resource_reason(task, node)
        finally:
            for v in victims:
                table.take(v.node, v.resources, v.usage_mean, v.usage_var)
        if not fits:
            return Decision(PlacementStatus.REJECTED_RESOURCES, reason)
        for victim in victims:
            self._release(victim)
        partition = self._partition_of[gm_id]
        logical = int(self.table.owner[node]) != partition
        allocation = self._allocate(task, node, partition, logical)
        return Decision(PlacementStatus.ACCEPTED, allocation=allocation, preempted=tuple(victims))

    def refusal(self, gm_id: str, task: TaskSpec, node: int) -> Decision | None:
        """What a placement of ``task`` on ``node`` would be refused for before its room
        and partition are looked at (id taken, fenced, duplicate, unknown GM or node,
        dead, draining, constraints); None if nothing. Changes nothing: lets a caller
        check a group before placing any of it (a gang's commit, reservations.py)."""
        return self._check_common(gm_id, task, node)

    def task_ids_on(self, node: int) -> list[str]:
        """The tasks booked on ``node``, in id order."""
        return sorted(self._by_node.get(node, ()))

    def adopt(self, task: TaskSpec, node: int) -> Allocation | None:
        """Book a task that ``node`` says it runs but these books do not hold: the LM
        restarted and lost them, and the worker tells it on registering again.

        Booked in the node's owner partition (which GM borrowed it by repartition went
        with the old books; the resources return to the owner when it ends either way),
        with no checks: it already runs. None when the books hold this attempt or a
        later one, saw it end, or know its id as another job's: the caller kills what
        the worker still runs of it.
        """
        refusals = (self._taken(task), self._duplicate(task), self._fenced(task))
        if any(refusal is not None for refusal in refusals):
            return None
        if not 0 <= node < self.table.size:
            raise ValueError(f"no node with index {node}")
        return self._allocate(task, node, int(self.table.owner[node]), logical=False)

    def hold(self, task: TaskSpec, node: int, partition: int, logical: bool) -> Allocation:
        """Book ``task`` (a placeholder holding room: ``Reservations.hold_room``) on
        ``node`` in ``partition`` exactly as given, with no checks: it takes the room an
        allocation just released there, so it fits."""
        if not 0 <= node < self.table.size:
            raise ValueError(f"no node with index {node}")
        return self._allocate(task, node, partition, logical)

    def release(self, task_id: str) -> Allocation | None:
        """Give a task's resources back (to the owner partition, for a logical node).

        Idempotent: releasing an unknown or already released task returns None.
        """
        allocation = self.allocations.get(task_id)
        if allocation is None:
            return None
        self._release(allocation)
        return allocation

    def remember_ended(self, task_id: str, attempt: int, job_id: str = "") -> None:
        """Note that ``attempt`` of ``task_id`` ended (a retry of it is a duplicate; the
        same id in another job than ``job_id``, when known, is refused): on every
        release, and from the LM's journal when it restarts."""
        self._ended_attempt.put_max(task_id, attempt)
        if job_id:
            self._ended_job.put(task_id, job_id)

    def fence(self, task_id: str, lease: int) -> None:
        """Refuse from now on every placement of ``task_id`` with a lease below
        ``lease`` (REJECTED_FENCED), and the adoption of a worker's copy below it. Asked
        by a GM that no longer knows whether an older request of the task was read here
        (it timed out, or its GM died): after this, a late copy does nothing."""
        self._fences.put_max(task_id, lease)

    def known_attempt(self, task_id: str) -> tuple[int, bool] | None:
        """The latest attempt of ``task_id`` launched here and whether it still runs;
        None if this LM never launched it."""
        current = self.allocations.get(task_id)
        if current is not None:
            return current.attempt, True
        ended = self._ended_attempt.get(task_id)
        return None if ended is None else (ended, False)

    # ----------------------------------------------------------- snapshots
    def snapshot(self, since_version: int | None = None) -> Snapshot:
        """Everything (``since_version`` None or too old), or what changed after it."""
        full = since_version is None or since_version < self._delta_floor
        if full:
            base = 0
            # Vacant rows are no nodes: a full state lists none (a view fills the gap).
            occupied = self.table.occupied()
            free_idx = occupied.astype(np.int64)
            nodes = self.table.columns(occupied)
            allocations = list(self.allocations.values())
            ended: list[str] = []
        else:
            assert since_version is not None
            base = min(since_version, self.version)
            free_idx = np.flatnonzero(self._free_version > base)
            nodes = self.table.columns(np.flatnonzero(self._static_version > base))
            allocations = []
            for allocation in reversed(self.allocations.values()):
                if allocation.version <= base:
                    break
                allocations.append(allocation)
            allocations.reverse()
            # _ended is in version order: walk back from the newest, stop at the base.
            ended = []
            for version, task_id in reversed(self._ended):
                if version <= base:
                    break
                ended.append(task_id)
            ended.reverse()
        return Snapshot(
            lm_id=self.lm_id,
            incarnation=self.incarnation,
            version=self.version,
            full=full,
            base_version=base,
            gm_ids=self.gm_ids,
            num_constraints=self.table.num_constraints,
            nodes=nodes,
            free_indices=free_idx,
            free=self._offered(free_idx),
            allocations=allocations,
            ended_task_ids=ended,
            usage_mean=self.table.usage_mean[free_idx],  # fancy indexing copies
            usage_var=self.table.usage_var[free_idx],
        )

    def _offered(self, indices: np.ndarray) -> np.ndarray:
        """What the nodes of ``indices`` have free for new tasks: nothing, if draining."""
        free = self.table.free[:, np.asarray(indices, dtype=np.int64)]  # a copy
        if self.draining:
            free[:, np.isin(indices, list(self.draining))] = 0
        return free

    # ----------------------------------------------------------- accounting
    def queue_usage(self) -> dict[str, np.ndarray]:
        """Resources held per user queue (what fairness measures shares with)."""
        return usage_by_queue(self.allocations.values())

    def borrowed(self) -> np.ndarray:
        """Per owner partition, resources lent to other GMs by repartition."""
        out = np.zeros((self.table.num_partitions, NUM_RESOURCES), dtype=np.int64)
        for allocation in self.allocations.values():
            if allocation.logical:
                out[int(self.table.owner[allocation.node])] += allocation.resources
        return out

    # ------------------------------------------------------------- internals
    def _taken(self, task: TaskSpec) -> Decision | None:
        """Another job's task with this id runs here or ended here: this one can never
        run here (a repeat of that task would be a DUPLICATE, and the GM would take it
        for launched). Unknown jobs (a journal's endings without their events, a request
        without a job) are not compared."""
        if not task.job_id:
            return None
        current = self.allocations.get(task.task_id)
        if current is not None:
            holder, how = current.job_id, "runs"
        else:
            holder, how = self._ended_job.get(task.task_id, ""), "ended"
        if not holder or holder == task.job_id:
            return None
        return Decision(
            PlacementStatus.REJECTED_TASK_ID_TAKEN,
            f"task id {task.task_id} is job {holder}'s (it {how} on {self.lm_id}), not job "
            f"{task.job_id}'s: task ids are unique across the federation",
        )

    def _duplicate(self, task: TaskSpec) -> Decision | None:
        current = self.allocations.get(task.task_id)
        if current is not None and current.attempt >= task.attempt:
            return Decision(PlacementStatus.DUPLICATE, "already running", allocation=current)
        if self._ended_attempt.get(task.task_id, -1) >= task.attempt:
            return Decision(PlacementStatus.DUPLICATE, f"attempt {task.attempt} already ended")
        return None

    def _fenced(self, task: TaskSpec) -> Decision | None:
        fence = self._fences.get(task.task_id, 0)
        if fence is None or task.lease >= fence:
            return None
        return Decision(
            PlacementStatus.REJECTED_FENCED,
            f"task {task.task_id} was fenced (lease {fence}): this request (lease "
            f"{task.lease}) was given up by its GM; nothing was done",
        )

    def _check_common(self, gm_id: str, task: TaskSpec, node: int) -> Decision | None:
        """Checks every request shares; None when the request may go on."""
        taken = self._taken(task)
        if taken is not None:
            return taken
        fenced = self._fenced(task)
        if fenced is not None:
            return fenced
        duplicate = self._duplicate(task)
        if duplicate is not None:
            return duplicate
        if gm_id not in self._partition_of:
            return Decision(PlacementStatus.REJECTED_UNKNOWN_GM, f"unknown GM {gm_id!r}")
        if not 0 <= node < self.table.size or node in self.table.vacant:
            # (A vacant row: its node was forgotten, lost for forget_lost_after_s.)
            return Decision(PlacementStatus.REJECTED_UNKNOWN_NODE, f"no node with index {node}")
        if not self.table.is_alive(node):
            return Decision(
                PlacementStatus.REJECTED_NODE_DEAD, f"node {self.table.node_ids[node]} is dead"
            )
        if node in self.draining:
            return Decision(
                PlacementStatus.REJECTED_NODE_DRAINING,
                f"node {self.table.node_ids[node]} is draining",
            )
        if not self.table.satisfies(node, task.constraint_mask):
            have = int(self.table.constraint_masks[node])
            missing = from_mask(task.constraint_mask & ~have)
            return Decision(
                PlacementStatus.REJECTED_CONSTRAINTS,
                f"node {self.table.node_ids[node]} lacks constraints {missing}",
            )
        return None

    def _place(self, gm_id: str, task: TaskSpec, node: int, repartition: bool) -> Decision:
        early = self._check_common(gm_id, task, node)
        if early is not None:
            return early
        partition = self._partition_of[gm_id]
        internal = int(self.table.owner[node]) == partition
        if internal == repartition:
            owner = self.gm_ids[int(self.table.owner[node])]
            hint = "use Launch" if internal else "use Repartition"
            return Decision(
                PlacementStatus.REJECTED_WRONG_PARTITION,
                f"node {self.table.node_ids[node]} is in {owner}'s partition; {hint}",
            )
        if not self.policy.fits(self.table, node, task):
            return Decision(PlacementStatus.REJECTED_RESOURCES, self._resource_reason(task, node))
        allocation = self._allocate(task, node, partition, logical=repartition)
        return Decision(PlacementStatus.ACCEPTED, allocation=allocation)

    def _allocate(self, task: TaskSpec, node: int, partition: int, logical: bool) -> Allocation:
        self.version += 1
        self._sequence += 1
        previous = self.allocations.get(task.task_id)
        if previous is not None:  # an older attempt still on the books: replaced
            self._release(previous)
        usage_mean, usage_var = task_usage(task)
        # One string for the tasks of a job launched one after another, not one each:
        # the books of ended attempts keep it for up to a million tasks.
        job_id = task.job_id
        if job_id == self._last_job_id:
            job_id = self._last_job_id
        self._last_job_id = job_id
        allocation = Allocation(
            task_id=task.task_id,
            queue=task.queue,
            node=node,
            resources=task.resources.copy(),
            partition=partition,
            logical=logical,
            sequence=self._sequence,
            attempt=task.attempt,
            version=self.version,
            usage_mean=usage_mean,
            usage_var=usage_var,
            job_id=job_id,
            gang=task.gang,
        )
        self.table.take(node, allocation.resources, usage_mean, usage_var)
        self._free_version[node] = self.version
        self.allocations[task.task_id] = allocation
        self._by_node[node].add(task.task_id)
        return allocation

    def _release(self, allocation: Allocation) -> None:
        """Completion, preemption and loss are booked alike: the attempt has ended (a
        stale retry of it is a duplicate) and its resources are free again. Re-queueing
        a lost or preempted task, as attempt + 1, is the caller's business."""
        del self.allocations[allocation.task_id]
        self._by_node[allocation.node].discard(allocation.task_id)
        self.version += 1
        self.table.give_back(
            allocation.node, allocation.resources, allocation.usage_mean, allocation.usage_var
        )
        self._free_version[allocation.node] = self.version
        self.remember_ended(allocation.task_id, allocation.attempt, allocation.job_id)
        self._ended.append((self.version, allocation.task_id))
        while len(self._ended) > self._delta_history:
            version, _ = self._ended.popleft()
            self._delta_floor = version

    def _resource_reason(self, task: TaskSpec, node: int) -> str:
        explain = getattr(self.policy, "explain", None)  # policies may say it better
        if explain is not None:
            return explain(self.table, node, task)
        return (
            f"node {self.table.node_ids[node]} has {format_resources(self.table.free[:, node])} "
            f"free, task needs {format_resources(task.resources)}"
        )
