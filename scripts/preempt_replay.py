"""The two-queue preemption replay of issue 27, run again and again: does any task stay
stuck, or run twice?

Each run starts a federation (``megha up``: 2 GMs, 3 LMs, 8 nodes of 4 CPUs each, two
queues, one per GM, of a quarter and three quarters of the pool: the replay gives jobs
to both in turn, so the bigger one stays under its share and preempts the other),
replays the first ``--max-jobs`` jobs of a trace against it, and reads the replay's
``summary.json``: tasks acknowledged and not completed are stuck (the replay waits for
them until its timeout), ``duplicates`` are tasks that succeeded twice.

    python scripts/preempt_replay.py --runs 20 --max-jobs 200 --speedup 1000 --out /tmp/pr

Prints a line per run and a total; writes ``runs.json`` in ``--out``. Exit 1 when any
run had a stuck or twice-run task.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO.parent / "shared" / "traces" / "yahoo_YH1_sub.tr"


def federation(base_port: int) -> dict:
    port = iter(range(base_port, base_port + 50))
    return {
        "gms": [{"id": f"gm-{i}", "port": next(port)} for i in (1, 2)],
        "lms": [{"id": f"lm-{i}", "port": next(port)} for i in (1, 2, 3)],
        "workers": [{"lm": f"lm-{i}", "count": 8, "capacity": "cpu=4,mem=8Gi"} for i in (1, 2, 3)],
        "queues": [
            {"name": "research", "share": 0.25, "gm": "gm-1"},
            {"name": "prod", "share": 0.75, "gm": "gm-2"},
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--max-jobs", type=int, default=200)
    parser.add_argument("--speedup", type=float, default=1000.0)
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--out", default="/tmp/megha-preempt-replay")
    parser.add_argument("--base-port", type=int, default=53000)
    parser.add_argument(
        "--replay-timeout",
        type=float,
        default=1200,
        help="seconds a replay waits for its last task (the trace overloads the pool)",
    )
    parser.add_argument("--run-timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for run in range(1, args.runs + 1):
        run_dir = out / f"run-{run}"
        run_dir.mkdir(exist_ok=True)
        config = run_dir / "federation.yaml"
        config.write_text(yaml.safe_dump(federation(args.base_port)))
        began = time.monotonic()
        command = [
            sys.executable, "-m", "services.cli", "up", "--config", str(config),
            "--log-dir", str(run_dir / "logs"), "--replay", args.trace,
            "--max-jobs", str(args.max_jobs), "--speedup", str(args.speedup),
            "--out", str(run_dir / "report"), "--timeout", str(args.replay_timeout),
        ]  # fmt: skip
        with open(run_dir / "up.log", "wb") as log:
            try:
                code = subprocess.run(
                    command, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout
                ).returncode
            except subprocess.TimeoutExpired:
                code = -1
        summary_path = run_dir / "report" / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        accepted = summary.get("accepted", 0)
        result = {
            "run": run,
            "exit": code,
            "tasks": summary.get("tasks", 0),
            "accepted": accepted,
            "completed": summary.get("completed", 0),
            "stuck": accepted - summary.get("completed", 0) - summary.get("failed", 0),
            "duplicates": summary.get("duplicates", 0),
            "preemptions": summary.get("preemptions", 0),
            "wall_s": round(time.monotonic() - began, 1),
        }
        results.append(result)
        print(json.dumps(result), flush=True)
        (out / "runs.json").write_text(json.dumps(results, indent=2))
    stuck_runs = sum(r["stuck"] > 0 or not r["accepted"] for r in results)
    twice = sum(r["duplicates"] for r in results)
    print(
        f"{len(results)} runs: {stuck_runs} with stuck tasks "
        f"({sum(r['stuck'] for r in results)} tasks), {twice} tasks run twice"
    )
    return 1 if stuck_runs or twice else 0


if __name__ == "__main__":
    sys.exit(main())
