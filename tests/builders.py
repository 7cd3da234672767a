"""Small builders shared by the tests."""

from __future__ import annotations

import numpy as np

from services.core.constraints import to_mask
from services.core.node_table import NodeTable
from services.core.resources import resources
from services.core.task import TaskSpec


def task(
    task_id: str = "t1",
    cpu: int = 1000,
    mem: int = 1024,
    constraints: tuple[int, ...] = (),
    queue: str = "default",
    attempt: int = 0,
    job_id: str = "",
) -> TaskSpec:
    return TaskSpec(
        task_id=task_id,
        resources=resources(cpu, mem),
        constraint_mask=to_mask(constraints),
        queue=queue,
        attempt=attempt,
        job_id=job_id,
    )


NODE = resources(cpu_milli=4000, memory_mb=8192, disk_mb=1000, net_mbps=1000)


def set_free_at(table: NodeTable, key, value) -> None:
    """``table.free[key] = value``, through ``NodeTable.set_free`` (``free`` is read-only:
    the table keeps ``has_cpu`` in step with it), usage sums unchanged."""
    free = table.free.copy()
    free[key] = value
    rows = np.arange(table.size)
    table.set_free(rows, free, table.usage_mean.copy(), table.usage_var.copy())
