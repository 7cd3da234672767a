"""What a GM decodes from the wire is exactly what the LM's books said, and wire tasks
turn into the TaskSpecs placement expects (or are rejected with the core's reasons)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from services._proto.megha.v1 import common_pb2, local_master_pb2
from services.common.convert import (
    MAX_ATTEMPT,
    InvalidTask,
    check_submitted,
    next_attempt,
    parse_task,
    partition_totals,
    placement_status_from_proto,
    placement_status_to_proto,
    resources_from_proto,
    resources_to_proto,
    snapshot_from_proto,
    snapshot_to_proto,
    spec_to_task,
    task_to_spec,
)
from services.core.cluster_state import ClusterState
from services.core.constraints import ConstraintError, to_mask
from services.core.global_view import ApplyResult, GlobalView
from services.core.node_table import NodeColumns
from services.core.resources import MAX_VALUE, NUM_RESOURCES, RESOURCE_NAMES, ResourceError
from services.core.resources import resources as res
from services.core.snapshot import Snapshot
from services.core.status import PlacementStatus
from services.core.task import TaskSpec

NUM_CONSTRAINTS = 21
GMS = ("gm-a", "gm-b")


def _wire(snap: Snapshot, num_constraints: int = NUM_CONSTRAINTS) -> Snapshot:
    """LM encodes and sends, GM receives and decodes."""
    data = snapshot_to_proto(snap).SerializeToString()
    return snapshot_from_proto(common_pb2.LocalMasterState.FromString(data), num_constraints)


def _allocation_rows(snap: Snapshot) -> list[tuple]:
    fields = ("task_id", "queue", "node", "partition", "logical", "sequence", "attempt")
    return [(*(getattr(a, f) for f in fields), a.resources.tolist()) for a in snap.allocations]


def _assert_same(got: Snapshot, want: Snapshot) -> None:
    assert (got.lm_id, got.version, got.full, got.base_version, got.gm_ids) == (
        want.lm_id,
        want.version,
        want.full,
        want.base_version,
        want.gm_ids,
    )
    assert got.incarnation == want.incarnation
    assert got.num_constraints == want.num_constraints
    for name in ("indices", "capacity", "constraint_masks", "partitions", "alive"):
        g, w = getattr(got.nodes, name), getattr(want.nodes, name)
        assert g.dtype == w.dtype, name
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert got.nodes.node_ids == want.nodes.node_ids
    assert got.nodes.addresses == want.nodes.addresses
    assert got.free_indices.dtype == want.free_indices.dtype
    np.testing.assert_array_equal(got.free_indices, want.free_indices)
    assert got.free.dtype == want.free.dtype
    np.testing.assert_array_equal(got.free, want.free)
    assert _allocation_rows(got) == _allocation_rows(want)
    assert got.ended_task_ids == want.ended_task_ids


def _busy_state() -> ClusterState:
    """Two GMs, six nodes with constraints, launches, a repartition, a dead node."""
    state = ClusterState(
        "lm-0", GMS, num_constraints=NUM_CONSTRAINTS, incarnation=1_700_000_000_123_456_789
    )
    for i in range(6):
        state.add_node(
            f"node-{i}",
            res(cpu_milli=4000 + i, memory_mb=8192, disk_mb=50_000, net_mbps=1000),
            constraint_mask=to_mask([i % 3, 20]) if i % 2 else 0,
            partition=i % 2,
            address=f"10.0.0.{i}:50051",
        )
    ok = [
        state.launch("gm-a", TaskSpec("t-a1", res(500, 1024), queue="qa"), 0),
        state.launch("gm-a", TaskSpec("t-a2", res(700, 512, 10, 5), queue="qa"), 2),
        state.launch("gm-b", TaskSpec("t-b1", res(1000, 2048), queue="qb"), 1),
        state.repartition("gm-b", TaskSpec("t-b2", res(300, 256), queue="qb"), 4),
        state.launch("gm-a", TaskSpec("t-a3", res(100, 100), queue="qa"), 4),
    ]
    assert all(d.ok for d in ok)
    lost = state.set_alive(4, False)
    assert {a.task_id for a in lost} == {"t-b2", "t-a3"}
    state.repartition("gm-b", TaskSpec("t-b3", res(250, 128), queue="qb", attempt=2), 2)
    return state


def test_full_snapshot_survives_the_wire() -> None:
    state = _busy_state()
    snap = state.snapshot()
    assert not snap.nodes.alive.all() and any(a.logical for a in snap.allocations)

    got = _wire(snap)

    _assert_same(got, snap)
    assert got.nodes.constraint_masks[1] == to_mask([1, 20])
    assert {a.task_id: a.attempt for a in got.allocations}["t-b3"] == 2


def test_gm_view_built_from_the_wire_matches_the_lm() -> None:
    state = _busy_state()
    view = GlobalView("gm-a", num_constraints=NUM_CONSTRAINTS)
    assert view.apply(_wire(state.snapshot()), now=0.0) is ApplyResult.APPLIED
    base = state.version

    state.release("t-a1")
    state.set_alive(4, True)
    state.launch("gm-a", TaskSpec("t-a4", res(200, 300), queue="qa"), 4)
    assert view.apply(_wire(state.snapshot(since_version=base)), now=1.0) is ApplyResult.APPLIED

    lm = view.lms["lm-0"]
    np.testing.assert_array_equal(lm.table.free, state.table.free)
    np.testing.assert_array_equal(lm.table.capacity, state.table.capacity)
    assert lm.table.alive == state.table.alive
    assert lm.table.constraint_bits == state.table.constraint_bits
    assert lm.table.members == state.table.members
    assert sorted(lm.allocations) == sorted(state.allocations)
    assert lm.version == state.version


def test_delta_snapshot_survives_the_wire() -> None:
    state = _busy_state()
    base = state.version
    state.release("t-a2")
    state.set_alive(4, True)
    state.add_node("node-6", res(2000, 4096), to_mask([7]), partition=1, address="h6:1")
    state.launch("gm-b", TaskSpec("t-b4", res(400, 400), queue="qb"), 6)
    delta = state.snapshot(since_version=base)
    assert not delta.full and delta.base_version == base
    assert len(delta.nodes) == 2 and len(delta.free_indices) == 2  # nodes 4 (alive), 6
    assert delta.ended_task_ids == ["t-a2"] and len(delta.allocations) == 1

    _assert_same(_wire(delta), delta)


def test_idle_heartbeat_decodes_to_empty_columns_of_the_right_shape() -> None:
    state = _busy_state()
    got = _wire(state.snapshot(since_version=state.version))

    assert got.nodes.capacity.shape == (NUM_RESOURCES, 0)
    assert got.free.shape == (NUM_RESOURCES, 0) and got.free_indices.shape == (0,)
    _assert_same(got, state.snapshot(since_version=state.version))


def test_partition_totals_go_on_the_wire_when_given() -> None:
    state = _busy_state()
    snap = state.snapshot()
    assert not snapshot_to_proto(snap).partitions

    msg = snapshot_to_proto(snap, partition_totals(state))

    by_gm = {p.gm_id: p for p in msg.partitions}
    assert [p.partition for p in msg.partitions] == [0, 1]
    assert by_gm["gm-a"].node_count == 3 and by_gm["gm-b"].node_count == 3
    # t-b3 was repartitioned onto node 2, owned by gm-a: gm-a lends exactly its resources.
    np.testing.assert_array_equal(resources_from_proto(by_gm["gm-a"].borrowed), res(250, 128))
    np.testing.assert_array_equal(resources_from_proto(by_gm["gm-b"].borrowed), res())
    owned_by_a = state.table.owner == 0
    np.testing.assert_array_equal(
        resources_from_proto(by_gm["gm-a"].free), state.table.free[:, owned_by_a].sum(axis=1)
    )
    with pytest.raises(ValueError, match="one per GM"):
        snapshot_to_proto(snap, partition_totals(state)[:1])


def test_node_of_unspecified_health_is_not_placeable() -> None:
    msg = snapshot_to_proto(_busy_state().snapshot())
    msg.nodes[0].health = common_pb2.NODE_HEALTH_UNSPECIFIED

    got = snapshot_from_proto(msg, NUM_CONSTRAINTS)

    assert not got.nodes.alive[0]


def test_ragged_free_columns_are_rejected_with_the_column_named() -> None:
    msg = snapshot_to_proto(_busy_state().snapshot())
    del msg.free.disk_mb[-1]

    with pytest.raises(ValueError, match="disk_mb"):
        snapshot_from_proto(msg, NUM_CONSTRAINTS)


def test_task_spec_survives_the_wire() -> None:
    spec = TaskSpec(
        "t-1",
        res(1500, 2048, 10, 100),
        constraint_mask=to_mask([0, 5, 63], 64),
        queue="research",
        job_id="j-9",
        attempt=3,
        duration_s=12.5,
        cpu_usage_mean=900.0,
        cpu_usage_std=120.5,
        lifetime_features={"user": "u1", "priority": "batch"},
    )
    data = spec_to_task(spec).SerializeToString()

    got = task_to_spec(common_pb2.Task.FromString(data), num_constraints=64)

    for name in TaskSpec.__slots__:
        if name != "resources":
            assert getattr(got, name) == getattr(spec, name), name
    np.testing.assert_array_equal(got.resources, spec.resources)


def test_task_from_a_client_maps_each_field() -> None:
    task = common_pb2.Task(
        task_id="t-2",
        job_id="j-1",
        queue="prod",
        resources=common_pb2.Resources(cpu_milli=250, memory_mb=64, net_mbps=7),
        constraints=[4, 2, 4],
        expected_duration_s=30.0,
        cpu_usage_mean_milli=200.0,
        cpu_usage_std_milli=15.0,
        lifetime_features={"image": "py"},
        priority=5,
        attempt=1,
        sim=common_pb2.SimExecutor(duration_s=30.0),
    )

    spec = task_to_spec(task, NUM_CONSTRAINTS)

    assert spec.resources.tolist() == [250, 64, 0, 7]
    assert spec.constraint_mask == 0b10100
    assert (spec.queue, spec.job_id, spec.attempt) == ("prod", "j-1", 1)
    assert (spec.duration_s, spec.cpu_usage_mean, spec.cpu_usage_std) == (30.0, 200.0, 15.0)
    assert spec.lifetime_features == {"image": "py"}


def test_task_with_unknown_constraint_is_rejected() -> None:
    task = common_pb2.Task(
        task_id="t-3", resources=common_pb2.Resources(cpu_milli=100), constraints=[3, 21]
    )

    with pytest.raises(ConstraintError, match="unknown constraint 21"):
        task_to_spec(task, NUM_CONSTRAINTS)


def test_task_asking_for_nothing_is_rejected() -> None:
    task = common_pb2.Task(task_id="t-4", resources=common_pb2.Resources())

    with pytest.raises(ResourceError, match="asks for nothing"):
        task_to_spec(task, NUM_CONSTRAINTS)


@pytest.mark.parametrize(
    ("task", "reason"),
    [
        (common_pb2.Task(task_id="t-5", resources=common_pb2.Resources()), "asks for nothing"),
        (
            common_pb2.Task(
                task_id="t-5", resources=common_pb2.Resources(cpu_milli=1), constraints=[99]
            ),
            "unknown constraint 99",
        ),
        (
            common_pb2.Task(
                task_id="t-5",
                resources=common_pb2.Resources(cpu_milli=1),
                expected_duration_s=float("nan"),
            ),
            "expected_duration_s must be a finite number >= 0, got nan",
        ),
        (
            common_pb2.Task(
                task_id="t-5",
                resources=common_pb2.Resources(cpu_milli=1),
                cpu_usage_std_milli=-3,
            ),
            "cpu_usage_std_milli must be a finite number >= 0, got -3.0",
        ),
        (
            common_pb2.Task(
                task_id="t-5", resources=common_pb2.Resources(cpu_milli=1), job_id="j" * 257
            ),
            r"job_id 'j+\.\.\.' is 257 bytes long; at most 256",
        ),
        (
            common_pb2.Task(
                task_id="t-5",
                resources=common_pb2.Resources(cpu_milli=1),
                process=common_pb2.ProcessExecutor(),
            ),
            "a process executor needs args",
        ),
        (
            common_pb2.Task(
                task_id="t-5",
                resources=common_pb2.Resources(cpu_milli=1),
                docker=common_pb2.DockerExecutor(args=["ls"]),
            ),
            "a docker executor needs an image",
        ),
        (
            common_pb2.Task(
                task_id="t-5",
                resources=common_pb2.Resources(cpu_milli=1),
                process=common_pb2.ProcessExecutor(args=["true"], timeout_s=-1),
            ),
            "process.timeout_s must be a finite number >= 0, got -1.0",
        ),
        (
            common_pb2.Task(
                task_id="t-5",
                resources=common_pb2.Resources(cpu_milli=1),
                sim=common_pb2.SimExecutor(duration_s=float("inf")),
            ),
            "sim.duration_s must be a finite number >= 0, got inf",
        ),
    ],
)
def test_parse_task_names_the_task_and_the_reason(task: common_pb2.Task, reason: str) -> None:
    """One error type for every malformed field, so the GM (INVALID_ARGUMENT, REJECTED)
    and the LM (REJECTED_INVALID) share one parser."""
    with pytest.raises(InvalidTask, match=f"^task t-5: .*{reason}"):
        parse_task(task, NUM_CONSTRAINTS)
    good = common_pb2.Task(task_id="t-6", resources=common_pb2.Resources(cpu_milli=5))
    assert parse_task(good, NUM_CONSTRAINTS).task_id == "t-6"
    longest = common_pb2.Task(task_id="t" * 256, resources=common_pb2.Resources(cpu_milli=5))
    assert parse_task(longest, NUM_CONSTRAINTS).task_id == "t" * 256
    with pytest.raises(InvalidTask, match=r"task_id 't+\.\.\.' is 257 bytes long; at most 256"):
        parse_task(common_pb2.Task(task_id="t" * 257, resources=longest.resources), 21)
    # A megabyte id is not echoed back: the message names it cut short.
    with pytest.raises(InvalidTask, match="is 1000000 bytes long") as huge:
        parse_task(common_pb2.Task(task_id="t" * 10**6, resources=longest.resources), 21)
    assert len(str(huge.value)) < 200
    # Bytes, not characters: 200 three-byte characters are 600 bytes.
    with pytest.raises(InvalidTask, match=r"job_id '€+\.\.\.' is 600 bytes long"):
        parse_task(common_pb2.Task(task_id="t", job_id="€" * 200, resources=longest.resources), 21)


@given(
    free=st.integers(0, 300).flatmap(
        lambda k: hnp.arrays(np.int64, (NUM_RESOURCES, k), elements=st.integers(0, MAX_VALUE))
    ),
    data=st.data(),
)
def test_any_free_matrix_survives_the_wire(free: np.ndarray, data: st.DataObject) -> None:
    k = free.shape[1]
    indices = data.draw(
        hnp.arrays(np.int64, k, elements=st.integers(0, 2**32 - 1), unique=True), "indices"
    )
    columns = NodeColumns(
        indices=np.zeros(0, np.uint32),
        node_ids=[],
        addresses=[],
        capacity=np.zeros((NUM_RESOURCES, 0), np.int64),
        constraint_masks=np.zeros(0, np.uint64),
        partitions=np.zeros(0, np.int32),
        alive=np.zeros(0, bool),
    )
    snap = Snapshot("lm", 7, False, 3, ("g",), NUM_CONSTRAINTS, columns, indices, free)

    _assert_same(_wire(snap), snap)


@given(
    masks=hnp.arrays(np.uint64, st.integers(0, 50), elements=st.integers(0, 2**64 - 1)),
    data=st.data(),
)
def test_any_node_columns_survive_the_wire(masks: np.ndarray, data: st.DataObject) -> None:
    k = len(masks)
    columns = NodeColumns(
        indices=np.arange(k, dtype=np.uint32),
        node_ids=data.draw(st.lists(st.text(), min_size=k, max_size=k), "ids"),
        addresses=[f"h{i}:1" for i in range(k)],
        capacity=data.draw(
            hnp.arrays(np.int64, (NUM_RESOURCES, k), elements=st.integers(0, MAX_VALUE))
        ),
        constraint_masks=masks,
        partitions=data.draw(hnp.arrays(np.int32, k, elements=st.integers(0, 7))),
        alive=data.draw(hnp.arrays(bool, k)),
    )
    free_indices, free = Snapshot.empty_free()
    snap = Snapshot("lm", 1, True, 0, ("g",), 64, columns, free_indices, free)

    _assert_same(_wire(snap, 64), snap)


def test_wire_resource_fields_are_named_like_the_core_vector() -> None:
    # convert.py maps vectors onto Resources and FreeColumns by these names.
    assert tuple(f.name for f in common_pb2.Resources.DESCRIPTOR.fields) == RESOURCE_NAMES
    free_columns = [f.name for f in common_pb2.FreeColumns.DESCRIPTOR.fields]
    assert tuple(free_columns[1:]) == RESOURCE_NAMES
    vec = res(1, 2, 3, 4)
    np.testing.assert_array_equal(resources_from_proto(resources_to_proto(vec)), vec)


def test_placement_status_mirrors_the_proto_enum() -> None:
    wire = local_master_pb2.PlacementStatus
    core_names = {f"PLACEMENT_STATUS_{s.name}" for s in PlacementStatus}
    assert core_names == set(wire.keys()) - {"PLACEMENT_STATUS_UNSPECIFIED"}
    for status in PlacementStatus:
        value = placement_status_to_proto(status)
        assert wire.Name(value) == f"PLACEMENT_STATUS_{status.name}"
        assert placement_status_from_proto(value) is status
    with pytest.raises(ValueError, match="placement status 0"):
        placement_status_from_proto(wire.Value("PLACEMENT_STATUS_UNSPECIFIED"))


def test_next_attempt_is_a_copy_that_keeps_only_the_submission_time():
    task = common_pb2.Task(task_id="t", job_id="j", queue="q", attempt=2)
    task.timestamps.submitted_unix_nanos = 10
    task.timestamps.started_unix_nanos = 20
    task.sim.duration_s = 1.5
    again = next_attempt(task, queued_unix_nanos=30)
    assert (again.task_id, again.job_id, again.queue, again.attempt) == ("t", "j", "q", 3)
    assert again.sim.duration_s == 1.5
    assert again.timestamps == common_pb2.TaskTimestamps(
        submitted_unix_nanos=10, queued_unix_nanos=30
    )
    assert task.attempt == 2 and task.timestamps.started_unix_nanos == 20  # untouched


def test_no_task_is_placed_whose_next_attempt_could_not_be_numbered():
    """Task.attempt is a uint32: a task placed as attempt 2**32 - 1 could not be queued
    again (a retry, a preemption, a lost node), and the LM's failure to write its next
    attempt ended its worker's heartbeat stream. Such a task is never placed."""
    last = common_pb2.Task(task_id="t", resources=common_pb2.Resources(cpu_milli=1))
    last.attempt = MAX_ATTEMPT
    assert parse_task(last, NUM_CONSTRAINTS).attempt == 2**32 - 2
    assert next_attempt(last, 0).attempt == 2**32 - 1  # still fits
    beyond = next_attempt(last, 0)
    with pytest.raises(InvalidTask, match="attempt is 4294967295; at most 4294967294"):
        parse_task(beyond, NUM_CONSTRAINTS)
    with pytest.raises(InvalidTask, match="attempt 4294967295 has no next attempt"):
        next_attempt(beyond, 0)


