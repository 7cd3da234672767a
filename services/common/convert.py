"""Conversion between the ``megha.v1`` wire messages and the pure core types.

``services/core`` never imports protobuf; services call these functions at their edges::

    Task ──task_to_spec──> TaskSpec            (GM on submit, LM on Launch/Repartition)
    Snapshot ──snapshot_to_proto──> LocalMasterState ──snapshot_from_proto──> Snapshot
                 (LM heartbeat / reply)                     (GM, then GlobalView.apply)

Free resources travel as packed columns (``FreeColumns``), and GPA's per-node usage sums
beside them (``UsageColumns``), so a heartbeat is encoded and decoded with a few
list/array copies, not a loop over nodes. Node facts and allocations
are messages per item; they change rarely, so deltas carry few of them.

Not on the wire, and so not restored by ``snapshot_from_proto``: ``Allocation.version``
(left 0; only the LM's own delta bookkeeping reads it) and the federation's
``num_constraints`` (an argument). ``LocalMasterState.partitions`` and ``sent_unix_nanos``
have no place in a ``Snapshot``; the sender fills them, the receiver reads them off the
message.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from services._proto.megha.v1 import common_pb2, local_master_pb2
from services.core.cluster_state import ClusterState
from services.core.constraints import from_mask, to_mask
from services.core.gang import VdcLayout
from services.core.ids import id_problem, shown
from services.core.node_table import NodeColumns
from services.core.resources import NUM_RESOURCES, RESOURCE_NAMES
from services.core.snapshot import Allocation, Snapshot
from services.core.status import PlacementStatus
from services.core.task import TaskSpec
from services.core.vdc import Vdc

# Resources and FreeColumns name their fields exactly like RESOURCE_NAMES (pinned by a
# test), so one tuple of names maps vectors, messages and columns onto each other.
_resource_values = operator.attrgetter(*RESOURCE_NAMES)
_HEALTH = (common_pb2.NODE_HEALTH_DEAD, common_pb2.NODE_HEALTH_ALIVE)  # indexed by alive


class PartitionTotals(NamedTuple):
    """One partition's row of ``LocalMasterState.partitions``."""

    node_count: int
    free: np.ndarray  # int64 (NUM_RESOURCES,)
    borrowed: np.ndarray  # int64 (NUM_RESOURCES,): lent to other GMs via Repartition


# ------------------------------------------------------------------ resources
def resources_to_proto(vec: np.ndarray) -> common_pb2.Resources:
    return common_pb2.Resources(**dict(zip(RESOURCE_NAMES, vec.tolist(), strict=True)))


def resources_from_proto(msg: common_pb2.Resources) -> np.ndarray:
    """An int64 vector in ``RESOURCE_NAMES`` order (unset fields are 0)."""
    return np.array(_resource_values(msg), dtype=np.int64)


# ----------------------------------------------------------------------- tasks
def task_to_spec(task: common_pb2.Task, num_constraints: int) -> TaskSpec:
    """The placement view of a wire task.

    Raises ``ConstraintError`` for a constraint id the federation does not know and
    ``ResourceError`` for an empty or out-of-range request: both mean no node can ever
    hold the task, so the caller rejects it instead of queueing it. Priority, executor
    and timestamps are not placement inputs and stay on the message.
    """
    _check_task_fields(task)
    return TaskSpec(
        task_id=task.task_id,
        resources=resources_from_proto(task.resources),
        constraint_mask=to_mask(task.constraints, num_constraints),
        queue=task.queue,
        job_id=task.job_id,
        attempt=task.attempt,
        lease=task.lease,
        duration_s=task.expected_duration_s,
        cpu_usage_mean=task.cpu_usage_mean_milli,
        cpu_usage_std=task.cpu_usage_std_milli,
        lifetime_features=dict(task.lifetime_features),
    )


# Hints a task may carry; each must be a finite number >= 0 (0: not given).
_HINTS = ("expected_duration_s", "cpu_usage_mean_milli", "cpu_usage_std_milli")
# The last attempt a task may be placed as: its next one (a retry, a preemption, a lost
# node) must still fit Task.attempt, a uint32, or its re-queue could not be written.
MAX_ATTEMPT = 2**32 - 2


