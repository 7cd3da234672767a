"""What keeping a GM's parked work in queued order costs: one ``UserQueues.unpark``.

    python scripts/unpark_bench.py [--parked 1000,10000] [--rounds 50]

A live GM parks each waiting task as one item and unparks them all on every change of
its view. For P parked items and one newer ready item it times ``unpark`` with the age
order the scheduler gives its queues (``attrgetter("enqueued")``: a merge by queued
time, issue 29) and without (insertion order, before). Medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from operator import attrgetter

from services.core.user_queues import UserQueues


@dataclass(eq=False)
class Item:
    enqueued: float


def unpark_ms(parked: int, rounds: int, ordered: bool) -> float:
    queues: UserQueues[Item] = UserQueues(["q"], age=attrgetter("enqueued") if ordered else None)
    items = [Item(float(i)) for i in range(parked)]
    times = []
    for _ in range(rounds):
        for item in items:
            queues.park("q", item)
        queues.push("q", Item(float(parked)))
        began = time.perf_counter()
        queues.unpark()
        times.append(time.perf_counter() - began)
        queues.pop_round(parked + 1)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parked", default="1000,10000", help="parked items, comma-separated")
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    for parked in (int(p) for p in args.parked.split(",")):
        if parked < 1:
            parser.error("--parked sizes must be at least 1")
        plain = unpark_ms(parked, args.rounds, ordered=False)
        ordered = unpark_ms(parked, args.rounds, ordered=True)
        print(
            f"{parked:>7,} parked: unpark {plain:.3f} ms in insertion order, "
            f"{ordered:.3f} ms in queued order ({ordered / plain:.2f}x)"
        )


if __name__ == "__main__":
    main()