@pytest.mark.parametrize(
    ("field", "value"), [("attempt", 2**32 - 1), ("attempt", 1), ("lease", 7), ("failures", 3)]
)
def test_a_submitted_task_may_not_set_what_the_federation_sets(field: str, value: int) -> None:
    check_submitted(common_pb2.Task(task_id="t"))
    submitted = common_pb2.Task(task_id="t", **{field: value})
    with pytest.raises(InvalidTask, match=f"^task t: {field} is {value}, but .*: leave it 0$"):
        check_submitted(submitted)


def test_a_vdc_layout_crosses_the_wire_whole_and_a_bad_one_is_refused():
    from services.common.convert import layout_from_proto, layout_to_proto, vdc_from_proto
    from services.core.gang import VdcLayout
    from services.core.vdc import Vdc, VdcError

    layout = VdcLayout(Vdc(100.0, 250.0), np.array([1000, 2000, 500]), np.array([0, 0, -1]))
    back = layout_from_proto(local_master_pb2.VdcLayout.FromString(
        layout_to_proto(layout).SerializeToString()
    ))  # fmt: skip
    assert back.vdc == layout.vdc
    assert back.cpu_milli.tolist() == [1000, 2000, 500] and back.slots.tolist() == [0, 0, -1]
    uneven = layout_to_proto(layout)
    del uneven.member_slots[-1]
    with pytest.raises(ValueError, match="one cpu and one slot per member"):
        layout_from_proto(uneven)
    with pytest.raises(VdcError, match="vlink_cap must be finite"):
        vdc_from_proto(common_pb2.Vdc(bandwidth_per_core_mbps=1, vlink_cap_mbps=float("inf")))