def _check_task_fields(task: common_pb2.Task) -> None:
    for name in ("task_id", "job_id", "queue"):
        problem = id_problem(name, getattr(task, name))
        if problem is not None:
            raise ValueError(problem)
    if task.attempt > MAX_ATTEMPT:
        raise ValueError(
            f"attempt is {task.attempt}; at most {MAX_ATTEMPT}, so that its next attempt "
            "can be numbered"
        )
    for name in _HINTS:
        _finite_non_negative(name, getattr(task, name))
    if task.max_retries > MAX_RETRIES:
        raise ValueError(f"max_retries is {task.max_retries}; at most {MAX_RETRIES}")
    # What a worker could not run at all is refused here, not failed on a worker later.
    executor = task.WhichOneof("executor")
    if executor == "process" and not task.process.args:
        raise ValueError("a process executor needs args (the program and its arguments)")
    if executor == "docker" and not task.docker.image:
        raise ValueError("a docker executor needs an image")
    field = {"sim": "duration_s", "process": "timeout_s", "docker": "timeout_s"}.get(executor)
    if field is not None:
        _finite_non_negative(f"{executor}.{field}", getattr(getattr(task, executor), field))


def _finite_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


MAX_RETRIES = 100  # Task.max_retries
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # Task.priority, an int32


class InvalidTask(ValueError):
    """A wire task no node can ever hold; the message names the task and the reason."""


def parse_task(task: common_pb2.Task, num_constraints: int) -> TaskSpec:
    """``task_to_spec`` for a task from outside (a client, the queue, a GM): any
    malformed field becomes one ``InvalidTask`` reading ``task <id>: <reason>``, which
    the GM turns into INVALID_ARGUMENT or REJECTED and the LM into REJECTED_INVALID."""
    try:
        return task_to_spec(task, num_constraints)
    except ValueError as err:  # ResourceError and ConstraintError are ValueErrors
        raise InvalidTask(f"task {shown(task.task_id)}: {err}") from None


# Task fields only the federation sets: a client's value would be taken for the
# federation's own (an attempt already ended, a lease a GM never gave, retries used up).
_SET_BY_THE_FEDERATION = {
    "attempt": "the LMs number a task's attempts",
    "lease": "the GM that places the task sets it",
    "failures": "the LM counts a task's failed attempts",
}


def check_submitted(task: common_pb2.Task) -> None:
    """Raise ``InvalidTask`` for a task a client submits with a field only the
    federation sets (``attempt``, ``lease``, ``failures``), naming the field."""
    for name, who in _SET_BY_THE_FEDERATION.items():
        value = getattr(task, name)
        if value:
            raise InvalidTask(
                f"task {shown(task.task_id)}: {name} is {value}, but {who}: leave it 0"
            )


def spec_to_task(spec: TaskSpec) -> common_pb2.Task:
    """The inverse of ``task_to_spec`` for the fields a ``TaskSpec`` has (no executor)."""
    return common_pb2.Task(
        task_id=spec.task_id,
        job_id=spec.job_id,
        queue=spec.queue,
        resources=resources_to_proto(spec.resources),
        constraints=from_mask(spec.constraint_mask),
        expected_duration_s=spec.duration_s,
        cpu_usage_mean_milli=spec.cpu_usage_mean,
        cpu_usage_std_milli=spec.cpu_usage_std,
        lifetime_features=spec.lifetime_features,
        attempt=spec.attempt,
    )


# ------------------------------------------------------------------- snapshots
def partition_totals(state: ClusterState) -> list[PartitionTotals]:
    """Per-partition node counts, free and borrowed resources, for ``snapshot_to_proto``."""
    sizes = state.table.partition_sizes().tolist()
    free = state.table.partition_free()
    borrowed = state.borrowed()
    return [PartitionTotals(sizes[p], free[p], borrowed[p]) for p in range(len(sizes))]


def next_attempt(task: common_pb2.Task, queued_unix_nanos: int) -> common_pb2.Task:
    """A copy of ``task`` as its next attempt, for its user queue again: it keeps when the
    user submitted it; everything after is the new attempt's own. ``InvalidTask`` for a
    task past ``MAX_ATTEMPT``, which ``parse_task`` keeps from ever being placed."""
    if task.attempt > MAX_ATTEMPT:
        raise InvalidTask(
            f"task {shown(task.task_id)}: attempt {task.attempt} has no next attempt "
            f"(Task.attempt is a uint32; at most {MAX_ATTEMPT} is ever placed)"
        )
    again = common_pb2.Task.FromString(task.SerializeToString())
    again.attempt = task.attempt + 1
    again.timestamps.CopyFrom(
        common_pb2.TaskTimestamps(
            submitted_unix_nanos=task.timestamps.submitted_unix_nanos,
            queued_unix_nanos=queued_unix_nanos,
        )
    )
    return again


