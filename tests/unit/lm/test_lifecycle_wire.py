"""The core's task states are the wire's: the GM, the LM and the load generator compare
protobuf values against ``services.core.states`` as they come, so a value that drifted
would put a state in the wrong set, or publish the wrong one."""

from services._proto.megha.v1 import common_pb2
from services.core.states import TERMINAL, TaskState


def test_every_task_state_has_its_wire_value_and_the_wire_has_no_other():
    for state in TaskState:
        assert common_pb2.TaskState.Value(f"TASK_STATE_{state.name}") == state
    assert {int(s) for s in TaskState} == set(common_pb2.TaskState.values())


def test_a_wire_value_is_found_in_the_core_sets():
    assert common_pb2.TASK_STATE_SUCCEEDED in TERMINAL
    assert common_pb2.TASK_STATE_RUNNING not in TERMINAL
