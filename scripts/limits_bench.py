"""What a queue limit costs a GM: one ``LimitLedger`` per scheduling round.

    python scripts/limits_bench.py [--lms 10] [--tasks 1000,5000] [--rounds 200]

For a view of L LMs each holding N running tasks (4 queues, one limited), it times:
- ``ledger``: building the round's ledger (``GlobalView.queue_usage`` + the copies), as
  a GM does once per round when a queue it serves has a limit; every LM's table changed
  since the previous round (a launch on each), the worst case;
- ``recount``: summing every allocation afresh (``usage_by_queue``), what the view did
  once per changed LM before it kept the sums as allocations come and go;
- ``set+pop``: adding and removing one allocation in an LM's map (``HeldAllocations``),
  against a plain dict, the price of keeping the sums on every launch, end and snapshot.
Medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from services.core.fairness import usage_by_queue
from services.core.global_view import GlobalView, HeldAllocations, LMView
from services.core.limits import LimitLedger, QueueLimits
from services.core.match import make_policy
from services.core.node_table import NodeTable
from services.core.resources import resources
from services.core.snapshot import Allocation


def allocation(task_id: str, queue: str) -> Allocation:
    return Allocation(task_id, queue, 0, resources(cpu_milli=100, memory_mb=10), 0, False, 0)


def build(lms: int, tasks: int) -> GlobalView:
    view = GlobalView("gm-1", make_policy("first-fit"), 21)
    for lm in range(lms):
        table = NodeTable(num_partitions=1, num_constraints=21)
        table.add("n0", resources(cpu_milli=10**9, memory_mb=10**9), 0, partition=0)
        lm_view = LMView(f"lm-{lm}", ("gm-1",), table, version=1, partition=0, updated_at=0.0)
        for k in range(tasks):
            task_id = f"t{lm}-{k}"
            lm_view.allocations[task_id] = allocation(task_id, f"q{k % 4}")
        view.lms[lm_view.lm_id] = lm_view
    return view


def median_us(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lms", type=int, default=10)
    parser.add_argument("--tasks", default="1000,5000", help="running tasks per LM")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    limits = QueueLimits.parse([("q0", "cpu=1000")])
    for tasks in (int(t) for t in args.tasks.split(",")):
        view = build(args.lms, tasks)

        def ledger(view=view) -> None:
            for lm_view in view.lms.values():
                lm_view.table.version += 1  # as a launch there would
            LimitLedger(limits, view.queue_usage())

        def recount(view=view) -> None:
            for lm_view in view.lms.values():
                usage_by_queue(lm_view.allocations.values())

        print(
            f"{args.lms} LMs x {tasks:,} tasks: ledger {median_us(ledger, args.rounds):,.1f} µs, "
            f"recount {median_us(recount, args.rounds):,.1f} µs a round"
        )
    extra = allocation("extra", "q0")
    for name, mapping in (("HeldAllocations", HeldAllocations()), ("a plain dict", {})):

        def churn(mapping=mapping) -> None:
            mapping["extra"] = extra
            mapping.pop("extra")

        print(f"set+pop of one allocation, {name}: {median_us(churn, 20_000):.2f} µs")


if __name__ == "__main__":
    main()