def snapshot_to_proto(
    snap: Snapshot, partitions: Sequence[PartitionTotals] | None = None
) -> common_pb2.LocalMasterState:
    """Encode an LM snapshot; ``partitions`` (one per GM, in ``gm_ids`` order) is optional.

    ``sent_unix_nanos`` is left 0: the core has no clock, the sending service stamps it.
    """
    msg = common_pb2.LocalMasterState(
        lm_id=snap.lm_id,
        version=snap.version,
        full=snap.full,
        base_version=snap.base_version,
        gm_ids=snap.gm_ids,
        ended_task_ids=snap.ended_task_ids,
        incarnation=snap.incarnation,
    )
    _add_nodes(msg, snap.nodes)
    msg.free.indices.extend(snap.free_indices.tolist())
    for name, column in zip(RESOURCE_NAMES, snap.free.tolist(), strict=True):
        getattr(msg.free, name).extend(column)
    if snap.usage_mean is not None and snap.usage_var is not None:
        msg.usage.SetInParent()  # present even with no nodes: "reported, nothing changed"
        msg.usage.cpu_usage_means.extend(snap.usage_mean.tolist())
        msg.usage.cpu_usage_variances.extend(snap.usage_var.tolist())
    add_allocation = msg.allocations.add
    for a in snap.allocations:
        add_allocation(
            task_id=a.task_id,
            queue=a.queue,
            node_index=a.node,
            resources=dict(zip(RESOURCE_NAMES, a.resources.tolist(), strict=True)),
            partition=a.partition,
            logical=a.logical,
            sequence=a.sequence,
            attempt=a.attempt,
            cpu_usage_mean_milli=a.usage_mean,
            cpu_usage_var_milli2=a.usage_var,
            gang=a.gang,
        )
    if partitions is not None:
        if len(partitions) != len(snap.gm_ids):
            raise ValueError(
                f"got totals for {len(partitions)} partitions, but the LM has "
                f"{len(snap.gm_ids)} GMs; give one per GM in gm_ids order"
            )
        for p, (count, free, borrowed) in enumerate(partitions):
            msg.partitions.add(
                partition=p,
                gm_id=snap.gm_ids[p],
                node_count=count,
                free=resources_to_proto(free),
                borrowed=resources_to_proto(borrowed),
            )
    return msg


def snapshot_from_proto(msg: common_pb2.LocalMasterState, num_constraints: int) -> Snapshot:
    """Decode an LM state. ``num_constraints`` is the federation's setting (not sent)."""
    free_indices = np.array(msg.free.indices, dtype=np.int64)
    free = np.empty((NUM_RESOURCES, len(free_indices)), dtype=np.int64)
    for d, name in enumerate(RESOURCE_NAMES):
        column = getattr(msg.free, name)
        if len(column) != len(free_indices):
            raise ValueError(
                f"LM {msg.lm_id!r} sent FreeColumns with {len(free_indices)} indices but "
                f"{len(column)} {name} values; every column must have one value per index"
            )
        free[d] = np.array(column, dtype=np.int64)
    usage_mean = usage_var = None
    if msg.HasField("usage"):
        usage_mean = np.array(msg.usage.cpu_usage_means, dtype=np.float64)
        usage_var = np.array(msg.usage.cpu_usage_variances, dtype=np.float64)
        if len(usage_mean) != len(free_indices) or len(usage_var) != len(free_indices):
            raise ValueError(
                f"LM {msg.lm_id!r} sent UsageColumns with {len(usage_mean)} means and "
                f"{len(usage_var)} variances for {len(free_indices)} FreeColumns indices; "
                "each needs one value per index"
            )
    allocations = [
        Allocation(
            task_id=a.task_id,
            queue=a.queue,
            node=a.node_index,
            resources=resources_from_proto(a.resources),
            partition=a.partition,
            logical=a.logical,
            sequence=a.sequence,
            attempt=a.attempt,
            usage_mean=a.cpu_usage_mean_milli,
            usage_var=a.cpu_usage_var_milli2,
            gang=a.gang,
        )
        for a in msg.allocations
    ]
    return Snapshot(
        lm_id=msg.lm_id,
        version=msg.version,
        full=msg.full,
        base_version=msg.base_version,
        gm_ids=tuple(msg.gm_ids),
        num_constraints=num_constraints,
        nodes=_nodes_from_proto(msg.nodes),
        free_indices=free_indices,
        free=free,
        allocations=allocations,
        ended_task_ids=list(msg.ended_task_ids),
        usage_mean=usage_mean,
        usage_var=usage_var,
        incarnation=msg.incarnation,
    )


