"""What the autoscaler's look costs a GM: ``GetClusterView(pending_shapes)`` walks every
task the GM holds waiting, once per autoscale interval (60 s by default).

    python scripts/autoscale_bench.py [--tasks 10000,100000] [--shapes 8] [--repeats 5]

For a GM holding N waiting tasks of S distinct requests in each of 4 queues (4S shapes),
it times ``waiting_shapes`` (the walk and the grouping, in the GM's event loop) without a
queue limit and with one on every queue (checked once per shape), and ``pool_demand``
over the shapes it returns (in the autoscaler, not the GM). Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from services.core.autoscale import Pool, pool_demand, waiting_shapes
from services.core.limits import LimitLedger, QueueLimits
from services.core.resources import resources
from services.core.task import TaskSpec
from services.core.user_queues import UserQueues

QUEUES = ("a", "b", "c", "d")


def build(tasks: int, shapes: int) -> UserQueues[TaskSpec]:
    queues: UserQueues[TaskSpec] = UserQueues(QUEUES)
    for i in range(tasks):
        cpu = 250 * (1 + i % shapes)
        spec = TaskSpec(task_id=f"t{i}", resources=resources(cpu_milli=cpu, memory_mb=512))
        queues.push(QUEUES[i % len(QUEUES)], spec)
    return queues


def median_s(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="10000,100000")
    parser.add_argument("--shapes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    limits = QueueLimits.parse([(q, "cpu=1000000") for q in QUEUES])  # never reached
    pools = [Pool("small", resources(cpu_milli=2000, memory_mb=4096), high=100)]
    for tasks in (int(n) for n in args.tasks.split(",")):
        queues = build(tasks, args.shapes)

        def walk(ledger=None, queues=queues):
            return waiting_shapes(((q, queues.items(q)) for q in queues.names), ledger)

        plain = median_s(walk, args.repeats)
        limited = median_s(lambda: walk(LimitLedger(limits, {})), args.repeats)
        rows = walk()
        shapes = np.array([r[1] for r in rows], dtype=np.int64)
        masks, counts = [r[2] for r in rows], [r[3] for r in rows]
        demand = median_s(
            lambda shapes=shapes, masks=masks, counts=counts: pool_demand(
                pools, shapes, masks, counts
            ),
            args.repeats,
        )
        print(
            f"{tasks} waiting tasks, {len(rows)} shapes: waiting_shapes {plain * 1e3:.1f} ms, "
            f"with limits {limited * 1e3:.1f} ms ({plain / tasks * 1e9:.0f} / "
            f"{limited / tasks * 1e9:.0f} ns a task); pool_demand {demand * 1e6:.0f} µs"
        )


if __name__ == "__main__":
    main()
