"""What an LM's book of ended attempts costs as it fills to its bound and turns over: the
slowest single insert (and where), time per insert and per lookup, memory per entry and
how long a full garbage collection of the process takes with it. Memory per entry
counts the task id's string, which the book holds.

    python scripts/ended_bench.py                       # 2,300,000 endings, bound 1,000,000
    python scripts/ended_bench.py --endings 500000 --json

Uses only ClusterState's public calls (``remember_ended``, ``known_attempt``), so the same
script measures an older checkout: ``PYTHONPATH=path/to/old python scripts/ended_bench.py``.
"""

from __future__ import annotations

import argparse
import gc
import time

from _measure import emit, full_collection_ms, rss_kb

from services.core.cluster_state import ENDED_KEPT, ClusterState

STALL_S = 0.005  # inserts slower than this are listed with their position


def task_name(n: int) -> str:
    return f"job-{n // 50:08d}.{n % 50}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endings", type=int, default=2_300_000)
    parser.add_argument("--bound", type=int, default=ENDED_KEPT)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    gc.collect()
    gc.freeze()  # what was there before the book is not counted in the collections below
    rss_before = rss_kb()
    state = ClusterState("lm-1", ("gm-1",), ended_kept=args.bound)
    stalls: list[tuple[int, float]] = []
    clock = time.perf_counter
    spent = 0.0
    rss_series: list[tuple[int, float]] = []  # (endings so far, MB above the start)
    for n in range(args.endings):
        if n % 100_000 == 0:
            rss_series.append((n, round((rss_kb() - rss_before) / 1024, 1)))
        task_id = task_name(n)  # a new string, as a task id parsed from a request is
        start = clock()
        state.remember_ended(task_id, 0)
        took = clock() - start
        spent += took
        if took > STALL_S:
            stalls.append((n, round(1000 * took, 1)))
    gc.collect()
    rss_after = rss_kb()
    rss_series.append((args.endings, round((rss_after - rss_before) / 1024, 1)))
    kept = min(args.endings, args.bound)

    unknown = [f"new-{i}" for i in range(200_000)]
    began = clock()
    for task_id in unknown:
        state.known_attempt(task_id)
    miss_us = 1e6 * (clock() - began) / len(unknown)
    recent = [task_name(n) for n in range(max(0, args.endings - 200_000), args.endings)]
    began = clock()
    for task_id in recent:
        state.known_attempt(task_id)
    hit_us = 1e6 * (clock() - began) / len(recent)

    out = {
        "endings": args.endings,
        "bound": args.bound,
        "us_per_insert": round(1e6 * spent / args.endings, 3),
        "slowest_insert_ms": max((ms for _, ms in stalls), default=0.0),
        "inserts_over_5ms": stalls,
        "us_per_lookup_unknown": round(miss_us, 3),
        "us_per_lookup_recent": round(hit_us, 3),
        "kb_per_entry": round((rss_after - rss_before) / kept, 3),
        "mb_every_100000": rss_series,
        "full_collection_ms": full_collection_ms(),
    }
    emit(out, args.json)


if __name__ == "__main__":
    main()