def _add_nodes(msg: common_pb2.LocalMasterState, columns: NodeColumns) -> None:
    # One pass over plain Python values: numpy scalars would cost a conversion per field.
    rows = zip(
        columns.indices.tolist(),
        columns.node_ids,
        columns.addresses,
        zip(*columns.capacity.tolist(), strict=True),
        columns.constraint_masks.tolist(),
        columns.partitions.tolist(),
        columns.alive.tolist(),
        strict=True,
    )
    add = msg.nodes.add
    for index, node_id, address, capacity, mask, partition, alive in rows:
        add(
            node_id=node_id,
            index=index,
            worker_address=address,
            capacity=dict(zip(RESOURCE_NAMES, capacity, strict=True)),
            constraint_mask=mask,
            partition=partition,
            health=_HEALTH[alive],
        )


def _nodes_from_proto(nodes: Sequence[common_pb2.NodeState]) -> NodeColumns:
    k = len(nodes)
    capacity = np.array([_resource_values(n.capacity) for n in nodes], dtype=np.int64)
    return NodeColumns(
        indices=np.fromiter((n.index for n in nodes), dtype=np.uint32, count=k),
        node_ids=[n.node_id for n in nodes],
        addresses=[n.worker_address for n in nodes],
        capacity=capacity.reshape(k, NUM_RESOURCES).T.copy(),  # reshape: right when k == 0
        constraint_masks=np.fromiter((n.constraint_mask for n in nodes), np.uint64, count=k),
        partitions=np.fromiter((n.partition for n in nodes), dtype=np.int32, count=k),
        # UNSPECIFIED counts as dead: a GM must not place on a node of unknown health.
        alive=np.fromiter(
            (n.health == common_pb2.NODE_HEALTH_ALIVE for n in nodes), dtype=bool, count=k
        ),
    )


# ------------------------------------------------------------- placement status
def placement_status_to_proto(
    status: PlacementStatus,
) -> local_master_pb2.PlacementStatus.ValueType:
    # The core enum mirrors megha.v1.PlacementStatus value for value (pinned by a test).
    return local_master_pb2.PlacementStatus.ValueType(int(status))


def placement_status_from_proto(value: int) -> PlacementStatus:
    try:
        return PlacementStatus(value)
    except ValueError:
        raise ValueError(
            f"placement status {value} has no meaning here (UNSPECIFIED, or from a newer LM)"
        ) from None


def vdc_from_proto(msg: common_pb2.Vdc) -> Vdc:
    """``Vdc`` of the wire's; ``VdcError`` (a ValueError) if its numbers are not."""
    return Vdc(float(msg.bandwidth_per_core_mbps), float(msg.vlink_cap_mbps))


def vdc_to_proto(vdc: Vdc) -> common_pb2.Vdc:
    return common_pb2.Vdc(
        bandwidth_per_core_mbps=vdc.bandwidth_per_core, vlink_cap_mbps=vdc.vlink_cap
    )


def layout_to_proto(layout: VdcLayout) -> local_master_pb2.VdcLayout:
    return local_master_pb2.VdcLayout(
        vdc=vdc_to_proto(layout.vdc),
        member_cpus=layout.cpu_milli.tolist(),
        member_slots=layout.slots.tolist(),
    )


def layout_from_proto(msg: local_master_pb2.VdcLayout) -> VdcLayout:
    """``VdcLayout`` of a ReserveGang; ``ValueError`` if malformed (the LM refuses it)."""
    if len(msg.member_cpus) != len(msg.member_slots) or not len(msg.member_slots):
        raise ValueError("a VDC layout needs one cpu and one slot per member")
    return VdcLayout(
        vdc_from_proto(msg.vdc),
        np.asarray(msg.member_cpus, dtype=np.int64),
        np.asarray(msg.member_slots, dtype=np.int64),
    )
