"""What holding process tasks to their memory request costs a worker host
(``services/worker/memwatch.py``): one look, a pass over ``/proc`` that sums the resident
memory of every watched process group, with ``--groups`` groups of ``--per-group``
sleeping processes each running beside whatever the machine already runs.

    python scripts/memwatch_bench.py --groups 24 --per-group 4 --looks 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from services.worker.memwatch import resident


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=24, help="process tasks running")
    parser.add_argument("--per-group", type=int, default=4, help="processes in each")
    parser.add_argument("--looks", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    script = " ".join(["sleep 600 &"] * (args.per_group - 1) + ["exec sleep 600"])
    leaders = [
        subprocess.Popen(["sh", "-c", script], start_new_session=True) for _ in range(args.groups)
    ]
    try:
        time.sleep(0.5)  # every group complete
        groups = [leader.pid for leader in leaders]
        times = []
        for _ in range(args.looks):
            began = time.perf_counter()
            resident(groups)
            times.append((time.perf_counter() - began) * 1e3)
        processes = sum(1 for name in os.listdir("/proc") if name.isdigit())
    finally:
        for leader in leaders:
            os.killpg(leader.pid, 9)
            leader.wait()
    times.sort()
    out = {
        "groups": args.groups,
        "processes_on_host": processes,
        "ms_per_look_p50": round(times[len(times) // 2], 3),
        "ms_per_look_p99": round(times[int(len(times) * 0.99)], 3),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"one look over {processes} processes for {args.groups} groups: "
        f"p50 {out['ms_per_look_p50']} ms, p99 {out['ms_per_look_p99']} ms"
    )


if __name__ == "__main__":
    main()
