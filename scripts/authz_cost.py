"""What identities, mutual TLS, authorization and the audit log cost (docs/security.md):
``megha-loadgen bench-live`` plain, then ``--secure``, alternating, in one sitting.

    python scripts/authz_cost.py [--rate 200] [--seconds 20] [--rounds 3] [--json]

Prints each run's allocation time p50/p99, the CPU per task summed over every process
(ms), and at the end the medians of each mode and their ratios. Needs RabbitMQ, as
bench-live does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(rate: float, seconds: float, secure: bool) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="authz-cost-"))
    argv = [sys.executable, "-m", "loadgen.cli", "bench-live", "--rate", str(rate)]
    argv += ["--seconds", str(seconds), "--log-dir", str(log_dir), "--out", str(log_dir / "r")]
    with open(log_dir / "bench.out", "w") as out:
        done = subprocess.run(
            argv + ["--secure"] * secure, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        raise RuntimeError(f"bench-live exited {done.returncode}; see {log_dir / 'bench.out'}")
    s = json.loads((log_dir / "r" / "summary.json").read_text())
    per_task = s["cpu"]["ms_per_task"]
    audited = sum(1 for p in log_dir.glob("audit-*.log") for _ in p.open())
    return {
        "secure": secure,
        "completed": s["completed"],
        "tasks": s["tasks"],
        "p50_ms": round(1e3 * s["alloc_s"]["p50"], 2),
        "p99_ms": round(1e3 * s["alloc_s"]["p99"], 2),
        "cpu_ms_per_task": round(sum(per_task.values()), 2),
        "audit_lines": audited,
        "log_dir": str(log_dir),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs (plain, secure)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = []
    for _ in range(args.rounds):
        for secure in (False, True):
            runs.append(run(args.rate, args.seconds, secure))
            r = runs[-1]
            if not args.json:
                print(
                    f"{'secure' if secure else 'plain '}  completed {r['completed']}/{r['tasks']}"
                    f"  p50 {r['p50_ms']} ms  p99 {r['p99_ms']} ms  CPU {r['cpu_ms_per_task']} "
                    f"ms/task  audit lines {r['audit_lines']}",
                    flush=True,
                )
    medians = {}
    for secure in (False, True):
        mine = [r for r in runs if r["secure"] == secure]
        medians["secure" if secure else "plain"] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("p50_ms", "p99_ms", "cpu_ms_per_task")
        }
    ratios = {k: round(medians["secure"][k] / medians["plain"][k], 2) for k in medians["plain"]}
    if args.json:
        print(json.dumps({"runs": runs, "medians": medians, "secure_over_plain": ratios}))
    else:
        print(f"medians {medians}\nsecure / plain {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
