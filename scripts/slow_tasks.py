"""The slow tasks of a bench-live or replay run, grouped into episodes: which jobs, when,
and in which step of the way (``report.DETAIL_STEPS``) they lost their time.

    python scripts/slow_tasks.py OUT/tasks.csv              # tasks over 50 ms
    python scripts/slow_tasks.py OUT/tasks.csv --over-ms 25

An episode is a second of the run (counted from the first submission) in which slow tasks
were submitted. For each: how many slow tasks, of which jobs and GMs, how many were a
later attempt, and the median of each step over its slow first attempts.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict

from loadgen.report import DETAIL_STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tasks_csv")
    parser.add_argument("--over-ms", type=float, default=50.0)
    args = parser.parse_args()

    first_ns = None
    slow: list[dict[str, str]] = []
    total = 0
    with open(args.tasks_csv, newline="") as handle:
        for row in csv.DictReader(handle):
            if not row["alloc_s"]:
                continue
            total += 1
            submitted = int(row["submitted_unix_nanos"])
            first_ns = submitted if first_ns is None else min(first_ns, submitted)
            if float(row["alloc_s"]) * 1000 > args.over_ms:
                slow.append(row)
    print(f"{len(slow)} of {total:,} allocated tasks over {args.over_ms:g} ms")
    if not slow or first_ns is None:
        return
    episodes: dict[int, list[dict[str, str]]] = defaultdict(list)
    for row in slow:
        episodes[(int(row["submitted_unix_nanos"]) - first_ns) // 10**9].append(row)
    for second, rows in sorted(episodes.items()):
        jobs = sorted({r["job_id"] for r in rows})
        gms = sorted({r["gm"] for r in rows})
        retried = sum(1 for r in rows if r["attempt"] not in ("", "0"))
        worst = max(float(r["alloc_s"]) for r in rows) * 1000
        print(
            f"at {second:>6,} s: {len(rows):>4} tasks of {len(jobs)} jobs "
            f"({', '.join(jobs[:4])}{', ...' if len(jobs) > 4 else ''}; {', '.join(gms)}), "
            f"{retried} later attempts, worst {worst:.1f} ms"
        )
        firsts = [r for r in rows if r["attempt"] in ("", "0")]
        medians = []
        for name, begin, end in DETAIL_STEPS:
            spans = [
                (int(r[f"{end}_unix_nanos"]) - int(r[f"{begin}_unix_nanos"])) / 1e6
                for r in firsts
                if r[f"{begin}_unix_nanos"] not in ("", "0")
                and r[f"{end}_unix_nanos"] not in ("", "0")
            ]
            if spans:
                medians.append(f"{name} {statistics.median(spans):.1f}")
        if medians:
            print(f"           median ms of its first attempts: {'  '.join(medians)}")


if __name__ == "__main__":
    main()
