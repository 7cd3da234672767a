"""Micro-benchmarks of the hot path (``megha bench ...``).

``match``: one GM match (AND of the task's constraint vectors with the partition and
liveness vectors, then the policy's fit search) on a partition of N nodes with 21
constraints. Nodes and tasks are synthetic but shaped like the paper's workload: node
constraints are common-to-rare (Sharma et al. style), most tasks need zero to three of
them, and a share of nodes is busy so the first fitting node is not always row 0.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from services.core.constraints import DEFAULT_NUM_CONSTRAINTS
from services.core.match import NO_NODE, make_policy, match
from services.core.node_table import NodeTable
from services.core.resources import resources
from services.core.task import TaskSpec

DEFAULT_SIZES = (1_000, 5_000, 50_000)


@dataclass(frozen=True)
class MatchResult:
    nodes: int
    constraints: int
    policy: str
    samples: int
    p50_us: float
    p99_us: float
    hit_rate: float  # share of matches that found a node
    miss_p50_us: float  # a task no node can hold: the full-scan worst case


def build_partition(nodes: int, num_constraints: int, rng: np.random.Generator) -> NodeTable:
    table = NodeTable(num_partitions=1, num_constraints=num_constraints)
    # Constraint c is held by a fraction of nodes falling from ~95 % to ~30 %.
    held = np.linspace(0.95, 0.30, num_constraints)
    has = rng.random((nodes, num_constraints)) < held
    masks = (has.astype(np.uint64) << np.arange(num_constraints, dtype=np.uint64)).sum(axis=1)
    capacity = resources(cpu_milli=4000, memory_mb=16384, disk_mb=100_000, net_mbps=10_000)
    for i in range(nodes):
        table.add(f"n{i}", capacity, int(masks[i]), partition=0)
    # About 60 % of nodes are (nearly) full, the rest have random room.
    busy = rng.random(nodes) < 0.6
    free = table.free.copy()
    free[0] = np.where(busy, rng.integers(0, 250, nodes), rng.integers(0, 4001, nodes))
    free[1] = np.where(busy, rng.integers(0, 256, nodes), rng.integers(0, 16385, nodes))
    table.set_free(np.arange(nodes), free)
    return table


def random_task(i: int, num_constraints: int, rng: np.random.Generator) -> TaskSpec:
    k = int(rng.choice(4, p=[0.45, 0.30, 0.17, 0.08]))
    wanted = rng.choice(num_constraints, size=k, replace=False)
    mask = int(sum(1 << int(c) for c in wanted))
    request = resources(
        cpu_milli=int(rng.choice([250, 500, 1000, 2000])),
        memory_mb=int(rng.choice([512, 1024, 2048, 4096])),
    )
    return TaskSpec(task_id=f"t{i}", resources=request, constraint_mask=mask)


def bench_match(
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    num_constraints: int = DEFAULT_NUM_CONSTRAINTS,
    samples: int = 2000,
    policy_name: str = "first-fit",
    seed: int = 7,
) -> list[MatchResult]:
    rng = np.random.default_rng(seed)
    policy = make_policy(policy_name)
    results = []
    for n in sizes:
        table = build_partition(n, num_constraints, rng)
        within = table.members[0]
        tasks = [random_task(i, num_constraints, rng) for i in range(samples)]
        for task in tasks[:50]:  # warm caches and numpy dispatch
            match(table, task, policy, within)
        times = np.empty(samples)
        hits = 0
        clock = time.perf_counter_ns
        for i, task in enumerate(tasks):
            t0 = clock()
            node = match(table, task, policy, within)
            times[i] = clock() - t0
            hits += node != NO_NODE
        huge = TaskSpec(task_id="huge", resources=resources(cpu_milli=10**6, memory_mb=1))
        miss = np.empty(200)
        for i in range(miss.size):
            t0 = clock()
            match(table, huge, policy, within)
            miss[i] = clock() - t0
        results.append(
            MatchResult(
                nodes=n,
                constraints=num_constraints,
                policy=policy.name,
                samples=samples,
                p50_us=round(float(np.percentile(times, 50)) / 1e3, 2),
                p99_us=round(float(np.percentile(times, 99)) / 1e3, 2),
                hit_rate=round(hits / samples, 3),
                miss_p50_us=round(float(np.percentile(miss, 50)) / 1e3, 2),
            )
        )
    return results


def render_match(results: list[MatchResult], as_json: bool) -> str:
    if as_json:
        return json.dumps([asdict(r) for r in results], indent=2)
    head = f"{'nodes':>8} {'constr':>6} {'policy':>10} {'p50 us':>8} {'p99 us':>8} "
    head += f"{'hit rate':>8} {'miss p50 us':>11}"
    rows = [head]
    for r in results:
        rows.append(
            f"{r.nodes:>8} {r.constraints:>6} {r.policy:>10} {r.p50_us:>8.1f} {r.p99_us:>8.1f} "
            f"{r.hit_rate:>8.2f} {r.miss_p50_us:>11.1f}"
        )
    return "\n".join(rows)
