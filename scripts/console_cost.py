"""What an open console costs a GM: ``megha-loadgen bench-live`` without a console, then
with one open on the jobs page, alternating, in one sitting (docs/console.md).

    python scripts/console_cost.py [--rate 200] [--seconds 20] [--rounds 2] [--json]

"With": once the benchmark has written its ``federation.yaml``, the console starts on it
(in this process) and a poller asks ``/jobs?fragment=1`` every 2 s, exactly what
``console.js`` does on an open jobs page (a browser itself would compete for this
machine's cores, where an operator's does not). Prints, per run, the
GMs' CPU (% of a core, ms per task), the allocation-time p50/p99 and the polls answered.
Needs RabbitMQ, as bench-live does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.config import load_config  # noqa: E402
from services.console.server import bind, running_console  # noqa: E402

POLL_S = 2.0  # services/console/server.py REFRESH_S


class JobsPageOpen:
    """The console on the federation in ``log_dir`` (in this process, on a thread of its
    own: a ``megha console`` process, starting while the federation loads two cores,
    took longer to import than the benchmark lasts) and a poller of its jobs page, from
    when the federation's file is written until ``stop``."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.polls = self.failed = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        path = self.log_dir / "federation.yaml"
        while not path.exists() and not self._stop.is_set():
            await asyncio.sleep(0.1)
        if self._stop.is_set():
            return
        async with running_console(load_config(str(path)), bind("127.0.0.1", 0)) as base:
            url = base + "jobs?fragment=1"
            while not self._stop.is_set():
                await asyncio.sleep(POLL_S)
                try:
                    await asyncio.to_thread(_get, url)
                    self.polls += 1
                except OSError:
                    self.failed += 1

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


def _get(url: str) -> None:
    with urllib.request.urlopen(url, timeout=10) as reply:
        reply.read()


def bench(rate: float, seconds: float, with_console: bool) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="console-cost-"))
    page = JobsPageOpen(log_dir) if with_console else None
    try:
        with open(log_dir / "bench.out", "w") as out:
            done = subprocess.run(
                [sys.executable, "-m", "loadgen.cli", "bench-live", "--rate", str(rate),
                 "--seconds", str(seconds), "--log-dir", str(log_dir), "--out",
                 str(log_dir / "report")],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        if done.returncode not in (0, 1):  # 1: ran, but not every task completed once
            raise RuntimeError(f"bench-live could not run; see {log_dir / 'bench.out'}")
    finally:
        if page is not None:
            page.stop()
    s = json.loads((log_dir / "report" / "summary.json").read_text())
    cpu = s["cpu"]
    gms = sorted(n for n in cpu["percent_of_core"] if n.startswith("gm"))
    return {
        "console": with_console,
        "bench_exit": done.returncode,
        "log_dir": str(log_dir),
        "completed": s["completed"],
        "tasks": s["tasks"],
        "alloc_p50_ms": round(1e3 * s["alloc_s"]["p50"], 2),
        "alloc_p99_ms": round(1e3 * s["alloc_s"]["p99"], 2),
        "gm_percent_of_core": {n: cpu["percent_of_core"][n] for n in gms},
        "gm_ms_per_task": {n: cpu["ms_per_task"][n] for n in gms},
        "other_cores": cpu.get("other_cores"),
        "polls": page.polls if page else 0,
        "failed_polls": page.failed if page else 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (without, with)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = []
    for _ in range(args.rounds):
        for with_console in (False, True):
            runs.append(bench(args.rate, args.seconds, with_console))
            if not args.json:
                r = runs[-1]
                print(
                    f"{'with console' if r['console'] else 'no console  '}  "
                    f"completed {r['completed']}/{r['tasks']}  alloc p50 {r['alloc_p50_ms']} ms "
                    f"p99 {r['alloc_p99_ms']} ms  GM % of a core {r['gm_percent_of_core']}  "
                    f"GM ms/task {r['gm_ms_per_task']}  polls {r['polls']} "
                    f"(failed {r['failed_polls']})  rest of host {r['other_cores']}",
                    flush=True,
                )
    if args.json:
        print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
