"""What the LM's journal of ended tasks costs: writing endings, the file's size, and how
long a restarted LM takes to read it back (the LM serves nothing until it has).

    python scripts/journal_bench.py --endings 1000000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from services._proto.megha.v1 import common_pb2
from services.core.cluster_state import ENDED_KEPT, ClusterState
from services.local_master.journal import EndingsJournal
from services.local_master.service import ENDINGS_KEPT


def _event(i: int, now: int) -> common_pb2.TaskEvent:
    job = f"replay-1732412345-{i // 100}"
    event = common_pb2.TaskEvent(
        task_id=f"{job}.{i % 100}",
        job_id=job,
        queue="research",
        state=common_pb2.TASK_STATE_SUCCEEDED,
        lm_id="lm-1",
        node_id=f"lm-1-w{i % 64}",
    )
    for field in event.timestamps.DESCRIPTOR.fields:  # every stamp set, as on a real end
        setattr(event.timestamps, field.name, now)
    return event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endings", type=int, default=ENDED_KEPT, help="endings to write")
    parser.add_argument("--batch", type=int, default=200, help="endings per append (one flush)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "lm.journal"
        journal = EndingsJournal(path, ENDED_KEPT, ENDINGS_KEPT)
        now = time.time_ns()
        events = [_event(i, now) for i in range(args.endings)]
        began = time.perf_counter()
        for start in range(0, len(events), args.batch):
            journal.append(events[start : start + args.batch])
        wrote = time.perf_counter() - began
        journal.close()
        size = sum(p.stat().st_size for p in Path(directory).iterdir())
        began = time.perf_counter()
        attempts, kept = EndingsJournal(path, ENDED_KEPT, ENDINGS_KEPT).load()
        read = time.perf_counter() - began
        books = ClusterState("lm-1", ["gm-1"])  # what LocalMaster._recall does next
        began = time.perf_counter()
        for task_id, attempt in attempts:
            books.remember_ended(task_id, attempt)
        booked = time.perf_counter() - began
    print(f"{args.endings:,} endings in batches of {args.batch}")
    print(f"  append: {wrote / args.endings * 1e6:.1f} us per ending ({wrote:.1f} s)")
    print(f"  on disk: {size / 1e6:.0f} MB")
    print(f"  read back: {read:.2f} s ({len(attempts):,} attempts, {len(kept):,} whole events)")
    print(f"  booked as ended: {booked:.2f} s (a restarted LM serves after both)")


if __name__ == "__main__":
    main()
