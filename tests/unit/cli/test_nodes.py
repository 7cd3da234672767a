"""``megha nodes``' table from an LM's full state (services/common/nodes.py)."""

from services._proto.megha.v1 import common_pb2
from services.common.nodes import node_rows, render


def state() -> common_pb2.LocalMasterState:
    s = common_pb2.LocalMasterState(lm_id="lm-1", gm_ids=["gm-1", "gm-2"])
    alive, dead = common_pb2.NODE_HEALTH_ALIVE, common_pb2.NODE_HEALTH_DEAD
    for index, (node_id, partition, mask, health, cpu, mem) in enumerate(
        [
            ("lm-1-w0", 1, (1 << 3) | (1 << 5), alive, 4000, 8192),
            ("lm-1-w1", 0, 0, dead, 2000, 4096),
            ("lm-1-w2", 0, 0, alive, 2000, 4096),
        ]
    ):
        node = s.nodes.add(
            node_id=node_id, index=index, partition=partition, constraint_mask=mask, health=health
        )
        node.capacity.cpu_milli, node.capacity.memory_mb = cpu, mem
    s.free.indices.extend([0, 1, 2])
    s.free.cpu_milli.extend([2500, 2000, 0])
    s.free.memory_mb.extend([7936, 4096, 0])
    s.free.disk_mb.extend([0, 0, 0])
    s.free.net_mbps.extend([0, 0, 0])
    s.allocations.add(task_id="a", node_index=0)
    s.allocations.add(task_id="b", node_index=2)
    return s


def test_each_node_with_its_gm_state_room_tasks_and_constraint_names():
    rows = node_rows(state(), draining={"lm-1-w1", "lm-1-w2"})
    assert [(r.node_id, r.gm_id, r.state, r.tasks) for r in rows] == [
        ("lm-1-w0", "gm-2", "alive", 1),
        ("lm-1-w1", "gm-1", "dead", 0),  # dead outranks draining
        ("lm-1-w2", "gm-1", "draining", 1),
    ]
    assert render(rows, {3: "gpu"}).splitlines() == [
        "NODE     LM    GM    STATE     CPU free/total  MEM free/total  TASKS  CONSTRAINTS",
        "lm-1-w0  lm-1  gm-2  alive     2500m/4         7936/8192Mi     1      gpu, 5",
        "lm-1-w1  lm-1  gm-1  dead      2/2             4096/4096Mi     0      -",
        "lm-1-w2  lm-1  gm-1  draining  0/2             0/4096Mi        1      -",
    ]
