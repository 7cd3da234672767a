"""``megha-loadgen chaos-sim``: the deterministic fault-injection simulation (issue 27).

    --seed N ──▶ one run (loadgen/chaos), its violations; --verbose: its event trace
    --seeds K ──▶ seeds 0..K-1 over --jobs processes, a progress bar ──▶ summary: runs,
        violations by kind, failing seeds, wall time

Exit 0 when every run kept every promise, 1 when any broke one (replay a failing seed
with ``--seed N --verbose``), 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

from loadgen.chaos.world import FAULT_KINDS, SMALL, ChaosConfig, Result, run_seed
from services.common.argtypes import bounded, non_negative_int, positive_int
from services.common.progress import Progress, bar

unit_interval = bounded(float, "unit_interval", 0, high=1)


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "chaos-sim",
        help="deterministic fault-injection simulation of the real protocol",
        description=(
            "Run GMs (the core Scheduler), LMs (Lifecycle over ClusterState), workers and "
            "a broker on a virtual clock; one seed decides every message delay, loss and "
            "late read, every crash, restart, pause and broker restart. After each run the "
            "promises are checked: every acknowledged task ends, no attempt starts twice, "
            "no two attempts of a task run at once, no node is over-committed, every ended "
            "task's resources are released. Exit 0: no violation; 1: some; 2: bad input."
        ),
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        help="run this one seed (replays it exactly); with --seeds, the first of them",
    )
    parser.add_argument("--seeds", type=positive_int, help="run seeds 0..K-1")
    parser.add_argument(
        "--first", type=non_negative_int, default=None, help="with --seeds: start here"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print the event trace of a failing --seed"
    )
    parser.add_argument(
        "--small", action="store_true", help="CI's smaller federation (2 GMs x 2 LMs x 2)"
    )
    parser.add_argument(
        "--faults",
        default="",
        help=f"comma-separated fault kinds to draw (default all): {', '.join(FAULT_KINDS)}",
    )
    parser.add_argument(
        "--calm-streams",
        action="store_true",
        help="worker streams never take the slow path (no kill reaches its worker late)",
    )
    parser.add_argument(
        "--calm-broker",
        action="store_true",
        help="messages to and from the broker never take the slow path",
    )
    parser.add_argument(
        "--failover",
        action="store_true",
        help="queue failover: every GM consumes every queue (single active consumer), "
        "so a GM's crash hands its queues to the other",
    )
    parser.add_argument(
        "--lose-journal",
        type=unit_interval,
        default=0.0,
        metavar="P",
        help="an LM crash also loses its journal with this chance (outside the promise)",
    )
    parser.add_argument(
        "--bursts",
        type=unit_interval,
        default=0.0,
        metavar="P",
        help="a job comes with the one before it (same instant and queue) with this "
        "chance, so GMs publish several jobs as one queue message (default 0: none)",
    )
    parser.add_argument(
        "--jobs", type=positive_int, default=os.cpu_count() or 1, help="worker processes"
    )
    return parser


def config(args: argparse.Namespace) -> ChaosConfig:
    cfg = SMALL if args.small else ChaosConfig()
    kinds = frozenset(k.strip() for k in args.faults.split(",") if k.strip())
    unknown = kinds - set(FAULT_KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}")
    if not 0.0 <= args.lose_journal <= 1.0:
        raise ValueError("--lose-journal is a chance, between 0 and 1")
    return dataclasses.replace(
        cfg,
        fault_kinds=kinds,
        slow_streams=not args.calm_streams,
        slow_broker=not args.calm_broker,
        lose_journal_p=args.lose_journal,
        failover=args.failover,
        bursts=args.bursts,
    )


def main(args: argparse.Namespace) -> int:
    try:
        cfg = config(args)
    except ValueError as err:
        print(f"megha-loadgen: {err}", file=sys.stderr)
        return 2
    if args.seeds is None:
        seed = 0 if args.seed is None else args.seed
        result = run_seed(seed, cfg, trace=args.verbose)
        print(describe(result))
        if args.verbose and not result.ok:
            print("\n".join(result.trace))
        return 0 if result.ok else 1
    if args.seed is not None and args.first is not None:
        print(
            "megha-loadgen: --seed and --first both name the first seed: give one", file=sys.stderr
        )
        return 2
    first = args.seed if args.seed is not None else (args.first or 0)
    return many(range(first, first + args.seeds), cfg, args.jobs)


def describe(result: Result) -> str:
    head = (
        f"seed {result.seed}: {result.tasks} tasks, {result.attempts} attempts started, "
        f"{result.preemptions} preempted, {len(result.faults)} faults, "
        f"settled at {result.ended_at_s:.0f} s virtual, {result.events} events: "
    )
    if result.ok:
        return head + "every promise kept"
    lines = [head + f"{len(result.violations)} violations"]
    lines += [f"  {v}" for v in result.violations[:20]]
    if len(result.violations) > 20:
        lines.append(f"  ... and {len(result.violations) - 20} more")
    lines += [f"  fault: {f}" for f in result.faults]
    return "\n".join(lines)


def _one(job: tuple[int, ChaosConfig]) -> tuple[int, list[str], int]:
    """A seed's run: its violations' kinds, and how many it found."""
    seed, cfg = job
    result = run_seed(seed, cfg)
    return seed, sorted({v.kind for v in result.violations}), len(result.violations)


def many(seeds: range, cfg: ChaosConfig, jobs: int) -> int:
    began = time.monotonic()
    kinds: Counter[str] = Counter()
    failing: list[tuple[int, list[str]]] = []
    progress = Progress()
    done = violations = 0

    def line() -> str:
        rate = done / max(time.monotonic() - began, 1e-9)
        return (
            f"chaos-sim {bar(done / len(seeds))} {done}/{len(seeds)} seeds, "
            f"{len(failing)} failing, {rate:.1f} seeds/s"
        )

    work = ((seed, cfg) for seed in seeds)
    with ProcessPoolExecutor(jobs) as pool:
        for seed, found, count in pool.map(_one, work, chunksize=8):
            done += 1
            violations += count
            if found:
                failing.append((seed, found))
                kinds.update(found)
            progress.show(line)
    progress.done()
    wall = time.monotonic() - began
    print(f"runs: {len(seeds)} ({len(seeds) / wall:.1f} seeds/s, wall {wall:.1f} s)")
    print(f"failing runs: {len(failing)}; violations: {violations}")
    for kind, count in kinds.most_common():
        print(f"  {kind}: {count} runs")
    if failing:
        shown = ", ".join(str(seed) for seed, _ in failing[:50])
        more = f" ... (+{len(failing) - 50})" if len(failing) > 50 else ""
        print(f"failing seeds: {shown}{more}")
        print("replay one: megha-loadgen chaos-sim --seed N --verbose")
    return 1 if failing else 0
